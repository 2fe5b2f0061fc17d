"""Writes an EXL3 model directory the way exllamav3 1.6.5 lays it out (../shared/reference/exl3-format.md §1, §7).

State machine: `Exl3Writer(out, work)` → `write_part(stage, units)` once per finished stage (each part is a
complete safetensors file under the work directory, written under a temporary name and renamed) →
`finalize(...)` packs the parts, in stage order, into shards of at most `shard_size` bytes (a module's tensors
are never split), then writes `model.safetensors` or `model-0000i-of-0000N.safetensors` (+ the index when N > 1),
config.json with `quantization_config`, quantization_config.json with `tensor_storage`, the side files of the
source directory, and `mixq_manifest.json` (tensor → shard, sha256 per shard). Every file is written under a
temporary name and renamed when complete; config.json is renamed last.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.exl3_layout import MUL1_MULTIPLIER, SHARD_SIZE, shard_names

EXL3_VERSION = "1.6.5"  # the exllamav3 release whose layout this writer follows
MANIFEST = "mixq_manifest.json"
DTYPES = {"int16": ("I16", 2), "int32": ("I32", 4), "float16": ("F16", 2), "float32": ("F32", 4),
          "bfloat16": ("BF16", 2), "uint8": ("U8", 1), "int64": ("I64", 8)}
ST_TO_NAME = {v[0]: k for k, v in DTYPES.items()}
_TORCH = {"int16": torch.int16, "int32": torch.int32, "float16": torch.float16, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "uint8": torch.uint8, "int64": torch.int64}
SKIP_COPY_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pth", ".pt")
SKIP_COPY_NAMES = {"config.json", "model.safetensors.index.json", "quantization_config.json", MANIFEST}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------------- safetensors I/O

def read_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file; FormatError naming the file when malformed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise FormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise FormatError(f"{path}: safetensors header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not an object")
    return 8 + n, header


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict | None) -> bytes:
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    off = 0
    for name, dt, shape, nbytes in entries:
        hdr[name] = {"dtype": DTYPES[dt][0], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)  # 8-byte alignment of the data section (allowed by the format)
    return struct.pack("<Q", len(js)) + js


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> str:
    """Write tensors in insertion order under a temp name, fsync, rename; returns the sha256 of the file."""
    entries = [(n, dtype_name(t), tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    tmp = path.with_name(path.name + ".tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for chunk in [_header_bytes(entries, metadata)] + [_tensor_bytes(t) for t in tensors.values()]:
            f.write(chunk)
            h.update(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return h.hexdigest()


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def load_tensor(path: Path, name: str, start: int | None = None, header: dict | None = None) -> torch.Tensor:
    """One tensor of a safetensors file, read by offset (no mmap of the whole file)."""
    if header is None or start is None:
        start, header = read_header(path)
    e = header.get(name)
    if e is None:
        raise FormatError(f"{path}: tensor {name!r} missing")
    dt = ST_TO_NAME.get(e["dtype"])
    if dt is None:
        raise FormatError(f"{path}: tensor {name!r} has unsupported dtype {e['dtype']}")
    a, b = e["data_offsets"]
    shape = tuple(e["shape"])
    n = 1
    for d in shape:
        n *= d
    if b - a != n * DTYPES[dt][1]:
        raise FormatError(f"{path}: tensor {name!r} byte size {b - a} does not match shape {shape} {dt}")
    with open(path, "rb") as f:
        f.seek(start + a)
        raw = f.read(b - a)
    if len(raw) != b - a:
        raise FormatError(f"{path}: tensor {name!r} is truncated")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype(dt)).reshape(shape).clone() \
        if raw else torch.empty(shape, dtype=torch_dtype(dt))


# ---------------------------------------------------------------------------------------------- config files

def exl3_config(source_config: dict, quant_config: dict) -> dict:
    """The source config.json with `quantization_config` added, `tie_word_embeddings` false (a separate lm_head
    is always written) and layer_types spelled linear_attention / deepseek_sparse_attention."""
    from mixq.formats.glm5next import normalise_layer_type

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


def _atomic_json(path: Path, obj, indent: int | None = 2) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

    def read_part_index(self, stage: str) -> tuple[int, dict, list[list]]:
        path = self.part_path(stage)
        start, header = read_header(path)
        units = json.loads(header.get("__metadata__", {}).get("units", "[]"))
        return start, header, units

    def finalize(self, stages: list[str], *, source_dir: Path | None, config: dict, tensor_storage: dict,
                 manifest: dict) -> dict:
        """Compile the parts of `stages` (in this order) into the output directory; returns the manifest."""
        if self.state != "open":
            raise RuntimeError(f"Exl3Writer.finalize after {self.state}")
        # 1. plan shards at module granularity
        modules = []  # (stage, key, [(name, dtype, shape, nbytes, offset_in_part)], start, header)
        for st in stages:
            start, header, units = self.read_part_index(st)
            for key, names in units:
                items = []
                for n in names:
                    e = header[n]
                    a, b = e["data_offsets"]
                    items.append((n, ST_TO_NAME[e["dtype"]], tuple(e["shape"]), b - a, a))
                modules.append((st, key, items, start))
        shards: list[list] = [[]]
        size = 24  # 8-byte length + braces + alignment padding
        for mod in modules:
            # data plus an upper bound of each tensor's header entry, so a shard file never exceeds the limit
            msize = sum(it[3] + len(it[0]) + 96 for it in mod[2])
            if shards[-1] and size + msize > self.shard_size:
                shards.append([])
                size = 24
            shards[-1].append(mod)
            size += msize
        names = shard_names(len(shards))
        total = sum(it[3] for m in modules for it in m[2])
        check_free_space(self.out, total + 2**20, "EXL3 shards")
        # 2. stream each shard from the parts
        weight_map, shard_info, tensors_info = {}, {}, {}
        for fname, mods in zip(names, shards):
            entries = [(it[0], it[1], it[2], it[3]) for m in mods for it in m[2]]
            tmp = self.out / (fname + ".tmp")
            h = hashlib.sha256()
            with open(tmp, "wb") as f:
                hb = _header_bytes(entries, None)
                f.write(hb)
                h.update(hb)
                for st, key, items, start in mods:
                    with open(self.part_path(st), "rb") as src:
                        for n, dt, shape, nb, off in items:
                            src.seek(start + off)
                            data = src.read(nb)
                            if len(data) != nb:
                                raise FormatError(f"part {self.part_path(st)} is truncated at {n}")
                            f.write(data)
                            h.update(data)
                            weight_map[n] = fname
                            tensors_info[n] = {"shard": fname, "dtype": dt, "shape": list(shape)}
                f.flush()
                os.fsync(f.fileno())
            shard_info[fname] = {"sha256": h.hexdigest(), "bytes": tmp.stat().st_size}
        # 3. side files, json files (temp names), then renames with config.json last
        pending: list[tuple[Path, Path]] = [(self.out / (n + ".tmp"), self.out / n) for n in names]
        if len(names) > 1:
            p = self.out / "model.safetensors.index.json.tmp"
            with open(p, "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=4)
            pending.append((p, self.out / "model.safetensors.index.json"))
        if source_dir is not None:
            for src in side_files(Path(source_dir)):
                dst = self.out / (src.name + ".tmp")
                shutil.copyfile(src, dst)
                pending.append((dst, self.out / src.name))
        qc = dict(config.get("quantization_config", {}))
        qc_file = dict(qc, tensor_storage=tensor_storage)
        p = self.out / "quantization_config.json.tmp"
        with open(p, "w") as f:
            json.dump(qc_file, f, indent=2)
        pending.append((p, self.out / "quantization_config.json"))
        manifest = dict(manifest, shards=shard_info, tensors=tensors_info, total_bytes=total)
        p = self.out / (MANIFEST + ".tmp")
        with open(p, "w") as f:
            json.dump(manifest, f, indent=1)
        pending.append((p, self.out / MANIFEST))
        p = self.out / "config.json.tmp"
        with open(p, "w") as f:
            json.dump(config, f, indent=2)
        pending.append((p, self.out / "config.json"))
        for a, b in pending:
            os.replace(a, b)
        self.state = "finalized"
        return manifest


def tensor_storage_entry(tensors: dict[str, tuple[tuple[int, ...], str]], bits: float | None) -> dict:
    """One `tensor_storage` entry (reference §1.3) from {name: (shape, dtype name)}."""
    stored = {}
    for n, (shape, dt) in tensors.items():
        numel = 1
        for d in shape:
            numel *= d
        stored[n] = {"shape": list(shape), "n_bytes": numel * DTYPES[dt][1], "dtype": f"torch.{dt}"}
    d: dict = {"stored_tensors": stored}
    if bits is not None:
        d["quant_format"] = "exl3"
        d["bits_per_weight"] = int(bits) if bits == int(bits) else float(bits)
        d["mul1_multiplier"] = MUL1_MULTIPLIER
    return d
