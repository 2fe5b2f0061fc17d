"""convert/gguf_rounding.py: GGUF `--rounding hessian` — same tensors, types and byte counts as ggml's encoder,
codes chosen for the layer-output error (glm5next-k256, a short calibration)."""
from __future__ import annotations

import numpy as np
import pytest

from mixq.convert import gguf_rounding as gr
from mixq.errors import InputError
from mixq.quant import kquants
from mixq.quant import kquants_hessian as kh

PICK = {"token_embd.weight": "Q4_K", "blk.0.attn_q.weight": "Q2_K", "blk.1.ffn_up_exps.weight": "Q3_K",
        "output.weight": "Q6_K", "blk.3.attn_k_b.weight": "BF16", "blk.0.ssm_f_a.weight": "Q4_K",
        "blk.4.ffn_up_exps.weight": "Q4_K"}


@pytest.fixture(scope="module")
def k256_specs(k256_model):
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    ck = open_checkpoint(k256_model)
    specs = [s for s in gguf_tensors(ck) if s.name in PICK]
    return ck, specs, [PICK[s.name] for s in specs]


def test_rounding_modes_are_checked():
    assert gr.check_rounding("Hessian") == "hessian" and gr.check_rounding("exact") == "exact"
    with pytest.raises(InputError, match="--rounding 'gptq': expected one of exact, hessian"):
        gr.check_rounding("gptq")


def test_covered_tensors(k256_specs):
    _, specs, types = k256_specs
    got = {s.name for s, t in zip(specs, types) if gr.covered(s, t)}
    # BF16 keeps its bytes; the NextN block (blk.4) has no calibration input; ssm_f_a is a covered Linear
    assert got == {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_up_exps.weight", "output.weight",
                   "blk.0.ssm_f_a.weight"}


@pytest.mark.slow
def test_hessian_rounded_blocks_have_ggml_layout(k256_specs, calibration_text, tmp_path):
    ck, specs, types = k256_specs
    with gr.hessian_rounded(ck, specs, types, tmp_path / "m.gguf", calibration=[calibration_text], rows=2,
                            seq_len=64, progress=False) as loaders:
        assert len(list(tmp_path.glob(".m.partial-hessian-*"))) == 1
        assert set(loaders) == {s.name for s, t in zip(specs, types) if gr.covered(s, t)}
        got = {n: f() for n, f in loaders.items()}
    assert not list(tmp_path.glob(".m.partial-hessian-*"))  # the spill directory is gone
    from mixq.formats.gguf_names import build_tensor

    for s, t in zip(specs, types):
        if s.name not in got:
            continue
        x = build_tensor(s, ck.get).numpy()
        exact = np.stack([kquants.quantize(e, t) for e in x]) if x.ndim == 3 else kquants.quantize(x, t)
        assert got[s.name].shape == exact.shape and got[s.name].dtype == np.uint8, s.name
        d = kh.dequantize_blocks(got[s.name], t)
        assert np.isfinite(d).all()
        # the codes moved, the weights stayed close: decoded values within a few steps of ggml's own decoding
        rel = np.abs(d - kh.dequantize_blocks(exact, t)).mean() / np.abs(x).mean()
        assert 0 < rel < 0.5, (s.name, rel)


def test_work_directory_is_removed_on_error(k256_specs, tmp_path, monkeypatch):
    ck, specs, types = k256_specs

    def boom(*a, **k):
        raise InputError("calibration failed")

    monkeypatch.setattr(gr, "encode_hessian_rounded", boom)
    with pytest.raises(InputError, match="calibration failed"):
        with gr.hessian_rounded(ck, specs, types, tmp_path / "m.gguf"):
            pass
    assert not list(tmp_path.iterdir())
