"""What `jls.precision.explain_step` finds, and what one call costs.

Found: each planted overflow of ``tests/planted_faults.py`` explained, and
whether the report names its pass, primitive, line, layer (and loop
iteration). Cost: on a float16 pre-norm residual network (the model of
``examples/why_skip.py``), one ``explain_step`` call (trace, compile and
run) against one jitted step (``jax.grad`` of the scaled loss: compile and
first run), each a fresh one in interleaved calls (medians, and the range of
the per-call ratio), and the explainer's program run again against the
step's run, compiled (medians). Times are the process's CPU time (all its threads), as
the machine is shared.

    python benchmarks/bench_explain.py
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jls
from jls.precision._explain import _EXACT, _QUICK, _scale_of, _step
from jls.precision._interpret import trace
from jls.precision._observe import observe

ROOT = pathlib.Path(__file__).parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]
import planted_faults  # noqa: E402  # pyright: ignore[reportMissingImports]
import why_skip  # noqa: E402  # pyright: ignore[reportMissingImports]


def _clock(fn) -> tuple[float, object]:
    start = time.process_time()
    out = jax.block_until_ready(fn())
    return time.process_time() - start, out


def found() -> None:
    hits = 0
    for name, make in planted_faults.PLANTS.items():
        plant = make()
        report = jls.precision.explain_step(plant.loss, plant.scale, *plant.args)
        wrong = planted_faults.found(plant, report)
        hits += not wrong
        print(f"  {name:<22} {'found' if not wrong else 'MISSED: ' + '; '.join(wrong)}")
    print(f"found {hits} of {len(planted_faults.PLANTS)} planted overflows")


def _fresh_step():
    """A new jitted step (``jax.grad`` of the scaled loss): traced and compiled anew."""
    return jax.jit(
        lambda p, s, b: jax.grad(lambda p: jls.scale_loss(why_skip.loss_fn(p, b), s))(p)
    )


def cost(width: int, depth: int, batch: int, rounds: int, calls: int) -> None:
    params = why_skip.init(jax.random.key(0), width, depth)
    x = (jax.random.normal(jax.random.key(1), (batch, width)) * 1e-3).astype(
        jnp.float16
    )
    data = (x, jnp.ones((batch, 1), jnp.float32))
    state = jls.dynamic_scale().init()
    step = _fresh_step()
    _clock(lambda: step(params, state, data))
    step_run = statistics.median(
        _clock(lambda: step(params, state, data))[0] for _ in range(rounds)
    )
    firsts, explains = [], []
    for _ in range(calls):  # interleaved: a fresh step's compile, then one call
        fresh = _fresh_step()
        firsts.append(_clock(lambda f=fresh: f(params, state, data))[0])
        explains.append(
            _clock(
                lambda: jls.precision.explain_step(
                    why_skip.loss_fn, state, params, data
                )
            )[0]
        )
    step_first, call = statistics.median(firsts), statistics.median(explains)
    ratios = sorted(e / f for e, f in zip(explains, firsts, strict=True))
    traced = trace(
        _step(why_skip.loss_fn, {0}, False), (_scale_of(state), params, data), {}
    )
    options = {**_EXACT, **_QUICK.get(jax.default_backend(), {})}
    run = jax.jit(lambda a: observe(traced.closed, a)[::2], compiler_options=options)
    run_first, _ = _clock(lambda: run(traced.arrays))
    run_again = statistics.median(
        _clock(lambda: run(traced.arrays))[0] for _ in range(rounds)
    )
    ops = len(observe(traced.closed, traced.arrays)[1])
    print(f"width {width}, depth {depth}, batch {batch}: {ops} ops observed")
    print(
        f"  explain_step, one call: {call * 1e3:.0f} ms; the step's compile and "
        f"first run: {step_first * 1e3:.0f} ms; {call / step_first:.2f}x "
        f"(medians of {calls}; per call {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
    )
    print(
        f"  of which its program's compile and first run: {run_first * 1e3:.0f} ms; "
        f"that program run again: {run_again * 1e3:.2f} ms against the step's "
        f"{step_run * 1e3:.2f} ms, {run_again / step_run:.2f}x"
    )


def _rnn(p, xs):
    """A float16 recurrent cell scanned over ``xs``' steps."""

    def cell(h, x):
        h = jnp.tanh(h @ p["w"] + x @ p["u"])
        return h, h[:, 0]

    h, ys = jax.lax.scan(cell, jnp.zeros((xs.shape[1], 32), jnp.float16), xs)
    return jnp.mean(h.astype(jnp.float32) ** 2) + jnp.mean(ys.astype(jnp.float32))


def _deep(ws, x):
    """An unrolled float16 MLP of many narrow layers: thousands of tiny ops."""
    for w in ws:
        x = jnp.tanh(x @ w) * 1.01
        x = x + jnp.sin(x) * 1e-3
    return jnp.mean(x.astype(jnp.float32))


def others(calls: int) -> None:
    """The same ratio on a long scan and on a program of thousands of tiny ops."""
    key = iter(jax.random.split(jax.random.key(2), 400))
    f16 = lambda shape, s=0.05: (jax.random.normal(next(key), shape) * s).astype(  # noqa: E731
        jnp.float16
    )
    sizes = [16 + i % 13 for i in range(301)]
    models = {
        "a 32-wide cell scanned over 10000 steps": (
            _rnn,
            {"w": f16((32, 32)), "u": f16((32, 32))},
            f16((10000, 8, 32), 1.0),
        ),
        "an unrolled MLP of 300 layers, 16-28 wide": (
            _deep,
            [f16((a, b), 0.3) for a, b in zip(sizes[:-1], sizes[1:], strict=True)],
            jnp.ones((4, 16), jnp.float16),
        ),
    }
    state = jls.dynamic_scale().init()
    for name, (loss, params, x) in models.items():
        _ratio(name, loss, params, x, state, calls)


def _ratio(name: str, loss, params, x, state, calls: int) -> None:
    """Prints one explain_step call against a fresh step's compile and first run."""
    firsts, explains = [], []
    for _ in range(calls):
        step = jax.jit(
            lambda p, s, b: jax.grad(lambda p: jls.scale_loss(loss(p, b), s))(p)
        )
        firsts.append(_clock(lambda: step(params, state, x))[0])  # noqa: B023
        explains.append(
            _clock(lambda: jls.precision.explain_step(loss, state, params, x))[0]
        )
    traced = trace(_step(loss, {0}, False), (_scale_of(state), params, x), {})
    ops = len(observe(traced.closed, traced.arrays)[1])
    step_first, call = statistics.median(firsts), statistics.median(explains)
    ratios = sorted(e / f for e, f in zip(explains, firsts, strict=True))
    print(f"{name}: {ops} ops observed")
    print(
        f"  explain_step, one call: {call * 1e3:.0f} ms; the step's compile and "
        f"first run: {step_first * 1e3:.0f} ms; {call / step_first:.2f}x "
        f"(medians of {calls}; per call {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=str(__doc__).splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=20, help="timed runs per median")
    parser.add_argument("--calls", type=int, default=7, help="explain_step calls")
    parser.add_argument("--no-plants", action="store_true", help="skip the found count")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    if not args.no_plants:
        found()
    for width, depth, batch in ((32, 4, 64), (256, 8, 256)):
        cost(width, depth, batch, args.rounds, args.calls)
    others(max(3, args.calls // 2))


if __name__ == "__main__":
    main()
