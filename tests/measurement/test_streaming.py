"""`--measure stream`: the streamed sensitivity against the whole-model oracle, its memory, and its plans."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr

from mixq.formats.checkpoint import open_checkpoint
from mixq.measurement import kld as oracle
from mixq.measurement import streaming as st
from mixq.measurement.trellis import budget_units

SHARED = Path(os.environ.get("MIXQ_SHARED", Path(__file__).resolve().parents[3] / "shared"))


def predicted_gains(ck, sens: st.Sensitivity, ref_bits: float = 3.0) -> dict[str, float]:
    """The streamed prediction of what `kld.kld_gains` measures: ½·Σ σ²·Σ_t ‖g_t‖²‖x_t‖² / N for i.i.d. noise of
    the oracle's variance on every matrix of the unit. Units with a matrix the gradient never reaches are left
    out (returned apart)."""
    out = {}
    for key, us in budget_units(ck).items():
        names = [n for u in us for n in u.hf_names]
        if any(n not in sens.noise for n in names):
            continue
        out[key] = sum(0.5 * oracle.TRELLIS_D * 2.0 ** (-2 * ref_bits)
                       * float(ck.get(n, dtype=torch.float32).square().mean()) * sens.noise[n] for n in names)
    return out


def oracle_agreement(model: Path, rows: int, seq_len: int) -> tuple[float, list[str], int]:
    ck = open_checkpoint(model)
    sens = st.stream_sensitivity(ck, rows=rows, seq_len=seq_len, progress=False)
    pred = predicted_gains(ck, sens)
    units = list(budget_units(ck))
    gains = oracle.kld_gains(ck, units, rows=rows, seq_len=seq_len, progress=False)
    keys = sorted(pred)
    rho = spearmanr([gains[k] for k in keys], [pred[k] for k in keys]).statistic
    return float(rho), sorted(set(units) - set(pred)), len(keys)


@pytest.mark.slow
def test_stream_ranks_units_as_the_oracle_mini():
    """The streamed per-unit costs rank mini's units as the whole-model oracle does (measured: 0.95)."""
    rho, left_out, n = oracle_agreement(SHARED / "models" / "glm5next-mini", rows=2, seq_len=64)
    assert left_out == ["model.language_model.layers.3.self_attn.indexer.wq_b.weight"]  # top-k choice: no gradient
    assert n == 25
    assert rho >= 0.9, rho
