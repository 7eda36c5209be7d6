"""What jls.hooks.Stagnation adds to a step whose parameters are sharded.

Usage: stagnation_mesh.py   (8 host devices)

Parameters sharded over 8 devices along their first or last axis, or
replicated, under jax.jit's default (Auto) mesh: the fused step is compiled
without the hook, with Stagnation(every=16) and with Stagnation(every=1),
and the collectives of each are counted. Prints one JSON line.
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
]:
    tx = jls.loss_scaling(optax.adam(1e-3), jls.dynamic_scale(), hooks=hooks)

    def step(p, s, g, tx=tx):
        return jls.apply_gradients(tx, g, s, p)

    text = jax.jit(step).lower(params, tx.init(params), params).compile().as_text()
    assert text is not None
    result[name] = {k: len(re.findall(rf" {k}(-start)?\(", text)) for k in COLLECTIVES}
print(json.dumps(result))
