"""Read glm5-next GGUF files (single or split) back into HF-named float tensors, and verify them.

- `read_gguf(path)` -> `GGUFFile` (KVs + tensor entries over all shards, via gguf-py's GGUFReader once
  formats/gguf_header_check has bounded the header by the file's size).
- `read_gguf_weights(path)` -> {hf_name: float32 tensor}: dequantized with gguf-py and with every glm5-next
  transform undone (experts unstacked, k_b/v_b merged into kv_b, ssm_a -> A_log, conv reshaped back).
- `verify_gguf(path, model=None)` -> report dict: every tensor the glm5-next loader reads present with its shape
  (formats/gguf_loader_tensors, from the file's own metadata), byte sizes right, data decodes finite, the seal holds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import Keys

from mixq.errors import FormatError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.glm5next import TEXT_PREFIX, gguf_sources
from mixq.formats.gguf_header_check import open_gguf_reader
from mixq.formats.gguf_integrity import integrity_note, integrity_problems, is_sealed_set, set_readers
from mixq.formats.gguf_loader_tensors import loader_problems
from mixq.formats.gguf_names import GGUFTensorSpec, gguf_tensors, merge_kv_b, unbuild_tensor
from mixq.formats.gguf_layout import FLOAT_TYPES, tensor_bytes
from mixq.formats.gguf_writer import ARCH

HF_PREFIX = TEXT_PREFIX
_SPLIT_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")  # parses gguf-py's SHARD_NAME_FORMAT

@dataclass
class GGUFTensorEntry:
    name: str
    qtype: str
    shape: tuple[int, ...]   # numpy order (outermost first)
    n_bytes: int
    shard: int
    _reader: Any = field(repr=False, default=None)
    _index: int = field(repr=False, default=0)

    def raw(self) -> np.ndarray:
        return self._reader.tensors[self._index].data

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape` (gguf-py's dequantizers)."""
        t = self._reader.tensors[self._index]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(arr, dtype=np.float32).reshape(self.shape)


@dataclass
class GGUFFile:
    paths: list[Path]
    kv: dict[str, Any]
    tensors: dict[str, GGUFTensorEntry]


def shard_paths(path: Path) -> list[Path]:
    """All shards of a split GGUF given its first shard (or any shard); [path] for a single file."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m.group(3))
    return [path.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _int_kv(p: Path, kv: dict[str, Any], key: str) -> int | None:
    """An integer KV (split keys); None when absent, FormatError naming the key when it holds something else."""
    v = kv.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"{p}: key {key!r} is {v!r}, expected an integer")
    return v


def _contents(p: Path, reader: Any) -> dict[str, Any]:
    """Every KV of one file as Python values; a value gguf-py cannot decode is named."""
    kv: dict[str, Any] = {}
    for k, f in reader.fields.items():
        try:
            kv[k] = f.contents()
        except Exception as e:  # noqa: BLE001 - the header check passed, so this is a malformed value
            raise FormatError(f"{p}: key {k!r} does not decode ({type(e).__name__}: {e})") from None
    return kv


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF (or every shard of a split GGUF) without loading tensor data (memory-mapped)."""
    path = Path(path)
    paths = shard_paths(path)
    kv: dict[str, Any] = {}
    tensors: dict[str, GGUFTensorEntry] = {}
    for si, p in enumerate(paths):
        r = open_gguf_reader(p)
        file_kv = _contents(p, r)
        if si == 0:
            kv = file_kv
        if len(paths) > 1:
            no = _int_kv(p, file_kv, Keys.Split.LLM_KV_SPLIT_NO)
            if no != si:
                raise FormatError(f"{p}: split.no is {no}, expected {si}")
        for i, t in enumerate(r.tensors):
            if t.name in tensors:
                raise FormatError(f"{p}: tensor {t.name} also in shard {tensors[t.name].shard}")
            shape = tuple(int(x) for x in reversed(list(t.shape)))
            tensors[t.name] = GGUFTensorEntry(t.name, t.tensor_type.name, shape, int(t.n_bytes), si, r, i)
    if len(paths) > 1:
        want = _int_kv(paths[0], kv, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
        if want != len(tensors):
            raise FormatError(f"{paths[0]}: split.tensors.count {want} but the shards hold {len(tensors)} tensors")
    return GGUFFile(paths, kv, tensors)


def spec_from_gguf(name: str, shape: tuple[int, ...], prefix: str = HF_PREFIX) -> GGUFTensorSpec:
    """Invert the glm5-next mapping for one GGUF tensor (formats/glm5next.gguf_sources): its HF name(s), transform."""
    src = gguf_sources(name, shape)
    if src is None:
        raise FormatError(f"GGUF tensor {name!r} is not part of the glm5-next mapping")
    hf = [prefix + n[len(HF_PREFIX):] if n.startswith(HF_PREFIX) else n for n in src.hf_names]
    extra = {}
    if src.transform == "kv_b_k":
        extra = {"heads": shape[0], "nope": shape[2]}
    elif src.transform == "kv_b_v":
        extra = {"heads": shape[0], "v": shape[1]}
    return GGUFTensorSpec(name, hf, shape, src.rule.role, src.layer, src.rule.scope == "mtp", src.transform, extra)


def read_gguf_weights(path: str | Path, prefix: str = HF_PREFIX) -> dict[str, torch.Tensor]:
    """HF-named float32 weights of a glm5-next GGUF file (or split set): the dequantized candidate for eval."""
    g = read_gguf(path)
    parts: dict[str, torch.Tensor] = {}
    for name, e in g.tensors.items():
        spec = spec_from_gguf(name, e.shape, prefix)
        t = torch.from_numpy(np.array(e.dequantize()))
        parts.update(unbuild_tensor(spec, t))
    return merge_kv_b(parts)


def verify_gguf(path: str | Path, model: str | Path | None = None, decode: bool = True) -> dict:
    """Check a GGUF: arch, tensor count, each tensor's byte size, data decodes to finite values; with `model`
    (the source checkpoint) also that exactly the expected tensors with the expected shapes are present.
    Returns a report dict; problems are listed in report["problems"] (empty = OK), and "integrity" says what could
    be checked: mixq's seal where the file carries one, else (any other writer's file) the structure and decode."""
    g = read_gguf(path)
    problems: list[str] = []
    arch = g.kv.get(Keys.General.ARCHITECTURE)
    if arch != ARCH:
        problems.append(f"general.architecture is {arch!r}, expected {ARCH!r}")
    # sealed or not, the tensors against what the glm5-next loader reads for this file's own metadata
    problems += loader_problems(g.kv, {n: tuple(reversed(e.shape)) for n, e in g.tensors.items()})
    n_bytes = 0
    for name, e in g.tensors.items():
        try:
            want = tensor_bytes(e.qtype, e.shape)
        except Exception as ex:  # noqa: BLE001
            problems.append(f"{name}: {ex}")
            continue
        if want != e.n_bytes:
            problems.append(f"{name}: {e.n_bytes} bytes stored, {e.qtype} {e.shape} needs {want}")
        n_bytes += e.n_bytes
        if decode:
            try:
                spec_from_gguf(name, e.shape)
                if not np.isfinite(e.dequantize()).all():
                    problems.append(f"{name}: non-finite values after decoding {e.qtype}")
            except Exception as ex:  # noqa: BLE001 - report, keep checking the rest
                problems.append(f"{name}: does not decode ({ex})")
    if model is not None:
        ckpt = open_checkpoint(model)
        has_mtp = int(g.kv.get(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=ARCH), 0) or 0) > 0
        want_specs = {s.name: s for s in gguf_tensors(ckpt, include_mtp=has_mtp)}
        for n in sorted(set(want_specs) - set(g.tensors)):
            problems.append(f"{n}: missing")
        for n in sorted(set(g.tensors) - set(want_specs)):
            problems.append(f"{n}: not expected for this model")
        for n in sorted(set(want_specs) & set(g.tensors)):
            if tuple(want_specs[n].shape) != g.tensors[n].shape:
                problems.append(f"{n}: shape {g.tensors[n].shape}, expected {tuple(want_specs[n].shape)}")
    # per-tensor sha256, metadata digest and conversion id of every shard (formats/gguf_integrity), always
    open_readers = {e.shard: e._reader for e in g.tensors.values()}
    readers = set_readers(g.paths, [open_readers.get(i) for i in range(len(g.paths))])
    sealed, checked = integrity_problems(g.paths, readers)
    problems += sealed
    types: dict[str, int] = {}
    for e in g.tensors.values():
        types[e.qtype] = types.get(e.qtype, 0) + 1
    quantized = sum(n for t, n in types.items() if t not in FLOAT_TYPES)
    return {"path": str(g.paths[0]), "files": [str(p) for p in g.paths], "tensors": len(g.tensors),
            "quantized": quantized if decode else 0, "bytes": n_bytes, "types": types, "checksums": checked,
            "integrity": integrity_note(is_sealed_set(g.paths, readers), checked, decoded=decode),
            "problems": problems, "ok": not problems}
