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


def _tiny(root: Path, layers: int) -> Path:
    from mixq.formats.tiny import write_tiny_checkpoint

    kinds = ("linear_attention",) * (layers - 1) + ("deepseek_sparse_attention",)
    return write_tiny_checkpoint(root / f"m{layers}", hidden=64, nextn=False, vision=False, layer_types=kinds)


def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage held by a live tensor on the CPU (parameters on the meta device hold none)."""
    import gc

    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st_ = o.untyped_storage()
            seen[st_.data_ptr()] = st_.nbytes()
    return sum(seen.values())


def test_stream_memory_does_not_grow_with_depth(tmp_path, monkeypatch):
    """The streamed measurement holds one layer and the current streams: the most bytes held by live tensors while
    a layer is materialised is the same for a 2-layer and a 4-layer model of one width (the layer inputs wait
    on disk). What does grow is the result, a few KB of per-row statistics per Linear (~90 KB for two layers
    here); kept in memory instead, the 4-layer model's two extra boundary states would add 0.75 MiB, twice the
    tolerance below. (Every materialisation walks every live object, so the depths stay small.)"""
    from mixq.runtime.layer_stream import DecoderStream

    peaks = {}
    orig = DecoderStream.materialize

    def spy(self, layer, fetch):
        mod = orig(self, layer, fetch)
        peaks[key] = max(peaks.get(key, 0), _live_tensor_bytes())
        return mod

    monkeypatch.setattr(DecoderStream, "materialize", spy)
    for key in (2, 4):
        ck = open_checkpoint(_tiny(tmp_path, key))
        s = st.stream_sensitivity(ck, rows=4, seq_len=96, spill_dir=tmp_path, progress=False)
        assert all(torch.isfinite(v).all() for v in s.rows.values())
    state = 4 * 96 * 4 * 64 * 4  # rows x seq x streams x hidden x float32: one boundary state
    assert abs(peaks[4] - peaks[2]) < state, (peaks, state)


@pytest.mark.slow
def test_plan_from_saved_stream_measurement_is_identical(tmp_path, monkeypatch):
    """`mixq plan --measure stream` saves its curves; the plan from `--measure FILE` is byte-identical
    to the one measured in the same run, and the file records the method."""
    import json

    from click.testing import CliRunner

    from mixq.cli import main
    from mixq.measurement import trellis as cs

    model = _tiny(tmp_path, 2)
    monkeypatch.setattr(cs, "RATES", (2.0, 4.0))
    monkeypatch.setattr(cs, "MEASURE_ROWS", 2)
    monkeypatch.setattr(cs, "MEASURE_SEQ_LEN", 32)
    monkeypatch.setitem(cs.SAMPLING, "cpu", (1, 1))
    out = tmp_path / "curves.json"
    base = ["plan", str(model), "--format", "exl3", "--bpw", "3.05", "--json"]
    r = CliRunner().invoke(main, base + ["--measure", "stream", "--measure-out", str(out)])
    assert r.exit_code == 0, r.output
    assert cs.curves_meta(out)["method"] == "stream"
    curves = cs.load_curves(out)
    assert set(curves) == set(budget_units(open_checkpoint(model)))
    assert all(c[2.0] > c[4.0] > 0 for c in curves.values())
    r2 = CliRunner().invoke(main, base + ["--measure", str(out)])
    assert r2.exit_code == 0, r2.output
    first, second = (json.loads(x.output[x.output.index("{"):]) for x in (r, r2))
    assert first["tensors"] and first["tensors"] == second["tensors"]
    assert (first["bpw"], first["total_bytes"]) == (second["bpw"], second["total_bytes"])
