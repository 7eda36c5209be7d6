"""What every rule shares: the range, saturating counters, input checks."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import F32_MAX

import jls


def test_counters_saturate_at_int32_max():
    top = np.iinfo(np.int32).max
    scaler = jls.dynamic_scale()
    state = scaler.init()._replace(
        consecutive_skips=jnp.int32(top), total_skips=jnp.int32(top)
    )
    state = jax.jit(scaler.adjust)(state, jnp.asarray(False))
    assert int(state.consecutive_skips) == top and int(state.total_skips) == top
    state = jax.jit(scaler.adjust)(state, jnp.asarray(True))
    assert int(state.consecutive_skips) == 0 and int(state.total_skips) == top


def test_adjust_is_vmappable():
    scaler = jls.dynamic_scale(8.0, growth_interval=1)
    states = jax.vmap(lambda _: scaler.init())(jnp.arange(3))
    finite = jnp.array([True, False, True])
    out = jax.jit(jax.vmap(scaler.adjust))(states, finite)
    np.testing.assert_array_equal(out.scale, np.float32([16, 4, 16]))


def test_scalers_are_immutable_and_hashable():
    a, b = jls.dynamic_scale(), jls.dynamic_scale()
    assert a == b and hash(a) == hash(b)
    assert jls.dynamic_scale(growth_interval=10) != a
    with pytest.raises(AttributeError):
        a.init_scale = 3.0  # type: ignore[misc]
    # Configuration is not a pytree leaf: nothing can be lost through jit.
    assert jax.tree.leaves(a) == [a]
    jax.jit(lambda s: s.init(), static_argnums=0)(a)


def test_bad_state_and_flag_raise_at_trace_time():
    scaler = jls.dynamic_scale()
    state = scaler.init()
    with pytest.raises(TypeError, match="grads_finite must be a scalar bool"):
        scaler.adjust(state, jnp.ones(3, bool))
    with pytest.raises(TypeError, match="grads_finite must be a scalar bool"):
        jax.jit(scaler.adjust)(state, jnp.float32(1))
    with pytest.raises(TypeError, match=r"state.scale must be a float32 scalar"):
        scaler.adjust(state._replace(scale=jnp.float16(2)), True)
    with pytest.raises(TypeError, match=r"state.growth_count must be a int32"):
        scaler.adjust(state._replace(growth_count=jnp.zeros(2, jnp.int32)), True)
    with pytest.raises(TypeError, match="state must be a jls.LossScaleState"):
        scaler.adjust({"scale": 1.0}, True)  # type: ignore[arg-type]


def test_the_growth_count_saturates_instead_of_wrapping():
    top = np.iinfo(np.int32).max
    scaler = jls.dynamic_scale(2.0**4, growth_interval=2000)
    # A count past the interval (a checkpoint, a user's hand) grows, it does
    # not wrap to -2**31 and wait another 2**31 steps.
    state = scaler.init()._replace(growth_count=jnp.int32(top))
    state = jax.jit(scaler.adjust)(state, jnp.asarray(True))
    assert int(state.growth_count) == 0 and float(state.scale) == 2.0**5
    last = jls.dynamic_scale(2.0**4, growth_interval=top)
    state = last.init()._replace(growth_count=jnp.int32(top - 1))
    state = jax.jit(last.adjust)(state, jnp.asarray(True))
    assert int(state.growth_count) == 0 and float(state.scale) == 2.0**5


def test_the_default_ceiling_is_two_to_the_126():
    assert jls.dynamic_scale().max_scale == 2.0**126
    assert jls.measured_scale().max_scale == 2.0**126
    # Presets of peers without a ceiling keep the float32 maximum.
    assert jls.presets.torch().max_scale == float(F32_MAX)
    state = jls.dynamic_scale(2.0**126, growth_interval=1).init()
    state = jls.dynamic_scale(2.0**126, growth_interval=1).adjust(state, True)
    assert float(state.scale) == 2.0**126


@pytest.mark.parametrize("donate", [(), (0,)])
@pytest.mark.parametrize(
    "scaler", [jls.dynamic_scale(), jls.static_scale(4.0), jls.measured_scale()]
)
def test_the_rule_writes_no_constant_into_the_state(scaler, donate):
    # `retries` is 0 after a step without retries: computed from its input,
    # it is one select done in place. As a constant it was copied out (twice
    # when donated), a fixed cost of every small step.
    def adjust(state, finite):
        return scaler.adjust(state, finite), scaler.hold(state, finite)

    step = jax.jit(adjust, donate_argnums=donate)
    text = step.lower(scaler.init(), jnp.asarray(True)).compile().as_text() or ""
    entry = text[text.index("\nENTRY ") :]
    assert not re.search(r" copy\(%constant", entry)
    state, held = step(scaler.init()._replace(retries=jnp.int32(3)), True)
    assert int(state.retries) == 0 and int(held.retries) == 0
