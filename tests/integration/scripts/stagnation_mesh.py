"""What jls.hooks.Stagnation adds to a step whose parameters are sharded.

Usage: stagnation_mesh.py   (8 host devices)

Parameters sharded over 8 devices along their first or last axis, or
replicated (3-d kernels cut along their last axis, sharded along the first
or the cut one; conv kernels sharded along C_in), under jax.jit's default
(Auto) mesh: the fused step is compiled without the hook, with
Stagnation(every=16), with Stagnation(every=1) and with scale_stats=True
(its one reduction per leaf is the same kind), and the collectives of each
are counted, under jax.jit over placed arrays and with in_shardings over
host arrays. Then a replicated leaf (8 entries, every update rounded away)
beside a sharded one (shard d moves d + 1 of its 8 entries, the rest have
no update) under shard_map (check_vma True and False) and pmap, a cycle of
2 steps: the fraction, and whether shard_map could return the state
replicated. Prints one JSON line.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jls

mesh = Mesh(np.array(jax.devices()), ("dp",))
specs = {
    "rows": ((1024, 512), P("dp", None)),
    "cols": ((512, 768), P(None, "dp")),
    "vector": ((2048,), P("dp")),
    "head": ((768, 10), P("dp", None)),
    "replicated": ((7, 3), P()),
    "wide": ((256, 2048), P(None, "dp")),
    "tiny": ((8,), P("dp")),
    # (heads, head dim, features): cut along the features (`_cut`: the first
    # axis of a multiple of 16 * 16 entries), sharded along another / along it
    "heads": ((8, 64, 512), P("dp", None, None)),
    "features": ((8, 64, 512), P(None, None, "dp")),
    # cut along the last axis: 4 rows of 64 a step would not split 8 ways
    "fsdp": ((64, 4096), P("dp", None)),
    # conv kernels: read whole, under a mask (4 or 8 of C_in a step would
    # not split 8 ways); a wider one cut along C_in, 16 a step, sharded along it
    "conv": ((3, 3, 64, 64), P(None, None, "dp", None)),
    "conv_wide": ((3, 3, 128, 128), P(None, None, "dp", None)),
    "conv_cut": ((3, 3, 256, 64), P(None, None, "dp", None)),
    "small": ((64, 64), P("dp", None)),
}
params = {k: jnp.ones(shape) for k, (shape, _) in specs.items()}
placed = {k: NamedSharding(mesh, spec) for k, (_, spec) in specs.items()}
params = jax.device_put(params, placed)
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")
result = {}
for name, hooks in [
    ("none", ()),
    ("every16", (jls.hooks.Stagnation(16),)),
    ("every1", (jls.hooks.Stagnation(1),)),
    ("scale_stats", ()),
]:
    stats = name == "scale_stats"
    tx = jls.loss_scaling(
        optax.adam(1e-3), jls.dynamic_scale(), hooks=hooks, scale_stats=stats
    )

    def step(p, s, g, tx=tx):
        return jls.apply_gradients(tx, g, s, p)

    text = jax.jit(step).lower(params, tx.init(params), params).compile().as_text()
    assert text is not None
    result[name] = {k: len(re.findall(rf" {k}(-start)?\(", text)) for k in COLLECTIVES}
    # The same step as jax.jit(..., in_shardings=...) over arrays not yet
    # placed: the leaves' types name no mesh there.
    state = jax.tree.map(np.asarray, tx.init(params))
    laid = jax.jit(
        step,
        in_shardings=(
            placed,
            jax.tree.map(lambda _: NamedSharding(mesh, P()), state),
            placed,
        ),
    )
    host = jax.tree.map(np.asarray, params)
    text = laid.lower(host, state, host).compile().as_text()
    assert text is not None
    counts = {k: len(re.findall(rf" {k}(-start)?\(", text)) for k in COLLECTIVES}
    result[name + " in_shardings"] = counts

bf16 = jnp.bfloat16
mixed = {"r": jnp.ones(8, bf16), "s": jnp.ones(64, bf16)}
moving = (np.arange(64) % 8 < np.arange(64) // 8 + 1).astype(np.float32)
grads = {"r": jnp.full(8, 1e-4), "s": jnp.asarray(0.1 * moving)}
specs = {"r": P(), "s": P("dp")}
tx = jls.loss_scaling(  # jax records no varying axes under check_vma=False, pmap
    optax.sgd(-1.0),
    jls.no_scale(),
    axis_name={"dp": specs},
    hooks=[jls.hooks.Stagnation(2)],
)


def body(g, s, p):
    return jls.apply_gradients(tx, g, s, p)


for vma in (True, False):
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, P(), specs),
            out_specs=(specs, P()),
            check_vma=vma,
        )
    )
    p, s = mixed, tx.init(mixed)
    for _ in range(2):
        p, s = f(grads, s, p)
    result[f"shard_map_vma{vma}"] = float(jls.metrics(s)["stagnant_fraction"])

split = {"r": jnp.stack([mixed["r"]] * 8), "s": mixed["s"].reshape(8, 8)}
split_grads = {"r": jnp.stack([grads["r"]] * 8), "s": grads["s"].reshape(8, 8)}
state = jax.tree.map(lambda x: jnp.stack([x] * 8), tx.init(mixed))
f = jax.pmap(body, axis_name="dp")
p, s = split, state
for _ in range(2):
    p, s = f(split_grads, s, p)
result["pmap"] = np.asarray(jls.metrics(s)["stagnant_fraction"]).tolist()
print(json.dumps(result))
