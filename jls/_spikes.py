"""Skipping steps whose gradient norm or loss spikes.

LLM trainers drop a step whose loss or gradient norm is an outlier against
its recent history (MaxText's ``skip_step_on_spikes``, OLMo-core's
skip-step optimizer). jls has the gradient norm from its finite check's one
pass, so the rule costs a few scalar operations per step. It is a veto on
top of the scaler's decision: a spike is dropped like a non-finite step
(counted in ``total_skips``, nothing changes), but the scaler sees finite
gradients, so the scale does not back off.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jls._validate import F32_MAX, integer, real

_WATCHED = ("norm", "loss", "both")


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    """Skip a step whose gradient norm (or loss) spikes; hashable, validated.

    A value ``x`` (the global norm of the unscaled gradients, or the loss
    given to the step as ``loss=``) is a spike when ``x > mean + threshold *
    std``, the running mean and standard deviation of the values of the
    applied steps before it. The statistics are exponential moving averages
    over about ``window`` steps (exact averages over the first ``window``);
    the rule acts once ``warmup`` steps have fed them. A skipped step (spike
    or non-finite) does not update them.

    Attributes:
      threshold: how many standard deviations above the mean make a spike;
        ``> 0``. Default 6 (OLMo-core's).
      warmup: applied steps before the rule acts, ``>= 2``.
      window: the statistics' horizon in steps, ``>= 1``.
      watch: ``"norm"`` (default), ``"loss"`` or ``"both"``. Watching the
        loss needs ``loss=`` (the unscaled loss, a scalar) on every step.

    Example:
      >>> import jls
      >>> jls.SpikeRule(threshold=4.0, warmup=50).watch
      'norm'
      >>> jls.SpikeRule(threshold=0)
      Traceback (most recent call last):
      ...
      ValueError: threshold must be > 0, got 0.0
    """

    threshold: float = 6.0
    warmup: int = 100
    window: int = 100
    watch: str = "norm"

    def __post_init__(self) -> None:
        threshold = real("threshold", self.threshold)
        if not 0 < threshold < float("inf"):
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        object.__setattr__(self, "threshold", threshold)
        object.__setattr__(self, "warmup", integer("warmup", self.warmup, 2))
        object.__setattr__(self, "window", integer("window", self.window, 1))
        if self.watch not in _WATCHED:
            raise ValueError(f"watch must be one of {_WATCHED}, got {self.watch!r}")

    @property
    def watches_loss(self) -> bool:
        """Whether every step needs ``loss=``."""
        return self.watch != "norm"

    @property
    def watches_norm(self) -> bool:
        """Whether the rule reads the gradient norm."""
        return self.watch != "loss"


class SpikeState(NamedTuple):
    """The spike rule's statistics: array leaves of fixed dtype.

    Attributes:
      count: int32, applied steps that fed the statistics (saturates).
      norm_mean, norm_var: float32, the gradient norm's running mean and
        variance.
      loss_mean, loss_var: float32, the loss's.
      spike: bool, whether the latest step was skipped as a spike.
      total_spikes: int32, steps skipped as spikes so far (saturates).
    """

    count: jax.Array
    norm_mean: jax.Array
    norm_var: jax.Array
    loss_mean: jax.Array
    loss_var: jax.Array
    spike: jax.Array
    total_spikes: jax.Array


def init() -> SpikeState:
    """The statistics before the first step."""
    f32, i32 = np.float32, np.int32
    return SpikeState(
        count=jnp.asarray(i32(0)),
        norm_mean=jnp.asarray(f32(0)),
        norm_var=jnp.asarray(f32(0)),
        loss_mean=jnp.asarray(f32(0)),
        loss_var=jnp.asarray(f32(0)),
        spike=jnp.asarray(np.bool_(False)),
        total_spikes=jnp.asarray(i32(0)),
    )


def check_loss(rule: SpikeRule, loss: Any) -> jax.Array | None:
    """The ``loss=`` argument as a float32 scalar; a ``TypeError`` if missing."""
    if loss is None:
        if rule.watches_loss:
            raise TypeError(
                f"SpikeRule(watch={rule.watch!r}) needs the step's loss: pass "
                "loss=<the unscaled loss> to update / apply_gradients"
            )
        return None
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"loss must be a floating scalar, got dtype {loss.dtype} and shape "
            f"{loss.shape}"
        )
    return loss.astype(jnp.float32)


def _outlier(
    rule: SpikeRule, x: jax.Array, mean: jax.Array, var: jax.Array
) -> jax.Array:
    return x > mean + jnp.float32(rule.threshold) * jnp.sqrt(var)


def is_spike(rule: SpikeRule, state: SpikeState, norm: Any, loss: Any) -> jax.Array:
    """Whether this step is a spike.

    An outlier once ``warmup`` applied steps fed the statistics; a watched
    loss that is not finite (inf or nan, with finite gradients) at any time.
    A non-finite norm is the finite check's business, not a spike.
    """
    spike = jnp.asarray(False)
    if rule.watches_norm:
        spike = spike | _outlier(rule, norm, state.norm_mean, state.norm_var)
    if rule.watches_loss:
        spike = spike | _outlier(rule, loss, state.loss_mean, state.loss_var)
    spike = (state.count >= jnp.int32(rule.warmup)) & spike
    if rule.watches_loss:
        spike = spike | ~jnp.isfinite(loss)
    return spike


def _moments(
    alpha: jax.Array, x: jax.Array, mean: jax.Array, var: jax.Array
) -> tuple[jax.Array, jax.Array]:
    delta = x - mean
    var = jnp.where(alpha < 1, (1 - alpha) * (var + alpha * delta * delta), 0)
    # A huge value must not make the variance inf (then nan): it saturates.
    return mean + alpha * delta, jnp.minimum(var, jnp.float32(F32_MAX))


def advance(
    rule: SpikeRule,
    state: SpikeState,
    *,
    applied: jax.Array,
    spike: jax.Array,
    norm: Any,
    loss: Any,
) -> SpikeState:
    """The statistics after a step.

    Only an applied step whose watched values are finite feeds them (with
    ``skip_nonfinite=False`` a non-finite step is applied, and would poison
    them for good).
    """
    count = jnp.asarray(optax.safe_increment(state.count))
    alpha = jnp.maximum(1 / count.astype(jnp.float32), jnp.float32(1 / rule.window))
    new = state
    if rule.watches_norm:
        norm_mean, norm_var = _moments(alpha, norm, state.norm_mean, state.norm_var)
        new = new._replace(norm_mean=norm_mean, norm_var=norm_var)
    if rule.watches_loss:
        loss_mean, loss_var = _moments(alpha, loss, state.loss_mean, state.loss_var)
        new = new._replace(loss_mean=loss_mean, loss_var=loss_var)
    new = new._replace(count=count)
    feeds = applied
    if rule.watches_norm:
        feeds = feeds & jnp.isfinite(norm)
    if rule.watches_loss:
        feeds = feeds & jnp.isfinite(loss)
    kept = jax.tree.map(lambda n, o: jnp.where(feeds, n, o), new, state)
    return kept._replace(
        spike=spike,
        total_spikes=jnp.where(
            spike, optax.safe_increment(state.total_spikes), state.total_spikes
        ),
    )
