"""The step: a few pure functions over a frozen configuration.

One loss-scaled step for every entry point: `validate`, `prepare`,
`jls._decision.decide` and `finish`; `step` chains them (docs/design.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jls._composition import check_not_masked
from jls._cond import select_tree, zeros_like
from jls._config import Config
from jls._decision import (
    Decision,
    agree,
    decide,
    gradient_factor,
    loss_for_hooks,
    same_on_replicas,
    vetoes,
)
from jls._off import off_step, warn_float16
from jls._scaling import check_scaled_with, reciprocals, unscale_leaf
from jls._state import LossScaleState, check_state
from jls._tree import holds, merge, split_frozen, split_inexact
from jls.hooks._hooks import LossScalingState, StepInfo, read_hooks_updates


class Prepared(NamedTuple):
    """A step's validated inputs: its ``state``, the hooks' ``loss``, ``extra_args``."""

    state: LossScalingState
    loss: jax.Array | None
    extra_args: dict[str, Any]


class Split(NamedTuple):
    """A fused step's parameters: ``trained``, ``frozen`` (no gradient), ``rest``."""

    trained: Any
    frozen: Any
    rest: Any


def split(params: Any, grads: Any) -> Split:
    """``params`` (a whole model too) split into what a fused step trains."""
    floating, rest = split_inexact(params)
    trained, frozen = split_frozen(floating, grads)
    return Split(trained, frozen, rest)


def validate(config: Config, opt_state: Any, params: Any) -> LossScalingState:
    """The step's state, validated once (boxed ``nnx`` leaves unwrapped).

    Raises:
      TypeError: for a state this transformation did not make, or
        ``params`` and ``opt_state`` swapped.
    """
    _check_order(opt_state, params)
    return _validated(config, opt_state)


def prepare(
    config: Config,
    grads: Any,
    state: LossScalingState,
    extra_args: dict[str, Any],
    *,
    stacklevel: int = 5,
) -> Prepared:
    """The composition checked and the loss taken, for a `validate`-d state.

    Raises:
      TypeError: for masked gradients, or a ``loss=`` a hook needs missing.
    """
    check_not_masked(grads, "gradients")
    if config.scaler.is_identity:  # scale 1: any pairing is right
        warn_float16(grads, off=config.off)
    else:
        check_scaled_with(state.loss_scale.scale, stacklevel=stacklevel)
    loss, args = loss_for_hooks(config, extra_args)
    return Prepared(state, loss, args)


def step(
    config: Config,
    grads: Any,
    opt_state: Any,
    params: Any,
    extra_args: dict[str, Any],
    *,
    fused: bool,
    also_finite: Any = None,
) -> tuple[Any, LossScalingState]:
    """``tx.update`` (``fused=False``: the updates) or the fused step (the params).

    ``also_finite``: values checked with the gradients, not unscaled (fp8).
    """
    state = validate(config, opt_state, params)
    prepared = prepare(config, grads, state, extra_args)
    parts = split(params, grads) if fused else None
    trained = parts.trained if parts is not None else params
    decision = None
    if not config.off:  # the off switch checks nothing
        decision = decide(config, grads, state.loss_scale, also_finite=also_finite)
    out, state = finish(config, grads, prepared, trained, decision, fused=fused)
    if parts is not None:
        out = merge(merge(out, parts.frozen), parts.rest)
    return out, state


def finish(
    config: Config,
    grads: Any,
    prepared: Prepared,
    params: Any,
    decision: Decision | None,
    *,
    fused: bool,
    retries: jax.Array | None = None,
) -> tuple[Any, LossScalingState]:
    """The step after its decision: vetoes, the skip, the scale rule, the records."""
    state, loss, args = prepared
    if config.off:
        return off_step(config.inner, grads, state, params, args, fused, loss)
    assert decision is not None
    info = step_info(config, grads, state, decision, loss)
    vetoed, held = vetoes(config, state.hooks, info, decision.apply)
    apply = decision.apply
    for v in vetoed.values():
        apply = apply & ~v
    unscaled = unscaled_grads(config, grads, state, info)
    updates, inner_state = config.inner.update(
        unscaled, state.inner_state, params, **args
    )
    readers = [
        h for h in config.hooks if h.reads_updates(state.hooks[h.name]) is not None
    ]
    new = optax.apply_updates(params, updates) if fused or readers else None
    reads = read_hooks_updates(readers, state.hooks, params, new, updates)
    if fused:
        out = select_tree(apply, new, params)
    else:
        out = select_tree(apply, updates, zeros_like(updates, grads, params))
    inner_state = select_tree(apply, inner_state, state.inner_state)
    loss_scale = adjusted(
        config, state.loss_scale, decision, apply, vetoed, held, retries
    )
    hooks = recorded(config, state.hooks, info, apply, loss_scale, reads, vetoed)
    return out, LossScalingState(loss_scale, inner_state, hooks)


def step_info(
    config: Config,
    grads: Any,
    state: LossScalingState,
    decision: Decision,
    loss: jax.Array | None,
) -> StepInfo:
    """What the hooks see of the step before it is applied (`StepInfo`)."""
    return StepInfo(
        grads=grads,
        scale=state.loss_scale.scale,
        finite=decision.finite,
        norm=decision.norm,
        loss=loss,
        applied=None,
        loss_scale=None,
        any_replica=lambda flags: agree(config, flags, lax.pmax),
        same_on_replicas=lambda values, axes=None: same_on_replicas(
            config, values, axes
        ),
        axis_name=config.axis_name,
    )


def unscaled_grads(
    config: Config, grads: Any, state: LossScalingState, info: StepInfo
) -> Any:
    """The gradients unscaled, times the hooks' factor: one multiplication a leaf."""
    factors = {}
    if not config.scaler.is_identity:  # no factors: the scale is 1 forever
        two = config.scaler.two_factor
        factors = reciprocals(state.loss_scale.scale, grads, two_factor=two)
    shrink = gradient_factor(config, state.hooks, info)
    if not factors and shrink is None:
        return grads
    return jax.tree.map(lambda g: unscale_leaf(g, factors, shrink), grads)


def adjusted(
    config: Config,
    old: LossScaleState,
    decision: Decision,
    apply: jax.Array,
    vetoed: dict[str, jax.Array],
    held: jax.Array | None,
    retries: jax.Array | None = None,
) -> LossScaleState:
    """The scale rule after the step (held where a holding veto skipped it)."""
    scaler = config.scaler
    # With skip_nonfinite and no veto, finite == applied: the rule reads one flag.
    known = scaler.skip_nonfinite and not vetoed
    new = scaler.adjust(
        old,
        apply if known else decision.finite,
        applied=apply,
        magnitude=decision.magnitude,
        retries=retries,
    )
    if held is None:
        return new
    kept = scaler.hold(old, decision.finite)
    hold = held & ~apply
    return jax.tree.map(lambda k, n: jnp.where(hold, k, n), kept, new)


def recorded(
    config: Config,
    hook_states: dict[str, Any],
    info: StepInfo,
    apply: jax.Array,
    loss_scale: LossScaleState,
    reads: dict[str, Any],
    vetoed: dict[str, jax.Array],
) -> dict[str, Any]:
    """Each hook's state after the step, by name (``reads`` zero if skipped)."""
    nothing = jax.tree.map(jnp.zeros_like, reads)
    reads = select_tree(apply, reads, nothing)
    after = info._replace(applied=apply, loss_scale=loss_scale, reads=reads)
    no_veto = jnp.asarray(False)
    return {
        h.name: h.update(hook_states[h.name], after, vetoed.get(h.name, no_veto))
        for h in config.hooks
    }


def _validated(config: Config, opt_state: Any) -> LossScalingState:
    """``opt_state`` if this configuration's ``init`` made it, leaves unboxed."""
    if not isinstance(opt_state, LossScalingState):
        hint = ""
        if holds(opt_state, LossScalingState):
            hint = (
                ": it holds one, inside other states (optax.chain?). Put "
                "every transformation inside loss_scaling, e.g. "
                "jls.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), "
                "optax.adam(1e-3))), and pass its state"
            )
        raise TypeError(
            "opt_state must be the state made by this transformation's init "
            f"(tx.init(params)), got {type(opt_state).__name__}{hint}"
        )
    hooks = opt_state.hooks
    missing = [h.name for h in config.hooks if h.name not in hooks]
    if missing or not isinstance(hooks, dict):
        raise TypeError(
            f"opt_state has no state for the hooks {missing}: it was not made "
            "by this transformation's init (a transformation made with other "
            "options, such as diagnostics=, gradient_norm=, skip_spikes=)"
        )
    loss_scale = check_state(opt_state.loss_scale, argname="opt_state.loss_scale")
    return opt_state._replace(loss_scale=loss_scale)


def _check_order(opt_state: Any, params: Any) -> None:
    """Refuses ``params`` and ``opt_state`` passed the wrong way round."""
    if isinstance(params, LossScalingState) and not isinstance(
        opt_state, LossScalingState
    ):
        raise TypeError(
            "params is this transformation's state and opt_state is not: they "
            "are swapped. Call apply_gradients(tx, grads, opt_state, params)"
        )
