"""The decision: the check, the replicas' agreement and the hooks' vetoes."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._compat import varying_axes
from jls._config import Config
from jls._finite import all_finite, unscaled_finite
from jls._squares import unscaled_measured, unscaled_norm
from jls._state import LossScaleState
from jls.hooks._hooks import StepInfo


class Decision(NamedTuple):
    """A step's decision, agreed across replicas.

    Attributes:
      finite: the unscaled gradients are all finite and the scale is in range.
      apply: the update is applied (before the hooks' vetoes).
      magnitude: float32, the scaled gradients' largest root-mean-square.
      norm: float32, the global norm of the unscaled gradients.
    """

    finite: jax.Array
    apply: jax.Array
    magnitude: jax.Array | None = None
    norm: jax.Array | None = None


def decide(
    config: Config, grads: Any, loss_scale: LossScaleState, *, also_finite: Any = None
) -> Decision:
    """The step's decision and measurements, agreed in one scalar all-reduce."""
    _check_gradient_dtypes(grads)
    hint_bfloat16(config, grads)
    scale = loss_scale.scale
    below_one = config.scaler.min_scale_f32 < 1
    valid = config.scaler.in_range(scale)
    also = jnp.asarray(True) if also_finite is None else all_finite(also_finite)
    magnitude = norm = None
    if config.measures:  # the rows it reduces and the flags: one all-reduce
        measured = unscaled_measured(
            grads,
            scale,
            scale_may_be_below_one=below_one,
            named=config.axis_name,
            flags=(also, valid),
        )
        (also, valid), magnitude = measured.flags, measured.magnitude
        finite = measured.finite & also
        norm = unscaled_norm(measured, scale)
    else:
        finite = unscaled_finite(grads, scale, scale_may_be_below_one=below_one)
        finite, valid = agree(config, [finite & also, valid], lax.pmin)
    finite = finite & valid
    apply = finite if config.scaler.skip_nonfinite else valid
    return Decision(finite, apply, magnitude, norm)


def vetoes(
    config: Config, hook_states: dict[str, Any], info: StepInfo, apply: jax.Array
) -> tuple[dict[str, jax.Array], jax.Array | None]:
    """Each vetoing hook's agreed veto, and whether one holds the scale."""
    names, flags = [], []
    for h in config.hooks:
        veto = h.veto(hook_states[h.name], info)
        if veto is not None:
            veto = jnp.asarray(veto)
            if veto.dtype != jnp.bool_ or veto.shape != ():
                raise TypeError(
                    f"hook {h.name!r}: veto must return a scalar bool or None, "
                    f"got dtype {veto.dtype} and shape {veto.shape}"
                )
            names.append(h.name)
            flags.append(veto)
    if not flags:
        return {}, None
    agreed = dict(zip(names, agree(config, flags, lax.pmax), strict=True))
    vetoed = {n: apply & v for n, v in agreed.items()}
    holding = [
        agreed[h.name] for h in config.hooks if h.holds_scale and h.name in agreed
    ]
    held = None
    if holding:
        held = holding[0]
        for v in holding[1:]:
            held = held | v
    return vetoed, held


def gradient_factor(config: Config, hook_states: dict[str, Any], info: StepInfo) -> Any:
    """The product of the hooks' factors (others read as 1), or ``None``."""
    factor = None
    for h in config.hooks:
        f = h.gradient_factor(hook_states[h.name], info)
        if f is None:
            continue
        f = jnp.asarray(f)
        if f.shape != () or not jnp.issubdtype(f.dtype, jnp.floating):
            raise TypeError(
                f"hook {h.name!r}: gradient_factor must return a floating "
                f"scalar or None, got dtype {f.dtype} and shape {f.shape}"
            )
        f = f.astype(jnp.float32)
        f = jnp.where((f >= 0) & (f <= 1), f, jnp.float32(1))
        factor = f if factor is None else factor * f
    if factor is None:
        return None
    # Every replica applies the same update: the smallest factor.
    axes = axes_of(config, factor)
    return lax.pmin(factor, axes) if axes else factor


def axes_of(config: Config, x: jax.Array) -> tuple[str, ...]:
    """``axis_name`` and every other ``shard_map`` axis ``x`` varies over."""
    named = config.axis_name
    return named + tuple(sorted(varying_axes(x) - set(named)))


def loss_for_hooks(
    config: Config, extra_args: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """``loss=`` for the hooks that watch it: the replicas' mean."""
    watchers = [h.name for h in config.hooks if h.needs_loss]
    readers = watchers or [h.name for h in config.hooks if h.reads_loss]
    if not readers:
        return None, extra_args
    rest = dict(extra_args)
    loss = rest.pop("loss", None)
    if loss is None:
        if not watchers:
            return None, rest
        raise TypeError(
            f"the hooks {watchers} watch the loss: pass loss=<the unscaled "
            "loss> to update / apply_gradients (jls.train_step passes it)"
        )
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"loss must be a floating scalar, got dtype {loss.dtype} and shape "
            f"{loss.shape}"
        )
    loss = loss.astype(jnp.float32)
    axes = axes_of(config, loss)
    return (lax.pmean(loss, axes) if axes else loss), rest


def agree(config: Config, flags: list[jax.Array], reduce: Any) -> list[jax.Array]:
    """Bool ``flags`` reduced by ``lax.pmin`` or ``pmax``, in one collective."""
    out = []
    for group in _by_shape(flags):
        stacked = jnp.stack([f.astype(jnp.int32) for f in group])
        axes = axes_of(config, stacked)
        agreed = reduce(stacked, axes) > 0 if axes else stacked > 0
        out.extend(agreed[i] for i in range(len(group)))
    return out


def same_on_replicas(
    config: Config, values: list[jax.Array], axes: tuple[str, ...] | None = None
) -> jax.Array:
    """Whether float32 scalar ``values`` are bitwise equal over ``axes``."""
    axes = config.axis_name if axes is None else axes
    if not axes:
        return jnp.asarray(True)
    bits = lax.bitcast_convert_type(jnp.stack(values), jnp.int32)
    both = lax.pmax(jnp.concatenate([bits, ~bits]), axes)
    n = bits.shape[0]
    return jnp.all(both[:n] == bits) & jnp.all(~both[n:] == bits)


def hint_bfloat16(config: Config, grads: Any) -> None:
    """Warns, at trace time, that bfloat16 gradients need no dynamic scale."""
    if config.scaler.measures or not config.scaler.is_dynamic:
        return
    dtypes = {
        np.dtype(x.dtype)
        for x in jax.tree.leaves(grads)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    }
    if dtypes == {np.dtype(jnp.bfloat16)}:
        warnings.warn(
            "every gradient is bfloat16, which has float32's range: a dynamic "
            "loss scale only costs time there. For skip-on-nan use "
            "jls.loss_scaling(inner, jls.no_scale()); loss scaling is for "
            "float16 (and fp8) gradients",
            UserWarning,
            stacklevel=5,
        )


def _by_shape(flags: list[jax.Array]) -> list[list[jax.Array]]:
    """``flags`` grouped by shape, in order (scalars together)."""
    groups: dict[tuple[int, ...], list[jax.Array]] = {}
    for f in flags:
        groups.setdefault(tuple(f.shape), []).append(f)
    if len(groups) == 1:
        return list(groups.values())
    return [[f] for f in flags]


def _check_gradient_dtypes(grads: Any) -> None:
    """Refuses, at trace time, gradient dtypes with no zero (``float8_e8m0fnu``)."""
    for leaf in jax.tree.leaves(grads):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and np.dtype(dtype).name == "float8_e8m0fnu":
            raise TypeError(
                "a gradient leaf has dtype float8_e8m0fnu, which has no zero: it "
                "cannot hold gradients or updates (every zero becomes nan). Keep "
                "such scale factors out of the optimized tree (e.g. optax.masked)."
            )
