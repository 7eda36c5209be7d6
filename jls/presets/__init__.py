"""Presets: every peer framework's loss scaler, as configuration of jls's rule.

Each preset takes the framework's own argument names and defaults and returns
a `jls.LossScaler` whose scale trajectory, for any sequence of finite and
non-finite steps, is the framework's exactly while the framework stays sane.
Where the framework breaks (the scale reaching 0 or inf and staying there),
jls keeps the scale finite and positive; each docstring says where. Every
preset also takes jls's ``min_scale`` and ``max_scale`` to override those
bounds.

The semantics were worked out from the frameworks' code, not their prose,
where the two disagree (each docstring notes it). Frameworks that keep the
scale in float64 Python numbers (MindSpore's manager, DeepSpeed, nnabla) are
matched exactly for power-of-two factors (their defaults); with other factors
jls's float32 scale can differ from theirs in the last bits.

State interchange: `to_state_dict` and `from_state_dict` carry a run's scale
and counters to and from the checkpoints of torch, Paddle and Megatron
(``framework="torch"``, ``"paddle"``, ``"megatron"``); pair them with
`jls.set_loss_scale` to put the state into an optimizer state.
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
