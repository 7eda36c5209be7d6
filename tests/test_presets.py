"""Presets: each peer's scaler step for step, and its state interchange.

Also the disabled and fixed modes and bad arguments in the peers' terms.
"""

# Optax and numpy types are loose here; values are checked at run time.
# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peers
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import jls

P = jls.presets
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
FRAMEWORKS = ("torch", "paddle", "megatron")
TO = {f: functools.partial(P.to_state_dict, framework=f) for f in FRAMEWORKS}
FROM = {f: functools.partial(P.from_state_dict, framework=f) for f in FRAMEWORKS}
INITS = [2.0**-120, 1.0, 3.0, 1000.0, 2.0**16, 2.0**120, F32_MAX / 4]


def _i(lo, hi):
    return st.integers(lo, hi)


def _s(*values):
    return st.sampled_from(values)


@st.composite
def _megatron(draw):
    initial = draw(_s(*INITS[1:]))
    return dict(
        initial_scale=initial,
        min_scale=draw(_s(1.0, 2.0**-10)),
        growth_factor=draw(_s(2.0, 1.5)),
        backoff_factor=draw(_s(0.5, 0.75)),
        growth_interval=draw(_i(1, 5)),
        hysteresis=draw(_i(1, 3)),
    )


@st.composite
def _jmp(draw):
    period = draw(_i(1, 5))
    minimum = draw(_s(1.0, 2.0**-10))
    return dict(
        loss_scale=draw(_s(*[x for x in INITS if x >= minimum])),
        counter=draw(_i(0, period - 1)),
        period=period,
        factor=draw(_s(2, 3, 4)),
        min_loss_scale=minimum,
    )


@st.composite
def _flax(draw):
    interval = draw(_i(0, 4))
    minimum = draw(_s(F32_TINY, None, 1.0))
    return dict(
        growth_factor=draw(_s(2.0, 1.5)),
        backoff_factor=draw(_s(0.5, 0.25)),
        growth_interval=interval,
        fin_steps=draw(_i(0, interval)),
        scale=draw(_s(*[x for x in INITS if x >= (minimum or 0)])),
        minimum_scale=minimum,
    )


# Factors: float32-exact ones for the float32 peers; powers of two for the
# float64 peers (MindSpore's manager, DeepSpeed, nnabla), see the presets docs.
PEERS = {
    "torch": (
        P.torch,
        peers.Torch,
        st.fixed_dictionaries(
            dict(
                init_scale=_s(*INITS),
                growth_factor=_s(1.5, 2.0, 4.0),
                backoff_factor=_s(0.5, 0.25, 0.75, 0.125),
                growth_interval=_i(1, 5),
            )
        ),
    ),
    "paddle": (
        P.paddle,
        peers.Paddle,
        st.fixed_dictionaries(
            dict(
                init_loss_scaling=_s(*INITS),
                incr_ratio=_s(1.5, 2.0, 3.0),
                decr_ratio=_s(0.5, 0.8, 0.3),
                incr_every_n_steps=_i(1, 5),
                decr_every_n_nan_or_inf=_i(1, 3),
            )
        ),
    ),
    "mindspore": (
        P.mindspore,
        peers.MindSpore,
        st.fixed_dictionaries(
            dict(
                init_loss_scale=_s(1.0, 2.0**24, 2.0**100),
                scale_factor=_s(2, 4),
                scale_window=_i(1, 5),
            )
        ),
    ),
    "nnabla": (
        P.nnabla,
        peers.Nnabla,
        st.fixed_dictionaries(
            dict(
                scale=_s(8.0, 2.0**-100, 2.0**100),
                scaling_factor=_s(2.0, 4.0),
                N=_i(0, 4),
            )
        ),
    ),
    "keras": (
        P.keras,
        peers.Keras,
        st.fixed_dictionaries(
            dict(initial_scale=_s(*INITS), dynamic_growth_steps=_i(1, 5))
        ),
    ),
    "tensorflow": (
        P.tensorflow,
        peers.TensorFlow,
        st.fixed_dictionaries(
            dict(initial_scale=_s(*INITS[1:]), dynamic_growth_steps=_i(1, 5))
        ),
    ),
    "tensorflow_v1": (
        P.tensorflow_v1,
        peers.TensorFlowV1,
        st.fixed_dictionaries(
            dict(
                initial_loss_scale=_s(*INITS[1:]),
                increment_period=_i(1, 5),
                multiplier=_s(2.0, 3.0, 1.5),
            )
        ),
    ),
    "megatron": (P.megatron, peers.Megatron, _megatron()),
    "deepspeed": (
        P.deepspeed,
        peers.DeepSpeed,
        st.fixed_dictionaries(
            dict(
                init_scale=_s(2.0**32, 2.0**10, 2.0**100),
                scale_factor=_s(2.0, 4.0),
                scale_window=_i(1, 4),
                min_scale=_s(1.0, 2.0**-20),
                delayed_shift=_i(1, 3),
                consecutive_hysteresis=st.booleans(),
            )
        ),
    ),
    "jmp": (P.jmp, peers.Jmp, _jmp()),
    "flax": (P.flax, peers.Flax, _flax()),
}

# Finite/non-finite sequences: run-length encoded so long runs (growth at
# the limits, collapse to the floor) come up as often as short ones.
SEQUENCES = st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=10).map(
    lambda runs: [f for f, n in runs for _ in range(n)]
)


def _sane(x) -> bool:
    """A scale the peer still handles: a finite, normal float32."""
    try:
        x = float(x)
    except OverflowError:  # MindSpore's integer default grows without bound
        return False
    return np.isfinite(x) and F32_TINY <= x <= F32_MAX and float(np.float32(x)) == x


def _trajectory(scaler, finite):
    def body(state, f):
        state = scaler.adjust(state, f)
        return state, state.scale

    _, scales = jax.jit(lambda s, fs: jax.lax.scan(body, s, fs))(
        scaler.init(), jnp.asarray(finite, bool)
    )
    return np.asarray(scales)


@pytest.mark.parametrize("name", PEERS)
@given(data=st.data())
def test_preset_matches_the_peer_step_for_step(name, data):
    make, ref_cls, kwargs_strategy = PEERS[name]
    kwargs = data.draw(kwargs_strategy, label="kwargs")
    finite = data.draw(SEQUENCES, label="finite")
    scaler, ref = make(**kwargs), ref_cls(**kwargs)
    if not finite:
        return
    got = _trajectory(scaler, finite)
    lo, hi = np.float32(scaler.min_scale), np.float32(scaler.max_scale)
    for i, f in enumerate(finite):
        ref.step(f)
        if not _sane(ref.scale):  # the peer broke; jls must stay in bounds
            assert np.all(np.isfinite(got[i:])) and np.all(got[i:] >= lo)
            assert np.all(got[i:] <= hi) and np.all(got[i:] > 0)
            break
        assert got[i] == np.float32(ref.scale), (i, kwargs, finite[: i + 1])


def test_where_the_peers_break_jls_stays_finite_and_positive():
    # torch / Paddle / Keras: no floor, so 200 overflows take them to 0.
    for make, ref in [
        (P.torch, peers.Torch()),
        (P.paddle, peers.Paddle()),
        (P.keras, peers.Keras()),
    ]:
        for _ in range(200):
            ref.step(False)
        assert float(ref.scale) == 0.0
        got = _trajectory(make(), [False] * 200)
        assert got[-1] == np.float32(F32_TINY)
    # MindSpore / Megatron / jmp / Paddle: unguarded growth reaches inf.
    for make, ref, kw in [
        (P.mindspore, peers.MindSpore(scale_window=1), {"scale_window": 1}),
        (P.megatron, peers.Megatron(growth_interval=1), {"growth_interval": 1}),
        (P.jmp, peers.Jmp(2.0**15, period=1), {"loss_scale": 2.0**15, "period": 1}),
        (P.paddle, peers.Paddle(incr_every_n_steps=1), {"incr_every_n_steps": 1}),
    ]:
        with np.errstate(over="ignore"):
            for _ in range(1200):
                ref.step(True)
        assert not _sane(ref.scale)
        got = _trajectory(make(**kw), [True] * 300)
        assert np.isfinite(got[-1]) and got[-1] <= np.float32(F32_MAX)


VECTORS = json.loads(
    (pathlib.Path(__file__).parent / "data" / "public_peer_tests.json").read_text()
)["cases"]


def _vector_preset(case):
    c = case["config"]
    name = case["name"]
    if name.startswith("torch"):
        return P.torch(
            c["init_scale"],
            c["growth_factor"],
            c["backoff_factor"],
            c["growth_interval"],
        )
    if name.startswith("keras3"):
        return P.keras(c["init_scale"], c["growth_interval"])
    if name.startswith("tf2"):
        return P.tensorflow(c["init_scale"], c["growth_interval"])
    if name.startswith("tf"):  # TensorFlow's loss_scale_test: the v1 class
        return P.tensorflow_v1(
            c["init_scale"], c["growth_interval"], c["growth_factor"]
        )
    if name.startswith("deepspeed"):
        return P.deepspeed(
            c["init_scale"], c["growth_factor"], c["window"], c["min_scale"]
        )
    return None


@pytest.mark.parametrize(
    "case",
    [c for c in VECTORS if _vector_preset(c) is not None],
    ids=lambda c: c["name"],
)
def test_public_vectors_through_presets(case):
    got = _trajectory(_vector_preset(case), case["finite"])
    np.testing.assert_array_equal(got, np.float32(case["scale_after"]))


def test_paddle_vector_through_state_import():
    case = next(c for c in VECTORS if c["name"] == "paddle_update_loss_scaling_op")
    c = case["config"]
    sd = {
        "scale": np.asarray([c["init_scale"]], np.float32),
        "incr_ratio": c["growth_factor"],
        "decr_ratio": c["backoff_factor"],
        "incr_every_n_steps": c["growth_interval"],
        "decr_every_n_nan_or_inf": c["backoff_interval"],
        "incr_count": c["initial_counts"]["good_steps"],
        "decr_count": c["initial_counts"]["bad_steps"],
        "use_dynamic_loss_scaling": True,
    }
    scaler, state = P.from_state_dict(sd, framework="paddle")
    for finite, expected in [(True, 4096.0), (False, 1638.4)]:
        after = scaler.adjust(state, finite)
        assert np.float32(after.scale) == np.float32(expected)
        assert int(after.growth_count) == 0 and int(after.backoff_count) == 0


@pytest.mark.parametrize(
    "scaler, scale, skips",
    [
        (P.torch(enabled=False), 1.0, False),
        (P.paddle(enable=False), 1.0, False),
        (
            P.paddle(use_dynamic_loss_scaling=False, init_loss_scaling=1024.0),
            1024.0,
            True,
        ),
        (P.mindspore_fixed(), 128.0, True),
        (P.mindspore_fixed(1024.0, False), 1024.0, False),
        (P.tensorflow(initial_scale=512.0, dynamic=False), 512.0, False),
    ],
)
def test_disabled_and_fixed_scalers(scaler, scale, skips):
    assert not scaler.is_dynamic
    assert float(scaler.init().scale) == scale
    assert scaler.skip_nonfinite is skips
    assert set(_trajectory(scaler, [False, True, False] * 3).tolist()) == {scale}


def test_preset_defaults_are_the_peers():
    assert P.torch() == jls.dynamic_scale(
        2.0**16, min_scale=F32_TINY, max_scale=float(np.finfo(np.float32).max)
    )
    assert P.paddle().init_scale == 65536.0 and P.paddle().growth_interval == 2000
    assert P.mindspore().init_scale == 2.0**24 and P.mindspore().min_scale == 1.0
    assert P.nnabla().init_scale == 8.0 and P.nnabla().growth_interval == 2001
    assert P.keras().init_scale == 32768.0 and P.keras().backoff_divisor == 2.0
    assert P.tensorflow().min_scale == 1.0
    assert P.megatron().init_scale == 2.0**32 and P.megatron().hysteresis == 2
    ds = P.deepspeed()
    assert ds.init_scale == 2.0**32 and ds.growth_interval == 1000
    assert ds.first_growth_interval == 1001 and ds.min_scale == 1.0
    assert P.flax().init_scale == 65536.0 and P.flax().saturate_growth
    assert P.deepspeed(hysteresis=3) == P.deepspeed(delayed_shift=3)
    assert P.deepspeed(initial_scale_power=16).init_scale == 2.0**16


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: P.torch(init_scale=1e39), ValueError, "torch: init_scale must be rep"),
        (lambda: P.torch(growth_factor=1.0), ValueError, "growth_factor must be > 1.0"),
        (lambda: P.torch(backoff_factor=1.0), ValueError, "backoff_factor must be < 1"),
        (lambda: P.torch(growth_interval=0), ValueError, "growth_interval must be"),
        (lambda: P.torch(enabled="yes"), TypeError, "enabled must be a bool"),
        (lambda: P.paddle(init_loss_scaling=0.0), ValueError, "init_loss_scaling must"),
        (lambda: P.paddle(incr_ratio=0.5), ValueError, "incr_ratio must be > 1.0"),
        (lambda: P.paddle(decr_ratio=1.5), ValueError, "decr_ratio must be < 1.0"),
        (lambda: P.paddle(incr_every_n_steps=0), ValueError, "incr_every_n_steps"),
        (lambda: P.paddle(decr_every_n_nan_or_inf=0), ValueError, "decr_every_n_nan"),
        (
            lambda: P.paddle(use_dynamic_loss_scaling=False, init_loss_scaling=-1.0),
            ValueError,
            "init_loss_scaling must be positive",
        ),
        (lambda: P.mindspore(init_loss_scale=0.5), ValueError, "init_loss_scale must"),
        (lambda: P.mindspore(scale_factor=0), ValueError, "scale_factor must be > 0"),
        (lambda: P.mindspore(scale_window=0), ValueError, "scale_window must be"),
        (lambda: P.mindspore(init_loss_scale=1e40), ValueError, "init_loss_scale must"),
        (lambda: P.mindspore_fixed(0.5), ValueError, "loss_scale must be >= 1"),
        (lambda: P.mindspore_fixed(drop_overflow_update=1), TypeError, "drop_overflow"),
        (lambda: P.nnabla(N=-1), ValueError, r"N must be an int in \[0, "),
        (lambda: P.nnabla(scale=0.0), ValueError, "nnabla: scale must be positive"),
        (lambda: P.nnabla(scaling_factor=0.5), ValueError, "scaling_factor must be"),
        (lambda: P.keras(initial_scale=1e39), ValueError, "initial_scale must be rep"),
        (lambda: P.keras(dynamic_growth_steps=0), ValueError, "dynamic_growth_steps"),
        (
            lambda: P.tensorflow(dynamic=False, dynamic_growth_steps=10),
            ValueError,
            "cannot be given when dynamic is False",
        ),
        (lambda: P.megatron(min_scale=2.0**40), ValueError, "initial_scale must be in"),
        (lambda: P.megatron(hysteresis=0), ValueError, "megatron: hysteresis must be"),
        (lambda: P.megatron(backoff_factor=1.0), ValueError, "backoff_factor must be"),
        (lambda: P.deepspeed(initial_scale_power=200), ValueError, "<= 127"),
        (
            lambda: P.deepspeed(init_scale=8.0, initial_scale_power=3),
            ValueError,
            "not both",
        ),
        (
            lambda: P.deepspeed(delayed_shift=2, hysteresis=3),
            ValueError,
            "same setting",
        ),
        (lambda: P.deepspeed(delayed_shift=0), ValueError, "delayed_shift must be"),
        (lambda: P.deepspeed(scale_window=0), ValueError, "scale_window must be"),
        (
            lambda: P.jmp(2.0**15, counter=5, period=5),
            ValueError,
            "counter must be an int in",
        ),
        (lambda: P.jmp(2.0**15, factor=0.5), ValueError, "jmp: factor must be >= 1"),
        (lambda: P.jmp(0.5), ValueError, "loss_scale must be in"),
        (lambda: P.flax(fin_steps=3, growth_interval=2), ValueError, "fin_steps must"),
        (lambda: P.flax(scale=float("inf")), ValueError, "flax: scale must be finite"),
    ],
)
def test_bad_arguments_are_named_in_the_peers_terms(call, error, match):
    with pytest.raises(error, match=match):
        call()


# State interchange ---------------------------------------------------------


@functools.cache
def _jitted_adjust(scaler):
    """One compiled ``adjust`` per scaler (the examples share a few configs)."""
    return jax.jit(scaler.adjust)


def _run(scaler, state, finite):
    adjust = _jitted_adjust(scaler)
    for f in finite:
        state = adjust(state, jnp.asarray(f))
    return state


def _assert_resumes(scaler, state, ref, finite):
    """The resumed jls run follows the peer's until the peer breaks."""
    adjust = _jitted_adjust(scaler)
    for f in finite:
        state = adjust(state, jnp.asarray(f))
        ref.step(f)
        if not _sane(ref.scale):
            break
        assert np.float32(state.scale) == np.float32(ref.scale)


@given(finite=SEQUENCES, more=SEQUENCES)
def test_torch_state_dict_round_trip_resumes_exactly(finite, more):
    scaler = P.torch(init_scale=2.0**10, growth_interval=3)
    state = _run(scaler, scaler.init(), finite)
    ref = peers.Torch(init_scale=2.0**10, growth_interval=3)
    for f in finite:
        ref.step(f)
        assume(_sane(ref.scale))  # the peer stayed sane all along
    sd = P.to_state_dict(scaler, state, framework="torch")
    assert sd == {
        "scale": float(ref.scale),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": ref._growth_tracker,
    }
    scaler2, state2 = P.from_state_dict(sd, framework="torch")
    assert scaler2.growth_interval == 3
    _assert_resumes(scaler2, state2, ref, more)
    assert P.from_state_dict({}, framework="torch")[0] == jls.no_scale(
        skip_nonfinite=False
    )


@given(finite=SEQUENCES, more=SEQUENCES)
def test_paddle_state_dict_round_trip_resumes_exactly(finite, more):
    kw = dict(
        init_loss_scaling=2.0**10, incr_every_n_steps=3, decr_every_n_nan_or_inf=2
    )
    scaler, ref = P.paddle(**kw), peers.Paddle(**kw)
    state = _run(scaler, scaler.init(), finite)
    for f in finite:
        ref.step(f)
        assume(_sane(ref.scale))  # the peer stayed sane all along
    sd = P.to_state_dict(scaler, state, framework="paddle")
    assert (sd["incr_count"], sd["decr_count"]) == (ref._incr_count, ref._decr_count)
    assert sd["scale"].dtype == np.float32 and sd["scale"][0] == ref.scale
    scaler2, state2 = P.from_state_dict(sd, framework="paddle")
    assert scaler2 == scaler.__class__(
        **{**scaler.__dict__, "init_scale": scaler2.init_scale}
    )
    adjust = _jitted_adjust(scaler2)
    for f in more:
        state2 = adjust(state2, jnp.asarray(f))
        ref.step(f)
        if _sane(ref.scale):
            assert np.float32(state2.scale) == np.float32(ref.scale)


@given(finite=SEQUENCES, more=SEQUENCES)
def test_megatron_state_dict_round_trip_resumes_exactly(finite, more):
    kw = dict(initial_scale=2.0**20, growth_interval=3, hysteresis=3)
    scaler, ref = P.megatron(**kw), peers.Megatron(**kw)
    state = _run(scaler, scaler.init(), finite)
    for f in finite:
        ref.step(f)
        assume(_sane(ref.scale))  # the peer stayed sane all along
    sd = P.to_state_dict(scaler, state, framework="megatron")
    assert sd["growth_tracker"] == ref._growth_tracker
    assert sd["hysteresis_tracker"] == max(ref._hysteresis_tracker, 0)
    # Megatron's own (possibly negative) tracker imports the same way.
    sd["hysteresis_tracker"] = ref._hysteresis_tracker
    scaler2, state2 = P.from_state_dict(
        sd, framework="megatron", growth_interval=3, hysteresis=3
    )
    _assert_resumes(scaler2, state2, ref, more)


def test_resuming_a_torch_run_inside_an_optax_state():
    params = {"w": jnp.ones(3)}
    sd = {
        "scale": 4096.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2,
        "_growth_tracker": 1,
    }
    scaler, ls = P.from_state_dict(sd, framework="torch")
    tx = jls.loss_scaling(optax.sgd(0.1), scaler)
    opt_state = jls.set_loss_scale(tx.init(params), ls)
    grads = {"w": jnp.full((3,), 4096.0)}
    _, opt_state = jax.jit(tx.update)(grads, opt_state, params)
    assert float(jls.metrics(opt_state)["loss_scale"]) == 8192.0  # torch grows here
    assert P.to_state_dict(scaler, opt_state, framework="torch")["_growth_tracker"] == 0


def test_bad_state_dicts():
    good = {
        "scale": 8.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2,
        "_growth_tracker": 0,
    }
    with pytest.raises(ValueError, match="_growth_tracker must be < growth_interval"):
        P.from_state_dict(dict(good, _growth_tracker=2), framework="torch")
    with pytest.raises(ValueError, match=r"\['scale'\] must be finite"):
        P.from_state_dict(dict(good, scale=float("inf")), framework="torch")
    with pytest.raises(ValueError, match="growth_tracker must be < growth_interval"):
        P.from_state_dict(
            {"scale": 8.0, "growth_tracker": 5000, "hysteresis_tracker": 2},
            framework="megatron",
        )
    missing = dict(good)
    del missing["_growth_tracker"]
    with pytest.raises(
        ValueError, match="state_dict has no '_growth_tracker': a torch"
    ):
        P.from_state_dict(missing, framework="torch")
    with pytest.raises(ValueError, match="has no 'hysteresis_tracker': a Megatron"):
        P.from_state_dict({"scale": 8.0, "growth_tracker": 0}, framework="megatron")
    with pytest.raises(
        TypeError,
        match="scale must be a real number, a real scalar array or a jls.LossScale",
    ):
        jls.set_loss_scale(jls.no_scale().init(), {"scale": 1.0})


def _docs_text() -> str:
    """The README and the docs pages (the migration table is in the how-to)."""
    root = pathlib.Path(__file__).parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return "\n".join(p.read_text() for p in pages if "_build" not in p.parts)


def test_readme_preset_lines_run():
    readme = _docs_text()
    calls = set(re.findall(r"`(jls\.presets\.(?!from_|to_)\w+\([^`]*\))`", readme))
    assert len(calls) >= 12
    for call in calls:
        scaler = eval(call, {"jls": jls})  # noqa: S307 (README examples)
        assert isinstance(scaler, jls.LossScaler), call


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: jls.presets.deepspeed(hysteresis=0), "deepspeed: hysteresis must"),
        (lambda: jls.presets.deepspeed(delayed_shift=0), "deepspeed: delayed_shift"),
        (
            lambda: jls.presets.deepspeed(initial_scale_power=-1),
            r"2\*\*initial_scale_power must be in",
        ),
        (lambda: jls.presets.mindspore(scale_factor=1e40), "mindspore: scale_factor"),
        (lambda: jls.presets.mindspore(scale_factor=1e38), "1 / scale_factor"),
        (lambda: jls.presets.tensorflow_v1(multiplier=1e38), "1 / multiplier"),
        (lambda: jls.presets.nnabla(scaling_factor=1e38), "1 / scaling_factor"),
        (lambda: jls.presets.jmp(2.0**15, factor=1e38), "jmp: 1 / factor"),
        (lambda: jls.presets.nnabla(N=2**31 - 1), r"N must be an int in \[0, "),
        (
            lambda: jls.presets.deepspeed(scale_window=2**31 - 1),
            r"scale_window must be an int in \[1, ",
        ),
        (lambda: jls.dynamic_scale(backoff_divisor=1e38), "1 / backoff_divisor"),
        (
            lambda: jls.dynamic_scale(growth_interval=2**31),
            r"growth_interval must be an int in \[1, 2147483647\]",
        ),
    ],
)
def test_errors_name_the_argument_the_user_gave(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "scaler, to, fields",
    [
        (jls.no_scale(), TO["torch"], "growth_factor must be > 1.0"),
        (jls.static_scale(8.0), TO["torch"], "growth_factor must be > 1.0"),
        (jls.dynamic_scale(hysteresis=2), TO["torch"], "hysteresis=2"),
        (jls.dynamic_scale(hysteresis=2), TO["paddle"], "hysteresis=2"),
        (
            jls.dynamic_scale(backoff_divisor=3.0),
            TO["torch"],
            "backoff_divisor",
        ),
        (
            jls.dynamic_scale(backoff_interval=2),
            TO["megatron"],
            "backoff_interval",
        ),
        (jls.presets.deepspeed(), TO["torch"], "first_growth_interval"),
        (jls.presets.flax(), TO["paddle"], "saturate_growth"),
        (jls.no_scale(), TO["megatron"], "growth_factor must be > 1.0"),
    ],
)
def test_what_a_format_cannot_hold_is_refused(scaler, to, fields):
    with pytest.raises(ValueError, match=re.escape(fields)):
        to(scaler, scaler.init())


@pytest.mark.parametrize(
    "scaler, to, back, kwargs",
    [
        (jls.dynamic_scale(), TO["torch"], FROM["torch"], {}),
        (P.torch(), TO["torch"], FROM["torch"], {}),
        (jls.static_scale(8.0), TO["paddle"], FROM["paddle"], {}),
        (
            P.paddle(decr_every_n_nan_or_inf=3),
            TO["paddle"],
            FROM["paddle"],
            {},
        ),
        (
            jls.dynamic_scale(hysteresis=3, growth_interval=7),
            TO["megatron"],
            FROM["megatron"],
            {"growth_interval": 7, "hysteresis": 3},
        ),
    ],
)
def test_what_is_exported_reads_back_as_the_same_rule(scaler, to, back, kwargs):
    state = scaler.adjust(scaler.adjust(scaler.init(), True), False)
    sd = to(scaler, state)
    bounds = {"min_scale": scaler.min_scale, "max_scale": scaler.max_scale}
    again, state2 = back(sd, **kwargs, **bounds)
    for field in dataclasses.fields(scaler):
        if field.name not in ("init_scale", "init_growth_count"):
            assert getattr(again, field.name) == getattr(scaler, field.name), field
    # The rule's own state (the skip counters are jls's bookkeeping).
    for name in ("scale", "growth_count", "backoff_count"):
        assert getattr(state2, name) == getattr(state, name), name
    assert again.adjust(state2, True).scale == scaler.adjust(state, True).scale


# The README's migration table: each row's jls scaler is the row's framework
# settings (the fragment of its column that sets them, and the peer's
# defaults for the rest).
MIGRATION_ROWS = {
    "PyTorch": (
        "GradScaler(init_scale=2**16)",
        {"init_scale": 2.0**16, "growth_interval": 2000, "backoff_factor": 0.5},
    ),
    "Paddle": (
        "GradScaler(init_loss_scaling=1024)",
        {"init_scale": 1024.0, "growth_interval": 2000, "backoff_interval": 1},
    ),
    "MindSpore": (
        "DynamicLossScaleManager(2**24, 2, 2000)",
        {"init_scale": 2.0**24, "growth_factor": 2.0, "growth_interval": 2000},
    ),
    "MindSpore, fixed": (
        "FixedLossScaleManager(1024.0, drop_overflow_update=False)",
        {"init_scale": 1024.0, "skip_nonfinite": False},
    ),
    "nnabla": ("scale=8.0, N=2000", {"init_scale": 8.0, "growth_interval": 2001}),
    "Keras 3": (
        "initial_scale=2**15",
        {"init_scale": 2.0**15, "backoff_divisor": 2.0},
    ),
    "TensorFlow 2": ("LossScaleOptimizer(inner)", {"init_scale": 2.0**15}),
    "TensorFlow 1": (
        "DynamicLossScale(2**15, 2000, 2.0)",
        {"init_scale": 2.0**15, "growth_interval": 2000, "growth_factor": 2.0},
    ),
    "Megatron-LM": (
        "--initial-loss-scale 4294967296 --loss-scale-window 1000 --hysteresis 2",
        {"init_scale": 2.0**32, "growth_interval": 1000, "hysteresis": 2},
    ),
    "DeepSpeed": (
        '"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2',
        {"init_scale": 2.0**16, "growth_interval": 1000, "hysteresis": 2},
    ),
    "jmp": ("DynamicLossScale(jnp.float32(2**15))", {"init_scale": 2.0**15}),
    "flax": ("DynamicScale()", {"init_scale": 2.0**16, "saturate_growth": True}),
}


def test_the_readme_migration_table_matches_each_frameworks_settings():
    readme = _docs_text()
    rows = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in MIGRATION_ROWS:
            rows[cells[0]] = cells
    assert set(rows) == set(MIGRATION_ROWS)
    for name, (fragment, want) in MIGRATION_ROWS.items():
        framework, jls_cell = rows[name][1], rows[name][2]
        assert fragment in framework, (name, framework)
        (call,) = re.findall(r"`(jls\.presets\.\w+\([^`]*\))`", jls_cell)
        scaler = eval(call, {"jls": jls})  # noqa: S307 (README examples)
        for field, value in want.items():
            assert getattr(scaler, field) == value, (name, field)


def test_the_dicts_are_each_frameworks_own_key_for_key():
    # One state after two finite steps and a non-finite one, every key and
    # value (and type) each framework's dict holds.
    def run(scaler):
        state = scaler.init()
        for finite in (True, True, False):
            state = scaler.adjust(state, finite)
        return state

    torch_scaler = P.torch(init_scale=2.0**10, growth_interval=3)
    sd = P.to_state_dict(torch_scaler, run(torch_scaler), framework="torch")
    assert sd == {
        "scale": 512.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": 0,
    }
    assert [type(v) for v in sd.values()] == [float, float, float, int, int]
    paddle = P.paddle(init_loss_scaling=2.0**10, decr_every_n_nan_or_inf=2)
    sd = P.to_state_dict(paddle, run(paddle), framework="paddle")
    scale = sd.pop("scale")
    assert scale.dtype == np.float32 and scale.tolist() == [1024.0]
    assert sd == {
        "incr_ratio": 2.0,
        "decr_ratio": 0.5,
        "incr_every_n_steps": 2000,
        "decr_every_n_nan_or_inf": 2,
        "incr_count": 0,
        "decr_count": 1,
        "use_dynamic_loss_scaling": True,
    }
    megatron = P.megatron(initial_scale=2.0**20, hysteresis=3)
    sd = P.to_state_dict(megatron, run(megatron), framework="megatron")
    assert sd == {"scale": 2.0**20, "growth_tracker": 0, "hysteresis_tracker": 2}


@pytest.mark.parametrize("framework", ["jax", "Torch", None, 0])
def test_the_framework_is_one_of_three_and_named_when_not(framework):
    scaler = P.torch()
    match = (
        r"jls\.presets\.%s: framework must be one of 'torch', 'paddle', "
        r"'megatron', got " + re.escape(repr(framework))
    )
    with pytest.raises(ValueError, match=match % "to_state_dict"):
        P.to_state_dict(scaler, scaler.init(), framework=framework)
    with pytest.raises(ValueError, match=match % "from_state_dict"):
        P.from_state_dict({}, framework=framework)
    with pytest.raises(TypeError, match="framework"):
        P.to_state_dict(scaler, scaler.init())  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match="framework"):  # keyword-only, no default
        P.from_state_dict({})  # pyright: ignore[reportCallIssue]
