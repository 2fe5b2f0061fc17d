"""EXL3 conversion of a DFlash2 speculative-decoding drafter (`DFlash2DraftModel`, reference §6.3).

exllamav3 flags this architecture `uncalibrated_quantize`: every Linear is quantized without a Hessian, at one
rate (default 6 bpw); the drafter has no embedding and no head of its own. The storage of each tensor comes from
the layout table in `formats/dflash2.py`: Linears -> trellis (fc unpadded), the selector's hidden projection ->
fp16 (out, in) padded to 128 on both sides, norms / conv base kernels / codebooks -> raw in their source dtype
(fp32 -> fp16). Units keep the order of the source files, so a conversion is reproducible byte for byte.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import safetensors  # safetensors.safe_open looked up per call (tests wrap it)
import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from mixq.errors import FormatError, InputError
from mixq.formats.dflash2 import ARCHITECTURE, CODEBOOK_ALIASES, check_tensor, drafter_shapes
from mixq.formats.exl3_names import PAD, Exl3Unit, pad_up, stage_order
from mixq.planning.sizes import parse_size as parse_bytes
from mixq.planning.types import DEFAULT_HEAD_BITS
from mixq.formats.exl3_writer import EXL3_VERSION, Exl3Writer, torch_dtype

from mixq.formats.model_files import check_model_dir, read_json
from mixq.quant.device import pick_device
from mixq.quant.trellis.codebooks import check_bits

from mixq.conversion.exl3.output import ConvertResult, achieved_bits, compile_exl3, quantize_unit
from mixq.conversion.job import Job, rss_peak_mib

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class DrafterSource:
    """A local drafter directory read through `safetensors.safe_open`: config, tensor names in file order,
    shapes, source dtypes, tensors. Unreadable files raise FormatError naming the file."""

    def __init__(self, path: Path) -> None:
        self.path = check_model_dir(path)
        cfg = path / "config.json"
        if not cfg.is_file():
            raise InputError(f"{path}: no config.json (drafters are converted from a local directory)")
        self.config = read_json(cfg, "config.json", FormatError)
        if not isinstance(self.config, dict):
            raise FormatError(f"{cfg}: not a JSON config (not an object)")
        if ARCHITECTURE not in (self.config.get("architectures") or []):
            raise InputError(f"{path}: architectures {self.config.get('architectures')} is not {ARCHITECTURE}")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError(f"{path}: no .safetensors files")
        self._open = safetensors.safe_open
        self._errors = (OSError, ValueError, SafetensorError)
        self.entries: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for f in files:
            try:
                with safetensors.safe_open(str(f), framework="pt") as h:
                    for n in h.offset_keys():
                        sl = h.get_slice(n)
                        if n in self.entries:
                            raise FormatError(f"{f}: tensor {n!r} is also in {self.entries[n][0].name}")
                        self.entries[n] = (f, sl.get_dtype(), tuple(sl.get_shape()))
            except self._errors as e:
                raise FormatError(f"{f}: not a readable safetensors file ({e})") from None

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, n: str) -> tuple[int, ...]:
        return self.entries[n][2]

    def dtype(self, n: str) -> str:
        return _ST_DTYPES.get(self.entries[n][1], "float32")

    def get(self, n: str) -> torch.Tensor:
        f = self.entries[n][0]
        try:
            with self._open(str(f), framework="pt") as h:
                return h.get_tensor(n).float()
        except self._errors as e:
            raise FormatError(f"{f}: cannot read tensor {n!r} ({e})") from None


def drafter_layout(src: DrafterSource) -> list[Exl3Unit]:
    """Output units of a DFlash2 drafter, in source file order. InputError naming a tensor the table does not
    know; FormatError naming a tensor whose shape the config contradicts, or the first missing tensor."""
    units = []
    where = str(src.path / "config.json")
    for n in src.names():
        shape = src.shape(n)
        row = check_tensor(n, shape, src.config, where)
        layer = n.split(".")[1] if n.startswith("layers.") else None
        stage = f"layer.{layer}" if layer is not None else "head"
        if row.exl3.startswith("trellis"):
            pad_to = 1 if row.exl3 == "trellis_unpadded" else PAD
            if pad_to == 1 and (shape[0] % 128 or shape[1] % 128):
                raise FormatError(f"{n}: {shape} must be multiples of 128 (fc is not padded, reference §6.3)")
            units.append(Exl3Unit(n[:-7], "trellis", [n], shape, "drafter", stage, "bits", pad_to=pad_to,
                                  src_shapes=[shape]))
        elif row.exl3 == "fp16_linear":
            units.append(Exl3Unit(n[:-7], "fp16_linear", [n], (pad_up(shape[0]), pad_up(shape[1])), "drafter",
                                  stage, dtype="float16", src_shapes=[shape]))
        else:
            key = CODEBOOK_ALIASES.get(n, n)
            dt = src.dtype(n)
            units.append(Exl3Unit(key, "raw", [n], shape, "drafter", stage,
                                  dtype=dt if dt in ("bfloat16", "float16") else "float16", src_shapes=[shape]))
    present = {CODEBOOK_ALIASES.get(n, n) for n in src.names()}
    missing = [n for n in drafter_shapes(src.config) if n not in present]
    if missing:
        raise FormatError(f"{src.path}: tensor {missing[0]!r} is missing ({len(missing)} missing)")
    return units


def convert_drafter(model, out, *, bits: float = 6.0, device: str | None = None,
                    shard_size: int | str = 8192 * 2**20, resume: bool = False, codebook: str = "mul1",
                    progress: bool = True):
    """Convert a local DFlash2 drafter directory to EXL3 at `bits` (uncalibrated). Returns a ConvertResult."""
    t0 = time.time()
    path = Path(model)
    src = DrafterSource(path)
    config = src.config
    units = drafter_layout(src)
    bits = check_bits(bits, codebook)  # refused before anything is written
    dev = pick_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda requested but CUDA is not available")
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
                                           device=dev, dequantized=False)
            elif u.kind == "fp16_linear":
                wp = torch.zeros(u.shape)
                wp[: w.shape[0], : w.shape[1]] = w
                tensors = {f"{u.key}.weight": wp.half()}
            else:
                tensors = {u.key: w.to(torch_dtype(u.dtype))}
            written.append((u.key, tensors))
        job.record(stage, writer.write_part(stage, written))
    b = achieved_bits(units, bitmap, "bits") or 0.0
    qc = {"quant_method": "exl3", "version": EXL3_VERSION, "bits": b, "head_bits": DEFAULT_HEAD_BITS,
          "calibration": {"rows": 0, "cols": 0}, "out_scales": "auto", "codebook": codebook, "quantizer": "mixq"}
    man = compile_exl3(writer, units, bitmap, stages, config, path, qc, job, [])
    job.cleanup()
    return ConvertResult(out=str(out), bytes=man["total_bytes"], bits=b, head_bits=None, seconds=time.time() - t0,
                         peak_rss_mib=rss_peak_mib(), shards=sorted(man["shards"]), tensors=len(man["tensors"]),
                         quantized=len(bitmap), resumed_stages=resumed, device=dev.type,
                         ref_params=sum(math.prod(e[2]) for e in src.entries.values()))
