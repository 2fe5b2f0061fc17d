"""formats/gguf_names: the glm5-next GGUF tensor list, shapes and transforms."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mixq.formats.gguf_names import build_tensor, gguf_tensors, merge_kv_b, unbuild_tensor


class HeaderCheckpoint:
    """Shapes + data straight from safetensors (keeps this test independent of the loader)."""

    def __init__(self, path: Path):
        self.config = json.loads((path / "config.json").read_text())
        self.text_config = self.config.get("text_config", self.config)
        self.num_hidden_layers = self.text_config["num_hidden_layers"]
        self._where = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    self._where[k] = (f, tuple(h.get_slice(k).get_shape()))

    def names(self):
        return list(self._where)

    def shape(self, n):
        return self._where[n][1]

    def get(self, n, dtype=torch.float32):
        with safe_open(self._where[n][0], "pt") as h:
            return h.get_tensor(n).to(dtype)


@pytest.fixture(scope="module")
def mini(mini_model):
    return HeaderCheckpoint(mini_model)


def test_mini_tensor_count_and_shapes(mini):
    specs = gguf_tensors(mini)
    by = {s.name: s for s in specs}
    # upstream converter output on the fixture: 151 tensors, 29 of them NextN (gguf-glm5-next.md §2.4)
    assert len(specs) == 151 and sum(s.mtp for s in specs) == 29
    assert len(gguf_tensors(mini, include_mtp=False)) == 122
    assert not any("visual" in h for s in specs for h in s.hf_names)
    # numpy shapes = loader ne reversed
    assert by["blk.3.attn_k_b.weight"].shape == (2, 32, 64)
    assert by["blk.3.attn_v_b.weight"].shape == (2, 64, 32)
    assert by["blk.1.ffn_down_exps.weight"].shape == (16, 128, 64)
    assert by["blk.1.ffn_gate_exps.weight"].shape == (16, 64, 128)
    assert by["blk.0.ssm_conv1d_q.weight"].shape == (1, 128, 1, 4)
    assert by["blk.0.ssm_a"].shape == (2,)
    assert by["blk.3.indexer_compressor_ape.weight"].shape == (4, 32)
    assert by["blk.4.nextn.eh_proj.weight"].shape == (128, 256)
    assert by["blk.1.exp_probs_b.bias"].hf_names == ["model.language_model.layers.1.mlp.gate.e_score_correction_bias"]
    assert by["output.weight"].role == "lm_head" and by["blk.1.ffn_up_exps.weight"].role == "routed_expert"
    assert by["blk.0.hc_attn_fn.weight"].policy == "f32" and by["blk.3.attn_q_a.weight"].policy == "q8_floor"
    assert by["blk.2.ffn_up_exps.weight"].hf_names[5].endswith("layers.2.mlp.experts.5.up_proj.weight")
    assert names_sorted_first_last(specs) == ("token_embd.weight", "output_norm.weight")


def names_sorted_first_last(specs):
    return specs[0].name, specs[-1].name


def test_transforms_roundtrip(mini):
    by = {s.name: s for s in gguf_tensors(mini)}
    kv = mini.get("model.language_model.layers.3.self_attn.kv_b_proj.weight")
    k = build_tensor(by["blk.3.attn_k_b.weight"], mini.get)
    v = build_tensor(by["blk.3.attn_v_b.weight"], mini.get)
    # per head: rows 0..n-1 are K_nope (transposed in k_b), rows n.. are V
    assert torch.equal(k[1], kv[128:192].T) and torch.equal(v[1], kv[192:256])
    parts = {**unbuild_tensor(by["blk.3.attn_k_b.weight"], k), **unbuild_tensor(by["blk.3.attn_v_b.weight"], v)}
    assert torch.equal(merge_kv_b(parts)["model.language_model.layers.3.self_attn.kv_b_proj.weight"], kv)
    a_log = mini.get("model.language_model.layers.0.self_attn.A_log")
    ssm_a = build_tensor(by["blk.0.ssm_a"], mini.get)
    assert torch.allclose(ssm_a, -torch.exp(a_log)) and (ssm_a < 0).all()
    back = unbuild_tensor(by["blk.0.ssm_a"], ssm_a)["model.language_model.layers.0.self_attn.A_log"]
    assert torch.allclose(back, a_log, atol=1e-6)
    exps = build_tensor(by["blk.2.ffn_down_exps.weight"], mini.get)
    assert torch.equal(exps[7], mini.get("model.language_model.layers.2.mlp.experts.7.down_proj.weight"))
    conv = build_tensor(by["blk.0.ssm_conv1d_v.weight"], mini.get)
    assert torch.equal(conv.flatten(), mini.get("model.language_model.layers.0.self_attn.v_conv1d.weight").flatten())


def test_glm53_shapes_from_config(flash_config):
    ckmod = pytest.importorskip("mixq.formats.checkpoint")
    if not hasattr(ckmod, "checkpoint_from_config"):
        pytest.skip("checkpoint_from_config not available yet")
    ckpt = ckmod.checkpoint_from_config(flash_config)
    by = {s.name: s for s in gguf_tensors(ckpt)}
    # loader ne from gguf-glm5-next.md §2.2 (GLM-5.3 column), reversed to numpy order
    assert by["blk.3.attn_k_b.weight"].shape == (64, 512, 256)
    assert by["blk.3.attn_v_b.weight"].shape == (64, 256, 512)
    assert by["blk.5.ffn_down_exps.weight"].shape == (288, 4096, 2048)
    assert by["blk.0.ssm_a"].shape == (64,)
    assert by["blk.0.ssm_conv1d_k.weight"].shape == (1, 8192, 1, 4)
    assert by["blk.45.nextn.eh_proj.weight"].shape == (4096, 8192)
    assert by["token_embd.weight"].shape == (154880, 4096)
    assert by["blk.3.indexer_compressor_ape.weight"].shape == (16, 128)
    assert not any(s.layer == 45 for s in gguf_tensors(ckpt, include_mtp=False))


def test_unbuild_conv_accepts_3d_and_4d_layouts():
    """llama-quantize may store ssm_conv1d as 3-D (c, 1, k) where mixq writes (1, c, 1, k): both read back."""
    import torch

    from mixq.formats.gguf_reader import spec_from_gguf
    from mixq.formats.gguf_names import unbuild_tensor

    w = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 1, 4)
    for shape in [(1, 12, 1, 4), (12, 1, 4)]:
        spec = spec_from_gguf("blk.0.ssm_conv1d_q.weight", shape)
        (name, back), = unbuild_tensor(spec, w.reshape(shape)).items()
        assert name.endswith("layers.0.self_attn.q_conv1d.weight")
        assert torch.equal(back, w)
