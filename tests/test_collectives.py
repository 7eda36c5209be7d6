"""Reading the collectives of a compiled program from its HLO text."""

import jax
import jax.numpy as jnp
import pytest

import jls
from jls.precision._collectives import compiled_collectives

HLO = """
ENTRY %main {
  %p = f16[2,16]{1,0} parameter(0)
  %all-reduce = f16[16,8]{1,0} all-reduce(%c), channel_id=1, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/dot_general" stack_frame_id=3}
  %all-reduce.1 = (f32[], pred[4]{0}, f32[3]{0}) all-reduce(%a, %b, %d), to_apply=%add
  %ags = ((bf16[2]{0}, f8e4m3fn[2]{0}), (bf16[8]{0}, f8e4m3fn[8]{0})) all-gather-start(%e, %f), dimensions={0}
  %agd = (bf16[8]{0}, f8e4m3fn[8]{0}) all-gather-done(%ags)
  %cps = (f16[4]{0}, f16[4]{0}, u32[], u32[]) collective-permute-start(%g), source_target_pairs={{0,1}}
  %cpd = f16[4]{0} collective-permute-done(%cps)
  %rs = s32[2]{0} reduce-scatter(%h), dimensions={0}, to_apply=%add
  %fusion = f32[] fusion(%all-reduce), kind=kLoop, calls=%all-reduce.clone
}
"""  # noqa: E501


def test_each_collective_once_per_dtype_it_sends_in_program_order():
    where = "jit(step)/transpose(jvp())/dot_general"
    assert compiled_collectives(HLO) == [
        ("all-reduce", "float16", where),
        ("all-reduce", "float32", "?"),
        ("all-reduce", "bool", "?"),
        ("all-gather", "bfloat16", "?"),
        ("all-gather", "float8_e4m3fn", "?"),
        ("collective-permute", "float16", "?"),  # not its u32 context
        ("reduce-scatter", "int32", "?"),
    ]


def test_the_report_of_a_compiled_step_on_one_device_lists_none():
    w = jnp.ones(3, jnp.float16)
    compiled = jax.jit(lambda w: jnp.sum(w * w)).lower(w).compile()
    report = jls.precision.precision_report(compiled)
    assert report.collectives == () and report.counts == {}
    lowered = jax.jit(lambda w: jnp.sum(w * w)).lower(w)
    assert jls.precision.precision_report(lowered).collectives == ()
    with pytest.raises(TypeError, match="compiled step takes no arguments"):
        jls.precision.precision_report(compiled, w)
