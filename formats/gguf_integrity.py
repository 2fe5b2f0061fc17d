"""Integrity seal of the GGUF files mixq writes: per-tensor sha256, a header digest and a conversion id.

Every file (each shard of a split set) carries, under keys llama.cpp ignores (it skips unknown keys):
  mixq.integrity.algorithm      "sha256"
  mixq.integrity.tensor_sha256  [hex digest of each tensor's data bytes, in this file's tensor-info order]
  mixq.integrity.header_sha256  hex digest of every other metadata key and every tensor info of this file
  mixq.integrity.conversion_id  hex sha256 over "name digest" lines of all tensors of the whole set, in order:
                                identical in every shard of one conversion, so a shard of another one shows
The header is written before the data, so the keys are written as placeholders of the final length and filled
in place once the data is on disk (`seal`); tensor data and its offsets are untouched by the seal.
`integrity_problems(paths)` re-reads the files and lists every mismatch (verify runs it, with or without decode).
A file without these keys (llama-quantize's, gguf-py's, any other writer's) is not sealed, which is no problem:
`integrity_note` tells verify's reader that only its structure and decode were checked.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable

import gguf
import numpy as np

from mixq.errors import FormatError
from mixq.formats.gguf_header_check import open_gguf_reader

PREFIX = "mixq.integrity."
KEY_ALGORITHM = PREFIX + "algorithm"
KEY_TENSORS = PREFIX + "tensor_sha256"
KEY_HEADER = PREFIX + "header_sha256"
KEY_CONVERSION = PREFIX + "conversion_id"
ALGORITHM = "sha256"
_HEX_LEN = 64
_PLACEHOLDER = "0" * _HEX_LEN


def data_sha256(arr: np.ndarray) -> str:
    """sha256 of an array's bytes as written to the file (C order, native byte order)."""
    buf = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return hashlib.sha256(buf).hexdigest()


def conversion_id(names_and_digests: Iterable[tuple[str, str]]) -> str:
    """The id every shard of one conversion carries: a digest of all tensors' names and digests, in order."""
    h = hashlib.sha256()
    for name, digest in names_and_digests:
        h.update(f"{name} {digest}\n".encode())
    return h.hexdigest()


def sealed_writer(path: Path, arch: str, **kwargs: Any):
    """A gguf-py GGUFWriter whose every output file (each shard) gets placeholder integrity keys, sized for
    its own tensors, next to the split keys gguf-py adds per shard."""
    class _SealedWriter(gguf.GGUFWriter):
        def add_shard_kv_data(self) -> None:
            super().add_shard_kv_data()  # single file: nothing; split: split.* keys into every shard
            for kv, tensors in zip(self.kv_data, self.tensors):
                S, A = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
                kv[KEY_ALGORITHM] = gguf.GGUFValue(ALGORITHM, S)
                kv[KEY_TENSORS] = gguf.GGUFValue([_PLACEHOLDER] * len(tensors), A, sub_type=S)
                kv[KEY_HEADER] = gguf.GGUFValue(_PLACEHOLDER, S)
                kv[KEY_CONVERSION] = gguf.GGUFValue(_PLACEHOLDER, S)

    return _SealedWriter(path, arch, **kwargs)


def _header_sha256(reader) -> str:
    """Digest of the raw bytes of every key/value (the integrity keys excepted) and every tensor info."""
    h = hashlib.sha256()
    for name, field in reader.fields.items():
        if name.startswith(PREFIX):
            continue
        for part in field.parts:
            h.update(np.ascontiguousarray(part).view(np.uint8).tobytes())
    for t in reader.tensors:
        for part in t.field.parts:
            h.update(np.ascontiguousarray(part).view(np.uint8).tobytes())
    return h.hexdigest()


def _put_string(field, index: int, text: str) -> None:
    """Overwrite the index-th string of a field in the memory-mapped file (same length: placeholders)."""
    part = field.parts[field.data[index]]
    raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    if part.shape != raw.shape:
        raise FormatError(f"{field.name}: placeholder of {part.size} bytes cannot hold {raw.size}")
    part[:] = raw


def seal(paths: list[Path], digests: dict[str, str]) -> str:
    """Fill the placeholder keys of freshly written `paths` (one conversion, shards in order) from the data
    digests `digests` {tensor name: hex}; returns the conversion id."""
    readers = [gguf.GGUFReader(p, "r+") for p in paths]
    try:
        order = [[t.name for t in r.tensors] for r in readers]
        cid = conversion_id((n, digests[n]) for names in order for n in names)
        for r, names in zip(readers, order):
            f = r.fields[KEY_TENSORS]
            for i, n in enumerate(names):
                _put_string(f, i, digests[n])
            _put_string(r.fields[KEY_CONVERSION], 0, cid)
            _put_string(r.fields[KEY_HEADER], 0, _header_sha256(r))
            r.data.flush()
        return cid
    finally:
        del readers


def _string(reader, key: str) -> str | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        v = f.contents()
    except Exception:  # noqa: BLE001 - a corrupt field reads as absent, reported by the caller
        return None
    return v if isinstance(v, str) else None


def set_readers(paths: list[Path], readers: list | None = None) -> list:
    """gguf-py GGUFReaders of every file of a GGUF (set): those of `readers` given, the others opened (headers
    checked first, formats/gguf_header_check)."""
    return [r if r is not None else open_gguf_reader(p) for p, r in zip(paths, readers or [None] * len(paths))]


def is_sealed_set(paths: list[Path], readers: list | None = None) -> bool:
    """True when any file of a GGUF (set) carries mixq's integrity keys (headers only are read)."""
    return any(KEY_TENSORS in r.fields for r in set_readers(paths, readers))


def integrity_note(sealed: bool, checksums: int, *, decoded: bool) -> str:
    """The line `mixq verify` prints about what it could check: mixq's seal where the file carries one
    (llama-quantize outputs and other writers' files do not), else the structure (and decode) alone."""
    what = "structure and decode checked" if decoded else "structure checked"
    if not sealed:
        return f"no mixq seal: {what}"
    return f"mixq seal: {checksums} tensor sha256 and {what}"


def integrity_problems(paths: list[Path], readers: list | None = None) -> tuple[list[str], int]:
    """Re-hash every tensor of a GGUF (all shards of a split set, in order) against its integrity keys;
    `readers` (gguf-py GGUFReaders of `paths`, None where not open yet) saves parsing the headers again.

    Returns (problems, tensors checked). A set with no integrity keys at all (not written by mixq) gives no
    problem and 0 checked; a set where some shards have them and others do not is reported."""
    readers = set_readers(paths, readers)
    sealed = [KEY_TENSORS in r.fields for r in readers]
    if not any(sealed):
        return [], 0
    problems: list[str] = []
    all_pairs: list[tuple[str, str]] = []
    ids: list[str | None] = []
    checked = 0
    for p, r, s in zip(paths, readers, sealed):
        if not s:
            problems.append(f"{p.name}: carries no {KEY_TENSORS} while other shards of the set do "
                            "(a shard of another conversion?)")
            ids.append(None)
            continue
        if _string(r, KEY_ALGORITHM) != ALGORITHM:
            problems.append(f"{p.name}: {KEY_ALGORITHM} is {_string(r, KEY_ALGORITHM)!r}, expected {ALGORITHM!r}")
            continue
        if _string(r, KEY_HEADER) != _header_sha256(r):
            problems.append(f"{p.name}: metadata or tensor infos changed since conversion ({KEY_HEADER} mismatch)")
        try:
            stored = list(r.fields[KEY_TENSORS].contents())
        except Exception:  # noqa: BLE001
            stored = []
        if len(stored) != len(r.tensors):
            problems.append(f"{p.name}: {KEY_TENSORS} lists {len(stored)} digests for {len(r.tensors)} tensors")
            continue
        for t, want in zip(r.tensors, stored):
            got = data_sha256(t.data)
            checked += 1
            if got != want:
                problems.append(f"{t.name}: data differs from the conversion's (sha256 {got[:12]}… recorded "
                                f"{want[:12]}…, in {p.name})")
        all_pairs += [(t.name, d) for t, d in zip(r.tensors, stored)]
        ids.append(_string(r, KEY_CONVERSION))
    known = [i for i in ids if i is not None]
    if known and len(set(known)) > 1:
        first = known[0]
        for p, i in zip(paths, ids):
            if i is not None and i != first:
                problems.append(f"{p.name}: conversion id {i[:12]}… differs from {paths[0].name}'s {first[:12]}… "
                                "(a shard of another conversion)")
    elif known and len(known) == len(paths) and conversion_id(all_pairs) != known[0]:
        problems.append(f"{paths[0].name}: {KEY_CONVERSION} does not match the recorded tensor digests")
    return problems, checked
