"""Finding the state in any optax state; refusing loss_scaling in a chain."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

# pyright: reportIndexIssue=false
import flax.nnx as nnx
import jax.numpy as jnp
import optax
import pytest
from steps import _params

import jls


def test_loss_scaling_chained_beside_other_transformations_is_refused():
    params = _params()
    for tx in (
        optax.chain(optax.clip_by_global_norm(1.0), jls.loss_scaling(optax.sgd(0.1))),
        optax.chain(jls.loss_scaling(optax.sgd(0.1)), optax.add_decayed_weights(0.1)),
        optax.chain(optax.identity(), jls.loss_scaling(optax.sgd(0.1))),
    ):
        state = tx.init(params)
        fix = r"jls.loss_scaling\(optax.chain\("
        for use in (
            lambda s: jls.scale_loss(jnp.float32(1.0), s),
            jls.metrics,
            jls.loss_scale_state,
        ):
            with pytest.raises(ValueError, match=fix):
                use(state)
        with pytest.raises(TypeError, match="made by jls.loss_scaling"):
            jls.apply_gradients(tx, params, state, params)
    # Alone in a chain, or with the others inside, it is found.
    for tx in (
        optax.chain(jls.loss_scaling(optax.sgd(0.1))),
        jls.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))),
    ):
        state = tx.init(params)
        assert float(jls.loss_scale_state(state).scale) == 2.0**15
        assert float(optax.tree.get(state, "scale")) == 2.0**15


def test_loss_scale_state_errors():
    with pytest.raises(
        ValueError, match=r"exactly one jls.LossScaleState, found none\."
    ):
        jls.loss_scale_state(optax.sgd(1.0).init({"w": jnp.zeros(1)}))
    two = (jls.no_scale().init(), jls.no_scale().init())
    with pytest.raises(ValueError, match="found 2"):
        jls.loss_scale_state(two)
    with pytest.raises(ValueError, match="found none"):
        jls.scale_loss(1.0, {})


def test_loss_scale_state_in_multisteps_and_nnx():
    params = {"w": jnp.zeros(2)}
    tx = optax.MultiSteps(
        jls.loss_scaling(optax.sgd(1.0), jls.static_scale(8.0)),
        2,
        should_skip_update_fn=optax.skip_not_finite,
    )
    assert float(jls.loss_scale_state(tx.init(params)).scale) == 8.0
    tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2), jls.static_scale(4.0))
    assert float(jls.loss_scale_state(tx.init(params)).scale) == 4.0

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    opt = nnx.Optimizer(
        Model(), jls.loss_scaling(optax.sgd(1.0), jls.static_scale(16.0)), wrt=nnx.Param
    )
    assert float(jls.loss_scale_state(opt.opt_state).scale) == 16.0
    assert float(jls.metrics(opt.opt_state)["loss_scale"]) == 16.0
