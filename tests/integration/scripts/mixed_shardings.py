"""A skipped step whose old and new values are placed differently.

Usage: mixed_shardings.py   (8 host devices)

Parameters sharded over an Auto mesh (jax.jit's default) meet optimizer
state that tx.init made unplaced; with an Explicit mesh the same is done
with and without jax.set_mesh. Each runs a finite step and a skipped one
through apply_gradients and tx.update, donated and not, and prints what
came back as one JSON line.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jls


def run(mesh, donated, fused):
    spec = {"w": P(None, "dp"), "b": P("dp")}
    params = {"w": jnp.ones((3, 8)), "b": jnp.ones(8)}
    placed = jax.tree.map(lambda s: NamedSharding(mesh, s), spec)
    params = jax.device_put(params, placed)
    tx = jls.loss_scaling(optax.adam(0.1), jls.dynamic_scale())
    state = tx.init(jax.tree.map(np.asarray, params))  # unplaced state

    def step(p, s, g):
        if fused:
            return jls.apply_gradients(tx, g, s, p)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(step, donate_argnums=(0, 1) if donated else ())
    out = []
    for value in (1.0, np.inf):
        grads = jax.tree.map(lambda x, v=value: jnp.full(x.shape, v), params)
        before = jax.tree.map(np.asarray, params)
        params, state = step(params, state, grads)
        after = jax.tree.map(np.asarray, params)
        same = all(np.array_equal(before[k], after[k]) for k in before)
        out.append(same)
    return {"unchanged": out, "scale": float(jls.loss_scale_state(state).scale)}


devices = np.array(jax.devices())
result = {}
for donated in (False, True):
    for fused in (False, True):
        key = f"donated{donated}_fused{fused}"
        result["auto_" + key] = run(Mesh(devices, ("dp",)), donated, fused)
        explicit = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Explicit,))
        result["explicit_" + key] = run(explicit, donated, fused)
        with jax.set_mesh(explicit):
            result["explicit_set_" + key] = run(explicit, donated, fused)
print(json.dumps(result))
