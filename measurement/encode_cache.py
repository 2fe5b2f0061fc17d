"""A content-addressed store of encoded GGUF tensors, so that a family of GGUFs encodes each (tensor, type) once.

An entry is the ggml bytes (or float array) that `conversion/gguf/workers.encode` made of one source tensor in one
type, under `ROOT/<key>.npy`; the key is the sha256 of everything the bytes depend on: the cache layout, the
mixq version (the encoders), the GGUF tensor name and shape, the ggml type, the sha256 of the float32 source
tensor and of its importance vector(s), and the rounding ("exact"; or the Hessian rounding's tag: its
calibration tokens, damping, passes and device, for the codes `--rounding hessian` makes before tuning, which
depend on the source weights and the source model's calibration forward only). The thread count does not enter
it, nor, for ggml's encoders, the device: they give the same bytes on any of them. Entries are written under a temporary name and renamed (formats/atomic), so a killed
run leaves whole entries only and a rerun serves them; a second run on the same cache writes the same bytes.
Source digests are kept in memory per (checkpoint, tensor) for the life of the object, so the members of one
family after the first do not read the checkpoint again to find their keys.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from mixq.formats.receipt import mixq_version
from mixq.errors import FormatError
from mixq.formats.atomic import atomic_open

CACHE_LAYOUT = 1
CACHE_DIR = ".mixq-cache"  # under a family's OUT_DIR


def array_sha256(a: np.ndarray | None) -> str:
    """sha256 of an array's dtype, shape and C-order bytes ("none" for None)."""
    if a is None:
        return "none"
    a = np.ascontiguousarray(a)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


@dataclass
class EncodeCache:
    """Encoded tensors under `root` (created on first write); `hits` / `writes` count this object's use."""

    root: Path
    hits: int = 0
    writes: int = 0
    _sources: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    def key(self, source: str, name: str, qtype: str, shape: tuple[int, ...],
            load: Callable[[], tuple[np.ndarray, np.ndarray | None]], rounding: str = "exact") -> str:
        """The key of tensor `name` of checkpoint `source` in `qtype`; `load()` gives (x, imatrix) when the source
        digests are not known yet. `rounding` names anything else the bytes depend on ("exact": ggml's encoders;
        Hessian rounding: its calibration, damping and device, `hessian_rounding_tag`)."""
        digests = self._sources.get((source, name))
        if digests is None:
            x, w = load()
            digests = self._sources[(source, name)] = (array_sha256(np.asarray(x, dtype=np.float32)),
                                                       array_sha256(None if w is None
                                                                    else np.asarray(w, dtype=np.float32)))
        text = "\n".join([f"layout {CACHE_LAYOUT}", f"mixq {mixq_version()}", f"tensor {name}",
                          f"shape {tuple(int(d) for d in shape)}", f"type {qtype.upper()}", f"rounding {rounding}",
                          f"source {digests[0]}", f"imatrix {digests[1]}"])
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.npy"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def get(self, key: str) -> np.ndarray:
        """The entry `key` (FormatError naming the file when it cannot be read: delete the cache to rebuild)."""
        p = self.path(key)
        try:
            arr = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise FormatError(f"{p}: damaged encode-cache entry ({e}); delete {self.root} to rebuild it") from None
        self.hits += 1
        return arr

    def put(self, key: str, data: np.ndarray) -> None:
        """Store `data` under `key` atomically (an existing entry holds the same bytes and is kept)."""
        p = self.path(key)
        if p.is_file():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_open(p, "wb") as f:
            np.save(f, np.ascontiguousarray(data), allow_pickle=False)
        self.writes += 1

    def entries(self) -> int:
        """Entries on disk."""
        return len(list(self.root.glob("*.npy"))) if self.root.is_dir() else 0
