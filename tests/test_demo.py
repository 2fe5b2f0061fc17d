"""demo_run.py: the demo's own tokenizer, and the whole demo with its EXL3 step (slow: the trellis on a CPU)."""
from __future__ import annotations

import json

import pytest

from mixq.demo_run import DEMO_EXL3_BPW, DEMO_MODEL, SPECIAL_TOKENS, run_demo, write_demo_tokenizer


def test_demo_tokenizer_loads_and_exports_to_gguf(tmp_path):
    from transformers import AutoTokenizer

    from mixq.runtime.calibration import BUILTIN_TEXT
    from mixq.formats.gguf_tokenizer import tokenizer_metadata

    vocab = DEMO_MODEL["vocab"]
    d = write_demo_tokenizer(tmp_path / "tok", vocab)
    first = (d / "tokenizer.json").read_text()
    assert write_demo_tokenizer(tmp_path / "again", vocab).joinpath("tokenizer.json").read_text() == first
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = tok(BUILTIN_TEXT, add_special_tokens=False)["input_ids"]
    assert len(tok) == vocab and max(ids) < vocab and tok.decode(ids) == BUILTIN_TEXT
    assert len(ids) < len(BUILTIN_TEXT) / 2  # merges learned: fewer tokens than half the characters
    meta = tokenizer_metadata(d, 2 * vocab)  # the embedding may have more rows than the tokenizer
    assert meta.pre == "gpt-2" and len(meta.tokens) == 2 * vocab and meta.merges
    assert meta.special_ids["bos"] == tok.convert_tokens_to_ids("[gMASK]")
    assert all(t in tok.get_vocab() for t in SPECIAL_TOKENS)


@pytest.mark.slow
def test_demo_with_exl3(tmp_path):
    out = tmp_path / "demo"
    rep = run_demo(out)
    st = rep["steps"]
    assert list(st) == ["model", "inspect", "plan", "convert_gguf", "convert_exl3", "verify", "eval"]
    ex = st["convert_exl3"]
    assert abs(ex["bits"] - DEMO_EXL3_BPW) <= 0.05 and ex["quantized"] > 0
    assert ex["file_bytes"] == sum(p.stat().st_size for p in (out / f"tiny-exl3-{DEMO_EXL3_BPW}").glob("*.safetensors"))
    assert abs(st["plan"]["exl3_bytes"] - ex["file_bytes"]) / ex["file_bytes"] < 0.01
    assert st["verify"]["problems"] == {"gguf": 0, "exl3": 0}
    cands = {c["name"]: c for c in st["eval"]["candidates"]}
    assert set(cands) == {"tiny-Q8_0.gguf", f"tiny-exl3-{DEMO_EXL3_BPW}"}
    assert cands[f"tiny-exl3-{DEMO_EXL3_BPW}"]["file_bpw"] == ex["file_bpw"]
    # 3 bits are coarser than Q8_0: more divergence, but the same model
    assert cands["tiny-Q8_0.gguf"]["kld_mean"] < cands[f"tiny-exl3-{DEMO_EXL3_BPW}"]["kld_mean"] < 0.5
    assert json.loads((out / "eval.json").read_text())["windows"] == st["eval"]["windows"]
    # a second run reuses the checkpoint and replaces its own outputs
    again = run_demo(out, skip=("convert_exl3", "eval"))
    assert again["steps"]["convert_gguf"]["file_bytes"] == st["convert_gguf"]["file_bytes"]
