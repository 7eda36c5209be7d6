"""Presets: every peer framework's loss scaler, as configuration of jls's rule.

Each preset takes the framework's own argument names and defaults; its scale
trajectory is the framework's exactly while the framework stays sane (the
semantics read from the frameworks' code where their prose disagrees). Where
a framework breaks (its scale reaching 0 or inf), jls keeps the scale finite
and positive; each docstring says where. Every preset also takes jls's
``min_scale`` and ``max_scale``. Frameworks that keep a float64 scale
(MindSpore, DeepSpeed, nnabla) match exactly for power-of-two factors.
`to_state_dict` and `from_state_dict` carry a run to and from torch's,
Paddle's and Megatron's checkpoints.
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
