"""The EXL3 layout of a glm5_next checkpoint: which output units exist, their keys, sources and storage.

One `Exl3Unit` is what one exllamav3 module stores: a quantized Linear (`<key>.trellis/.suh/.svh/.mul1[/.bias]`),
an unquantized fp16 Linear (`<key>.weight`), or a raw tensor in fp32 / fp16 / its source dtype.
Conventions (../shared/reference/exl3-format.md §1.4-1.6, §6.1-6.2, §7): tensors the architecture table fuses
(`TensorInfo.exl3_key`) become one unit, concatenated on dim 0 in the table's member order (a quantized Linear
such as KDA's qkv_proj, or a raw tensor such as its conv1d); `exl3_flat` tensors are stored flattened; storage
(fp16 / fp32 / source dtype, fp32 -> fp16) follows the table's EXL3 policy; quantized Linears are padded to
multiples of 128 on both sides unless the table gives another `exl3_pad`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mixq.errors import FormatError
from mixq.formats.exl3_layout import MCG_MARKER, MUL1_MARKER, PAD, linear_tensors, pad_up  # noqa: F401 - re-exported


@dataclass
class Exl3Unit:
    """One output unit. `kind`: "trellis" | "fp16_linear" | "raw"."""

    key: str                       # module key (trellis / fp16 Linear) or the full tensor name (raw)
    kind: str
    hf_names: list[str]            # source tensors, in concatenation order
    shape: tuple[int, ...]         # assembled logical shape (HF orientation (out, in) for Linears)
    role: str
    stage: str                     # "embed" | "layer.{i}" | "head" | "mtp.{i}" | "vision"
    bits_key: str | None = None    # "bits" | "head_bits" | "mtp_bits" | "vision_bits" for trellis units
    dtype: str | None = None       # raw / fp16: "float16" | "float32" | "bfloat16"
    bias: str | None = None        # HF bias tensor of a Linear (vision), stored as <key>.bias fp16
    pad_to: int = PAD
    split: list[int] = field(default_factory=list)  # dim-0 sizes of hf_names when concatenated
    src_shapes: list[tuple[int, ...]] = field(default_factory=list)
    marker: str | None = "mul1"    # codebook marker tensor of a trellis unit ("mul1" | "mcg"; None = 3INST)
    part: bool = False             # holds a dim-0 slice of its one HF tensor (a fused HF Linear stored split)

    @property
    def padded(self) -> tuple[int, int]:
        """(k, n) = padded (in, out) of a Linear."""
        out, inp = self.shape
        return pad_up(inp, self.pad_to), pad_up(out, self.pad_to)

    def tensor_specs(self, bits: float | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every stored tensor: name -> (shape, dtype name)."""
        if self.kind == "trellis":
            if bits is None:
                raise ValueError(f"{self.key}: bits needed for a trellis unit")
            k, n = self.padded
            return linear_tensors(self.key, k, n, bits, bias=bool(self.bias), marker=self.marker)
        if self.kind == "fp16_linear":
            d = {f"{self.key}.weight": (self.shape, "float16")}
            if self.bias:
                d[f"{self.key}.bias"] = ((self.shape[0],), "float16")
            return d
        return {self.key: (self.shape, self.dtype or "float16")}

    def assemble(self, fetch) -> torch.Tensor:
        """The source tensor of the unit in float32 (fetch: HF name -> tensor)."""
        parts = [fetch(n).float() for n in self.hf_names]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        return t.reshape(self.shape)

    def split_back(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of `assemble`: the unit's (dequantized) tensor -> {HF name: tensor in its source shape}."""
        if len(self.hf_names) == 1:
            src = self.src_shapes[0]
            if t.dim() == 2 and len(src) == 2 and tuple(t.shape) != tuple(src):
                t = t[: src[0], : src[1]]  # a padded fp16 Linear (DFlash2 selector projection)
            return {self.hf_names[0]: t.reshape(src)}
        chunks = torch.split(t, self.split, 0)
        return {n: c.reshape(s) for n, c, s in zip(self.hf_names, chunks, self.src_shapes)}


def storage_dtype(policy: str, source_dtype: str, name: str) -> str:
    """The dtype an unquantized tensor is stored in, by its EXL3 policy and source dtype (exl3-format.md §1.5)."""
    if policy == "fp32":
        # e_score_correction_bias keeps fp16 when the source is fp16 (reference §1.5)
        return "float16" if (source_dtype == "float16" and name.endswith("e_score_correction_bias")) else "float32"
    if policy == "fp16":
        return "float16"
    # native: bf16 / fp16 kept, anything else (fp32, fp8 dequantized) -> fp16
    return source_dtype if source_dtype in ("bfloat16", "float16") else "float16"


def _stage(info, name: str) -> str:
    if info.role == "vision":
        return "vision"
    if info.layer is None:
        return "embed" if info.role == "embed" else "head"
    return f"mtp.{info.layer}" if info.mtp else f"layer.{info.layer}"


def _fused_unit(ckpt, info, have: set[str], stage: str) -> Exl3Unit:
    """One unit made of the table's fusion group of ``info`` (concatenated on dim 0, member order)."""
    srcs = list(info.exl3_members)
    missing = [s for s in srcs if s not in have]
    if missing:
        raise FormatError(f"{info.exl3_key} is fused from {', '.join(srcs)}; missing {missing[0]}")
    shapes = [tuple(ckpt.shape(s)) for s in srcs]
    if len({s[1:] for s in shapes}) != 1:
        raise FormatError(f"{info.exl3_key}: the fused tensors' trailing shapes differ {shapes}")
    fused = (sum(s[0] for s in shapes),) + shapes[0][1:]
    split = [s[0] for s in shapes]
    if info.exl3 == "trellis":
        return Exl3Unit(info.exl3_key, "trellis", srcs, fused, info.role, stage, info.exl3_bits_key, split=split,
                        src_shapes=shapes)
    return Exl3Unit(info.exl3_key, "raw", srcs, fused, info.role, stage,
                    dtype=storage_dtype(info.exl3, ckpt.source_dtype(info.name), info.name), split=split,
                    src_shapes=shapes)


def exl3_layout(ckpt, *, vision_bits: float | None = None, include_mtp: bool = True) -> list[Exl3Unit]:
    """All output units of the checkpoint, in checkpoint order within each stage.

    ckpt: a Checkpoint (`names()`, `shape()`, `source_dtype()`, `info()`).
    vision_bits None keeps the vision tower at source precision (raw copies under the source names)."""
    names = ckpt.names()
    have = set(names)
    units: list[Exl3Unit] = []
    fused_done: set[str] = set()
    # biases of quantized Linears are stored as <key>.bias with their Linear (they may sort before the weight)
    bias_of_linear: set[str] = set()
    for name in names:
        if name.endswith(".bias") and name[:-5] + ".weight" in have:
            wi = ckpt.info(name[:-5] + ".weight")
            if wi.exl3 == "trellis" and not (wi.role == "vision" and vision_bits is None) \
                    and not (wi.mtp and not include_mtp):
                bias_of_linear.add(name)
    for name in names:
        if name in fused_done or name in bias_of_linear:
            continue
        info = ckpt.info(name)
        if info.mtp and not include_mtp:
            continue
        stage = _stage(info, name)
        shape = tuple(ckpt.shape(name))
        if info.exl3_key:
            units.append(_fused_unit(ckpt, info, have, stage))
            fused_done.update(info.exl3_members)
            continue
        dtype_src = ckpt.source_dtype(name)
        if info.exl3_flat:
            units.append(Exl3Unit(name, "raw", [name], (math.prod(shape),), info.role, stage,
                                  dtype=storage_dtype(info.exl3, dtype_src, name), src_shapes=[shape]))
            continue
        quantize = info.exl3 == "trellis" and not (info.role == "vision" and vision_bits is None)
        is_linear = name.endswith(".weight") and len(shape) == 2
        if quantize:
            key = name[: -len(".weight")]
            bias = key + ".bias" if key + ".bias" in have else None
            pad_to = info.exl3_pad or PAD
            units.append(Exl3Unit(key, "trellis", [name], shape, info.role, stage, info.exl3_bits_key,
                                  bias=bias, pad_to=pad_to, src_shapes=[shape]))
        elif info.exl3 == "fp16" and is_linear and info.role != "attn_param":
            units.append(Exl3Unit(name[: -len(".weight")], "fp16_linear", [name], shape, info.role, stage,
                                  dtype="float16", src_shapes=[shape]))
        else:
            units.append(Exl3Unit(name, "raw", [name], shape, info.role, stage,
                                  dtype=storage_dtype(info.exl3, dtype_src, name), src_shapes=[shape]))
    return units


def stage_order(units: list[Exl3Unit]) -> list[str]:
    """Stages in processing (and file) order: embed, layers, head, NextN, vision."""
    def rank(s: str) -> tuple:
        kind, _, idx = s.partition(".")
        base = {"embed": 0, "layer": 1, "head": 2, "mtp": 3, "vision": 4}[kind]
        return (base, int(idx) if idx else 0)
    return sorted({u.stage for u in units}, key=rank)


# exllamav3 stores some fused HF Linears as separate Linears (the vision attention's qkv as q/k/v, exl3-format.md
# §6.1): the leaf of the HF key -> the leaves of the stored keys, in the HF tensor's row order
SPLIT_LINEARS = {"qkv": ("q_proj", "k_proj", "v_proj")}


def add_unit_tensors(out: dict[str, torch.Tensor], u: Exl3Unit, tensors: dict[str, torch.Tensor]) -> None:
    """Add one unit's HF-named tensors to ``out``; a `part` unit's slice is appended on dim 0 to what the parts
    before it (in unit order) put there."""
    for name, t in tensors.items():
        out[name] = torch.cat([out[name], t], 0) if u.part and name in out else t


def hf_names_of_key(units: list[Exl3Unit]) -> dict[str, Exl3Unit]:
    """HF tensor name -> the unit that stores it."""
    out = {}
    for u in units:
        for n in u.hf_names:
            out[n] = u
        if u.bias:
            out[u.bias] = u
    return out
