"""Fixed scales: `jls.static_scale` and `jls.no_scale`."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import pytest
from rule_runs import _run

import jls


def test_static_and_no_scale():
    for scaler, value in [(jls.static_scale(128.0), 128.0), (jls.no_scale(), 1.0)]:
        states = _run(scaler, [True, False, False, True] * 3)
        assert {float(s.scale) for s in states} == {value}
        assert int(states[-1].total_skips) == 6
        assert not scaler.is_dynamic
    assert jls.no_scale().is_identity and not jls.static_scale(2.0).is_identity


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), 1e40])
def test_bad_static_scale(value):
    with pytest.raises(ValueError, match="value must be"):
        jls.static_scale(value)
