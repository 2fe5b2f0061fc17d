"""The architecture table: every fixture tensor classified, policies as the reference sheets say."""
from __future__ import annotations

import collections

import pytest
from safetensors import safe_open

from mixq.errors import InputError
from mixq.formats.glm5next import EXL3_POLICIES, GGUF_POLICIES, ROLES, RULES, classify, normalise_layer_type

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
