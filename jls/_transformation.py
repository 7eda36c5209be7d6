"""`LossScaling`: the object that owns a loss-scaled step, and its optax pair.

`jls.loss_scaling` returns ``LossScaling(...).gradient_transformation()``;
`jls.apply_gradients` (the fused path) and ``tx.update`` share one
implementation, `LossScaling._step`; the decision is `jls._decision`'s. One
step, inside ``jit``:

1. Check that the unscaled gradients would all be finite, reading the
   still-scaled gradients once (`jls._finite`: one sum of magnitudes per leaf
   at the memory-bandwidth floor, exact, and immune to the compiler fusing the
   gradient's producer into it; `jls._squares` when the rule or a hook needs
   the gradients' range or norm). A scale outside the rule's range counts as
   non-finite. Every replica agrees (``pmin`` over ``axis_name`` and any
   ``shard_map`` axis the gradients vary over).
2. The hooks' vetoes (`jls.Hook`), agreed the same way in one collective,
   and their gradient factors (a clipped spike), folded into the unscaling.
3. The skip (`jls._cond`): the applying computation unscales the gradients
   (a multiplication by the reciprocal scale, which XLA fuses into the
   optimizer's elementwise update), runs the inner optimizer and, on the
   fused path, adds the updates; each state leaf is then selected against
   its old value (``donated=True``: one ``lax.cond`` whose skip branch passes
   the state through). Skipped updates are ``-0.0``. The scale rule advances.
4. The hooks record what they keep.

How this was chosen (``benchmarks/bench_step.py``, ``bench_skip.py``):
unscaling before the decision materialises a second gradient tree (1.12x
plain Adam on the 27M LM, donated); a division in the branch is not
duplicated into Adam's two uses of the gradient (1.19x); a multiplication,
1.05x. ``tests/integration/test_perf_guards.py`` asserts the result;
``docs/design.md`` says what is kept from earlier designs, and why.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jls import _cond
from jls._builtins import all_hooks
from jls._decision import Decision, Decisions
from jls._divergence import DIVERGENCE_LIMIT
from jls._dynamic import dynamic_scale
from jls._hooks import Hook, StepInfo, WrapperState
from jls._inner import Transformation, checked_inner
from jls._off import is_off, off_step
from jls._rule import LossScaler, checked_scaler
from jls._scaling import reciprocals, unscale_leaf
from jls._spikes import SpikeRule
from jls._state import LossScaleState, check_state
from jls._tree import holds, merge, split_frozen, split_inexact
from jls._validate import axis_names, flag


class LossScaling(Decisions):
    """Loss scaling around an optax optimizer: the object that owns the step.

    Made by `jls.loss_scaling`, which returns its `gradient_transformation`
    (the optax pair); `jls.apply_gradients` and `jls.train_step` use it too.
    Use it directly when you want its methods without going through a
    transformation. Arguments: as for `jls.loss_scaling`.

    The state is a ``NamedTuple`` with fields ``loss_scale`` (a
    `jls.LossScaleState`), ``inner_state`` (the wrapped optimizer's, bitwise
    unchanged by a skipped step) and ``hooks`` (each hook's state by name);
    read it with `jls.metrics`.

    Attributes:
      inner: the wrapped optimizer (with extra-args support).
      scaler: the `jls.LossScaler`.
      axis_name: the axis names replicas agree over, as a tuple.
      hooks: the `jls.Hook` objects the step consults, in order.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> scaling = jls.LossScaling(optax.sgd(0.5), jls.static_scale(2.0))
      >>> tx = scaling.gradient_transformation()
      >>> params = jnp.ones(2)
      >>> params, state = scaling.apply_gradients(
      ...     jnp.full(2, 2.0), tx.init(params), params
      ... )
      >>> params
      Array([0.5, 0.5], dtype=float32)
    """

    def __init__(
        self,
        inner: Transformation,
        scaler: LossScaler | None = None,
        *,
        axis_name: str | tuple[str, ...] | None = None,
        hooks: Sequence[Hook] = (),
        diagnostics: bool = False,
        max_consecutive_skips: int | None = DIVERGENCE_LIMIT,
        gradient_norm: bool = False,
        skip_spikes: SpikeRule | None = None,
        check_replicas: bool = False,
        donated: bool = False,
        scale_stats: Any = False,
    ) -> None:
        self.inner = checked_inner(inner)
        self.donated = flag("donated", donated)
        self.scaler = dynamic_scale() if scaler is None else checked_scaler(scaler)
        self.axis_name = axis_names("axis_name", axis_name)
        self.hooks = all_hooks(
            hooks,
            diagnostics,
            max_consecutive_skips,
            gradient_norm,
            skip_spikes,
            self.scaler.skip_nonfinite,
            (check_replicas, self.axis_name),
            scale_stats,
            self.donated,
        )

    def __repr__(self) -> str:
        return (
            f"LossScaling(inner={self.inner!r:.80}, scaler={self.scaler!r}, axis_name="
            f"{self.axis_name!r}, hooks={self.hooks!r}, donated={self.donated!r})"
        )

    @staticmethod
    def _of(tx: Any) -> LossScaling:
        """The `LossScaling` behind ``tx`` (made by `jls.loss_scaling`)."""
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
        hooks = {h.name: h.init(params) for h in self.hooks}
        return WrapperState(self.scaler.init(), self.inner.init(params), hooks)

    def update(
        self,
        updates: optax.Updates,
        state: WrapperState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, WrapperState]:
        """Optax's ``update``: takes the SCALED gradients (see `jls.loss_scaling`)."""
        return self._step(updates, state, params, extra_args, fused=False)

    def apply_gradients(
        self,
        grads: optax.Updates,
        opt_state: optax.OptState,
        params: optax.Params,
        **extra_args: Any,
    ) -> tuple[optax.Params, WrapperState]:
        """The fused step (`jls.apply_gradients`): ``(new_params, new_opt_state)``.

        Args:
          grads: the scaled gradients.
          opt_state: this object's state.
          params: the parameters: any pytree, a whole model too (an equinox
            ``Module``). Only its floating arrays whose gradient is not
            ``None`` are stepped (initialise the optimizer on them:
            ``eqx.filter(model, eqx.is_inexact_array)``); every other leaf
            (functions, Python numbers, integer arrays, frozen arrays) is
            returned as it is, as ``eqx.apply_updates`` does.
          **extra_args: forwarded to the inner optimizer's ``update`` (e.g.
            ``value=`` for ``optax.contrib.reduce_on_plateau``); ``loss=`` goes
            to the hooks that watch the loss.
        """
        return self._step(grads, opt_state, params, extra_args, fused=True)

    # Deprecated (jls 0.2 made these public; they are internals) --------------

    @staticmethod
    def of(tx: Any) -> LossScaling:
        """Deprecated: pass ``tx`` to `jls.apply_gradients` / `jls.train_step`."""
        _deprecated("LossScaling.of(tx)", "jls.apply_gradients(tx, ...)")
        return LossScaling._of(tx)

    def decide(self, grads: Any, loss_scale: LossScaleState) -> Decision:
        """Deprecated: the decision is the step's own (`jls.train_step`)."""
        _deprecated("LossScaling.decide", "jls.apply_gradients or jls.train_step")
        return self._decide(grads, loss_scale)

    def check_state(self, opt_state: Any) -> WrapperState:
        """Deprecated: every entry point checks the state."""
        _deprecated("LossScaling.check_state", "jls.apply_gradients or tx.update")
        return self._check_state(opt_state)

    # The one implementation -----------------------------------------------------

    def _step(
        self,
        grads: Any,
        state: Any,
        params: Any,
        extra_args: dict[str, Any],
        *,
        fused: bool,
        decision: Decision | None = None,
        retries: jax.Array | None = None,
        also_finite: Any = None,
    ) -> tuple[Any, WrapperState]:
        """``tx.update`` (``fused=False``) or the fused step (``fused=True``).

        ``decision``: the caller's `_decide` (`jls.train_step` retries), with
        ``retries`` made. ``also_finite``: values checked with the gradients,
        neither unscaled nor measured (flax's fp8 scales and amax histories).
        """
        _check_order(state, params)
        state = self._check_state(state)
        if is_off(self.scaler, self.hooks):
            return off_step(self.inner, grads, state, params, extra_args, fused=fused)
        loss, extra_args = self._pop_loss(extra_args)
        if decision is None:
            decision = self._decide(grads, state.loss_scale, also_finite=also_finite)
        info = StepInfo(
            grads=grads,
            scale=state.loss_scale.scale,
            finite=decision.finite,
            norm=decision.norm,
            loss=loss,
            applied=None,
            loss_scale=None,
            any_replica=lambda flags: self._agree(flags, lax.pmax),
            same_on_replicas=self._same,
            axis_name=self.axis_name,
        )
        vetoed, held = self._vetoes(state, info, decision.apply)
        apply = decision.apply
        for v in vetoed.values():
            apply = apply & ~v
        # Computed once, before the skip (not once per fusion that reads one).
        factors = {}
        if not self.scaler.is_identity:
            two = self.scaler.two_factor
            factors = reciprocals(state.loss_scale.scale, grads, two_factor=two)
        shrink = self._gradient_factor(state, info)
        rest = frozen = None
        if fused:
            params, rest = split_inexact(params)  # a whole model: the rest passes by
            params, frozen = split_frozen(params, grads)  # None gradients: not trained

        def taken(operands):  # and the parameters and updates, for the hooks' reads
            grads, inner_state, params = operands
            if factors or shrink is not None:  # no factors: the scale is 1 forever
                grads = jax.tree.map(lambda g: unscale_leaf(g, factors, shrink), grads)
            updates, inner_state = self.inner.update(
                grads, inner_state, params, **extra_args
            )
            out = optax.apply_updates(params, updates) if fused else updates
            return (out, inner_state), params, updates

        def skipped(operands, out):
            grads, inner_state, params = operands
            if fused:
                return _cond.cast_like((params, inner_state), out)
            zeros = _cond.zeros_like(out[0], grads, params)
            return zeros, _cond.cast_like(inner_state, out[1])

        branches = _cond.reading(self.hooks, state.hooks, taken, skipped, fused)
        # With skip_nonfinite and no veto, finite == applied: a constant in each
        # branch, so the scale rule folds.
        known = self.scaler.skip_nonfinite and not vetoed

        def adjusted(applied: Any) -> LossScaleState:
            # ``applied``: a Python bool in a branch of the conditional, else
            # the traced decision.
            new = self.scaler.adjust(
                state.loss_scale,
                jnp.asarray(applied) if known else decision.finite,
                applied=jnp.asarray(applied),
                magnitude=decision.magnitude,
                retries=retries,
            )
            if held is None or applied is True:
                return new
            kept = self.scaler.hold(state.loss_scale, decision.finite)
            hold = held if applied is False else held & ~applied
            return jax.tree.map(lambda k, n: jnp.where(hold, k, n), kept, new)

        skip = _cond.guarded if self.donated else _cond.selected
        ((out, inner_state), reads), loss_scale = skip(
            apply, *branches, (grads, state.inner_state, params), adjusted
        )
        if fused:
            out = merge(merge(out, frozen), rest)
        after = info._replace(applied=apply, loss_scale=loss_scale, reads=reads)
        no_veto = jnp.asarray(False)
        hooks = {
            h.name: h.update(state.hooks[h.name], after, vetoed.get(h.name, no_veto))
            for h in self.hooks
        }
        return out, WrapperState(loss_scale, inner_state, hooks)

    def _check_state(self, opt_state: Any) -> WrapperState:
        """``opt_state`` if it is a state made by `init`; else a ``TypeError``.

        Checked at trace time; boxed leaves (flax ``nnx``) are unwrapped.
        """
        if not isinstance(opt_state, WrapperState):
            hint = ""
            if holds(opt_state, WrapperState):
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
        hooks = opt_state.hooks
        missing = [h.name for h in self.hooks if h.name not in hooks]
        if missing or not isinstance(hooks, dict):
            raise TypeError(
                f"opt_state has no state for the hooks {missing}: it was not made "
                "by this transformation's init (a transformation made with other "
                "options, such as diagnostics=, gradient_norm=, skip_spikes=)"
            )
        loss_scale = check_state(opt_state.loss_scale, argname="opt_state.loss_scale")
        return opt_state._replace(loss_scale=loss_scale)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in jls 0.4; use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


MISSING: Any = object()


def _check_order(opt_state: Any, params: Any) -> None:
    """Refuses ``params`` and ``opt_state`` passed the wrong way round."""
    if isinstance(params, WrapperState) and not isinstance(opt_state, WrapperState):
        raise TypeError(
            "params is this transformation's state and opt_state is not: they "
            "are swapped. Call apply_gradients(tx, grads, opt_state, params)"
        )
