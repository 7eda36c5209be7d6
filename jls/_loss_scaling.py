"""`LossScaling`: the object that owns a loss-scaled step, and its optax pair.

`loss_scaling` returns ``LossScaling(...).gradient_transformation()``;
`apply_gradients` and `jls.train_step` use the same object's public methods.

One step, inside ``jit``:

1. Check that the unscaled gradients would all be finite, reading the
   still-scaled gradients once (``jls._finite.unscaled_finite``: one sum of
   magnitudes per leaf at the memory-bandwidth floor, exact, and immune to
   the compiler fusing the gradient's producer into it). For a scale >= 1
   this is the same question; a scaler that can go below 1 tests the
   unscaled values while it is there. A scale outside the scaler's range
   counts as non-finite. With the measured scaler, the norm metric or the
   spike rule the check is a sum of squares instead, which also measures
   the gradients' range and norm in the same pass. The flags are reduced
   across replicas (``pmin`` over ``axis_name`` and any ``shard_map`` axis
   the gradients vary over), so every replica takes the same decision.
2. ``lax.cond`` on the decision, the applying branch first. It unscales the
   gradients (a multiplication by the reciprocal scale, which XLA fuses
   into the optimizer's elementwise update), runs the inner optimizer and,
   in `apply_gradients`, adds the updates to the parameters. The other
   branch passes the inner state (and parameters) through and returns
   ``-0.0`` updates. Nothing is selected with masks, so a nan can never
   reach a state through ``0 * nan``, and a skipped step computes nothing.
3. Adjust the loss scale (scalar work).

How this was chosen (``benchmarks/bench_step.py`` and scripts like it, on
XLA:CPU, a 27M-parameter transformer with a donated Adam state, 60
interleaved rounds): unscaling before the decision (and checking the
unscaled values) materialises a second gradient tree and cost 1.12x plain
Adam; unscaling inside the branch with a division did too (XLA will not
duplicate a division into Adam's two uses of the gradient), 1.19x; with a
multiplication inside the branch, 1.05x. Putting the skip branch first makes
XLA copy every parameter and moment. ``tests/test_perf_guards.py`` asserts
the result: the fused step's compiled temporary memory is the plain
optimizer's plus one gradient tree (which any skip decision must hold), and
its HLO has no more array copies than the plain step's.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jls import _spikes
from jls._finite import (
    all_finite,
    nonfinite_leaf_flags,
    unscaled_finite,
    unscaled_measured,
    unscaled_norm,
    varying_axes,
)
from jls._scaler import LossScaler, dynamic_scale
from jls._scaling import SINGLE_FACTOR_MAX, Factors, reciprocals, unscale_leaf
from jls._state import LossScaleState, WrapperState, check_state
from jls._trees import merge, split_frozen, split_inexact
from jls._validate import axis_names, flag, integer


class Decision(NamedTuple):
    """A step's decision (`LossScaling.decide`), agreed across replicas.

    Attributes:
      finite: the unscaled gradients are all finite and the scale is in range.
      apply: the update is applied.
      magnitude: float32, the gradients' measured range (the largest
        root-mean-square over the check's reductions, scaled), when the check
        measures (the measured scaler, the norm metric, the spike rule).
      norm: float32, the global norm of the unscaled gradients, likewise.
      spike: whether the spike rule vetoed the step (set by the step itself).
    """

    finite: jax.Array
    apply: jax.Array
    magnitude: jax.Array | None = None
    norm: jax.Array | None = None
    spike: jax.Array | None = None


class _Transformation(Protocol):
    """Anything with optax's ``init``/``update`` (also ``optax.MultiSteps``)."""

    @property
    def init(self) -> Callable[..., Any]: ...

    @property
    def update(self) -> Callable[..., Any]: ...


def _with_extra_args(inner: _Transformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` as an optax pair whose ``update`` takes extra arguments.

    ``optax.with_extra_args_support`` drops them for anything that is not a
    ``GradientTransformationExtraArgs``, such as an ``optax.MultiSteps``
    object, whose ``update`` forwards them to its own inner optimizer: an
    ``update`` that takes ``**kwargs`` keeps them.
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


def _cast_like(tree: Any, like: Any) -> Any:
    """Casts ``tree``'s leaves to the dtypes of ``like``'s (shape structs).

    Not ``optax.tree.cast_like``: that casts every leaf, and ``astype`` makes
    a weakly typed leaf strong, so a skipped step would change the state's
    types and retrace the step once.
    """
    return jax.tree.map(
        lambda x, s: x if x is None or x.dtype == s.dtype else x.astype(s.dtype),
        tree,
        like,
    )


def _check_gradient_dtypes(grads: Any) -> None:
    """Refuses, at trace time, gradient dtypes that cannot hold a zero update.

    ``float8_e8m0fnu`` (an exponent-only scale format) has no zero: any
    optimizer's update, and jls's skipped-step zeros, would be nan.
    """
    for leaf in jax.tree.leaves(grads):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and np.dtype(dtype).name == "float8_e8m0fnu":
            raise TypeError(
                "a gradient leaf has dtype float8_e8m0fnu, which has no zero: it "
                "cannot hold gradients or updates (every zero becomes nan). Keep "
                "such scale factors out of the optimized tree (e.g. optax.masked)."
            )


_MISSING: Any = object()


def _holds(tree: Any, kind: type) -> bool:
    """Whether a ``kind`` is inside ``tree`` (not ``tree`` itself)."""
    found = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kind))
    return any(isinstance(x, kind) for x in found)


def _check_order(opt_state: Any, params: Any) -> None:
    """Refuses ``params`` and ``opt_state`` passed the wrong way round."""
    if isinstance(params, WrapperState) and not isinstance(opt_state, WrapperState):
        raise TypeError(
            "params is this transformation's state and opt_state is not: they "
            "are swapped. Call apply_gradients(tx, grads, opt_state, params)"
        )


def _zero(dtype: Any) -> Any:
    """The zero update of ``dtype``: ``-0.0`` for floats, 0 for others.

    ``p + (-0.0)`` is ``p`` bitwise for every float ``p``, ``-0.0`` included
    (``-0.0 + 0.0`` is ``+0.0``).
    """
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return complex(-0.0, -0.0)  # both parts: -0.0 + 0.0 is +0.0
    return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0


def _zeros_like(shapes: Any, like: Any) -> Any:
    """Zero updates of ``shapes``, built from ``like``'s leaves where they match.

    So they carry the same varying axes under ``shard_map`` as the taken
    branch's updates. (``optax.tree.zeros_like`` makes ``+0.0``.)
    """
    if jax.tree.structure(shapes) == jax.tree.structure(like):
        return jax.tree.map(
            lambda s, x: (
                jnp.full_like(x, _zero(s.dtype), dtype=s.dtype)
                if getattr(x, "shape", None) == s.shape
                else jnp.full(s.shape, _zero(s.dtype), s.dtype)
            ),
            shapes,
            like,
        )
    return jax.tree.map(lambda s: jnp.full(s.shape, _zero(s.dtype), s.dtype), shapes)


class LossScaling:
    """Loss scaling around an optax optimizer: the object that owns the step.

    Made by `jls.loss_scaling`, which returns its `gradient_transformation`
    (the optax pair); `jls.apply_gradients` and `jls.train_step` call its
    `apply_gradients` and `decide`. Use it directly when you want those
    methods without going through a transformation, or `LossScaling.of` to
    get it back from one.

    The state is a ``NamedTuple`` with fields ``loss_scale`` (a
    `jls.LossScaleState`), ``inner_state`` (the wrapped optimizer's, bitwise
    unchanged by a skipped step), ``nonfinite_leaves`` (with
    ``diagnostics=True``) and ``diverged`` (with ``max_consecutive_skips``);
    read it with `jls.metrics`.

    Args: as for `jls.loss_scaling`.

    Attributes:
      inner: the wrapped optimizer (with extra-args support).
      scaler: the `jls.LossScaler`.
      axis_name: the axis names replicas agree over, as a tuple.
      diagnostics: whether per-leaf flags are recorded.
      max_consecutive_skips: the divergence limit, or ``None``.
      gradient_norm: whether the norm of the unscaled gradients is recorded.
      skip_spikes: the `jls.SpikeRule`, or ``None``.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> scaling = jls.LossScaling(optax.sgd(0.5), jls.static_scale(2.0))
      >>> tx = scaling.gradient_transformation()
      >>> jls.LossScaling.of(tx) is scaling
      True
      >>> params = jnp.ones(2)
      >>> params, state = scaling.apply_gradients(
      ...     jnp.full(2, 2.0), tx.init(params), params
      ... )
      >>> params
      Array([0.5, 0.5], dtype=float32)
    """

    def __init__(
        self,
        inner: _Transformation,
        scaler: LossScaler | None = None,
        *,
        axis_name: str | tuple[str, ...] | None = None,
        diagnostics: bool = False,
        max_consecutive_skips: int | None = None,
        gradient_norm: bool = False,
        skip_spikes: _spikes.SpikeRule | None = None,
    ) -> None:
        if not (
            callable(getattr(inner, "init", None))
            and callable(getattr(inner, "update", None))
        ):
            hint = ""
            if callable(inner) and not isinstance(inner, LossScaler):
                hint = (
                    " (an optimizer factory? call it: loss_scaling(optax.adam(1e-3)),"
                    " not loss_scaling(optax.adam))"
                )
            if isinstance(inner, LossScaler):
                hint = (
                    " (a scaler: the optimizer comes first: "
                    "loss_scaling(inner, scaler))"
                )
            raise TypeError(
                "inner must be an optax.GradientTransformation, got "
                f"{type(inner).__name__}{hint}: {inner!r:.200}"
            )
        if scaler is None:
            scaler = dynamic_scale()
        if not isinstance(scaler, LossScaler):
            raise TypeError(
                "scaler must be a jls scaler (jls.dynamic_scale(), "
                "jls.static_scale(v), jls.no_scale() or a jls.presets one), got "
                f"{scaler!r:.200}"
            )
        self.inner = _with_extra_args(inner)
        self.scaler = scaler
        self.axis_name = axis_names("axis_name", axis_name)
        self.diagnostics = flag("diagnostics", diagnostics)
        self.max_consecutive_skips = (
            None
            if max_consecutive_skips is None
            else integer("max_consecutive_skips", max_consecutive_skips, 1)
        )
        self.gradient_norm = flag("gradient_norm", gradient_norm)
        if skip_spikes is not None and not isinstance(skip_spikes, _spikes.SpikeRule):
            raise TypeError(
                f"skip_spikes must be a jls.SpikeRule or None, got {skip_spikes!r:.200}"
            )
        self.skip_spikes = skip_spikes

    @property
    def measures(self) -> bool:
        """Whether the check is the squares check, which measures range and norm."""
        return (
            self.scaler.margin is not None
            or self.gradient_norm
            or self.skip_spikes is not None
        )

    def __repr__(self) -> str:
        return (
            f"LossScaling(inner={self.inner!r:.80}, scaler={self.scaler!r}, "
            f"axis_name={self.axis_name!r}, diagnostics={self.diagnostics!r}, "
            f"max_consecutive_skips={self.max_consecutive_skips!r}, "
            f"gradient_norm={self.gradient_norm!r}, skip_spikes={self.skip_spikes!r})"
        )

    @staticmethod
    def of(tx: Any) -> LossScaling:
        """The `LossScaling` behind ``tx`` (a `jls.loss_scaling` transformation).

        Raises:
          TypeError: if ``tx`` was not made by `jls.loss_scaling` (or is a
            `LossScaling` itself); e.g. it is wrapped in ``optax.chain``.
        """
        if isinstance(tx, LossScaling):
            return tx
        owner = getattr(getattr(tx, "update", None), "__self__", None)
        if not isinstance(owner, LossScaling):
            raise TypeError(
                "tx must be a transformation made by jls.loss_scaling(...) itself "
                "(not wrapped in optax.chain, optax.inject_hyperparams or another "
                "wrapper: put those inside, e.g. jls.loss_scaling("
                "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)), which "
                "keeps the fused path); for other transformations use tx.update "
                f"and optax.apply_updates. Got {tx!r:.200}"
            )
        return owner

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """The optax pair: ``init`` and ``update`` of this object."""
        update = cast(optax.TransformUpdateExtraArgsFn, self.update)
        return optax.GradientTransformationExtraArgs(self.init, update)

    def init(self, params: optax.Params) -> WrapperState:
        """The state before the first step (see the class notes)."""
        flags = diverged = None
        if self.diagnostics:
            flags = jax.tree.map(lambda _: jnp.asarray(np.bool_(False)), params)
        if self.max_consecutive_skips is not None:
            diverged = jnp.asarray(np.bool_(False))
        norm = jnp.asarray(np.float32(0)) if self.gradient_norm else None
        spikes = None if self.skip_spikes is None else _spikes.init()
        return WrapperState(
            self.scaler.init(), self.inner.init(params), flags, diverged, norm, spikes
        )

    def check_state(self, opt_state: Any) -> WrapperState:
        """``opt_state`` if it is a state made by `init`; else a ``TypeError``.

        Checked at trace time; boxed leaves (flax ``nnx``) are unwrapped.
        """
        if not isinstance(opt_state, WrapperState):
            hint = ""
            if _holds(opt_state, WrapperState):
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
        if self.diagnostics and opt_state.nonfinite_leaves is None:
            raise TypeError(
                "opt_state has no nonfinite_leaves: it was not made by this "
                "transformation's init (diagnostics=True)"
            )
        if self.max_consecutive_skips is not None and opt_state.diverged is None:
            raise TypeError(
                "opt_state has no diverged flag: it was not made by this "
                "transformation's init (max_consecutive_skips="
                f"{self.max_consecutive_skips})"
            )
        if self.gradient_norm and opt_state.gradient_norm is None:
            raise TypeError(
                "opt_state has no gradient_norm: it was not made by this "
                "transformation's init (gradient_norm=True)"
            )
        if self.skip_spikes is not None and not isinstance(
            opt_state.spikes, _spikes.SpikeState
        ):
            raise TypeError(
                "opt_state has no spike statistics: it was not made by this "
                "transformation's init (skip_spikes=...)"
            )
        loss_scale = check_state(opt_state.loss_scale, argname="opt_state.loss_scale")
        return opt_state._replace(loss_scale=loss_scale)

    def decide(
        self, grads: Any, loss_scale: LossScaleState, *, also_finite: Any = None
    ) -> Decision:
        """The step's `Decision`: ``finite`` and ``apply``, and the measurements.

        ``finite``: the unscaled gradients are all finite and the scale lies
        in the scaler's range (a scale set by hand outside it, or nan, counts
        as a non-finite step). ``apply``: the update is applied; ``finite``,
        or with ``skip_nonfinite=False`` any step whose scale is in range.
        Both are reduced across replicas (``axis_name``, and any
        ``shard_map`` axis the gradients vary over), so every replica takes
        the same decision.

        Args:
          grads: the scaled gradients.
          loss_scale: the `jls.LossScaleState` they were scaled with.
          also_finite: a tree of values that must be finite too for the step
            to be applied, checked with the gradients but neither unscaled
            nor measured (flax's fp8 scales and amax histories).

        Raises:
          TypeError: at trace time, if ``loss_scale`` is not a valid
            `jls.LossScaleState` (the whole optimizer state, say).
        """
        if not isinstance(loss_scale, LossScaleState):
            hint = ""
            if isinstance(loss_scale, WrapperState):
                hint = " (this is the whole optimizer state: pass its .loss_scale)"
            raise TypeError(
                "loss_scale must be a jls.LossScaleState, got "
                f"{type(loss_scale).__name__}{hint}: {loss_scale!r:.200}"
            )
        loss_scale = check_state(loss_scale, argname="loss_scale")
        _check_gradient_dtypes(grads)
        self._hint_bfloat16(grads)
        scale = loss_scale.scale
        below_one = self.scaler.min_scale_f32 < 1
        magnitude = norm = None
        if self.measures:
            measured = unscaled_measured(
                grads, scale, scale_may_be_below_one=below_one, named=self.axis_name
            )
            finite, magnitude = measured.finite, measured.magnitude
            norm = unscaled_norm(measured, scale)
        else:
            finite = unscaled_finite(grads, scale, scale_may_be_below_one=below_one)
        if also_finite is not None:
            finite = finite & all_finite(also_finite)
        finite, valid = self._agree([finite, self.scaler.in_range(scale)], lax.pmin)
        finite = finite & valid
        apply = finite if self.scaler.skip_nonfinite else valid
        return Decision(finite, apply, magnitude, norm)

    def _hint_bfloat16(self, grads: Any) -> None:
        """Warns, at trace time, that bfloat16 gradients need no dynamic scale."""
        if self.scaler.margin is not None or not self.scaler.is_dynamic:
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
                stacklevel=4,
            )

    def update(
        self,
        updates: optax.Updates,
        state: WrapperState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, WrapperState]:
        """Optax's ``update``: takes the SCALED gradients (see `jls.loss_scaling`)."""
        _check_order(state, params)
        state = self.check_state(state)
        loss, extra_args = self._pop_loss(extra_args)
        decision = self._veto(self.decide(updates, state.loss_scale), state, loss)
        factors = self._reciprocals(updates, state.loss_scale)

        def step(operands):
            grads, inner_state, params = operands
            grads = self._unscale(grads, factors)
            return self.inner.update(grads, inner_state, params, **extra_args)

        def skip(operands, out):
            grads, inner_state, _ = operands
            return _zeros_like(out[0], grads), _cast_like(inner_state, out[1])

        operands = (updates, state.inner_state, params)
        (new_updates, inner_state), loss_scale = self._guarded(
            decision, state.loss_scale, step, skip, operands
        )
        return new_updates, self._finish(
            state, updates, decision, inner_state, loss_scale, loss
        )

    def apply_gradients(
        self,
        grads: optax.Updates,
        opt_state: optax.OptState,
        params: optax.Params,
        decision: Decision | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Params, WrapperState]:
        """The fused step (`jls.apply_gradients`): ``(new_params, new_opt_state)``.

        Args:
          grads: the scaled gradients.
          opt_state: this object's state.
          params: the parameters: any pytree, a whole model too (an equinox
            ``Module``). Only its floating arrays are stepped (initialise the
            optimizer on them: ``eqx.filter(model, eqx.is_inexact_array)``);
            every other leaf (functions, Python numbers, integer arrays) is
            returned as it is, as ``eqx.apply_updates`` does.
          decision: the step's `decide` result, when the caller took it
            (`jls.train_step` does, to retry); by default it is taken here.
          **extra_args: forwarded to the inner optimizer's ``update`` (e.g.
            ``value=`` for ``optax.contrib.reduce_on_plateau``).
        """
        _check_order(opt_state, params)
        state = self.check_state(opt_state)
        loss, extra_args = self._pop_loss(extra_args)
        if decision is None:
            decision = self.decide(grads, state.loss_scale)
        elif not isinstance(decision, Decision):
            raise TypeError(
                "decision must be the jls Decision that decide(grads, "
                "opt_state.loss_scale) returned (or None), got "
                f"{type(decision).__name__}: {decision!r:.200}"
            )
        decision = self._veto(decision, state, loss)
        factors = self._reciprocals(grads, state.loss_scale)
        params, rest = split_inexact(params)  # a whole model: the rest passes by
        params, frozen = split_frozen(params, grads)  # None gradients: not trained

        def step(operands):
            grads, inner_state, params = operands
            grads = self._unscale(grads, factors)
            updates, inner_state = self.inner.update(
                grads, inner_state, params, **extra_args
            )
            return optax.apply_updates(params, updates), inner_state

        def skip(operands, out):
            _, inner_state, params = operands
            return _cast_like((params, inner_state), out)

        operands = (grads, state.inner_state, params)
        (params, inner_state), loss_scale = self._guarded(
            decision, state.loss_scale, step, skip, operands
        )
        new_state = self._finish(state, grads, decision, inner_state, loss_scale, loss)
        return merge(merge(params, frozen), rest), new_state

    def _reciprocals(self, grads: Any, loss_scale: LossScaleState) -> Factors:
        """The unscaling factors, computed once, before the conditional.

        So the branch receives them as operands instead of recomputing them
        in every fusion that reads a gradient.
        """
        if self.scaler.is_identity:
            return {}
        two = self.scaler.max_scale_f32 > SINGLE_FACTOR_MAX
        return reciprocals(loss_scale.scale, grads, two_factor=two)

    @staticmethod
    def _unscale(grads: Any, factors: Factors) -> Any:
        if not factors:  # scale 1 forever
            return grads
        return jax.tree.map(lambda g: unscale_leaf(g, factors), grads)

    def _guarded(
        self,
        decision: Decision,
        loss_scale: LossScaleState,
        step: Any,
        skip: Any,
        operands: Any,
    ) -> tuple[Any, LossScaleState]:
        """``step(operands)`` if applied, else ``skip(operands, step's shapes)``.

        One ``lax.cond``, the applying branch first (XLA then copies nothing);
        ``skip`` gets ``step``'s output shapes and dtypes so both branches
        agree. ``step`` is traced once, by ``lax.cond`` itself: the taken
        branch records its output shapes while it is traced, and ``lax.cond``
        traces it first (tracing ``step`` ahead of the conditional, with
        ``jax.eval_shape`` or ``jax.make_jaxpr``, costs about what tracing
        the inner optimizer costs; the skip branch still falls back to
        ``jax.eval_shape`` should a jax ever trace it first). Each branch also
        returns the adjusted loss-scale state: there the decision is a
        constant (with ``skip_nonfinite``), so the scale rule folds to a few
        scalar ops instead of reading the step's flags, which XLA would
        recompute in each fusion that reads them.
        """
        finite, apply = decision.finite, decision.apply
        # With skip_nonfinite and no spike veto, finite == applied: a constant
        # in each branch.
        known = self.scaler.skip_nonfinite and self.skip_spikes is None

        def adjusted(taken: bool) -> LossScaleState:
            return self.scaler.adjust(
                loss_scale,
                jnp.asarray(taken) if known else finite,
                applied=jnp.asarray(taken),
                magnitude=decision.magnitude,
            )

        shapes: list[Any] = []  # step's output shapes, once it is traced

        def taken(ops):
            new = step(ops)
            shapes.append(jax.tree.map(jax.typeof, new))
            return new, adjusted(True)

        def skipped(ops):
            out = shapes[-1] if shapes else jax.eval_shape(step, ops)
            return skip(ops, out), adjusted(False)

        return lax.cond(apply, taken, skipped, operands)

    def _finish(
        self,
        state: WrapperState,
        grads: Any,
        decision: Decision,
        inner_state: optax.OptState,
        loss_scale: LossScaleState,
        loss: jax.Array | None,
    ) -> WrapperState:
        """The state after a step: diagnostics, divergence, norm, spikes."""
        finite = decision.finite
        flags = state.nonfinite_leaves
        if self.diagnostics:
            new = nonfinite_leaf_flags(grads, finite, state.loss_scale.scale)
            if jax.tree.structure(new) != jax.tree.structure(flags):
                raise TypeError(
                    "with diagnostics=True the gradients must have the structure "
                    f"of the parameters: {jax.tree.structure(flags)}, got "
                    f"{jax.tree.structure(new)}"
                )
            leaves, treedef = jax.tree.flatten(new)  # non-finite on any replica
            if leaves:
                new = jax.tree.unflatten(treedef, self._agree(leaves, lax.pmax))
            flags = new
        diverged = state.diverged
        if self.max_consecutive_skips is not None:
            limit = jnp.int32(self.max_consecutive_skips)
            diverged = diverged | (loss_scale.consecutive_skips >= limit)
        norm = decision.norm if self.gradient_norm else None
        spikes = state.spikes
        if self.skip_spikes is not None:
            spikes = _spikes.advance(
                self.skip_spikes,
                spikes,
                applied=decision.apply,
                spike=self._spike(decision),
                norm=decision.norm,
                loss=loss,
            )
        return WrapperState(loss_scale, inner_state, flags, diverged, norm, spikes)

    def _pop_loss(self, extra_args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The spike rule's ``loss=``, taken out of the inner optimizer's args."""
        if self.skip_spikes is None or not self.skip_spikes.watches_loss:
            return None, extra_args
        rest = dict(extra_args)
        loss = _spikes.check_loss(self.skip_spikes, rest.pop("loss", None))
        if loss is not None:
            # Every replica watches (and feeds its statistics) the same loss:
            # the replicas' mean (non-finite if any replica's is).
            axes = self.axis_name + tuple(
                sorted(varying_axes(loss) - set(self.axis_name))
            )
            if axes:
                loss = lax.pmean(loss, axes)
        return loss, rest

    def _veto(self, decision: Decision, state: WrapperState, loss: Any) -> Decision:
        """The decision with the spike rule's veto: a spike is not applied."""
        if self.skip_spikes is None:
            return decision
        spike = _spikes.is_spike(self.skip_spikes, state.spikes, decision.norm, loss)
        # A spike on any replica is one on all (each may watch its own loss).
        spike = decision.apply & self._agree([spike], lax.pmax)[0]
        # Carried in the decision, so _finish records what was vetoed.
        return decision._replace(apply=decision.apply & ~spike, spike=spike)

    @staticmethod
    def _spike(decision: Decision) -> jax.Array:
        return jnp.asarray(False) if decision.spike is None else decision.spike

    def _agree(self, flags: list[jax.Array], reduce: Any) -> list[jax.Array]:
        """Scalar bool ``flags`` reduced across replicas, in one collective.

        ``reduce`` is ``lax.pmin`` (true on every replica) or ``lax.pmax``
        (true on any), over ``axis_name`` and every ``shard_map`` axis the
        flags vary over: under ``shard_map`` a flag computed from gradients
        sharded over an axis the user did not name (model-parallel
        parameters, say) varies over it too.
        """
        stacked = jnp.stack([f.astype(jnp.int32) for f in flags])
        named = self.axis_name
        axes = named + tuple(sorted(varying_axes(stacked) - set(named)))
        if not axes:
            return flags
        agreed = reduce(stacked, axes) > 0
        return [agreed[i] for i in range(len(flags))]


def loss_scaling(
    inner: _Transformation,
    scaler: LossScaler | None = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    diagnostics: bool = False,
    max_consecutive_skips: int | None = None,
    gradient_norm: bool = False,
    skip_spikes: _spikes.SpikeRule | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer with loss scaling.

    ``update`` takes the SCALED gradients (of ``jls.scale_loss(loss, state)``).
    It checks them, and when every unscaled gradient is finite it unscales
    them and runs ``inner``; otherwise it returns zero updates and leaves
    ``inner``'s state bitwise unchanged (its step count and schedules do not
    advance). Either way it adjusts the loss scale. Extra arguments are
    forwarded to ``inner``. One trace serves every step.

    For the smallest overhead, apply the step with `apply_gradients` instead
    of ``update`` + ``optax.apply_updates``.

    Composition: put ``loss_scaling`` outermost. Inside it, any optax
    transformation (``chain`` with ``clip_by_global_norm``, ``masked``,
    ``inject_hyperparams``, ``MultiSteps``) sees unscaled gradients. With
    gradient accumulation, ``loss_scaling(optax.MultiSteps(inner, k))`` is
    the recommended order: each micro-batch is checked before it reaches the
    accumulator, so a non-finite micro-batch is dropped alone (the window
    waits for one more) and can never poison the accumulator, and the scale
    backs off at once. In the other order, ``MultiSteps`` accumulates scaled
    gradients and resets its accumulator as ``0 * acc``, so one nan
    micro-batch would poison every later window; that order needs
    ``MultiSteps(..., should_skip_update_fn=optax.skip_not_finite)``, and
    then jls never sees (or backs off for) the dropped micro-batches.

    Args:
      inner: the optimizer to wrap (any ``optax.GradientTransformation``).
      scaler: a `LossScaler`; default ``jls.dynamic_scale()``.
      axis_name: the ``pmap``/``shard_map`` axis name (or names) over which
        replicas agree on the skip decision. Not needed under ``jit`` with
        sharded arrays, where the check is already global.
      diagnostics: record which gradient leaves were not finite on the latest
        step (``jls.metrics(...)["nonfinite_leaves"]``, `jls.nonfinite_paths`). Costs
        nothing on finite steps; a skipped step makes one more exact pass.
      max_consecutive_skips: the divergence limit, an int in ``[1, 2**31 -
        1]``: the state's ``diverged`` flag turns ``True`` on the step that
        makes this many skipped steps in a row, and stays ``True``. It is
        plain state, exact under ``vmap``, ``scan`` and ``pmap``;
        `jls.raise_if_diverged` raises `jls.DivergenceError` from it (on the
        host, or inside ``jit`` under ``checkify``). ``None`` (default): no
        limit.
      gradient_norm: record the global norm of each step's unscaled
        gradients (``jls.metrics(...)["gradient_norm"]``), from the finite
        check's own pass: the check becomes a sum of squares, which also
        yields the norm (no second read of the gradients, unlike
        ``optax.global_norm``), exact for every finite norm (inf past the
        float32 maximum); finite gradients are never reported non-finite.
      skip_spikes: a `jls.SpikeRule`: also skip a step whose gradient norm
        (or loss, given as ``loss=``) is an outlier against its running
        statistics. Composes with every scaler, ``no_scale()`` included.

    Returns:
      ``LossScaling(...).gradient_transformation()``: an
      ``optax.GradientTransformationExtraArgs``; its state is described in
      `LossScaling`.

    Raises:
      TypeError: if ``inner`` is not an optax transformation, ``scaler`` is
        not a `LossScaler`, or ``axis_name`` is not a str or tuple of str.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jls.loss_scaling(optax.sgd(0.5), jls.dynamic_scale(init_scale=4))
      >>> state = tx.init(params)
      >>> grads = jax.grad(lambda p: jls.scale_loss(p["w"].sum(), state))(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"], jls.metrics(state)["loss_scale"]
      (Array([-0.5, -0.5], dtype=float32), Array(4., dtype=float32))
      >>> bad = {"w": jnp.array([1.0, jnp.inf])}
      >>> updates, state = tx.update(bad, state, params)
      >>> updates["w"], jls.metrics(state)["loss_scale"]
      (Array([-0., -0.], dtype=float32), Array(2., dtype=float32))
    """
    return LossScaling(
        inner,
        scaler,
        axis_name=axis_name,
        diagnostics=diagnostics,
        max_consecutive_skips=max_consecutive_skips,
        gradient_norm=gradient_norm,
        skip_spikes=skip_spikes,
    ).gradient_transformation()


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params = _MISSING,
    **extra_args: Any,
) -> tuple[optax.Params, WrapperState]:
    """Applies one loss-scaled step to the parameters: the fused path.

    Equivalent to ``updates, opt_state = tx.update(grads, opt_state, params)``
    followed by ``optax.apply_updates(params, updates)``, with the same
    guarantees, but the skip decision wraps the inner update and the
    parameter update together: a skipped step returns ``params`` and the
    inner state untouched without computing anything, and a finite step costs
    one reduction over the gradients more than the plain optimizer. Donate
    ``params`` and ``opt_state`` to ``jit`` to update them in place.

    Args:
      tx: a transformation made by `loss_scaling` (not wrapped further), or
        a `LossScaling`.
      grads: the scaled gradients.
      opt_state: ``tx``'s state.
      params: the parameters (a whole model too: see
        `LossScaling.apply_gradients`).
      **extra_args: forwarded to the inner optimizer's ``update``.

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      TypeError: if ``tx`` was not made by `loss_scaling`, or ``opt_state``
        is not its state.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jls.loss_scaling(optax.sgd(0.5), jls.static_scale(8.0))
      >>> state = tx.init(params)
      >>> grads = jax.grad(lambda p: jls.scale_loss(p["w"].sum(), state))(params)
      >>> params, state = jls.apply_gradients(tx, grads, state, params)
      >>> params["w"]
      Array([0.5, 0.5], dtype=float32)
    """
    if params is _MISSING:
        got = "params" if isinstance(opt_state, WrapperState) else "opt_state"
        raise TypeError(
            "apply_gradients(tx, grads, opt_state, params) takes four arguments; "
            f"{got} is missing (got tx, grads and one more)"
        )
    return LossScaling.of(tx).apply_gradients(grads, opt_state, params, **extra_args)
