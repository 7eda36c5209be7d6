"""`explain_step`: the scale it reads, what its report says, and where it runs.

The planted overflows it must name are in ``tests/test_explain_faults.py``.
"""

import dataclasses
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls

F16, F32 = jnp.float16, jnp.float32


def _loss(params, x):
    with jax.named_scope("head"):
        h = x @ params["w"]  # overflows float16 once |x| * |w| * 4 > 65504
    return jnp.sum(h.astype(F32))


def _params(w=1.0):
    return {"w": jnp.full((4, 2), w, F16)}


def test_the_scale_is_the_states_as_jls_metrics_reads_it():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(init_scale=2.0**12))
    x = jnp.ones((3, 4), F16)
    for state in (
        tx.init(_params()),
        jls.loss_scale_state(tx.init(_params())),
        2.0**12,
    ):
        report = jls.precision.explain_step(_loss, state, _params(), x)
        assert report.scale == 2.0**12 and report.loss == 24.0


def test_a_real_skipped_step_is_explained_with_the_state_it_ran_with():
    # The step's backward overflows in float16: 2**15 * 4 per entry of the
    # cotangent of x @ w's weight gradient.
    tx = jls.loss_scaling(optax.sgd(0.1))
    params, x = _params(), jnp.full((3, 4), 4.0, F16)
    before = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x), opt_state))(params)
        return jls.apply_gradients(tx, grads, opt_state, params)

    new_params, after = step(params, before)
    assert bool(jls.metrics(after)["skipped"])
    chex.assert_trees_all_equal(new_params, params)
    report = jls.precision.explain_step(_loss, before, params, x)
    first = report.first
    assert not report.grads_finite and first is not None, str(report)
    assert (first.pass_, first.primitive, first.dtype) == (
        "backward",
        "dot_general",
        "float16",
    )
    assert "head" in first.layer and first.where.startswith("test_explain.py:")
    assert first.inputs == "float16[3,2], float16[3,4]"
    assert (first.in_max, first.out_max) == (2.0**15, np.inf)


def test_the_report_reads_as_text_and_markdown():
    report = jls.precision.explain_step(
        _loss, 2.0**15, _params(), jnp.full((3, 4), 4.0, F16)
    )
    text = str(report)
    assert text.splitlines()[0] == (
        "step at loss scale 32768: loss 96, gradients NOT finite (the step is skipped)"
    )
    assert "backward dot_general -> float16 at test_explain.py:" in text
    assert (
        "least headroom" in text and report._repr_markdown_() == f"```text\n{text}\n```"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.scale = 1.0  # type: ignore[misc]


def test_arguments_already_not_finite_are_named_and_no_op_blamed():
    params = {"w": jnp.full((4, 2), 1.0, F16).at[0, 0].set(jnp.nan)}
    report = jls.precision.explain_step(_loss, 1.0, params, jnp.ones((3, 4), F16))
    assert report.nonfinite_args == ("args[0]['w']",) and report.first is None
    assert "args[0]['w']" in str(report)


def test_keywords_aux_and_argnums():
    def loss(x, params, *, bias):
        return _loss(params, x) + bias, {"aux": 1}

    x = jnp.full((3, 4), 4.0, F16)
    report = jls.precision.explain_step(
        loss, 2.0**15, x, _params(), argnums=1, has_aux=True, bias=jnp.float32(1)
    )
    assert report.first is not None and report.first.pass_ == "backward"
    # Not differentiated: nothing overflows without the weights' gradient.
    report = jls.precision.explain_step(
        loss, 2.0**15, x, _params(), argnums=(), has_aux=True, bias=jnp.float32(1)
    )
    assert report.first is None and report.grads_finite


def test_a_flush_to_zero_is_reported_beside():
    def loss(w):
        return jnp.sum((w * 1e-5).astype(F16).astype(F32))  # 1e-8 flushes in float16

    report = jls.precision.explain_step(loss, 1.0, jnp.full(4, 1e-3, F32))
    assert report.first is None and report.first_flush is not None
    flush = report.first_flush
    assert (flush.pass_, flush.primitive, flush.flushed) == (
        "forward",
        "convert_element_type",
        4,
    )
    assert "first underflow: forward convert_element_type" in str(report)


def _on_two_devices(code: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh Python on two CPU devices."""
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, **env},
    )


def test_sharded_arrays_under_jit():
    code = """
import jax, jax.numpy as jnp, numpy as np, jls
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("data",))
def loss(w, x):
    with jax.named_scope("proj"):
        h = x @ w
    return jnp.sum(h.astype(jnp.float32))
w = jax.device_put(jnp.full((4, 2), 1.0, jnp.float16), NamedSharding(mesh, P()))
x = jax.device_put(jnp.full((8, 4), 4.0, jnp.float16), NamedSharding(mesh, P("data")))
r = jls.precision.explain_step(loss, 2.0**15, w, x)
print(r.first.pass_, r.first.primitive, r.first.layer.split()[0], r.first.out_max)
"""
    run = _on_two_devices(code)
    assert run.stdout.split() == ["backward", "dot_general", "proj", "inf"], run.stderr[
        -2000:
    ]


def test_values_on_several_devices_are_measured_each_alone():
    # One reduction of two values sharded differently would gather them: on
    # several devices each value is measured alone, and nothing is gathered.
    code = """
import re, jax, jax.numpy as jnp, jls
from jax.sharding import NamedSharding, PartitionSpec as P
from jls.precision import _explain, _observe
mesh = jax.sharding.Mesh(jax.devices()[:2], ("data",))  # Auto: sharding not in types
a = jax.device_put(jnp.ones((8, 8), jnp.float16), NamedSharding(mesh, P("data")))
b = jax.device_put(jnp.ones((8, 8), jnp.float16), NamedSharding(mesh, P(None, "data")))
f32 = jnp.float32
loss = lambda a, b: jnp.sum(jnp.tanh(a * 2).astype(f32)) + jnp.sum(jnp.tanh(b * 3))
together, observe, tops = [], _explain.observe, _explain.tops
def spy(closed, arrays, grouped):
    together.append(grouped)
    return observe(closed, arrays, grouped)
def spy_tops(xs, grouped):  # the gradients' and the arguments' measures
    together.append(grouped)
    return tops(xs, grouped)
_explain.observe, _explain.tops = spy, spy_tops
jls.precision.explain_step(loss, 1.0, a, b)
one = jnp.ones((8, 8), jnp.float16)
jls.precision.explain_step(loss, 1.0, one, one)
closed = jax.make_jaxpr(loss)(a, b)
for grouped in (False, True):
    run = jax.jit(lambda a, b: observe(closed, [a, b], grouped)[2])
    text = run.lower(a, b).compile().as_text()
    together.append(len(re.findall(r" (all-gather|all-to-all)(-start)?\\(", text)))
print(*together)
"""
    run = _on_two_devices(code)
    out = run.stdout.split()
    assert out[:5] == ["False", "False", "True", "True", "0"], run.stderr[-2000:]
    assert int(out[5]) > 0  # what measuring them together costs


def test_nothing_is_loaded_until_asked():
    code = (
        "import sys, jls, optax\n"
        "jls.loss_scaling(optax.sgd(0.1)).init({})\n"
        "print('jls.precision._explain' in sys.modules)\n"
        "jls.precision.explain_step\n"
        "print('jls.precision._explain' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.stdout.split() == ["False", "True"], run.stderr[-2000:]


def test_the_example_scripts_report_is_the_one_the_page_shows():
    # docs/howto/why_skip.md includes the stored report and reads it out:
    # the first op's line and operands, the table's first headroom.
    import pathlib
    import re
    import runpy

    root = pathlib.Path(__file__).parents[1]
    script = runpy.run_path(str(root / "examples" / "why_skip.py"))
    stored = (root / "docs" / "howto" / "why_skip_report.txt").read_text()
    assert script["explain"]() == stored.rstrip("\n")
    page = (root / "docs" / "howto" / "why_skip.md").read_text()
    assert "{literalinclude} why_skip_report.txt" in page
    line = re.search(r"backward dot_general -> float16 at (why_skip.py:\d+)", stored)
    operand = re.search(r"in: .*max\|x\| (\d+)", stored)
    headroom = re.search(r"^ +([\d.]+x) +backward", stored, re.M)
    assert line and operand and headroom, stored
    for shown in (line[1], operand[1], headroom[1]):
        assert shown in page, shown


def test_the_pages_cost_figures_are_the_stored_benchmarks():
    # docs/howto/why_skip.md quotes benchmarks/results/cpu/bench_explain.txt.
    import pathlib
    import re

    root = pathlib.Path(__file__).parents[1]
    stored = (root / "benchmarks" / "results" / "cpu" / "bench_explain.txt").read_text()
    page = " ".join((root / "docs" / "howto" / "why_skip.md").read_text().split())
    rows = re.findall(r"(\d+) ops observed\n.*?; ([\d.]+x) \(medians of (\d+)", stored)
    assert len(rows) == 4, stored
    for ops, ratio, _ in rows:
        assert f"{ratio} " in page and f"({ops} ops" in page, (ops, ratio)
    assert f"medians of {rows[0][2]} fresh calls" in page


def test_an_fp8_value_is_measured():
    loss = lambda w: jnp.sum(w.astype(jnp.float8_e4m3fn).astype(jnp.float32) * 2)  # noqa: E731
    w = jnp.array([300.0, 420.0])  # 420 rounds to 416; 500 would be nan
    report = jls.precision.explain_step(loss, 1.0, w)
    cast = next(op for op in report.least_headroom if op.dtype == "float8_e4m3fn")
    assert cast.out_max == 416.0 and report.grads_finite and report.first is None


def test_a_bfloat16_value_is_measured_as_bfloat16_holds_it():
    # The product's float32 value is 9.0e8; bfloat16 holds 897581056: an op
    # computed wider is rounded as the step rounds it (no excess precision).
    b = jnp.array([-3e4, 1.0], jnp.bfloat16)
    report = jls.precision.explain_step(lambda b: jnp.sum(b * b), 1.0, b)
    mul = next(op for op in report.least_headroom if op.primitive == "mul")
    assert mul.out_max == float((b * b)[0]) == 897581056.0


def test_finite_float64_values_past_float32s_range_are_finite():
    with jax.enable_x64(True):
        w, x = jnp.ones(3), jnp.array([1e300, 1.0])
        loss = lambda w, x: jnp.sum(w * 1e39) + jnp.sum(x) * 1e-300  # noqa: E731
        report = jls.precision.explain_step(loss, 1.0, w, x)
    assert report.grads_finite and report.nonfinite_args == () and report.first is None


@pytest.mark.parametrize(
    ("fn", "quick"),
    [
        (lambda c: jax.lax.scan(lambda c, _: (c * 2, None), c, length=100)[0], True),
        (lambda c: jax.lax.scan(lambda c, _: (c * 2, None), c, length=6000)[0], False),
        (lambda c: jax.lax.while_loop(lambda c: c[0] < 9, lambda c: c * 2, c), False),
    ],
)
def test_a_long_loop_is_compiled_at_the_normal_level(fn, quick):
    # A loop's run outweighs its compile: the quick (level 0) compile is for
    # programs whose loops are short; values are always as their dtype holds them.
    from jls.precision._explain import _QUICK, _eqns, _options

    options = _options(_eqns(jax.make_jaxpr(fn)(jnp.ones(2))))
    assert options["xla_allow_excess_precision"] is False
    backend = _QUICK.get(jax.default_backend(), {})
    assert (backend.items() <= options.items()) == quick or not backend
