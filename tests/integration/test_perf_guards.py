"""Deterministic performance guards: compiled temporary bytes and HLO copies.

Timings live in ``benchmarks/``; these are the proxies that cannot be noisy.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jls
from jls._finite import SMALL_GROUP

LAYERS, WIDTH = 8, 256
PARAMS = {f"l{i}": jnp.full((WIDTH, WIDTH), 0.01) for i in range(LAYERS)}
X = jnp.ones((4, WIDTH))
GRAD_BYTES = LAYERS * WIDTH * WIDTH * 4


def _loss(params, x):
    h = x
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"l{i}"])
    return jnp.mean(h**2)


def _plain(inner, params, state, x):
    grads = jax.grad(_loss)(params, x)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _fused(tx, params, state, x):
    grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x), state))(params)
    return jls.apply_gradients(tx, grads, state, params)


def _via_update(tx, params, state, x):
    grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _compile(fn, state, donated=True):
    donate = (0, 1) if donated else ()
    # keep_unused: the entry's parameter i is the i-th flat input.
    jitted = jax.jit(fn, donate_argnums=donate, keep_unused=True)
    return jitted.lower(PARAMS, state, X).compile()


def _temp_bytes(compiled) -> int:
    stats = compiled.memory_analysis()
    assert stats is not None, "this backend reports no memory analysis"
    return stats.temp_size_in_bytes


def _hlo(compiled) -> str:
    text = compiled.as_text()
    assert text is not None
    return text


def _array_copies(compiled):
    """Copy ops whose result is an array (scalar copies are free)."""
    return [
        line
        for line in _hlo(compiled).splitlines()
        if re.search(r"= \w+\[[0-9,]+\]\S* copy\(", line)
    ]


INNERS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd": lambda: optax.sgd(1e-3, momentum=0.9),
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
}


def _entry(compiled) -> str:
    return _hlo(compiled).split("\nENTRY", 1)[1]


def _entry_array_copies(compiled):
    """`_array_copies` of the entry computation only."""
    return [
        line
        for line in _entry(compiled).splitlines()
        if re.search(r"= \w+\[[0-9,]+\]\S* copy\(", line)
    ]


def _copied_inputs(compiled) -> list[int]:
    """The input index each entry copy reads; a copy of anything else fails."""
    entry = _entry(compiled)
    inputs = dict(re.findall(r"%(\S+) = \S+ parameter\((\d+)\)", entry))
    found = []
    for line in _entry_array_copies(compiled):
        operand = re.search(r" copy\(%([^)\s]+)\)", line)
        assert operand is not None and operand.group(1) in inputs, line
        found.append(int(inputs[operand.group(1)]))
    return found


def _inputs(tree) -> list[int]:
    """Indices of the state ``tree``'s array leaves among the step's inputs."""
    leaves = jax.tree.leaves(tree)
    offset = len(jax.tree.leaves(PARAMS))
    return [offset + i for i, leaf in enumerate(leaves) if leaf.ndim > 0]


@pytest.mark.parametrize("path", ["fused", "update"])
@pytest.mark.parametrize("name", INNERS)
def test_without_donation_both_paths_cost_what_plain_costs(name, path):
    # The skip (a select per leaf, fused into the update's loops): without
    # donation a lax.cond made XLA copy every parameter and moment and hold
    # the gradients (134 MB of temporaries on the 27M LM against plain
    # Adam's 3 MB). No copy at all, and within a quarter of a gradient tree
    # of plain's temporaries (clip_by_global_norm's norm holds one leaf).
    inner = INNERS[name]()
    tx = jls.loss_scaling(inner)
    step = _fused if path == "fused" else _via_update
    plain = _compile(functools.partial(_plain, inner), inner.init(PARAMS), False)
    ours = _compile(functools.partial(step, tx), tx.init(PARAMS), False)
    plain_temp, temp = _temp_bytes(plain), _temp_bytes(ours)
    assert temp <= plain_temp + GRAD_BYTES // 4, (plain_temp, temp)
    assert _entry_array_copies(ours) == [], _entry_array_copies(ours)
    assert " conditional(" not in _hlo(ours)


@pytest.mark.parametrize("path", ["fused", "update"])
def test_without_donation_adam_holds_a_few_scalars_more_than_plain(path):
    inner = optax.adam(1e-3)
    tx = jls.loss_scaling(inner)
    step = _fused if path == "fused" else _via_update
    plain = _compile(functools.partial(_plain, inner), inner.init(PARAMS), False)
    ours = _compile(functools.partial(step, tx), tx.init(PARAMS), False)
    assert _temp_bytes(ours) <= _temp_bytes(plain) + 4096


@pytest.mark.parametrize("path", ["fused", "update"])
@pytest.mark.parametrize("name", INNERS)
def test_a_donated_step_copies_each_moment_at_most_once_and_no_parameter(name, path):
    # The caller's jit donates the parameters and the state. The skip
    # selects each new leaf against its old one; XLA:CPU writes a moment in
    # place and its select fusion still reads the old one, so it copies
    # each optimizer-state array first (16 copies for Adam here, 5.8 MB of
    # temporaries against plain Adam's 0.6 MB; XLA:GPU schedules the reads
    # first and copies none). What is copied is the optimizer's state, each
    # leaf at most once: never a parameter (plain Adam copies seven here),
    # a gradient or an update. The temporaries are plain's, those copies
    # and one gradient tree (the decision needs every gradient before any
    # moment is overwritten), and a few scalars.
    inner = INNERS[name]()
    tx = jls.loss_scaling(inner)
    step = _fused if path == "fused" else _via_update
    state = tx.init(PARAMS)
    plain = _compile(functools.partial(_plain, inner), inner.init(PARAMS))
    ours = _compile(functools.partial(step, tx), state)
    copied = _copied_inputs(ours)
    moments = _inputs(state)
    assert len(copied) == len(set(copied)), copied
    assert set(copied) <= set(moments), (copied, moments)
    copy_bytes = len(copied) * WIDTH * WIDTH * 4
    bound = _temp_bytes(plain) + copy_bytes + GRAD_BYTES + 4096
    assert _temp_bytes(ours) <= bound, (_temp_bytes(plain), _temp_bytes(ours))


@pytest.mark.parametrize("donates", [False, True], ids=["undonated", "donated"])
@pytest.mark.parametrize("path", ["fused", "update"])
def test_declaring_donation_or_not_compiles_the_same_program(path, donates):
    # donated= is deprecated and ignored: the step is one program whatever
    # it says, so a caller's jit that donates without declaring it pays
    # what a declared one pays.
    step = _fused if path == "fused" else _via_update

    def program(**declared):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            tx = jls.loss_scaling(optax.adam(1e-3), **declared)
        compiled = _compile(functools.partial(step, tx), tx.init(PARAMS), donates)
        text = _entry(compiled)
        return re.sub(r"metadata=\{[^}]*\}", "", text), _temp_bytes(compiled)

    assert program(donated=True) == program(donated=False) == program()


@pytest.mark.parametrize("donated", [False, True], ids=["undonated", "donated"])
def test_the_update_path_costs_what_the_fused_path_costs(donated):
    # tx.update returns an updates tree that apply_updates then reads; XLA
    # fuses the two, so it holds no more than apply_gradients, and copies
    # the same leaves.
    tx = jls.loss_scaling(optax.adam(1e-3))
    fused = _compile(functools.partial(_fused, tx), tx.init(PARAMS), donated)
    update = _compile(functools.partial(_via_update, tx), tx.init(PARAMS), donated)
    assert sorted(_copied_inputs(update)) == sorted(_copied_inputs(fused))
    assert _temp_bytes(update) <= _temp_bytes(fused) + 4096


def test_the_check_reads_each_gradient_once():
    grads = [jnp.ones((WIDTH, WIDTH)) for _ in range(LAYERS)]
    hlo = _hlo(jax.jit(jls.all_finite).lower(grads).compile())
    # One reduction per leaf, no second pass in a conditional, and no bool
    # array is materialised.
    assert "conditional(" not in hlo
    assert not re.search(r"pred\[\d", hlo.split("ENTRY")[1].split("\n}\n")[0])


def test_small_leaves_share_one_magnitude():
    # Forty small gradients, each the output of a reduction (as a bias's
    # gradient is), which nothing fuses into: concatenated before the
    # magnitude is taken, they cost one abs kernel, not forty.
    x = jnp.ones((40, 64, 32))

    def check(x):
        return jls.all_finite([x[i].sum(0) for i in range(40)])

    hlo = _hlo(jax.jit(check).lower(x).compile())
    assert len(re.findall(r" abs\(", hlo)) == 1


def _equations(fn, state) -> int:
    """Equations in ``fn``'s jaxpr, counting every nested jaxpr's too."""

    def nested(value):
        # jax.extend.core.subjaxprs does this on newer jax; jls supports 0.8.0.
        if isinstance(value, tuple | list):
            for item in value:
                yield from nested(item)
        elif hasattr(value, "eqns"):
            yield value
        elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
            yield value.jaxpr

    def count(jaxpr) -> int:
        subs = [
            sub for eqn in jaxpr.eqns for v in eqn.params.values() for sub in nested(v)
        ]
        return len(jaxpr.eqns) + sum(count(sub) for sub in subs)

    return count(jax.make_jaxpr(fn)(PARAMS, state, X).jaxpr)


def test_trace_size_is_plain_plus_a_few_equations_per_leaf():
    # The compile-time proxy (benchmarks/bench_compile.py has the timings):
    # the fused step is the plain step plus, per gradient leaf, the check (abs,
    # shrink, sum, isfinite, and) and the unscaling (two multiplies), plus a
    # fixed amount of scalar work (the decision, the scale rule). A second
    # pass over the leaves (the exact fallback jls had before 0.2 added five
    # equations per leaf) or per-leaf diagnostics would break the bound.
    inner = optax.adam(1e-3)
    tx = jls.loss_scaling(inner)
    plain = _equations(functools.partial(_plain, inner), inner.init(PARAMS))
    fused = _equations(functools.partial(_fused, tx), tx.init(PARAMS))
    update = _equations(functools.partial(_via_update, tx), tx.init(PARAMS))
    per_leaf, fixed = 9, 120
    assert fused <= plain + per_leaf * LAYERS + fixed, (plain, fused)
    assert update <= plain + (per_leaf + 2) * LAYERS + fixed, (plain, update)


class _Counting:
    """An optax transformation that counts how often its update is traced."""

    def __init__(self, inner):
        self.inner, self.traces = inner, 0

    def init(self, params):
        return self.inner.init(params)

    def update(self, updates, state, params=None):
        self.traces += 1
        return self.inner.update(updates, state, params)


@pytest.mark.parametrize("path", ["fused", "update", "train_step"])
def test_the_inner_optimizer_is_traced_once_per_step(path):
    counting = _Counting(optax.adam(1e-3))
    tx = jls.loss_scaling(counting)
    state = tx.init(PARAMS)
    if path == "fused":
        jax.jit(functools.partial(_fused, tx)).lower(PARAMS, state, X)
    elif path == "update":
        jax.jit(functools.partial(_via_update, tx)).lower(PARAMS, state, X)
    else:
        jax.jit(jls.train_step(_loss, tx)).lower(PARAMS, state, X)
    assert counting.traces == 1


@pytest.mark.parametrize("donated", [False, True])
def test_one_reduction_per_leaf_and_no_conditional_whether_donated_or_not(donated):
    # Donating picks no lax.cond for the skip.
    inner = optax.adam(1e-3)
    tx = jls.loss_scaling(inner)
    plain = _hlo(
        _compile(functools.partial(_plain, inner), inner.init(PARAMS), donated)
    )
    fused = _hlo(_compile(functools.partial(_fused, tx), tx.init(PARAMS), donated))

    def count(pattern, text):
        return len(re.findall(pattern, text))

    assert count(r" conditional\(", fused) == 0
    assert count(r" reduce\(", fused) <= count(r" reduce\(", plain) + LAYERS


def _whole_gradient_reductions(text: str) -> int:
    """Reductions over both axes of a (WIDTH, WIDTH) array: a whole gradient."""
    return len(re.findall(r" reduce\(.*dimensions=\{0,1\}", text))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"scaler": jls.measured_scale()},
        {"gradient_norm": True},
        {"skip_spikes": jls.hooks.SpikeRule()},
    ],
    ids=["dynamic", "measured", "gradient_norm", "skip_spikes"],
)
@pytest.mark.parametrize("donated", [False, True])
def test_measuring_adds_no_pass_over_the_gradients(options, donated):
    # The measured scaler, the norm and the spike rule read their numbers off
    # the check's own reductions: one per gradient, as the plain check. The
    # squares' second, shrunk pass sits in a conditional of its own that runs
    # only when a plain sum of squares overflowed.
    inner = optax.adam(1e-3)
    tx = jls.loss_scaling(inner, **options)
    plain = _hlo(
        _compile(functools.partial(_plain, inner), inner.init(PARAMS), donated)
    )
    fused = _hlo(_compile(functools.partial(_fused, tx), tx.init(PARAMS), donated))
    conds = [c for c in re.findall(r"^.* conditional\(.*$", fused, re.M)]
    fallback = [c for c in conds if "leaves_squares" in c]
    assert len(conds) == len(fallback)
    assert len(fallback) == (0 if not options else 1)
    in_fallback = 0
    for line in fallback:
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        assert branches is not None
        for name in re.findall(r"%([\w.-]+)", branches.group(1)):
            in_fallback += _whole_gradient_reductions(_reachable(fused, name))
    assert in_fallback == (0 if not options else LAYERS)
    assert _whole_gradient_reductions(fused) - in_fallback == (
        _whole_gradient_reductions(plain) + LAYERS
    )


def _reachable(text: str, root: str) -> str:
    """The HLO of computation ``root`` and every computation it calls."""
    computations = {}
    for block in re.split(r"\n(?=\S)", text):
        head = re.match(r"(?:ENTRY )?%([\w.-]+)", block)
        if head:
            computations[head.group(1)] = block
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        body = computations[name].split("\n", 1)[-1]
        todo.extend(re.findall(r"(?:calls|to_apply|body|condition)=%([\w.-]+)", body))
        for group in re.findall(r"branch_computations=\{([^}]*)\}", body):
            todo.extend(re.findall(r"%([\w.-]+)", group))
    return "\n".join(computations[name] for name in sorted(seen))


def test_many_small_leaves_hold_no_copy_of_the_gradients():
    # Small leaves share a reduction over their concatenation, a temporary
    # copy: capped (jls._finite.SMALL_GROUP), or a model of hundreds of small
    # matrices held a copy of every gradient (33 MB for 8M parameters in 1,000
    # leaves, where plain Adam holds none).
    params = {f"w{i}": jnp.full((64, 64), 0.01) for i in range(300)}
    x = jnp.ones((8, 64))

    def loss(params, x):
        return sum(jnp.sum(jnp.tanh(x @ w)) for w in params.values())

    inner = optax.adam(1e-3)
    tx = jls.loss_scaling(inner)

    def plain(params, state, x):
        updates, state = inner.update(jax.grad(loss)(params, x), state, params)
        return optax.apply_updates(params, updates), state

    def fused(params, state, x):
        grads = jax.grad(lambda p: jls.scale_loss(loss(p, x), state))(params)
        return jls.apply_gradients(tx, grads, state, params)

    def temp(fn, state):
        return _temp_bytes(jax.jit(fn).lower(params, state, x).compile())

    gradient_bytes = 300 * 64 * 64 * 4
    cap = SMALL_GROUP * 4
    assert cap < gradient_bytes / 4
    # One capped concatenation (0.54 MB here on jax 0.8.0 and 0.10.2), never
    # every gradient (4.9 MB).
    held = temp(fused, tx.init(params)) - temp(plain, inner.init(params))
    assert held <= cap + 2**16


# -- On a mesh -----------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_collectives():
    import json
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "scripts" / "mesh_hlo.py"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _scalars(all_reduces):
    """The all-reduces of scalars only (one, or a tuple XLA combined)."""

    def scalars_only(shape):
        parts = re.sub(r"/\*.*?\*/", "", shape).strip("()").split(", ")
        return all(re.fullmatch(r"\w+\[\](\{\})?", p.strip()) for p in parts)

    return [s for s in all_reduces if scalars_only(s)]


@pytest.mark.parametrize("rule", ["dynamic", "measured"])
def test_the_mesh_step_decides_with_scalar_all_reduces_and_gathers_nothing(
    mesh_collectives, rule
):
    # The compiled 8-device data x model step of examples/mesh_lm.py: jls's
    # decision is one all-reduce of scalars (the measured rule's range one
    # more), plain optax makes none, and no gradient is gathered (small
    # leaves that may be sharded are not concatenated).
    plain = mesh_collectives["plain"]
    jls_step = mesh_collectives[rule]
    extra = 1 if rule == "dynamic" else 2
    assert _scalars(plain["all_reduce"]) == []
    assert len(_scalars(jls_step["all_reduce"])) == extra
    assert len(jls_step["all_reduce"]) == len(plain["all_reduce"]) + extra
    assert jls_step["all_gather"] == plain["all_gather"]
