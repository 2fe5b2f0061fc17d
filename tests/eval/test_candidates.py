"""Candidate detection, sizes on disk, and the checks before weights enter the reference model."""
from __future__ import annotations

import json

import pytest

from mixq.errors import FormatError, InputError
from mixq.eval.candidates import check_against_reference, detect_format, gguf_split_paths, open_candidate, weight_bytes


def test_detect_formats(tmp_path, mini_model):
    assert detect_format(mini_model) == "hf"
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 16)
    assert detect_format(g) == "gguf"
    e = tmp_path / "exl3"
    e.mkdir()
    (e / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl3", "bits": 4.0}}))
    (e / "model.safetensors").write_bytes(b"")
    assert detect_format(e) == "exl3"
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"PK\x03\x04")
    with pytest.raises(InputError, match="not a GGUF"):
        detect_format(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no \\*.safetensors"):
        detect_format(empty)
    with pytest.raises(InputError, match="no such"):
        detect_format(tmp_path / "nope")


def test_sizes(tmp_path, mini_model):
    expected = sum(p.stat().st_size for p in mini_model.glob("*.safetensors"))
    assert open_candidate(mini_model).bytes == expected
    parts = [tmp_path / f"q-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, p in enumerate(parts):
        p.write_bytes(b"GGUF" + b"\x00" * (10 * (i + 1)))
    assert gguf_split_paths(parts[1]) == parts
    assert weight_bytes(parts[0], "gguf") == 14 + 24 + 34
    parts[2].unlink()
    with pytest.raises(InputError, match="shard missing"):
        weight_bytes(parts[0], "gguf")


def test_checks_against_reference():
    ref = {
        "model.language_model.layers.0.mlp.down_proj.weight": (4, 8),
        "model.language_model.layers.4.eh_proj.weight": (2, 2),  # NextN (n_layers = 4)
        "model.visual.blocks.0.attn.qkv.weight": (3, 3),
    }
    cand = {"model.language_model.layers.0.mlp.down_proj.weight": (4, 8)}
    check_against_reference(cand, ref, 4, "c")  # vision / NextN may be left out
    check_against_reference(dict(ref), ref, 4, "c")
    with pytest.raises(FormatError, match="c: tensor .*down_proj.* has shape \\(8, 4\\), reference \\(4, 8\\)"):
        check_against_reference({"model.language_model.layers.0.mlp.down_proj.weight": (8, 4)}, ref, 4, "c")
    with pytest.raises(FormatError, match="c: 1 reference tensors missing, e.g. .*down_proj"):
        check_against_reference({}, ref, 4, "c")
    with pytest.raises(FormatError, match="not in the reference, e.g. model.bogus"):
        check_against_reference({**cand, "model.bogus": (1,)}, ref, 4, "c")
