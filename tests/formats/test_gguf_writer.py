"""GGUF writer -> gguf-py GGUFReader round trips: KV types, tensor values, shards, temp-name output."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mixq.conversion.gguf.pipeline import convert_gguf
from mixq.errors import InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.gguf_reader import read_gguf, read_gguf_weights, verify_gguf
from mixq.formats.gguf_writer import KV, TensorOut, write_gguf

VT = gguf.GGUFValueType


def _field_type(reader, key):
    f = reader.fields[key]
    return VT(f.types[0]), (VT(f.types[1]) if len(f.types) > 1 else None)


@pytest.fixture(scope="module")
def mini_bf16(mini_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "mini-bf16.gguf"
    summary = convert_gguf(mini_model, out, qtype="BF16", progress=False)
    return out, summary


def test_kv_types_and_values(mini_bf16):
    path, summary = mini_bf16
    assert summary["tensors"] == 151 and summary["types"] == {"BF16": 73, "F32": 78}
    r = gguf.GGUFReader(path)
    p = "glm5-next."
    # exact GGUF value types the loader insists on (gguf-glm5-next.md §1.2/§1.3)
    for key in ("block_count", "expert_count", "leading_dense_block_count", "attention.key_length",
                "rope.dimension_count", "nextn_predict_layers", "attention.indexer.kpool"):
        assert _field_type(r, p + key) == (VT.UINT32, None), key
    for key in ("attention.layer_norm_rms_epsilon", "kda.gate_lower_bound", "expert_weights_scale"):
        assert _field_type(r, p + key) == (VT.FLOAT32, None), key
    assert _field_type(r, p + "expert_weights_norm") == (VT.BOOL, None)
    assert _field_type(r, p + "attention.head_count_kv") == (VT.ARRAY, VT.INT32)
    assert _field_type(r, p + "swiglu_clamp_exp") == (VT.ARRAY, VT.FLOAT32)
    assert _field_type(r, p + "attention.indexer.types") == (VT.ARRAY, VT.BOOL)
    assert _field_type(r, "tokenizer.ggml.bos_token_id") == (VT.UINT32, None)
    assert _field_type(r, "tokenizer.ggml.token_type") == (VT.ARRAY, VT.INT32)
    kv = read_gguf(path).kv
    assert kv["general.architecture"] == "glm5-next"
    assert kv[p + "block_count"] == 5 and kv[p + "attention.head_count_kv"] == [0, 0, 0, 1, 1]
    assert kv[p + "attention.indexer.types"] == [True] * 4  # trunk length, not block_count
    assert kv[p + "swiglu_clamp_shexp"] == [10.0] * 5
    assert kv[p + "attention.key_length"] == 32 and kv[p + "attention.key_length_mla"] == 64
    assert kv[p + "kda.gate_lower_bound"] == -5.0 and kv[p + "expert_weights_scale"] == 2.5
    assert kv[p + "leading_dense_block_count"] == 1 and kv["general.file_type"] == 32
    assert kv["tokenizer.ggml.pre"] == "gpt-2" and len(kv["tokenizer.ggml.tokens"]) == 8192


def test_bf16_roundtrip_values(mini_bf16, mini_model):
    path, _ = mini_bf16
    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    # F32 pins (norms, hc_*, ssm_a/dt, conv, router, indexer.proj/compressor) vs BF16 matmuls
    for n in ("blk.0.hc_attn_fn.weight", "blk.0.ssm_a", "blk.0.ssm_conv1d_q.weight", "blk.1.ffn_gate_inp.weight",
              "blk.3.indexer.proj.weight", "blk.3.indexer_compressor_ape.weight", "blk.1.exp_probs_b.bias"):
        assert types[n] == "F32", n
    assert types["blk.1.ffn_up_exps.weight"] == "BF16" and types["output.weight"] == "BF16"
    ckpt = open_checkpoint(mini_model)
    w = read_gguf_weights(path)
    text = [n for n in ckpt.names() if "visual" not in n]
    assert sorted(w) == sorted(text)
    for n in text:
        ref = ckpt.get(n)
        if n.endswith("A_log"):  # goes through -exp / log in f32
            assert torch.allclose(w[n], ref, rtol=1e-5, atol=1e-6), n
        else:  # BF16 source -> BF16/F32 storage is lossless
            assert torch.equal(w[n], ref), n
    assert verify_gguf(path, mini_model)["ok"]


def test_q8_0_roundtrip_and_verify(mini_model, tmp_path):
    out = tmp_path / "m.gguf"
    s = convert_gguf(mini_model, out, qtype="Q8_0", no_mtp=True, progress=False)
    assert s["tensors"] == 122 and s["types"]["Q8_0"] >= 30
    ckpt = open_checkpoint(mini_model)
    w = read_gguf_weights(out)
    assert not any(".layers.4." in n for n in w)
    n = "model.language_model.layers.2.mlp.experts.3.down_proj.weight"
    ref = ckpt.get(n)
    # Q8_0: per 32-block absmax/127 steps -> error at most half a step (+ f16 rounding of the scale)
    step = ref.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
    assert ((w[n].reshape(-1, 32) - ref.reshape(-1, 32)).abs() <= step * 0.57 + 1e-7).all()
    assert not torch.equal(w[n], ref)
    rep = verify_gguf(out, mini_model)
    assert rep["ok"] and rep["types"]["F32"] > 0
    assert read_gguf(out).kv.get("glm5-next.block_count") == 4


def test_shards_and_split_keys(tmp_path):
    kv = [KV("glm5-next.block_count", "UINT32", 1)]
    rng = np.random.default_rng(0)
    data = {f"blk.0.t{i}.weight": rng.standard_normal((8, 64)).astype(np.float32) for i in range(5)}
    tens = [TensorOut(n, (8, 64), "F32") for n in data]
    files = write_gguf(tmp_path / "x.gguf", kv, tens, lambda t: data[t.name], shard_size=4096, progress=False)  # 2 tensors of 2048 B per shard
    assert [f.name for f in files] == [f"x-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f.name for f in files]  # no temp leftovers
    for i, f in enumerate(files):
        r = gguf.GGUFReader(f)
        assert _field_type(r, "split.no") == (VT.UINT16, None) and r.fields["split.no"].contents() == i
        assert _field_type(r, "split.count") == (VT.UINT16, None) and r.fields["split.count"].contents() == 3
        assert _field_type(r, "split.tensors.count") == (VT.INT32, None)
        assert r.fields["split.tensors.count"].contents() == 5
        assert ("glm5-next.block_count" in r.fields) == (i == 0)
    g = read_gguf(files[0])
    assert len(g.tensors) == 5
    for n, a in data.items():
        assert np.array_equal(g.tensors[n].dequantize(), a)


def test_bad_output_name(tmp_path):
    with pytest.raises(InputError):
        write_gguf(tmp_path / "x.bin", [], [], lambda t: None)


def test_glm53_metadata_from_config(flash_config):
    """KVs for the real GLM-5.3-Flash config match the reference sheet's GLM-5.3 column (gguf-glm5-next.md §1.2)."""
    from mixq.formats.checkpoint import checkpoint_from_config
    from mixq.formats.gguf_writer import glm5next_kv

    kv = {k.key: k.value for k in glm5next_kv(checkpoint_from_config(flash_config))}
    p = "glm5-next."
    want = {"block_count": 46, "embedding_length": 4096, "feed_forward_length": 12288, "attention.head_count": 64,
            "expert_count": 288, "expert_used_count": 8, "vocab_size": 154880, "kda.head_dim": 128,
            "attention.q_lora_rank": 1536, "attention.kv_lora_rank": 512, "attention.key_length": 512,
            "attention.key_length_mla": 256, "attention.value_length_mla": 256, "attention.indexer.head_count": 32,
            "attention.indexer.key_length": 128, "attention.indexer.top_k": 2048, "attention.indexer.kpool": 16,
            "leading_dense_block_count": 3, "expert_feed_forward_length": 2048, "nextn_predict_layers": 1,
            "rope.dimension_count": 0, "hyper_connection.count": 4}
    assert {k: kv[p + k] for k in want} == want
    assert kv[p + "attention.head_count_kv"] == [0, 0, 0, 1] * 11 + [0, 1]
    assert len(kv[p + "attention.indexer.types"]) == 45 and len(kv[p + "swiglu_clamp_exp"]) == 46
    assert kv[p + "kda.gate_lower_bound"] == -5.0 and kv[p + "expert_weights_scale"] == 2.5
