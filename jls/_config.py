"""A loss-scaled step's configuration: validated once, frozen, closed over."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optax

from jls._builtins import checked_hooks
from jls._dynamic import dynamic_scale
from jls._inner import Transformation, checked_inner
from jls._off import is_off
from jls._rule import LossScaler, checked_scaler
from jls._shards import named_axes
from jls.hooks._hooks import Hook, HookContext
from jls.hooks._nonfinite_loss import NonfiniteLoss


@dataclasses.dataclass(frozen=True)
class Config:
    """What a `jls.LossScaling` was made with.

    Attributes:
      inner: the wrapped optimizer (with extra-args support).
      scaler: the `jls.LossScaler`.
      axis_name: the axes replicas agree over, a tuple (empty without one).
      hooks: every hook the step consults, in order, names unique.
    """

    inner: optax.GradientTransformationExtraArgs
    scaler: LossScaler
    axis_name: tuple[str, ...]
    hooks: tuple[Hook, ...]

    @property
    def off(self) -> bool:
        """Whether the step is the inner optimizer's own (the off switch)."""
        return is_off(self.scaler, self.hooks)

    @property
    def measures(self) -> bool:
        """Whether the check is the squares check (the rule or a hook reads it)."""
        return self.scaler.measures or any(h.needs_norm for h in self.hooks)

    @property
    def reads_loss(self) -> bool:
        """Whether a hook reads the loss (`jls.train_step` then passes it)."""
        return any(h.needs_loss or h.reads_loss for h in self.hooks)


def make_config(
    inner: Transformation,
    scaler: LossScaler | None,
    *,
    axis_name: Any,
    hooks: Sequence[Hook],
) -> Config:
    """A validated `Config`: the always-on `NonfiniteLoss`, then ``hooks``.

    Raises:
      TypeError, ValueError: naming the argument, for a bad value, two hooks
        of one name, or a hook that does not fit the rest (its `Hook.check`).
    """
    inner = checked_inner(inner)
    scaler = dynamic_scale() if scaler is None else checked_scaler(scaler)
    axes = named_axes(axis_name)
    found = (NonfiniteLoss(skips=scaler.skip_nonfinite), *checked_hooks(hooks))
    names = [h.name for h in found]
    if len(set(names)) != len(names):
        raise ValueError(f"hooks must have distinct names, got {names}")
    context = HookContext(scaler, axes, found)
    for hook in found:
        hook.check(context)
    return Config(inner, scaler, axes, found)
