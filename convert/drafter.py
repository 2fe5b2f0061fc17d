"""EXL3 conversion of a DFlash2 speculative-decoding drafter (`DFlash2DraftModel`, reference §6.3).

exllamav3 flags this architecture `uncalibrated_quantize`: every Linear is quantized without a Hessian, at one
rate (default 6 bpw); the drafter has no embedding and no head of its own. Storage per tensor:
  fc, layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.mlp.{gate,up,down}_proj,
  layers.{i}.{attention,mlp}_conv.kernel_projection                  -> trellis (fc is pad_to=1)
  candidate_selector.hidden_projection                               -> fp16 (out, in), both dims padded to 128
  norms, base_kernel, candidate_selector.{predecessor,successor}_codebook -> raw, source dtype (fp32 -> fp16)
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.exl3_names import PAD, Exl3Unit, pad_up, stage_order
from mixq.formats.exl3_writer import EXL3_VERSION, Exl3Writer, load_tensor, read_header

from .job import Job, rss_peak_mib, sleep_hook

_TRELLIS = re.compile(r"(?:fc|layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj"
                      r"|(?:attention|mlp)_conv\.kernel_projection))\.weight")
_FP16_LINEAR = re.compile(r"candidate_selector\.hidden_projection\.weight")
_RAW = re.compile(r"(?:hidden_norm\.weight|norm\.weight|layers\.\d+\.(?:input_layernorm|post_attention_layernorm"
                  r"|self_attn\.[qk]_norm)\.weight|layers\.\d+\.(?:attention|mlp)_conv\.base_kernel"
                  r"|candidate_selector\.(?:predecessor|successor)_codebook(?:\.weight)?)")
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class _Source:
    """Minimal lazy reader of a drafter's safetensors files (names, shapes, dtypes, tensors)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, tuple[Path, int, dict]] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError(f"{path}: no .safetensors files")
        for f in files:
            start, header = read_header(f)
            for n, e in header.items():
                if n != "__metadata__":
                    self.entries[n] = (f, start, header)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, n: str) -> tuple[int, ...]:
        f, _, h = self.entries[n]
        return tuple(h[n]["shape"])

    def dtype(self, n: str) -> str:
        f, _, h = self.entries[n]
        return _ST_DTYPES.get(h[n]["dtype"], "float32")

    def get(self, n: str) -> torch.Tensor:
        f, start, h = self.entries[n]
        return load_tensor(f, n, start, h).float()


def drafter_layout(src: _Source) -> list[Exl3Unit]:
    """Output units of a DFlash2 drafter; InputError naming any tensor the table does not know."""
    units = []
    for n in src.names():
        shape = src.shape(n)
        m = re.match(r"layers\.(\d+)\.", n)
        stage = f"layer.{m.group(1)}" if m else "head"
        if _TRELLIS.fullmatch(n):
            pad_to = 1 if n == "fc.weight" else PAD
            if pad_to == 1 and (shape[0] % 128 or shape[1] % 128):
                raise FormatError(f"{n}: {shape} must be multiples of 128 (fc is not padded, reference §6.3)")
            units.append(Exl3Unit(n[:-7], "trellis", [n], shape, "drafter", stage, "bits", pad_to=pad_to,
                                  src_shapes=[shape]))
        elif _FP16_LINEAR.fullmatch(n):
            units.append(Exl3Unit(n[:-7], "fp16_linear", [n], (pad_up(shape[0]), pad_up(shape[1])), "drafter",
                                  stage, dtype="float16", src_shapes=[shape]))
        elif _RAW.fullmatch(n):
            key = n[:-7] if n.startswith("candidate_selector.") and n.endswith(".weight") else n
            dt = src.dtype(n)
            units.append(Exl3Unit(key, "raw", [n], shape, "drafter", stage,
                                  dtype=dt if dt in ("bfloat16", "float16") else "float16", src_shapes=[shape]))
        else:
            raise InputError(f"tensor {n!r}: unknown DFlash2 drafter tensor name")
    return units


def convert_drafter(model, out, *, bits: float = 6.0, device: str | None = None,
                    shard_size: int | str = 8192 * 2**20, resume: bool = False, codebook: str = "mul1",
                    progress: bool = True):
    """Convert a local DFlash2 drafter directory to EXL3 at `bits` (uncalibrated). Returns a ConvertResult."""
    from tqdm.auto import tqdm

    from mixq.quant.device import pick_device
    from mixq.quant.allocator import parse_size as parse_bytes

    from .exl3_output import ConvertResult, achieved_bits, compile_exl3, quantize_unit

    t0 = time.time()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no config.json (drafters are converted from a local directory)")
    import json

    config = json.loads((path / "config.json").read_text())
    if "DFlash2DraftModel" not in (config.get("architectures") or []):
        raise InputError(f"{path}: architectures {config.get('architectures')} is not DFlash2DraftModel")
    src = _Source(path)
    units = drafter_layout(src)
    dev = pick_device(device)
    bitmap = {u.key: float(bits) for u in units if u.kind == "trellis"}
    settings = {"mixq_dflash2": 1, "model": str(path.resolve()), "bits": float(bits), "codebook": codebook,
                "device": dev.type, "files": sorted((p.name, p.stat().st_size) for p in path.glob("*.safetensors")),
                "shard_size": parse_bytes(shard_size)}
    out = Path(out)
    job = Job.open(out, settings, resume=resume)
    resumed = len(job.done)
    writer = Exl3Writer(out, job.dir, shard_size=parse_bytes(shard_size))
    stages = stage_order(units)
    seeds = {u.key: i for i, u in enumerate(units)}
    for stage in tqdm(stages, desc="dflash2", disable=not progress, unit="stage"):
        if job.is_done(stage):
            continue
        written = []
        for u in (u for u in units if u.stage == stage):
            w = src.get(u.hf_names[0])
            if u.kind == "trellis":
                tensors, _ = quantize_unit(u, w, bitmap[u.key], None, seed=seeds[u.key], codebook=codebook,
                                           device=dev)
            elif u.kind == "fp16_linear":
                wp = torch.zeros(u.shape)
                wp[: w.shape[0], : w.shape[1]] = w
                tensors = {f"{u.key}.weight": wp.half()}
            else:
                from mixq.formats.exl3_writer import torch_dtype

                tensors = {u.key: w.to(torch_dtype(u.dtype))}
            written.append((u.key, tensors))
        job.record(stage, writer.write_part(stage, written))
        sleep_hook()
    b = achieved_bits(units, bitmap, "bits") or 0.0
    qc = {"quant_method": "exl3", "version": EXL3_VERSION, "bits": b, "head_bits": 6,
          "calibration": {"rows": 0, "cols": 0}, "out_scales": "auto", "codebook": codebook, "quantizer": "mixq"}
    man = compile_exl3(writer, units, bitmap, stages, config, path, qc, job, [])
    job.cleanup()
    return ConvertResult(out=str(out), bytes=man["total_bytes"], bits=b, head_bits=None, seconds=time.time() - t0,
                         peak_rss_mib=rss_peak_mib(), shards=sorted(man["shards"]), tensors=len(man["tensors"]),
                         quantized=len(bitmap), resumed_stages=resumed, device=dev.type)
