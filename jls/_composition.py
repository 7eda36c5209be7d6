"""Compositions that hide jls from its caller: refused at trace time, by path.

A transformation whose state holds jls's runs around it and quietly trains
wrongly (docs/howto/composing.md lists each case).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

_INSIDE = (
    "Put it inside loss_scaling, which then sees every gradient first and "
    "hands it on unscaled: "
)

_CHAINED = (
    "opt_state is the state of {chain}(..., jls.loss_scaling(inner), ...): "
    "the transformations chained before loss_scaling see the scaled gradients (a "
    "clip by global norm clips loss-scale times too hard) and those after it "
    "change the parameters on skipped steps. Put them inside: "
    "jls.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), inner), scaler)"
    "{also}"
)

_REFUSED = {
    "MaskedState": (
        "opt_state is the state of optax.masked(jls.loss_scaling(inner), mask): "
        "the masked-out parameters' updates are their loss-scaled gradients, "
        "passed through as they are. " + _INSIDE + "jls.loss_scaling(optax.masked("
        "inner, mask), scaler)"
    ),
    "PartitionState": (
        "opt_state is the state of optax.multi_transform / optax.partition with "
        "jls.loss_scaling in one group: the other groups step with the "
        "loss-scaled gradients (the scale times too large) and skip nothing. "
        + _INSIDE
        + "jls.loss_scaling(optax.partition({'a': inner_a, 'b': inner_b}, "
        "labels), scaler)"
    ),
    "MultiStepsState": (
        "opt_state is the state of optax.MultiSteps(jls.loss_scaling(inner), k) "
        "without should_skip_update_fn: MultiSteps accumulates the scaled "
        "gradients and resets its accumulator as 0 * acc, so one nan micro-batch "
        "poisons every later window (each is skipped, with no error). "
        + _INSIDE
        + "jls.loss_scaling(optax.MultiSteps(inner, k), scaler): each micro-batch "
        "is then checked before it reaches the accumulator"
    ),
    "ApplyIfFiniteState": (
        "opt_state is the state of optax.apply_if_finite(jls.loss_scaling(inner), "
        "n): apply_if_finite drops the non-finite steps before jls sees them, so "
        "the loss scale never backs off and a float16 run overflows on every "
        "step. jls skips non-finite steps itself: drop apply_if_finite, "
        "jls.loss_scaling(inner, scaler)"
    ),
}
_REFUSED["MultiTransformState"] = _REFUSED["PartitionState"]
# Wrappers that hand every gradient to jls unchanged and step nothing else.
_SAFE = {"InjectHyperparamsState", "InjectStatefulHyperparamsState"}
_SCHEDULED = (
    "opt_state is the state of optax.inject_hyperparams(<a factory of "
    "jls.loss_scaling>)(...) with a schedule: the schedule's count advances on "
    "the steps jls skips, so after one skip every scheduled hyperparameter is "
    "a step ahead. " + _INSIDE + "jls.loss_scaling(optax.inject_hyperparams("
    "optax.adam)(learning_rate=schedule), scaler): its count stands still on a "
    "skipped step"
)


def check_path(tree: Any, path: tuple[Any, ...]) -> None:
    """Judges every container on ``path`` from ``tree`` down to jls's state.

    Raises:
      ValueError: for a composition known to train wrongly, naming the fix.

    Warns:
      UserWarning: for any other transformation state on the path.
    """
    node = tree
    for key in path:
        _check_node(node, key)
        node = _child(node, key)


def _check_node(node: Any, key: Any) -> None:
    if type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey):
        others = [c for i, c in enumerate(node) if i != key.idx]
        if any(map(_is_transform_state, others)):
            raise ValueError(_CHAINED.format(chain="optax.chain", also=""))
        return
    if isinstance(node, Mapping) and isinstance(key, jax.tree_util.DictKey):
        others = [c for k, c in node.items() if k != key.key]
        if any(map(_is_transform_state, others)):
            also = (
                " (a dict of separate optimizers' states: pass each its own "
                "state, e.g. jls.scale_loss(loss, opt_states['generator']))"
            )
            raise ValueError(_CHAINED.format(chain="optax.named_chain", also=also))
        return
    if not _is_namedtuple(node):
        return
    kind = type(node).__name__
    field = getattr(key, "name", "")
    module = type(node).__module__ or ""
    wrapper = module.split(".")[0] in ("optax", "jls") or field.startswith("inner")
    scheduled = jax.tree.leaves(getattr(node, "hyperparams_states", None))
    if not wrapper or field == "loss_scale" or (kind in _SAFE and not scheduled):
        return  # a container, jls's own state, or a known-safe wrapper
    if kind in _SAFE:
        raise ValueError(_SCHEDULED)
    if kind == "MultiStepsState" and jax.tree.leaves(getattr(node, "skip_state", ())):
        return  # should_skip_update_fn drops a non-finite micro-batch itself
    if kind in _REFUSED:
        raise ValueError(_REFUSED[kind])
    counters = [
        f"{kind}.{f}"
        for f in getattr(node, "_fields", ())
        if f != field and _ints(jax.tree.leaves(getattr(node, f)))
    ]
    counted = "".join(f" {c} counts the steps jls skips too." for c in counters)
    warnings.warn(
        f"opt_state holds jls's state inside a {kind} (from {module}), the state "
        "of a transformation around jls.loss_scaling: that transformation sees "
        "or passes on the loss-scaled gradients, or acts on steps jls skips."
        f"{counted} {_INSIDE}jls.loss_scaling(<the wrapper>(inner), scaler)",
        UserWarning,
        stacklevel=6,  # the user's call of scale_loss, metrics, ...
    )


def check_not_masked(tree: Any, what: str) -> None:
    """Refuses ``optax.MaskedNode`` leaves: jls inside masked or partition.

    Raises:
      ValueError: naming ``what`` (the gradients or the parameters) and the fix.
    """
    is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    if any(map(is_masked, jax.tree.leaves(tree, is_leaf=is_masked))):
        raise ValueError(
            f"jls.loss_scaling was given {what} with optax.MaskedNode leaves: it "
            "runs inside optax.masked, optax.multi_transform or optax.partition, "
            "so it sees only some of the gradients and the others reach their "
            "optimizer (or the updates) still loss-scaled. "
            + _INSIDE
            + "jls.loss_scaling(optax.partition({'a': inner_a, 'b': inner_b}, "
            "labels), scaler), or jls.loss_scaling(optax.masked(inner, mask), "
            "scaler)"
        )


def not_loss_scaling(tx: Any, owner: Any) -> TypeError:
    """Error for a ``tx`` not made by ``loss_scaling``; ``owner`` owns its update."""
    got = "another transformation"
    if owner is not None:
        got = f"one made by {type(owner).__name__}"
    return TypeError(
        f"tx must be a transformation made by jls.loss_scaling(...) itself, got "
        f"{got}: put every wrapper inside loss_scaling, where it sees unscaled "
        "gradients and nothing of a skipped step, e.g. jls.loss_scaling("
        "optax.MultiSteps(optax.adam(1e-3), k)) to accumulate, jls.loss_scaling("
        "optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))), "
        "jls.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate="
        "1e-3)). (Wrapped the other way round, optax.MultiSteps accumulates the "
        f"scaled gradients and one nan micro-batch poisons every later window.) "
        f"Got {tx!r:.200}"
    )


def _ints(leaves: list[Any]) -> bool:
    """Whether an array of ``leaves`` holds integers (a counter, when stepped)."""
    return any(jnp.issubdtype(getattr(x, "dtype", float), jnp.integer) for x in leaves)


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _is_transform_state(node: Any) -> bool:
    """An optax transformation's state: a NamedTuple, or a chain's tuple of them."""
    if _is_namedtuple(node):
        return True
    return type(node) is tuple and bool(node) and all(map(_is_transform_state, node))


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    name = getattr(key, "name", None)
    if name is not None:
        return getattr(node, name)
    return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0][key.key]
