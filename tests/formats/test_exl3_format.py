"""EXL3 layout (key conventions), the directory writer (shards, index, config, side files) and the raw reader."""
from __future__ import annotations

import hashlib
import json
import shutil
from collections import namedtuple

import pytest
import torch

from mixq.errors import InputError
from mixq.formats.exl3_names import exl3_layout, hf_names_of_key, stage_order
from mixq.formats.exl3_writer import Exl3Writer, check_free_space, exl3_config
from mixq.formats.safetensors_io import load_tensor, read_header, write_safetensors


def test_layout_conventions_on_the_trained_fixture(mini_model):
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(mini_model)
    units = exl3_layout(ck)
    by_key = {u.key: u for u in units}
    p = "model.language_model.layers"
    qkv = by_key[f"{p}.0.self_attn.qkv_proj"]
    assert qkv.kind == "trellis" and qkv.shape == (384, 128) and qkv.split == [128, 128, 128]
    assert qkv.hf_names == [f"{p}.0.self_attn.{c}_proj.weight" for c in "qkv"]
    conv = by_key[f"{p}.0.self_attn.conv1d.weight"]
    assert conv.kind == "raw" and conv.shape == (384, 1, 4) and conv.dtype == "bfloat16"
    assert by_key[f"{p}.0.self_attn.A_log"].shape == (2,)
    assert by_key[f"{p}.3.self_attn.kv_b_proj"].kind == "fp16_linear"
    assert by_key[f"{p}.3.self_attn.indexer.wk"].kind == "fp16_linear"
    assert by_key[f"{p}.3.self_attn.indexer.weights_proj"].kind == "fp16_linear"
    assert by_key[f"{p}.3.mlp.gate"].kind == "fp16_linear"
    assert by_key[f"{p}.3.hc_attn_fn"].dtype == "float32"
    assert by_key[f"{p}.3.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert by_key[f"{p}.3.self_attn.indexer.index_kpool_compress_ape"].dtype == "float32"
    exp = by_key[f"{p}.2.mlp.experts.7.down_proj"]
    assert exp.kind == "trellis" and exp.padded == (128, 128)  # in 64 -> padded to 128
    eh = by_key[f"{p}.4.eh_proj"]
    assert eh.pad_to == 1 and eh.bits_key == "mtp_bits" and eh.stage == "mtp.4"
    assert by_key["lm_head"].bits_key == "head_bits"
    assert all(u.kind == "raw" for u in units if u.stage == "vision")  # source precision by default
    assert stage_order(units) == ["embed", "layer.0", "layer.1", "layer.2", "layer.3", "head", "mtp.4", "vision"]
    # every source tensor is stored by exactly one unit
    covered = [n for u in units for n in u.hf_names] + [u.bias for u in units if u.bias]
    assert sorted(covered) == sorted(ck.names())
    assert set(hf_names_of_key(units)) == set(ck.names())
    with_vision = exl3_layout(ck, vision_bits=6)
    qv = {u.key: u for u in with_vision}["model.visual.blocks.0.attn.qkv"]
    assert qv.kind == "trellis" and qv.bias == "model.visual.blocks.0.attn.qkv.bias"
    assert "trellis" in {u.kind for u in with_vision if u.stage == "vision"}
    spec = qkv.tensor_specs(2.5)
    assert spec[f"{qkv.key}.trellis"] == ((8, 24, 40), "int16")
    assert spec[f"{qkv.key}.suh"] == ((128,), "float16") and spec[f"{qkv.key}.svh"] == ((384,), "float16")
    assert spec[f"{qkv.key}.mul1"] == ((), "int32")


def test_split_back_inverts_assemble(mini_model):
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(mini_model)
    for u in exl3_layout(ck):
        if len(u.hf_names) > 1 or u.key.endswith("A_log"):
            back = u.split_back(u.assemble(ck.get))
            for n in u.hf_names:
                assert torch.equal(back[n], ck.get(n)), n


def _part(w: Exl3Writer, stage: str, n_units: int, width: int) -> None:
    g = torch.Generator().manual_seed(hash(stage) % 1000)
    units = [(f"{stage}.u{i}", {f"{stage}.u{i}.a": torch.randn(width, generator=g).half(),
                                f"{stage}.u{i}.b": torch.arange(width, dtype=torch.int16)})
             for i in range(n_units)]
    w.write_part(stage, units)


def test_writer_shards_index_config_and_side_files(tmp_path, mini_model):
    out = tmp_path / "out"
    w = Exl3Writer(out, tmp_path / "work", shard_size=9000)
    for st in ("layer.0", "layer.1", "head"):
        _part(w, st, 3, 1000)  # each unit: 4000 data bytes, so two units per 9000-byte shard
    src_cfg = json.loads((mini_model / "config.json").read_text())
    src_cfg["text_config"]["layer_types"][3] = "indexed_attention"
    src_cfg["quantization_config"] = {"quant_method": "fp8"}
    cfg = exl3_config(src_cfg, {"quant_method": "exl3", "bits": 4.0})
    assert cfg["text_config"]["layer_types"][3] == "deepseek_sparse_attention"
    assert cfg["quantization_config"]["original_quantization_config"] == {"quant_method": "fp8"}
    assert cfg["tie_word_embeddings"] is False
    man = w.finalize(["layer.0", "layer.1", "head"], source_dir=mini_model, config=cfg,
                     tensor_storage={"x": {}}, manifest={"format": "exl3"})
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    for n in names:
        assert (out / n).stat().st_size <= 9000
        assert man["shards"][n]["bytes"] == (out / n).stat().st_size
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(idx["weight_map"]) == 18 and idx["metadata"]["total_size"] == 9 * 4000
    # a unit's tensors share a shard
    assert idx["weight_map"]["layer.1.u2.a"] == idx["weight_map"]["layer.1.u2.b"]
    for side in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                 "generation_config.json"):
        assert (out / side).read_bytes() == (mini_model / side).read_bytes()
    assert json.loads((out / "quantization_config.json").read_text())["tensor_storage"] == {"x": {}}
    assert not list(out.glob("*.tmp"))
    # readable by the safetensors library itself, values intact
    from safetensors import safe_open

    shard = idx["weight_map"]["head.u0.a"]
    with safe_open(str(out / shard), "pt") as f:
        a = f.get_tensor("head.u0.a")
    assert torch.equal(a, load_tensor(tmp_path / "work" / "parts" / "head.safetensors", "head.u0.a"))
    with pytest.raises(RuntimeError):
        w.write_part("late", [])


def test_single_shard_has_no_index_and_write_is_atomic(tmp_path):
    out = tmp_path / "o"
    w = Exl3Writer(out, tmp_path / "w", shard_size=1 << 30)
    _part(w, "layer.0", 2, 10)
    w.finalize(["layer.0"], source_dir=None, config={"quantization_config": {"quant_method": "exl3"}},
               tensor_storage={}, manifest={})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "mixq_manifest.json", "model.safetensors",
                                                     "quantization_config.json"]
    p = tmp_path / "x.safetensors"
    sha = write_safetensors(p, {"s": torch.tensor(-2082680531, dtype=torch.int32)}, metadata={"k": "v"})
    _, hdr = read_header(p)
    assert hdr["s"] == {"dtype": "I32", "shape": []} and hdr["__metadata__"] == {"k": "v"}
    assert load_tensor(p, "s").item() == -2082680531 and sha == hashlib.sha256(p.read_bytes()).hexdigest()
    assert not (tmp_path / "x.safetensors.tmp").exists()


def test_disk_space_check(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(InputError, match="not enough disk space"):
        check_free_space(tmp_path, 5000)
    check_free_space(tmp_path, 500)
