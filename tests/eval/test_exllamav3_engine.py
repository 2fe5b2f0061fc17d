"""`mixq eval --engine exllamav3` (eval/exllamav3_engine.py): an EXL3 candidate scored through exllamav3's own
forward on CUDA; elsewhere one `mixq: error:` line saying exllamav3 and CUDA are needed.

The GPU test converts glm5next-k256 with mixq's real trellis encoder (4 bpw) and scores it with both engines on
the same held-out windows: the KLDs are finite and within a factor 2 of each other (the two forwards differ in
numerics: fp16 kernels in exllamav3, float32 layers in torch).
"""
from __future__ import annotations

import math

import pytest
import torch

from cli_helpers import error_line, run_cli


def _exllamav3_ready() -> str | None:
    """Why the GPU test cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import exllamav3  # noqa: F401 - builds / loads its CUDA extension
    except Exception as e:  # noqa: BLE001
        return f"exllamav3 does not import ({type(e).__name__})"
    return None


def test_without_cuda_or_exllamav3_one_error_line(tiny_model, tiny_exl3_cheap, tmp_path, monkeypatch):
    """No CUDA (or no exllamav3): exit 2 with one line naming exllamav3 and CUDA, before any forward."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "text.txt").write_text("held-out words and more words " * 40)
    line = error_line(run_cli("eval", tiny_model, tiny_exl3_cheap, "--text", tmp_path / "text.txt", "--ctx", "16",
                              "--windows", "1", "--engine", "exllamav3", "--device", "cpu"))
    assert "--engine exllamav3 needs exllamav3 and a CUDA device" in line


@pytest.mark.gpu
def test_exllamav3_engine_scores_like_the_torch_engine(k256_model, heldout_text, calibration_text, tmp_path):
    why = _exllamav3_ready()
    if why:
        pytest.skip(why)
    from mixq.conversion.api import convert
    from mixq.eval import evaluate

    out = tmp_path / "k256-4.0"
    convert(k256_model, out, "exl3", bpw=4.0, device="cuda", calibration=[calibration_text], rows=16, seq_len=256,
            progress=False)
    common = dict(ctx=256, windows=4, device="cuda", progress=False)
    rt = evaluate(k256_model, [out], heldout_text, engine="torch", **common)["candidates"][0]
    rx = evaluate(k256_model, [out], heldout_text, engine="exllamav3", **common)["candidates"][0]
    assert rt["engine"] == "torch" and rx["engine"] == "exllamav3" and rx["format"] == "exl3"
    assert math.isfinite(rt["kld_mean"]) and math.isfinite(rx["kld_mean"]) and rt["kld_mean"] > 0
    assert 0.5 <= rx["kld_mean"] / rt["kld_mean"] <= 2.0, (rx["kld_mean"], rt["kld_mean"])
    assert rx["positions"] == rt["positions"] and rx["top1"] > 0.5
