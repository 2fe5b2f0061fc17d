"""`compare`: one table across reports and a KLD-vs-size PNG."""
from __future__ import annotations

import json

import pytest

from mixq.errors import FormatError, InputError
from mixq.eval.report import compare, render_markdown


def _cand(name, nbytes, kld, top1, dppl):
    return {
        "path": f"/q/{name}", "format": "gguf", "bytes": nbytes, "bpw": nbytes * 8 / 1e6, "kld_mean": kld,
        "kld_mean_err": kld / 10, "kld_median": kld / 2, "kld_p90": kld * 2, "kld_p99": kld * 5, "kld_p999": kld * 9,
        "kld_max": kld * 20, "top1": top1, "ppl_ref": 10.0, "ppl": 10.0 + dppl, "dppl": dppl, "rms_dp": 0.01, "positions": 255,
    }


def _report(ref, cands):
    return {"reference": ref, "text": "t.txt", "ctx": 512, "windows": 1, "candidates": cands}


def test_compare_table_and_plot(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps(_report("/m/mini", [_cand("Q8_0", 1_000_000, 0.001, 0.99, 0.01), _cand("Q2_K", 300_000, 0.2, 0.8, 1.5)])))
    b.write_text(json.dumps(_report("/m/k256", [_cand("Q4_K_M", 600_000, 0.03, 0.95, 0.2)])))
    png, md = tmp_path / "kld.png", tmp_path / "t.md"
    res = compare([a, b], plot=png, markdown=md)
    names = [r["name"] for r in res["rows"]]
    assert names == ["Q4_K_M", "Q2_K", "Q8_0"]  # grouped by reference, then by size
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    text = md.read_text()
    assert text == res["markdown"]
    assert "Reference `/m/mini`" in text and "Reference `/m/k256`" in text
    assert "| Q2_K | gguf | torch | 292.97 KiB | 2.400 | 0.2 ± 0.02 | 1 | 80.00 | +1.5000 |" in text


def test_compare_rejects_bad_reports(tmp_path):
    with pytest.raises(InputError):
        compare([])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FormatError):
        compare([bad])
    bad.write_text(json.dumps({"reference": "r", "candidates": [{"path": "x"}]}))
    with pytest.raises(FormatError, match="lacks"):
        compare([bad])


def test_render_markdown_row():
    md = render_markdown(_report("/m/mini", [_cand("Q8_0", 2 * 2**20, 0.001, 0.995, -0.01)]))
    assert "| Q8_0 | gguf | 2.00 MiB | 16.777 | 0.001 ± 0.0001 |" in md and "| 99.50 |" in md


def test_render_markdown_mtp_table():
    a, b = _cand("Q8_0", 2 * 2**20, 0.001, 0.995, -0.01), _cand("Q4_K_M", 2**20, 0.01, 0.95, 0.1)
    a.update(mtp_agreement=0.19, mtp_relative=0.95, mtp_delta=-0.01, mtp_delta_se=0.004)
    b["mtp_note"] = "llama.cpp does not run the NextN block (its MTP graph is not built)"
    rep = _report("/m/k256", [a, b])
    rep["mtp"] = {"nextn_layer": 4, "agreement": 0.2, "agreed": 50, "positions": 250}
    md = render_markdown(rep)
    assert "over 250 positions: reference head 20.00 %" in md
    assert "| Q8_0 | gguf | 16.777 | 19.00 | 0.9500 | -1.00 ± 0.40 |" in md
    assert "| Q4_K_M | gguf | 8.389 | not run: llama.cpp does not run the NextN block" in md
    assert "NextN" not in render_markdown(_report("/m/k256", [_cand("Q8_0", 2**20, 0.001, 0.995, 0.0)]))


def test_mtp_needs_the_reference_forward():
    from mixq.eval.options import EvalOptions

    with pytest.raises(InputError, match="--mtp"):
        EvalOptions(mtp=True, ref_logits="ref.bin")
    with pytest.raises(InputError, match="--mtp"):
        EvalOptions(mtp=True, devices="cpu,cpu")
