"""flax drop-ins on jls's fused path: ``jls.flax.Optimizer``, ``jls.flax.TrainState``.

The step is `jls.apply_gradients`; ``step`` counts applied steps only; a
skipped step keeps the state the forward pass wrote (BatchNorm statistics,
fp8 values, which are checked but never unscaled). Needs flax;
``docs/howto/flax.md`` shows both.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state
from flax.training import train_state

from jls._cond import select_tree
from jls._core import step
from jls._loss_scaling import apply_gradients, metrics
from jls._transformation import config_of

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"

__all__ = ["Optimizer", "TrainState"]


class TrainState(train_state.TrainState):
    """linen's ``TrainState`` on jls's fused path; ``step`` counts applied steps.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls, jls.flax
      >>> tx = jls.loss_scaling(optax.sgd(0.5), jls.static_scale(4.0))
      >>> state = jls.flax.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=tx
      ... )
      >>> state = state.apply_gradients(grads={"w": jnp.full(2, 4.0)})
      >>> state.params["w"], int(state.step)
      (Array([0.5, 0.5], dtype=float32), 1)
      >>> state = state.apply_gradients(grads={"w": jnp.full(2, jnp.inf)})
      >>> state.params["w"], int(state.step)  # skipped: nothing moves
      (Array([0.5, 0.5], dtype=float32), 1)
    """

    @classmethod
    def create(cls, *, tx: Any, **kwargs: Any) -> TrainState:  # type: ignore[override]
        """Makes the state as flax does; ``tx`` must be made by `jls.loss_scaling`.

        Raises:
          TypeError: if ``tx`` is not (naming the order that works).
        """
        config_of(tx)
        return super().create(tx=tx, **kwargs)

    def apply_gradients(
        self, *, grads: Any, loss: Any = None, **kwargs: Any
    ) -> TrainState:
        """One fused, loss-scaled step (``grads`` are the scaled gradients).

        ``loss`` (the unscaled loss) goes to a ``jls.hooks.SpikeRule`` that watches
        it; the other keyword arguments replace fields, as flax's do.
        """
        config = config_of(self.tx)
        fp8 = OVERWRITE_WITH_GRADIENT in grads
        params = self.params["params"] if fp8 else self.params
        trainable = grads["params"] if fp8 else grads
        # Every value is checked, fp8 ones too; only the trainable are unscaled.
        extra = {} if loss is None else {"loss": loss}
        new_params, opt_state = step(
            config,
            trainable,
            self.opt_state,
            params,
            extra,
            fused=True,
            also_finite=grads[OVERWRITE_WITH_GRADIENT] if fp8 else None,
        )
        off = config.off  # the plain optimizer
        applied = jnp.asarray(True) if off else ~metrics(opt_state)["skipped"]
        # Every other field the step writes is kept as it was on a skipped step.
        new = dict(kwargs)
        old = {name: getattr(self, name) for name in kwargs}
        if fp8:
            new[OVERWRITE_WITH_GRADIENT] = grads[OVERWRITE_WITH_GRADIENT]
            old[OVERWRITE_WITH_GRADIENT] = self.params[OVERWRITE_WITH_GRADIENT]
        kept = new if off else select_tree(applied, new, old)
        if fp8:
            new_params = {
                "params": new_params,
                OVERWRITE_WITH_GRADIENT: kept.pop(OVERWRITE_WITH_GRADIENT),
            }
        return self.replace(
            step=self.step + applied.astype(jnp.asarray(self.step).dtype),
            params=new_params,
            opt_state=opt_state,
            **kept,
        )


def _pure(tree: Any) -> Any:
    """The arrays of an nnx state, as flax's own ``Optimizer.update`` takes them."""
    if hasattr(nnx, "as_pure"):  # newer flax
        return nnx.as_pure(tree)
    return nnx.to_arrays(nnx.pure(tree))  # pyright: ignore[reportAttributeAccessIssue]


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` on jls's fused path; ``step`` counts applied steps.

    Example:
      >>> import jax.numpy as jnp, optax, jls, jls.flax
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
      >>> optimizer = jls.flax.Optimizer(model, tx, wrt=nnx.Param)
      >>> def loss(m):
      ...     return jls.scale_loss(m(jnp.ones((1, 2))).sum(), optimizer.opt_state)
      >>> optimizer.update(model, nnx.grad(loss)(model))
      >>> int(optimizer.step[...])
      1
    """

    def __init__(
        self, model: Any, tx: Any, *, wrt: Any, keep: Any = nnx.BatchStat, **kwargs: Any
    ) -> None:
        config_of(tx)  # refused here, not at the first update
        super().__init__(model, tx, wrt=wrt, **kwargs)
        self.keep = keep
        # The kept variables after the latest step: a skipped step restores them.
        kept = {} if keep is None else _pure(nnx.state(model, keep, **self._graph()))
        self.kept = nnx.data(to_opt_state(kept))

    def _graph(self) -> dict[str, Any]:
        graph = getattr(self, "graph", None)
        return {} if graph is None else {"graph": graph}

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:  # type: ignore[override]
        """One fused, loss-scaled step (``grads`` are the scaled gradients).

        On a skipped step the ``keep`` variables (``nnx.BatchStat``) are
        restored; ``kwargs`` go to the transformation (``loss=``).
        """
        graph = self._graph()
        params = _pure(nnx.state(model, self.wrt, **graph))
        grad_arrays = _pure(nnx.state(grads, self.wrt, **graph))
        new_params, opt_state = apply_gradients(
            self.tx, grad_arrays, _pure(self.opt_state), params, **_pure(kwargs)
        )
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(opt_state, **graph))
        config = config_of(self.tx)
        off = config.off  # the plain optimizer
        applied = jnp.asarray(True) if off else ~metrics(opt_state)["skipped"]
        if self.keep is not None and not off:
            now = _pure(nnx.state(model, self.keep, **graph))
            kept = select_tree(applied, now, _pure(self.kept))
            nnx.update(model, kept)
            nnx.update(self.kept, to_opt_state(kept))
        self.step[...] += applied.astype(self.step[...].dtype)
