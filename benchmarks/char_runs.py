"""What the char-LM experiments share: the model module, batches, held-out loss.

``examples/char_lm.py``'s model is loaded by path (``examples/`` is not a
package); the experiments (``spike_clipping.py``, ``low_precision_params.py``,
``probe_char_check.py``) draw their batches and measure the held-out loss
the same way.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_char_lm() -> Any:
    """The ``examples/char_lm.py`` module."""
    spec = importlib.util.spec_from_file_location(
        "char_lm", ROOT / "examples" / "char_lm.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["char_lm"] = module  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def split(text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The training text and the held-out tenth."""
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def batch_tokens(cfg: Any, data: np.ndarray, seed: int):
    """A function of the step returning its batch of token windows."""
    starts = np.random.default_rng(seed).integers(
        0, len(data) - cfg.seq - 1, (cfg.steps, cfg.batch)
    )
    windows = np.arange(cfg.seq + 1)
    return lambda i: jnp.asarray(data[starts[i][:, None] + windows], jnp.int32)


def held_out_loss(lm: Any, cfg: Any, params: Any, held_out: np.ndarray) -> float:
    """The float32 loss on 8 fixed held-out batches (parameters cast up)."""
    f32_loss = jax.jit(lm.make_loss(cfg, "f32"))
    wide = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    starts = np.random.default_rng(1234).integers(
        0, len(held_out) - cfg.seq - 1, (8, cfg.batch)
    )
    windows = np.arange(cfg.seq + 1)
    losses = [
        float(f32_loss(wide, jnp.asarray(held_out[h[:, None] + windows], jnp.int32)))
        for h in starts
    ]
    return float(np.mean(losses))
