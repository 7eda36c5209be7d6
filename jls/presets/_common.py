"""What every preset shares: errors that name it and the framework's arguments.

A preset builds its rule through its mapping of jls's field names to the
framework's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from jls._dynamic import DynamicScale
from jls._rule import LossScaler
from jls._static import static_named

F = TypeVar("F", bound=Callable[..., Any])


def preset(fn: F) -> F:
    """Prefixes the errors of ``fn`` with ``jls.presets.<name>:``."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"jls.presets.{fn.__name__}: {err}") from None

    return wrapped  # type: ignore[return-value]


def named(names: Mapping[str, str]) -> Callable[[str], str]:
    """The framework's name for each jls field (its own where not renamed)."""
    return lambda field: names.get(field, field)


def dynamic_rule(names: Mapping[str, str], **fields: Any) -> LossScaler:
    return DynamicScale.named(named(names), **fields)


def static_rule(
    names: Mapping[str, str], value: Any, skip_nonfinite: Any = True
) -> LossScaler:
    return static_named(named(names), value, skip_nonfinite)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
