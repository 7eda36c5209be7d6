"""flax's ImageNet example, converted to jls: a linen ResNet, BatchNorm, ``pmap``.

The structure of flax's ``examples/imagenet`` (``train.py`` and
``models.py``): a ResNet18 with BatchNorm, a ``TrainState`` carrying
``batch_stats``, a train step ``pmap``-ed over a ``'batch'`` axis whose
gradients are averaged with ``lax.pmean``, and one script for every
precision. What changed for jls (the migration guide, ``docs/from_flax.md``,
shows it as a diff):

* ``jls.flax.TrainState`` instead of flax's, and no ``dynamic_scale`` field:
  the scale lives in the optimizer state, made by ``jls.loss_scaling(tx,
  scaler, axis_name="batch")``. ``jls.presets.flax()`` is flax's
  ``DynamicScale`` rule; float32 and bfloat16 runs use
  ``jls.no_scale(skip_nonfinite=False)``, the plain optimizer exactly.
* The loss is ``jls.scale_loss(loss, state.opt_state)`` and the gradient
  code has one branch; ``lax.pmean(grads, "batch")`` stays (``axis_name``
  only makes the replicas agree on the skip and the scale).
* The ``jnp.where`` block that restored the state after a non-finite step
  is gone: a skipped step leaves the parameters, the optimizer state and the
  ``batch_stats`` passed to ``apply_gradients`` bitwise as they were.
* ``state.step`` counts applied steps (the learning-rate schedule's step);
  the number of calls, the data loop's resume offset, is ``step +
  total_skips``.
* The state is donated to the step (flax's example does not donate), so XLA
  updates it in place; jls's step is the same either way, nothing to
  declare. ``--no-donate`` runs flax's way (``benchmarks/bench_resnet.py``
  measures both).

The data are synthetic (no downloads): small images of 10 classes, each a
fixed random pattern plus noise. The script asks XLA for two host devices
(``XLA_FLAGS``) when none are set, so ``pmap`` runs on a CPU-only machine.

Run: ``python examples/flax_imagenet.py`` (``--help`` lists the options).
Needs flax (``pip install -e ".[flax]"``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import functools  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import serialization  # noqa: E402
from jax import lax  # noqa: E402

import jls  # noqa: E402
import jls.flax  # noqa: E402

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
CLASSES = 10


class ResNetBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a projected shortcut."""

    filters: int
    conv: Callable[..., Any]
    norm: Callable[..., Any]
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):  # noqa: D102
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = nn.relu(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides)(residual)
            residual = self.norm()(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """An ImageNet-style ResNet: 7x7 stem, max pool, four stages, mean pool."""

    stage_sizes: Sequence[int]
    width: int = 64
    num_classes: int = CLASSES
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):  # noqa: D102
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        x = conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)])(x)
        x = nn.relu(norm()(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.width * 2**i, conv, norm, strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, jnp.float32)  # the loss in float32


ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2))


class TrainState(jls.flax.TrainState):
    """flax's example state: parameters, optimizer state, BatchNorm statistics."""

    batch_stats: Any


def make_data(seed: int, n: int, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images of ``CLASSES`` classes: a fixed pattern per class, plus noise."""
    patterns = np.random.default_rng(1234).normal(size=(CLASSES, size, size, 3))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, size=n)
    images = patterns[labels] + 1.5 * rng.normal(size=(n, size, size, 3))
    return images.astype(np.float32), labels.astype(np.int32)


def scaler_for(precision: str) -> jls.LossScaler:
    """float16 needs a loss scale; float32 and bfloat16 step as plain optax."""
    if precision == "float16":
        return jls.presets.flax()  # flax's DynamicScale() rule
    return jls.no_scale(skip_nonfinite=False)


def create_train_state(
    rng: jax.Array,
    model: ResNet,
    lr: float,
    precision: str,
    image_size: int = 32,
) -> TrainState:
    """The state of flax's ``create_train_state``, with jls's transformation."""
    variables = model.init(rng, jnp.ones((1, image_size, image_size, 3)), train=False)
    schedule = optax.cosine_decay_schedule(lr, 1000)
    tx = jls.loss_scaling(
        optax.sgd(schedule, momentum=0.9, nesterov=True),
        scaler_for(precision),
        axis_name="batch",
    )
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )


def train_step(state: TrainState, batch: dict[str, jax.Array]):
    """One step on each replica's shard of the batch (under ``pmap``)."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        one_hot = jax.nn.one_hot(batch["label"], CLASSES)
        loss = optax.softmax_cross_entropy(logits, one_hot).mean()
        penalty = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
        loss = loss + 1e-4 * 0.5 * penalty
        return jls.scale_loss(loss, state.opt_state), (loss, new_model_state, logits)

    grads, (loss, new_model_state, logits) = jax.grad(loss_fn, has_aux=True)(
        state.params
    )
    grads = lax.pmean(grads, axis_name="batch")  # data parallelism: the mean
    new_state = state.apply_gradients(
        grads=grads, batch_stats=new_model_state["batch_stats"]
    )
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    metrics = lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")
    return new_state, metrics | jls.metrics(new_state.opt_state)


def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> jax.Array:
    """Accuracy on each replica's shard, averaged over the replicas."""
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, batch["image"], train=False)
    return lax.pmean(jnp.mean(jnp.argmax(logits, -1) == batch["label"]), "batch")


def sync_batch_stats(state: TrainState) -> TrainState:
    """The replicas' mean statistics (flax's example does this before eval)."""
    mean = jax.pmap(lambda x: lax.pmean(x, "x"), "x")
    return state.replace(batch_stats=mean(state.batch_stats))


def shard(x: np.ndarray, devices: int) -> jax.Array:
    return jnp.asarray(x.reshape(devices, -1, *x.shape[1:]))


def calls(state: TrainState) -> int:
    """How many times the step ran: applied steps plus skipped ones.

    The data loop's resume offset (``state.step`` counts applied steps).
    """
    first = jax.tree.map(lambda x: x[0], state)
    return int(first.step) + int(jls.metrics(first.opt_state)["total_skips"])


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, optionally resumes from a checkpoint; returns a summary."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--precision",
        choices=list(DTYPES),
        default="float16",
        help="compute dtype of the model",
    )
    parser.add_argument("--width", type=int, default=16, help="ResNet18's filters")
    parser.add_argument("--steps", type=int, default=60, help="train steps")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument(
        "--bad-step", type=int, default=None, help="multiply this step's images by 1e6"
    )
    parser.add_argument(
        "--no-donate", action="store_true", help="do not donate the state"
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="a file: resume from it if it exists, save to it at the end",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)

    devices = jax.local_device_count()
    model = ResNet18(width=args.width, dtype=DTYPES[args.precision])
    state = create_train_state(jax.random.key(0), model, args.lr, args.precision)
    start = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        with open(args.checkpoint, "rb") as f:
            state = serialization.from_bytes(state, f.read())
        start = int(state.step) + int(jls.metrics(state.opt_state)["total_skips"])
    state = jax.tree.map(lambda x: jnp.stack([x] * devices), state)  # replicate
    donate = () if args.no_donate else (0,)
    p_train_step = jax.pmap(train_step, axis_name="batch", donate_argnums=donate)
    p_eval_step = jax.pmap(eval_step, axis_name="batch")

    images, labels = make_data(0, args.steps * args.batch_size)
    log = []
    for step in range(start, args.steps):
        lo = step * args.batch_size
        x, y = images[lo : lo + args.batch_size], labels[lo : lo + args.batch_size]
        if step == args.bad_step:
            x = x * 1e6  # overflows float16
        batch = {"image": shard(x, devices), "label": shard(y, devices)}
        state, metrics = p_train_step(state, batch)
        m = jax.tree.map(lambda v: v[0].item(), metrics)
        log.append(m)
        if not args.quiet and (step % 10 == 0 or m["skipped"]):
            print(
                f"step {step:3d}  loss {m['loss']:.3f}  accuracy {m['accuracy']:.2f}  "
                f"scale {m['loss_scale']:g}  skipped {m['skipped']}"
            )
    assert calls(state) == args.steps  # every batch consumed exactly once
    state = sync_batch_stats(state)
    x_test, y_test = make_data(1, 8 * args.batch_size)
    accuracy = float(
        np.mean(
            [
                p_eval_step(
                    state,
                    {
                        "image": shard(x_test[i : i + args.batch_size], devices),
                        "label": shard(y_test[i : i + args.batch_size], devices),
                    },
                )[0]
                for i in range(0, len(x_test), args.batch_size)
            ]
        )
    )
    if args.checkpoint:
        with open(args.checkpoint, "wb") as f:
            f.write(serialization.to_bytes(jax.tree.map(lambda v: v[0], state)))
    summary = {
        "devices": devices,
        "test_accuracy": accuracy,
        "final_loss": log[-1]["loss"] if log else None,
        "total_skips": int(jls.metrics(state.opt_state)["total_skips"][0]),
        "steps_applied": int(state.step[0]),
        "log": log,
        "state": state,
    }
    if not args.quiet:
        print(f"held-out accuracy {accuracy:.3f} (chance {1 / CLASSES:.2f})")
    return summary


if __name__ == "__main__":
    main()
