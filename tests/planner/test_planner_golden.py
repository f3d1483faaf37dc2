"""The cost model's choices on traces recorded on the lent H100 (W1, W2): the same as when the
data was written (make_golden.py), for every case of its grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from make_golden import DATA, decision, trace_of


@pytest.mark.parametrize("name", ["w1-h100", "w2-h100"])
def test_the_cost_model_chooses_as_recorded(name: str) -> None:
    golden = json.loads((DATA / f"{name}.json").read_text())
    trace = trace_of(golden["trace"])
    differ = []
    for *values, expected in golden["cases"]:
        case = dict(zip(golden["case"], values))
        got = decision(trace, case)
        if expected is None or got is None:
            same = got == expected
        else:
            # the predicted cost is rounded to the microsecond: a sum taken in another order may round the other way
            cost = golden["plan"].index("predicted_cost_ms")
            same = (got[:cost] + got[cost + 1:] == expected[:cost] + expected[cost + 1:]
                    and got[cost] == pytest.approx(expected[cost], abs=1.5e-3))
        if not same:
            differ.append((case, dict(zip(golden["plan"], expected or [])), dict(zip(golden["plan"], got or []))))
    assert not differ, f"{len(differ)} of {len(golden['cases'])} choices differ; the first: {differ[0]}"
