"""Reference log-prob files (`--save-ref` / `--ref-logits`): a safetensors file written window by window.

Layout: tensor `tokens` int32 (windows, ctx), then one tensor `logprobs.NNNNNN` (scored, vocab) per window,
float32 (exact) or float16 (half the size); `__metadata__` holds format, ctx, first, vocab, windows,
dtype, reference and text. The header is written first (all shapes are known up front), then each
window's rows are appended as they are computed, so the whole text's logits are never in memory.
Size ≈ windows · (ctx - 1 - first) · vocab · (4 | 2) bytes.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from mixq.errors import FormatError, InputError

FORMAT_TAG = "mixq-ref-logits-1"
_DTYPES = {"float32": (torch.float32, "F32", 4), "float16": (torch.float16, "F16", 2)}


def ref_file_bytes(windows: int, ctx: int, first: int, vocab: int, dtype: str = "float32") -> int:
    """Data bytes of a reference file (header excluded)."""
    return windows * ctx * 4 + windows * (ctx - 1 - first) * vocab * _DTYPES[dtype][2]


class RefLogitsWriter:
    """Stream reference log-probs to `path` (written under a temporary name, renamed by `close`)."""

    def __init__(self, path: Path, tokens: torch.Tensor, first: int, vocab: int, dtype: str = "float32", meta: dict | None = None):
        if dtype not in _DTYPES:
            raise InputError(f"reference log-prob dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.torch_dtype, st_dtype, size = _DTYPES[dtype]
        n, ctx = tokens.shape
        rows = ctx - 1 - first
        header: dict = {}
        off = n * ctx * 4
        header["tokens"] = {"dtype": "I32", "shape": [n, ctx], "data_offsets": [0, off]}
        for w in range(n):
            nb = rows * vocab * size
            header[f"logprobs.{w:06d}"] = {"dtype": st_dtype, "shape": [rows, vocab], "data_offsets": [off, off + nb]}
            off += nb
        md = {"format": FORMAT_TAG, "ctx": ctx, "first": first, "vocab": vocab, "windows": n, "dtype": dtype}
        md.update(meta or {})
        header["__metadata__"] = {k: str(v) for k, v in md.items()}
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)  # keep the data 8-byte aligned
        self.rows, self.vocab, self.count, self.next = rows, vocab, n, 0
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(hb)) + hb)
        self.f.write(tokens.to(torch.int32).contiguous().numpy().tobytes())

    def add(self, logprobs: torch.Tensor) -> None:
        """Append the next window's (scored, vocab) log-probs."""
        if tuple(logprobs.shape) != (self.rows, self.vocab):
            raise ValueError(f"window log-probs {tuple(logprobs.shape)}, expected {(self.rows, self.vocab)}")
        self.f.write(logprobs.detach().to("cpu", self.torch_dtype).contiguous().numpy().tobytes())
        self.next += 1

    def close(self) -> None:
        self.f.close()
        if self.next != self.count:
            os.unlink(self.tmp)
            raise ValueError(f"{self.path}: {self.next} of {self.count} windows written")
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        if self.tmp.exists():
            os.unlink(self.tmp)


class RefLogitsReader:
    """Windows and per-window log-probs (float32) of a reference file, read lazily."""

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{path}: no such reference log-prob file")
        try:
            self._f = safe_open(str(self.path), framework="pt")
        except (SafetensorError, OSError) as e:
            raise FormatError(f"{path}: not a readable safetensors file ({e})") from e
        md = self._f.metadata() or {}
        if md.get("format") != FORMAT_TAG:
            raise FormatError(f"{path}: not a mixq reference log-prob file (format {md.get('format')!r})")
        self.meta = md
        self.ctx, self.first = int(md["ctx"]), int(md["first"])
        self.vocab, self.count = int(md["vocab"]), int(md["windows"])
        self.tokens = self._f.get_tensor("tokens").to(torch.int64)

    def logprobs(self, w: int) -> torch.Tensor:
        return self._f.get_tensor(f"logprobs.{w:06d}").to(torch.float32)
