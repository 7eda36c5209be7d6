"""Compositions that hide jls from its caller are refused, or warned about."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportCallIssue=false, reportIndexIssue=false

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls

PARAMS = {"w": jnp.ones(2), "b": jnp.ones(1)}
LABELS = {"w": "a", "b": "b"}


def _sgd() -> Any:
    return jls.loss_scaling(optax.sgd(0.01), jls.static_scale(2.0**10))


def _lookups():
    """Every way a user's step reads jls's state."""
    return (
        lambda s: jls.scale_loss(jnp.float32(1.0), s),
        jls.metrics,
        jls.loss_scale_state,
        lambda s: jls.unscale(PARAMS, s),
        lambda s: jls.keep_if_skipped(PARAMS, PARAMS, s),
    )


def _refused(state, match):
    for use in _lookups():
        with pytest.raises(ValueError, match=match):
            use(state)
        with pytest.raises(ValueError, match=match):  # at trace time, too
            jax.jit(use)(state)


def test_named_chain_beside_loss_scaling_is_refused_naming_the_fix():
    # It used to train with the clip applied to the scaled gradients: updates
    # of -3.45e-5 instead of -0.01 in issue 33's run, silently.
    tx = optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("jls", _sgd()))
    state = tx.init(PARAMS)
    _refused(state, r"optax.named_chain.*jls.loss_scaling\(optax.chain\(")
    # The fix, and named_chain with loss_scaling alone, are accepted.
    for tx in (
        jls.loss_scaling(
            optax.named_chain(
                ("clip", optax.clip_by_global_norm(1.0)), ("sgd", optax.sgd(0.01))
            )
        ),
        optax.named_chain(("jls", _sgd())),
    ):
        for use in _lookups():
            use(tx.init(PARAMS))


@pytest.mark.parametrize("partition", [optax.multi_transform, optax.partition])
def test_loss_scaling_in_one_group_of_a_partition_is_refused(partition):
    # Group b used to step with the scaled gradients (issue 33: -10.24 for -0.01).
    tx = partition({"a": _sgd(), "b": optax.sgd(0.01)}, LABELS)
    with pytest.raises(ValueError, match=r"MaskedNode.*jls.loss_scaling\(optax.part"):
        tx.init(PARAMS)
    # A state made without that init (a checkpoint) is refused where it is
    # read, and by the update itself, which sees the masked-out leaves.
    inner = _sgd()
    state = optax.transforms.PartitionState(
        inner_states={
            "a": optax.MaskedState(inner_state=inner.init(PARAMS)),
            "b": optax.MaskedState(inner_state=optax.sgd(0.01).init(PARAMS)),
        }
    )
    _refused(state, r"multi_transform / optax.partition")
    masked = {"w": PARAMS["w"], "b": optax.MaskedNode()}
    with pytest.raises(ValueError, match="MaskedNode"):
        inner.update(masked, inner.init(PARAMS), masked)
    # The fix: the partition inside.
    fixed = jls.loss_scaling(
        partition({"a": optax.sgd(0.01), "b": optax.sgd(0.01)}, LABELS)
    )
    state = fixed.init(PARAMS)
    grads = jax.grad(lambda p: jls.scale_loss(p["w"].sum() + p["b"].sum(), state))(
        PARAMS
    )
    updates, _ = fixed.update(grads, state, PARAMS)
    np.testing.assert_array_equal(updates["b"], np.float32([-0.01]))


def test_masked_around_loss_scaling_is_refused():
    tx = optax.masked(_sgd(), {"w": True, "b": False})
    with pytest.raises(ValueError, match=r"jls.loss_scaling\(optax.masked\(inner"):
        tx.init(PARAMS)
    state = optax.MaskedState(inner_state=_sgd().init(PARAMS))
    _refused(state, r"masked-out parameters' updates are their loss-scaled")


def _multisteps_run(tx, scale_of):
    """Micro-batches 0-9 of a k=2 accumulation, micro-batch 1 nan."""
    params, state = PARAMS, tx.init(PARAMS)

    @jax.jit
    def step(params, state, x, bad):
        x = jnp.where(bad, jnp.nan, x)  # a micro-batch with a nan in it

        def loss(p):
            return (jnp.sum(p["w"] * x) + jnp.sum(p["b"] * x)) * scale_of(state)

        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    history = []
    for i in range(10):
        params, state = step(params, state, jnp.float32(1 + i), jnp.asarray(i == 1))
        history.append(params)
    return history, state


def test_multisteps_around_loss_scaling_poisons_every_later_window():
    # The trap, reproduced: MultiSteps accumulates the scaled gradients and
    # resets its accumulator as 0 * acc, so after one nan micro-batch every
    # window is nan, and jls skips every one of them, with no error.
    tx = optax.MultiSteps(_sgd(), 2)
    history, state = _multisteps_run(tx, lambda s: s.inner_opt_state.loss_scale.scale)
    for params in history:  # not one window was ever applied
        jax.tree.map(np.testing.assert_array_equal, params, PARAMS)
    assert int(state.inner_opt_state.loss_scale.total_skips) == 5
    assert np.isnan(np.asarray(state.acc_grads["w"])).all()
    # Now refused wherever the step reads the state, naming the fix.
    _refused(state, r"jls.loss_scaling\(optax.MultiSteps\(inner, k\), scaler\)")
    # The recommended order: the nan micro-batch is dropped alone, and the
    # windows after it are applied.
    fixed = jls.loss_scaling(
        optax.MultiSteps(optax.sgd(0.01), 2), jls.static_scale(2.0**10)
    )
    history, state = _multisteps_run(fixed, lambda s: jls.loss_scale_state(s).scale)
    assert int(jls.metrics(state)["total_skips"]) == 1
    assert float(history[-1]["w"][0]) < 0.9  # every later window applied
    # With a skip function MultiSteps drops it itself: accepted.
    skipping = optax.MultiSteps(_sgd(), 2, should_skip_update_fn=optax.skip_not_finite)
    history, state = _multisteps_run(skipping, lambda s: jls.loss_scale_state(s).scale)
    assert float(history[-1]["w"][0]) < 0.9  # every later window applied


def test_apply_if_finite_around_loss_scaling_is_refused():
    state = optax.apply_if_finite(_sgd(), 3).init(PARAMS)
    _refused(state, r"the loss scale never backs off.*drop apply_if_finite")


def test_any_other_wrapper_around_loss_scaling_is_warned_about():
    lookahead = optax.lookahead(_sgd(), 2, 0.5)
    for state in (
        lookahead.init(optax.LookaheadParams.init_synced(PARAMS)),
        jls.precision.compensated(_sgd()).init(PARAMS),
    ):
        for use in _lookups():
            with pytest.warns(UserWarning, match=r"Put it inside loss_scaling"):
                use(state)


class TrainState(NamedTuple):
    """A user's own train state: a container, not a transformation's state."""

    params: Any
    opt_state: Any
    step: jax.Array


def test_plain_containers_and_the_safe_wrappers_pass():
    opt_state = _sgd().init(PARAMS)
    for state in (
        opt_state,
        (PARAMS, opt_state),
        {"params": PARAMS, "opt_state": opt_state, "step": jnp.int32(0)},
        TrainState(PARAMS, opt_state, jnp.int32(0)),
        optax.chain(_sgd()).init(PARAMS),
        optax.inject_hyperparams(jls.loss_scaling)(optax.sgd(0.1)).init(PARAMS),
        optax.MultiSteps(_sgd(), 2, should_skip_update_fn=optax.skip_not_finite).init(
            PARAMS
        ),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for use in _lookups():
                use(state)


def test_a_dict_of_two_optimizers_states_names_the_one_to_pass():
    states = {"generator": _sgd().init(PARAMS), "other": optax.adam(1e-3).init(PARAMS)}
    with pytest.raises(ValueError, match=r"opt_states\['generator'\]"):
        jls.scale_loss(jnp.float32(1.0), states)
    jls.scale_loss(jnp.float32(1.0), states["generator"])


def test_the_fused_path_names_the_order_that_works():
    tx = optax.MultiSteps(_sgd(), 2)
    with pytest.raises(TypeError) as err:
        jls.apply_gradients(tx, PARAMS, tx.init(PARAMS), PARAMS)
    message = str(err.value)
    assert "one made by MultiSteps" in message
    assert "jls.loss_scaling(optax.MultiSteps(optax.adam(1e-3), k))" in message
    # It no longer sends the user to tx.update around loss_scaling, the
    # order that poisons the accumulator.
    assert "use tx.update" not in message


def _schedule(count):
    return 0.1 * (count + 1.0)


def _scheduled(order: str) -> Any:
    """SGD at ``_schedule``'s rate, inside jls (exact) or around it."""
    scaler = jls.static_scale(1.0)
    if order == "inside":
        return jls.loss_scaling(optax.inject_hyperparams(optax.sgd)(_schedule), scaler)
    sgd = lambda learning_rate: jls.loss_scaling(optax.sgd(learning_rate), scaler)  # noqa: E731
    return optax.inject_hyperparams(sgd)(learning_rate=_schedule)


def test_inject_hyperparams_with_a_schedule_around_jls_is_refused():
    # Around jls, the schedule's count advances on a skipped step: the rate
    # is then a step ahead. Inside, a skip keeps the count.
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), PARAMS)
    rates = {}
    for order in ("inside", "around"):
        tx = _scheduled(order)
        state = tx.init(PARAMS)
        for grads in (nan, PARAMS):
            updates, state = tx.update(grads, state, PARAMS)
        rates[order] = float(-updates["w"][0])
    assert rates == {"inside": np.float32(0.1), "around": np.float32(0.2)}
    state = _scheduled("around").init(PARAMS)
    _refused(state, r"a step ahead.*jls.loss_scaling\(optax.inject_hyperparams\(")
    stateful = optax.schedules.WrappedSchedule(_schedule)  # a StatefulSchedule
    with pytest.raises(ValueError, match="a step ahead"):
        sgd = optax.inject_hyperparams(lambda learning_rate: _sgd())(stateful)
        jls.metrics(sgd.init(PARAMS))
    for state in (  # inside jls, or constant rates: nothing advances apart
        _scheduled("inside").init(PARAMS),
        jls.loss_scaling(optax.inject_hyperparams(optax.sgd)(stateful)).init(PARAMS),
        optax.inject_hyperparams(lambda learning_rate: _sgd())(0.1).init(PARAMS),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jls.metrics(state)


class _Counted(NamedTuple):
    """A user's wrapper around jls with its own step counter."""

    inner_state: Any
    step: jax.Array


def test_any_wrapper_with_its_own_counter_is_warned_about_naming_it():
    state = _Counted(_sgd().init(PARAMS), jnp.int32(0))
    for use in _lookups():
        with pytest.warns(
            UserWarning, match=r"_Counted.step counts the steps jls skips"
        ):
            use(state)
