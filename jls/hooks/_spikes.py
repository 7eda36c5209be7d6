"""Skipping (or clipping) steps whose gradient norm or loss spikes."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jls._tree import plain
from jls._validate import F32_MAX, integer, positive_f32, real
from jls.hooks._hooks import Hook, StepInfo

_WATCHED = ("norm", "loss", "both")
_ACTIONS = ("skip", "clip")


@dataclasses.dataclass(frozen=True)
class SpikeRule(Hook):
    """Skip a step whose gradient norm (or loss) spikes; hashable, validated.

    A value (the gradient norm, or the ``loss=``) is a spike above
    ``limit = mean + threshold * std`` of its moving averages; it is skipped
    (the scale holds) or clipped to ``limit``. See docs/howto/spikes.md.

    Attributes:
      threshold: standard deviations above the mean that make a spike; ``> 0``.
      warmup: applied steps before the rule acts, ``>= 2``.
      window: the statistics' horizon in steps, ``>= 1``.
      watch: ``"norm"`` (default), ``"loss"`` or ``"both"`` (needs ``loss=``).
      patience: spikes in a row after which the statistics restart, ``>= 1``.
      action: ``"skip"`` (default) or ``"clip"`` (needs ``watch="norm"``).

    Example:
      >>> import jls
      >>> jls.hooks.SpikeRule(threshold=4.0, warmup=50).watch
      'norm'
      >>> jls.hooks.SpikeRule(threshold=0)
      Traceback (most recent call last):
      ...
      ValueError: threshold must be > 0, got 0.0
    """

    threshold: float = 6.0
    warmup: int = 100
    window: int = 100
    watch: str = "norm"
    patience: int = 25
    action: str = "skip"

    def __post_init__(self) -> None:
        threshold = real("threshold", self.threshold)
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        threshold = positive_f32("threshold", threshold)
        object.__setattr__(self, "threshold", threshold)
        object.__setattr__(self, "warmup", integer("warmup", self.warmup, 2))
        object.__setattr__(self, "window", integer("window", self.window, 1))
        object.__setattr__(self, "patience", integer("patience", self.patience, 1))
        if self.watch not in _WATCHED:
            raise ValueError(f"watch must be one of {_WATCHED}, got {self.watch!r}")
        if self.action not in _ACTIONS:
            raise ValueError(f"action must be one of {_ACTIONS}, got {self.action!r}")
        if self.action == "clip" and self.watch != "norm":
            raise ValueError(
                f"action='clip' clips the gradient norm, so it needs watch='norm', "
                f"got watch={self.watch!r}; to act on loss spikes use "
                "action='skip'"
            )

    name = "spikes"

    @property
    def watches_loss(self) -> bool:
        """Whether every step needs ``loss=``."""
        return self.watch != "norm"

    @property
    def watches_norm(self) -> bool:
        """Whether the rule reads the gradient norm."""
        return self.watch != "loss"

    @property
    def needs_loss(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        """Whether every step needs ``loss=``."""
        return self.watches_loss

    @property
    def needs_norm(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        """Whether the rule reads the gradient norm."""
        return self.watches_norm

    def init(self, params: Any) -> SpikeState:
        """The statistics before the first step."""
        del params
        return init()

    @property
    def clips(self) -> bool:
        """Whether a spike is clipped (applied shrunk) rather than skipped."""
        return self.action == "clip"

    def veto(self, state: Any, info: StepInfo) -> jax.Array:
        """Whether to skip this step: a spike (`is_spike`).

        Clipping, only a spike float32 cannot clip.
        """
        spike = is_spike(self, state, info.norm, info.loss, info.finite)
        if not self.clips:
            return spike
        factor = clip_factor(self, state, info.norm, info.finite)
        tiny = jnp.float32(np.finfo(np.float32).tiny)
        carried = (factor == 0) | (factor / info.scale >= tiny)
        return spike & ~(jnp.isfinite(jnp.asarray(info.norm)) & carried)

    def gradient_factor(self, state: Any, info: StepInfo) -> jax.Array | None:
        """``limit / norm`` on a spike, else 1 (clipping); ``None`` when skipping."""
        if not self.clips:
            return None
        return clip_factor(self, state, info.norm, info.finite)

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> SpikeState:
        """The statistics after the step (see `advance`)."""
        assert info.applied is not None
        norm = info.norm
        if self.clips:
            # A clipped step is a spike that was applied, with norm ``limit``.
            spike = is_spike(self, state, norm, None, info.finite)
            clipped = spike & info.applied
            norm = jnp.where(clipped, limit(self, state), jnp.asarray(norm))
            vetoed = clipped | vetoed
        return advance(
            self,
            state,
            applied=info.applied,
            spike=vetoed,
            norm=norm,
            loss=info.loss,
        )


class SpikeState(NamedTuple):
    """The spike rule's statistics (``count``, norm and loss mean and variance).

    ``spike``: the latest step was a spike; ``total_spikes``, ``consecutive_spikes``.
    """

    count: jax.Array
    norm_mean: jax.Array
    norm_var: jax.Array
    loss_mean: jax.Array
    loss_var: jax.Array
    spike: jax.Array
    total_spikes: jax.Array
    consecutive_spikes: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``spike`` (the latest step was one) and ``total_spikes``."""
        return {"spike": plain(self.spike), "total_spikes": plain(self.total_spikes)}


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
        consecutive_spikes=jnp.asarray(i32(0)),
    )


def _restarted(state: SpikeState) -> SpikeState:
    """The statistics with a fresh start (the counters of spikes kept)."""
    fresh = init()
    return fresh._replace(
        spike=state.spike,
        total_spikes=state.total_spikes,
        consecutive_spikes=state.consecutive_spikes,
    )


def sanitized(state: SpikeState) -> SpikeState:
    """``state``, or a fresh start of statistics that cannot be right (nan, < 0)."""
    ok = state.count >= 0
    for x in (state.norm_mean, state.loss_mean):
        ok = ok & jnp.isfinite(x)
    ok = ok & (state.norm_mean >= 0)  # a mean of norms
    for x in (state.norm_var, state.loss_var):
        ok = ok & jnp.isfinite(x) & (x >= 0)
    fresh = _restarted(state)
    state = jax.tree.map(lambda s, f: jnp.where(ok, s, f), state, fresh)
    zero = jnp.int32(0)
    return state._replace(
        total_spikes=jnp.maximum(state.total_spikes, zero),
        consecutive_spikes=jnp.maximum(state.consecutive_spikes, zero),
    )


def _bound(rule: SpikeRule, mean: jax.Array, var: jax.Array) -> jax.Array:
    return mean + jnp.float32(rule.threshold) * jnp.sqrt(var)


def _outlier(
    rule: SpikeRule, x: jax.Array, mean: jax.Array, var: jax.Array
) -> jax.Array:
    return x > _bound(rule, mean, var)


def limit(rule: SpikeRule, state: SpikeState) -> jax.Array:
    """The largest norm that is no spike, in ``[0, float32 max]`` (`sanitized`)."""
    state = sanitized(state)
    bound = _bound(rule, state.norm_mean, state.norm_var)
    return jnp.clip(bound, jnp.float32(0), jnp.float32(F32_MAX))


def clip_factor(
    rule: SpikeRule, state: SpikeState, norm: Any, finite: Any = None
) -> jax.Array:
    """``limit / norm`` in ``[0, 1)`` on a spike (0 past float32's range); else 1."""
    spike = is_spike(rule, state, norm, None, finite)
    safe = jnp.where(spike, norm, jnp.float32(1))
    return jnp.where(spike, jnp.minimum(limit(rule, state) / safe, 1), 1).astype(
        jnp.float32
    )


def is_spike(
    rule: SpikeRule, state: SpikeState, norm: Any, loss: Any, finite: Any = None
) -> jax.Array:
    """Whether this step is a spike: an outlier once ``warmup`` steps fed the rule.

    A non-finite norm is a spike only where the gradients were ``finite``.
    """
    state = sanitized(state)
    spike = jnp.asarray(False)
    if rule.watches_norm:
        outlier = _outlier(rule, norm, state.norm_mean, state.norm_var)
        measured = jnp.isfinite(norm) if finite is None else jnp.isfinite(norm) | finite
        spike = spike | (outlier & measured)
    if rule.watches_loss:
        spike = spike | _outlier(rule, loss, state.loss_mean, state.loss_var)
    return (state.count >= jnp.int32(rule.warmup)) & spike


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
    """The statistics after a step, fed by applied steps with finite values."""
    state = sanitized(state)
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
    run = jnp.where(spike, optax.safe_increment(state.consecutive_spikes), 0)
    kept = kept._replace(
        spike=spike,
        total_spikes=jnp.where(
            spike, optax.safe_increment(state.total_spikes), state.total_spikes
        ),
        consecutive_spikes=run,
    )
    # A run of `patience` spikes: the level moved; learn it again.
    restart = run >= jnp.int32(rule.patience)
    fresh = _restarted(kept)._replace(consecutive_spikes=jnp.int32(0))
    return jax.tree.map(lambda f, k: jnp.where(restart, f, k), fresh, kept)
