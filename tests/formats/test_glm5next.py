"""The architecture table: every fixture tensor classified, policies as the reference sheets say."""
from __future__ import annotations

import collections

import pytest
from safetensors import safe_open

from mixq.errors import InputError
from mixq.formats.glm5next import (EXL3_POLICIES, GGUF_POLICIES, ROLES, RULES, classify, global_gguf_name,
                                   global_hf_name, gguf_policy, gguf_sources, in_nextn_block, module_sources,
                                   nextn_only_shapes, normalise_layer_type)

L = "model.language_model.layers"


def _fixture_names(path):
    names = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            names += [k for k in s.keys() if not k.endswith("_scale_inv")]
    return names


def test_mini_all_354_tensors_classified(mini_model):
    infos = [classify(n, 4) for n in _fixture_names(mini_model)]
    assert len(infos) == 354
    roles = collections.Counter(i.role for i in infos)
    assert roles == {"attn": 44, "norm": 18, "routed_expert": 192, "router": 8, "shared_expert": 12,
                     "attn_param": 26, "lm_head": 1, "embed": 1, "hc": 24, "dense_mlp": 3, "vision": 25}
    assert {i.name for i in infos if i.mtp} == {n for n in _fixture_names(mini_model) if f"{L}.4." in n}
    assert all(i.layer == 4 for i in infos if i.mtp)
    # the text GGUF has exactly 151 tensors for this model (gguf-glm5-next.md §2.4)
    assert len({g for i in infos for g in i.gguf_names}) == 151


@pytest.mark.parametrize("fixture", ["k256_model", "k256_fp8_model"])
def test_k256_fixtures_classify(fixture, request):
    names = _fixture_names(request.getfixturevalue(fixture))
    assert len(names) == 354
    assert all(classify(n, 4).role in ROLES for n in names)


@pytest.mark.parametrize("name,role,exl3,gguf,gguf_names", [
    (f"{L}.3.self_attn.kv_b_proj.weight", "attn", "fp16", "keep", ("blk.3.attn_k_b.weight", "blk.3.attn_v_b.weight")),
    (f"{L}.3.self_attn.indexer.wk.weight", "attn", "fp16", "keep", ("blk.3.indexer.attn_k.weight",)),
    (f"{L}.3.self_attn.indexer.weights_proj.weight", "attn", "fp16", "f32", ("blk.3.indexer.proj.weight",)),
    (f"{L}.3.self_attn.indexer.wq_b.weight", "attn", "trellis", "keep", ("blk.3.indexer.attn_q_b.weight",)),
    (f"{L}.3.self_attn.q_a_proj.weight", "attn", "trellis", "q8_floor", ("blk.3.attn_q_a.weight",)),
    (f"{L}.0.self_attn.f_b_proj.weight", "attn", "fp16", "keep", ("blk.0.ssm_f_b.weight",)),
    (f"{L}.0.self_attn.b_proj.weight", "attn", "fp16", "keep", ("blk.0.ssm_beta.weight",)),
    (f"{L}.0.self_attn.A_log", "attn_param", "native", "f32", ("blk.0.ssm_a",)),
    (f"{L}.0.self_attn.k_conv1d.weight", "attn_param", "native", "f32", ("blk.0.ssm_conv1d_k.weight",)),
    (f"{L}.1.hc_ffn_fn", "hc", "fp32", "f32", ("blk.1.hc_ffn_fn.weight",)),
    (f"{L}.1.mlp.gate.weight", "router", "fp16", "f32", ("blk.1.ffn_gate_inp.weight",)),
    (f"{L}.1.mlp.gate.e_score_correction_bias", "router", "fp32", "f32", ("blk.1.exp_probs_b.bias",)),
    (f"{L}.2.mlp.experts.11.up_proj.weight", "routed_expert", "trellis", "quant", ("blk.2.ffn_up_exps.weight",)),
    (f"{L}.0.mlp.down_proj.weight", "dense_mlp", "trellis", "quant", ("blk.0.ffn_down.weight",)),
    (f"{L}.4.eh_proj.weight", "attn", "trellis", "q8_floor", ("blk.4.nextn.eh_proj.weight",)),
    (f"{L}.4.shared_head.norm.weight", "norm", "native", "f32", ("blk.4.nextn.shared_head_norm.weight",)),
    ("model.language_model.embed_tokens.weight", "embed", "native", "quant", ("token_embd.weight",)),
    ("lm_head.weight", "lm_head", "trellis", "quant", ("output.weight",)),
    ("model.visual.blocks.0.attn.qkv.weight", "vision", "trellis", "mmproj", ()),
    ("model.visual.patch_embed.proj.weight", "vision", "native", "mmproj", ()),
])
def test_policies_follow_reference(name, role, exl3, gguf, gguf_names):
    i = classify(name, 4)
    assert (i.role, i.exl3, i.gguf, i.gguf_names) == (role, exl3, gguf, gguf_names)
    assert i.source  # every rule cites ../shared/reference


def test_info_fields_and_bits_keys():
    e = classify(f"{L}.4.mlp.experts.7.down_proj.weight", 4)
    assert (e.layer, e.mtp, e.expert, e.exl3_bits_key) == (4, True, 7, "mtp_bits")
    assert classify(f"{L}.2.mlp.experts.7.down_proj.weight", 4).exl3_bits_key == "bits"
    assert classify("lm_head.weight", 4).exl3_bits_key == "head_bits"
    assert classify("lm_head.weight", 4).layer is None
    assert classify(f"{L}.3.self_attn.kv_b_proj.weight", 4).exl3_bits_key is None
    assert classify(f"{L}.1.hc_attn_fn", 4).gguf_source_type == "F32"
    assert not classify(f"{L}.1.hc_attn_fn", 4).gguf_quantizable
    # flat (text-only) naming and the real model's NextN index
    assert classify("model.layers.44.self_attn.o_proj.weight", 45).mtp is False
    assert classify("model.layers.45.eh_proj.weight", 45).mtp is True
    assert all(r.exl3 in EXL3_POLICIES and r.gguf in GGUF_POLICIES and r.role in ROLES for r in RULES)


@pytest.mark.parametrize("name", [
    f"{L}.1.eh_proj.weight",              # NextN-only tensor in a trunk layer
    f"{L}.4.hc_attn_fn",                  # the NextN block has no mHC
    f"{L}.1.self_attn.new_proj.weight",   # a future revision's tensor
    "model.language_model.rotary.inv_freq",
])
def test_unknown_names_raise_naming_the_tensor(name):
    with pytest.raises(InputError, match=name.replace(".", r"\.")):
        classify(name, 4)


def test_layer_type_spellings():
    assert {normalise_layer_type(t) for t in ("deepseek_sparse_attention", "indexed_attention",
                                              "full_attention")} == {"deepseek_sparse_attention"}
    assert normalise_layer_type("linear_attention") == "linear_attention"
    with pytest.raises(InputError, match="sliding"):
        normalise_layer_type("sliding_attention")


def test_fusion_and_module_columns():
    q = classify(f"{L}.0.self_attn.k_proj.weight", 4)
    assert q.exl3_key == f"{L}.0.self_attn.qkv_proj" and q.exl3_group == "layers.0.self_attn.qkv_proj"
    assert q.exl3_members == tuple(f"{L}.0.self_attn.{c}_proj.weight" for c in "qkv")
    c = classify(f"{L}.0.self_attn.v_conv1d.weight", 4)
    assert c.exl3_key == f"{L}.0.self_attn.conv1d.weight" and c.gguf_transforms == ("conv",)
    assert c.module == "self_attn.conv1d.weight"
    assert classify(f"{L}.0.self_attn.A_log", 4).exl3_flat
    assert classify(f"{L}.4.eh_proj.weight", 4).exl3_pad == 1
    e = classify(f"{L}.2.mlp.experts.5.gate_proj.weight", 4)
    assert (e.exl3_group, e.gguf_transforms, e.module) == ("layers.2.experts", ("stack",), "mlp.experts.gate_up_proj")
    assert classify(f"{L}.1.hc_ffn_scale", 4).module == "ffn_hc.scale"
    assert classify(f"{L}.3.self_attn.kv_b_proj.weight", 4).gguf_transforms == ("kv_b_k", "kv_b_v")
    p = classify("model.visual.patch_embed.proj.weight", 4)
    assert p.mmproj_names == ("v.patch_embd.weight", "v.patch_embd.weight.1") and p.mmproj_parts == ("t0", "t1")
    assert classify("model.visual.blocks.3.norm2.bias", 4).mmproj_names == ("v.blk.3.ln2.bias",)


def test_inverse_lookups_invert_classify(mini_model):
    names = _fixture_names(mini_model)
    for n in names:
        i = classify(n, 4)
        for g, tr in zip(i.gguf_names, i.gguf_transforms):
            src = gguf_sources(g, (8,) if tr == "stack" else ())
            assert src is not None and src.transform == tr and gguf_policy(g) == i.gguf
            assert n in src.hf_names or (tr == "stack" and i.expert >= 8)
    assert gguf_sources("blk.0.attn_qkv.weight") is None and gguf_policy("blk.0.attn_qkv.weight") is None
    assert module_sources(1, "mlp.experts.down_proj", 2) == [[f"{L}.1.mlp.experts.{e}.down_proj.weight"] for e in (0, 1)]
    assert module_sources(0, "self_attn.forget_gate.A_log") == [[f"{L}.0.self_attn.A_log"]]
    assert module_sources(0, "self_attn.conv1d.weight") == [[f"{L}.0.self_attn.{c}_conv1d.weight" for c in "qkv"]]
    assert module_sources(0, "self_attn.rotary.inv_freq") is None


def test_nextn_block_names():
    before, after = nextn_only_shapes(64)
    assert before == {"eh_proj.weight": (64, 128), "enorm.weight": (64,), "hnorm.weight": (64,)}
    assert after == {"shared_head.norm.weight": (64,)}
    assert in_nextn_block("mlp.experts.0.up_proj.weight") and not in_nextn_block("hc_attn_fn")
    assert global_hf_name("embed") == "model.language_model.embed_tokens.weight"
    assert (global_gguf_name("embed"), global_gguf_name("lm_head")) == ("token_embd.weight", "output.weight")
