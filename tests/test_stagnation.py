"""`jls.hooks.Stagnation`: the fraction of updates rounded away, and its warning."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportCallIssue=false

import functools
import logging
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from blocks_model import read_phases

import jls


def _step(tx, fused):
    def step(g, s, p):
        if fused:
            return jls.apply_gradients(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return step


def _reference(p, u, dtype):
    """numpy: of the entries with a nonzero update, the fraction left as they were."""
    p = np.asarray(p).astype(dtype)
    new = (p.astype(np.float32) + u).astype(dtype)
    moving = u != 0
    return np.sum(moving & (new == p)) / max(np.sum(moving), 1)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_the_fraction_is_the_share_of_updates_rounded_away(dtype, fused):
    # |p| in [1.1, 1.9] * 2**e, updates up to 2**-6 of it, either sign, some
    # zero: no parameter lands on a power of two, where the rule reads the
    # new value only (see the next test).
    rng = np.random.default_rng(0)
    n = 4096
    sign = rng.choice([-1, 1], n)
    p = rng.uniform(1.1, 1.9, n) * 2.0 ** rng.integers(-6, 6, n) * sign
    u = p * rng.uniform(-1, 1, n) * 2.0 ** -rng.integers(6, 30, n)
    u[rng.random(n) < 0.1] = 0.0
    u = u.astype(np.float32)
    params = {"a": jnp.asarray(p[:3000], dtype), "b": jnp.asarray(p[3000:], dtype)}
    grads = {"a": jnp.asarray(u[:3000]), "b": jnp.asarray(u[3000:])}
    tx = jls.loss_scaling(  # sgd(-1): the update is the gradient
        optax.sgd(-1.0), jls.no_scale(), hooks=[jls.hooks.Stagnation(every=1)]
    )
    _, state = jax.jit(_step(tx, fused))(grads, tx.init(params), params)
    got = float(jls.metrics(state)["stagnant_fraction"])
    want = _reference(np.concatenate([params["a"], params["b"]]), u, dtype)
    assert 0.05 < want < 0.95  # both kinds of entry are there
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_parameter_moved_onto_a_power_of_two_counts_as_stuck():
    # The documented limit of reading the new value only: 1 - 2**-8 moved up
    # by 1.5 * 2**-9 lands on 1.0 (the update is more than half the spacing
    # below 1), and 1.0 + 1.5 * 2**-9 rounds back to 1.0 (less than half the
    # spacing above): counted as stuck. Off a power of two it is exact.
    p = jnp.asarray([1 - 2**-8, 1.25], jnp.bfloat16)
    u = jnp.asarray([1.5 * 2**-9, 1.5 * 2**-8], jnp.float32)
    tx = jls.loss_scaling(
        optax.sgd(-1.0), jls.no_scale(), hooks=[jls.hooks.Stagnation(1)]
    )
    new, state = jls.apply_gradients(tx, u, tx.init(p), p)
    assert new.tolist() == [1.0, 1.2578125]  # both moved
    assert float(jls.metrics(state)["stagnant_fraction"]) == 0.5


def _cycle_reference(params, grads_seq, applied, every, dtype):
    """numpy: each cycle's fraction, each entry read at its `read_phases`.

    SGD(-1): the update is the gradient. A skipped step reads nothing and
    does not advance the cycle; the fraction is held between cycles.
    """
    p = [np.asarray(x, np.float32) for x in params]
    stuck = moving = 0
    phase, fraction, seen = 0, 0.0, []
    for grads, ok in zip(grads_seq, applied, strict=True):
        if ok:
            for k, (x, g) in enumerate(zip(p, grads, strict=True)):
                new = (x + g).astype(dtype).astype(np.float32)
                again = (new + g).astype(dtype).astype(np.float32)
                read = read_phases(x.shape, every) == phase
                move = read & (g != 0)
                stuck += np.sum(move & (again == new))
                moving += np.sum(move)
                p[k] = new
            phase += 1
            if phase == every:
                fraction = stuck / max(moving, 1)
                stuck = moving = phase = 0
        seen.append(fraction)
    return seen


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("every", [1, 3, 16])
def test_each_cycle_reads_every_entry_once(every, fused):
    # Leaves no axis of which the cycle divides, a scalar, leaves cut in
    # blocks along their last axis, at 16 one in blocks widened to 16
    # entries and one cut in rows along its first axis, not its last
    # (`cut_axis`); nan steps skipped mid-cycle.
    dtype = jnp.bfloat16
    shapes = [(5,), (3, 200), (1024,), (7, 300), (), (4, 2, 768), (8, 4096)]
    shapes.append((32, 4, 512))
    rng = np.random.default_rng(every)
    params = [jnp.asarray(rng.uniform(0.5, 2.0, s), dtype) for s in shapes]
    tx = jls.loss_scaling(
        optax.sgd(-1.0), jls.no_scale(), hooks=[jls.hooks.Stagnation(every=every)]
    )
    step = jax.jit(_step(tx, fused))
    state, p = tx.init(params), params
    grads_seq, applied, seen = [], [], []
    for t in range(2 * every + 5):
        scale = 2.0 ** -rng.integers(2, 12, size=None)
        grads = [
            (rng.normal(size=s) * scale * (rng.random(s) > 0.2)).astype(np.float32)
            for s in shapes
        ]
        ok = t % 4 != 2
        given = [jnp.asarray(g) for g in grads]
        if not ok:
            given[1] = given[1].at[0, 0].set(jnp.nan)
        p, state = step(given, state, p)
        grads_seq.append(grads)
        applied.append(ok)
        seen.append(float(jls.metrics(state)["stagnant_fraction"]))
    want = _cycle_reference(params, grads_seq, applied, every, dtype)
    assert any(0 < w < 1 for w in want)  # both kinds of entry are there
    np.testing.assert_allclose(seen, want, rtol=1e-6)


def _inner_optimizers():
    clipped = optax.chain(optax.clip_by_global_norm(1e-3), optax.adam(1e-2))
    return {
        "adam": optax.adam(1e-2),
        "adamw": optax.adamw(1e-2, weight_decay=0.1),
        "lion": optax.lion(1e-3),
        "rmsprop": optax.rmsprop(1e-3, momentum=0.9, nesterov=True),
        "sgd_momentum": optax.sgd(1e-2, momentum=0.9),
        "adafactor": optax.adafactor(1e-2),  # factored moments: row/column means
        "clipped_adam": clipped,  # a global norm: a reduction on the way
        "muon": optax.contrib.muon(1e-2),  # matrix products on the way
        "lamb": optax.lamb(1e-2),  # per-leaf norms
        "compensated": jls.precision.compensated(optax.adam(1e-2)),
    }


@pytest.mark.parametrize("name", sorted(_inner_optimizers()))
def test_the_sampled_read_counts_the_updates_the_step_applies(name):
    # At every > 1 the hook reads this phase's slice of each update the
    # step applies and of its new parameter. Whatever the
    # optimizer computes on the way (moments, norms, factored means, matrix
    # products), the fractions are those of the updates the step applies,
    # counted in numpy at `read_phases`, and the parameters are unchanged.
    inner = _inner_optimizers()[name]
    dtype, every = jnp.bfloat16, 4
    shapes = {"w": (256, 64), "v": (7, 300), "b": (256,), "s": ()}
    rng = np.random.default_rng(3)
    params = {
        k: jnp.asarray(rng.uniform(0.01, 2.0, s) * rng.choice([-1, 1], s), dtype)
        for k, s in shapes.items()
    }
    grads_seq = [
        {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
        for _ in range(2 * every)
    ]
    read = jls.loss_scaling(inner, jls.no_scale(), hooks=[jls.hooks.Stagnation(every)])
    plain = jls.loss_scaling(inner, jls.no_scale())
    step = jax.jit(lambda g, s, p: jls.apply_gradients(read, g, s, p))
    updates_of = jax.jit(plain.update)
    p, s, q, t = params, read.init(params), params, plain.init(params)
    stuck = moving = 0
    seen, want = [], []
    for phase, g in enumerate(grads_seq):
        p, s = step(g, s, p)
        u, t = updates_of(g, t, q)
        q = optax.apply_updates(q, u)
        for k in shapes:
            new, up = np.asarray(q[k], np.float32), np.asarray(u[k], np.float32)
            again = (new + up).astype(dtype).astype(np.float32)
            mine = (read_phases(shapes[k], every) == phase % every) & (up != 0)
            stuck += int(np.sum(mine & (again == new)))
            moving += int(np.sum(mine))
        if phase % every == every - 1:
            want.append(stuck / max(moving, 1))
            stuck = moving = 0
            seen.append(float(jls.metrics(s)["stagnant_fraction"]))
    chex.assert_trees_all_equal(p, q)
    assert any(0 < f < 1 for f in want), want  # both kinds of entry are there
    assert seen == pytest.approx(want, rel=1e-6, abs=0)


def test_a_batch_of_runs_under_vmap_reads_as_each_run_alone():
    # vmap over an ensemble: each member's slices are read as each alone.
    tx = jls.loss_scaling(
        optax.adam(1e-3), jls.no_scale(), hooks=[jls.hooks.Stagnation(4)]
    )
    rng = np.random.default_rng(0)
    shapes = {"w": (3, 256, 64), "b": (3, 7, 30)}
    batch = {
        k: jnp.asarray(rng.uniform(0.01, 2, s), jnp.bfloat16) for k, s in shapes.items()
    }
    grads = [
        {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
        for _ in range(4)
    ]
    step = jax.jit(jax.vmap(lambda g, s, p: jls.apply_gradients(tx, g, s, p)))
    p, s = batch, jax.vmap(tx.init)(batch)
    for g in grads:
        p, s = step(g, s, p)
    alone = []
    for i in range(3):
        q = jax.tree.map(lambda x, i=i: x[i], batch)
        t = tx.init(q)
        for g in grads:
            q, t = jls.apply_gradients(tx, jax.tree.map(lambda x, i=i: x[i], g), t, q)
        alone.append(float(jls.metrics(t)["stagnant_fraction"]))
    assert all(0 < f < 1 for f in alone), alone
    assert np.asarray(jls.metrics(s)["stagnant_fraction"]).tolist() == alone


def test_no_fraction_before_the_first_cycle_and_held_between():
    params = jnp.ones(8, jnp.bfloat16)
    tx = jls.loss_scaling(
        optax.sgd(-1.0), jls.no_scale(), hooks=[jls.hooks.Stagnation(every=3)]
    )
    step = jax.jit(_step(tx, fused=True))
    lost, moves, bad = jnp.full(8, 1e-4), jnp.full(8, 0.1), jnp.full(8, jnp.nan)
    state = tx.init(params)
    seen = []
    for g in (lost, lost, lost, moves, bad, moves, moves, lost):
        params, state = step(g, state, params)
        seen.append(float(jls.metrics(state)["stagnant_fraction"]))
    # 8 entries: one block, read at phase 0 of each cycle (steps 0 and 3).
    # Cycle 1 ends at step 2 (1e-4 is lost on 1.0); the nan step 4 does not
    # count, so cycle 2 (steps 3, 5, 6) ends at step 6: 0.1 moves them.
    assert seen == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("every", [1, 2])
def test_reading_changes_nothing_in_the_step(fused, every):
    params = {"w": jnp.full((16, 8), 0.5, jnp.bfloat16), "b": jnp.ones(8)}
    out = []
    for hooks in ((), (jls.hooks.Stagnation(every=every),)):
        tx = jls.loss_scaling(optax.adam(1e-3), jls.dynamic_scale(2.0**4), hooks=hooks)
        step = jax.jit(_step(tx, fused))
        p, s = params, tx.init(params)
        rng = np.random.default_rng(1)
        for i in range(5):
            g = jax.tree.map(
                lambda x, r=rng: jnp.asarray(r.normal(size=x.shape) * 16, x.dtype), p
            )
            if i == 2:  # one skipped step
                g = {"w": g["w"].at[0, 0].set(jnp.inf), "b": g["b"]}
            p, s = step(g, s, p)
        out.append((p, s.inner_state, s.loss_scale))
    chex.assert_trees_all_equal(out[0], out[1])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("every", [2, 16])
@pytest.mark.parametrize("name", ["plateau", "adafactor"])
def test_reading_changes_no_bit_of_a_one_leaf_step(name, every, fused):
    # One leaf: Adam's bias corrections have one consumer and XLA:CPU fuses
    # them into the update's loop. Reading them for the slice as well made
    # XLA compute them apart, and 118 of 256 updates moved in their last
    # place (reduce_on_plateau after Adam, float32); a leaf read whole
    # (Adafactor's (1, 40)) moved one. The slice's scalars are made again
    # behind a barrier, and a leaf read whole is read from its update.
    inner = {
        "plateau": optax.chain(
            optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1)
        ),
        "adafactor": optax.adafactor(1e-2),
    }[name]
    rng = np.random.default_rng(4)
    shapes = {"w": (64, 4)} if name == "plateau" else {"b": (64,), "r": (1, 40)}
    extra = {"value": jnp.float32(1.0)} if name == "plateau" else {}
    for dtype in (jnp.float32, jnp.bfloat16):
        params = {
            k: jnp.asarray(rng.uniform(0.01, 2, s), dtype) for k, s in shapes.items()
        }
        grads = {
            k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()
        }
        out = []
        for hooks in ((jls.hooks.Stagnation(every),), ()):
            tx = jls.loss_scaling(inner, jls.no_scale(), hooks=hooks)
            if fused:
                step = jax.jit(
                    lambda g, s, p, tx=tx: jls.apply_gradients(tx, g, s, p, **extra)
                )
            else:
                step = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p, **extra))
            result, state = step(grads, tx.init(params), params)
            out.append((result, state.inner_state))
        chex.assert_trees_all_equal(out[0], out[1])


def test_rounding_remedies_report_no_stagnation():
    params = jnp.ones(256, jnp.bfloat16)
    fractions = {}
    for name, inner in [
        ("plain", optax.sgd(1e-4)),
        ("kahan", jls.precision.compensated(optax.sgd(1e-4))),
        ("stochastic", jls.precision.stochastic_rounding(optax.sgd(1e-4))),
    ]:
        tx = jls.loss_scaling(
            inner, jls.no_scale(), hooks=[jls.hooks.Stagnation(every=1)]
        )
        p, s = params, tx.init(params)
        for _ in range(3):
            p, s = jls.apply_gradients(tx, jnp.ones(256), s, p)
        fractions[name] = float(jls.metrics(s)["stagnant_fraction"])
    # Plain bfloat16 loses every 1e-4 step at 1.0; the remedies' updates are
    # new - p, zero where the parameter stays: nothing they apply is lost.
    assert fractions == {"plain": 1.0, "kahan": 0.0, "stochastic": 0.0}


def test_a_state_from_a_longer_cycle_reports_again():
    # A Stagnation(8) state half-way through its cycle, resumed under
    # Stagnation(4): its phase is past the new cycle's end. It completes the
    # cycle at once and reads on (it used to wait for a phase it had passed,
    # and never report again).
    params = jnp.ones(8, jnp.bfloat16)
    lost = jnp.full(8, 1e-4)
    long = jls.loss_scaling(
        optax.sgd(-1.0), jls.no_scale(), hooks=[jls.hooks.Stagnation(8)]
    )
    short = jls.loss_scaling(
        optax.sgd(-1.0), jls.no_scale(), hooks=[jls.hooks.Stagnation(4)]
    )
    state = long.init(params)
    for _ in range(5):
        params, state = jls.apply_gradients(long, lost, state, params)
    step = jax.jit(_step(short, fused=True))
    seen = []
    for _ in range(5):
        params, state = step(lost, state, params)
        seen.append(float(jls.metrics(state)["stagnant_fraction"]))
        assert int(state.hooks["stagnation"].phase) < 4
    assert seen == [1.0] * 5


def test_any_cycle_runs_whether_the_caller_donates_or_not():
    for every in (1, 16):  # no donated= to declare
        tx = jls.loss_scaling(optax.sgd(0.1), hooks=[jls.hooks.Stagnation(every)])
        params = jnp.ones(300)
        for donate in ((), (1, 2)):
            step = jax.jit(_step(tx, fused=True), donate_argnums=donate)
            p, s = step(jnp.ones(300), tx.init(params), jnp.ones(300))
            assert jls.all_finite(p)
    for bad in (0, 2.5, True):
        with pytest.raises((ValueError, TypeError), match="every"):
            jls.hooks.Stagnation(every=bad)


def test_the_hook_needs_the_parameters():
    tx = jls.loss_scaling(optax.sgd(0.1), hooks=[jls.hooks.Stagnation(every=1)])
    params = jnp.ones(2)
    with pytest.raises(TypeError, match="need the parameters"):
        tx.update(params, tx.init(params))


def _program(hooks, donated):
    params = {"w": jnp.ones((128, 256)), "b": jnp.ones(256)}  # cut: 256 entries
    tx = jls.loss_scaling(optax.adam(1e-3), hooks=hooks)

    def step(p, s, x):
        g = jax.grad(lambda p: jls.scale_loss(jnp.sum(jnp.tanh(x @ p["w"])), s))(p)
        return jls.apply_gradients(tx, g, s, p)

    jitted = jax.jit(step, donate_argnums=(0, 1) if donated else ())
    return jitted.lower(params, tx.init(params), jnp.ones((4, 128))).compile()


def _kernels(compiled) -> int:
    """The entry computation's instructions that run generated code.

    Copies, scalar ones included, are not counted: they compile to no code.
    """
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    kinds = r"^\s*(?:ROOT )?%\S+ = .* (?:fusion|reduce|dynamic-slice)\("
    return len(re.findall(kinds, entry, flags=re.MULTILINE))


@pytest.mark.parametrize("donated", [False, True], ids=["undonated", "donated"])
def test_reading_adds_two_kernels_a_leaf_at_the_default_cycle(donated):
    # Per leaf: one reduction counting both, which computes the slice of
    # the update it reads (XLA:CPU makes the update again inside it), and
    # the leaf's row; and one for each of the hook's scalars. A kernel is
    # compile time on XLA:CPU and a launch on a GPU, each step.
    plain = _kernels(_program((), donated))
    for every, per_leaf, fixed in ((16, 2, 6), (1, 3, 4)):
        read = _kernels(_program((jls.hooks.Stagnation(every),), donated))
        assert read <= plain + per_leaf * 2 + fixed, (every, plain, read)


def _compiled(hooks, donated):
    compiled = _program(hooks, donated)
    copies = len(re.findall(r"= f32\[128,256\]\S* copy\(", compiled.as_text()))
    stats = compiled.memory_analysis()
    assert stats is not None, "this backend reports no memory analysis"
    return copies, stats.temp_size_in_bytes


@pytest.mark.parametrize("donated", [False, True], ids=["undonated", "donated"])
def test_reading_holds_no_update_and_copies_at_most_the_old_parameter(donated):
    # The read is inline, beside the update: undonated nothing is copied (a
    # conditional over the step's inputs made XLA copy every parameter and
    # moment when the caller donates). Donated, XLA:CPU copies Adam's two
    # moments of w without the hook (the skip's select reads each old moment
    # after the in-place update), and w once more: XLA:CPU makes the update
    # and the new parameter again inside the read's reduction, from the old
    # parameter, rather than hold them. The step holds nothing more than
    # the step without the hook, at either cycle.
    copies, temp = _compiled((), donated)
    assert copies <= (2 if donated else 0)
    for every in (16, 1):
        got_copies, got_temp = _compiled((jls.hooks.Stagnation(every),), donated)
        assert got_copies <= copies + (1 if donated else 0), (every, got_copies)
        assert got_temp <= temp + 8192, (every, temp, got_temp)


@pytest.mark.parametrize(
    "name",
    [
        "lion",
        "sgd_momentum",
        "rmsprop",
        "adamw_clipped",
        "plateau",
    ],
)
def test_no_update_is_held_for_an_elementwise_optimizer(name):
    # Where XLA makes the update again inside the read's reduction, the
    # step holds nothing the step without the hook does not. Behind
    # clip_by_global_norm (whose norm needs every update before any is
    # scaled) XLA:CPU holds w's update for the read instead: that one, no
    # more.
    inner = {
        "lion": optax.lion(1e-4),
        "sgd_momentum": optax.sgd(1e-3, momentum=0.9),
        "rmsprop": optax.rmsprop(1e-3),
        "adamw_clipped": optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)
        ),
        "plateau": optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau()),
    }[name]
    extra = {"value": jnp.float32(1.0)} if name == "plateau" else {}
    params = {"w": jnp.ones((512, 256)), "b": jnp.ones(256)}
    temps = []
    for hooks in ((), (jls.hooks.Stagnation(),)):
        tx = jls.loss_scaling(inner, jls.dynamic_scale(), hooks=hooks)
        step = jax.jit(lambda g, s, p, tx=tx: jls.apply_gradients(tx, g, s, p, **extra))
        stats = step.lower(params, tx.init(params), params).compile().memory_analysis()
        assert stats is not None, "this backend reports no memory analysis"
        temps.append(stats.temp_size_in_bytes)
    held = 512 * 256 * 4 if name == "adamw_clipped" else 0  # w's update
    assert temps[1] <= temps[0] + held + 8192, temps


def test_one_trace_for_any_number_of_steps():
    traces = []
    params = jnp.ones(16, jnp.bfloat16)
    tx = jls.loss_scaling(
        optax.adam(1e-3), jls.no_scale(), hooks=[jls.hooks.Stagnation(4)]
    )

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(g, s, p):
        traces.append(1)
        return jls.apply_gradients(tx, g, s, p)

    s = tx.init(params)
    for _ in range(6):
        params, s = step(jnp.ones(16, jnp.bfloat16), s, params)
    assert len(traces) == 1


def _stalled_state(threshold_lr=1e-4):
    tx = jls.loss_scaling(
        optax.sgd(threshold_lr), jls.no_scale(), hooks=[jls.hooks.Stagnation(every=1)]
    )
    params = jnp.asarray([1.0, 1.0, 1.0, 0.001], jnp.bfloat16)
    state = tx.init(params)
    return jls.apply_gradients(tx, jnp.ones(4), state, params)[1]


def test_warn_if_stagnant_warns_at_the_threshold_and_names_the_remedies():
    state = _stalled_state()  # 3 of 4 entries stuck
    with pytest.warns(jls.hooks.StagnationWarning, match="75.0%.*stochastic_rounding"):
        assert jls.hooks.warn_if_stagnant(state, threshold=0.75) == 0.75
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jls.hooks.warn_if_stagnant(state) == 0.75  # below the default 0.9
        assert jls.hooks.warn_if_stagnant(state, threshold=0.8) == 0.75


def test_warn_if_stagnant_refuses_what_it_cannot_read():
    state = _stalled_state()
    for bad in (0.0, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="threshold must be a float in"):
            jls.hooks.warn_if_stagnant(state, threshold=bad)
    plain = jls.loss_scaling(optax.sgd(0.1)).init(jnp.ones(2))
    with pytest.raises(ValueError, match=r"hooks=\[jls.hooks.Stagnation\(\)\]"):
        jls.hooks.warn_if_stagnant(plain)
    with pytest.raises(TypeError, match="on the host after the step"):
        jax.jit(jls.hooks.warn_if_stagnant)(state)


def test_eager_steps_compile_nothing_after_the_first():
    # lax.reduce caches its computation by the function it is given: a new
    # lambda per call compiled the counting reduction on every eager step
    # (200 compiles in 100 steps, memory growing), here and in ScaleStats.
    compiles = []

    class Count(logging.Handler):
        def emit(self, record):
            if "Compiling" in record.getMessage():
                compiles.append(record)

    tx = jls.loss_scaling(
        optax.adam(1e-3),
        jls.dynamic_scale(),
        hooks=[jls.hooks.Stagnation(1)],
        scale_stats=True,
    )
    params = {"w": jnp.ones(4)}
    state, grads = tx.init(params), {"w": jnp.full(4, 0.5)}
    _, state = tx.update(grads, state, params)  # compiles what it needs
    logger = logging.getLogger("jax")
    handler = Count()
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            for _ in range(3):
                _, state = tx.update(grads, state, params)
    finally:
        logger.removeHandler(handler)
    assert compiles == []


def _stagnation_on_named_axis(axis_name):
    """16 of 20 entries stuck: 4 mirrored shards of 4, beside 4 replicated that move.

    Every entry of the sharded leaf is stuck (its shards equal) and every
    entry of the replicated one moves.
    """
    tx = jls.loss_scaling(
        optax.sgd(1.0),
        jls.no_scale(),
        axis_name=axis_name,
        hooks=[jls.hooks.Stagnation(every=1)],
    )
    params = {"r": jnp.ones(4, jnp.bfloat16), "s": jnp.ones(4, jnp.bfloat16)}
    grads = {"r": jnp.full(4, 0.25), "s": jnp.full(4, 1e-4)}

    def device(_):
        return jls.apply_gradients(tx, grads, tx.init(params), params)[1]

    state = jax.vmap(device, axis_name="dp")(jnp.arange(4))
    return np.asarray(jls.metrics(state)["stagnant_fraction"]).tolist()


def test_mirrored_shards_are_each_counted_without_vma():
    assert (
        _stagnation_on_named_axis({"dp": {"r": False, "s": True}})
        == [np.float32(0.8)] * 4
    )


def test_an_undeclared_axis_is_refused_without_vma():
    with pytest.raises(ValueError, match=r"axis_name=\{'dp': False\}.*got axis_name"):
        _stagnation_on_named_axis("dp")
