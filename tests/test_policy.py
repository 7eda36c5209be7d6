"""`jls.precision.get_policy`: jmp's policy tests as the specification, and jmp live."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jls

HALF = (np.float16, jnp.float16, jnp.bfloat16)
FULL = (np.float32, jnp.float32)
DTYPES = HALF + FULL
NUMPYS = (np, jnp)
NAMES = {np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16"}
NAMES[np.dtype(np.float32)] = "float32"
CASES = list(itertools.product(DTYPES, NUMPYS))


def _dtypes_equal(a, b):
    jax.tree.map(lambda x, y: x.dtype == y.dtype or pytest.fail(f"{x} {y}"), a, b)


# jmp's policy_test.py, case by case -----------------------------------------


@pytest.mark.parametrize("dtype, np_", CASES)
@pytest.mark.parametrize("which", ["param", "compute", "output"])
def test_policy_casts(dtype, np_, which):
    policy = jls.precision.Policy(dtype, dtype, dtype)
    assert getattr(policy, f"{which}_dtype") == dtype
    cast = getattr(policy, f"cast_to_{which}")({"a": np_.ones([])})
    _dtypes_equal(cast, {"a": np_.ones([], dtype)})


@pytest.mark.parametrize("dtype, np_", CASES)
def test_policy_with_output_dtype(dtype, np_):
    policy = jls.precision.Policy(np_.float32, np_.float32, np_.float32)
    assert policy.with_output_dtype(dtype).output_dtype == dtype


@pytest.mark.parametrize(
    "name, dtype",
    [("float16", np.float16), ("float32", np.float32), ("bfloat16", jnp.bfloat16)],
)
def test_get_policy(name, dtype):
    policy = jls.precision.get_policy(name)
    assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype


def test_get_policy_almost_dtype():
    with pytest.raises(ValueError, match="Unknown dtype 'compute_float16'"):
        jls.precision.get_policy("compute_float16")


@pytest.mark.parametrize("dtype, np_", CASES)
def test_get_policy_mixed(dtype, np_):
    policy = jls.precision.get_policy(f"c={NAMES[np.dtype(dtype)]}")
    assert policy.param_dtype == np_.float32
    assert policy.compute_dtype == policy.output_dtype == dtype


@pytest.mark.parametrize("dtype, np_", CASES)
def test_get_policy_compute(dtype, np_):
    policy = jls.precision.get_policy(f"c={NAMES[np.dtype(dtype)]},o=full")
    assert policy.param_dtype == policy.output_dtype == np_.float32
    assert policy.compute_dtype == dtype


def test_half_is_float16_off_tpu():
    assert jls.precision.get_policy("half").compute_dtype == jnp.float16  # CPU here


def test_cast_leaves_other_leaves_alone():
    obj = object()
    tree = {
        "o": obj,
        "h": jnp.ones([], jnp.float16),
        "f": jnp.ones([]),
        "i": jnp.ones([], jnp.int16),
    }
    full = jls.precision.get_policy("full").cast_to_param(tree)
    assert full["o"] is obj and full["i"] is tree["i"] and full["f"] is tree["f"]
    assert full["h"].dtype == jnp.float32
    half = jls.precision.get_policy("half").cast_to_compute(tree)
    assert half["h"] is tree["h"] and half["f"].dtype == jnp.float16


@pytest.mark.parametrize("dtype", DTYPES)
def test_str(dtype):
    first_name = {"float16": "f16", "bfloat16": "bf16", "float32": "full"}
    policy = jls.precision.Policy(dtype, dtype, dtype)
    for piece in str(policy).split(","):
        assert piece.split("=")[1] == first_name[np.dtype(dtype).name]


# Beyond jmp's tests ---------------------------------------------------------


STRINGS = [
    "float16",
    "bf16",
    "full",
    "half",
    "c=f16",
    "c=bf16,o=full",
    "p=f16,c=f16",
    "p=f16,c=bf16",
    "params=float32,compute=float16,output=float32",
    "o=bfloat16",
    "p=bf16",
]


@pytest.mark.parametrize("text", STRINGS)
def test_the_same_policy_as_jmp(text):
    ours, theirs = jls.precision.get_policy(text), jmp.get_policy(text)
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        assert getattr(ours, field) == np.dtype(getattr(theirs, field)), field
    assert str(ours) == str(theirs)
    tree = {"w": jnp.ones(3), "h": jnp.ones(2, jnp.float16), "i": jnp.arange(2)}
    for cast in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        a, b = getattr(ours, cast)(tree), getattr(theirs, cast)(tree)
        assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)


@pytest.mark.parametrize(
    "text, match",
    [
        ("x=f16", "Unknown key 'x'"),
        ("c=f8", "Unknown dtype 'f8'"),
        ("c=f16,", "Unknown key ''"),
        ("int32", "Unknown dtype 'int32'"),
    ],
)
def test_bad_policy_strings_name_the_part(text, match):
    with pytest.raises(ValueError, match=match):
        jls.precision.get_policy(text)


def test_policy_dtypes_must_be_floating():
    with pytest.raises(TypeError, match="compute_dtype must be a floating dtype"):
        jls.precision.Policy(jnp.float32, jnp.int32, jnp.float32)
    with pytest.raises(TypeError, match="policy must be a string"):
        jls.precision.get_policy(jnp.float16)


def test_an_equinox_module_is_cast_as_it_is():
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    policy = jls.precision.get_policy("p=f32,c=f16,o=f32")
    half = policy.cast_to_compute(model)
    assert half.activation is jax.nn.gelu
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(half, eqx.is_array))} == {
        np.dtype(np.float16)
    }
    out = policy.wrap(lambda m, x: m(x))(model, jnp.ones(3))
    assert out.dtype == jnp.float32


def test_cast_arguments_computes_in_compute_precision_and_differentiates():
    policy = jls.precision.get_policy("c=f16,o=f32")

    @policy.cast_arguments
    def loss(w, x):
        assert w.dtype == x.dtype == jnp.float16
        return jnp.sum(w * x)

    g = jax.grad(loss)(jnp.ones(3), jnp.arange(3.0))
    assert g.dtype == jnp.float32  # the master weights' dtype
    np.testing.assert_array_equal(g, [0.0, 1.0, 2.0])


@pytest.mark.parametrize("cast", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_weakly_typed_arrays_become_strong_as_with_jmp(cast):
    # jnp.asarray(2.0) is a weakly typed float32: jmp casts it (astype makes
    # it strong), so multiplying it by a float16 array stays float32.
    weak = jnp.asarray(2.0)
    assert jax.typeof(weak).weak_type
    policy = "p=f32,c=f32,o=f32"
    ours = getattr(jls.precision.get_policy(policy), cast)(weak)
    theirs = getattr(jmp.get_policy(policy), cast)(weak)
    assert not jax.typeof(ours).weak_type
    f16 = jnp.ones(2, jnp.float16)
    assert (ours * f16).dtype == (theirs * f16).dtype == jnp.float32

    @jax.jit
    def traced(x):
        return (
            getattr(jls.precision.get_policy(policy), cast)(x) * f16
        ).dtype == jnp.float32

    assert traced(weak)


def test_an_nnx_module_is_refused_by_argument_casting_with_the_nnx_way():
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    policy = jls.precision.get_policy("params=float32,compute=float16,output=float32")
    for call in (
        lambda: policy.cast_to_compute(model),
        lambda: policy.cast_arguments(lambda m, x: m(x))(model, jnp.ones((1, 2))),
        lambda: policy.cast_to_param({"model": model}),
    ):
        with pytest.raises(
            TypeError, match=r"nnx Module \(Linear\).*policy.wrap\(fn\).*float16"
        ):
            call()
    # A state (a pure pytree of arrays) is cast as it is.
    cast = policy.cast_to_compute(nnx.state(model, nnx.Param))
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.float16)}
