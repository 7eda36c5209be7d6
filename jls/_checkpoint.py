"""`upgrade_state`: checkpoints of an older jls, whose states had fewer fields."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jls._state import LossScaleState
from jls.hooks._hooks import LossScalingState
from jls.hooks._spikes import SpikeState

_MISSING = object()

# Per hook, each field's path inside its 0.3 state (a bare value or a dict).
_HOOK_FIELDS_0_3 = {
    "gradient_norm": {"norm": ()},
    "divergence": {"diverged": ()},
    "nonfinite_loss": {"nonfinite": ()},
    "diagnostics": {"nonfinite_leaves": ()},
    "replicas": {"differ": ("differ",), "mismatches": ("steps",)},
}


# jls 0.1 and 0.2 kept each hook's state in a state field of its own.
_OLD_FIELDS = {
    "diagnostics": "nonfinite_leaves",
    "divergence": "diverged",
    "gradient_norm": "gradient_norm",
    "spikes": "spikes",
}


def _child(node: Any, key: Any) -> Any:
    """``node``'s child at one key path entry, or `_MISSING`."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        name = key.name
        if isinstance(node, dict):
            return node.get(name, _MISSING)
        return getattr(node, name, _MISSING)
    if isinstance(key, jax.tree_util.DictKey):
        if isinstance(node, dict):
            if key.key in node:
                return node[key.key]
            return node.get(str(key.key), _MISSING)
        return _MISSING
    if isinstance(key, jax.tree_util.SequenceKey):
        if isinstance(node, (list, tuple)):
            return node[key.idx] if key.idx < len(node) else _MISSING
        if isinstance(node, dict):  # flax state dicts key sequences by str(i)
            return node.get(str(key.idx), _MISSING)
        return _MISSING
    return _MISSING


def _owned_prefixes(target: Any) -> list[tuple[Any, ...]]:
    """Key paths of the subtrees jls owns (whose fields jls may add)."""
    kinds = (LossScaleState, SpikeState, LossScalingState)
    found = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: isinstance(x, kinds)
    )[0]
    prefixes = []
    for path, node in found:
        if isinstance(node, LossScalingState):
            for name in ("loss_scale", "hooks"):
                prefixes.append((*path, jax.tree_util.GetAttrKey(name)))
        elif isinstance(node, kinds):
            prefixes.append(tuple(path))
    return prefixes


def _leaf_paths(tree: Any) -> set[str]:
    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, (jax.Array, np.ndarray, np.generic))

    return {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
        if leaf is not None
    }


def upgrade_state(restored: Any, target: Any) -> Any:
    """``restored`` in ``target``'s structure, with jls's newer fields filled.

    Each leaf of ``target`` is taken from ``restored`` by key path; a jls
    field the checkpoint lacks (``headroom``) keeps ``target``'s value.

    Args:
      restored: the checkpoint's tree, as restored without a target.
      target: a tree of the structure to restore into (``tx.init(params)``).

    Returns:
      A tree of ``target``'s structure.

    Raises:
      KeyError: if a non-jls leaf is missing or ``restored`` has extra leaves.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1))
      >>> target = tx.init({"w": jnp.zeros(2)})
      >>> old = {  # saved before `headroom`, restored without a target
      ...     "loss_scale": {"scale": jnp.float32(512.0), "growth_count": 7,
      ...                    "backoff_count": 0, "consecutive_skips": 0,
      ...                    "total_skips": 3, "consecutive_nonfinite": 0,
      ...                    "retries": 0},
      ...     "inner_state": [None, None],
      ... }
      >>> state = jls.upgrade_state(old, target)
      >>> float(state.loss_scale.scale), float(state.loss_scale.headroom)
      (512.0, 1.0)
    """
    owned = _owned_prefixes(target)
    used: set[str] = set()
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    upgraded = jax.tree_util.tree_unflatten(
        treedef,
        [_pick(restored, owned, used, tuple(path), leaf) for path, leaf in paths],
    )
    extra = _restored_paths(restored) - used
    if extra:
        raise KeyError(
            "the checkpoint has values the target has no place for: "
            f"{sorted(extra)[:10]} (restore into the structure you saved)"
        )
    return jax.tree.map(lambda x: jax.numpy.asarray(x), upgraded)


def _pick(restored: Any, owned, used: set[str], path: tuple, default: Any) -> Any:
    """The leaf of ``restored`` at ``path`` in any layout, else ``default`` if owned."""
    node, walked, renamed = restored, [], False
    for depth, key in enumerate(path):
        moved = _moved_hook_field(path, depth, node)
        if moved is not None:  # a hook state that was bare, now a field
            for old in moved:
                node = _child(node, jax.tree_util.DictKey(old))
                walked.append(jax.tree_util.DictKey(old))
            continue
        child = _child(node, key)
        if renamed:  # an old layout: the hook's state in a field of its own
            old = _OLD_FIELDS.get(str(getattr(key, "key", "")), "")
            key = jax.tree_util.DictKey(old)
            child = _child(node, key)
            renamed = False
        elif child is _MISSING and getattr(key, "name", None) == "hooks":
            renamed = True
            continue
        if child is _MISSING:
            if any(path[: len(p)] == p for p in owned):
                return default
            raise KeyError(
                "the checkpoint has no value at "
                f"{jax.tree_util.keystr(path)}: restored and target differ "
                "beyond the fields jls added (another model or optimizer?)"
            )
        node = child
        walked.append(key)
    used.add(_normalised(jax.tree_util.keystr(tuple(walked))))
    if isinstance(default, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(node, dtype=_dtype(node, default)).reshape(default.shape)
    return node


def _dtype(saved: Any, default: Any) -> Any:
    """The restored leaf's dtype: the saved one where casting would change bits."""
    dtype = getattr(saved, "dtype", None)
    if dtype is None or dtype == default.dtype:
        return default.dtype
    both_float = all(jnp.issubdtype(d, jnp.floating) for d in (dtype, default.dtype))
    return dtype if both_float and jnp.finfo(dtype).bits <= 32 else default.dtype


def _moved_hook_field(path: tuple[Any, ...], depth: int, node: Any) -> tuple | None:
    """The older sub-path of hook field ``path[depth]`` if ``node`` lacks it."""
    if depth < 2 or getattr(path[depth - 2], "name", None) != "hooks":
        return None
    fields = _HOOK_FIELDS_0_3.get(str(getattr(path[depth - 1], "key", "")))
    field = getattr(path[depth], "name", None)
    if fields is None or not isinstance(field, str) or field not in fields:
        return None
    if isinstance(node, dict) and field in node:
        return None  # saved by jls 0.4
    if not isinstance(node, dict) and hasattr(node, field):
        return None
    return fields[field]


def _normalised(path: str) -> str:
    """A key path in the raw form: ``.name`` and ``[0]`` as ``['name']``/``['0']``."""
    path = re.sub(r"\.(\w+)", r"['\1']", path)
    return re.sub(r"\[(\d+)\]", r"['\1']", path)


def _restored_paths(restored: Any) -> set[str]:
    return {_normalised(p) for p in _leaf_paths(restored)}
