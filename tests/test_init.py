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
    # The core only (jls 0.4): the rest lives in jls.hooks, jls.precision and
    # jls.presets.
    expected = {
        "LossScaleState",
        "LossScaler",
        "LossScaling",
        "LossScalingState",
        "all_finite",
        "apply_gradients",
        "dynamic_scale",
        "hooks",
        "keep_if_skipped",
        "loss_scale_state",
        "loss_scaling",
        "measured_scale",
        "metrics",
        "no_scale",
        "precision",
        "presets",
        "scale_loss",
        "set_loss_scale",
        "static_scale",
        "train_step",
        "unscale",
        "upgrade_state",
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
