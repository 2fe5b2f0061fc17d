"""Writes an EXL3 model directory the way exllamav3 1.6.5 lays it out (../shared/reference/exl3-format.md §1, §7).

State machine: `Exl3Writer(out, work)` → `write_part(stage, units)` once per finished stage (each part is a
complete safetensors file under the work directory, written under a temporary name and renamed) →
`finalize(...)` packs the parts, in stage order, into shards of at most `shard_size` bytes (a module's tensors
are never split), then writes `model.safetensors` or `model-0000i-of-0000N.safetensors` (+ the index when N > 1),
config.json with `quantization_config`, quantization_config.json with `tensor_storage`, the side files of the
source directory, and `mixq_manifest.json` (tensor → shard, sha256 per shard, and the seal: sha256 and size of
every other file plus the manifest's own digest, formats/exl3_seal). Every file is written under a temporary
name and renamed when complete; config.json is renamed last (its bytes are hashed for the seal before).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.atomic import atomic_open, atomic_path, json_bytes, write_bytes
from mixq.formats.exl3_layout import MUL1_MULTIPLIER, SHARD_SIZE, shard_names
from mixq.formats.exl3_seal import CONFIG, INDEX, MANIFEST, QUANT_CONFIG, bytes_digest, file_digest, seal_manifest
from mixq.formats.glm5next import normalise_layer_type
from mixq.formats.io_counts import count_read
from mixq.formats.safetensors_io import (ST_DTYPES, dtype_name, dtype_tag, open_safetensors, read_metadata,
                                         tensor_entries, write_safetensors)

EXL3_VERSION = "1.6.5"  # the exllamav3 release whose layout this writer follows
SKIP_COPY_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pth", ".pt")
SKIP_COPY_NAMES = {CONFIG, INDEX, QUANT_CONFIG, MANIFEST}


# ---------------------------------------------------------------------------------------------- safetensors I/O
# (through the library: formats/safetensors_io; only the shard compile below writes safetensors bytes itself)

def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a storage dtype name ("float16", "int16", ...)."""
    dt = getattr(torch, name, None)
    if dt not in ST_DTYPES.values():
        raise FormatError(f"unsupported storage dtype {name!r}")
    return dt


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict | None) -> bytes:
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    off = 0
    for name, dt, shape, nbytes in entries:
        hdr[name] = {"dtype": dtype_tag(torch_dtype(dt)), "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)  # 8-byte alignment of the data section (allowed by the format)
    return struct.pack("<Q", len(js)) + js


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# ---------------------------------------------------------------------------------------------- config files

def exl3_config(source_config: dict, quant_config: dict) -> dict:
    """The source config.json with `quantization_config` added, `tie_word_embeddings` false (a separate lm_head
    is always written) and layer_types spelled linear_attention / deepseek_sparse_attention."""
    cfg = json.loads(json.dumps(source_config))
    qc = dict(quant_config)
    old = cfg.get("quantization_config")
    if isinstance(old, dict) and old.get("quant_method") != "exl3":
        qc["original_quantization_config"] = old
    cfg["quantization_config"] = qc
    for d in (cfg, cfg.get("text_config")):
        if isinstance(d, dict):
            if "tie_word_embeddings" in d:
                d["tie_word_embeddings"] = False
            if isinstance(d.get("layer_types"), list) and d.get("model_type", "").startswith("glm5_next"):
                d["layer_types"] = [normalise_layer_type(t) for t in d["layer_types"]]
    return cfg


def side_files(source_dir: Path) -> list[Path]:
    """Non-tensor files to copy (tokenizer, generation/processor/preprocessor configs, chat template, ...)."""
    out = []
    for p in sorted(source_dir.iterdir()):
        if p.is_file() and p.name not in SKIP_COPY_NAMES and not p.name.endswith(SKIP_COPY_SUFFIXES) \
                and not p.name.startswith("."):
            out.append(p)
    return out


def check_free_space(directory: Path, needed: int, what: str = "output") -> None:
    """InputError when `directory`'s filesystem has fewer than `needed` bytes free (plus 1% margin)."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed * 1.01:
        raise InputError(f"not enough disk space for the {what} in {directory}: need {needed / 2**20:.1f} MiB, "
                         f"{free / 2**20:.1f} MiB free")


# ---------------------------------------------------------------------------------------------- the writer

@dataclass
class PartInfo:
    stage: str
    file: str
    sha256: str
    bytes: int
    units: list[list]          # [[unit key, [tensor names]], ...] in write order


def _write_sealed_json(path: Path, obj, *, indent: int | None = 2, newline: bool = True) -> dict:
    """Write ``obj`` as JSON atomically (the bytes formats/atomic.write_json writes); returns its seal entry."""
    data = json_bytes(obj, indent=indent, newline=newline)
    write_bytes(path, data)
    return bytes_digest(data)


@dataclass
class _Module:
    """One unit's tensors in a part file: [(name, storage dtype name, shape, bytes)]."""

    stage: str
    key: str
    items: list[tuple[str, str, tuple[int, ...], int]]

    def size_bound(self) -> int:
        # data plus an upper bound of each tensor's header entry, so a shard file never exceeds the limit
        return sum(nb + len(n) + 96 for n, _, _, nb in self.items)


class Exl3Writer:
    """Collects finished stages as part files, then compiles the output directory (see module docstring)."""

    def __init__(self, out_dir: str | Path, work_dir: str | Path, *, shard_size: int = SHARD_SIZE) -> None:
        self.out = Path(out_dir)
        self.work = Path(work_dir)
        self.parts_dir = self.work / "parts"
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        if shard_size < 1:
            raise InputError(f"--shard-size must be positive (got {shard_size})")
        self.shard_size = int(shard_size)
        self.state = "open"

    def part_path(self, stage: str) -> Path:
        return self.parts_dir / f"{stage}.safetensors"

    def write_part(self, stage: str, units: list[tuple[str, dict[str, torch.Tensor]]]) -> PartInfo:
        """Write one stage's units ([(unit key, {tensor name: tensor})]) as one part file."""
        if self.state != "open":
            raise RuntimeError(f"Exl3Writer.write_part after {self.state}")
        flat: dict[str, torch.Tensor] = {}
        index = []
        for key, tensors in units:
            index.append([key, list(tensors)])
            for n, t in tensors.items():
                if n in flat:
                    raise FormatError(f"tensor {n!r} written twice")
                flat[n] = t
        path = self.part_path(stage)
        sha = write_safetensors(path, flat, metadata={"stage": stage, "units": json.dumps(index)})
        return PartInfo(stage, path.name, sha, path.stat().st_size, index)

    def part_modules(self, stage: str) -> list[_Module]:
        """The units of a stage's part file, in write order."""
        path = self.part_path(stage)
        entries = {n: (tag, shape) for n, tag, shape in tensor_entries(path)}
        out = []
        for key, names in json.loads(read_metadata(path).get("units", "[]")):
            items = []
            for n in names:
                if n not in entries:
                    raise FormatError(f"part {path}: tensor {n!r} of unit {key} is missing")
                tag, shape = entries[n]
                dt = ST_DTYPES[tag]
                items.append((n, dtype_name(dt), shape, math.prod(shape) * dt.itemsize))
            out.append(_Module(stage, key, items))
        return out

    def _plan_shards(self, modules: list[_Module]) -> list[list[_Module]]:
        """Modules packed in order into shards of at most ``shard_size`` bytes (a module is never split)."""
        shards: list[list[_Module]] = [[]]
        size = 24  # 8-byte length + braces + alignment padding
        for mod in modules:
            msize = mod.size_bound()
            if shards[-1] and size + msize > self.shard_size:
                shards.append([])
                size = 24
            shards[-1].append(mod)
            size += msize
        return shards

    def _stream_shard(self, fname: str, mods: list[_Module], tensors_info: dict) -> dict:
        """Write one shard: the compiled header, then each tensor's bytes read from its part file."""
        entries = [it for m in mods for it in m.items]
        h = hashlib.sha256()
        with atomic_open(self.out / fname, "wb") as f:
            hb = _header_bytes(entries, None)
            f.write(hb)
            h.update(hb)
            for stage in dict.fromkeys(m.stage for m in mods):
                with open_safetensors(self.part_path(stage)) as part:
                    for m in (m for m in mods if m.stage == stage):
                        for n, dt, shape, nb in m.items:
                            data = _tensor_bytes(part.get_tensor(n))
                            count_read(len(data))
                            if len(data) != nb:
                                raise FormatError(f"part {self.part_path(stage)}: tensor {n!r} has {len(data)} "
                                                  f"bytes, its header says {nb}")
                            f.write(data)
                            h.update(data)
                            tensors_info[n] = {"shard": fname, "dtype": dt, "shape": list(shape)}
        return {"sha256": h.hexdigest(), "bytes": (self.out / fname).stat().st_size}

    def finalize(self, stages: list[str], *, source_dir: Path | None, config: dict, tensor_storage: dict,
                 manifest: dict) -> dict:
        """Compile the parts of `stages` (in this order) into the output directory; returns the manifest.
        Every file is written under a temporary name and renamed when complete; config.json comes last."""
        if self.state != "open":
            raise RuntimeError(f"Exl3Writer.finalize after {self.state}")
        modules = [m for st in stages for m in self.part_modules(st)]
        shards = self._plan_shards(modules)
        names = shard_names(len(shards))
        total = sum(nb for m in modules for *_, nb in m.items)
        check_free_space(self.out, total + 2**20, "EXL3 shards")
        shard_info, tensors_info = {}, {}
        files: dict[str, dict] = {}  # the seal: every file written here, as written
        for fname, mods in zip(names, shards):
            shard_info[fname] = self._stream_shard(fname, mods, tensors_info)
            files[fname] = dict(shard_info[fname])  # hashed while streamed: shards are not read again
        if len(names) > 1:
            weight_map = {n: i["shard"] for n, i in tensors_info.items()}
            files[INDEX] = _write_sealed_json(self.out / INDEX, {"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}, indent=4, newline=False)
        if source_dir is not None:
            for src in side_files(Path(source_dir)):
                with atomic_path(self.out / src.name) as dst:
                    shutil.copyfile(src, dst)
                    files[src.name] = file_digest(dst)
        qc = dict(config.get("quantization_config", {}))
        files[QUANT_CONFIG] = _write_sealed_json(self.out / QUANT_CONFIG, dict(qc, tensor_storage=tensor_storage),
                                                 newline=False)
        config_bytes = json_bytes(config, newline=False)
        files[CONFIG] = bytes_digest(config_bytes)  # sealed now, written last: it marks the directory complete
        manifest = seal_manifest(dict(manifest, shards=shard_info, tensors=tensors_info, total_bytes=total), files)
        _write_sealed_json(self.out / MANIFEST, manifest, indent=1, newline=False)
        write_bytes(self.out / CONFIG, config_bytes)
        self.state = "finalized"
        return manifest


def tensor_storage_entry(tensors: dict[str, tuple[tuple[int, ...], str]], bits: float | None) -> dict:
    """One `tensor_storage` entry (reference §1.3) from {name: (shape, dtype name)}."""
    stored = {}
    for n, (shape, dt) in tensors.items():
        numel = 1
        for d in shape:
            numel *= d
        stored[n] = {"shape": list(shape), "n_bytes": numel * torch_dtype(dt).itemsize, "dtype": f"torch.{dt}"}
    d: dict = {"stored_tensors": stored}
    if bits is not None:
        d["quant_format"] = "exl3"
        d["bits_per_weight"] = int(bits) if bits == int(bits) else float(bits)
        d["mul1_multiplier"] = MUL1_MULTIPLIER
    return d
