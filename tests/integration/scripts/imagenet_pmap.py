"""flax's ImageNet example converted to jls, on 2 host devices under pmap.

Run by tests/integration/test_flax_imagenet.py in a subprocess (XLA_FLAGS
asks for 2 host devices before jax starts); prints a JSON report.
"""

import json
import os
import pathlib
import runpy
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state

assert jax.local_device_count() == 2, jax.local_device_count()
EXAMPLE = pathlib.Path(__file__).parents[3] / "examples" / "flax_imagenet.py"
ex = runpy.run_path(str(EXAMPLE), run_name="flax_imagenet")
ARGS = ["--width", "8", "--batch-size", "16", "--quiet", "--precision", "float16"]
report = {}


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def replicas_equal(tree):
    return all(
        np.asarray(x)[0].tobytes() == np.asarray(x)[1].tobytes()
        for x in jax.tree.leaves(tree)
    )


# 1. The migrated step keeps the replicas bitwise equal; an inf batch is
#    skipped and the run is unharmed.
clean = ex["main"]([*ARGS, "--steps", "24"])
bad = ex["main"]([*ARGS, "--steps", "24", "--bad-step", "6"])
report["replicas_equal"] = replicas_equal((bad["state"].params, bad["state"].opt_state))
report["skips"] = [clean["total_skips"], bad["total_skips"]]
report["accuracy"] = [clean["test_accuracy"], bad["test_accuracy"]]
report["bad_step_logged_skipped"] = bad["log"][6]["skipped"]

# 2. The skipped step leaves every BatchNorm statistic bitwise unchanged (and
#    flax's own TrainState + DynamicScale idiom writes nan into them).
model = ex["ResNet18"](width=8, dtype=jnp.float16)
state = ex["create_train_state"](jax.random.key(0), model, 0.05, "float16")
state = jax.tree.map(lambda x: jnp.stack([x] * 2), state)
step = jax.pmap(ex["train_step"], axis_name="batch")
images, labels = ex["make_data"](0, 32)
batch = {"image": ex["shard"](images[:16], 2), "label": ex["shard"](labels[:16], 2)}
state, _ = step(state, batch)
inf_batch = dict(batch, image=batch["image"] * 1e6)
after, metrics = step(state, inf_batch)
report["jls_skipped"] = bool(metrics["skipped"][0])
report["jls_batch_stats_unchanged"] = bits(after.batch_stats) == bits(state.batch_stats)
report["jls_params_unchanged"] = bits(
    (after.params, after.opt_state.inner_state)
) == bits((state.params, state.opt_state.inner_state))
report["batch_stats_leaves"] = len(jax.tree.leaves(state.batch_stats))


class FlaxState(train_state.TrainState):
    """flax's example state, with its ``dynamic_scale``."""

    batch_stats: dict
    dynamic_scale: flax_dynamic_scale.DynamicScale


def flax_step(state, batch):
    # flax's examples/imagenet train_step with half precision, as written.
    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["label"]
        ).mean()
        return loss, (new_model_state, logits)

    grad_fn = state.dynamic_scale.value_and_grad(
        loss_fn, has_aux=True, axis_name="batch"
    )
    dynamic_scale, is_fin, (_, (new_model_state, _)), grads = grad_fn(state.params)
    new_state = state.apply_gradients(
        grads=grads, batch_stats=new_model_state["batch_stats"]
    )
    new_state = new_state.replace(
        opt_state=jax.tree.map(
            lambda n, o: jnp.where(is_fin, n, o),
            new_state.opt_state,
            state.opt_state,
        ),
        params=jax.tree.map(
            lambda n, o: jnp.where(is_fin, n, o), new_state.params, state.params
        ),
        dynamic_scale=dynamic_scale,
    )
    return new_state


variables = model.init(jax.random.key(0), jnp.ones((1, 32, 32, 3)), train=False)
fstate = FlaxState.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=optax.sgd(0.05, momentum=0.9),
    batch_stats=variables["batch_stats"],
    dynamic_scale=flax_dynamic_scale.DynamicScale(),
)
fstate = jax.tree.map(lambda x: jnp.stack([x] * 2), fstate)
fstep = jax.pmap(flax_step, axis_name="batch")
fstate = fstep(fstate, batch)
fafter = fstep(fstate, inf_batch)
report["flax_nan_batch_stats_leaves"] = sum(
    not bool(np.all(np.isfinite(np.asarray(x))))
    for x in jax.tree.leaves(fafter.batch_stats)
)

# 3. Resuming: the data offset is step + total_skips (step counts applied steps).
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "state.msgpack")
    first = ex["main"](
        [*ARGS, "--steps", "10", "--bad-step", "3", "--checkpoint", ckpt]
    )
    second = ex["main"]([*ARGS, "--steps", "14", "--checkpoint", ckpt])
report["resume"] = {
    "first": [first["steps_applied"], first["total_skips"], len(first["log"])],
    "second": [second["steps_applied"], second["total_skips"], len(second["log"])],
}
json.dump(report, sys.stdout)
print()
