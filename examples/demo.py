"""``python examples/demo.py``: float16 training with and without loss scaling.

The demo is a program, not API: its functions may change in any release.

Trains one small network on scikit-learn's bundled handwritten digits (no
download) in five modes side by side, with float32 master weights in the
first four mixed modes:

- ``f32``: float32 compute, plain optax (the reference);
- ``f16``: float16 compute, plain optax, no loss scaling;
- ``f16-jls``: float16 compute, `jls.loss_scaling` with a dynamic scale;
- ``bf16``: bfloat16 compute, `jls.no_scale` (skip non-finite steps only);
- ``f16-state``: as ``f16-jls`` with no float32 copy at all: the parameters
  and Adam's moments in float16 (`jls.precision.scaled_state`: the moments scaled per
  array, Adam run in float32), the parameters stochastically rounded
  (`jls.precision.stochastic_rounding`): half of ``f16-jls``'s bytes.

The configuration shows the problem loss scaling solves, measured rather than
asserted: a 6-layer GELU network trained full-batch with Adam on the mean
cross-entropy. Once it fits the training set, each example's contribution to
the gradient (its small error divided by the 1437 examples of the mean) falls
below float16's smallest subnormal, 2**-24, and rounds to zero in the float16
backward pass. A growing fraction of gradient entries becomes exactly zero
and plain float16 training stalls, while float16 with jls keeps tracking
float32: the scale grows (a doubling every 50 finite steps) until the
gradients fit, and backs off when they overflow. The "underflow" the demo
reports is measured on the gradients each mode's optimizer receives: of the
entries that are nonzero when the same gradient is computed in float32 at the
same parameters, the fraction that is exactly zero in that mode.

It prints a progress bar per mode, then a table: the final training loss
and the held-out (test) loss (both evaluated in float32), test accuracy,
skipped steps (modes without jls cannot skip: "-"), the final loss scale,
the underflow fraction averaged over the run and over its last tenth ("at
end"), the megabytes of the parameters and the optimizer's state, and the
training seconds
(compilation excluded). Below it, ``f16-jls``'s own view of its scale:
``jls.loss_scaling(..., scale_stats=True)`` records, in the step, the
fraction of the scaled gradient entries below float16's smallest normal and
the headroom to overflow in bits (``jls.metrics``), averaged over the last
tenth's applied steps. It writes ``summary.json`` and ``demo.png`` (loss
curves, the loss-scale trajectory with skipped steps marked, the underflow
fraction per step with ``f16-jls``'s statistics beside it, and a histogram of
gradient magnitudes against the float16 range) to ``--out``.

The demo needs the ``demo`` extra: ``pip install -e ".[demo]"`` in a checkout
of the repository (jls is not on a package index yet; scikit-learn,
matplotlib, tqdm).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlp import forward, init_params, loss_fn

import jls

MODES: dict[str, Any] = {
    "f32": jnp.float32,
    "f16": jnp.float16,
    "f16-jls": jnp.float16,
    "bf16": jnp.bfloat16,
    "f16-state": jnp.float16,
}
F16_TINY = 2.0**-24  # smallest float16 subnormal; half of it rounds to zero
F16_NORMAL = 2.0**-14  # smallest normal float16
F16_MAX = 65504.0
TRAIN_SIZE = 1437  # 80% of scikit-learn's 1797 digits


@dataclasses.dataclass(frozen=True)
class Config:
    """What the demo trains; the defaults finish in about 3 minutes on 2 CPUs.

    Attributes:
      steps: optimizer steps per mode.
      seed: seeds the train/test split, the initialization and minibatches.
      modes: which of `MODES` to train, in order.
      width: hidden units per layer.
      depth: hidden layers.
      learning_rate: Adam's learning rate.
      batch: examples per step; 0 trains full-batch on the training split.
        Underflow is always measured on the full-batch gradient (with the
        mode's dtype and current scale), so with minibatches it describes the
        parameters' state rather than the exact gradients each step applied.
      init_scale: the initial loss scale of the ``f16-jls`` mode.
      growth_interval: finite steps between scale doublings in ``f16-jls``.
      chunk: steps per compiled call; underflow is measured once per chunk.

    Example:
      >>> import demo
      >>> config = demo.Config(steps=200, modes=("f16", "f16-jls"))
      >>> config.depth, config.width, config.modes
      (6, 128, ('f16', 'f16-jls'))
    """

    steps: int = 1500
    seed: int = 0
    modes: tuple[str, ...] = tuple(MODES)
    width: int = 128
    depth: int = 6
    learning_rate: float = 5e-3
    batch: int = 0
    init_scale: float = 2.0**15
    growth_interval: int = 50
    chunk: int = 25

    def __post_init__(self):
        for name in ("steps", "width", "depth", "growth_interval", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int):
            raise ValueError(f"batch must be an int, got {self.batch!r}")
        if not 0 <= self.batch <= TRAIN_SIZE:
            raise ValueError(
                f"batch must be in [0, {TRAIN_SIZE}] (0: full batch), "
                f"got {self.batch!r}"
            )
        if not self.learning_rate > 0:
            raise ValueError(
                f"learning_rate must be positive, got {self.learning_rate!r}"
            )
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(
                f"modes must be a non-empty subset of {list(MODES)}, got {self.modes!r}"
            )


def load_digits(seed: int) -> tuple[np.ndarray, ...]:
    """The 1797 8x8 digits of scikit-learn, split 80/20 by ``seed``.

    Returns:
      ``(x_train, y_train, x_test, y_test)``: float32 pixels in [0, 1] and
      int32 labels.

    Example:
      >>> import demo
      >>> x_train, y_train, x_test, y_test = demo.load_digits(0)
      >>> x_train.shape, x_test.shape, x_train.dtype.name, int(y_train.max())
      ((1437, 64), (360, 64), 'float32', 9)
    """
    from sklearn.datasets import load_digits as _load

    pixels, labels = _load(return_X_y=True)
    x = (np.asarray(pixels) / 16.0).astype(np.float32)
    y = np.asarray(labels).astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = TRAIN_SIZE
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def underflow_fraction(grads: Any, reference: Any) -> jax.Array:
    """Of the entries nonzero in ``reference``, the fraction that are 0 in ``grads``.

    Args:
      grads: a gradient tree as some mode's optimizer receives it.
      reference: the same gradient computed in float32.

    Returns:
      A float32 scalar in [0, 1].

    Example:
      >>> import jax.numpy as jnp
      >>> ref = jnp.array([1e-9, 1e-3, 0.0, 2.0])
      >>> float(underflow_fraction(ref.astype(jnp.float16), ref))
      0.3333333432674408
    """
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True)
    lost = nonzero = jnp.zeros((), jnp.float32)
    for g, r in pairs:
        nonzero_r = r != 0
        lost += jnp.sum(nonzero_r & (g == 0), dtype=jnp.float32)
        nonzero += jnp.sum(nonzero_r, dtype=jnp.float32)
    return lost / jnp.maximum(nonzero, 1.0)


def make_optimizer(mode: str, config: Config) -> optax.GradientTransformation:
    """Adam, wrapped by jls in the ``f16-jls``, ``bf16`` and ``f16-state`` modes.

    Example:
      >>> import jax.numpy as jnp, jls
      >>> import demo
      >>> tx = demo.make_optimizer("f16-jls", demo.Config())
      >>> float(jls.metrics(tx.init(jnp.zeros(2)))["loss_scale"])
      32768.0
    """
    adam = optax.adam(config.learning_rate)
    if mode == "f16-jls":
        scaler = jls.dynamic_scale(
            config.init_scale, growth_interval=config.growth_interval
        )
        # scale_stats: jls's own view of the scale, read by the table's note
        # and the plot (it changes nothing in the step).
        return jls.loss_scaling(adam, scaler, scale_stats=True)
    if mode == "bf16":
        return jls.loss_scaling(adam, jls.no_scale())
    if mode == "f16-state":  # float16 parameters and moments, no float32 copy
        scaler = jls.dynamic_scale(
            config.init_scale, growth_interval=config.growth_interval
        )
        inner = jls.precision.stochastic_rounding(
            jls.precision.scaled_state(adam), seed=config.seed
        )
        return jls.loss_scaling(inner, scaler)
    return adam


@dataclasses.dataclass
class History:
    """Per-step and per-chunk records of one mode's run.

    Attributes:
      loss: the training loss of every step (the mode's own forward pass).
      scale: the loss scale every step used (1 without jls).
      skipped: whether every step's gradients were not finite.
      underflow_steps: the steps after which underflow was measured.
      underflow: the underflow fraction measured then (`underflow_fraction`).
      stats_underflow: ``f16-jls`` only (else empty): every step's
        ``jls.metrics(...)["underflow_fraction"]`` (``scale_stats=True``), the
        fraction of its scaled gradient entries below float16's smallest
        normal, zeros included.
      stats_headroom: ``f16-jls`` only: every step's ``headroom_bits``.

    Example:
      >>> import demo
      >>> config = demo.Config(steps=4, chunk=2)
      >>> _, history, _ = demo.train_mode("f16-jls", config, demo.load_digits(0))
      >>> len(history.loss), history.scale, history.underflow_steps
      (4, [32768.0, 32768.0, 32768.0, 32768.0], [2, 4])
    """

    loss: list[float] = dataclasses.field(default_factory=list)
    scale: list[float] = dataclasses.field(default_factory=list)
    skipped: list[bool] = dataclasses.field(default_factory=list)
    underflow_steps: list[int] = dataclasses.field(default_factory=list)
    underflow: list[float] = dataclasses.field(default_factory=list)
    stats_underflow: list[float] = dataclasses.field(default_factory=list)
    stats_headroom: list[float] = dataclasses.field(default_factory=list)


def train_mode(
    mode: str,
    config: Config,
    data: tuple[np.ndarray, ...],
    *,
    progress: Callable[..., Any] | None = None,
) -> tuple[dict[str, Any], History, Any]:
    """Trains one mode; returns its summary row, history and final params.

    Args:
      mode: one of `MODES`.
      config: what to train.
      data: ``load_digits(seed)``.
      progress: called after every chunk as ``progress(steps_done_in_chunk,
        loss=..., underflow=...)``.

    Returns:
      ``(row, history, params)``: the table row (a dict), the `History`, and
      the final float32 parameters.

    Raises:
      ValueError: for an unknown ``mode`` or a ``config.batch`` out of range.

    Example:
      >>> import demo
      >>> config = demo.Config(steps=10)
      >>> row, history, params = demo.train_mode("f32", config, demo.load_digits(0))
      >>> row["mode"], row["steps"], row["underflow_mean"], len(history.loss)
      ('f32', 10, 0.0, 10)
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    dtype = MODES[mode]
    x_train, y_train, x_test, y_test = (jnp.asarray(a) for a in data)
    n = x_train.shape[0]
    batch = n if config.batch in (0, n) else config.batch
    if not 0 < batch <= n:
        raise ValueError(f"batch must be in [0, {n}], got {config.batch!r}")
    tx = make_optimizer(mode, config)
    uses_jls = mode in ("f16-jls", "bf16", "f16-state")
    sizes = [x_train.shape[1], *[config.width] * config.depth, 10]
    params = init_params(jax.random.key(config.seed), sizes)
    if mode == "f16-state":  # the parameters themselves in float16
        params = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    opt_state = tx.init(params)
    # The parameters and the optimizer's own state (not jls's few scalars).
    inner_state = opt_state.inner_state if uses_jls else opt_state
    state_bytes = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves((params, inner_state))
    )
    data_key = jax.random.key(config.seed + 1)

    def gradients(params, opt_state, xb, yb):
        def objective(p):
            loss = loss_fn(p, xb, yb, dtype)
            return (jls.scale_loss(loss, opt_state) if uses_jls else loss), loss

        return jax.grad(objective, has_aux=True)(params)

    if uses_jls:
        jls_step = jls.train_step(lambda p, x, y: loss_fn(p, x, y, dtype), tx)

    def one_step(carry, step):
        params, opt_state = carry
        if batch == n:
            xb, yb = x_train, y_train
        else:
            idx = jax.random.choice(
                jax.random.fold_in(data_key, step), n, (batch,), replace=False
            )
            xb, yb = x_train[idx], y_train[idx]
        if uses_jls:  # scale, differentiate, check, apply: one fused jls step
            params, opt_state, out = jls_step(params, opt_state, xb, yb)
            stats = jls.metrics(opt_state)
            record = (
                out.loss,
                out.loss_scale,
                out.skipped,
                stats.get("underflow_fraction", jnp.float32(jnp.nan)),
                stats.get("headroom_bits", jnp.float32(jnp.nan)),
            )
        else:
            grads, loss = gradients(params, opt_state, xb, yb)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            nan = jnp.float32(jnp.nan)
            record = (loss, jnp.float32(1.0), ~jls.all_finite(grads), nan, nan)
        return (params, opt_state), record

    # Not donated: jls's step is the same either way, nothing to declare.
    @functools.partial(jax.jit, static_argnums=3)
    def run_chunk(params, opt_state, first_step, length):
        steps = first_step + jnp.arange(length)
        (params, opt_state), records = jax.lax.scan(
            one_step, (params, opt_state), steps
        )
        grads, _ = gradients(params, opt_state, x_train, y_train)
        wide = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        reference = jax.grad(loss_fn)(wide, x_train, y_train, jnp.float32)
        frac = underflow_fraction(grads, reference)
        next_scale = jls.metrics(opt_state)["loss_scale"] if uses_jls else 1.0
        return params, opt_state, records, frac, next_scale

    history = History()
    next_scale = 1.0
    seconds = 0.0
    done = 0
    while done < config.steps:
        length = min(config.chunk, config.steps - done)
        start = time.perf_counter()
        params, opt_state, records, frac, next_scale = run_chunk(
            params, opt_state, jnp.int32(done), length
        )
        loss, scale, skipped, stats_underflow, stats_headroom = jax.device_get(records)
        frac = float(frac)
        if done > 0:  # the first chunk includes compilation: not timed
            seconds += time.perf_counter() - start
        history.loss.extend(float(v) for v in loss)
        history.scale.extend(float(v) for v in scale)
        history.skipped.extend(bool(v) for v in skipped)
        if mode == "f16-jls":
            history.stats_underflow.extend(float(v) for v in stats_underflow)
            history.stats_headroom.extend(float(v) for v in stats_headroom)
        done += length
        history.underflow_steps.append(done)
        history.underflow.append(frac)
        if progress is not None:
            progress(length, loss=float(loss[-1]), underflow=frac)

    final_loss = float(loss_fn(params, x_train, y_train, jnp.float32))
    logits = forward(params, x_test, jnp.float32)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    test_loss = float(loss_fn(params, x_test, y_test, jnp.float32))
    tail = max(1, len(history.underflow) // 10)
    row = {
        "mode": mode,
        "final_loss": final_loss,
        "test_accuracy": accuracy,
        "test_loss": test_loss,
        "state_bytes": int(state_bytes),
        "skipped_steps": int(sum(history.skipped)) if uses_jls else None,
        "nonfinite_steps": int(sum(history.skipped)),
        "final_scale": float(next_scale) if uses_jls else None,
        "underflow_mean": float(np.mean(history.underflow)),
        "underflow_final": float(np.mean(history.underflow[-tail:])),
        "seconds": seconds,
        "steps": config.steps,
    }
    if history.stats_underflow:  # jls's own statistics: the last tenth's
        last = max(1, len(history.stats_underflow) // 10)  # applied steps
        applied = ~np.asarray(history.skipped[-last:])
        for key, values in (
            ("stats_underflow_final", history.stats_underflow),
            ("stats_headroom_final", history.stats_headroom),
        ):
            kept = np.asarray(values[-last:])[applied]  # none: None (JSON null)
            row[key] = float(np.mean(kept)) if kept.size else None
    return row, history, params


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a fixed-width text table.

    Example:
      >>> import demo
      >>> row = {"mode": "f16-jls", "final_loss": 1e-6, "test_loss": 0.09,
      ...        "test_accuracy": 0.99, "skipped_steps": 3, "final_scale": 2.0**30,
      ...        "underflow_mean": 0.001, "underflow_final": 0.0,
      ...        "state_bytes": 1106044, "seconds": 9.5}
      >>> table = demo.format_table([row])
      >>> print(table)  # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
      mode      final loss  test loss  test acc  skipped  final scale  underflow ...
      -----------------------------------------------------------------------...
      f16-jls    1.000e-06     0.0900     0.990        3        2**30       0.1% ...
      >>> table.splitlines()[2][-22:]  # underflow at end, MB, time s
      '   0.0%   1.11     9.5'
    """
    header = (
        f"{'mode':<8} {'final loss':>11} {'test loss':>10} {'test acc':>9} "
        f"{'skipped':>8} {'final scale':>12} {'underflow':>10} {'at end':>7} "
        f"{'MB':>6} {'time s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        scale = r["final_scale"]
        skipped = "-" if r["skipped_steps"] is None else str(r["skipped_steps"])
        if scale is None:
            scale_text = "-"
        elif _is_pow2(scale):
            scale_text = f"2**{int(math.log2(scale))}"
        else:
            scale_text = f"{scale:g}"
        lines.append(
            f"{r['mode']:<8} {r['final_loss']:>11.3e} {r['test_loss']:>10.4f} "
            f"{r['test_accuracy']:>9.3f} {skipped:>8} {scale_text:>12} "
            f"{100 * r['underflow_mean']:>9.1f}% {100 * r['underflow_final']:>6.1f}% "
            f"{r['state_bytes'] / 1e6:>6.2f} {r['seconds']:>7.1f}"
        )
    return "\n".join(lines)


def _is_pow2(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


def _plot(
    path: pathlib.Path,
    histories: dict[str, History],
    gradient_magnitudes: np.ndarray,
    jls_scale: float | None,
) -> None:
    """Writes the four-panel figure to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0, 0]
    for mode, h in histories.items():
        ax.plot(np.arange(1, len(h.loss) + 1), h.loss, label=mode, lw=1.2)
    ax.set(yscale="log", xlabel="step", ylabel="training loss")
    ax.set_title("Loss (log scale)")
    ax.legend()

    ax = axes[0, 1]
    if "f16-jls" in histories:
        h = histories["f16-jls"]
        steps = np.arange(1, len(h.scale) + 1)
        ax.plot(steps, h.scale, color="C2", label="loss scale (f16-jls)")
        skipped = np.flatnonzero(h.skipped)
        if skipped.size:
            ax.scatter(
                skipped + 1,
                np.asarray(h.scale)[skipped],
                marker="x",
                color="C3",
                label=f"skipped step ({skipped.size})",
                zorder=3,
            )
        ax.set_yscale("log", base=2)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "f16-jls not run", ha="center", transform=ax.transAxes)
    ax.set(xlabel="step", ylabel="loss scale used by the step")
    ax.set_title("Loss-scale trajectory")

    ax = axes[1, 0]
    colors = {}
    for mode, h in histories.items():
        (line,) = ax.plot(h.underflow_steps, 100 * np.asarray(h.underflow), label=mode)
        colors[mode] = line.get_color()
    if "f16-jls" in histories and histories["f16-jls"].stats_underflow:
        h = histories["f16-jls"]
        # Skipped steps' statistics (the gradients were not finite): gaps.
        stats = np.where(h.skipped, np.nan, h.stats_underflow)
        ax.plot(
            np.arange(1, len(stats) + 1),
            100 * stats,
            color=colors["f16-jls"],
            ls=":",
            lw=0.8,
            label="f16-jls, jls's scale_stats (< float16 normal)",
        )
    ax.set(xlabel="step", ylabel="% of nonzero float32 gradient entries = 0")
    ax.set_title("Gradient entries lost to underflow")
    ax.legend()

    ax = axes[1, 1]
    mags = gradient_magnitudes[gradient_magnitudes > 0]
    if mags.size:
        logs = np.log2(mags)
        lo = min(float(logs.min()), -34.0)
        hi = max(float(logs.max()), 17.0)
        if jls_scale is not None:
            hi = max(hi, float(logs.max()) + math.log2(jls_scale))
        bins = np.linspace(lo, hi + 1, 80)
        ax.hist(logs, bins=bins, color="C0", alpha=0.7, label="gradients (float32)")
        if jls_scale is not None:
            ax.hist(
                logs + math.log2(jls_scale),
                bins=bins,
                color="C2",
                alpha=0.5,
                label=f"x final jls scale 2**{math.log2(jls_scale):g}",
            )
        ax.axvspan(lo, math.log2(F16_TINY) - 1, color="C3", alpha=0.15)
        ax.axvspan(
            math.log2(F16_TINY) - 1, math.log2(F16_NORMAL), color="C1", alpha=0.12
        )
        ax.axvspan(math.log2(F16_MAX), hi + 1, color="C3", alpha=0.15)
        ax.text(lo + 0.5, ax.get_ylim()[1] * 0.9, "-> 0 in f16", color="C3")
        ax.text(math.log2(F16_TINY), ax.get_ylim()[1] * 0.8, "subnormal", color="C1")
        ax.text(math.log2(F16_MAX), ax.get_ylim()[1] * 0.7, "inf", color="C3")
        ax.legend(loc="upper right")
    ax.set(xlabel="log2 |gradient entry|", ylabel="entries")
    ax.set_title("Parameter gradients at the end (f32 run) vs the float16 range")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    config: Config, out: pathlib.Path, *, show_progress: bool = True
) -> list[dict[str, Any]]:
    """Trains every mode of ``config``, prints the table, writes the files.

    Returns:
      The table rows (also written to ``out / "summary.json"``).

    Example:
      >>> import pathlib, tempfile
      >>> import demo
      >>> out = pathlib.Path(tempfile.mkdtemp())
      >>> config = demo.Config(steps=5, modes=("f16",))
      >>> rows = demo.run(config, out, show_progress=False)  # doctest: +ELLIPSIS
      mode      final loss ...
      ...
      f16 ...
      >>> sorted(p.name for p in out.iterdir())
      ['demo.png', 'summary.json']
    """
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    data = load_digits(config.seed)
    rows, histories, final_params = [], {}, {}
    for mode in config.modes:
        with tqdm(
            total=config.steps,
            desc=f"{mode:<8}",
            unit="step",
            disable=not show_progress,
            file=sys.stderr,
        ) as bar:

            def progress(n, bar=bar, **postfix):
                bar.update(n)
                bar.set_postfix(
                    loss=f"{postfix['loss']:.2e}",
                    underflow=f"{100 * postfix['underflow']:.0f}%",
                )

            row, history, params = train_mode(mode, config, data, progress=progress)
        rows.append(row)
        histories[mode] = history
        final_params[mode] = params

    x_train, y_train = jnp.asarray(data[0]), jnp.asarray(data[1])
    # The float32 gradient at the end of the f32 run, or of the first mode run.
    reference_mode = "f32" if "f32" in final_params else config.modes[0]
    reference_params = final_params[reference_mode]
    grads = jax.grad(loss_fn)(reference_params, x_train, y_train, jnp.float32)
    magnitudes = np.concatenate([np.abs(np.ravel(g)) for g in jax.tree.leaves(grads)])
    jls_row = next((r for r in rows if r["mode"] == "f16-jls"), None)
    _plot(
        out / "demo.png",
        histories,
        magnitudes,
        None if jls_row is None else jls_row["final_scale"],
    )
    summary = {
        "config": dataclasses.asdict(config),
        "rows": rows,
        "float16_min_subnormal": F16_TINY,
        "gradient_entries_below_float16_min_subnormal": float(
            np.mean(magnitudes[magnitudes > 0] < F16_TINY / 2)
        ),
        "gradient_reference_mode": reference_mode,
        "devices": [str(d) for d in jax.devices()],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(rows))
    below = 100 * summary["gradient_entries_below_float16_min_subnormal"]
    print(
        f"\nAt the end of the {reference_mode} run, {below:.1f}% of the nonzero "
        "float32 gradient entries\nlie below half of float16's smallest subnormal: "
        "unscaled, float16 rounds them to 0."
    )
    if jls_row is not None and jls_row.get("stats_underflow_final") is not None:
        print(
            "f16-jls, jls's own statistics (scale_stats=True) over the last "
            "tenth's applied steps:\n"
            f"{100 * jls_row['stats_underflow_final']:.1f}% of the scaled gradient "
            "entries below float16's smallest normal (zeros included), "
            f"{jls_row['stats_headroom_final']:.1f} bits\nof headroom to overflow."
        )
    print(f"wrote {out / 'demo.png'} and {out / 'summary.json'}")
    return rows


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"modes must be a comma-separated subset of {','.join(MODES)}, got {text!r}"
        )
    return modes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Parses the command line and runs the demo (``python examples/demo.py``).

    Args:
      argv: the arguments; ``None`` reads ``sys.argv``.

    Returns:
      The table rows, as `run` returns them.

    Example:
      >>> import tempfile
      >>> import demo
      >>> args = ["--steps", "5", "--modes", "bf16", "--no-progress"]
      >>> rows = demo.main([*args, "--out", tempfile.mkdtemp()])  # doctest: +ELLIPSIS
      mode ...
      >>> rows[0]["mode"], rows[0]["final_scale"]
      ('bf16', 1.0)
    """
    defaults = Config()
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="python examples/demo.py",
        description=(
            "Train a 6-layer MLP on scikit-learn's digits in float32, float16 "
            "without loss scaling, float16 with jls dynamic loss scaling, "
            "bfloat16 (float32 master weights), and float16 with no float32 "
            "copy, and show what float16 "
            "underflow does to training. Prints a table and writes demo.png "
            "and summary.json to --out."
        ),
        epilog=(
            "modes: f32 = float32 compute, plain optax; f16 = float16 compute, "
            "plain optax, no loss scaling; f16-jls = float16 compute with "
            f"jls.loss_scaling(dynamic_scale(2**{math.log2(defaults.init_scale):g}, "
            f"growth_interval={defaults.growth_interval})); bf16 = "
            "bfloat16 compute with jls.no_scale() (skip non-finite steps); "
            "f16-state = f16-jls with float16 parameters and Adam moments "
            "(jls.precision.scaled_state, jls.precision.stochastic_rounding), "
            "no float32 copy. "
            "Columns: final loss = training loss at the end, evaluated in "
            "float32; test loss = the same on the 360 held-out digits; MB = "
            "the parameters and the optimizer's state; underflow = of the "
            "gradient entries nonzero in float32 "
            "at the same parameters, the fraction that is exactly 0 in the "
            "mode's gradients, averaged over the run and over its last tenth "
            "(at end); time s = training time without compilation. Needs the "
            'demo extra: pip install -e ".[demo]" in a checkout of the jls repository.'
        ),
    )
    parser.add_argument(
        "--steps",
        type=_positive,
        default=defaults.steps,
        help=f"optimizer steps per mode (default {defaults.steps}); float16 "
        "underflow sets in after a few hundred",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed for the split, the initialization and minibatches "
        f"(default {defaults.seed})",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jls-demo"),
        help="folder for demo.png and summary.json (default ./jls-demo)",
    )
    parser.add_argument(
        "--modes",
        type=_modes,
        default=defaults.modes,
        help=f"comma-separated modes to train, from {','.join(MODES)} (default all)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=defaults.batch,
        help="examples per step; 0 = full batch of the 1437 training digits "
        "(default). Smaller batches make per-example gradients larger and "
        "underflow later",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="do not show progress bars"
    )
    args = parser.parse_args(argv)
    try:
        config = dataclasses.replace(
            defaults,
            steps=args.steps,
            seed=args.seed,
            modes=args.modes,
            batch=args.batch,
        )
    except ValueError as e:
        parser.error(str(e))
    try:
        import matplotlib  # noqa: F401
        import sklearn  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as e:
        parser.exit(
            2,
            f"examples/demo.py needs the demo extra ({e.name} is missing): "
            'pip install -e ".[demo]"  (in a checkout of the jls repository)\n',
        )
    return run(config, args.out, show_progress=not args.no_progress)


if __name__ == "__main__":
    main()
