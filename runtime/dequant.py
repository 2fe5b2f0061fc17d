"""Dequantized, HF-named weights of a model in any format mixq reads, one decoder layer at a time.

`open_dequant(path, fmt)` gives a `DequantSource`: the HF tensor names and shapes a file holds (read from headers,
nothing decoded), the float32 tensors of one decoder layer (`layer(i)`), and single tensors outside the decoder
layers (`get(name)`: embedding, final norm, lm_head). Formats:
- "hf": an HF checkpoint directory through `formats.checkpoint` (BF16/FP16/FP32, FP8 blocks dequantized);
- "gguf": a glm5-next GGUF (or split set) through `formats.gguf_reader`, its blocks decoded on the source's device
  by `quant.ggml.torch_decode` (gguf-py for a type it does not decode); experts unstacked, kv_b rebuilt, A_log
  and conv reshaped back;
- "exl3": an EXL3 directory (mixq's, or exllamav3's own without mixq's manifest) through `formats.exl3_reader`
  (stored tensors), trellis units decoded here with `quant.trellis` (W = diag(suh)·H·Ŵ·H·diag(svh), padding
  cropped, fused units split back, the parts of a Linear stored split joined again).
Which tensors belong to which decoder layer comes from the architecture table (`formats.glm5next.classify`).
`read_exl3(path)` gives a whole EXL3 directory at once (tools and tests on small models).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import mixq.quant.trellis  # looked up per call: tests swap in a fake mixq.quant.trellis
from mixq.errors import FormatError, InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.exl3_names import MCG_MARKER, MUL1_MARKER, add_unit_tensors
from mixq.formats.exl3_reader import Exl3Dir
from mixq.formats.io_counts import count_read
from mixq.formats.gguf_names import merge_kv_b, unbuild_tensor
from mixq.formats.gguf_reader import read_gguf, spec_from_gguf
from mixq.formats.glm5next import classify
from mixq.quant.ggml import torch_decode

FORMATS = ("hf", "gguf", "exl3")


def in_text_forward(name: str, num_hidden_layers: int) -> bool:
    """True for a tensor the causal-LM forward uses: not the vision tower, not a NextN/MTP block (the table says)."""
    info = classify(name, num_hidden_layers)
    return not info.mtp and info.role != "vision"


class DequantSource:
    """HF-named float32 weights of one model file or directory, decoded on demand (see module docstring)."""

    format = ""

    def __init__(self, path: Path, num_hidden_layers: int) -> None:
        self.path = Path(path)
        self.num_hidden_layers = num_hidden_layers
        self._shapes: dict[str, tuple[int, ...]] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the source holds -> its shape (nothing is decoded)."""
        return dict(self._shapes)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The float32 tensors of decoder layer i (NextN layers are never part of it)."""
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        """One float32 tensor outside the decoder layers (embedding, final norm, lm_head)."""
        raise NotImplementedError

    def nextn_layer(self, i: int) -> dict[str, torch.Tensor]:
        """The float32 tensors of NextN block i (its decoder index); empty when the file holds none."""
        raise NotImplementedError

    def _in_layer(self, hf_name: str, i: int) -> bool:
        return classify(hf_name, self.num_hidden_layers).layer == i

    def _layer_of(self, name: str) -> int | None:
        """Decoder layer of an HF tensor; None for tensors outside the trunk (embeddings, head, vision, NextN)."""
        return classify(name, self.num_hidden_layers).layer if in_text_forward(name, self.num_hidden_layers) else None

    def _missing(self, name: str) -> InputError:
        return InputError(f"{self.path}: no tensor {name!r}")


class CheckpointSource(DequantSource):
    """An HF checkpoint directory (BF16 / FP16 / FP32 / FP8 block-scaled)."""

    format = "hf"

    def __init__(self, path: Path, num_hidden_layers: int | None = None) -> None:
        self.ckpt = open_checkpoint(path)
        super().__init__(self.ckpt.path, num_hidden_layers or self.ckpt.num_hidden_layers)
        self._by_layer: dict[int | None, list[str]] = {}
        for n in self.ckpt.names():
            self._shapes[n] = tuple(self.ckpt.shape(n))
            self._by_layer.setdefault(self._layer_of(n), []).append(n)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return {n: self.ckpt.get(n, dtype=torch.float32) for n in self._by_layer.get(i, [])}

    def get(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise self._missing(name)
        return self.ckpt.get(name, dtype=torch.float32)

    def nextn_layer(self, i: int) -> dict[str, torch.Tensor]:
        return {n: self.ckpt.get(n, dtype=torch.float32) for n in self._by_layer.get(None, []) if self._in_layer(n, i)}


class _UnitSource(DequantSource):
    """A written file decoded per stored unit (a GGUF tensor, an EXL3 unit): subclasses fill `_by_layer` (layer ->
    units), `_global` (HF name -> unit of the tensors outside the decoder layers) and `_decode(units)`."""

    _by_layer: dict
    _global: dict

    def _decode(self, units) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self._decode(self._by_layer.get(i, []))

    def get(self, name: str) -> torch.Tensor:
        if name not in self._global:
            raise self._missing(name)
        return self._decode([self._global[name]])[name]

    def _unit_hf(self, unit) -> str:
        """The first HF tensor a stored unit holds."""
        raise NotImplementedError

    def nextn_layer(self, i: int) -> dict[str, torch.Tensor]:
        return self._decode([u for u in self._by_layer.get(None, []) if self._in_layer(self._unit_hf(u), i)])


class GGUFSource(_UnitSource):
    """A glm5-next GGUF file or split set (memory-mapped; a GGUF tensor is dequantized when its layer is asked)."""

    format = "gguf"

    def __init__(self, path: Path, num_hidden_layers: int, device: str | torch.device = "cpu") -> None:
        super().__init__(path, num_hidden_layers)
        self.device = torch.device(device)  # where torch decodes the blocks; the tensors come back on the CPU
        self.file = read_gguf(path)
        self._specs = {}
        self._by_layer: dict[int | None, list[str]] = {}
        self._global: dict[str, str] = {}  # HF name -> GGUF name, for tensors outside the decoder layers
        parts = {}
        for name, e in self.file.tensors.items():
            spec = spec_from_gguf(name, e.shape)
            self._specs[name] = spec
            layer = self._layer_of(spec.hf_names[0])
            self._by_layer.setdefault(layer, []).append(name)
            if layer is None:
                for n in spec.hf_names:
                    self._global[n] = name
            # shapes without decoding: the inverse transforms run on meta tensors
            parts.update(unbuild_tensor(spec, torch.empty(e.shape, device="meta")))
        self._shapes = {n: tuple(t.shape) for n, t in merge_kv_b(parts).items()}

    def _unit_hf(self, unit) -> str:
        return self._specs[unit].hf_names[0]

    def _decode(self, gguf_names: list[str]) -> dict[str, torch.Tensor]:
        parts: dict[str, torch.Tensor] = {}
        for name in gguf_names:
            e = self.file.tensors[name]
            count_read(e.raw().nbytes)  # the stored blocks, memory-mapped: read as they are decoded
            if torch_decode.can_decode(e.qtype):  # torch on self.device, the same values as gguf-py's
                raw = torch_decode.stored_bytes(e.raw()).to(self.device)
                t = torch_decode.dequantize(raw, e.qtype, e.shape)
            else:
                t = torch.from_numpy(np.array(e.dequantize()))
            parts.update(unbuild_tensor(self._specs[name], t))
        return {n: t.cpu() for n, t in merge_kv_b(parts).items()}


class Exl3Source(_UnitSource):
    """An EXL3 directory (any writer): stored tensors read per unit, trellis units decoded on `device`."""

    format = "exl3"

    def __init__(self, path: Path, num_hidden_layers: int | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.dir = Exl3Dir(path)
        if num_hidden_layers is None:
            cfg = self.dir.config
            num_hidden_layers = int(cfg.get("text_config", cfg)["num_hidden_layers"])
        super().__init__(path, num_hidden_layers)
        self.device = torch.device(device)
        self._by_layer: dict[int | None, list] = {}
        self._global: dict[str, object] = {}
        self._parts: dict[str, list] = {}  # HF name -> every unit holding a slice of it (a Linear stored split)
        shapes: dict[str, torch.Tensor] = {}
        for u in self.dir.units:
            layer = self._layer_of(u.hf_names[0])
            self._by_layer.setdefault(layer, []).append(u)
            names = u.split_back(torch.empty(u.shape, device="meta"))
            if u.bias:
                names[u.bias] = torch.empty(u.shape[0], device="meta")
            add_unit_tensors(shapes, u, names)
            for n in names:
                if layer is None:
                    self._global[n] = u
                if u.part:
                    self._parts.setdefault(n, []).append(u)
        self._shapes = {n: tuple(t.shape) for n, t in shapes.items()}

    def _unit_hf(self, unit) -> str:
        return unit.hf_names[0]

    def _decode(self, units) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for u in units:
            add_unit_tensors(out, u, unit_weights(self.dir, u, self.device))
        return out

    def get(self, name: str) -> torch.Tensor:
        if name in self._parts:  # every part, not only the one `_global` remembers
            return self._decode(self._parts[name])[name]
        return super().get(name)


def open_dequant(path: str | Path, fmt: str, *, num_hidden_layers: int | None = None,
                 device: str | torch.device = "cpu") -> DequantSource:
    """The `DequantSource` of `path` in format `fmt` ("hf" | "gguf" | "exl3"). `num_hidden_layers` (the
    reference's) tells trunk layers from NextN layers where the file does not; `device` decodes trellis units."""
    if fmt == "hf":
        return CheckpointSource(Path(path), num_hidden_layers)
    if fmt == "exl3":
        return Exl3Source(Path(path), num_hidden_layers, device=device)
    if fmt == "gguf":
        if num_hidden_layers is None:
            raise InputError(f"{path}: a GGUF source needs the reference's num_hidden_layers")
        return GGUFSource(Path(path), num_hidden_layers, device=device)
    raise InputError(f"{path}: unknown weight format {fmt!r} (one of {FORMATS})")


# --- EXL3 trellis decoding ---------------------------------------------------------------------------------------
def decode_linear(t: dict[str, torch.Tensor], key: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """Dequantize one EXL3 Linear from its stored tensors -> padded HF-orientation weight (n, k) float32."""
    trel = t[f"{key}.trellis"]
    if trel.dtype != torch.int16 or trel.dim() != 3:
        raise FormatError(f"{key}.trellis: expected a 3-D int16 tensor, got {tuple(trel.shape)} {trel.dtype}")
    marker = "mul1" if f"{key}.mul1" in t else "mcg" if f"{key}.mcg" in t else None
    if marker:
        want = MUL1_MARKER if marker == "mul1" else MCG_MARKER
        if int(t[f"{key}.{marker}"].item()) != want:
            raise FormatError(f"{key}.{marker}: marker value {int(t[f'{key}.{marker}'].item())} != {want}")
    parts = {"trellis": trel.to(device), "suh": t[f"{key}.suh"].to(device), "svh": t[f"{key}.svh"].to(device)}
    if marker:
        parts[marker] = t[f"{key}.{marker}"]
    k, n = 16 * trel.shape[0], 16 * trel.shape[1]
    return mixq.quant.trellis.from_tensors(parts, (n, k)).dequantize().float()


def dequantize_unit(d, u, device: str | torch.device = "cpu") -> torch.Tensor:
    """An EXL3 unit's weight as the model sees it, float32 on the CPU, logical (unpadded) shape.
    d: an opened `formats.exl3_reader.Exl3Dir`; u: one of its units."""
    t = d.unit_tensors(u)
    count_read(sum(x.numel() * x.element_size() for x in t.values()))
    if u.kind == "trellis":
        return decode_linear(t, u.key, device=device)[: u.shape[0], : u.shape[1]].float().cpu()
    return next(iter(t.values())).float().reshape(u.shape)


def unit_weights(d, u, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """{HF name: float32 tensor} of one EXL3 unit (its bias included); a `part` unit gives its slice."""
    out = u.split_back(dequantize_unit(d, u, device))
    if u.bias:
        out[u.bias] = d.tensor(f"{u.key}.bias").float()[: u.shape[0]]
    return out


def read_exl3(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """{HF checkpoint name: float32 tensor} of every tensor stored in the EXL3 directory `path`."""
    d = Exl3Dir(path)
    out: dict[str, torch.Tensor] = {}
    for u in d.units:
        add_unit_tensors(out, u, unit_weights(d, u, device))
    return out


def exl3_decode_check(path: str | Path, device: str | torch.device = "cpu") -> tuple[int, list[str]]:
    """Decode every stored trellis unit of an EXL3 directory: (units decoded, problems) — a unit that does not
    decode or decodes to non-finite values is a problem (what `verify` adds to `formats.exl3_reader`'s checks)."""
    d = Exl3Dir(path)
    decoded, problems = 0, []
    for u in d.units:
        if u.kind != "trellis" or d.bits.get(u.key) is None \
                or any(n not in d.where for n in u.tensor_specs(d.bits.get(u.key))):
            continue  # missing tensors (or an unreadable rate) are reported by the reader's own checks
        try:
            w = dequantize_unit(d, u, device)
        except (FormatError, ValueError, RuntimeError) as e:
            problems.append(f"{u.key}: does not decode ({e})")
            continue
        decoded += 1
        if not bool(torch.isfinite(w).all()):
            problems.append(f"{u.key}: decodes to non-finite values")
    return decoded, problems
