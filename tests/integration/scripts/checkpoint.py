"""Checkpoint a jls run with orbax mid-run, resume in a fresh process.

Usage: checkpoint.py MODE DIR [--sharded]
  full:   run all steps uninterrupted; write DIR/full.npz
  save:   run the first half; save params + optimizer state with orbax
  resume: (a fresh process) restore, run the second half; write DIR/resumed.npz
Steps 3, 4 and 5 straddle the checkpoint (after step 4) and overflow.
With --sharded (8 host devices) the parameters and Adam moments are sharded.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jls
from jls import LossScalingState

mode, root = sys.argv[1], sys.argv[2]
sharded = "--sharded" in sys.argv
STEPS, HALF, BAD = 8, 4, {3, 4, 5}

tx = jls.loss_scaling(optax.adamw(1e-2), jls.dynamic_scale(2.0**8, growth_interval=2))
params = {"w": jnp.linspace(-1.0, 1.0, 32).reshape(4, 8), "b": jnp.full((8,), 0.1)}
if sharded:
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    shardings = {
        "w": NamedSharding(mesh, P(None, "dp")),
        "b": NamedSharding(mesh, P("dp")),
    }
    params = jax.device_put(params, shardings)


def loss_fn(p, x):
    return jnp.mean((x @ p["w"] + p["b"][None, :]) ** 2)


@jax.jit
def train_step(params, opt_state, x):
    grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, x), opt_state))(params)
    return jls.apply_gradients(tx, grads, opt_state, params)


def batch(i):
    x = np.linspace(0.0, 1.0, 6 * 4, dtype=np.float32).reshape(6, 4) + i
    if i in BAD:
        x[i % 6, 1] = np.inf
    return jnp.asarray(x)


def run(params, opt_state, steps):
    for i in steps:
        params, opt_state = train_step(params, opt_state, batch(i))
    return params, opt_state


def dump(path, tree):
    leaves = jax.tree.leaves(tree)
    np.savez(path, *[np.asarray(x) for x in leaves])


opt_state = tx.init(params)
ckpt_dir = os.path.join(os.path.abspath(root), "ckpt")
if mode == "full":
    dump(os.path.join(root, "full.npz"), run(params, opt_state, range(STEPS)))
elif mode == "save":
    state = run(params, opt_state, range(HALF))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(ckpt_dir, {"params": state[0], "opt_state": state[1]})
elif mode == "resume":
    target = jax.eval_shape(lambda: {"params": params, "opt_state": opt_state})
    if sharded:
        # Restore every leaf with the sharding a fresh init gives it; the
        # scale and counters (uncommitted scalars there) come back replicated.
        live = {"params": params, "opt_state": opt_state}

        def sharding(x):
            if isinstance(x.sharding, NamedSharding):
                return x.sharding
            return NamedSharding(mesh, P())

        target = jax.tree.map(
            lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(x)),
            target,
            live,
        )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(ckpt_dir, target)
    state = (restored["params"], restored["opt_state"])
    assert isinstance(state[1], LossScalingState), type(state[1])
    if sharded:
        assert state[0]["w"].sharding.spec == P(None, "dp"), state[0]["w"].sharding
    dump(os.path.join(root, "resumed.npz"), run(*state, range(HALF, STEPS)))
print("ok")
