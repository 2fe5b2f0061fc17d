"""GLM-5.3-Flash at its real widths, a few layers deep: every pipeline stage timed, then projected to 321B.

The slice keeps every width of the release (hidden 4096, vocab 154880, q_lora 1536, kv_lora 512, 64 heads x 256,
KDA 64 heads x 128, DSA indexer 32 x 128, mHC 4, dense intermediate 12288, experts 2048 wide, the vision tower) and
cuts depth and experts: layers [KDA+dense, KDA+MoE, KDA+MoE, DSA+MoE] with E routed experts (default 32; the
release has 288) plus the shared expert. Weights are transformers' own initialisation (std 0.02, FLA gate init)
with outlier input channels (0.5% of the columns of every matrix x8), written as sharded BF16 safetensors like the
release, and an FP8 block-scaled copy (GLM's FP8 set, 128x128 scale_inv).

Stages (each a separate process, so peak host memory is per stage; timings and peaks into one JSON):
  build     write the slice (BF16 + FP8)
  load      read every tensor through mixq's checkpoint reader (BF16 and FP8)
  exl3      `mixq convert --format exl3 --bpw 3.05` (calibration with every expert, trellis, write), then verify
  eval      `mixq eval` of that EXL3 against the BF16 slice (16 windows x 4096 tokens, past the DSA dense prefix)
  gguf      imatrix, `--type Q4_K_M --imatrix`, and the 108 GB plan's i-quant types (`--gguf-ladder iq`)
  exllamav3 exllamav3's own convert.py on the same slice at the same bpw (wall time)
  project   each stage scaled to the release: 45 layers (3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE), 288 experts

    python bench/glm53_slice.py --work DIR --json OUT.json --stages build,load,exl3,eval  [--experts 32]
    python bench/glm53_slice.py --work DIR --json OUT.json --stages gguf,exllamav3,project
    python bench/glm53_slice.py --work DIR --json OUT.json --small --device cpu     # the same code on a toy
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED  # noqa: E402

SHAPE_CONFIG = SHARED / "models" / "glm-5.3-flash-shape" / "config.json"
LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "deepseek_sparse_attention")
MLP_TYPES = ("dense", "sparse", "sparse", "sparse")
SHARD_BYTES = 4 << 30
OUTLIER_FRACTION, OUTLIER_GAIN = 0.005, 8.0


# --- the slice -------------------------------------------------------------------------------------------------

def slice_config(shape: dict, experts: int, small: bool = False) -> dict:
    """The release config cut to LAYER_TYPES and ``experts`` routed experts (``small``: toy widths for CPU tests)."""
    cfg = copy.deepcopy(shape)
    t = cfg["text_config"]
    n = len(LAYER_TYPES)
    t.update(num_hidden_layers=n, layer_types=list(LAYER_TYPES), mlp_layer_types=list(MLP_TYPES),
             indexer_types=["full"] * n, first_k_dense_replace=MLP_TYPES.count("dense"), n_routed_experts=experts,
             num_experts_per_tok=min(int(t["num_experts_per_tok"]), experts), num_nextn_predict_layers=0)
    if small:
        t.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, q_lora_rank=256,
                 kv_lora_rank=256, num_attention_heads=2, num_key_value_heads=2, qk_head_dim=128,
                 qk_nope_head_dim=128, v_head_dim=128, linear_num_heads=2, linear_head_dim=128, index_n_heads=2,
                 index_head_dim=128, index_topk=64, index_kpool=4, vocab_size=8192, pad_token_id=0)
        t["linear_attn_config"] = dict(t["linear_attn_config"], num_heads=2, head_dim=128)
        cfg["vision_config"].update(depth=1, hidden_size=128, intermediate_size=256, num_heads=2,
                                    out_hidden_size=256, projection_intermediate_size=256)
        for k in ("image_end_token_id", "image_start_token_id", "image_token_id", "video_end_token_id",
                  "video_start_token_id", "video_token_id"):
            cfg.pop(k, None)
    cfg["dtype"] = "bfloat16"
    return cfg


def _add_outliers(sd: dict, seed: int) -> None:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, w in sd.items():
        if w.dim() != 2 or not name.endswith(".weight") or "embed_tokens" in name or min(w.shape) < 64:
            continue
        k = max(1, int(w.shape[1] * OUTLIER_FRACTION))
        cols = torch.randperm(w.shape[1], generator=gen)[:k].to(w.device)
        w[:, cols] *= OUTLIER_GAIN


def _save_shards(sd: dict, out: Path, *, fp8: bool) -> int:
    """Write ``sd`` (checkpoint names -> tensors on any device) as release-style shards plus an index."""
    import torch
    from safetensors.torch import save_file

    from mixq.formats.tiny import _is_fp8_target, fp8_quantize_blocks

    dsa = {i for i, t in enumerate(LAYER_TYPES) if t != "linear_attention"}
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(sd, key=_file_order):
        parts = {name: sd[name]}
        if fp8 and _is_fp8_target(name, tuple(sd[name].shape), dsa):
            q, s = fp8_quantize_blocks(sd[name])
            parts = {name: q, name + "_scale_inv": s}
        nb = sum(v.numel() * (4 if k.endswith("_scale_inv") else v.element_size() if v.dtype == torch.float8_e4m3fn
                              else 2) for k, v in parts.items())
        if size and size + nb > SHARD_BYTES:
            shards.append({})
            size = 0
        for k, v in parts.items():
            keep = k.endswith("_scale_inv") or v.dtype == torch.float8_e4m3fn  # scales f32, weights e4m3
            shards[-1][k] = v.to("cpu", v.dtype if keep else torch.bfloat16).contiguous()
        size += nb
    weight_map, total = {}, 0
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(out / fname), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _file_order(name: str):
    if ".layers." in name and "visual." not in name:
        rest = name.split(".layers.")[1]
        return (1, int(rest.split(".")[0]), name)
    return (0 if "embed" in name else 2, 0, name)


def build(work: Path, experts: int, *, small: bool, device: str, seed: int = 0) -> dict:
    """Write the BF16 slice to work/bf16 and the FP8 copy to work/fp8; returns sizes and seconds."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from mixq.formats.tiny import default_tokenizer_dir

    shape = json.loads(SHAPE_CONFIG.read_text())
    cfg = slice_config(shape, experts, small)
    tcfg = copy.deepcopy(cfg)
    tcfg["text_config"]["layer_types"] = ["indexed_attention" if k != "linear_attention" else k
                                          for k in cfg["text_config"]["layer_types"]]
    t0 = time.time()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig(**tcfg))
    with torch.no_grad():
        sd = {k: v.detach() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
        _add_outliers(sd, seed)
    params = sum(v.numel() for v in sd.values())
    t_init = time.time() - t0
    res = {"experts": experts, "params": params, "init_seconds": round(t_init, 1)}
    tok = default_tokenizer_dir()
    for kind in ("bf16", "fp8"):
        out = work / kind
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        t1 = time.time()
        c = copy.deepcopy(cfg)
        if kind == "fp8":
            c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
        with torch.no_grad():
            res[f"{kind}_bytes"] = _save_shards(sd, out, fp8=kind == "fp8")
        (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
        if tok is not None:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (tok / f).is_file():
                    shutil.copyfile(tok / f, out / f)
        res[f"{kind}_write_seconds"] = round(time.time() - t1, 1)
    del model, sd
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="directory for the slice and every output")
    ap.add_argument("--json", type=Path, required=True, help="results (updated after every stage)")
    ap.add_argument("--stages", default="build,load,exl3,eval,gguf,exllamav3,project")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="toy widths (CPU test of the script)")
    ap.add_argument("--device", default=None, help="cuda|cpu [default: cuda when present]")
    a = ap.parse_args()
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.work.mkdir(parents=True, exist_ok=True)
    res = json.loads(a.json.read_text()) if a.json.is_file() else {}
    res.setdefault("stages", {})
    for stage in [s for s in a.stages.split(",") if s]:
        t = time.time()
        if stage == "build":
            out = build(a.work, a.experts, small=a.small, device=device)
        else:
            raise SystemExit(f"unknown stage {stage}")
        out["seconds"] = round(time.time() - t, 1)
        res["stages"][stage] = out
        a.json.write_text(json.dumps(res, indent=2) + "\n")
        print(stage, json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
