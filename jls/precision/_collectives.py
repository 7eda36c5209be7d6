"""The collectives of a compiled program (its HLO text), with the dtype each sends."""

from __future__ import annotations

import re

_KINDS = "all-reduce|reduce-scatter|all-gather|(?:ragged-)?all-to-all|collective-\\w+"
_OP = re.compile(rf"=\s*(\(.*\)|\S+)\s+({_KINDS})(-start)?\(")
_ARRAY = re.compile(r"\b(pred|bf16|[fsu]\d+\w*)\[([\d,]*)\]")
_NAME = re.compile(r'op_name="([^"]*)"')
_DTYPE = {"pred": "bool", "bf16": "bfloat16", "f": "float", "s": "int", "u": "uint"}


def _dtype(hlo: str) -> str:
    """The numpy name of an HLO element type: ``f16`` -> ``float16``."""
    if hlo in _DTYPE:
        return _DTYPE[hlo]
    kind, bits, rest = re.split(r"(\d+)", hlo, maxsplit=1)
    return _DTYPE[kind] + bits + (rest and f"_{rest}")


def compiled_collectives(text: str) -> list[tuple[str, str, str]]:
    """``(kind, dtype, op_name)`` of each collective in HLO ``text``, in order.

    One per dtype an instruction sends; an asynchronous pair once. ``op_name``
    is jax's op it came from, or ``"?"``.
    """
    found = []
    for line in text.splitlines():
        if (op := _OP.search(line)) is None:
            continue
        arrays = _ARRAY.findall(op[1])
        if op[3]:
            arrays = [a for a in arrays if a[1] or a[0] not in ("s32", "u32")]
        name = _NAME.search(line)
        for dtype in dict.fromkeys(_dtype(t) for t, _ in arrays):
            found.append((op[2], dtype, name[1] if name else "?"))
    return found
