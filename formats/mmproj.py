"""The vision projector GGUF (mmproj) of a glm5_next checkpoint, as llama.cpp's mtmd loader reads it
(`general.architecture = clip`, `clip.projector_type = glm5v`). Facts: ../shared/reference/gguf-glm5-next.md §4,
checked against the vendored loader (tools/mtmd/clip.cpp, clip-impl.h key and tensor names).

Matrices are F16 (default) or Q8_0 (when the row length allows), conv kernels F16, biases and norms F32.
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from gguf import Keys

from mixq.errors import InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.gguf_layout import ggml_type
from mixq.formats.gguf_writer import KV, TensorOut, write_gguf
from mixq.formats.model_files import read_json

CV = Keys.ClipVision

def mmproj_tensors(ckpt) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(mmproj name, HF name, numpy shape, part) for every vision tensor, names from the architecture table;
    part "t0" / "t1" selects a temporal slice of the Conv3d patch kernel (two 2-D kernels), "all" the whole."""
    out = []
    for name in ckpt.names():
        info = ckpt.info(name)
        if info.role != "vision":
            continue
        if not info.mmproj_names:
            raise InputError(f"{name}: vision tensor with no mmproj mapping")
        shape = tuple(ckpt.shape(name))
        if any(info.mmproj_parts):
            if len(shape) != 5 or shape[2] != len(info.mmproj_parts):
                raise InputError(f"{name}: expected a Conv3d kernel with temporal size {len(info.mmproj_parts)}, "
                                 f"got {shape}")
            sub = (shape[0], shape[1], shape[3], shape[4])
            out += [(g, name, sub, part) for g, part in zip(info.mmproj_names, info.mmproj_parts)]
        else:
            out += [(g, name, shape, "all") for g in info.mmproj_names]
    if not out:
        raise InputError(f"{ckpt.path}: checkpoint has no vision tower (model.visual.*)")
    return out


def _storage(gname: str, shape: tuple[int, ...], outtype: str) -> str:
    if len(shape) == 1 or gname.endswith(".bias") or "norm" in gname or ".ln" in gname:
        return "F32"
    if len(shape) != 2:
        return "F16"  # conv kernels (patch embedding, patch merger)
    if outtype == "Q8_0" and shape[-1] % 32 == 0:
        return "Q8_0"
    return "F16"


def check_mmproj(ckpt, outtype: str = "F16", what: str = "--mmproj") -> None:
    """Everything the projector file is made from, checked before any output is written (it is written after the
    model GGUF): a vision tower, its tensors' mmproj mapping and shapes, the vision_config keys and the image
    processor settings. InputError naming `what` when the checkpoint has no vision tower."""
    if not ckpt.vision_names():
        raise InputError(f"{what}: {ckpt.path} has no vision tower (model.visual.*) to write a projector from")
    mmproj_tensors(ckpt)
    mmproj_kv(ckpt, ckpt.path, outtype)


def _count(d: dict, key: str, where: str, default: int | None = None) -> int:
    """d[key] as a whole number >= 1 (InputError naming `where` and the key when it is missing or not one)."""
    v = d.get(key, default)
    if v is None:
        raise InputError(f"{where} has no {key!r} (the mmproj file needs it)")
    try:
        n = None if isinstance(v, (bool, list, dict)) else int(v)
    except (TypeError, ValueError, OverflowError):
        n = None
    if n is None or isinstance(v, float) and n != v or n < 1:
        raise InputError(f"{where}: {key} is {v!r}, expected a whole number >= 1")
    return n


def _real(d: dict, key: str, where: str, default: float) -> float:
    """d[key] (or `default`) as a finite float, else InputError naming `where` and the key."""
    v = d.get(key, default)
    try:
        x = float(v)
    except (TypeError, ValueError):
        x = None
    if isinstance(v, bool) or x is None or not math.isfinite(x):
        raise InputError(f"{where}: {key} is {v!r}, expected a finite number")
    return x


def _reals(d: dict, key: str, where: str, default: list[float]) -> list[float]:
    """d[key] (or `default`) as a non-empty list of finite floats, else InputError naming `where` and the key."""
    v = d.get(key, default)
    if not isinstance(v, (list, tuple)) or not v:
        raise InputError(f"{where}: {key} is {v!r}, expected a list of numbers")
    return [_real({key: x}, key, where, 0.0) for x in v]


def _processor_config(model_dir: Path) -> tuple[dict, str]:
    """The image processor settings (preprocessor_config.json, else processor_config.json) and the file they come
    from; empty settings when neither file exists. A file that is not a JSON object is an InputError naming it."""
    for fname in ("preprocessor_config.json", "processor_config.json"):
        f = model_dir / fname
        if f.is_file():
            d = read_json(f, fname)
            pp = d.get("image_processor", d) if isinstance(d, dict) else d
            if not isinstance(pp, dict):
                raise InputError(f"{f}: expected a JSON object of image processor settings, got "
                                 f"{type(pp).__name__}")
            return pp, str(f)
    return {}, str(model_dir / "preprocessor_config.json")


def mmproj_kv(ckpt, model_dir: Path, ftype: str) -> list[KV]:
    """clip.* keys the glm5v loader reads (types as clip.cpp's get_u32/get_f32/get_bool/get_arr_f32 expect). A
    missing or malformed vision_config key or processor setting is an InputError naming the file and the key."""
    vc = ckpt.config.get("vision_config")
    if not vc:
        raise InputError(f"{model_dir}: config.json has no vision_config")
    where = f"{Path(model_dir) / 'config.json'}: vision_config"
    if not isinstance(vc, dict):
        raise InputError(f"{where} is {type(vc).__name__}, expected an object")
    pp, pp_file = _processor_config(Path(model_dir))
    patch, merge = _count(vc, "patch_size", where), _count(vc, "spatial_merge_size", where, 2)
    kv = [
        KV(Keys.General.TYPE, "STRING", "mmproj"), KV(Keys.General.NAME, "STRING", Path(model_dir).name),
        KV(Keys.General.FILE_TYPE, "UINT32", 1 if ftype == "F16" else 7),
        KV(Keys.Clip.PROJECTOR_TYPE, "STRING", "glm5v"),
        KV(Keys.Clip.HAS_VISION_ENCODER, "BOOL", True),
        KV(CV.USE_SILU, "BOOL", vc.get("hidden_act", "silu") == "silu"),
        KV(CV.PROJECTION_DIM, "UINT32", _count(vc, "out_hidden_size", where)),
        KV(CV.IMAGE_SIZE, "UINT32", _count(vc, "image_size", where)),
        KV(CV.PATCH_SIZE, "UINT32", patch),
        KV(CV.EMBEDDING_LENGTH, "UINT32", _count(vc, "hidden_size", where)),
        KV(CV.FEED_FORWARD_LENGTH, "UINT32", _count(vc, "intermediate_size", where)),
        KV(CV.BLOCK_COUNT, "UINT32", _count(vc, "depth", where)),
        KV(CV.Attention.HEAD_COUNT, "UINT32", _count(vc, "num_heads", where)),
        KV(CV.SPATIAL_MERGE_SIZE, "UINT32", merge),
        KV(CV.Attention.LAYERNORM_EPS, "FLOAT32", _real(vc, "rms_norm_eps", where, 1e-5)),
        KV("clip.vision.swiglu_clamp", "FLOAT32", _real(vc, "swiglu_limit", where, 0.0)),  # not named by gguf-py 0.19
        KV(CV.IMAGE_MEAN, "ARRAY", _reals(pp, "image_mean", pp_file, [0.48145466, 0.4578275, 0.40821073]),
           "FLOAT32"),
        KV(CV.IMAGE_STD, "ARRAY", _reals(pp, "image_std", pp_file, [0.26862954, 0.26130258, 0.27577711]),
           "FLOAT32"),
    ]
    # the loader takes pixel limits; processors give token limits: one token = (patch * merge)^2 pixels
    px = (patch * merge) ** 2
    if "min_image_tokens" in pp:
        kv.append(KV(CV.IMAGE_MIN_PIXELS, "UINT32", _count(pp, "min_image_tokens", pp_file) * px))
    if "max_image_tokens" in pp:
        kv.append(KV(CV.IMAGE_MAX_PIXELS, "UINT32", _count(pp, "max_image_tokens", pp_file) * px))
    return kv


def write_mmproj(model, out, outtype: str = "F16", progress: bool = True, overwrite: bool = False) -> dict:
    """Write the vision tower of `model` as a glm5v mmproj GGUF at `out` (F16 default, or Q8_0)."""
    outtype = outtype.upper()
    if outtype not in ("F16", "Q8_0"):
        raise InputError(f"mmproj type must be F16 or Q8_0, not {outtype}")
    ckpt = open_checkpoint(model)
    rows = mmproj_tensors(ckpt)
    kv = mmproj_kv(ckpt, ckpt.path, outtype)
    outs = [TensorOut(g, shape, _storage(g, shape, outtype)) for g, _, shape, _ in rows]
    src = {g: (h, part) for g, h, _, part in rows}

    def produce(t: TensorOut) -> np.ndarray:
        h, part = src[t.name]
        x = ckpt.get(h).numpy().astype(np.float32)
        if part in ("t0", "t1"):
            x = np.ascontiguousarray(x[:, :, 0 if part == "t0" else 1])
        if t.qtype == "F32":
            return x
        if t.qtype == "F16":
            return x.astype(np.float16)
        return gguf.quants.quantize(x, ggml_type(t.qtype))

    files = write_gguf(out, kv, outs, produce, arch="clip", progress=progress, overwrite=overwrite)
    types: dict[str, int] = {}
    for t in outs:
        types[t.qtype] = types.get(t.qtype, 0) + 1
    return {"files": [str(f) for f in files], "tensors": len(outs), "types": types}
