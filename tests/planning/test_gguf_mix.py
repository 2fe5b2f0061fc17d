"""planning/gguf_mix.py: llama-quantize's per-tensor choices (gguf-facts.md §4, gguf-glm5-next.md §3.3-3.4)."""
from __future__ import annotations

import math

import pytest

from mixq.errors import PlanError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.glm5next import gguf_policy
from mixq.formats.gguf_names import gguf_tensors
from mixq.planning import gguf_mix as gm


def _specs(path):
    ck = open_checkpoint(path)
    specs = gguf_tensors(ck)
    ctx = gm.MixContext(n_layer_all=ck.num_hidden_layers + len(ck.nextn_layers),
                        n_expert=int(ck.text_config["n_routed_experts"]), n_gqa=0, policy=gguf_policy)
    rows = [(s.name, s.shape, "F32" if s.policy == "f32" else "BF16") for s in specs]
    return rows, ctx


def test_q4_k_m_on_mini_matches_llama_quantize_report(mini_model):
    # gguf-glm5-next.md §3.4: "42 of 151 tensor(s) required fallback", Q4_K->Q5_0, the Q6_K bumps (blk.2/blk.4
    # ffn_down, blk.2 attn_v) -> Q8_0, output Q8_0, q_a/q_b/eh_proj Q8_0 (floor), 7.50 BPW
    rows, ctx = _specs(mini_model)
    stats: dict = {}
    types = dict(zip([r[0] for r in rows], gm.mix_types(rows, "Q4_K_M", ctx, stats=stats)))
    assert len(rows) == 151 and stats["n_fallback"] == 42
    assert types["token_embd.weight"] == "Q5_0" and types["output.weight"] == "Q8_0"
    assert types["blk.2.attn_v.weight"] == "Q8_0" and types["blk.1.attn_v.weight"] == "Q5_0"
    for b in (2, 4):
        assert types[f"blk.{b}.ffn_down_exps.weight"] == "Q8_0" == types[f"blk.{b}.ffn_down_shexp.weight"]
    assert types["blk.0.ffn_down.weight"] == "Q5_0" and types["blk.3.ffn_down_exps.weight"] == "Q5_0"
    assert types["blk.3.attn_q_a.weight"] == types["blk.4.attn_q_b.weight"] == "Q8_0"
    assert types["blk.4.nextn.eh_proj.weight"] == "Q8_0"
    assert types["blk.3.attn_k_b.weight"] == "BF16" and types["blk.0.ssm_f_a.weight"] == "BF16"
    assert types["blk.0.hc_attn_fn.weight"] == "F32" and types["blk.1.ffn_gate_inp.weight"] == "F32"
    data = sum(gm.tensor_nbytes(types[n], s) for n, s, _ in rows)
    params = sum(math.prod(s) for _, s, _ in rows)
    assert data * 8 / params == pytest.approx(7.50, abs=0.005)


def test_q4_k_m_on_k256_keeps_k_quants(k256_model):
    rows, ctx = _specs(k256_model)
    types = dict(zip([r[0] for r in rows], gm.mix_types(rows, "Q4_K_M", ctx)))
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(3)] == ["Q4_K", "Q4_K", "Q6_K"]
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(1, 5)] == ["Q4_K", "Q6_K", "Q4_K", "Q6_K"]
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_up_exps.weight"] == "Q4_K"
    assert types["blk.3.attn_q_a.weight"] == "Q8_0" and types["blk.3.indexer.attn_q_b.weight"] == "BF16"


def _flash_names():
    rows = [("token_embd.weight", (154880, 4096), "BF16"), ("output.weight", (154880, 4096), "BF16")]
    for i in range(46):
        kda = i < 45 and i % 4 != 3
        if kda:
            rows.append((f"blk.{i}.attn_v.weight", (8192, 4096), "BF16"))
        else:
            rows.append((f"blk.{i}.attn_q_b.weight", (16384, 1536), "BF16"))
        if i < 3:
            rows.append((f"blk.{i}.ffn_down.weight", (4096, 12288), "BF16"))
        else:
            rows.append((f"blk.{i}.ffn_down_exps.weight", (288, 4096, 2048), "BF16"))
            rows.append((f"blk.{i}.ffn_gate_exps.weight", (288, 2048, 4096), "BF16"))
    return rows


def test_flash_use_more_bits_layers_and_mixes():
    rows = _flash_names()
    ctx = gm.MixContext(n_layer_all=46, n_expert=288, policy=gguf_policy)
    t = dict(zip([r[0] for r in rows], gm.mix_types(rows, "Q4_K", ctx)))  # alias of Q4_K_M
    bumped = {i for i in range(46) if t.get(f"blk.{i}.ffn_down_exps.weight", t.get(f"blk.{i}.ffn_down.weight"))
              == "Q6_K"}
    # gguf-facts.md §4.3: layers 0-4, 7, 10, ..., 37 and 40-45 get the bump (n = 46)
    assert bumped == set(range(5)) | set(range(7, 38, 3)) | set(range(40, 46))
    assert t["blk.5.ffn_gate_exps.weight"] == "Q4_K" and t["blk.3.attn_q_b.weight"] == "Q8_0"
    q2 = dict(zip([r[0] for r in rows], gm.mix_types(rows, "Q2_K", ctx)))
    assert q2["blk.0.attn_v.weight"] == "Q3_K" and q2["blk.9.ffn_down_exps.weight"] == "Q3_K"
    assert q2["blk.9.ffn_gate_exps.weight"] == "Q2_K" and q2["output.weight"] == "Q6_K"
    q3 = dict(zip([r[0] for r in rows], gm.mix_types(rows, "Q3_K_M", ctx)))
    assert [q3[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2, 4)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert q3["blk.1.ffn_down.weight"] == "Q5_K" and q3["blk.3.ffn_down_exps.weight"] == "Q4_K"
    q8 = gm.mix_types(rows, "Q8_0", ctx)
    assert set(q8) == {"Q8_0"}


def test_tensor_type_override_skips_mix_and_floor_but_not_fallback():
    rows = _flash_names() + [("blk.50.ffn_up_exps.weight", (16, 64, 128), "BF16")]
    ctx = gm.MixContext(n_layer_all=51, n_expert=288, policy=gguf_policy)
    t = dict(zip([r[0] for r in rows], gm.mix_types(rows, "Q4_K_M", ctx, tensor_types=[
        (r"attn_q_b", "Q4_K"), (r"ffn_.*_exps", "Q2_K"), (r"ffn_down", "Q5_K")])))
    assert t["blk.3.attn_q_b.weight"] == "Q4_K"        # the Q8_0 floor is bypassed by a manual type
    assert t["blk.4.ffn_down_exps.weight"] == "Q2_K"   # first matching pattern wins
    assert t["blk.0.ffn_down.weight"] == "Q5_K"
    assert t["blk.50.ffn_up_exps.weight"] == "Q4_0"    # Q2_K on 128-wide rows still falls back


def test_fallback_chain_and_sizes():
    assert [gm.fallback(t, 384) for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")] == \
        ["Q4_0", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q8_0"]
    assert gm.fallback("Q4_K", 100) == "F16"
    assert gm.tensor_nbytes("Q4_K", (288, 2048, 4096)) == 288 * 2048 * 16 * 144
    assert gm.tensor_nbytes("Q8_0", (64, 128)) == 64 * 4 * 34
    assert gm.ladder(128) == ["Q4_0", "Q5_0", "Q5_1", "Q8_0"]
    assert gm.ladder(4096, kind="iq")[:3] == ["IQ2_XXS", "IQ2_XS", "IQ2_S"]
    with pytest.raises(PlanError):
        gm.normalize_mix("Q4_K_XL")
    assert not gm.allows_quantization("blk.0.ssm_a", (64,))
    assert not gm.allows_quantization("blk.0.ssm_conv1d_q.weight", (1, 8192, 1, 4))
    assert gm.allows_quantization("blk.3.ffn_up_exps.weight", (288, 2048, 4096))
    # the architecture's exclusion list and Q8_0 floor come from the table's GGUF policies
    assert not gm.allows_quantization("blk.3.attn_k_b.weight", (4, 256, 64), gguf_policy("blk.3.attn_k_b.weight"))
    assert not gm.allows_quantization("blk.0.hc_attn_fn.weight", (24, 4096), gguf_policy("blk.0.hc_attn_fn.weight"))
    assert gm.allows_quantization("blk.3.attn_k_b.weight", (4, 256, 64))  # no architecture policy given
    rows = [("blk.3.attn_q_a.weight", (1536, 4096), "BF16"), ("blk.3.indexer.attn_q_b.weight", (4096, 1536), "BF16")]
    assert gm.mix_types(rows, "Q2_K", gm.MixContext(4, 8, policy=gguf_policy)) == ["Q8_0", "BF16"]
    assert gm.mix_types(rows, "Q2_K", gm.MixContext(4, 8)) == ["Q2_K", "Q2_K"]


def test_file_size_counts_header_and_alignment():
    tensors = [("a.weight", (3, 32), "Q8_0"), ("b", (5,), "F32")]
    total, head = gm.gguf_file_bytes(tensors, kv_bytes=100)
    assert head == 224 and head % 32 == 0  # 24 + 100 + (8+8+4+16+4+8) + (8+1+4+8+4+8) = 205 -> 224
    assert total == head + 128 + 32  # 102 -> 128, 20 -> 32


def test_every_llama_quantize_name_is_a_mix_with_its_file_type():
    # V:tools/quantize/quantize.cpp QUANT_OPTIONS (less Q1_0, Q2_0, TQ*, MXFP4_MOE, COPY and the float types);
    # ids: llama.h's llama_ftype
    ids = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
           "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19,
           "IQ2_XS": 20, "Q2_K_S": 21, "IQ3_XS": 22, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26,
           "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29, "IQ4_XS": 30, "IQ1_M": 31}
    assert {n: m.file_type for n, m in gm.MIXES.items()} == ids
    assert gm.normalize_mix("iq2_xxs") == "IQ2_XXS" and gm.normalize_mix("q4_k") == "Q4_K_M"
    assert gm.MIX_DEFAULT["IQ2_S"] == "IQ2_XS" and gm.MIX_DEFAULT["IQ2_M"] == "IQ2_S"
    assert gm.MIX_DEFAULT["IQ3_XS"] == gm.MIX_DEFAULT["IQ3_M"] == "IQ3_S"


def test_low_bit_mixes_count_ffn_down_tensors_not_layers():
    # V:src/llama-quant.cpp: in the IQ1/IQ2 mixes the first n_layer_all/8 ffn_down tensors in loader order
    # (46 // 8 = 5: blk.0-2 dense ffn_down, then blk.3's exps, ...) take Q2_K (IQ3_S for IQ2_S / IQ2_M); attn_v-like
    # tensors take Q4_K with more than 4 experts; output Q5_K; token_embd Q2_K / IQ3_S
    rows = _flash_names()
    ctx = gm.MixContext(n_layer_all=46, n_expert=288, policy=gguf_policy)
    t = dict(zip([r[0] for r in rows], gm.mix_types(rows, "IQ2_XXS", ctx, imatrix=True)))
    downs = [n for n, _, _ in rows if "ffn_down" in n]
    assert [t[n] for n in downs[:6]] == ["Q2_K"] * 5 + ["IQ2_XXS"]
    assert downs[3] == "blk.3.ffn_down_exps.weight" and t["blk.45.ffn_down_exps.weight"] == "IQ2_XXS"
    assert t["blk.0.attn_v.weight"] == "Q4_K" and t["output.weight"] == "Q5_K" and t["token_embd.weight"] == "Q2_K"
    assert t["blk.5.ffn_gate_exps.weight"] == "IQ2_XXS" and t["blk.3.attn_q_b.weight"] == "Q8_0"
    m = dict(zip([r[0] for r in rows], gm.mix_types(rows, "IQ2_M", ctx, imatrix=True)))
    assert m["blk.4.ffn_down_exps.weight"] == "IQ3_S" and m["blk.9.ffn_down_exps.weight"] == "IQ2_S"
    assert m["token_embd.weight"] == "IQ3_S"


def test_imatrix_changes_the_mixes_that_read_it():
    rows = _flash_names()
    ctx = gm.MixContext(n_layer_all=46, n_expert=288, policy=gguf_policy)
    names = [r[0] for r in rows]
    for mix, without, with_ in (("IQ4_XS", "Q5_K", "IQ4_XS"), ("Q4_0", "Q4_0", "Q4_1"), ("Q5_0", "Q5_0", "Q5_1"),
                                ("IQ3_XXS", "Q4_K", "IQ3_XXS")):
        a = dict(zip(names, gm.mix_types(rows, mix, ctx, imatrix=False)))
        b = dict(zip(names, gm.mix_types(rows, mix, ctx, imatrix=True)))
        assert (a["blk.0.ffn_down.weight"], b["blk.0.ffn_down.weight"]) == (without, with_), mix
        assert a["blk.20.ffn_down_exps.weight"] == b["blk.20.ffn_down_exps.weight"] != "Q5_K" or mix == "IQ3_XXS"
    x = dict(zip(names, gm.mix_types(rows, "IQ3_XXS", ctx)))
    assert x["blk.0.attn_v.weight"] == "IQ3_S" and x["blk.20.ffn_down_exps.weight"] == "Q3_K"
    assert gm.requires_imatrix("Q2_K", "blk.0.ffn_up.weight", "Q2_K_S")
    assert not gm.requires_imatrix("Q2_K", "blk.0.ffn_up.weight", "Q2_K")
    assert not gm.requires_imatrix("Q2_K", "token_embd.weight", "Q2_K_S")
    assert gm.requires_imatrix("IQ2_XXS", "token_embd.weight")  # ggml's own encoder asserts it
