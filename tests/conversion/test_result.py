"""conversion/result.py: the one bpw figure of a written output and the readable summary of both formats."""
from __future__ import annotations

from mixq.conversion.result import COMMON_KEYS, ConvertResult


def test_exl3_file_size_counts_the_shards_on_disk(tmp_path):
    out = tmp_path / "m-exl3"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x" * 3000)
    (out / "model-00002-of-00002.safetensors").write_bytes(b"x" * 1000)
    (out / "config.json").write_text("{}")  # not a weight file
    res = ConvertResult(out=str(out), bytes=3990, tensors=10, seconds=1.0, bits=3.05, head_bits=6,
                        shards=["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
                        ref_params=8000, quantized=4)
    d = res.to_dict()
    assert d["file_bytes"] == 4000 and d["ref_params"] == 8000 and d["file_bpw"] == 4.0
    assert d["bpw"] == 3.05 and set(COMMON_KEYS) <= set(d)  # the older keys stay, as they were
    text = res.summary()
    assert "bpw        4.000 = file bytes x 8 / 8,000 model parameters" in text and text.count("bpw") == 2
    assert "3.05 exllamav3 bits over the budgeted Linears (what --bpw counts), head 6 bits" in text
    assert "in 2 files" in text and f"mixq verify {out}" in text


def test_gguf_summary_names_the_mmproj_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"G" * 2**20)
    res = ConvertResult(out=str(f), files=[str(f)], bytes=2**20 - 100, tensors=3, seconds=2.0, format="gguf",
                        types={"Q8_0": 2, "F32": 1}, threads=2, ref_params=2**20,
                        mmproj={"files": [str(tmp_path / "mm.gguf")], "tensors": 12, "types": {"F16": 12}})
    text = res.summary()
    assert res.file_bpw == 8.0 and "bpw        8.000" in text and "1.00 MiB in 1 file" in text
    assert f"mmproj     {tmp_path / 'mm.gguf'} (12 vision tensors)" in text and "{" not in text
    assert "Q8_0 x2, F32 x1" in text


def test_no_parameter_count_no_figure(tmp_path):
    res = ConvertResult(out=str(tmp_path / "x"), bytes=0, tensors=0, seconds=0.0, bits=2.0)
    assert res.file_bpw is None and res.to_dict()["file_bpw"] is None and "bpw   " not in res.summary()
