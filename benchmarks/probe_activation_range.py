"""An activation-gradient probe, evaluated for `jls.measured_scale`.

The measured rule sees the parameters' gradients; float16 overflows in the
activations' gradients. This script puts an identity "probe" after every
layer of the demo's MLP whose backward pass returns the max |cotangent| as
the gradient of a dummy slot (the way flax's fp8 ops return amax values),
trains with `measured_scale()` in float16, and reports how far the largest
activation gradient sits above the largest parameter-gradient RMS (the
measurement the rule keeps `margin` below float16's maximum).

Run: ``python benchmarks/probe_activation_range.py``. Not part of jls: a
probe needs the model changed and a max reduction per activation.
"""

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls
from jls._decision import decide
from jls._transformation import config_of

# The demo's model and data (examples/demo.py, examples/mlp.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import demo  # noqa: E402
import mlp  # noqa: E402


@jax.custom_vjp
def probe(x, slot):
    return x


def _fwd(x, slot):
    return x, None


def _bwd(_, ct):
    # The "gradient" of the slot is the cotangent's max |value| (in float32).
    return ct, jnp.max(jnp.abs(ct.astype(jnp.float32)))


probe.defvjp(_fwd, _bwd)


def forward(params, x, dtype, slots):
    h = x.astype(dtype)
    for i, layer in enumerate(params):
        w, b = layer["w"].astype(dtype), layer["b"].astype(dtype)
        h = h @ w + b
        h = probe(h, slots[i])
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    return h.astype(jnp.float32)


def main(argv=None) -> None:
    """Trains with the probes and prints the activation-gradient range."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=1500, help="float16 steps")
    args = parser.parse_args(argv)
    x, y, _, _ = demo.load_digits(0)
    x, y = jnp.asarray(x), jnp.asarray(y)
    params = mlp.init_params(jax.random.key(0), [x.shape[1], *[128] * 6, 10])
    n = len(params)
    tx = jls.loss_scaling(optax.adam(5e-3), jls.measured_scale())
    state = tx.init(params)
    config = config_of(tx)

    @jax.jit
    def step(params, state):
        def loss(p, slots):
            logits = forward(p, x, jnp.float16, slots)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return jls.scale_loss(ce, state)

        g, amax = jax.grad(loss, argnums=(0, 1))(params, jnp.zeros(n))
        d = decide(config, g, jls.loss_scale_state(state))
        params, state = jls.apply_gradients(tx, g, state, params)
        return params, state, d.magnitude, jnp.max(amax), d.finite

    ratios = []
    for _ in range(args.steps):
        params, state, m, a, fin = step(params, state)
        if bool(fin) and float(m) > 0:
            ratios.append(float(a) / float(m))
    r = np.log2(np.array(ratios))
    p50, p99 = np.median(r), np.percentile(r, 99)
    print(f"{len(r)} finite steps; log2(largest activation gradient /")
    print(f"  largest parameter-gradient RMS): min {r.min():.1f}, median {p50:.1f},")
    print(f"  99th percentile {p99:.1f}, max {r.max():.1f}")
    m = jls.metrics(state)
    scale, skips = float(m["loss_scale"]), int(m["total_skips"])
    print(f"final scale 2**{np.log2(scale):.0f}, skipped steps {skips}")


if __name__ == "__main__":
    main()
