"""Test helper: rewrite a mixq EXL3 directory into the layout exllamav3 1.6.5's converter writes, from the facts in
../shared/reference/exl3-format.md §1 (files, config.json's quantization_config, quantization_config.json with
tensor_storage, shard naming and the index), §1.4 (per-Linear tensors, .mul1 / .mcg markers, 3INST = no
marker), §1.5 (fp16 Linears) and §6.1 (vision qkv stored as separate q/k/v Linears):

- no mixq_manifest.json; config.json and the index written with indent 4, quantization_config without mixq's
  keys; shards `model-0000i-of-0000N.safetensors` written with a plain header (no `__metadata__`, no padding),
  a module's tensors never split across shards;
- the vision attention's fused `qkv` Linear stored as `q_proj` / `k_proj` / `v_proj` with their biases;
- optionally (`unfuse_layer`) one KDA layer stored unfused (q/k/v_proj and q/k/v_conv1d), as an older or other
  writer may lay it out; a Linear re-coded with the MCG marker and one with none (3INST); lm_head stored as an
  fp16 `.weight` (`--head_bits 16`).
Slicing a trellis along its output tiles is exact when the cut falls on a 128-column Hadamard block (the tiny
model's widths are all 128): every part decodes to the matching rows of the fused weight.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file

from mixq.formats.exl3_layout import MCG_MARKER, MCG_MULTIPLIER, MUL1_MULTIPLIER
from mixq.formats.safetensors_io import dtype_tag
from mixq.runtime.dequant import decode_linear

LINEAR_SUFFIXES = (".trellis", ".suh", ".svh", ".mul1", ".mcg", ".bias", ".weight")
SKIP = {"config.json", "quantization_config.json", "mixq_manifest.json", "model.safetensors.index.json"}


def _load_shards(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _module(name: str, tensors: dict) -> str:
    """The exllamav3 module a stored tensor belongs to (a Linear's key, else the tensor itself)."""
    for s in LINEAR_SUFFIXES:
        key = name[: -len(s)]
        if name.endswith(s) and (f"{key}.trellis" in tensors or (s in (".weight", ".bias") and f"{key}.weight" in tensors
                                                                   and tensors[f"{key}.weight"].dim() == 2)):
            return key
    return name


def write_plain_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """8-byte length, minified JSON header (no metadata, not padded), the tensors' bytes back to back."""
    header, blobs, off = {}, [], 0
    for n, t in tensors.items():
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[n] = {"dtype": dtype_tag(t.dtype), "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    js = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(js)) + js + b"".join(blobs))


def _slice_linear(t: dict, key: str, new_keys: list[str]) -> None:
    """Cut Linear `key` into len(new_keys) Linears of equal output width (whole 128-column blocks)."""
    trel, svh = t.pop(f"{key}.trellis"), t.pop(f"{key}.svh")
    suh, marker = t.pop(f"{key}.suh"), t.pop(f"{key}.mul1")
    bias = t.pop(f"{key}.bias", None)
    parts = len(new_keys)
    tiles, n = trel.shape[1] // parts, svh.shape[0] // parts
    assert n % 128 == 0, f"{key}: parts of {n} columns do not fall on Hadamard blocks"
    for j, k in enumerate(new_keys):
        t[f"{k}.trellis"] = trel[:, j * tiles:(j + 1) * tiles].contiguous()
        t[f"{k}.suh"], t[f"{k}.svh"] = suh.clone(), svh[j * n:(j + 1) * n].contiguous()
        t[f"{k}.mul1"] = marker.clone()
        if bias is not None:
            t[f"{k}.bias"] = bias[j * n:(j + 1) * n].contiguous()


def _tensor_storage(t: dict[str, torch.Tensor]) -> dict:
    storage: dict[str, dict] = {}
    for n, x in t.items():
        mod = _module(n, t)
        e = storage.setdefault(mod, {"stored_tensors": {}})
        e["stored_tensors"][n] = {"shape": list(x.shape), "n_bytes": x.numel() * x.element_size(),
                                  "dtype": str(x.dtype)}
        if n == f"{mod}.trellis":
            bits = x.shape[-1] / 16
            e.update(quant_format="exl3", bits_per_weight=int(bits) if bits == int(bits) else bits)
    for mod, e in storage.items():
        if f"{mod}.mul1" in t:
            e["mul1_multiplier"] = MUL1_MULTIPLIER
        if f"{mod}.mcg" in t:
            e["mcg_multiplier"] = MCG_MULTIPLIER
    return storage


def to_exllamav3_layout(src: Path, dst: Path, *, shards: int = 2, unfuse_layer: int | None = 0,
                        mcg_key: str | None = None, plain_key: str | None = None,
                        fp16_head: bool = True) -> Path:
    """Write `dst` (see the module docstring) from the mixq EXL3 directory `src`; returns `dst`."""
    t = _load_shards(src)
    cfg = json.loads((src / "config.json").read_text())
    for key in [n[: -len(".trellis")] for n in t if n.endswith(".attn.qkv.trellis") and "visual" in n]:
        parent = key.rsplit(".", 1)[0]
        _slice_linear(t, key, [f"{parent}.{p}" for p in ("q_proj", "k_proj", "v_proj")])
    if unfuse_layer is not None:
        L = f"model.language_model.layers.{unfuse_layer}.self_attn"
        _slice_linear(t, f"{L}.qkv_proj", [f"{L}.{p}_proj" for p in "qkv"])
        conv = t.pop(f"{L}.conv1d.weight")
        for p, c in zip("qkv", torch.chunk(conv, 3, 0)):
            t[f"{L}.{p}_conv1d.weight"] = c.contiguous()
    if mcg_key:  # the same codes under the MCG codebook: another weight, decoded with MCG
        t.pop(f"{mcg_key}.mul1")
        t[f"{mcg_key}.mcg"] = torch.tensor(MCG_MARKER, dtype=torch.int32)
    if plain_key:  # no marker: 3INST
        t.pop(f"{plain_key}.mul1")
    if fp16_head:
        w = decode_linear({k: v for k, v in t.items() if k.startswith("lm_head.")}, "lm_head")
        for s in (".trellis", ".suh", ".svh", ".mul1"):
            t.pop(f"lm_head{s}")
        vocab, hidden = cfg["text_config"]["vocab_size"], cfg["text_config"]["hidden_size"]
        t["lm_head.weight"] = w[:vocab, :hidden].to(torch.float16).contiguous()

    dst.mkdir(parents=True)
    modules: dict[str, list[str]] = {}
    for n in t:
        modules.setdefault(_module(n, t), []).append(n)
    groups = list(modules.values())
    per = -(-len(groups) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        names = [n for g in groups[i * per:(i + 1) * per] for n in g]
        write_plain_safetensors(dst / fname, {n: t[n] for n in names})
        for n in names:
            weight_map[n] = fname
            total += t[n].numel() * t[n].element_size()
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=4))
    old = cfg["quantization_config"]
    qc = {"quant_method": "exl3", "version": "1.6.5", "bits": old["bits"], "head_bits": 16 if fp16_head else 6,
          "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto", "codebook": "mul1"}
    if "vision_bits" in old:
        qc["vision_bits"] = int(old["vision_bits"])
    if "mtp_bits" in old:
        qc["mtp_bits"] = int(old["mtp_bits"])
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=4))
    (dst / "quantization_config.json").write_text(json.dumps(dict(qc, tensor_storage=_tensor_storage(t)), indent=4))
    for f in src.iterdir():
        if f.is_file() and f.name not in SKIP and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, dst / f.name)
    return dst
