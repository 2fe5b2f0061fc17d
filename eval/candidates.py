"""Candidates for `mixq eval`: format detection, size on disk, and dequantized HF-named weights.

Every candidate (HF checkpoint, EXL3 directory, GGUF file) becomes a dict {HF checkpoint name: tensor}
that is loaded into the reference architecture; the format readers are imported lazily so that eval
works for the formats whose readers exist.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


@dataclass(frozen=True)
class Candidate:
    path: Path
    format: str  # "hf" | "exl3" | "gguf"
    bytes: int   # weight files on disk (see `weight_bytes`)


def detect_format(path: Path) -> str:
    """'gguf' for a file starting with the GGUF magic, 'exl3' for a directory whose config.json has
    quantization_config.quant_method == 'exl3', 'hf' for another directory with safetensors files."""
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return "gguf"
        raise InputError(f"{path}: not a GGUF file (magic {magic!r}) and not a checkpoint directory")
    if path.is_dir():
        cfg = path / "config.json"
        if cfg.is_file():
            try:
                qc = json.loads(cfg.read_text()).get("quantization_config") or {}
            except json.JSONDecodeError as e:
                raise FormatError(f"{cfg}: invalid JSON ({e})") from e
            if qc.get("quant_method") == "exl3":
                return "exl3"
        if any(path.glob("*.safetensors")):
            return "hf"
        raise InputError(f"{path}: directory holds no *.safetensors files (pass a GGUF file itself)")
    raise InputError(f"{path}: no such file or directory")


def gguf_split_paths(path: Path) -> list[Path]:
    """All shards of a gguf-split set given any shard (or the single file)."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def weight_bytes(path: Path, fmt: str) -> int:
    """Bytes on disk of the weights: every shard of a GGUF; the *.safetensors files of a directory."""
    if fmt == "gguf":
        files = gguf_split_paths(Path(path))
        missing = [p for p in files if not p.is_file()]
        if missing:
            raise InputError(f"{path}: GGUF split shard missing: {missing[0]}")
    else:
        files = sorted(Path(path).glob("*.safetensors"))
    return int(sum(p.stat().st_size for p in files))


def open_candidate(path: str | Path) -> Candidate:
    p = Path(path)
    fmt = detect_format(p)
    return Candidate(path=p, format=fmt, bytes=weight_bytes(p, fmt))


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory by checkpoint name, FP8 blocks dequantized (float32)."""
    try:
        from mixq.formats.checkpoint import open_checkpoint
    except ImportError:
        open_checkpoint = None
    if open_checkpoint is not None:
        ckpt = open_checkpoint(path)
        return {name: ckpt.get(name, dtype=torch.float32) for name in ckpt.names()}
    # Fallback while the shared loader is absent: plain safetensors, no FP8.
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    if any(k.endswith("_scale_inv") for k in out):
        raise InputError(f"{path}: FP8 checkpoint needs mixq.formats.checkpoint (not available)")
    return {k: v.to(torch.float32) for k, v in out.items()}


def read_candidate_weights(cand: Candidate) -> dict[str, torch.Tensor]:
    """Dequantized HF-named weights of a candidate, via the reader of its format."""
    if cand.format == "hf":
        return read_hf_weights(cand.path)
    if cand.format == "exl3":
        try:
            from mixq.formats.exl3_reader import read_exl3
        except ImportError as e:
            raise InputError(f"{cand.path}: EXL3 candidates are not supported yet (no EXL3 reader: {e})") from e
        return read_exl3(cand.path)
    if cand.format == "gguf":
        try:
            from mixq.formats.gguf_reader import read_gguf_weights
        except ImportError as e:
            raise InputError(f"{cand.path}: GGUF candidates are not supported yet (no GGUF reader: {e})") from e
        return read_gguf_weights(cand.path)
    raise InputError(f"{cand.path}: unknown candidate format {cand.format!r}")


def _is_text_tensor(name: str, n_layers: int) -> bool:
    """True for tensors the text forward uses (not vision, not NextN/MTP layers)."""
    parts = name.split(".")
    if "visual" in parts:
        return False
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= n_layers:
            return False
    return True


def merge_with_reference(
    cand: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], n_layers: int, where: Path
) -> dict[str, torch.Tensor]:
    """The candidate's tensors over the reference's: every text tensor must come from the candidate with the
    reference shape; vision / MTP tensors a format leaves out are taken from the reference (unused by the text forward)."""
    unknown = sorted(set(cand) - set(ref))
    if unknown:
        raise FormatError(f"{where}: {len(unknown)} tensors not in the reference, e.g. {unknown[0]}")
    missing = sorted(n for n in ref if n not in cand and _is_text_tensor(n, n_layers))
    if missing:
        raise FormatError(f"{where}: {len(missing)} reference tensors missing, e.g. {missing[0]}")
    for name, t in cand.items():
        if tuple(t.shape) != tuple(ref[name].shape):
            raise FormatError(f"{where}: tensor {name} has shape {tuple(t.shape)}, reference {tuple(ref[name].shape)}")
    merged = dict(ref)
    merged.update(cand)
    return merged
