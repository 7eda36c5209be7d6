"""Which jax primitives are matmuls, which need float32, which are collectives.

`jls.precision.autocast` casts by these lists and
`jls.precision.precision_report` counts by them; they hold names, so one
absent from the installed jax costs nothing.
"""

from __future__ import annotations

# The matmuls autocast computes in the compute dtype (torch autocast's list).
CAST = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
# Ops whose result depends on the operand's dtype, not only its value: they
# take a value autocast holds wide back in its traced dtype.
TRACED_DTYPE = frozenset({"bitcast_convert_type", "nextafter"})

# Every matmul-like primitive `precision_report` counts, fused and scaled too.
MATMULS = CAST | frozenset(
    {
        "scaled_dot",
        "scaled_matmul",
        "scaled_matmul_wrapper",
        "dot_product_attention_fwd",
        "dot_product_attention_fwd_wrapper",
        "dot_product_attention_bwd",
        "dot_product_attention_bwd_wrapper",
        "dot_product_attention_fp8_fwd",
        "dot_product_attention_fp8_fwd_wrapper",
        "dot_product_attention_fp8_bwd",
        "dot_product_attention_fp8_bwd_wrapper",
    }
)

# The ops autocast computes in float32 (at least): torch autocast's float32
# list as the jax primitives those are made of.
FLOAT32 = frozenset(
    {
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "logistic",
        "pow",
        "integer_pow",
        "square",
        "rsqrt",
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "erf_inv",
        "reduce_sum",
        "reduce_prod",
        "reduce_window_sum",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
    }
)

# Primitives that move data between devices (shard_map, pmap).
COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "unreduced_psum",
        "pmax",
        "pmin",
        "ppermute",
        "pbroadcast",
        "pgather",
        "preduced",
        "psend",
        "precv",
        "all_gather",
        "all_gather_invariant",
        "all_gather_reduced",
        "all_to_all",
        "ragged_all_to_all",
        "reduce_scatter",
        "unreduced_reduce_scatter",
    }
)
# jax 0.10's asynchronous halves (``psum_start``/``psum_done``, ...) of these.
COLLECTIVES |= frozenset(f"{n}_start" for n in COLLECTIVES)
COLLECTIVES |= frozenset(f"{n}_done" for n in COLLECTIVES if not n.endswith("_start"))
