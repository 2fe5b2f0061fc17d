"""What both EXL3 converters share (the glm5_next pipeline and the DFlash2 drafter): trellis-quantize Linear units
into their stored tensors, the achieved rate of a budget key, compiling the output directory, and the result record.
"""
from __future__ import annotations

from pathlib import Path

import torch

import mixq.quant.trellis  # looked up per call: tests swap in a fake mixq.quant.trellis
from mixq.formats.exl3_names import Exl3Unit
from mixq.formats.exl3_writer import Exl3Writer, exl3_config, tensor_storage_entry
from mixq.runtime.overlap import host_stack, to_device, to_host

from mixq.conversion.job import Job
from mixq.conversion.result import ConvertResult  # noqa: F401  (one result type for EXL3 and GGUF)


def achieved_bits(units: list[Exl3Unit], bits: dict[str, float], key: str = "bits") -> float | None:
    """Σ rate·numel / Σ numel over the trellis units of one budget key (padded numel, as exllamav3 reports)."""
    num = den = 0
    for u in units:
        if u.kind == "trellis" and u.bits_key == key:
            k, n = u.padded
            num += bits[u.key] * k * n
            den += k * n
    return round(num / den, 2) if den else None


def _stored(u: Exl3Unit, q) -> dict[str, torch.Tensor]:
    t = q.tensors()
    stored = {f"{u.key}.trellis": t["trellis"].to(torch.int16).cpu().contiguous(),
              f"{u.key}.suh": t["suh"].to(torch.float16).cpu().contiguous(),
              f"{u.key}.svh": t["svh"].to(torch.float16).cpu().contiguous()}
    for marker in ("mul1", "mcg"):
        if marker in t:
            stored[f"{u.key}.{marker}"] = t[marker].to(torch.int32).cpu().reshape(())
    return stored


def quantize_unit(u: Exl3Unit, w: torch.Tensor, bits: float, hessian: torch.Tensor | None, *, seed: int,
                  codebook: str, device: torch.device,
                  dequantized: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Trellis-quantize one Linear unit (HF (out, in) weight; the quantizer pads to 128).
    Returns ({stored tensor: tensor}, dequantized weight (out, in) float32 on the CPU, or None without
    `dequantized`)."""
    (stored, deq), = quantize_batch([u], [w], bits, [hessian], seed=seed, codebook=codebook, device=device,
                                    dequantized=dequantized)
    return stored, deq


def quantize_batch(units: list[Exl3Unit], ws: list[torch.Tensor] | torch.Tensor, bits: float,
                   hessians: list[torch.Tensor | None], *, seed: int, codebook: str,
                   device: torch.device,
                   dequantized: bool = True) -> list[tuple[dict[str, torch.Tensor], torch.Tensor | None]]:
    """Quantize same-shape units at one rate in one stacked call (MoE experts), with per-unit Hessians
    (all given or all None); `ws` the units' weights, or already stacked (`runtime.overlap.host_stack`).
    Encoder-speed device only: every unit is still stored as its own Linear. Each unit's dequantized weight
    (float32 on the host) comes back with it when `dequantized` (the next layer is calibrated on it), else None."""
    w = to_device(ws if isinstance(ws, torch.Tensor) else host_stack(ws, device), device)
    h = None
    if hessians[0] is not None:
        h = torch.stack([x.float() for x in hessians]).to(device)
    qs = mixq.quant.trellis.quantize(w if len(ws) > 1 else w[0], bits,
                                     hessian=h if (h is None or len(ws) > 1) else h[0], codebook=codebook, seed=seed)
    qs = qs if isinstance(qs, list) else [qs]
    return [(_stored(u, q), to_host(q.dequantize().float()) if dequantized else None) for u, q in zip(units, qs)]


def compile_exl3(writer: Exl3Writer, units: list[Exl3Unit], bits: dict[str, float], stages: list[str],
                 source_config: dict, source_dir: Path, qc: dict, job: Job, fallbacks: list[str]) -> dict:
    """config.json, quantization_config.json (tensor_storage), manifest (units, expected tensors), shards."""
    config = exl3_config(source_config, qc)
    storage: dict[str, dict] = {}
    for u in units:
        mod = u.key if u.kind != "raw" else (u.key.rsplit(".", 1)[0] if u.key.endswith((".weight", ".bias"))
                                             else u.key)
        entry = tensor_storage_entry(u.tensor_specs(bits.get(u.key)), bits.get(u.key))
        if mod in storage:
            storage[mod]["stored_tensors"].update(entry["stored_tensors"])
        else:
            storage[mod] = entry
    manifest = {
        "format": "exl3", "writer": "mixq", "fingerprint": job.fp,
        "units": [dict(key=u.key, kind=u.kind, hf_names=u.hf_names, shape=list(u.shape), role=u.role,
                       stage=u.stage, bits_key=u.bits_key, dtype=u.dtype, bias=u.bias, pad_to=u.pad_to,
                       split=u.split, src_shapes=[list(s) for s in u.src_shapes], bits=bits.get(u.key))
                  for u in units],
        "expected": {n: {"shape": list(s), "dtype": d} for u in units
                     for n, (s, d) in u.tensor_specs(bits.get(u.key)).items()},
        "fallbacks": fallbacks,
    }
    return writer.finalize(stages, source_dir=source_dir, config=config, tensor_storage=storage, manifest=manifest)
