"""Sphinx configuration of jls's documentation.

Build it strictly (every warning and every broken cross-reference fails)::

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -n -b html docs docs/_build/html

The MyST pages' ``{code-cell}`` cells and the notebooks in ``notebooks/``
(copied in at build time; committed without outputs) run on every build, so
the site shows every output and plot, and a failing cell fails the build.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import shutil

import jls

DOCS = pathlib.Path(__file__).parent
ROOT = DOCS.parent

project = "jls"
author = "jls maintainers"
copyright = "jls maintainers"
release = jls.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# No intersphinx: the build must work without network (CI has none), so
# third-party names are not links (see nitpick_ignore_regex below).

exclude_patterns = ["_build", "**.ipynb_checkpoints", "jupyter_execute"]
templates_path = ["_templates"]

html_theme = "sphinx_book_theme"
html_title = f"jls {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}

# -- The notebooks ------------------------------------------------------------
# Sphinx only reads files under docs/, so notebooks/*.ipynb are copied into
# docs/notebooks/ (gitignored) on every build; a copy is rewritten only when
# it differs, so an unchanged notebook is not read again.
NOTEBOOKS = DOCS / "notebooks"
NOTEBOOKS.mkdir(exist_ok=True)
for _source in sorted((ROOT / "notebooks").glob("*.ipynb")):
    _copy = NOTEBOOKS / _source.name
    if not _copy.exists() or _copy.read_bytes() != _source.read_bytes():
        shutil.copyfile(_source, _copy)
for _stale in NOTEBOOKS.glob("*.ipynb"):
    if not (ROOT / "notebooks" / _stale.name).exists():
        _stale.unlink()

# The notebooks import the demo's model and data (examples/demo.py,
# examples/mlp.py): the kernels the build starts inherit this path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT / "examples"), os.environ.get("PYTHONPATH")])
)

# -- myst-nb ------------------------------------------------------------------
# Every build runs the pages' code cells and the notebooks ("force": no
# execution cache to go stale; Sphinx still skips pages it does not read
# again), each cell with a time limit, and a cell that raises fails the
# build: the site shows what each cell prints and plots, as it runs today.
# (tests/integration/test_notebooks.py runs the notebooks too.)
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 300
nb_execution_excludepatterns: list[str] = []
# Each page runs in a fresh temporary folder: nothing a cell writes lands in
# the source tree, and a page runs again cleanly.
nb_execution_in_temp = True
# A cell that writes to stderr (a warning, a deprecation) is a build warning,
# so -W fails on it: the documented examples run without warnings, as the
# README's blocks do under pytest's filterwarnings = error.
nb_output_stderr = "warn"
nb_merge_streams = True

myst_enable_extensions = ["colon_fence", "deflist"]
# Anchors for headings (## Foo -> #foo), as GitHub makes them, for
# [text](page.md#foo) links between pages.
myst_heading_anchors = 3

# -- API reference ------------------------------------------------------------
autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Not set: autodoc_preserve_defaults (jls's defaults are written as
# _D.init_scale, worse than their values) and autodoc_type_aliases for
# ArrayLike (Sphinx then renders "ArrayLike | None" as TypeAliasForwardRef).
# The examples in docstrings are doctests (tests/test_doctests.py runs them);
# napoleon renders Google-style sections (Args:, Returns:, Raises:, Example:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# The Attributes: sections describe each field; the annotations (jax.Array
# shown as jax.jaxlib._jax.Array) add nothing but noise.
napoleon_attr_annotations = False

# Single backticks in jls's docstrings (`jls.apply_gradients`,
# `LossScaleState`) are meant as cross-references: make them py:obj
# references, checked by -n like every other.
default_role = "py:obj"

# Nitpicky everywhere (Read the Docs passes -W but not -n): every reference
# must resolve.
nitpicky = True

# -n (nitpicky) reports every reference that does not resolve. jls's own
# public names all resolve (a bare name like `LossScaleState` in a docstring
# of jls.presets resolves to jls's, see _resolve_in_jls below); what is
# ignored here is what has no page to link to. Anything else that fails to
# resolve fails the build.
nitpick_ignore_regex = [
    # Third-party types in signatures and bases (no intersphinx, so no
    # pages): jax.Array, jax.sharding types; optax.GradientTransformation,
    # optax.Params, ...; flax.nnx.Optimizer and
    # flax.training.train_state.TrainState (jls.flax's bases); numpy types.
    (r"py:.*", r"(jax|jaxlib|optax|flax|numpy|np)(\..*)?"),
    # The standard library's types in signatures (collections.abc.Callable,
    # Sequence, Mapping).
    (r"py:.*", r"collections\.abc\..*"),
    # jls's private modules and types (jls.hooks._hooks.StepInfo,
    # jls.precision._precision.PrecisionReport, jls._inner.Transformation, the base
    # jls._config.Config, the TypeVar jls.precision._policy.T, ...): they appear in
    # signatures and bases and, as `jls._measured`, in a docstring, but are
    # not public, so the API reference has no entry for them.
    (r"py:.*", r"jls(\.\w+)*\._.*"),
    # The same private types named bare: by string annotations, and by
    # jls.precision.precision_report's "Returns:" (PrecisionReport), and the
    # step's frozen Config (jls._config), named in LossScaling's attributes.
    (r"py:(class|obj)", r"(StepOutput|ArrayTree|PrecisionReport|Config)"),
]
nitpick_ignore = [
    # jls.hooks.SpikeRule.veto and .update point at the private helpers of
    # jls/hooks/_spikes.py that implement them; they have no page.
    ("py:obj", "is_spike"),
    ("py:obj", "advance"),
]


def _resolve_in_jls(app, env, node, contnode):
    """Resolve a bare name that jls's docstrings use for one of jls's names.

    jls's docstrings write `LossScaleState` for ``jls.LossScaleState`` in
    every module; Sphinx looks such a name up in the documented object's own
    module (``jls.presets`` for a preset) and misses it; a summary line in
    the API reference's tables (`warn_if_stagnant`, `Hook.check`) is looked
    up from the page, not from its module. Try ``jls.<name>``, then
    ``jls.hooks.<name>`` and ``jls.precision.<name>``, before calling the
    reference broken.
    """
    if node.get("refdomain") != "py" or node.get("reftarget", "").startswith("jls."):
        return None
    domain = env.get_domain("py")
    for space in ("jls.", "jls.hooks.", "jls.precision."):
        target = space + node["reftarget"]
        found = domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], target, node, contnode
        )
        if found is not None:
            return found
    return None


def _skip_namedtuple_aliases(app, what, name, obj, skip, options):
    """Leave out NamedTuple fields' generated "Alias for field number N".

    The classes' ``Attributes:`` sections (napoleon) already document each
    field; autodoc would describe them a second time, a duplicate.
    """
    doc = getattr(obj, "__doc__", None) or ""
    if what == "class" and doc.startswith("Alias for field number"):
        return True
    return skip


def _own_init_signature(app, what, name, obj, options, signature, return_annotation):
    """Show a class's own ``__init__`` arguments, not its metaclass's.

    flax's nnx classes are made through a metaclass whose ``__call__`` takes
    ``(*args, **kwargs)``; autodoc shows that for `jls.flax.Optimizer`,
    hiding ``wrt`` and ``keep``. Use the class's ``__init__`` instead.
    """
    init = vars(obj).get("__init__") if what == "class" else None
    if init is None or not (signature or "").startswith("(*args"):
        return None
    parameters = list(inspect.signature(init).parameters.values())[1:]
    shown = [
        p.replace(annotation=p.empty, default=_Default(p.default))
        if p.default is not p.empty
        else p.replace(annotation=p.empty)
        for p in parameters
    ]
    return str(inspect.Signature(shown)), return_annotation


class _Default:
    """A default value shown by name (``keep=BatchStat``), not by repr."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return getattr(self.value, "__name__", None) or repr(self.value)


def setup(app):
    """Register the hooks above."""
    app.connect("autodoc-skip-member", _skip_namedtuple_aliases)
    app.connect("missing-reference", _resolve_in_jls)
    app.connect("autodoc-process-signature", _own_init_signature)
