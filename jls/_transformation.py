"""`LossScaling`: the object that owns a loss-scaled step, and its optax pair."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import optax

from jls._builtins import keywords_refused, warn_donated
from jls._composition import check_not_masked, not_loss_scaling
from jls._config import Config, make_config
from jls._core import step
from jls._inner import Transformation
from jls._rule import LossScaler
from jls.hooks._hooks import Hook, LossScalingState


class LossScaling:
    """Loss scaling around an optax optimizer: the object that owns the step.

    `jls.loss_scaling` returns its `gradient_transformation`; it takes hooks,
    not the feature keywords (so no divergence flag unless given one).

    Args:
      inner: the optimizer to wrap (any ``optax.GradientTransformation``).
      scaler: a `LossScaler`; default ``jls.dynamic_scale()``.
      axis_name: the axis name (or names) replicas agree over.
      hooks: the `jls.hooks.Hook` objects the step consults, in order.
      **options: refused, naming the hooks a feature keyword stands for.

    Attributes:
      config: the frozen configuration (its fields are attributes too).

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> scaling = jls.LossScaling(optax.sgd(0.5), jls.static_scale(2.0))
      >>> tx = scaling.gradient_transformation()
      >>> p = jnp.ones(2)
      >>> scaling.apply_gradients(jnp.full(2, 2.0), tx.init(p), p)[0]
      Array([0.5, 0.5], dtype=float32)
    """

    def __init__(
        self,
        inner: Transformation,
        scaler: LossScaler | None = None,
        *,
        axis_name: str | tuple[str, ...] | dict[str, Any] | None = None,
        hooks: Sequence[Hook] = (),
        **options: Any,
    ) -> None:
        if "donated" in options:  # deprecated, as loss_scaling's
            warn_donated("LossScaling", options.pop("donated"))
        if options:  # jls.loss_scaling's feature keywords: say which hooks
            raise keywords_refused(options)
        self.config = make_config(inner, scaler, axis_name=axis_name, hooks=hooks)

    inner = property(lambda self: self.config.inner, doc="The wrapped optimizer.")
    scaler = property(lambda self: self.config.scaler, doc="The `jls.LossScaler`.")
    axis_name = property(lambda self: self.config.axis_name, doc="The axes.")
    hooks = property(lambda self: self.config.hooks, doc="The hooks, in order.")

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LossScaling(inner={c.inner!r:.80}, scaler={c.scaler!r}, axis_name="
            f"{c.axis_name!r}, hooks={c.hooks!r})"
        )

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """The optax pair: ``init`` and ``update`` of this object."""
        update = cast(optax.TransformUpdateExtraArgsFn, self.update)
        return optax.GradientTransformationExtraArgs(self.init, update)

    def init(self, params: optax.Params) -> LossScalingState:
        """The state before the first step (a `jls.LossScalingState`)."""
        check_not_masked(params, "parameters")
        c = self.config
        hooks = {h.name: h.init(params) for h in c.hooks}
        return LossScalingState(c.scaler.init(), c.inner.init(params), hooks)

    def update(
        self,
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        """Optax's ``update``: takes the SCALED gradients (see `jls.loss_scaling`)."""
        return step(self.config, updates, state, params, extra_args, fused=False)

    def apply_gradients(
        self,
        grads: optax.Updates,
        opt_state: optax.OptState,
        params: optax.Params,
        **extra_args: Any,
    ) -> tuple[optax.Params, LossScalingState]:
        """`jls.apply_gradients` with this object as ``tx``: the fused step."""
        return step(self.config, grads, opt_state, params, extra_args, fused=True)


def config_of(tx: Any) -> Config:
    """The configuration behind ``tx`` (made by `jls.loss_scaling`).

    Raises:
      TypeError: naming the fix, if ``tx`` was not made by `jls.loss_scaling`.
    """
    if isinstance(tx, LossScaling):
        return tx.config
    owner = getattr(getattr(tx, "update", None), "__self__", None)
    if not isinstance(owner, LossScaling):
        raise not_loss_scaling(tx, owner)
    return owner.config


MISSING: Any = object()
