"""A mixed-precision casting policy, compatible with jmp's.

Casting touches floating arrays only; every other leaf passes through as the
same object (``docs/howto/policy.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jls.precision._autocast import autocast, floating_dtype, is_nnx_module

T = TypeVar("T")

_NAMES = {  # the first name of each is the one str(policy) prints, as jmp does
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(np.float16): ("f16", "float16"),
    np.dtype(np.float32): ("full", "f32", "float32"),
    np.dtype(np.float64): ("f64", "float64"),
}
_DTYPES = {name: dtype for dtype, names in _NAMES.items() for name in names}
_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute"}
_KEYS.update({"o": "output", "output": "output"})


def half_dtype() -> np.dtype:
    """The half-precision dtype of the backend: bfloat16 on TPU, else float16."""
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else np.float16)


def _parse_dtype(name: str, policy: str) -> np.dtype:
    if name == "half":
        return half_dtype()
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"Unknown dtype {name!r} in policy {policy!r}: use one of half, "
            f"{', '.join(sorted(_DTYPES))}"
        ) from None


def _refuse_nnx_modules(tree: Any) -> None:
    found = jax.tree.leaves(tree, is_leaf=is_nnx_module)
    modules = [x for x in found if is_nnx_module(x)]
    if modules:
        raise TypeError(
            "a jls.precision.Policy cannot cast a flax nnx Module "
            f"({type(modules[0]).__name__}):"
            " it would run a cast copy, and the forward pass's state updates "
            "(BatchNorm statistics, Dropout RNG counts, your own Variables) would "
            "land on the copy, not on your model. Use policy.wrap(fn) (it runs fn "
            "on the Module's state and writes the new state back), or give the "
            "layers their compute dtype: nnx.Linear(..., dtype=jnp.float16, "
            "param_dtype=jnp.float32); check the result with "
            "jls.precision.precision_report(fn, model, x)"
        )


def _cast_floating(tree: T, dtype: np.dtype) -> T:
    _refuse_nnx_modules(tree)

    def cast(x: Any) -> Any:
        is_array = isinstance(x, (jax.Array, np.ndarray))
        if not (is_array and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        # A weakly typed array is cast even to its own dtype (made strong), as jmp.
        weak = isinstance(x, jax.Array) and jax.typeof(x).weak_type
        return x.astype(dtype) if x.dtype != dtype or weak else x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtypes parameters, computation and outputs use.

    Attributes:
      param_dtype: the dtype parameters are stored in (float32 master weights).
      compute_dtype: the dtype the model computes in (float16, bfloat16).
      output_dtype: the dtype of the model's outputs (the loss).

    Example:
      >>> import jax.numpy as jnp, jls
      >>> spec = "params=float32,compute=float16,output=float32"
      >>> policy = jls.precision.get_policy(spec)
      >>> print(policy)
      p=full,c=f16,o=full
      >>> tree = {"w": jnp.ones(2), "step": jnp.int32(3), "act": jnp.tanh}
      >>> cast = policy.cast_to_compute(tree)
      >>> cast["w"].dtype.name, cast["step"].dtype.name, cast["act"] is jnp.tanh
      ('float16', 'int32', True)
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            dtype = floating_dtype(field, getattr(self, field))
            object.__setattr__(self, field, dtype)

    def cast_to_param(self, tree: T) -> T:
        """``tree`` with its floating arrays in ``param_dtype``."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """``tree`` with its floating arrays in ``compute_dtype``."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """``tree`` with its floating arrays in ``output_dtype``."""
        return _cast_floating(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """This policy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def wrap(
        self, fn: Callable[..., Any], *, float32: Any = None
    ) -> Callable[..., Any]:
        """``fn`` autocast to ``compute_dtype``, its results in ``output_dtype``.

        `jls.precision.autocast`; the arguments are not cast, so gradients
        stay in ``param_dtype``.

        Example:
          >>> import jax, jax.numpy as jnp, jls
          >>> policy = jls.precision.get_policy("p=f32,c=f16,o=f32")
          >>> loss = policy.wrap(lambda w, x: jax.nn.logsumexp(x @ w))
          >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
          >>> report = jls.precision.precision_report(loss, w, x)
          >>> report.counts, report.numerics["log"], loss(w, x).dtype.name
          ({'float16': 1}, {'float32': 1}, 'float32')
        """
        cast = autocast(fn, self.compute_dtype, float32=float32)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return self.cast_to_output(cast(*args, **kwargs))

        return wrapped

    def cast_arguments(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its arguments cast to compute and its results to output.

        jmp's way (a loss's softmax in ``compute_dtype`` too): wrap a forward
        pass with it, not a loss.

        Example:
          >>> import jax.numpy as jnp, jls
          >>> policy = jls.precision.get_policy("c=f16,o=f32")
          >>> f = policy.cast_arguments(lambda w, x: (w * x).dtype.name)
          >>> f(jnp.ones(2), jnp.ones(2))
          'float16'
        """

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self.cast_to_compute((args, kwargs))
            return self.cast_to_output(fn(*args, **kwargs))

        return wrapped

    def __str__(self) -> str:
        p, c, o = (
            _NAMES[d][0]
            for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
        )
        return f"p={p},c={c},o={o}"


def get_policy(policy: str) -> Policy:
    """A `Policy` parsed from a string, as ``jmp.get_policy`` parses it.

    ``"p=f32,c=f16,o=f32"`` (or ``params=``, ``compute=``, ``output=``):
    parameters default to float32, compute follows them and output follows
    compute; a bare dtype sets all three.

    Raises:
      ValueError: for an unknown key or dtype name (the message names it).
      TypeError: if ``policy`` is not a string.

    Example:
      >>> import jls
      >>> policy = jls.precision.get_policy("c=bf16")
      >>> policy.param_dtype.name, policy.compute_dtype.name, policy.output_dtype.name
      ('float32', 'bfloat16', 'bfloat16')
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a string, got {policy!r}")
    if "=" not in policy:
        dtype = _parse_dtype(policy, policy)
        return Policy(dtype, dtype, dtype)
    dtypes: dict[str, np.dtype] = {"param": np.dtype(np.float32)}
    for part in policy.split(","):
        key, _, value = part.partition("=")
        if key not in _KEYS:
            raise ValueError(
                f"Unknown key {key!r} in policy {policy!r}: use params (p), "
                "compute (c) or output (o)"
            )
        dtypes[_KEYS[key]] = _parse_dtype(value, policy)
    compute = dtypes.get("compute", dtypes["param"])
    return Policy(dtypes["param"], compute, dtypes.get("output", compute))
