"""`loss_scaling`: the optax wrapper, and `apply_gradients`, its fused path.

One step, inside ``jit``:

1. Check that the unscaled gradients would all be finite, reading the
   still-scaled gradients once (``jls._finite.unscaled_finite``: one sum of
   magnitudes per leaf at the memory-bandwidth floor, exact, and immune to
   the compiler fusing the gradient's producer into it). For a scale >= 1
   this is the same question; a scaler that can go below 1 tests the
   unscaled values while it is there. A scale outside the scaler's range
   counts as non-finite. The flags are reduced across replicas (``pmin``
   over ``axis_name`` and any ``shard_map`` axis the gradients vary over),
   so every replica takes the same decision.
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

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jls._finite import nonfinite_leaf_flags, unscaled_finite
from jls._scaler import LossScaler, dynamic_scale
from jls._scaling import unscale_leaf
from jls._state import LossScaleState, check_state, loss_scale_state
from jls._validate import flag, integer


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The ``shard_map`` axes ``x``'s value varies over (empty outside one).

    ``jax.typeof(x).vma`` up to jax 0.9, ``.manual_axis_type.varying`` after.
    """
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)
    if varying is None:
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(varying or ())


class _Transformation(Protocol):
    """Anything with optax's ``init``/``update`` (also ``optax.MultiSteps``)."""

    @property
    def init(self) -> Callable[..., Any]: ...

    @property
    def update(self) -> Callable[..., Any]: ...


class LossScalingState(NamedTuple):
    """The state of a `loss_scaling` transformation.

    Attributes:
      loss_scale: the `LossScaleState` (scale and counters).
      inner_state: the wrapped optimizer's state; bitwise unchanged by a
        skipped step.
      nonfinite_leaves: with ``loss_scaling(..., diagnostics=True)``, a tree
        like the parameters of scalar bools: which gradient leaves were not
        finite on the latest step (all ``False`` after a finite step; with
        ``axis_name``, on any replica). ``None`` otherwise.
      diverged: with ``loss_scaling(..., max_consecutive_skips=n)``, a scalar
        bool that becomes ``True`` on the step that makes ``n`` skipped steps
        in a row and stays ``True`` (so a breach inside a ``lax.scan`` is not
        lost); `jls.raise_if_diverged` raises on it. ``None`` otherwise.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.adam(1e-3))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> type(state).__name__, float(state.loss_scale.scale)
      ('LossScalingState', 32768.0)
      >>> type(state.inner_state[0]).__name__
      'ScaleByAdamState'
    """

    loss_scale: LossScaleState
    inner_state: optax.OptState
    nonfinite_leaves: Any = None
    diverged: Any = None


def _cast_like(tree: Any, like: Any) -> Any:
    """Casts ``tree``'s leaves to the dtypes of ``like``'s (shape structs)."""
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
    branch's updates.
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


@dataclasses.dataclass(frozen=True, eq=False)
class _Update:
    """The ``update`` function of a `loss_scaling` transformation."""

    inner: optax.GradientTransformationExtraArgs
    scaler: LossScaler
    axis_name: Any
    diagnostics: bool = False
    max_consecutive_skips: int | None = None

    def _state(self, state: Any) -> LossScalingState:
        if not isinstance(state, LossScalingState):
            raise TypeError(
                "state must be the jls.LossScalingState made by this "
                f"transformation's init, got {type(state).__name__}"
            )
        if self.diagnostics and state.nonfinite_leaves is None:
            raise TypeError(
                "state has no nonfinite_leaves: it was not made by this "
                "transformation's init (diagnostics=True)"
            )
        if self.max_consecutive_skips is not None and state.diverged is None:
            raise TypeError(
                "state has no diverged flag: it was not made by this "
                "transformation's init (max_consecutive_skips="
                f"{self.max_consecutive_skips})"
            )
        return state._replace(
            loss_scale=check_state(state.loss_scale, argname="state.loss_scale")
        )

    def finish(
        self,
        state: LossScalingState,
        grads: Any,
        decision: tuple[jax.Array, jax.Array],
        inner_state: optax.OptState,
    ) -> LossScalingState:
        """The state after a step: adjusted scale, diagnostics, divergence."""
        finite, apply = decision
        loss_scale = self.scaler.adjust(state.loss_scale, finite, applied=apply)
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
        return LossScalingState(loss_scale, inner_state, flags, diverged)

    def _axes(self, x: jax.Array) -> tuple[str, ...]:
        """``axis_name`` and every ``shard_map`` axis ``x`` varies over.

        Under ``shard_map`` a flag computed from gradients sharded over an
        axis the user did not name (model-parallel parameters, say) varies
        over it too; reducing over it as well makes every replica agree.
        """
        named = self.axis_name
        named = () if named is None else (named,) if isinstance(named, str) else named
        varying = _varying_axes(x)
        return tuple(named) + tuple(sorted(set(varying) - set(named)))

    def _agree(self, flags: list[jax.Array], reduce: Any) -> list[jax.Array]:
        """Scalar bool ``flags`` reduced across replicas, in one collective.

        ``reduce`` is ``lax.pmin`` (true on every replica) or ``lax.pmax``
        (true on any); see `_axes` for the axes.
        """
        stacked = jnp.stack([f.astype(jnp.int32) for f in flags])
        axes = self._axes(stacked)
        if not axes:
            return flags
        agreed = reduce(stacked, axes) > 0
        return [agreed[i] for i in range(len(flags))]

    def apply_fused(
        self,
        grads: Any,
        state: LossScalingState,
        params: optax.Params,
        decision: tuple[jax.Array, jax.Array],
    ) -> tuple[optax.Params, LossScalingState]:
        """The fused step, given the step's decision (see `decide`)."""
        finite, apply = decision
        loss_scale = state.loss_scale

        def step(operands):
            grads, inner_state, params = operands
            grads = self.unscale(grads, loss_scale)
            updates, inner_state = self.inner.update(grads, inner_state, params)
            return optax.apply_updates(params, updates), inner_state

        def skip(operands, out):
            _, inner_state, params = operands
            return _cast_like(params, out[0]), _cast_like(inner_state, out[1])

        operands = (grads, state.inner_state, params)
        params, inner_state = self.guarded(apply, step, skip, operands)
        return params, self.finish(state, grads, decision, inner_state)

    def guarded(self, apply: jax.Array, step: Any, skip: Any, operands: Any) -> Any:
        """``step(operands)`` if ``apply``, else ``skip(operands, step's shapes)``.

        One ``lax.cond``, the applying branch first (XLA then copies nothing);
        ``skip`` gets ``step``'s output shapes and dtypes so both branches
        agree.
        """
        out = jax.eval_shape(step, operands)
        return lax.cond(apply, step, lambda ops: skip(ops, out), operands)

    def decide(
        self, grads: Any, loss_scale: LossScaleState
    ) -> tuple[jax.Array, jax.Array]:
        """The step's decision: ``(finite, apply)``.

        ``finite``: the unscaled gradients are all finite and the state's
        scale lies in the scaler's range (a scale set by hand outside it, or
        nan, counts as a non-finite step). ``apply``: the update is applied;
        ``finite``, or with ``skip_nonfinite=False`` any step whose scale is
        in range. Both are reduced across replicas (``axis_name``, and any
        ``shard_map`` axis the gradients vary over), so every replica takes
        the same decision.
        """
        _check_gradient_dtypes(grads)
        scale = loss_scale.scale
        finite = unscaled_finite(
            grads,
            scale,
            scale_may_be_below_one=self.scaler.min_scale_f32 < 1,
        )
        finite, valid = self._agree([finite, self.scaler.in_range(scale)], lax.pmin)
        finite = finite & valid
        return finite, (finite if self.scaler.skip_nonfinite else valid)

    def unscale(self, grads: Any, loss_scale: LossScaleState) -> Any:
        if self.scaler.is_identity:
            return grads
        return jax.tree.map(lambda g: unscale_leaf(g, loss_scale.scale), grads)

    def __call__(
        self,
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        state = self._state(state)
        loss_scale = state.loss_scale
        finite, apply = self.decide(updates, loss_scale)

        def step(operands):
            grads, inner_state, params = operands
            grads = self.unscale(grads, loss_scale)
            return self.inner.update(grads, inner_state, params, **extra_args)

        def skip(operands, out):
            grads, inner_state, _ = operands
            return _zeros_like(out[0], grads), _cast_like(inner_state, out[1])

        operands = (updates, state.inner_state, params)
        new_updates, inner_state = self.guarded(apply, step, skip, operands)
        return new_updates, self.finish(state, updates, (finite, apply), inner_state)


def loss_scaling(
    inner: _Transformation,
    scaler: LossScaler | None = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    diagnostics: bool = False,
    max_consecutive_skips: int | None = None,
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
        step (``jls.nonfinite_leaves``, ``jls.nonfinite_paths``). Costs
        nothing on finite steps; a skipped step makes one more exact pass.
      max_consecutive_skips: the divergence limit (MindSpore raises after
        1000 consecutive overflows), an int in ``[1, 2**31 - 1]``: the state's
        ``diverged`` flag turns ``True`` on the step that makes this many
        skipped steps in a row, and stays ``True``. It is plain state, exact
        under ``vmap``, ``scan`` and ``pmap``; `jls.raise_if_diverged`
        raises `jls.DivergenceError` from it on the host (call it where you
        log), and `jls.checkify_divergence` inside ``jit``. ``None``
        (default): no limit.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `LossScalingState`.

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
    if not (
        callable(getattr(inner, "init", None))
        and callable(getattr(inner, "update", None))
    ):
        raise TypeError(
            "inner must be an optax.GradientTransformation, got "
            f"{type(inner).__name__}: {inner!r:.200}"
        )
    if scaler is None:
        scaler = dynamic_scale()
    if not isinstance(scaler, LossScaler):
        raise TypeError(
            "scaler must be a jls scaler (jls.dynamic_scale(), jls.static_scale(v), "
            f"jls.no_scale() or a jls.presets one), got {scaler!r:.200}"
        )
    if axis_name is not None and not (
        isinstance(axis_name, str)
        or (
            isinstance(axis_name, tuple)
            and axis_name
            and all(isinstance(a, str) for a in axis_name)
        )
    ):
        raise TypeError(
            f"axis_name must be None, a str or a tuple of str, got {axis_name!r}"
        )
    diagnostics = flag("diagnostics", diagnostics)
    if max_consecutive_skips is not None:
        max_consecutive_skips = integer(
            "max_consecutive_skips", max_consecutive_skips, 1
        )
    inner = optax.with_extra_args_support(cast(optax.GradientTransformation, inner))

    def init(params: optax.Params) -> LossScalingState:
        flags = diverged = None
        if diagnostics:
            flags = jax.tree.map(lambda _: jnp.asarray(np.bool_(False)), params)
        if max_consecutive_skips is not None:
            diverged = jnp.asarray(np.bool_(False))
        return LossScalingState(scaler.init(), inner.init(params), flags, diverged)

    update = _Update(inner, scaler, axis_name, diagnostics, max_consecutive_skips)
    return optax.GradientTransformationExtraArgs(
        init, cast(optax.TransformUpdateExtraArgsFn, update)
    )


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
) -> tuple[optax.Params, LossScalingState]:
    """Applies one loss-scaled step to the parameters: the fused path.

    Equivalent to ``updates, opt_state = tx.update(grads, opt_state, params)``
    followed by ``optax.apply_updates(params, updates)``, with the same
    guarantees, but the skip decision wraps the inner update and the
    parameter update together: a skipped step returns ``params`` and the
    inner state untouched without computing anything, and a finite step costs
    one reduction over the gradients more than the plain optimizer. Donate
    ``params`` and ``opt_state`` to ``jit`` to update them in place.

    Args:
      tx: a transformation made by `loss_scaling` (not wrapped further).
      grads: the scaled gradients.
      opt_state: ``tx``'s state.
      params: the parameters.

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
    update = update_of(tx)
    state = update._state(opt_state)
    decision = update.decide(grads, state.loss_scale)
    return update.apply_fused(grads, state, params, decision)


def update_of(tx: Any) -> _Update:
    """The `_Update` of a `loss_scaling` transformation, or a clear error."""
    update = getattr(tx, "update", None)
    if not isinstance(update, _Update):
        raise TypeError(
            "tx must be a transformation made by jls.loss_scaling(...) itself "
            "(not wrapped in optax.chain or another wrapper); for other "
            f"transformations use tx.update and optax.apply_updates. Got {tx!r:.200}"
        )
    return update


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The loss-scale metrics of a step, for logging.

    Args:
      opt_state: a `LossScaleState` or any optimizer state containing one.

    Returns:
      A dict of scalar arrays:

      * ``loss_scale``: the scale for the next step (float32).
      * ``skipped``: whether the latest step's update was dropped (bool).
      * ``nonfinite``: whether the latest step's gradients were not all
        finite (bool). Equal to ``skipped`` unless the scaler applies such
        steps (``skip_nonfinite=False``), or the step's scale was outside the
        scaler's range (then the step counts as non-finite and is dropped).
      * ``consecutive_skips``: skipped steps in a row, ending with the latest.
      * ``total_skips``: skipped steps so far. Retries are not steps.
      * ``consecutive_nonfinite``: steps in a row with non-finite gradients.
      * ``growth_count``: consecutive finite steps towards the next growth.
      * ``retries``: how many times the latest step's gradients were
        recomputed (``jls.train_step(..., max_retries=n)``).
      * ``nonfinite_leaves``: with ``loss_scaling(..., diagnostics=True)``,
        the per-leaf flags of `nonfinite_leaves` (no extra pass over the
        gradients on finite steps).
      * ``diverged``: with ``loss_scaling(..., max_consecutive_skips=n)``,
        whether the run has reached the limit.

    Example:
      >>> import jls
      >>> m = jls.metrics(jls.dynamic_scale().init())
      >>> float(m["loss_scale"]), bool(m["skipped"]), int(m["total_skips"])
      (32768.0, False, 0)
    """
    state = loss_scale_state(opt_state, batched=True)
    return {
        "loss_scale": state.scale,
        "skipped": state.consecutive_skips > 0,
        "nonfinite": state.consecutive_nonfinite > 0,
        "consecutive_skips": state.consecutive_skips,
        "total_skips": state.total_skips,
        "consecutive_nonfinite": state.consecutive_nonfinite,
        "growth_count": state.growth_count,
        "retries": state.retries,
        **_wrapper_metrics(opt_state),
    }


def _wrapper_metrics(opt_state: Any) -> dict[str, Any]:
    found = wrappers(opt_state)
    if len(found) != 1:
        return {}
    out = {}
    if found[0].nonfinite_leaves is not None:
        out["nonfinite_leaves"] = found[0].nonfinite_leaves
    if found[0].diverged is not None:
        out["diverged"] = found[0].diverged
    return out


def wrappers(opt_state: Any) -> list[LossScalingState]:
    """Every `LossScalingState` inside ``opt_state`` (or it itself)."""
    return [
        x
        for x in jax.tree.leaves(
            opt_state, is_leaf=lambda x: isinstance(x, LossScalingState)
        )
        if isinstance(x, LossScalingState)
    ]


def applied_steps(step: Any, opt_state: Any) -> jax.Array:
    """How many of ``step`` optimizer calls were applied (not skipped).

    flax's ``TrainState.step`` and ``nnx.Optimizer.step`` count every call to
    ``apply_gradients``/``update``, skipped or not, while the inner optax
    optimizer's own count (which drives its schedules) only counts applied
    steps. ``applied_steps(state.step, state.opt_state)`` is the number to use
    wherever your code keys something to the step (a hand-written schedule,
    logging), and matches the inner count.

    Args:
      step: the caller's step counter (int array or Python int).
      opt_state: an optimizer state containing a `LossScaleState`.

    Returns:
      ``step - total_skips`` as an int32 array.

    Example:
      >>> import jls
      >>> s = jls.dynamic_scale().adjust(jls.dynamic_scale().init(), False)
      >>> int(jls.applied_steps(5, s))
      4
    """
    skips = loss_scale_state(opt_state, batched=True).total_skips
    return jnp.asarray(step, jnp.int32) - skips


def _wrapper_state(opt_state: Any) -> LossScalingState:
    found = wrappers(opt_state)
    if len(found) != 1:
        raise ValueError(
            "opt_state must contain exactly one jls.LossScalingState, found "
            f"{len(found) or 'no'}"
        )
    if found[0].nonfinite_leaves is None:
        raise ValueError(
            "this state records no per-leaf diagnostics: make the transformation "
            "with jls.loss_scaling(..., diagnostics=True)"
        )
    return found[0]


def nonfinite_leaves(opt_state: Any) -> Any:
    """Which gradient leaves were not finite on the latest step (in ``jit``).

    Args:
      opt_state: the state of a ``loss_scaling(..., diagnostics=True)``
        transformation, or any optimizer state containing it.

    Returns:
      A tree like the parameters of scalar bools; all ``False`` after a
      finite step.

    Raises:
      ValueError: if the state has no diagnostics.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), diagnostics=True)
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> grads = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> jls.nonfinite_leaves(state)
      {'a': Array(False, dtype=bool), 'b': Array(True, dtype=bool)}
    """
    return _wrapper_state(opt_state).nonfinite_leaves


def nonfinite_paths(opt_state: Any) -> list[str]:
    """On the host: the paths of the gradient leaves that were not finite.

    Reads the state (a sync point); use it when ``metrics()["skipped"]``.

    Args:
      opt_state: as for `nonfinite_leaves`.

    Returns:
      Key paths such as ``"['dense']['kernel']"``, in tree order; empty after
      a finite step.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), diagnostics=True)
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> grads = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> jls.nonfinite_paths(state)
      ["['b']"]
    """
    flags = nonfinite_leaves(opt_state)
    return [
        jax.tree_util.keystr(path)
        for path, flag in jax.tree_util.tree_flatten_with_path(flags)[0]
        if bool(flag)
    ]
