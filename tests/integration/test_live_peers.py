"""The presets against the peers' own code, run under ``jax.jit``.

``tests/test_presets.py`` checks each preset against ``tests/peers.py``, numpy
transcriptions of the peers' rules. This module runs the real
implementations instead, compiled as they run in training, and steps them
next to the jls preset over the same random sequences of finite and
non-finite steps:

* jmp: ``jmp.DynamicLossScale.adjust`` in a ``lax.scan`` under ``jit``,
  against `jls.presets.jmp`.
* flax: ``flax.training.dynamic_scale.DynamicScale.value_and_grad`` on a
  tiny loss whose gradients are finite or not as the sequence says, against
  `jls.presets.flax`.
* Keras 3 (JAX backend): ``keras.optimizers.LossScaleOptimizer`` around
  ``SGD``, stepped with ``stateless_apply`` as Keras's JAX trainer does,
  against `jls.presets.keras`. Keras is imported only in a subprocess
  (``KERAS_BACKEND=jax``, warnings as errors), which runs this module's
  ``__main__``, so the test process never imports it.

Scales are compared bitwise (their float32 bits) and the growth counters
exactly, after every step. Where a peer's arithmetic or a known fault makes
it differ from jls, a test measures the difference and asserts the exact
values of both sides, so each test fails if either side changes:

* jmp divides by ``factor`` in its code, but XLA rewrites ``x / 3`` into
  ``x * 0.33333334`` (the rounded reciprocal), so under ``jit`` jmp's
  back-off by a factor that is not a power of two is one float32 ulp off
  the exact quotient for some scales; jls divides exactly.
* jmp's ``tree_flatten`` drops ``min_loss_scale``: once a ``DynamicLossScale``
  crosses a ``jit`` or ``scan`` boundary its floor is 1.0.
* jmp's growth is guarded (``first_finite``): it never reaches inf.
* flax with ``minimum_scale=None`` backs off to 0.0, where every later step
  is non-finite (``0 / 0``); jls stops at 2**-126.
* Keras checks the scaled gradients, so below scale 1 it applies steps
  whose unscaled gradients overflow; its scale reaches inf (after which
  every step is skipped) or 0.0 (after which every step applies nan).

For speed the compiled steppers are cached: one per peer configuration that
the peer keeps static, with the initial scale and count passed as data. On
the jls side the initial state is the example's own ``preset(...).init()``
and the step rule is the same preset with its two initial-state fields
normalised (`LossScaler.adjust` does not read them), so one compilation
serves every initial scale.
"""

# The peers' and numpy's types are loose; values are checked at run time.
# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale
from hypothesis import event, example, given
from hypothesis import strategies as st
from jax import lax

import jls

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
STEPS = 40  # steps per random sequence (a fixed length: one compilation)
LR = 0.5  # the SGD learning rate of the Keras runs
ROOT = pathlib.Path(__file__).resolve().parents[2]

# A step is a gradient coefficient: 1.0 (finite gradients) or inf, -inf, nan.
# Four in seven finite, so that growth intervals of a few steps complete.
_COEFFICIENTS = np.array([1.0, 1.0, 1.0, 1.0, np.inf, -np.inf, np.nan], np.float32)
_steps = st.lists(
    st.integers(0, len(_COEFFICIENTS) - 1), min_size=STEPS, max_size=STEPS
).map(lambda codes: _COEFFICIENTS[np.asarray(codes)])


# Explicit examples run on every test run whatever hypothesis draws: runs
# that hold at the floor and at the float32 maximum.
_ALL_FINITE = np.ones(STEPS, np.float32)
_MIXED = np.resize(np.float32([np.inf, 1.0, 1.0, np.nan, -np.inf, 1.0]), STEPS)


def _bits(x: Any) -> np.ndarray:
    """float32 values as their bit patterns, for bitwise comparison."""
    return np.asarray(x, np.float32).view(np.uint32)


def _floats(bits: Any) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _assert_same_scales(actual: Any, expected: Any) -> None:
    np.testing.assert_array_equal(_bits(actual), _bits(expected))


def _events(initial: float, finite: Any, scales: Any, counts: Any) -> None:
    """Labels what a run exercised (see ``--hypothesis-show-statistics``)."""
    before = np.concatenate([[np.float32(initial)], scales[:-1]])
    held = scales == before
    event(f"grew: {bool((scales > before).any())}")
    event(f"held at the floor: {bool((~finite & held).any())}")
    top = finite & (counts == 0) & held & (scales >= 2.0**125)
    event(f"growth stopped at the top: {bool(top.any())}")


# jls -----------------------------------------------------------------------


def _rule(scaler: jls.LossScaler) -> jls.LossScaler:
    """The scaler with its initial-state fields normalised: its step rule."""
    return dataclasses.replace(
        scaler, init_scale=scaler.max_scale, init_growth_count=scaler.growth_restart
    )


@functools.cache
def _jls_stepper(rule: jls.LossScaler) -> Any:
    @jax.jit
    def run(state: jls.LossScaleState, finite: jax.Array) -> Any:
        def step(state, finite):
            state = rule.adjust(state, finite)
            return state, (state.scale, state.growth_count)

        return lax.scan(step, state, finite)[1]

    return run


def _jls_trajectory(scaler: jls.LossScaler, finite: Any) -> tuple[Any, Any]:
    """``scaler``'s scale and growth count after each step, under ``jit``."""
    scales, counts = _jls_stepper(_rule(scaler))(scaler.init(), jnp.asarray(finite))
    return np.asarray(scales), np.asarray(counts)


# jmp -----------------------------------------------------------------------


@functools.cache
def _jmp_stepper(period: int, factor: int, min_loss_scale: float = 1.0) -> Any:
    @jax.jit
    def run(loss_scale: jax.Array, counter: jax.Array, finite: jax.Array) -> Any:
        scale = jmp.DynamicLossScale(
            loss_scale, counter, period, factor, jnp.float32(min_loss_scale)
        )

        def step(scale, finite):
            scale = scale.adjust(finite)
            return scale, (scale.loss_scale, scale.counter)

        return lax.scan(step, scale, finite)[1]

    return run


def _jmp_trajectory(
    loss_scale: float,
    finite: Any,
    counter: int = 0,
    period: int = 2000,
    factor: int = 2,
    min_loss_scale: float = 1.0,
) -> tuple[Any, Any]:
    run = _jmp_stepper(period, factor, min_loss_scale)
    scales, counters = run(
        jnp.float32(loss_scale), jnp.int32(counter), jnp.asarray(finite)
    )
    return np.asarray(scales), np.asarray(counters)


@st.composite
def _jmp_case(draw):
    period = draw(st.sampled_from([1, 2, 3, 5]))
    return dict(
        # min_loss_scale is jmp's default, 1.0: jmp loses any other value under
        # jit (test_jmp_loses_min_loss_scale_under_jit).
        loss_scale=draw(
            st.sampled_from(
                [1.0, 3.0, 1000.0, 2.0**15, 2.0**100, 2.0**126, 2.0**127, F32_MAX / 4]
            )
        ),
        counter=draw(st.integers(0, period - 1)),
        period=period,
        factor=draw(st.sampled_from([2, 4])),  # powers of two: exact either way
    )


@given(_jmp_case(), _steps)
@example(dict(loss_scale=3.0, counter=0, period=2, factor=4), _MIXED)
@example(dict(loss_scale=F32_MAX / 4, counter=0, period=1, factor=4), _ALL_FINITE)
@example(dict(loss_scale=2.0**127, counter=1, period=2, factor=2), _ALL_FINITE)
def test_jmp_matches_jls_bitwise(case, coefficients):
    finite = np.isfinite(coefficients)
    jmp_scales, jmp_counters = _jmp_trajectory(finite=finite, **case)
    scales, counts = _jls_trajectory(jls.presets.jmp(**case), finite)
    _assert_same_scales(scales, jmp_scales)
    np.testing.assert_array_equal(counts, jmp_counters)
    _events(case["loss_scale"], finite, scales, counts)


def test_jmp_backoff_by_three_is_a_multiplication_under_jit():
    # jmp writes loss_scale / factor; XLA compiles it to loss_scale * (1/3)
    # rounded, 0.33333334 = 0x3eaaaaab. From 2**15 the second back-off is the
    # first where the two roundings differ: by one ulp.
    finite = np.zeros(3, bool)
    jmp_scales, _ = _jmp_trajectory(2.0**15, finite, factor=3)
    scales, _ = _jls_trajectory(jls.presets.jmp(2.0**15, factor=3), finite)
    np.testing.assert_array_equal(
        _bits(jmp_scales), [0x462AAAAB, 0x45638E3A, 0x4497B427]
    )
    np.testing.assert_array_equal(_bits(scales), [0x462AAAAB, 0x45638E39, 0x4497B426])
    ulps = _bits(jmp_scales).astype(np.int64) - _bits(scales).astype(np.int64)
    np.testing.assert_array_equal(ulps, [0, 1, 1])
    assert jmp_scales[1] == np.float32(3640.8892)
    assert scales[1] == np.float32(3640.889)
    # jls's are the correctly rounded quotients, jmp's the products by 1/3.
    third, three = np.float32(1 / 3), np.float32(3)
    assert _bits(third) == 0x3EAAAAAB
    quotients, products = [np.float32(2.0**15)], [np.float32(2.0**15)]
    for _ in range(3):
        quotients.append(quotients[-1] / three)
        products.append(products[-1] * third)
    _assert_same_scales(scales, quotients[1:])
    _assert_same_scales(jmp_scales, products[1:])
    # From 5, the first back-off already differs.
    jmp_scales, _ = _jmp_trajectory(5.0, finite[:1], factor=3)
    scales, _ = _jls_trajectory(jls.presets.jmp(5.0, factor=3), finite[:1])
    np.testing.assert_array_equal(_bits(jmp_scales), [0x3FD55556])  # 1.6666667
    np.testing.assert_array_equal(_bits(scales), [0x3FD55555])  # 1.6666666


def test_jmp_loses_min_loss_scale_under_jit():
    # Passed through jit (or carried by scan), a DynamicLossScale is rebuilt
    # from tree_flatten's (loss_scale, counter): min_loss_scale becomes 1.0.
    scale = jmp.DynamicLossScale(
        jnp.float32(8.0), min_loss_scale=jnp.float32(8.0), period=2000
    )
    nonfinite = jnp.asarray(False)
    through = jax.jit(lambda s, f: s.adjust(f).loss_scale)(scale, nonfinite)
    closed_over = jax.jit(lambda f: scale.adjust(f).loss_scale)(nonfinite)
    assert float(through) == 4.0  # the floor of 8 is gone
    assert float(closed_over) == 8.0  # not crossing the boundary, it holds

    # Over a run: a floor above 1 is lowered to 1, one below 1 raised to 1.
    finite = np.zeros(6, bool)
    jmp_scales, _ = _jmp_trajectory(64.0, finite, min_loss_scale=8.0)
    scales, _ = _jls_trajectory(jls.presets.jmp(64.0, min_loss_scale=8.0), finite)
    np.testing.assert_array_equal(jmp_scales, [32, 16, 8, 4, 2, 1])
    np.testing.assert_array_equal(scales, [32, 16, 8, 8, 8, 8])
    jmp_scales, _ = _jmp_trajectory(4.0, finite, min_loss_scale=2.0**-3)
    scales, _ = _jls_trajectory(jls.presets.jmp(4.0, min_loss_scale=2.0**-3), finite)
    np.testing.assert_array_equal(jmp_scales, [2, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(scales, [2, 1, 0.5, 0.25, 0.125, 0.125])


def test_jmp_growth_is_guarded():
    # jmp's adjust keeps the old scale when the grown one is not finite
    # (first_finite), as jls's max_scale does: neither reaches inf.
    finite = np.array([True, True, False, True])
    for factor in (2, 3):
        jmp_scales, _ = _jmp_trajectory(2.0**127, finite, period=1, factor=factor)
        scales, _ = _jls_trajectory(
            jls.presets.jmp(2.0**127, period=1, factor=factor), finite
        )
        expected = [2.0**127, 2.0**127, 2.0**127 / factor, 2.0**127]
        np.testing.assert_array_equal(jmp_scales, np.float32(expected))
        np.testing.assert_array_equal(scales, np.float32(expected))


# flax ----------------------------------------------------------------------


def _flax_loss(params: jax.Array, coefficient: jax.Array) -> jax.Array:
    """A loss whose gradient is ``coefficient``: finite or not at will."""
    return jnp.sum(params * coefficient)


@functools.cache
def _flax_stepper(
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    minimum_scale: float | None,
) -> Any:
    @jax.jit
    def run(scale: jax.Array, fin_steps: jax.Array, coefficients: jax.Array) -> Any:
        dynamic_scale = DynamicScale(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            fin_steps=fin_steps,
            scale=scale,
            minimum_scale=minimum_scale,
        )

        def step(dynamic_scale, coefficient):
            grad_fn = dynamic_scale.value_and_grad(_flax_loss)
            dynamic_scale, is_fin, _, _ = grad_fn(jnp.ones(2, jnp.float32), coefficient)
            return dynamic_scale, (
                dynamic_scale.scale,
                dynamic_scale.fin_steps,
                is_fin,
            )

        return lax.scan(step, dynamic_scale, coefficients)[1]

    return run


def _flax_trajectory(
    coefficients: Any,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    fin_steps: int = 0,
    scale: float = 65536.0,
    minimum_scale: float | None = F32_TINY,
) -> tuple[Any, Any, Any]:
    run = _flax_stepper(growth_factor, backoff_factor, growth_interval, minimum_scale)
    scales, fin_steps_after, is_fin = run(
        jnp.float32(scale), jnp.int32(fin_steps), jnp.asarray(coefficients)
    )
    return np.asarray(scales), np.asarray(fin_steps_after), np.asarray(is_fin)


_FLAX_RULES = [
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=0),
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    dict(growth_factor=1.5, backoff_factor=0.75, growth_interval=1, minimum_scale=1.0),
    dict(
        growth_factor=3.0,
        backoff_factor=1 / 3,
        growth_interval=2,
        minimum_scale=2.0**-10,
    ),
]


@st.composite
def _flax_case(draw):
    rule = draw(st.sampled_from(_FLAX_RULES))
    minimum = rule.get("minimum_scale", F32_TINY)
    # The floor itself, a few scales above it, and some near the top.
    inits = [2.0**-8, 3.0, 2.0**15, 2.0**127, F32_MAX / 2, F32_MAX]
    return dict(
        rule,
        scale=draw(st.sampled_from([minimum, *(x for x in inits if x > minimum)])),
        fin_steps=draw(st.integers(0, rule["growth_interval"])),
    )


@given(_flax_case(), _steps)
@example(dict(_FLAX_RULES[0], scale=F32_TINY, fin_steps=0), _MIXED)
@example(dict(_FLAX_RULES[2], scale=1.0, fin_steps=1), _MIXED)
@example(dict(_FLAX_RULES[3], scale=2.0**-10, fin_steps=0), _MIXED[::-1].copy())
@example(dict(_FLAX_RULES[3], scale=F32_MAX / 2, fin_steps=2), _ALL_FINITE)
@example(dict(_FLAX_RULES[1], scale=F32_MAX, fin_steps=3), _MIXED)
def test_flax_matches_jls_bitwise(case, coefficients):
    flax_scales, fin_steps, is_fin = _flax_trajectory(coefficients, **case)
    finite = np.isfinite(coefficients)
    np.testing.assert_array_equal(is_fin, finite)
    scales, counts = _jls_trajectory(jls.presets.flax(**case), finite)
    _assert_same_scales(scales, flax_scales)
    np.testing.assert_array_equal(counts, fin_steps)
    _events(case["scale"], finite, scales, counts)


def test_flax_without_minimum_scale_dies_at_zero():
    # 30 back-offs from 2**-120 pass 2**-149, the smallest subnormal, whether
    # or not XLA flushes subnormals. At 0 flax's gradients are 0 / 0 = nan,
    # so every later step is non-finite and the scale stays 0.
    coefficients = np.array([np.inf] * 30 + [1.0] * 5, np.float32)
    flax_scales, fin_steps, is_fin = _flax_trajectory(
        coefficients, scale=2.0**-120, growth_interval=0, minimum_scale=None
    )
    halvings = np.float32(2.0 ** np.arange(-121, -127, -1))  # 2**-121 .. 2**-126
    np.testing.assert_array_equal(flax_scales[:6], halvings)
    np.testing.assert_array_equal(_bits(flax_scales[29:]), 0)
    np.testing.assert_array_equal(is_fin, False)
    np.testing.assert_array_equal(fin_steps, 0)

    scaler = jls.presets.flax(scale=2.0**-120, growth_interval=0, minimum_scale=None)
    scales, _ = _jls_trajectory(scaler, np.isfinite(coefficients))
    grown = np.float32(2.0 ** np.arange(-125, -120))  # 2**-125 .. 2**-121
    expected = np.concatenate([halvings, np.float32([F32_TINY] * 24), grown])
    np.testing.assert_array_equal(_bits(scales), _bits(expected))


# Keras ---------------------------------------------------------------------
#
# Each Keras step is a loss sum(params * a) * b with params starting at 0:
# the scaled gradient is (scale * b) * a, the forward loss 0.


def _keras_cases() -> list[dict[str, Any]]:
    """Seeded random cases (one subprocess runs them all)."""
    rng = np.random.default_rng(20240611)
    cases = []
    for growth_steps in (1, 2, 3, 5):
        for initial_scale in (2.0**-20, 0.75, 1.0, 3.0, 1000.0, 2.0**15, 2.0**24):
            codes = rng.integers(0, len(_COEFFICIENTS), STEPS)
            cases.append(
                dict(
                    initial_scale=initial_scale,
                    dynamic_growth_steps=growth_steps,
                    a=_COEFFICIENTS[codes],
                    b=np.ones(STEPS, np.float32),
                )
            )
    return cases


def _keras_scenarios() -> dict[str, dict[str, Any]]:
    """Where Keras breaks and jls does not."""
    one, inf = np.float32(1.0), np.float32(np.inf)
    return {
        # Scaled gradient 2**-10 * 2**65 * 2**65 = 2**120 is finite; unscaled,
        # 2**130 overflows.
        "below_one": dict(
            initial_scale=2.0**-10,
            dynamic_growth_steps=2000,
            a=np.float32([2.0**65, 1.0]),
            b=np.float32([2.0**65, 1.0]),
        ),
        "to_inf": dict(
            initial_scale=2.0**127,
            dynamic_growth_steps=1,
            a=np.array([one, one, inf, one]),
            b=np.array([one] * 4),
        ),
        "to_zero": dict(
            initial_scale=2.0**-126,
            dynamic_growth_steps=2000,
            a=np.array([inf] * 24 + [one, one]),
            b=np.array([one] * 26),
        ),
    }


def _encode(case: dict[str, Any]) -> dict[str, Any]:
    return dict(case, a=_bits(case["a"]).tolist(), b=_bits(case["b"]).tolist())


def _keras_main(request_path: str, result_path: str) -> None:
    """The subprocess: runs each case through Keras, writes the trajectories."""
    import keras  # only here, with KERAS_BACKEND=jax set by the caller

    assert keras.backend.backend() == "jax"
    request = json.loads(pathlib.Path(request_path).read_text())
    steppers: dict[int, Any] = {}

    def make_stepper(optimizer: Any) -> Any:
        # One compiled step per dynamic_growth_steps: the initial scale is
        # in the optimizer variables, which are data.
        index = {id(v): i for i, v in enumerate(optimizer.variables)}
        scale_at = index[id(optimizer.dynamic_scale)]
        counter_at = index[id(optimizer.step_counter)]

        @jax.jit
        def run(variables, params, a, b):
            def step(carry, ab):
                variables, params = carry

                def loss(params):
                    unscaled = jnp.sum(params * ab[0]) * ab[1]
                    # As Keras's JAX trainer scales the loss.
                    mapping = list(zip(optimizer.variables, variables, strict=True))
                    with keras.StatelessScope(state_mapping=mapping):
                        return optimizer.scale_loss(unscaled)

                grads = jax.grad(loss)(params)
                (params,), variables = optimizer.stateless_apply(
                    variables, [grads], [params]
                )
                out = (variables[scale_at], variables[counter_at], params)
                return (variables, params), out

            return lax.scan(step, (variables, params), (a, b))[1]

        return run

    def run_case(case: dict[str, Any]) -> dict[str, Any]:
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(learning_rate=LR),
            initial_scale=case["initial_scale"],
            dynamic_growth_steps=case["dynamic_growth_steps"],
        )
        params = keras.Variable(np.zeros(2, np.float32))
        optimizer.build([params])
        if case["dynamic_growth_steps"] not in steppers:
            steppers[case["dynamic_growth_steps"]] = make_stepper(optimizer)
        run = steppers[case["dynamic_growth_steps"]]
        variables = [v.value for v in optimizer.variables]
        scales, counters, params = run(
            variables, params.value, _floats(case["a"]), _floats(case["b"])
        )
        return dict(
            scale=_bits(scales).tolist(),
            step_counter=np.asarray(counters).tolist(),
            params=_bits(params).tolist(),
        )

    result = dict(
        version=keras.__version__,
        cases=[run_case(c) for c in request["cases"]],
        scenarios={k: run_case(c) for k, c in request["scenarios"].items()},
    )
    pathlib.Path(result_path).write_text(json.dumps(result))


def _keras_results(tmp_dir: pathlib.Path) -> dict[str, Any]:
    request = dict(
        cases=[_encode(c) for c in _keras_cases()],
        scenarios={k: _encode(c) for k, c in _keras_scenarios().items()},
    )
    request_path, result_path = tmp_dir / "request.json", tmp_dir / "result.json"
    request_path.write_text(json.dumps(request))
    env = dict(os.environ, KERAS_BACKEND="jax")
    command = [sys.executable, "-W", "error", str(pathlib.Path(__file__))]
    done = subprocess.run(
        [*command, str(request_path), str(result_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    result = json.loads(result_path.read_text())
    for run in [*result["cases"], *result["scenarios"].values()]:
        run["scale"] = _floats(run["scale"])
        run["params"] = _floats(run["params"])
    return result


@functools.cache
def _keras_runs() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return _keras_results(pathlib.Path(tmp))


def test_keras_matches_jls_bitwise():
    assert _keras_runs()["version"].startswith("3.")  # Keras 3, as measured
    runs = _keras_runs()["cases"]
    cases = _keras_cases()
    assert len(runs) == len(cases) == 28
    for case, run in zip(cases, runs, strict=True):
        finite = np.isfinite(case["a"])
        scaler = jls.presets.keras(
            initial_scale=case["initial_scale"],
            dynamic_growth_steps=case["dynamic_growth_steps"],
        )
        scales, counts = _jls_trajectory(scaler, finite)
        _assert_same_scales(scales, run["scale"])
        np.testing.assert_array_equal(counts, run["step_counter"])
        # Keras applied exactly the finite steps (each moves params by -LR).
        applied = np.cumsum(finite).astype(np.float32)
        expected = np.repeat(-LR * applied[:, None], 2, axis=1)
        np.testing.assert_array_equal(run["params"], expected)


def _jls_sgd(case: dict[str, Any]) -> dict[str, Any]:
    """The jls side of a Keras scenario: the same loss and SGD, under ``jit``."""
    scaler = jls.presets.keras(
        initial_scale=case["initial_scale"],
        dynamic_growth_steps=case["dynamic_growth_steps"],
    )
    tx = jls.loss_scaling(optax.sgd(LR), scaler)

    @jax.jit
    def run(params, a, b):
        def step(carry, ab):
            state, params = carry

            def loss(params):
                return jls.scale_loss(jnp.sum(params * ab[0]) * ab[1], state)

            updates, state = tx.update(jax.grad(loss)(params), state, params)
            params = optax.apply_updates(params, updates)
            metrics = jls.metrics(state)
            return (state, params), (metrics["loss_scale"], metrics["skipped"], params)

        params = jnp.zeros(2, jnp.float32)
        return lax.scan(step, (tx.init(params), params), (a, b))[1]

    scales, skipped, params = run(
        jnp.zeros(2, jnp.float32), jnp.asarray(case["a"]), jnp.asarray(case["b"])
    )
    return dict(
        scale=np.asarray(scales), skipped=np.asarray(skipped), params=np.asarray(params)
    )


def test_keras_applies_overflowing_gradients_below_scale_one():
    keras_run = _keras_runs()["scenarios"]["below_one"]
    ours = _jls_sgd(_keras_scenarios()["below_one"])
    # Keras: the scaled gradient 2**120 passes its check; divided by 2**-10
    # it is inf, and SGD writes -inf into the parameters. Then a finite step
    # applies as usual (-inf stays -inf).
    np.testing.assert_array_equal(keras_run["scale"], np.float32([2.0**-10] * 2))
    np.testing.assert_array_equal(keras_run["step_counter"], [1, 2])
    np.testing.assert_array_equal(keras_run["params"], np.float32([[-np.inf] * 2] * 2))
    # jls checks the unscaled gradient: the step is skipped, the scale backs
    # off, and the next step applies.
    np.testing.assert_array_equal(ours["scale"], np.float32([2.0**-11] * 2))
    np.testing.assert_array_equal(ours["skipped"], [True, False])
    np.testing.assert_array_equal(ours["params"], np.float32([[0, 0], [-LR, -LR]]))


def test_keras_scale_grows_to_inf():
    keras_run = _keras_runs()["scenarios"]["to_inf"]
    ours = _jls_sgd(_keras_scenarios()["to_inf"])
    # Keras doubles 2**127 to inf; the scaled gradients are then inf, so
    # every later step is skipped and halving inf keeps it inf.
    np.testing.assert_array_equal(keras_run["scale"], np.float32([np.inf] * 4))
    np.testing.assert_array_equal(keras_run["params"], np.float32([[-LR] * 2] * 4))
    # jls skips a growth past the float32 maximum and keeps training.
    expected = np.float32([2.0**127, 2.0**127, 2.0**126, 2.0**127])
    np.testing.assert_array_equal(ours["scale"], expected)
    np.testing.assert_array_equal(ours["skipped"], [False, False, True, False])
    np.testing.assert_array_equal(
        ours["params"], np.float32([[-0.5] * 2, [-1.0] * 2, [-1.0] * 2, [-1.5] * 2])
    )


def test_keras_scale_backs_off_to_zero_then_applies_nan():
    keras_run = _keras_runs()["scenarios"]["to_zero"]
    ours = _jls_sgd(_keras_scenarios()["to_zero"])
    # 24 halvings from 2**-126 pass the smallest subnormal (flushed or not),
    # so Keras's scale is 0; the scaled gradients are then 0, which passes its
    # check, and 0 / 0 = nan is applied.
    np.testing.assert_array_equal(_bits(keras_run["scale"][23:]), 0)
    np.testing.assert_array_equal(keras_run["step_counter"][-2:], [1, 2])
    np.testing.assert_array_equal(keras_run["params"][:24], 0.0)
    assert np.isnan(keras_run["params"][24:]).all()
    # jls stops at 2**-126 and applies the finite steps.
    np.testing.assert_array_equal(ours["scale"], np.float32(F32_TINY))
    np.testing.assert_array_equal(ours["skipped"], [True] * 24 + [False] * 2)
    np.testing.assert_array_equal(
        ours["params"][-2:], np.float32([[-0.5] * 2, [-1] * 2])
    )


if __name__ == "__main__":
    _keras_main(sys.argv[1], sys.argv[2])
