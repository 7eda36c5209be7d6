"""The gradient norm and the spike veto under shard_map and pmap (2 devices)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jls

mesh = jax.make_mesh((2,), ("model",))
report = {}

# Model parallel: one leaf sharded over "model", one replicated over it.
tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(), gradient_norm=True)
specs = {"sharded": P("model"), "replicated": P()}
grads = {"sharded": jnp.arange(1.0, 5.0), "replicated": jnp.full(4, 1.0)}
grads = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), grads, specs
)
state = tx.init(grads)
step = jax.jit(
    jax.shard_map(
        lambda g, s, p: jls.apply_gradients(tx, g, s, p),
        mesh=mesh,
        in_specs=(specs, P(), specs),
        out_specs=(specs, P()),
    )
)
_, new = step(grads, state, grads)
true = float(np.sqrt(sum((np.asarray(x) ** 2).sum() for x in jax.tree.leaves(grads))))
report["norm"] = [float(jls.metrics(new)["gradient_norm"]), true]

# Data parallel under pmap: each replica watches its own loss; a spike on one
# is a skip on both.
rule = jls.hooks.SpikeRule(watch="loss", warmup=3, threshold=3.0)
tx = jls.loss_scaling(optax.sgd(0.01), jls.no_scale(), skip_spikes=rule, axis_name="r")
params = {"w": jnp.ones(2)}
state = jax.tree.map(lambda x: jnp.stack([x, x]), tx.init(params))
rep_params = jax.tree.map(lambda x: jnp.stack([x, x]), params)


@functools.partial(jax.pmap, axis_name="r")
def pstep(params, state, loss):
    grads = jax.lax.pmean({"w": jnp.full(2, 0.5)}, "r")
    return jls.apply_gradients(tx, grads, state, params, loss=loss)


skipped = []
for i in range(6):
    losses = jnp.asarray([1.0 + 0.01 * i, 1.0 + 0.01 * i if i != 5 else 50.0])
    rep_params, state = pstep(rep_params, state, losses)
    skipped.append(np.asarray(jls.metrics(state)["skipped"]).tolist())
report["skipped"] = skipped
report["params_agree"] = bool(np.array_equal(*np.asarray(rep_params["w"])))

# Explicit sharding: a leaf sharded on its second axis cannot be reshaped
# (the squares check and diagnostics must not ravel it), real or complex.
from jax.sharding import AxisType  # noqa: E402

explicit = jax.make_mesh((2,), ("m",), axis_types=(AxisType.Explicit,))
report["explicit"] = {}
with jax.set_mesh(explicit):
    for dtype in (jnp.float32, jnp.complex64):
        values = np.ones((4, 4), dtype)
        grads = {"w": jax.device_put(values, P(None, "m"))}
        values[1, 3] = np.nan
        bad = {"w": jax.device_put(values, P(None, "m"))}
        for name, options in [
            ("norm", {"gradient_norm": True}),
            ("measured", {"scaler": jls.measured_scale()}),
            ("diagnostics", {"diagnostics": True}),
        ]:
            options = dict(options)
            scaler = options.pop("scaler", jls.dynamic_scale(4.0))
            tx = jls.loss_scaling(optax.sgd(0.1), scaler, **options)
            update = jax.jit(tx.update)
            got = []
            for g in (grads, bad):
                _, new = update(g, tx.init(g), g)
                metrics = jls.metrics(new)
                got.append(
                    [
                        bool(metrics["skipped"]),
                        float(metrics.get("gradient_norm", -1.0)),
                        bool(jax.tree.leaves(metrics["nonfinite_leaves"])[0])
                        if options.get("diagnostics")
                        else None,
                    ]
                )
            report["explicit"][f"{jnp.dtype(dtype).name}-{name}"] = got
print(json.dumps(report))
