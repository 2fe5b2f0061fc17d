"""The units of an EXL3 directory without mixq's manifest (exllamav3's own output, or a mixq one whose manifest is
gone), derived from its config.json and the tensors its shards hold.

The layout the writer would plan (formats/exl3_names `exl3_layout`) is built from the shapes transformers gives
for the config (formats/checkpoint `checkpoint_from_config`), then held against what is stored
(../shared/reference/exl3-format.md §1.4-1.6, §6.1-6.2):
- a Linear is quantized when `<key>.trellis` is stored: its rate is the trellis' last dim / 16, its codebook the
  `.mul1` / `.mcg` marker present (none: 3INST); a Linear stored as `<key>.weight` is an fp16 Linear (a head or
  tower kept at 16 bits), possibly padded to 128;
- a fused unit (KDA qkv_proj, conv1d) whose members are stored one by one is read unfused; a fused HF Linear that
  exllamav3 stores split (the vision attention's qkv as q/k/v_proj) becomes one `part` unit per stored Linear;
- raw tensors keep the dtype (and, at equal size, the shape) they are stored in;
- the NextN block and the vision tower are part of the layout only when the shards hold any of their tensors.
What is planned but not stored stays in the units (verify names it as missing); what is stored but planned for no
unit is named by verify as unexpected.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

from mixq.formats.checkpoint import checkpoint_from_config
from mixq.formats.exl3_layout import MARKERS, TILE
from mixq.formats.exl3_names import SPLIT_LINEARS, Exl3Unit, exl3_layout
from mixq.formats.glm5next import is_vision
from mixq.formats.safetensors_io import ST_DTYPES, dtype_name

Stored = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype tag, shape)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
VISION_BITS_PLACEHOLDER = 6.0  # any rate makes exl3_layout plan the vision Linears as trellis units


class _Skeleton:
    """The shapes-only checkpoint of a config, limited to the names the directory can hold (the NextN block
    and the vision tower only when stored): what `exl3_layout` reads."""

    def __init__(self, config_path: Path, stored: Stored) -> None:
        self.ckpt = checkpoint_from_config(config_path)
        n = self.ckpt.num_hidden_layers
        has_nextn = any(int(m.group(1)) >= n for s in stored for m in [_LAYER.search(s)] if m)
        has_vision = any(is_vision(s) for s in stored)
        self._names = [x for x in self.ckpt.names()
                       if (has_nextn or not self.ckpt.info(x).mtp) and (has_vision or not is_vision(x))]

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ckpt.shape(name))

    def source_dtype(self, name: str) -> str:
        return self.ckpt.source_dtype(name)

    def info(self, name: str):
        return self.ckpt.info(name)


def _dtype(stored: Stored, name: str) -> str:
    return dtype_name(ST_DTYPES[stored[name][0]])


def codebook_marker(tensors, key: str) -> str | None:
    """The codebook marker Linear `key` carries among `tensors` (names, stored or planned): "mul1" / "mcg"; None =
    3INST; both: the first, verify names the other as unexpected."""
    return next((m for m in MARKERS if f"{key}.{m}" in tensors), None)


def trellis_bits(stored: Stored, key: str) -> float | None:
    """K of a stored Linear: the trellis' last dim / 16 (exl3-format.md §1.4); None when it is not 3-D."""
    shape = stored[f"{key}.trellis"][1]
    return shape[-1] / TILE if len(shape) == 3 else None


def _quantized(u: Exl3Unit, stored: Stored, **changes) -> tuple[Exl3Unit, float | None]:
    key = changes.get("key", u.key)
    return replace(u, kind="trellis", marker=codebook_marker(stored, key), **changes), trellis_bits(stored, key)


def _fp16(u: Exl3Unit, stored: Stored, key: str, hf_names: list[str], src: tuple[int, ...]) -> Exl3Unit:
    """An fp16 Linear stored as `<key>.weight` (out, in), possibly padded (split_back crops it to `src`)."""
    shape = tuple(stored[f"{key}.weight"][1])
    return replace(u, key=key, kind="fp16_linear", hf_names=hf_names, shape=shape, dtype=_dtype(stored, f"{key}.weight"),
                   bias=u.bias if f"{key}.bias" in stored else None, split=[], src_shapes=[src], pad_to=u.pad_to)


def _member_units(u: Exl3Unit, stored: Stored) -> list[tuple[Exl3Unit, float | None]] | None:
    """A fused unit whose members are stored each under its own name (an unfused layout), or None."""
    out = []
    for name, shape in zip(u.hf_names, u.src_shapes):
        one = replace(u, hf_names=[name], shape=tuple(shape), split=[], src_shapes=[tuple(shape)])
        key = name.removesuffix(".weight")
        if u.kind == "raw" and name in stored:
            out.append(_raw(replace(one, key=name), stored))
        elif u.kind == "trellis" and f"{key}.trellis" in stored:
            out.append(_quantized(one, stored, key=key))
        elif u.kind == "trellis" and f"{key}.weight" in stored:
            out.append((_fp16(one, stored, key, [name], tuple(shape)), None))
        else:
            return None
    return out


def _split_parts(u: Exl3Unit, stored: Stored) -> list[tuple[Exl3Unit, float | None]] | None:
    """A fused HF Linear stored as separate Linears (SPLIT_LINEARS), equal row counts in order, or None."""
    parent, _, leaf = u.key.rpartition(".")
    leaves = SPLIT_LINEARS.get(leaf)
    if not leaves or len(u.hf_names) != 1 or u.shape[0] % len(leaves):
        return None
    keys = [f"{parent}.{p}" for p in leaves]
    if not all(f"{k}.trellis" in stored for k in keys):
        return None
    rows = (u.shape[0] // len(leaves), u.shape[1])
    return [_quantized(u, stored, key=k, shape=rows, src_shapes=[rows], part=True,
                       bias=u.bias if f"{k}.bias" in stored else None) for k in keys]


def _raw(u: Exl3Unit, stored: Stored) -> tuple[Exl3Unit, None]:
    """A raw tensor as stored: its dtype, and its shape when it holds as many elements (A_log flattened)."""
    shape = tuple(stored[u.key][1])
    same_size = math.prod(shape) == math.prod(u.shape)
    return replace(u, dtype=_dtype(stored, u.key), shape=shape if same_size else u.shape), None


def _fit(u: Exl3Unit, stored: Stored) -> list[tuple[Exl3Unit, float | None]]:
    """The units (with their rates) that store planned unit `u` in this directory."""
    if u.kind == "trellis":
        if f"{u.key}.trellis" in stored:
            return [_quantized(u, stored)]
        if f"{u.key}.weight" in stored and len(u.hf_names) == 1:
            return [(_fp16(u, stored, u.key, u.hf_names, u.src_shapes[0]), None)]
    elif u.kind == "fp16_linear":
        if f"{u.key}.weight" in stored:
            return [(_fp16(u, stored, u.key, u.hf_names, u.src_shapes[0]), None)]
    elif u.key in stored:
        return [_raw(u, stored)]
    if len(u.hf_names) > 1 and (members := _member_units(u, stored)):
        return members
    if u.kind == "trellis" and (parts := _split_parts(u, stored)):
        return parts
    return [(u, None)]  # not stored: verify reports its tensors as missing


def derive_units(config_path: Path, stored: Stored) -> tuple[list[Exl3Unit], dict[str, float | None]]:
    """(units, {unit key: bits}) of a directory whose config.json is `config_path` and whose shards hold
    `stored`; bits None for units that are not quantized (or not stored)."""
    skeleton = _Skeleton(Path(config_path), stored)
    has_vision_trellis = any(is_vision(s) and s.endswith(".trellis") for s in stored)
    planned = exl3_layout(skeleton, vision_bits=VISION_BITS_PLACEHOLDER if has_vision_trellis else None,
                          include_mtp=True)
    units, bits = [], {}
    for u in planned:
        for v, b in _fit(u, stored):
            units.append(v if v.kind == "trellis" else replace(v, marker=None))  # a codebook is a Linear's only
            bits[v.key] = b
    return units, bits
