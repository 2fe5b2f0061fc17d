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
