"""`jls.precision._primitives`: every matmul-like and collective primitive is named.

The installed jax's primitives are enumerated from its own modules (private
jax, read by this test only): a primitive a later jax adds whose name says
dot, conv, matmul or einsum, or one of its parallel (collective) module,
fails here until `jls.precision._primitives` classifies it, instead of being missed by
`jls.precision.precision_report` and `jls.precision.autocast`.
"""

import importlib
import pkgutil
import re
import sys

import pytest
from jax.extend.core import Primitive

from jls.precision._primitives import CAST, COLLECTIVES, FLOAT32, MATMULS

# Where jax defines its primitives (jax 0.8.0 through 0.10.2); a package
# missing from one version is skipped, the rest must import.
PACKAGES = [
    "jax._src",
    "jax._src.lax",
    "jax._src.lax.control_flow",
    "jax._src.cudnn",
    "jax._src.nn",
    "jax._src.numpy",
]

# Named like a matmul but not one.
NOT_MATMULS = {
    "convert_element_type": "a cast",
    "bitcast_convert_type": "a cast",
    "ragged_all_to_all": "a collective",
}
# In jax's parallel module but sending no data between devices.
NOT_COLLECTIVES = {
    "axis_index": "reads the device's index",
    "vary_unreduced_cast_p": "a type cast of the unreduced mark",
}
MATMUL_LIKE = re.compile(r"dot|conv|matmul|einsum|ragged")


def _primitives() -> dict[str, set[str]]:
    """Every Primitive defined in jax's modules: name -> defining modules."""
    for package in PACKAGES:
        try:
            path = importlib.import_module(package).__path__
        except ImportError:
            continue
        for info in pkgutil.iter_modules(path):
            if not info.ispkg and not info.name.startswith("test"):
                try:
                    importlib.import_module(f"{package}.{info.name}")
                except Exception:  # a backend's plugin absent here (cuda, tpu)
                    continue
    found: dict[str, set[str]] = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("jax.") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, Primitive):
                    found.setdefault(value.name, set()).add(name)
    return found


PRIMITIVES = _primitives()


def test_the_enumeration_finds_jax_s_primitives():
    # The ones every supported jax has: the enumeration itself works.
    expected = {"dot_general", "conv_general_dilated", "ragged_dot_general"}
    expected |= {"psum", "all_gather", "ppermute", "all_to_all", "reduce_scatter"}
    assert expected <= set(PRIMITIVES)
    assert len(PRIMITIVES) > 150


def test_every_matmul_like_primitive_is_counted():
    named = {n for n in PRIMITIVES if MATMUL_LIKE.search(n)} - set(NOT_MATMULS)
    missing = named - MATMULS
    assert not missing, f"classify in jls/precision/_primitives.py: {sorted(missing)}"


def test_every_collective_is_listed():
    parallel = {
        name
        for name, modules in PRIMITIVES.items()
        if any(m.endswith("lax.parallel") for m in modules)
    }
    missing = parallel - COLLECTIVES - set(NOT_COLLECTIVES)
    assert not missing, f"classify in jls/precision/_primitives.py: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(CAST | {"exp", "log", "reduce_sum", "square"}))
def test_the_cast_and_float32_lists_name_real_primitives(name):
    # A typo in a list would silently cast nothing.
    assert name in PRIMITIVES


def test_every_float32_op_is_a_primitive_of_the_installed_jax():
    assert FLOAT32 <= set(PRIMITIVES), sorted(FLOAT32 - set(PRIMITIVES))
    assert CAST <= MATMULS
