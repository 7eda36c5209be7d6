"""The seam: a user's hook vetoes, holds the scale, records, and reports."""

# Hooks read optional fields of StepInfo that the step fills in.
# pyright: reportOptionalOperand=false, reportOptionalMemberAccess=false
# pyright: reportArgumentType=false

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls


class SkipHighLoss(jls.hooks.Hook):
    """Skip a step whose (replicas' mean) loss is above a limit."""

    name = "skip_high_loss"
    needs_loss = True

    def __init__(self, limit: float = 10.0):
        self.limit = limit

    def veto(self, state, info):
        return info.loss > self.limit


class CountedState(NamedTuple):
    """What CountApplied keeps; its metrics are what jls.metrics reports."""

    applied: jax.Array
    norm: jax.Array

    def metrics(self):
        return {"applied_steps": self.applied}


class CountApplied(jls.hooks.Hook):
    """Counts applied steps; records the latest norm (a statistic)."""

    name = "count_applied"
    needs_norm = True

    def init(self, params):
        return CountedState(jnp.int32(0), jnp.float32(0))

    def update(self, state, info, vetoed):
        return CountedState(state.applied + info.applied.astype(jnp.int32), info.norm)


class HoldOnNanLoss(jls.hooks.Hook):
    """Skip a step whose loss is not finite, holding the scale rule."""

    name = "hold_on_nan_loss"
    needs_loss = True
    holds_scale = True

    def veto(self, state, info):
        return ~jnp.isfinite(info.loss)


class SumUpdates(jls.hooks.Hook):
    """Reads the sum of the applied updates and new parameters, every other step."""

    name = "sum_updates"

    def init(self, params):
        return {"count": jnp.int32(0), "seen": jnp.zeros(2)}

    def reads_updates(self, state):
        return state["count"] % 2 == 0

    def read_updates(self, state, new_params, updates):
        total = sum(jnp.sum(u) for u in jax.tree.leaves(updates))
        return jnp.stack([total, sum(jnp.sum(p) for p in jax.tree.leaves(new_params))])

    def update(self, state, info, vetoed):
        assert info.reads is not None  # in update, always
        read = info.applied & (state["count"] % 2 == 0)
        seen = jnp.where(read, info.reads[self.name], state["seen"])
        return {"count": state["count"] + 1, "seen": seen}


PARAMS = {"w": jnp.ones(4), "b": jnp.zeros(2)}


def _grads(value=1.0):
    return jax.tree.map(lambda p: jnp.full_like(p, value), PARAMS)


def test_a_veto_skips_the_step_and_changes_nothing():
    tx = jls.loss_scaling(
        optax.adam(1e-2), jls.static_scale(4.0), hooks=[SkipHighLoss()]
    )
    state = tx.init(PARAMS)
    step = jax.jit(lambda g, s, p, loss: jls.apply_gradients(tx, g, s, p, loss=loss))
    params, state = step(_grads(4.0), state, PARAMS, jnp.float32(1.0))  # applied
    before = (params, state.inner_state)
    new_params, new_state = step(_grads(4.0), state, params, jnp.float32(50.0))
    chex.assert_trees_all_equal((new_params, new_state.inner_state), before)
    m = jls.metrics(new_state)
    assert bool(m["skipped"]) and not bool(m["nonfinite"])
    assert int(m["total_skips"]) == 1
    # Vetoed steps are finite: the rule is not backed off.
    assert float(m["loss_scale"]) == 4.0
    chex.assert_max_traces(n=1)


def test_a_statistic_hook_records_and_reports():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(), hooks=[CountApplied()])
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for value in (1.0, jnp.nan, 2.0):
        _, state = update(_grads(value), state, PARAMS)
    assert int(jls.metrics(state)["applied_steps"]) == 2
    want = float(np.sqrt(6 * 4.0))  # the last step's norm: six 2.0s
    assert float(state.hooks["count_applied"].norm) == pytest.approx(want)


def test_a_veto_on_one_replica_skips_every_replica():
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.no_scale(), hooks=[SkipHighLoss(1.5)], axis_name="r"
    )
    # The hook watches the replicas' mean loss: (1 + 3) / 2 = 2 > 1.5.
    losses = jnp.asarray([1.0, 3.0])
    states = jax.tree.map(lambda x: jnp.stack([x, x]), tx.init(PARAMS))
    params = jax.tree.map(lambda x: jnp.stack([x, x]), PARAMS)
    grads = jax.tree.map(lambda x: jnp.stack([x, x]), _grads())

    def step(g, s, p, loss):
        return jls.apply_gradients(tx, g, s, p, loss=loss)

    new_params, new = jax.vmap(step, axis_name="r")(grads, states, params, losses)
    assert np.asarray(jls.metrics(new)["skipped"]).tolist() == [True, True]
    chex.assert_trees_all_equal(new_params, params)


def test_a_holding_veto_leaves_the_scale_rule_where_it_was():
    scaler = jls.dynamic_scale(2.0**10, growth_interval=3)
    tx = jls.loss_scaling(optax.sgd(0.1), scaler, hooks=[HoldOnNanLoss()])
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    _, state = update(_grads(2.0**10), state, PARAMS, loss=jnp.float32(1.0))
    before = jls.loss_scale_state(state)
    # A nan loss with nan gradients: skipped, but the scale does not back off
    # and the growth count is kept (the loss says nothing about the scale).
    _, state = update(_grads(jnp.nan), state, PARAMS, loss=jnp.float32(jnp.nan))
    after = jls.loss_scale_state(state)
    assert float(after.scale) == float(before.scale) == 2.0**10
    assert int(after.growth_count) == int(before.growth_count) == 1
    assert int(after.consecutive_skips) == 1 and int(after.total_skips) == 1
    # Without the hook the same step backs off.
    plain = jls.loss_scaling(optax.sgd(0.1), scaler)
    _, other = plain.update(_grads(jnp.nan), plain.init(PARAMS), PARAMS)
    assert float(jls.metrics(other)["loss_scale"]) == 2.0**9


@pytest.mark.parametrize("donate", [False, True], ids=["undonated", "donated"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_hook_reads_the_applied_updates_on_the_steps_it_asks(donate, fused):
    # sgd(0.5): the updates are -0.5 * g; read on calls 0, 2, 4 (call 2 is
    # skipped: nothing read), held between.
    tx = jls.loss_scaling(optax.sgd(0.5), jls.no_scale(), hooks=[SumUpdates()])

    def step(g, s, p):
        if fused:
            return jls.apply_gradients(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(1, 2) if donate else ())
    params, state = jax.tree.map(jnp.copy, PARAMS), tx.init(PARAMS)
    seen = []
    for value in (1.0, 2.0, jnp.nan, 3.0, 4.0):
        params, state = step(_grads(value), state, params)
        seen.append(np.asarray(state.hooks["sum_updates"]["seen"]).tolist())
    # Call 0: six updates of -0.5, the new parameters 4 * 0.5 + 2 * -0.5.
    # Call 4: six of -2; the parameters were 1 - 0.5 * (1 + 2 + 3) = -2 (w)
    # and -3 (b), and become -4 and -5: 4 * -4 + 2 * -5.
    assert seen == [[-3.0, 1.0]] * 4 + [[-12.0, -26.0]]
    chex.assert_max_traces(n=1)


class AddReads(jls.hooks.Hook):
    """Adds up what it reads of every step's updates and new parameters."""

    name = "add_reads"

    def init(self, params):
        return jnp.zeros(2)

    def reads_updates(self, state):
        return True  # inline, every step

    def read_updates(self, state, new_params, updates):
        return jnp.stack(
            [
                sum(jnp.sum(u) for u in jax.tree.leaves(updates)),
                sum(jnp.sum(p) for p in jax.tree.leaves(new_params)),
            ]
        )

    def update(self, state, info, vetoed):
        assert info.reads is not None
        return state + info.reads[self.name]


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_reads_zeros_not_its_nan_updates(fused):
    # The read runs beside the update on every step; a skipped step's
    # reads are zeros of their types (its updates are nan here).
    tx = jls.loss_scaling(optax.sgd(0.5), jls.no_scale(), hooks=[AddReads()])

    def step(g, s, p):
        if fused:
            return jls.apply_gradients(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step)
    params, state = PARAMS, tx.init(PARAMS)
    for value in (1.0, jnp.nan, 2.0):
        params, state = step(_grads(value), state, params)
    # Call 0: six updates of -0.5, new parameters 4 * 0.5 + 2 * -0.5; call 2:
    # six of -1, new parameters 4 * -0.5 + 2 * -1.5.
    assert np.asarray(state.hooks["add_reads"]).tolist() == [-9.0, -4.0]


def test_hook_misuse_is_named():
    with pytest.raises(TypeError, match="hooks must be a sequence of jls.hooks.Hook"):
        jls.loss_scaling(optax.sgd(0.1), hooks=SkipHighLoss())
    with pytest.raises(TypeError, match="hooks must be a sequence of jls.hooks.Hook"):
        jls.loss_scaling(optax.sgd(0.1), hooks=[lambda s, i: True])
    with pytest.raises(TypeError, match="hooks must be a sequence.*got None"):
        jls.LossScaling(optax.sgd(0.1), hooks=None)  # pyright: ignore[reportArgumentType]
    tx = jls.loss_scaling(optax.sgd(0.1), hooks=[SkipHighLoss()])
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"\['skip_high_loss'\] watch the loss"):
        tx.update(_grads(), state, PARAMS)

    class BadVeto(jls.hooks.Hook):
        name = "bad_veto"

        def veto(self, state, info):
            return jnp.float32(1.0)

    bad = jls.loss_scaling(optax.sgd(0.1), hooks=[BadVeto()])
    with pytest.raises(TypeError, match="hook 'bad_veto': veto must return a scalar"):
        bad.update(_grads(), bad.init(PARAMS), PARAMS)


def test_a_hook_class_with_jls_0_3s_metrics_classmethod_is_told_the_new_way():
    with pytest.warns(DeprecationWarning, match="metrics come from its state"):

        class Old(jls.hooks.Hook):  # pyright: ignore[reportUnusedClass]
            name = "old"

            @classmethod
            def metrics(cls, state):
                return {}


class SameKey(NamedTuple):
    """A state that reports a key a built-in hook reports."""

    value: jax.Array

    def metrics(self):
        return {"spike": self.value}


class Shadow(jls.hooks.Hook):
    """A user hook whose state reports a key a built-in reports."""

    name = "shadow"

    def init(self, params):
        return SameKey(jnp.bool_(True))


def test_no_registry_a_user_hook_cannot_replace_a_built_in_hooks_metrics():
    # 0.3 looked metrics up in a global registry by hook name: a user hook
    # named "spikes" replaced the spike rule's metrics for every
    # transformation. Now each state reports its own, and a clash is refused.
    tx = jls.loss_scaling(optax.sgd(0.1), hooks=[Shadow()])
    state = tx.init({"w": jnp.ones(2)})
    assert bool(jls.metrics(state)["spike"])  # its own, no spike rule here
    clash = jls.loss_scaling(
        optax.sgd(0.1), skip_spikes=jls.hooks.SpikeRule(), hooks=[Shadow()]
    )
    with pytest.raises(ValueError, match="report 'spike' twice"):
        jls.metrics(clash.init({"w": jnp.ones(2)}))


def test_two_hooks_of_one_name_are_refused_at_construction():
    with pytest.raises(ValueError, match="distinct names"):
        jls.loss_scaling(optax.sgd(0.1), hooks=[Shadow(), Shadow()])


def test_a_hook_checks_itself_against_the_scaler_the_axes_and_the_hooks():
    seen = []

    class Looks(jls.hooks.Hook):
        name = "looks"

        def check(self, context):
            seen.append(context)

    looks = Looks()
    scaler = jls.static_scale(4.0)
    jls.loss_scaling(optax.sgd(0.1), scaler, axis_name="batch", hooks=[looks])
    (context,) = seen
    assert context._fields == ("scaler", "axis_name", "hooks")  # no donated
    assert context.scaler == scaler and context.axis_name == ("batch",)
    assert [h.name for h in context.hooks] == ["nonfinite_loss", "divergence", "looks"]
