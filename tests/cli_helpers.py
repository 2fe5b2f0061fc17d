"""CLI helpers shared by the test modules (tests/ is on pytest's pythonpath: `from cli_helpers import ...`)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from click.testing import CliRunner

from mixq.cli import main
from mixq.formats.gguf_integrity import PREFIX as SEAL_PREFIX


def run_cli(*args):
    """`mixq ARGS...` in this process (click's runner); arguments may be paths."""
    return CliRunner().invoke(main, [str(a) for a in args])


def error_lines(stderr: str) -> list[str]:
    """The `mixq: error` lines of a run's stderr, as a terminal shows them: a progress bar redraws with carriage
    returns and, closing, moves the cursor with an escape that can precede the error on its byte line (a bar is
    drawn only once its step lasts long enough, e.g. on a loaded machine)."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", stderr)
    lines = (ln.lstrip() for ln in re.split(r"[\r\n]+", text))  # a cleared bar leaves blanks before the line
    return [ln for ln in lines if ln.startswith("mixq: error")]


def error_line(r) -> str:
    """The single `mixq: error:` line of a run that must exit 2 (no traceback)."""
    assert r.exit_code == 2, r.output[-2000:]
    assert "Traceback" not in r.output
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr[-2000:]
    return lines[0]


def copy_model(src: Path, dst: Path) -> Path:
    """A writable copy of a model directory (the shared fixtures are read-only) to corrupt or edit."""
    shutil.copytree(src, dst)
    for p in [dst, *dst.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def rewrite_gguf(src: Path, dst: Path, *, drop: Callable[[str], bool] = lambda n: False,
                 tensors: dict[str, np.ndarray] | None = None, kv: dict[str, object] | None = None) -> Path:
    """`src` copied through gguf-py's GGUFWriter without mixq's seal: tensors for which `drop` is true left out,
    `tensors` {name: array} written in place of (or beside) the file's own, `kv` {key: value or None to drop}
    replacing keys of the same type."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    kv = kv or {}
    for name, f in r.fields.items():
        if name.startswith(("GGUF.", SEAL_PREFIX)) or name == "general.architecture":
            continue
        value = kv[name] if name in kv else f.contents()
        if value is None:
            continue
        vtype = f.types[0]
        w.add_key_value(name, value, vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    extra = dict(tensors or {})
    for t in r.tensors:
        if drop(t.name):
            continue
        if t.name in extra:
            w.add_tensor(t.name, extra.pop(t.name))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, arr in extra.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def write_compare_report(tmp_path: Path) -> Path:
    """A small valid `mixq eval --json` report (one GGUF candidate) at tmp_path/r.json, for `mixq compare`."""
    cand = {"path": "/q/Q8_0.gguf", "format": "gguf", "bytes": 10**6, "bpw": 8.0, "kld_mean": 0.01,
            "kld_mean_err": 0.001, "kld_median": 0.005, "kld_p90": 0.02, "kld_p99": 0.05, "kld_p999": 0.09,
            "kld_max": 0.2, "top1": 0.99, "ppl_ref": 10.0, "ppl": 10.01, "dppl": 0.01, "rms_dp": 0.01,
            "positions": 255}
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"reference": "/m/mini", "text": "t.txt", "ctx": 512, "windows": 1,
                             "candidates": [cand]}))
    return p
