"""Presets: every peer framework's loss scaler, as configuration of jls's rule.

Each preset takes the framework's own argument names and defaults, and its
scale trajectory is the framework's exactly while the framework stays sane;
where a framework's scale reaches 0 or inf, jls keeps it finite and positive.
"""

from jls.presets._frameworks import mindspore, mindspore_fixed, nnabla, paddle, torch
from jls.presets._jax import flax, jmp
from jls.presets._keras import keras, tensorflow, tensorflow_v1
from jls.presets._llm import deepspeed, megatron
from jls.presets._state_dicts import from_state_dict, to_state_dict

__all__ = [
    "deepspeed",
    "flax",
    "from_state_dict",
    "jmp",
    "keras",
    "megatron",
    "mindspore",
    "mindspore_fixed",
    "nnabla",
    "paddle",
    "tensorflow",
    "tensorflow_v1",
    "to_state_dict",
    "torch",
]
