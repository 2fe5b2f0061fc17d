"""--refine-passes: the Hessian rounding's descent passes after its feedback walk, from the option to the encoder,
the encode cache's key and the receipt."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mixq.conversion.gguf import receipt as gguf_receipt
from mixq.conversion.gguf import rounding as gr
from mixq.conversion.options import GGUFOptions
from mixq.errors import InputError


def test_the_option_is_checked_and_needs_hessian_rounding():
    assert GGUFOptions(qtype="Q4_K_M", rounding="hessian", refine_passes=1).refine_passes == 1
    assert GGUFOptions(qtype="Q4_K_M", rounding="hessian", refine_passes=0).refine_passes == 0
    with pytest.raises(InputError, match=r"--refine-passes applies to GGUF with --rounding hessian"):
        GGUFOptions(qtype="Q4_K_M", refine_passes=1)
    with pytest.raises(InputError, match=r"--refine-passes -1: expected a whole number >= 0"):
        GGUFOptions(qtype="Q4_K_M", rounding="hessian", refine_passes=-1)


def test_the_receipt_records_it_only_when_given():
    given = GGUFOptions(qtype="Q4_K_M", rounding="hessian", refine_passes=1)
    default = GGUFOptions(qtype="Q4_K_M", rounding="hessian")
    for o, want in ((given, {"refine_passes": 1}), (default, {})):
        assert "refine_passes" not in gguf_receipt.receipt_options(o)
        hessian = gguf_receipt._calibration(SimpleNamespace(opts=o, imx=None, imatrix_obj=None))["hessian"]
        assert {k: v for k, v in hessian.items() if k == "refine_passes"} == want


def test_the_cache_key_names_the_passes():
    ids = torch.arange(8).view(1, 8)
    dev = torch.device("cpu")
    assert gr.rounding_tag(ids, dev) == gr.rounding_tag(ids, dev, gr.REFINE_PASSES)
    assert gr.rounding_tag(ids, dev, 1) != gr.rounding_tag(ids, dev)


def test_the_default_is_per_type_where_tuning_follows():
    assert {t: gr.passes_for(t) for t in ("Q2_K", "IQ2_S", "IQ2_XS", "Q3_K", "Q4_K", "IQ4_NL")} == \
        {"Q2_K": 1, "IQ2_S": 0, "IQ2_XS": 1, "Q3_K": 3, "Q4_K": 3, "IQ4_NL": 3}
    assert {gr.passes_for(t, tuned=False) for t in ("Q2_K", "IQ2_S", "Q4_K")} == {gr.REFINE_PASSES}
    assert {gr.passes_for(t, 2) for t in ("Q2_K", "IQ2_S", "Q4_K")} == {2}


def test_the_passes_reach_the_encoder(k256_model, calibration_text, tmp_path, monkeypatch):
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    ck = open_checkpoint(k256_model)
    specs = [s for s in gguf_tensors(ck) if s.name in ("blk.0.attn_q.weight", "blk.1.ffn_up_exps.weight")]
    seen = []
    real = gr.kh.quantize_hessian

    def spy(w, h, qtype, *a, refine=0, **k):
        seen.append((qtype, refine))
        return real(w, h, qtype, *a, refine=refine, **k)

    monkeypatch.setattr(gr.kh, "quantize_hessian", spy)
    three = gr.REFINE_PASSES
    for passes, iters, want in ((None, 0, {("Q4_K", three), ("Q2_K", three)}), (1, 0, {("Q4_K", 1), ("Q2_K", 1)}),
                                (None, 1, {("Q4_K", three), ("Q2_K", 1)})):
        seen.clear()
        out = gr.encode_hessian_rounded(ck, specs, ["Q4_K", "Q2_K"], tmp_path / f"{passes}-{iters}",
                                        calibration=[calibration_text], rows=1, seq_len=32, tune_iters=iters,
                                        refine_passes=passes, progress=False)
        assert set(out) == {s.name for s in specs}
        assert set(seen) == want
