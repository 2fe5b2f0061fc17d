"""Compare two GGUF files section by section: is everything but mixq's integrity keys byte-identical?

    python bench/tools/gguf_sections.py OLD.gguf NEW.gguf [--ignore-key KEY ...] [--json OUT.json]

Prints, for each file, sha256 of the whole file, of its tensor data section (from the aligned data offset to the
end) and of its metadata without the `mixq.integrity.*` keys and the key count; then whether the tensor data,
the tensor infos (name, type, shape, offset within the data section) and the other metadata are equal. The seal
(formats/gguf_integrity) must change the header only: run this on a file written before it and one after.
`--ignore-key` leaves a key out of the metadata digest (e.g. quantize.imatrix.file, which holds the imatrix path
the two runs were given). Exit status 1 when anything but the integrity keys (and ignored keys) differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

PREFIX = "mixq.integrity."
SKIP = ("GGUF.kv_count",)  # the count of keys changes with the integrity keys by design


def _sha(buf) -> str:
    return hashlib.sha256(np.ascontiguousarray(buf).view(np.uint8)).hexdigest()


def sections(path: Path, ignore: tuple[str, ...] = ()) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    meta = hashlib.sha256()
    for name, f in r.fields.items():
        if name.startswith(PREFIX) or name in SKIP or name in ignore:
            continue
        for part in f.parts:
            meta.update(np.ascontiguousarray(part).view(np.uint8).tobytes())
    infos = [(t.name, t.tensor_type.name, [int(x) for x in t.shape], int(t.data_offset) - int(r.data_offset))
             for t in r.tensors]
    return {"file": path.name, "bytes": path.stat().st_size, "file_sha256": _sha(r.data),
            "data_sha256": _sha(r.data[r.data_offset:]), "data_bytes": int(len(r.data) - r.data_offset),
            "metadata_sha256": meta.hexdigest(), "tensor_infos_sha256": hashlib.sha256(
                json.dumps(infos).encode()).hexdigest(),
            "integrity_keys": sorted(k for k in r.fields if k.startswith(PREFIX))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--ignore-key", action="append", default=[], help="metadata key left out of the comparison")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    a = ap.parse_args()
    old, new = sections(a.old, tuple(a.ignore_key)), sections(a.new, tuple(a.ignore_key))
    same = {k: old[k] == new[k] for k in ("data_sha256", "tensor_infos_sha256", "metadata_sha256")}
    res = {"old": old, "new": new, "ignored_keys": a.ignore_key, "equal": same,
           "only_integrity_keys_differ": all(same.values())}
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    sys.exit(0 if res["only_integrity_keys_differ"] else 1)


if __name__ == "__main__":
    main()
