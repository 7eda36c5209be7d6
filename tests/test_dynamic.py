"""The dynamic rule: the peers' public vectors and a reference state machine."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import F32_MAX, RefScaler
from rule_runs import _run

import jls

VECTORS = json.loads(
    (pathlib.Path(__file__).parent / "data" / "public_peer_tests.json").read_text()
)["cases"]


# DeepSpeed's first growth after window + 1 steps needs the first-growth knob
# of the presets issue; every other public case is the dynamic rule itself.
RULE_CASES = [c for c in VECTORS if not c["name"].startswith("deepspeed")]


TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def _scaler_for(config):
    return jls.dynamic_scale(
        config["init_scale"],
        growth_factor=config["growth_factor"],
        backoff_factor=config["backoff_factor"],
        growth_interval=config["growth_interval"],
        backoff_interval=config.get("backoff_interval", 1),
        # Peers without a floor (torch, Keras) get the smallest normal float32.
        min_scale=config.get("min_scale", TINY),
        max_scale=float(F32_MAX),  # nor a ceiling
    )


configs = st.fixed_dictionaries(
    {
        "init_scale": st.sampled_from(
            [1.0, 2.0**-20, 3.0, 2.0**15, 65536.0, 2.0**126, float(F32_MAX) / 4]
        ),
        "growth_factor": st.sampled_from([1.0, 1.5, 2.0, 3.0, 1000.0]),
        "backoff_factor": st.sampled_from([1.0, 0.5, 0.8, 1 / 3, 1e-3]),
        "growth_interval": st.integers(1, 6),
        "first_extra": st.sampled_from([0, 0, 1, 3]),
        "saturate": st.booleans(),
        "divide": st.booleans(),
        "rule": st.sampled_from(["plain", "paddle", "hysteresis", "consecutive"]),
        "n": st.integers(2, 4),
        "min_scale": st.sampled_from([TINY, 2.0**-24, 2.0**-20, 1.0]),
        "max_scale": st.sampled_from([float(F32_MAX), 2.0**126, 2.0**24]),
    }
)


def _both(cfg):
    extra = {}
    if cfg["rule"] == "paddle":
        extra["backoff_interval"] = cfg["n"]
    elif cfg["rule"] in ("hysteresis", "consecutive"):
        extra["hysteresis"] = cfg["n"]
        extra["consecutive_hysteresis"] = cfg["rule"] == "consecutive"
    init = min(max(cfg["init_scale"], cfg["min_scale"]), cfg["max_scale"])
    if cfg["divide"]:
        extra["backoff_divisor"] = 1 / cfg["backoff_factor"]
    else:
        extra["backoff_factor"] = cfg["backoff_factor"]
    kw = dict(
        growth_factor=cfg["growth_factor"],
        growth_interval=cfg["growth_interval"],
        first_growth_interval=cfg["growth_interval"] + cfg["first_extra"],
        saturate_growth=cfg["saturate"],
        min_scale=cfg["min_scale"],
        max_scale=cfg["max_scale"],
        **extra,
    )
    return jls.dynamic_scale(init, **kw), RefScaler(init_scale=init, **kw)


def test_rule_cases_cover_the_vectors():
    assert {c["name"] for c in VECTORS} - {c["name"] for c in RULE_CASES} == {
        "deepspeed_fp16_window",
        "deepspeed_fp16_overflow",
    }


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c["name"])
def test_public_vectors(case):
    scaler = _scaler_for(case["config"])
    counts = case["config"].get("initial_counts", {})
    state = scaler.init()._replace(
        growth_count=jnp.int32(counts.get("good_steps", 0)),
        backoff_count=jnp.int32(counts.get("bad_steps", 0)),
    )
    runs = [(case["finite"], case["scale_after"])]
    if "alt" in case:
        runs.append((case["alt"]["finite"], case["alt"]["scale_after"]))
    for finite, expected in runs:
        states = _run(scaler, finite, state)
        got = [np.float32(s.scale) for s in states]
        np.testing.assert_array_equal(got, np.float32(expected))
    if "growth_count_after" in case:
        got = [int(s.growth_count) for s in _run(scaler, case["finite"], state)]
        assert got == case["growth_count_after"]


def test_paddle_vector_counts_restart():
    case = next(c for c in VECTORS if c["name"] == "paddle_update_loss_scaling_op")
    scaler = _scaler_for(case["config"])
    state = scaler.init()._replace(
        growth_count=jnp.int32(999), backoff_count=jnp.int32(1)
    )
    for finite in (True, False):
        (after,) = _run(scaler, [finite], state)
        assert int(after.growth_count) == 0 and int(after.backoff_count) == 0


@given(cfg=configs, finite=st.lists(st.booleans(), min_size=1, max_size=300))
def test_adjust_matches_reference_model(cfg, finite):
    scaler, ref = _both(cfg)

    # One jitted scan over the whole sequence: also proves scan-compatibility.
    def body(state, f):
        state = scaler.adjust(state, f)
        return state, state

    _, states = jax.jit(lambda s, fs: jax.lax.scan(body, s, fs))(
        scaler.init(), jnp.asarray(finite)
    )
    for i, f in enumerate(finite):
        ref.step(f)
        assert np.float32(states.scale[i]) == ref.scale, (i, cfg)
        assert int(states.growth_count[i]) == ref.growth_count
        assert int(states.consecutive_skips[i]) == ref.consecutive
        assert int(states.total_skips[i]) == ref.total
    scales = np.asarray(states.scale)
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    assert np.all(scales >= np.float32(scaler.min_scale))
    assert np.all(scales <= np.float32(scaler.max_scale))


@given(
    cfg=configs,
    runs=st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=12),
)
def test_long_runs_stay_in_bounds(cfg, runs):
    """Long runs of finite/non-finite steps, as run-length encoded sequences."""
    scaler, ref = _both(cfg)
    finite = np.concatenate([np.full(n, f) for f, n in runs] or [np.ones(1, bool)])
    final = jax.jit(
        lambda s, fs: jax.lax.fori_loop(
            0, fs.shape[0], lambda i, s: scaler.adjust(s, fs[i]), s
        )
    )(scaler.init(), jnp.asarray(finite))
    for f in finite:
        ref.step(bool(f))
    assert np.float32(final.scale) == ref.scale
    assert int(final.total_skips) == ref.total
    assert np.isfinite(final.scale) and final.scale > 0


def test_growth_never_reaches_inf_at_the_float32_limit():
    scaler = jls.dynamic_scale(2.0**127, growth_interval=1, max_scale=float(F32_MAX))
    (state,) = _run(scaler, [True])
    assert np.float32(state.scale) == np.float32(2.0**127)


def test_floor_below_one():
    scaler = jls.dynamic_scale(1.0, min_scale=2.0**-10)
    states = _run(scaler, [False] * 20)
    assert [float(s.scale) for s in states[:11]] == [2.0**-k for k in range(1, 12)][
        :10
    ] + [2.0**-10]
    assert float(states[-1].scale) == 2.0**-10


def test_hysteresis_megatron():
    # Megatron DynamicGradScaler, hysteresis=2: the first inf since the last
    # growth is tolerated, later ones back off until the scale grows again.
    scaler = jls.dynamic_scale(64.0, growth_interval=2, hysteresis=2)
    finite = [False, False, False, True, False, True, True, False, True, False]
    scales = [float(s.scale) for s in _run(scaler, finite)]
    assert scales == [64, 32, 16, 16, 8, 8, 16, 16, 16, 8]


def test_consecutive_hysteresis_deepspeed():
    # DeepSpeed consecutive_hysteresis: any finite step restores the budget.
    scaler = jls.dynamic_scale(
        64.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True
    )
    finite = [False, True, False, True, False, False, False]
    scales = [float(s.scale) for s in _run(scaler, finite)]
    assert scales == [64, 64, 64, 64, 64, 32, 16]


def test_paddle_decr_every_n():
    scaler = jls.dynamic_scale(64.0, growth_interval=100, backoff_interval=2)
    finite = [False, True, False, False, False, False, False]
    scales = [float(s.scale) for s in _run(scaler, finite)]
    assert scales == [64, 64, 64, 32, 32, 16, 16]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"init_scale": 0.0}, ValueError, "init_scale must be positive, got 0.0"),
        ({"init_scale": -4.0}, ValueError, "init_scale must be positive"),
        ({"init_scale": float("inf")}, ValueError, "init_scale must be finite"),
        ({"init_scale": float("nan")}, ValueError, "init_scale must be finite"),
        ({"init_scale": 1e39}, ValueError, "init_scale must be representable"),
        ({"init_scale": 1e-50, "min_scale": 1e-50}, ValueError, "init_scale must be"),
        ({"min_scale": 1e-40, "init_scale": 1.0}, ValueError, "min_scale must be rep"),
        ({"init_scale": "1024"}, TypeError, "init_scale must be a real number"),
        ({"init_scale": True}, TypeError, "init_scale must be a real number"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor must be >= 1, got 0.5"),
        ({"growth_factor": None}, TypeError, "growth_factor"),
        ({"backoff_factor": 0.0}, ValueError, r"backoff_factor must be in \(0, 1\]"),
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor must be in"),
        ({"backoff_factor": -0.5}, ValueError, "got -0.5"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be an int >= 1"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int"),
        ({"growth_interval": 2**31}, ValueError, "growth_interval"),
        ({"growth_interval": True}, TypeError, "growth_interval"),
        ({"backoff_interval": 0}, ValueError, "backoff_interval"),
        ({"hysteresis": -1}, ValueError, "hysteresis must be an int >= 1"),
        (
            {"hysteresis": 2, "backoff_interval": 2},
            ValueError,
            "set at most one of",
        ),
        ({"consecutive_hysteresis": 1}, TypeError, "consecutive_hysteresis must be"),
        ({"min_scale": 0.0}, ValueError, "min_scale must be positive"),
        ({"max_scale": float("inf")}, ValueError, "max_scale must be finite"),
        ({"max_scale": 1e39}, ValueError, "max_scale must be representable"),
        (
            {"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0},
            ValueError,
            "min_scale must be <= max_scale",
        ),
        ({"init_scale": 0.5}, ValueError, r"init_scale must be in \[min_scale"),
        ({"init_scale": 8.0, "max_scale": 4.0}, ValueError, "init_scale must be in"),
        ({"skip_nonfinite": "yes"}, TypeError, "skip_nonfinite must be a bool"),
    ],
)
def test_bad_configuration(kwargs, error, match):
    with pytest.raises(error, match=match):
        jls.dynamic_scale(**kwargs)


def test_numpy_numbers_are_accepted():
    scaler = jls.dynamic_scale(
        np.float32(1024), growth_interval=np.int64(10), growth_factor=np.float64(2)
    )
    assert scaler.growth_interval == 10 and type(scaler.growth_interval) is int
