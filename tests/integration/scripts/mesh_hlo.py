"""The collectives of the compiled mesh step: examples/mesh_lm.py on 4 x 2.

Run by tests/integration/test_perf_guards.py in a subprocess (8 host
devices). Compiles the ``jit`` layout's step (tensor parallel, batch over
``"data"``) with plain optax Adam and with jls (the dynamic and the measured
rule, the fused path), and prints, for each, the all-reduces of its HLO (the
shape of each) and the number of all-gathers.
"""

# pyright: reportMissingImports=false

import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import mesh_lm as m  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jls  # noqa: E402

model = m.LM(jnp.float16)
params = model.init(jax.random.key(0), jnp.zeros((1, m.SEQ), jnp.int32))["params"]
mesh = jax.make_mesh(
    (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
)
specs = jax.tree_util.tree_map_with_path(m.megatron_spec, params)
tokens, weights = next(m.batches(1, -1))
batch = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (tokens, weights)]
loss = m.make_loss(model)


def collectives(tx, plain):
    state = tx.init(params)
    state_specs = optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    place = lambda t, s: jax.tree.map(  # noqa: E731
        lambda a, b: jax.device_put(a, NamedSharding(mesh, b)), t, s
    )

    def step(p, s, t, w):
        if plain:
            g = jax.grad(loss)(p, t, w)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        g = jax.grad(lambda p: jls.scale_loss(loss(p, t, w), s))(p)
        return jls.apply_gradients(tx, g, s, p)

    args = (place(params, specs), place(state, state_specs), *batch)
    hlo = jax.jit(step).lower(*args).compile().as_text() or ""
    return {
        "all_reduce": re.findall(r"= (.+?) all-reduce(?:-start)?\(", hlo),
        "all_gather": len(re.findall(r" all-gather(?:-start)?\(", hlo)),
    }


print(
    json.dumps(
        {
            "plain": collectives(optax.adam(1e-3), True),
            "dynamic": collectives(jls.loss_scaling(optax.adam(1e-3)), False),
            "measured": collectives(
                jls.loss_scaling(optax.adam(1e-3), jls.measured_scale()), False
            ),
        }
    )
)
