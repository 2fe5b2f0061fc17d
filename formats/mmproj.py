"""The vision projector GGUF (mmproj) of a glm5_next checkpoint, as llama.cpp's mtmd loader reads it
(`general.architecture = clip`, `clip.projector_type = glm5v`). Facts: ../shared/reference/gguf-glm5-next.md §4,
checked against the vendored loader (tools/mtmd/clip.cpp, clip-impl.h key and tensor names).

Matrices are F16 (default) or Q8_0 (when the row length allows), conv kernels F16, biases and norms F32.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import Keys

from mixq.errors import InputError
from mixq.formats.gguf_writer import KV, TensorOut, ggml_type, write_gguf

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


def mmproj_kv(ckpt, model_dir: Path, ftype: str) -> list[KV]:
    """clip.* keys the glm5v loader reads (types as clip.cpp's get_u32/get_f32/get_bool/get_arr_f32 expect)."""
    vc = ckpt.config.get("vision_config")
    if not vc:
        raise InputError(f"{model_dir}: config.json has no vision_config")
    pp: dict = {}
    for fname in ("preprocessor_config.json", "processor_config.json"):
        f = Path(model_dir) / fname
        if f.is_file():
            d = json.loads(f.read_text())
            pp = d.get("image_processor", d)
            break
    patch, merge = int(vc["patch_size"]), int(vc.get("spatial_merge_size", 2))
    kv = [
        KV(Keys.General.TYPE, "STRING", "mmproj"), KV(Keys.General.NAME, "STRING", Path(model_dir).name),
        KV(Keys.General.FILE_TYPE, "UINT32", 1 if ftype == "F16" else 7),
        KV(Keys.Clip.PROJECTOR_TYPE, "STRING", "glm5v"),
        KV(Keys.Clip.HAS_VISION_ENCODER, "BOOL", True),
        KV(CV.USE_SILU, "BOOL", vc.get("hidden_act", "silu") == "silu"),
        KV(CV.PROJECTION_DIM, "UINT32", int(vc["out_hidden_size"])),
        KV(CV.IMAGE_SIZE, "UINT32", int(vc["image_size"])),
        KV(CV.PATCH_SIZE, "UINT32", patch),
        KV(CV.EMBEDDING_LENGTH, "UINT32", int(vc["hidden_size"])),
        KV(CV.FEED_FORWARD_LENGTH, "UINT32", int(vc["intermediate_size"])),
        KV(CV.BLOCK_COUNT, "UINT32", int(vc["depth"])),
        KV(CV.Attention.HEAD_COUNT, "UINT32", int(vc["num_heads"])),
        KV(CV.SPATIAL_MERGE_SIZE, "UINT32", merge),
        KV(CV.Attention.LAYERNORM_EPS, "FLOAT32", float(vc.get("rms_norm_eps", 1e-5))),
        KV("clip.vision.swiglu_clamp", "FLOAT32", float(vc.get("swiglu_limit", 0.0))),  # not named by gguf-py 0.19
        KV(CV.IMAGE_MEAN, "ARRAY", [float(x) for x in pp.get("image_mean", [0.48145466, 0.4578275, 0.40821073])],
           "FLOAT32"),
        KV(CV.IMAGE_STD, "ARRAY", [float(x) for x in pp.get("image_std", [0.26862954, 0.26130258, 0.27577711])],
           "FLOAT32"),
    ]
    # the loader takes pixel limits; processors give token limits: one token = (patch * merge)^2 pixels
    px = (patch * merge) ** 2
    if "min_image_tokens" in pp:
        kv.append(KV(CV.IMAGE_MIN_PIXELS, "UINT32", int(pp["min_image_tokens"]) * px))
    if "max_image_tokens" in pp:
        kv.append(KV(CV.IMAGE_MAX_PIXELS, "UINT32", int(pp["max_image_tokens"]) * px))
    return kv


def write_mmproj(model, out, outtype: str = "F16", progress: bool = True) -> dict:
    """Write the vision tower of `model` as a glm5v mmproj GGUF at `out` (F16 default, or Q8_0)."""
    import gguf

    from mixq.formats.checkpoint import open_checkpoint

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

    files = write_gguf(out, kv, outs, produce, arch="clip", progress=progress)
    types: dict[str, int] = {}
    for t in outs:
        types[t.qtype] = types.get(t.qtype, 0) + 1
    return {"files": [str(f) for f in files], "tensors": len(outs), "types": types}
