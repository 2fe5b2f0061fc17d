"""Outputs are checked before any work: an output that is an input or another output, an existing file, a place
that cannot be written, a full disk -- each is one line (exit 2) naming the path, and nothing is left at OUT."""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from cli_helpers import error_line as _error_line
from cli_helpers import run_cli as _cli


def _no_partials(d: Path) -> bool:
    return not [p for p in d.glob(".*") if "partial" in p.name] if d.is_dir() else True


@pytest.fixture
def files(tmp_path):
    """A directory with a few existing files the cases point outputs at."""
    d = tmp_path / "files"
    d.mkdir()
    for name, data in {"im.gguf": b"GGUF-imatrix", "tmpl.gguf": b"{{ messages }}", "old.gguf": b"old bytes",
                       "proj.gguf": b"old projector", "m-00001-of-00002.gguf": b"split 1"}.items():
        (d / name).write_bytes(data)
    (d / "a-file").write_bytes(b"x")
    (d / "a-dir.gguf").mkdir()
    return d


GGUF = ["--format", "gguf", "--type", "Q8_0"]

# (case id, args after MODEL, the output that must not appear / stay unchanged, fragment of the message)
DATA_LOSS = [
    ("mmproj-is-out", lambda d: ["{o}", *GGUF, "--mmproj", "{o}"], "o.gguf", "same file as OUT"),
    ("out-is-imatrix", lambda d: [d / "im.gguf", *GGUF, "--imatrix", d / "im.gguf"], None, "input --imatrix"),
    ("out-is-template", lambda d: [d / "tmpl.gguf", *GGUF, "--chat-template", d / "tmpl.gguf"], None,
     "input --chat-template"),
    ("mmproj-is-imatrix", lambda d: ["{o}", *GGUF, "--imatrix", d / "im.gguf", "--mmproj", d / "im.gguf"], None,
     "input --imatrix"),
    ("out-exists", lambda d: [d / "old.gguf", *GGUF], None, "--overwrite"),
    ("mmproj-exists", lambda d: ["{o}", *GGUF, "--mmproj", d / "proj.gguf"], "o.gguf", "--overwrite"),
    ("split-exists", lambda d: [d / "m.gguf", *GGUF, "--shard-size", "1M"], "m.gguf", "m-00001-of-00002.gguf"),
]


@pytest.mark.parametrize("case", DATA_LOSS, ids=[c[0] for c in DATA_LOSS])
def test_no_output_replaces_an_input_or_an_existing_file(case, tiny_model, files):
    _, make, new, needle = case
    o = files / "o.gguf"
    before = {p.name: p.read_bytes() for p in files.iterdir() if p.is_file()}
    args = [str(a).replace("{o}", str(o)) for a in make(files)]
    line = _error_line(_cli("convert", tiny_model, *args))
    assert needle in line
    after = {p.name: p.read_bytes() for p in files.iterdir() if p.is_file()}
    assert after == before  # every existing file untouched, nothing new (no OUT, no projector)
    assert _no_partials(files)


def test_out_is_the_model_itself(tiny_model, tmp_path):
    """EXL3 into the model's own directory, an imatrix over one of its files: refused before anything is read."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    before = {p.name: p.stat().st_mtime_ns for p in model.iterdir()}
    line = _error_line(_cli("convert", model, model, "--bpw", "4", "--device", "cpu"))
    assert str(model) in line and "input MODEL" in line
    line = _error_line(_cli("imatrix", model, model / "model.safetensors", "--device", "cpu"))
    assert "model.safetensors" in line and "input MODEL" in line
    assert {p.name: p.stat().st_mtime_ns for p in model.iterdir()} == before


def test_overwrite_replaces_an_existing_gguf(tiny_model, tmp_path):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"stale")
    r = _cli("convert", tiny_model, out, *GGUF, "--threads", "1", "--overwrite")
    assert r.exit_code == 0, r.output[-2000:]
    assert out.read_bytes()[:4] == b"GGUF" and _no_partials(tmp_path)


# --- places that cannot take the output -------------------------------------------------------------------
BAD_PLACES = [
    ("gguf-out-is-dir", lambda d: ["convert", "{m}", d / "a-dir.gguf", *GGUF], "is a directory"),
    ("gguf-parent-is-file", lambda d: ["convert", "{m}", d / "a-file" / "o.gguf", *GGUF], "a-file"),
    ("exl3-out-is-file", lambda d: ["convert", "{m}", d / "a-file", "--bpw", "4"], "not a directory"),
    ("exl3-parent-is-file", lambda d: ["convert", "{m}", d / "a-file" / "o", "--bpw", "4"], "a-file"),
    ("imatrix-out-is-dir", lambda d: ["imatrix", "{m}", d / "a-dir.gguf", "--device", "cpu"], "is a directory"),
    ("imatrix-parent-is-file", lambda d: ["imatrix", "{m}", d / "a-file" / "i.gguf"], "a-file"),
    ("eval-json-is-dir", lambda d: ["eval", "{m}", "{m}", "--json", d / "a-dir.gguf"], "is a directory"),
    ("eval-save-ref-parent-is-file", lambda d: ["eval", "{m}", "--save-ref", d / "a-file" / "r.bin"], "a-file"),
    ("binary-chat-template", lambda d: ["convert", "{m}", d / "t.gguf", *GGUF, "--chat-template", d / "bin.jinja"],
     "bin.jinja"),
    ("device-tpu9-exl3", lambda d: ["convert", "{m}", d / "e", "--bpw", "4", "--device", "tpu9"], "tpu9"),
    ("device-tpu9-imatrix", lambda d: ["imatrix", "{m}", d / "i.gguf", "--device", "tpu9"], "tpu9"),
    ("device-tpu9-eval", lambda d: ["eval", "{m}", "{m}", "--device", "tpu9"], "tpu9"),
]


@pytest.mark.parametrize("case", BAD_PLACES, ids=[c[0] for c in BAD_PLACES])
def test_unwritable_places_and_bad_inputs_are_one_line(case, tiny_model, files):
    _, make, needle = case
    (files / "bin.jinja").write_bytes(bytes(range(256)) * 4)
    before = sorted(p.name for p in files.rglob("*"))
    args = [str(a).replace("{m}", str(tiny_model)) for a in make(files)]
    line = _error_line(_cli(*args))
    assert needle in line
    assert sorted(p.name for p in files.rglob("*")) == before and _no_partials(files)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("cmd", ["convert", "imatrix", "eval"])
def test_cuda_without_cuda_is_one_line(cmd, tiny_model, tmp_path):
    args = {"convert": ["convert", tiny_model, tmp_path / "e", "--bpw", "4"],
            "imatrix": ["imatrix", tiny_model, tmp_path / "i.gguf"],
            "eval": ["eval", tiny_model, tiny_model]}[cmd]
    line = _error_line(_cli(*args, "--device", "cuda"))
    assert "--device cuda" in line and "CUDA" in line
    assert not list(tmp_path.iterdir())


# --- read-only filesystem and full disk, found before the work --------------------------------------------
def _read_only(monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr("mixq.formats.outputs.tempfile.mkstemp", refuse)


def _full_disk(monkeypatch):
    real = shutil.disk_usage

    def tiny(path):
        u = real(path)
        return type(u)(u.total, u.total - 4096, 4096)
    monkeypatch.setattr("mixq.formats.outputs.shutil.disk_usage", tiny)


WHEN_UP_FRONT = [
    ("gguf-read-only", _read_only, lambda d: ["convert", "{m}", d / "o.gguf", *GGUF], "read-only filesystem"),
    ("exl3-read-only", _read_only, lambda d: ["convert", "{m}", d / "o", "--bpw", "4"], "read-only filesystem"),
    ("imatrix-read-only", _read_only, lambda d: ["imatrix", "{m}", d / "i.gguf"], "read-only filesystem"),
    ("eval-json-read-only", _read_only, lambda d: ["eval", "{m}", "{m}", "--json", d / "r.json"],
     "read-only filesystem"),
    ("gguf-disk-full", _full_disk, lambda d: ["convert", "{m}", d / "o.gguf", *GGUF], "not enough disk space"),
    ("exl3-disk-full", _full_disk, lambda d: ["convert", "{m}", d / "o", "--bpw", "4", "--device", "cpu"],
     "not enough disk space"),  # --device cpu: past the CPU time estimate to the free-space check
    ("imatrix-disk-full", _full_disk, lambda d: ["imatrix", "{m}", d / "i.gguf"], "not enough disk space"),
]


@pytest.mark.parametrize("case", WHEN_UP_FRONT, ids=[c[0] for c in WHEN_UP_FRONT])
def test_read_only_and_full_disk_are_refused_before_the_work(case, tiny_model, tmp_path, monkeypatch):
    _, patch, make, needle = case
    patch(monkeypatch)
    args = [str(a).replace("{m}", str(tiny_model)) for a in make(tmp_path)]
    line = _error_line(_cli(*args))
    assert needle in line and str(tmp_path) in line
    assert not list(tmp_path.iterdir())


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_while_writing_a_gguf_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr("gguf.GGUFWriter.write_tensor_data", _enospc)
    out = tmp_path / "o.gguf"
    line = _error_line(_cli("convert", tiny_model, out, *GGUF, "--threads", "1"))
    assert str(out) in line and "no space left" in line
    assert not list(tmp_path.iterdir())  # neither the file nor its temporary directory


def test_disk_full_while_writing_an_imatrix_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr("gguf.GGUFWriter.write_tensors_to_file", _enospc)
    out = tmp_path / "i.gguf"
    line = _error_line(_cli("imatrix", tiny_model, out, "--rows", "1", "--seq-len", "8", "--device", "cpu"))
    assert str(out) in line and "no space left" in line
    assert not list(tmp_path.iterdir())


def test_imatrix_into_a_missing_directory_creates_it(tiny_model, tmp_path):
    out = tmp_path / "new" / "dir" / "i.gguf"
    r = _cli("imatrix", tiny_model, out, "--rows", "1", "--seq-len", "8", "--device", "cpu")
    assert r.exit_code == 0, r.output[-2000:]
    assert out.read_bytes()[:4] == b"GGUF"
