"""The package: public and deprecated names, lazy `jls.flax`, a quiet import."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import jax

import jls

# pyright: reportIndexIssue=false


def test_jls_flax_without_importing_it():
    code = "import jls; print(jls.flax.TrainState.__name__)"
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TrainState"


def test_public_names():
    expected = {
        "DivergenceError",
        "Hook",
        "LossScaleState",
        "LossScaler",
        "LossScaling",
        "Policy",
        "ScaleStats",
        "ScaledState",
        "SpikeRule",
        "Stagnation",
        "StagnationWarning",
        "all_finite",
        "apply_gradients",
        "compensated",
        "dynamic_scale",
        "get_policy",
        "loss_scale_state",
        "measured_scale",
        "loss_scaling",
        "metrics",
        "no_scale",
        "nonfinite_paths",
        "precision_report",
        "presets",
        "raise_if_diverged",
        "scale_loss",
        "scaled_state",
        "set_loss_scale",
        "static_scale",
        "stochastic_rounding",
        "train_step",
        "unscale",
        "upgrade_state",
        "warn_if_stagnant",
    }
    assert set(jls.__all__) == expected
    assert all(hasattr(jls, name) for name in expected)
    assert jax.tree.leaves(jls.LossScaleState._fields) == list(
        (
            "scale",
            "growth_count",
            "backoff_count",
            "consecutive_skips",
            "total_skips",
            "consecutive_nonfinite",
            "retries",
            "headroom",
        )
    )


def test_import_starts_no_backend():
    import subprocess
    import sys

    code = "import jax._src.xla_bridge as xb, jls; print(bool(xb._backends))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
