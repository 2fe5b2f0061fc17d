"""bench/quality/nextn_types.py: the standard errors it adds to a run, on a hand-worked result."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "bench" / "quality"), str(REPO / "bench")]

import nextn_types  # noqa: E402


def test_summarise_on_hand_worked_rates():
    # 400 positions: the reference agrees at 10 % -> SE sqrt(0.1 * 0.9 / 400) = 0.015; a difference of two such
    # independent rates has SE 0.015 * sqrt(2), and two of those are 0.0424
    res = {"positions": 400, "reference_agreement": 0.1,
           "rows": [{"mtp_agreement": 0.1}, {"mtp_agreement": 0.5}, {"mtp_note": "not run"}]}
    out = nextn_types.summarise(res)
    assert out["rows"][0]["agreement_se"] == pytest.approx(0.015)
    assert out["rows"][1]["agreement_se"] == pytest.approx(0.025)
    assert "agreement_se" not in out["rows"][2]
    assert out["unpaired_resolution"] == pytest.approx(2 * 0.015 * math.sqrt(2))


def test_the_stored_table_carries_them():
    import json

    res = json.loads((REPO / "bench" / "results" / "nextn_types_k256.json").read_text())
    ref = res["rows"][0]
    assert ref["kind"] == "bf16" and ref["mtp_agreement"] == res["reference_agreement"]
    assert ref["agreement_se"] == pytest.approx(math.sqrt(ref["mtp_agreement"] * (1 - ref["mtp_agreement"])
                                                          / res["positions"]))
