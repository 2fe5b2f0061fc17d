"""Tiny random glm5_next checkpoints built through transformers (tests, `mixq demo`).

The model is ``Glm5NextForConditionalGeneration`` from transformers with a small config; its state dict is
turned back into checkpoint names by transformers' own reverse weight conversion, the NextN block is added
(copied from the last trunk layer when that layer is DSA + MoE, like ../shared/models/glm5next-mini), and the
files are written the way GLM ships them (optionally FP8 e4m3 with 128x128 ``_scale_inv`` blocks, optionally
sharded with an index). By default every matmul width is 128 and there are 2 routed experts.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from mixq.errors import InputError
from mixq.formats.atomic import atomic_dir
from mixq.formats.checkpoint import nextn_shapes
from mixq.formats.glm5next import is_vision

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
# Weights GLM's FP8 release stores in e4m3 (../shared/README.md, glm5next-k256-fp8); KDA o_proj stays BF16.
_FP8_ATTN = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.q_a_proj.",
             "self_attn.q_b_proj.", "self_attn.kv_a_proj_with_mqa.")


def default_tokenizer_dir() -> Path | None:
    """The trained fixtures' 8k tokenizer (../shared/models/glm5next-mini) when present."""
    roots = [os.environ.get("MIXQ_SHARED"), Path(__file__).resolve().parent.parent.parent / "shared"]
    for r in roots:
        if r and (Path(r) / "models" / "glm5next-mini" / "tokenizer.json").is_file():
            return Path(r) / "models" / "glm5next-mini"
    return None


def tiny_config(*, hidden: int = 128, layer_types: Sequence[str], n_experts: int, top_k: int,
                dense_layers: int, nextn: bool, vocab: int, vision_hidden: int = 128) -> dict:
    """A glm5_next config.json dict (nested text/vision) with all matmul widths = ``hidden``."""
    n = len(layer_types)
    heads, hd = 2, hidden // 2
    lt = ["linear_attention" if t == "linear_attention" else "deepseek_sparse_attention" for t in layer_types]
    text = {
        "model_type": "glm5_next_text", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": hidden, "moe_intermediate_size": hidden, "num_hidden_layers": n,
        "num_attention_heads": heads, "num_key_value_heads": heads, "n_shared_experts": 1,
        "n_routed_experts": n_experts, "num_experts_per_tok": top_k, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "q_lora_rank": hidden, "kv_lora_rank": hidden, "qk_rope_head_dim": 0, "qk_nope_head_dim": hd,
        "v_head_dim": hd, "head_dim": 0, "index_topk": 64, "index_head_dim": hd, "index_n_heads": heads,
        "index_kpool": 4, "index_kpool_always_select_tail": True, "indexer_types": ["full"] * n,
        "layer_types": lt, "mlp_layer_types": ["dense"] * dense_layers + ["sparse"] * (n - dense_layers),
        "linear_head_dim": hd, "linear_num_heads": heads, "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "pad_token_id": 0, "eos_token_id": 0,
        "bos_token_id": None, "tie_word_embeddings": False, "hidden_act": "silu", "swiglu_limit": 10.0,
        "initializer_range": 0.02, "num_nextn_predict_layers": 1 if nextn else 0,
        # keys real GLM-5.3-Flash files carry besides transformers' own
        "linear_attn_config": {"num_heads": heads, "head_dim": hd, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "safe_gate": True},
        "mla_use_nope": True, "first_k_dense_replace": dense_layers, "mhc": True,
    }
    vision = {
        "model_type": "glm5_next_vision", "depth": 1, "hidden_size": vision_hidden, "num_heads": 2,
        "intermediate_size": vision_hidden, "out_hidden_size": hidden, "projection_intermediate_size": hidden,
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "image_size": 336,
        "in_channels": 3, "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": True,
    }
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "dtype": "bfloat16",
            "tie_word_embeddings": False, "text_config": text, "vision_config": vision}


def fp8_quantize_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 weight, float32 scale_inv per block x block tile) with W ~= fp8 * scale_inv."""
    r, c = w.shape
    br, bc = -(-r // block), -(-c // block)
    x = torch.zeros(br * block, bc * block, dtype=torch.float32, device=w.device)
    x[:r, :c] = w.float()
    tiles = x.view(br, block, bc, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = (amax / FP8_MAX).float()
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(br * block, bc * block)[:r, :c].contiguous(), scale


def is_fp8_target(name: str, shape: tuple[int, ...], dsa_layers: set[int]) -> bool:
    """Whether GLM's FP8 release stores checkpoint tensor ``name`` in e4m3 (``dsa_layers``: the MLA layers,
    the NextN block among them)."""
    if len(shape) != 2 or min(shape) < FP8_BLOCK or not name.endswith(".weight") or is_vision(name):
        return False
    if ".mlp." in name and ".mlp.gate." not in name:
        return True  # routed / shared experts and dense MLP
    if any(k in name for k in _FP8_ATTN):
        return True
    if "self_attn.o_proj." in name:  # MLA o_proj is FP8, KDA o_proj stays BF16
        return int(name.split("layers.")[1].split(".")[0]) in dsa_layers
    return False


def _nextn_tensors(sd: dict[str, torch.Tensor], n: int, hidden: int, gen: torch.Generator,
                   config: dict) -> dict[str, torch.Tensor]:
    """NextN block at layers.{n}: body copied from the last trunk layer when it is DSA + MoE (else random)."""
    text = config["text_config"]
    shapes = nextn_shapes(config, text, text["layer_types"])
    src, dst = f"layers.{n - 1}.", f"layers.{n}."
    out = {}
    for name, shape in shapes.items():
        twin = name.replace(dst, src)
        if twin in sd and tuple(sd[twin].shape) == shape:
            out[name] = sd[twin].clone()
        elif len(shape) == 1 and name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.02
    return out


def write_tiny_checkpoint(
    out_dir: str | os.PathLike,
    *,
    hidden: int = 128,
    layer_types: Sequence[str] = ("linear_attention", "linear_attention", "linear_attention",
                                  "deepseek_sparse_attention"),
    n_experts: int = 2,
    top_k: int | None = None,
    dense_layers: int = 1,
    nextn: bool = True,
    vision: bool = True,
    fp8: bool = False,
    shards: int = 1,
    seed: int = 0,
    vocab: int = 8192,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a random glm5_next checkpoint to ``out_dir`` (created; must not hold files) and return its path.

    ``top_k`` defaults to max(1, n_experts // 2). ``fp8`` stores the GLM FP8 set in e4m3 with 128x128
    ``_scale_inv`` blocks (needs widths >= 128). ``shards`` > 1 writes ``model-0000i-of-0000k.safetensors`` plus
    ``model.safetensors.index.json`` (the NextN block in the last shard)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out}: output directory exists and is not empty")
    if fp8 and hidden < FP8_BLOCK:
        raise InputError(f"fp8 tiny checkpoints need hidden >= {FP8_BLOCK} (got {hidden})")
    if not 1 <= dense_layers < len(layer_types) + 1:
        raise InputError(f"dense_layers must be in 1..{len(layer_types)}")
    top_k = top_k or max(1, n_experts // 2)
    config = tiny_config(hidden=hidden, layer_types=layer_types, n_experts=n_experts, top_k=top_k,
                         dense_layers=dense_layers, nextn=nextn, vocab=vocab)
    n = len(layer_types)

    torch.manual_seed(seed)
    tcfg = json.loads(json.dumps(config))
    tcfg["text_config"]["layer_types"] = [
        "indexed_attention" if t != "linear_attention" else t for t in config["text_config"]["layer_types"]]
    model = transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig(**tcfg))
    with torch.no_grad():
        sd = {k: v.detach().to(torch.bfloat16).contiguous()
              for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    del model
    if not vision:
        sd = {k: v for k, v in sd.items() if not is_vision(k)}
    gen = torch.Generator().manual_seed(seed + 1)
    mtp: dict[str, torch.Tensor] = {}
    if nextn:
        mtp = {k: v.to(torch.bfloat16) for k, v in _nextn_tensors(sd, n, hidden, gen, config).items()}

    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        dsa = {i for i, t in enumerate(layer_types) if t != "linear_attention"} | {n}
        for part in (sd, mtp):
            for name in [k for k in part if is_fp8_target(k, tuple(part[k].shape), dsa)]:
                q, s = fp8_quantize_blocks(part[name])
                part[name], part[name + "_scale_inv"] = q, s

    with atomic_dir(out) as tmp:
        _write_files(tmp, sd, mtp, shards, save_file)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"_from_model_config": True, "eos_token_id": 0, "pad_token_id": 0}, indent=2) + "\n")
        tok = Path(tokenizer_dir) if tokenizer_dir else default_tokenizer_dir()
        if tok is not None:
            for f in _TOKENIZER_FILES:
                if (tok / f).is_file():
                    shutil.copyfile(tok / f, tmp / f)
    return out


def _write_files(tmp: Path, sd: dict, mtp: dict, shards: int, save_file) -> None:
    meta = {"format": "pt"}
    if shards <= 1:
        save_file({**sd, **mtp}, str(tmp / "model.safetensors"), metadata=meta)
        return
    names = list(sd)
    per = -(-len(names) // shards)
    groups = [names[i * per:(i + 1) * per] for i in range(shards)]
    groups[-1] = groups[-1] + list(mtp)
    both = {**sd, **mtp}
    weight_map, total = {}, 0
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: both[k] for k in g}, str(tmp / fname), metadata=meta)
        for k in g:
            weight_map[k] = fname
            total += both[k].numel() * both[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
