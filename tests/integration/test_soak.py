"""The fault-injection soak (``tests/soak.py``), short, on every configuration.

Each configuration is compiled once (both paths in one function, on the
smaller tree, at LLVM optimisation level 0: the HLO, and so what XLA fuses
into jls's checks, is the same as at the default level; only the machine
code is less optimised) and run for a few hundred steps; every invariant is
checked on every step. ``python tests/soak.py --steps 20000`` is the long run.

The checker itself is tested: a wrong reference model, sabotaged records and
a sabotaged jls decision must each be reported.
"""

import functools

import numpy as np
import pytest
import soak
from reference import RefScaler

import jls._decision

STEPS = 400
SEED = 0
OPTIONS = {"xla_backend_optimization_level": 0}


@functools.cache
def _runs(config):
    """The records of both paths (cached: one compile per configuration)."""
    return soak.simulate(
        config,
        STEPS,
        SEED,
        soak.PATHS,
        chunk=STEPS,
        leaves=soak.SMALL_LEAVES,
        compiler_options=OPTIONS,
    )


def _check(config, records, path, ref=None):
    scaler, _ = soak.make_config(config)
    ref = soak.reference_for(scaler) if ref is None else ref
    return soak.check_records(records, scaler, ref, path=path)


def _copy(records):
    return {
        k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in records.items()
    }


@pytest.mark.parametrize("config", soak.CONFIGS)
def test_every_invariant_on_every_step(config):
    scaler, _ = soak.make_config(config)
    runs = _runs(config)
    for path, records in runs.items():
        failures = _check(config, records, path)
        assert not failures, "\n".join(failures)
        summary = soak.summarize(config, path, records, failures)
        # The run exercised both outcomes and the injected faults.
        assert 0 < summary["nonfinite"] < STEPS, summary
        assert sum(summary["injected"].values()) > 0, summary
        if scaler.skip_nonfinite:
            assert summary["skipped"] == summary["nonfinite"], summary
        else:
            assert summary["skipped"] == 0, summary
    # Both paths took the same decisions and scales on the same gradients.
    a, b = (runs[p] for p in soak.PATHS)
    for key in ("skipped", "nonfinite", "growth_count", "total_skips"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    np.testing.assert_array_equal(
        a["scale"].view(np.uint32), b["scale"].view(np.uint32)
    )


def test_the_runs_cover_the_rule():
    """Across the configurations: growth, back-off, floors, scales below 1."""
    summaries = {
        config: soak.summarize(config, "update", _runs(config)["update"], [])
        for config in soak.CONFIGS
    }
    kinds = {k for s in summaries.values() for k, n in s["injected"].items() if n}
    assert kinds == set(soak.KINDS[1:])
    for config in ("dynamic_fast", "torch", "paddle", "megatron", "deepspeed", "flax"):
        assert summaries[config]["growths"] > 0, config
        assert summaries[config]["backoffs"] > 0, config
    for config in ("dynamic_below_one", "nnabla", "flax"):
        assert summaries[config]["steps_below_one"] > 0, config
    below = summaries["dynamic_below_one"]
    assert below["scale_range"][0] == 2.0**-10  # reached its floor


# The checker must be able to fail ----------------------------------------------

CHECKED = "dynamic_below_one"


def test_checker_reports_a_wrong_reference_model():
    scaler, _ = soak.make_config(CHECKED)
    ref = soak.reference_for(scaler)
    wrong = RefScaler(
        **{
            **{f: getattr(ref, f) for f in RefScaler.__dataclass_fields__},
            "growth_interval": ref.growth_interval + 1,
        }
    )
    failures = _check(CHECKED, _runs(CHECKED)["update"], "update", wrong)
    assert any("scale (bitwise)" in f for f in failures), failures
    assert any("growth_count" in f for f in failures), failures


def test_checker_reports_a_sabotaged_decision():
    records = _copy(_runs(CHECKED)["apply_gradients"])
    applied = np.flatnonzero(~records["skipped"])
    records["skipped"][applied[len(applied) // 2]] = True
    failures = _check(CHECKED, records, "apply_gradients")
    assert any("metrics skipped" in f for f in failures), failures


def test_checker_reports_a_changed_state_on_a_dropped_step():
    records = _copy(_runs(CHECKED)["update"])
    dropped = np.flatnonzero(records["skipped"])
    assert dropped.size
    records["inner_same"][dropped[0]] = False
    records["updates_negzero"][dropped[-1]] = False
    failures = _check(CHECKED, records, "update")
    assert any("dropped step: inner_same" in f for f in failures), failures
    assert any("dropped step: updates_negzero" in f for f in failures), failures


def test_checker_reports_gradients_it_did_not_see_as_nonfinite():
    """An inf the step did not see: the host truth disagrees with the step."""
    records = _copy(_runs(CHECKED)["update"])
    applied = np.flatnonzero(~records["skipped"])
    grads = [np.array(g) for g in records["grads"]]
    grads[2][applied[0]].flat[0] = np.inf
    records["grads"] = tuple(grads)
    failures = _check(CHECKED, records, "update")
    for name in ("metrics skipped", "body truth == host truth", "gradients were"):
        assert any(name in f for f in failures), (name, failures)


def test_soak_catches_a_check_of_the_scaled_gradients(monkeypatch):
    """A jls that tests the scaled gradients below scale 1 (torch's way).

    Finite scaled gradients that overflow once unscaled are then applied: the
    soak must report it.
    """
    original = jls._decision.unscaled_finite

    def scaled_only(grads, scale, *, scale_may_be_below_one):
        del scale_may_be_below_one
        return original(grads, scale, scale_may_be_below_one=False)

    monkeypatch.setattr(jls._decision, "unscaled_finite", scaled_only)
    summaries = soak.run_config(
        CHECKED,
        STEPS,
        SEED,
        ("apply_gradients",),
        chunk=STEPS,
        leaves=soak.SMALL_LEAVES,
        compiler_options=OPTIONS,
    )
    failures = summaries[0]["failures"]
    assert failures
    assert any("metrics skipped" in f and "pre_scale=" in f for f in failures)
    assert any("gradients were finite" in f for f in failures), failures
