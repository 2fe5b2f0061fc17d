"""Reference log-prob files (`--save-ref` / `--ref-logits`): a safetensors file written window by window.

Layout: tensor `tokens` int32 (windows, ctx), then per window the scored rows (ctx - 1 - first, vocab) as
- float32 `logprobs.NNNNNN` (exact) or float16 (half the size), or
- uint16 (half the size, llama.cpp's KL-base idea): `logprobs.NNNNNN` codes of each row's log-probs on a linear
  grid from −16 (code 0) to the row's maximum (code 65535), `logprob_max.NNNNNN` float32 the row maxima, and
  `target_logprob.NNNNNN` float32 the exact log-prob of each row's true next token. Entries at or below −16 are
  the ones the KLD ignores (gguf-facts.md §7.3) and come back as −16; the grid step is at most 16/65535
  (error ≤ 1.2e-4 nats); the true token's log-prob (perplexity) is exact.
`__metadata__` holds format, ctx, first, vocab, windows, dtype, reference and text. The header is written first
(all shapes are known up front), then each window's rows are appended as they are computed, so the whole text's
logits are never in memory.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import safetensors  # safetensors.safe_open looked up per call (tests wrap it)
import torch
from safetensors import SafetensorError

from mixq.errors import FormatError, InputError
from mixq.formats.finite import has_non_finite

FORMAT_TAG = "mixq-ref-logits-1"
U16_FLOOR = -16.0  # code 0; the KLD ignores reference log-probs at or below it
U16_STEPS = 65535
# dtype -> (torch dtype of the rows, safetensors dtype, bytes per entry)
REF_DTYPES = {"float32": (torch.float32, "F32", 4), "float16": (torch.float16, "F16", 2),
              "uint16": (torch.uint16, "U16", 2)}


def ref_file_bytes(windows: int, ctx: int, first: int, vocab: int, dtype: str = "float32") -> int:
    """Data bytes of a reference file (header excluded)."""
    rows = ctx - 1 - first
    extra = 2 * rows * 4 if dtype == "uint16" else 0
    return windows * ctx * 4 + windows * (rows * vocab * REF_DTYPES[dtype][2] + extra)


def encode_u16(lp: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """uint16 codes (rows, vocab), row maxima and the true tokens' exact log-probs of float32 log-probs."""
    lp = lp.float()
    hi = lp.amax(-1, keepdim=True)
    step = ((hi - U16_FLOOR) / U16_STEPS).clamp_min(1e-30)
    codes = ((lp - U16_FLOOR) / step).round().clamp(0, U16_STEPS).to(torch.int32)
    return {"codes": codes.to(torch.uint16), "max": hi.squeeze(-1),
            "target": lp.gather(-1, targets.long().to(lp.device).unsqueeze(-1)).squeeze(-1)}


def decode_u16(codes: torch.Tensor, hi: torch.Tensor, target_lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float32 log-probs from `encode_u16`'s parts (the true tokens' entries exact)."""
    hi = hi.float().unsqueeze(-1)
    lp = U16_FLOOR + codes.to(torch.int32).float() * ((hi - U16_FLOOR) / U16_STEPS)
    return lp.scatter(-1, targets.long().to(lp.device).unsqueeze(-1), target_lp.float().unsqueeze(-1))


def roundtrip(lp: torch.Tensor, dtype: str, targets: torch.Tensor | None = None) -> torch.Tensor:
    """What a `dtype` file gives back for log-probs `lp` (the saving run scores exactly that)."""
    if dtype == "float32":
        return lp.float()
    if dtype == "float16":
        return lp.to(torch.float16).float()
    e = encode_u16(lp, targets)
    return decode_u16(e["codes"], e["max"], e["target"], targets)


class RefLogitsWriter:
    """Stream reference log-probs to `path` (written under a temporary name, renamed by `close`)."""

    def __init__(self, path: Path, tokens: torch.Tensor, first: int, vocab: int, dtype: str = "float32",
                 meta: dict | None = None):
        if dtype not in REF_DTYPES:
            raise InputError(f"reference log-prob dtype must be one of {sorted(REF_DTYPES)}, not {dtype!r}")
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.dtype = dtype
        self.torch_dtype, st_dtype, size = REF_DTYPES[dtype]
        n, ctx = tokens.shape
        rows = ctx - 1 - first
        header: dict = {}
        off = n * ctx * 4
        header["tokens"] = {"dtype": "I32", "shape": [n, ctx], "data_offsets": [0, off]}
        for w in range(n):
            parts = [(f"logprobs.{w:06d}", st_dtype, [rows, vocab], rows * vocab * size)]
            if dtype == "uint16":
                parts += [(f"logprob_max.{w:06d}", "F32", [rows], rows * 4),
                          (f"target_logprob.{w:06d}", "F32", [rows], rows * 4)]
            for name, dt, shape, nb in parts:
                header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nb]}
                off += nb
        md = {"format": FORMAT_TAG, "ctx": ctx, "first": first, "vocab": vocab, "windows": n, "dtype": dtype}
        md.update(meta or {})
        header["__metadata__"] = {k: str(v) for k, v in md.items()}
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)  # keep the data 8-byte aligned
        self.tokens, self.first = tokens, first
        self.rows, self.vocab, self.count, self.next = rows, vocab, n, 0
        try:
            self.f = open(self.tmp, "wb")
            self.f.write(struct.pack("<Q", len(hb)) + hb)
            self.f.write(tokens.to(torch.int32).contiguous().numpy().tobytes())
        except OSError as e:
            self.tmp.unlink(missing_ok=True)
            raise InputError(f"{self.path}: cannot write ({e.strerror or e})") from None

    def add(self, logprobs: torch.Tensor) -> None:
        """Append the next window's (scored, vocab) log-probs."""
        if tuple(logprobs.shape) != (self.rows, self.vocab):
            raise ValueError(f"window log-probs {tuple(logprobs.shape)}, expected {(self.rows, self.vocab)}")
        if self.dtype == "uint16":
            e = encode_u16(logprobs, self.tokens[self.next, self.first + 1:])
            blobs = [e["codes"], e["max"], e["target"]]
        else:
            blobs = [logprobs.detach().to(self.torch_dtype)]
        try:
            for t in blobs:
                self.f.write(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        except OSError as e:
            self.abort()
            raise InputError(f"{self.path}: cannot write ({e.strerror or e})") from None
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
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{path}: no such reference log-prob file")
        try:
            self._f = safetensors.safe_open(str(self.path), framework="pt")
        except (SafetensorError, OSError) as e:
            raise FormatError(f"{path}: not a readable safetensors file ({e})") from e
        md = self._f.metadata() or {}
        if md.get("format") != FORMAT_TAG:
            raise FormatError(f"{path}: not a mixq reference log-prob file (format {md.get('format')!r})")
        self.meta = md
        try:
            self.ctx, self.first = int(md["ctx"]), int(md["first"])
            self.vocab, self.count = int(md["vocab"]), int(md["windows"])
        except (KeyError, ValueError) as e:
            raise FormatError(f"{path}: reference log-prob metadata incomplete ({e})") from None
        self.dtype = md.get("dtype", "float32")
        if self.dtype not in REF_DTYPES:
            raise FormatError(f"{path}: unknown log-prob dtype {self.dtype!r}")
        self._check_layout()
        self.tokens = self._f.get_tensor("tokens").to(torch.int64)
        self._check_tokens()

    def _shape(self, name: str) -> tuple[int, ...] | None:
        try:
            return tuple(self._f.get_slice(name).get_shape())
        except (SafetensorError, KeyError):
            return None

    def _check_layout(self) -> None:
        """The metadata against the tensors the file holds (headers only): a token row per window of ctx tokens,
        and per window the scored rows of the vocabulary's width."""
        p, ctx, first, vocab, n = self.path, self.ctx, self.first, self.vocab, self.count
        if ctx < 2 or not 0 <= first <= ctx - 2 or vocab < 1 or n < 1:
            raise FormatError(f"{p}: metadata ctx {ctx}, first {first}, vocab {vocab}, windows {n} do not describe "
                              "a reference log-prob file")
        if self._shape("tokens") != (n, ctx):
            raise FormatError(f"{p}: metadata says {n} windows of {ctx} tokens, the tokens tensor is "
                              f"{list(self._shape('tokens') or [])}")
        rows = ctx - 1 - first
        parts = [("logprobs", (rows, vocab))]
        if self.dtype == "uint16":
            parts += [("logprob_max", (rows,)), ("target_logprob", (rows,))]
        for w in range(n):
            for part, want in parts:
                got = self._shape(f"{part}.{w:06d}")
                if got != want:
                    raise FormatError(f"{p}: {part}.{w:06d} is {'missing' if got is None else list(got)}, the "
                                      f"metadata (ctx {ctx}, first {first}, vocab {vocab}) implies {list(want)}")

    def _check_tokens(self) -> None:
        """Every token id inside the vocabulary (the scores index the log-probs by them)."""
        bad = (self.tokens < 0) | (self.tokens >= self.vocab)
        if bool(bad.any()):
            w, i = (int(x) for x in bad.nonzero()[0])
            raise FormatError(f"{self.path}: token id {int(self.tokens[w, i])} (window {w}, position {i}) is outside "
                              f"the file's vocabulary of {self.vocab}")

    def check_values(self, windows: int) -> None:
        """The first `windows` windows' log-probs are finite: read once before any forward, so a corrupt file is
        refused before the candidates run, not after."""
        for w in range(min(windows, self.count)):
            lp = self.logprobs(w)
            if has_non_finite(lp.reshape(-1)):
                n_nan, n_inf = int(torch.isnan(lp).sum()), int(torch.isinf(lp).sum())
                r, c = (int(x) for x in (~torch.isfinite(lp)).nonzero()[0])
                raise FormatError(f"{self.path}: window {w} holds non-finite log-probs ({n_nan} NaN, {n_inf} Inf "
                                  f"of {lp.numel()}; first at row {r}, token {c}): the file is corrupt")

    def logprobs(self, w: int) -> torch.Tensor:
        lp = self._f.get_tensor(f"logprobs.{w:06d}")
        if self.dtype != "uint16":
            return lp.to(torch.float32)
        return decode_u16(lp, self._f.get_tensor(f"logprob_max.{w:06d}"),
                          self._f.get_tensor(f"target_logprob.{w:06d}"), self.tokens[w, self.first + 1:])
