"""Three real-code examples, in the style of their frameworks, truly in float16.

Each trains briefly in float16 with jls and in float32, compares the losses,
and asserts with `jls.precision.precision_report` that every matmul of the float16
train step (forward and backward) computes in float16.
"""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportCallIssue=false, reportIndexIssue=false

import pathlib
import runpy
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jls

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


def _example(name: str) -> dict:
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=name)


def test_equinox_gru_trains_in_float16():
    gru = _example("equinox_gru")
    f32, f16 = gru["main"](["--steps", "120"])
    assert f32["final_loss"] < 0.35 and f16["final_loss"] < 0.35  # chance: 0.69
    assert abs(f16["final_loss"] - f32["final_loss"]) < 0.2
    xs, ys = gru["make_data"](0, 16, 24)
    model = gru["GRUClassifier"](16, jax.random.key(0))
    tx = jls.loss_scaling(optax.adam(1e-2))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    step = gru["make_step"]("float16", tx)
    report = jls.precision.precision_report(step, model, opt_state, xs, ys)
    report.check(jnp.float16)
    assert sum(report.counts.values()) >= 6  # the GRU's and the head's, both ways
    # A float32 carry (jnp.zeros without a dtype) would have promoted them.
    f32_step = gru["make_step"]("float32", tx)
    assert (
        "float16"
        not in jls.precision.precision_report(f32_step, model, opt_state, xs, ys).counts
    )


def test_nnx_batchnorm_and_dropout_train_in_float16():
    ex = _example("nnx_batchnorm")
    f32, f16 = ex["main"](["--steps", "120"])
    assert f16["eval_loss"] < 0.2 and f32["eval_loss"] < 0.2
    assert abs(f16["eval_loss"] - f32["eval_loss"]) < 0.02
    assert f16["steps_applied"] == 120 - f16["skipped"]
    model, optimizer = ex["build"](jnp.float16, 0)
    x, y = ex["make_data"](0)
    ex["train_step"](model, optimizer, x, y)
    report = jls.precision.precision_report(ex["train_step"], model, optimizer, x, y)
    report.check(jnp.float16)
    # The state the forward pass updates lands on the caller's model: the
    # running statistics move, and Dropout draws a new mask each step.
    before = jnp.copy(model.bn.mean[...])
    ex["train_step"](model, optimizer, x, y)
    assert not np.array_equal(model.bn.mean[...], before)
    assert model.bn.mean[...].dtype == jnp.float32  # statistics stay float32
    first, second = model(x[:4]), model(x[:4])
    assert not np.array_equal(first, second)


def test_linen_seq2seq_under_scan_trains_in_float16():
    ex = _example("linen_seq2seq")
    f32, f16 = ex["main"](["--steps", "150"])
    assert f32["accuracy"] > 0.9 and f16["accuracy"] > 0.9
    assert abs(f16["final_loss"] - f32["final_loss"]) < 0.1
    state = ex["build"](jnp.float16, 0)
    tokens, targets = ex["make_data"](0, 8, 6)
    report = jls.precision.precision_report(ex["train_step"], state, tokens, targets)
    report.check(jnp.float16)
    assert sum(report.counts.values()) >= 10  # two LSTMs under scan, a head


@pytest.mark.parametrize("name", ["equinox_gru", "nnx_batchnorm", "linen_seq2seq"])
def test_help_shows_the_defaults(name):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "(default:" in out.stdout


def test_the_policy_refuses_what_would_lose_nnx_state():
    ex = _example("nnx_batchnorm")
    model, _ = ex["build"](jnp.float32, 0)
    policy = jls.precision.get_policy("params=float32,compute=float16,output=float32")
    with pytest.raises(TypeError, match="dtype=jnp.float16"):
        policy.cast_arguments(lambda m, x: m(x))(model, jnp.ones((2, 8)))
    assert isinstance(model, nnx.Module)
    # policy.wrap runs on the Module's state and writes it back.
    before = jnp.copy(model.bn.mean[...])
    policy.wrap(lambda m, x: m(x))(model, jnp.ones((2, 8)))
    assert not np.array_equal(model.bn.mean[...], before)
