"""llama.cpp importance-matrix files: the GGUF imatrix format (read/write) and the legacy `.dat` (read).

Facts: ../shared/reference/gguf-facts.md §5. Per weight W (a GGUF tensor name) the file holds raw sums of x²
per input column, one vector per matrix (per expert for `*_exps`), and the token count per matrix:
  GGUF:   `W.in_sum2` F32 ne [n_cols, n_mat] and `W.counts` F32 ne [1, n_mat]; KVs general.type = "imatrix",
          imatrix.datasets (string array), imatrix.chunk_count / imatrix.chunk_size (u32); entries sorted by name.
  legacy: int32 n; per entry int32 len, name, int32 ncall, int32 nval, f32[nval] = mean·ncall; optional trailer.
What quantizers use is the mean: sum / count per matrix, 1.0 for a matrix never seen (count 0).
`check_names` refuses an imatrix with no entries, none naming a tensor of the model (one for another model), or
only entries that saw no token.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from mixq.errors import FormatError, InputError
from mixq.formats.atomic import atomic_path
from mixq.formats.gguf_header_check import open_gguf_reader

KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"


@dataclass
class IMatrix:
    """sums[name]: float32 (n_mat, n_cols) Σx²; counts[name]: float32 (n_mat,) rows seen per matrix."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 512

    def add(self, name: str, sum_x2: np.ndarray, count: np.ndarray | float) -> None:
        """Accumulate statistics for one weight (sum_x2 (n_mat, n) or (n,); count per matrix)."""
        s = np.asarray(sum_x2, dtype=np.float64).reshape(-1, np.shape(sum_x2)[-1])
        c = np.broadcast_to(np.asarray(count, dtype=np.float64), (s.shape[0],)).copy()
        if name in self.sums:
            if self.sums[name].shape != s.shape:
                raise InputError(f"imatrix {name}: shape {s.shape} != earlier {self.sums[name].shape}")
            self.sums[name] = self.sums[name] + s
            self.counts[name] = self.counts[name] + c
        else:
            self.sums[name], self.counts[name] = s, c

    def means(self) -> dict[str, np.ndarray]:
        """What llama-quantize feeds the encoders: flattened (n_mat·n,) mean x², 1.0 where count is 0."""
        out = {}
        for name, s in self.sums.items():
            c = np.asarray(self.counts[name], dtype=np.float64).reshape(-1, 1)
            m = np.where(c > 0, s / np.maximum(c, 1e-30), 1.0)
            out[name] = m.astype(np.float32).reshape(-1)
        return out


def write_imatrix(path: str | Path, im: IMatrix) -> Path:
    """Write `im` in llama.cpp's GGUF imatrix format (temp name, then rename)."""
    path = Path(path)
    with atomic_path(path) as tmp:  # a failed write (disk full, Ctrl-C) leaves nothing behind
        w = gguf.GGUFWriter(tmp, "imatrix")
        try:
            w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # llama-imatrix files carry no architecture
            w.add_string(gguf.Keys.General.TYPE, "imatrix")
            if im.datasets:
                w.add_array(KEY_DATASETS, list(im.datasets))
            else:
                w.add_key_value(KEY_DATASETS, [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
            w.add_uint32(KEY_CHUNK_COUNT, int(im.chunk_count))
            w.add_uint32(KEY_CHUNK_SIZE, int(im.chunk_size))
            for name in sorted(im.sums):
                s = np.ascontiguousarray(im.sums[name], dtype=np.float32)
                c = np.ascontiguousarray(np.asarray(im.counts[name], dtype=np.float32).reshape(-1, 1))
                w.add_tensor(f"{name}.in_sum2", s)
                w.add_tensor(f"{name}.counts", c)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return path


def _scalar_int(path: Path, fields: dict, key: str) -> int:
    """A UINT32 scalar KV of an imatrix file (§5.2), FormatError naming the key otherwise."""
    f = fields[key]
    if f.types != [GGUFValueType.UINT32]:
        raise FormatError(f"{path}: imatrix key {key!r} is not a UINT32 ({', '.join(t.name for t in f.types)})")
    return int(f.contents())


def _read_gguf(path: Path) -> IMatrix:
    try:
        r = open_gguf_reader(path)
    except FormatError as e:
        detail = str(e).removeprefix(f"{path}: ")
        raise FormatError(f"{path}: not a GGUF imatrix file (unreadable GGUF: {detail})") from None
    f = r.fields
    if KEY_CHUNK_COUNT not in f or KEY_CHUNK_SIZE not in f:
        raise FormatError(f"{path}: GGUF without imatrix.chunk_count / imatrix.chunk_size (not an imatrix file)")
    ds = f.get(KEY_DATASETS)
    datasets: list[str] = []
    if ds is not None and len(ds.data):
        if ds.types[:1] != [GGUFValueType.ARRAY] or ds.types[-1] != GGUFValueType.STRING:
            raise FormatError(f"{path}: imatrix key {KEY_DATASETS!r} is not a string array")
        datasets = list(ds.contents())
    im = IMatrix(datasets=datasets, chunk_count=_scalar_int(path, f, KEY_CHUNK_COUNT),
                 chunk_size=_scalar_int(path, f, KEY_CHUNK_SIZE))
    tens = {t.name: t for t in r.tensors}
    for tname, t in tens.items():
        if tname.endswith(".counts") and tname[: -len(".counts")] + ".in_sum2" not in tens:
            raise FormatError(f"{path}: {tname} has no matching {tname[: -len('.counts')]}.in_sum2")
        if not tname.endswith(".in_sum2"):
            continue
        base = tname[: -len(".in_sum2")]
        c = tens.get(base + ".counts")
        if c is None:
            raise FormatError(f"{path}: {tname} has no matching {base}.counts")
        for x in (t, c):  # llama-imatrix stores both as F32; any other type would be misread as floats
            if x.tensor_type != GGMLQuantizationType.F32:
                raise FormatError(f"{path}: imatrix tensor {x.name}: type {x.tensor_type.name}, expected F32")
        if int(c.shape[0]) != 1:
            raise FormatError(f"{path}: {c.name}: ne {[int(d) for d in c.shape]}, expected [1, matrices]")
        s = np.asarray(t.data, dtype=np.float32).reshape(-1, int(t.shape[0]))
        cnt = np.asarray(c.data, dtype=np.float32).reshape(-1)
        if cnt.shape[0] != s.shape[0]:
            raise FormatError(f"{path}: {base}: {s.shape[0]} matrices but {cnt.shape[0]} counts")
        im.sums[base], im.counts[base] = s.astype(np.float64), cnt.astype(np.float64)
    return im


def _read_legacy(path: Path) -> IMatrix:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise FormatError(f"{path}: truncated legacy imatrix at byte {pos}")
        v = struct.unpack_from(fmt, data, pos)
        pos += size
        return v

    (n,) = take("<i")
    if n < 0 or 12 * n > len(data):  # an entry takes at least 12 bytes (name length, calls, values)
        raise FormatError(f"{path}: entry count {n} does not fit in {len(data)} bytes")
    im = IMatrix()
    for _ in range(n):
        (ln,) = take("<i")
        if not 0 < ln <= len(data) - pos:
            raise FormatError(f"{path}: name length {ln} at byte {pos - 4}")
        name = data[pos:pos + ln].decode("utf-8")
        pos += ln
        ncall, nval = take("<ii")
        if not 0 <= 4 * nval <= len(data) - pos:
            raise FormatError(f"{path}: {nval} values of {name!r} at byte {pos} run past the end")
        vals = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float64)
        pos += 4 * nval
        # stored values are mean·ncall; keep means with count = ncall (per-expert counts are not stored)
        im.sums[name] = vals.reshape(1, -1)
        im.counts[name] = np.array([float(max(ncall, 1))])
    if pos + 8 <= len(data):
        (im.chunk_count,) = take("<i")
        (dl,) = take("<i")
        im.datasets = [data[pos:pos + dl].decode("utf-8", "replace")] if dl > 0 else []
    return im


def read_imatrix(path: str | Path) -> IMatrix:
    """Read a GGUF imatrix or a legacy `.dat` (detected by the GGUF magic)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such imatrix file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        return check_values(path, _read_gguf(path))
    try:
        im = _read_legacy(path)
    except (FormatError, UnicodeDecodeError) as e:  # no GGUF magic and no legacy layout: say what was expected
        detail = str(e).removeprefix(f"{path}: ")
        raise FormatError(f"{path}: not a GGUF imatrix file (no GGUF magic), nor a legacy .dat imatrix ({detail})") \
            from None
    return check_values(path, im)


def check_values(path: str | Path, im: IMatrix) -> IMatrix:
    """InputError naming the file and entry when a sum of squares or a count is negative, NaN or Inf: no
    calibration produces one, and the encoders would weight the rounding error with it."""
    for name in sorted(im.sums):
        for what, v in (("sum of squares", im.sums[name]), ("token count", im.counts[name])):
            v = np.asarray(v)
            bad = ~np.isfinite(v) | (v < 0)
            if bad.any():
                first = v.reshape(-1)[int(np.flatnonzero(bad.reshape(-1))[0])]
                raise InputError(f"{path}: imatrix entry {name}: {int(bad.sum())} {what} value(s) negative or "
                                 f"non-finite (first {first}); the file is corrupt")
    return im


def check_names(im: IMatrix, names: Iterable[str], where: str = "--imatrix") -> IMatrix:
    """InputError naming `where` when `im` has no entries, or when none of its entry names is one of `names` (the
    model's GGUF tensor names): such a file gives no tensor importance data, which would pass unnoticed. An
    imatrix that covers only some tensors is normal (llama-imatrix never sees the NextN block) and passes."""
    if not im.sums:
        raise InputError(f"{where}: the imatrix has no entries")
    wanted = set(names)
    if not any(n in wanted for n in im.sums):
        first = sorted(im.sums)[0]
        example = next((n for n in sorted(wanted) if n.startswith("blk.")), next(iter(sorted(wanted)), "?"))
        raise InputError(f"{where}: none of the imatrix's {len(im.sums)} entries names a tensor of this model "
                         f"(first entry {first!r}; the model's GGUF names are like {example!r}); was it made for "
                         "another model?")
    ours = [n for n in im.sums if n in wanted]
    if not any(np.asarray(im.counts[n]).sum() > 0 for n in ours):  # means of 1.0 everywhere: no importance at all
        raise InputError(f"{where}: the imatrix's {len(ours)} entries for this model's tensors hold no data (every "
                         "token count is 0)")
    return im
