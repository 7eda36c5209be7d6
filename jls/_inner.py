"""The wrapped optimizer: anything with optax's ``init``/``update``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, cast

import optax


class Transformation(Protocol):
    """Anything with optax's ``init``/``update`` (also ``optax.MultiSteps``)."""

    @property
    def init(self) -> Callable[..., Any]: ...

    @property
    def update(self) -> Callable[..., Any]: ...


def with_extra_args(inner: Transformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` as an optax pair whose ``update`` takes extra arguments.

    ``optax.with_extra_args_support`` would drop them for ``optax.MultiSteps``.
    """
    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return inner
    try:
        parameters = inspect.signature(inner.update).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        parameters = ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return optax.GradientTransformationExtraArgs(inner.init, inner.update)
    return optax.with_extra_args_support(cast(optax.GradientTransformation, inner))


def checked_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    """``inner`` with extra-args support, or a ``TypeError`` naming the fix."""
    if not (
        callable(getattr(inner, "init", None))
        and callable(getattr(inner, "update", None))
    ):
        hint = ""
        if callable(inner):
            hint = (
                " (an optimizer factory? call it: loss_scaling(optax.adam(1e-3)),"
                " not loss_scaling(optax.adam))"
            )
        if hasattr(inner, "adjust") and hasattr(inner, "init"):
            hint = " (a scaler: the optimizer comes first: loss_scaling(inner, scaler))"
        raise TypeError(
            "inner must be an optax.GradientTransformation, got "
            f"{type(inner).__name__}{hint}: {inner!r:.200}"
        )
    return with_extra_args(inner)
