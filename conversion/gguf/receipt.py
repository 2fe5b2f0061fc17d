"""The receipt of one GGUF conversion (formats/receipt.py writes it as `mixq.receipt.*` keys): what was asked,
what the plan gave, which calibration, which mixq, and the options that decide the bytes.

Left out on purpose, so that the bytes depend only on what decides them: the thread count, the device, progress,
--overwrite, output paths, and the directories of input files (a file is named by its base name and sha256).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from mixq.formats.gguf_layout import tensor_bytes
from mixq.formats.receipt import mixq_version
from mixq.formats.safetensors_io import sha256_file
from mixq.planning.sizes import parse_size
from mixq.planning.types import numel

# options that never change a byte of the output, or are output paths, or are recorded elsewhere in the receipt
# (tune_group_iters and refine_passes: under calibration.hessian, when given); EXL3's devices and resume too: a
# family records its members' options with this; gpu_memory: the pieces it sets change memory, not bytes, except
# the expert groups of block-output tuning, which the free memory set before it (runtime/memory_budget.STAGES)
NOT_IN_RECEIPT = ("threads", "device", "devices", "resume", "progress", "overwrite", "mmproj", "imatrix",
                  "calibration", "measure", "chat_template", "size", "bpw", "qtype", "tune_group_iters",
                  "refine_passes", "profile", "gpu_memory")
_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def cached_file_sha256(path: str | Path) -> str:
    """sha256_file, remembered per (path, size, mtime) for the process: a --size fit builds the header often."""
    p = Path(path)
    st = p.stat()
    k = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if k not in _SHA_MEMO:
        _SHA_MEMO[k] = sha256_file(p)
    return _SHA_MEMO[k]


def _named_file(path) -> dict:
    """{"file": base name, "sha256"} of an input file; a built-in or in-memory input by name only."""
    if isinstance(path, (str, Path)) and Path(path).is_file():
        return {"file": Path(path).name, "sha256": cached_file_sha256(path)}
    return {"file": str(path) if isinstance(path, (str, Path)) else "in-memory"}


def receipt_target(o) -> dict:
    if o.qtype is not None:
        return {"type": o.qtype}
    if o.bpw is not None:
        return {"bpw": float(o.bpw)}
    return {"size": parse_size(o.size)}


def _plan_summary(run) -> dict:
    """Tensor bytes, their bpw and the type counts of the plan (each tensor's type is in the file itself)."""
    counts: dict[str, int] = {}
    for t in run.types:
        counts[t] = counts.get(t, 0) + 1
    total = sum(tensor_bytes(t, s.shape) for s, t in zip(run.specs, run.types))
    params = sum(numel(s.shape) for s in run.specs)
    return {"tensor_bytes": total, "bpw": round(8.0 * total / max(params, 1), 4), "types": dict(sorted(counts.items()))}


def _calibration(run) -> dict:
    o = run.opts
    cal: dict[str, Any] = {}
    if run.imx is not None:
        im = run.imatrix_obj
        entry = _named_file(o.imatrix)
        if entry.get("file") == "in-memory":
            h = hashlib.sha256()
            for name in sorted(run.imx):
                h.update(name.encode())
                h.update(run.imx[name].tobytes())
            entry["sha256"] = h.hexdigest()
        if im is not None:
            entry.update(datasets=[os.path.basename(str(d)) for d in getattr(im, "datasets", [])],
                         chunks=int(getattr(im, "chunk_count", 0)), chunk_size=int(getattr(im, "chunk_size", 0)))
        cal["imatrix"] = entry
    if o.rounding == "hessian":
        files = [_named_file(c) for c in o.calibration] or [{"file": "builtin"}]
        cal["hessian"] = {"files": files, "rows": o.rows, "seq_len": o.seq_len, "tune_iters": o.tune_iters}
        for name in ("tune_group_iters", "refine_passes"):
            if getattr(o, name) is not None:
                cal["hessian"][name] = getattr(o, name)
    return cal


def receipt_options(o) -> dict:
    d = {k: v for k, v in o.to_dict().items() if k not in NOT_IN_RECEIPT}
    if o.measure is not None:  # a curves file or mapping: by digest (a mapping can hold every tensor's curve)
        if isinstance(o.measure, Mapping):
            d["measure"] = {"sha256": hashlib.sha256(json.dumps(o.measure, sort_keys=True, default=str)
                                                     .encode()).hexdigest()}
        else:
            d["measure"] = _named_file(o.measure)
    if getattr(o, "chat_template", None) is not None:  # GGUF only
        d["chat_template"] = _named_file(o.chat_template)
    return d


def conversion_receipt(run) -> dict:
    """The receipt dict (formats/receipt.FIELDS) of a GGUF conversion run (conversion/gguf/pipeline's state)."""
    o = run.opts
    return {"mixq": mixq_version(), "source": Path(str(run.ckpt.path)).name, "target": receipt_target(o),
            "plan": _plan_summary(run), "calibration": _calibration(run), "options": receipt_options(o)}
