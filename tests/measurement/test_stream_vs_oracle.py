"""`--measure stream` against the oracle's saved curves: the streamed costs rank the units as `--measure kld` does.

The oracle curves (tests/data/stream_oracle/MODEL_FORMAT_kld.json) were measured by bench/quality/stream_vs_oracle.py
through `mixq.measure(..., method="kld")`: each unit perturbed and the whole model run end to end, code apart
from the streamed measurement. A unit's cost is its curve at one reference point, the same for both: EXL3 at
3 bits (the rate of the oracle's perturbation), GGUF at the ladder point nearest 3.5 bpw (the oracle's reference
type). bench/results/stream_vs_oracle.json holds the Spearman of every pair and what each measurement cost.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr

import mixq
from mixq.formats.checkpoint import open_checkpoint
from mixq.measurement import kld as oracle
from mixq.measurement import streaming as st
from mixq.measurement.trellis import budget_units

DATA = Path(__file__).resolve().parents[1] / "data" / "stream_oracle"
EXL3_REF, GGUF_REF = 3.0, 3.5


def costs(curves: dict, fmt: str) -> dict[str, float]:
    """Each unit's curve at the reference point (module docstring)."""
    out = {}
    for k, c in curves.items():
        if k.startswith("_"):
            continue
        c = {float(b): float(v) for b, v in c.items()}
        out[k] = c[EXL3_REF if fmt == "exl3" else min(c, key=lambda b: (abs(b - GGUF_REF), b))]
    return out


def rho(a: dict[str, float], b: dict[str, float]) -> tuple[float, int]:
    keys = sorted(set(a) & set(b))
    return float(spearmanr([a[k] for k in keys], [b[k] for k in keys]).statistic), len(keys)


def saved(model: str, fmt: str) -> dict[str, float]:
    return costs(json.loads((DATA / f"{model}_{fmt}_kld.json").read_text()), fmt)


def test_the_streamed_sensitivity_ranks_mini_as_the_saved_oracle(mini_model):
    """What the oracle measures at 3 bits (i.i.d. noise of the trellis's error, one unit at a time, KLD of the
    whole model) predicted from one streamed backward on 2 x 64 calibration tokens: ½·σ²·(the sequence Fisher's
    trace) summed over the unit's matrices. Units the backward cannot reach (the DSA indexer's, which only choose
    keys) are left out."""
    ck = open_checkpoint(mini_model)
    sens = st.stream_sensitivity(ck, rows=2, seq_len=64, progress=False)
    pred = {}
    for key, us in budget_units(ck).items():
        names = [n for u in us for n in u.hf_names]
        if all(n in sens.noise for n in names):
            pred[key] = sum(0.5 * oracle.TRELLIS_D * 2.0 ** (-2 * EXL3_REF)
                            * float(ck.get(n, dtype=torch.float32).square().mean()) * sens.noise[n] for n in names)
    oracle_costs = saved("mini", "exl3")
    r, n = rho(pred, oracle_costs)
    assert (n, len(oracle_costs)) == (25, 26)  # all but layer 3's indexer wq_b (it only chooses keys)
    assert r >= 0.9, r


@pytest.mark.slow
@pytest.mark.parametrize("model, fmt", [("mini", "exl3"), ("mini", "gguf"), ("k256", "gguf"), ("k256", "exl3")])
def test_stream_curves_rank_units_as_the_saved_oracle(request, model, fmt):
    """The whole `--measure stream` (the public API, the bench's calibration) against the saved oracle curves."""
    if not (DATA / f"{model}_{fmt}_kld.json").is_file():
        pytest.skip(f"no saved oracle for {model} {fmt} (bench/quality/stream_vs_oracle.py --pairs {model}:{fmt})")
    path = request.getfixturevalue(f"{model}_model")
    shared = Path(path).parents[1]
    curves = mixq.measure(path, fmt, method="stream", calibration=[shared / "data" / "calibration.txt"],
                          device="cpu", progress=False)
    r, n = rho(costs(curves, fmt), saved(model, fmt))
    assert n == len(saved(model, fmt)) == len(costs(curves, fmt))
    assert r >= 0.9, r
