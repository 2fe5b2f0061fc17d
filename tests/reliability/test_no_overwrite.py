"""No command replaces its inputs or an existing file it was not told to overwrite (convert's checks, for every
other command that writes): eval's --json / --markdown / --save-ref, imatrix's OUT, plan's --measure-out,
compare's --plot / --markdown, and the demo's directory. Each refusal is one line naming the path, exit 2, before
any work, and every file is left as it was."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli_helpers import error_line, run_cli


def write_report(path: Path, i: int) -> Path:
    """A minimal `mixq eval --json` report with one candidate."""
    cand = {"path": f"/q/Q{i}", "format": "gguf", "bytes": 1000 * i, "bpw": 4.0 + i, "kld_mean": 0.01 / i,
            "top1": 0.9, "dppl": 0.1}
    path.write_text(json.dumps({"reference": "/m/ref", "ctx": 512, "windows": 1, "candidates": [cand]}))
    return path


def _snapshot(*dirs: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def eval_files(tiny_model, tiny_gguf, tmp_path):
    """A reference copy, a candidate GGUF, a text, a reference-log-prob file and a report, all in tmp_path."""
    ref = tmp_path / "ref"
    shutil.copytree(tiny_model, ref)
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(tiny_gguf, files / "cand.gguf")
    (files / "text.txt").write_text("held-out words for the evaluation " * 40)
    (files / "ref.bin").write_bytes(b"reference log-probs of an earlier run")
    (files / "old.json").write_text('{"an": "earlier report"}')
    return ref, files


EVAL_BASE = ["--ctx", "16", "--windows", "1", "--device", "cpu"]

# (case, extra args given (ref, files), the path the line must name)
EVAL_CASES = [
    ("json-is-candidate", lambda r, f: [f / "cand.gguf", "--text", f / "text.txt", "--json", f / "cand.gguf"],
     "cand.gguf"),
    ("markdown-is-text", lambda r, f: [f / "cand.gguf", "--text", f / "text.txt", "--markdown", f / "text.txt"],
     "text.txt"),
    ("save-ref-is-text", lambda r, f: ["--text", f / "text.txt", "--save-ref", f / "text.txt"], "text.txt"),
    ("json-is-ref-logits", lambda r, f: [f / "cand.gguf", "--ref-logits", f / "ref.bin", "--json", f / "ref.bin"],
     "ref.bin"),
    ("json-in-reference", lambda r, f: [f / "cand.gguf", "--text", f / "text.txt", "--json", r / "config.json"],
     "config.json"),
    ("save-ref-in-reference", lambda r, f: ["--text", f / "text.txt", "--save-ref", r / "model.safetensors"],
     "model.safetensors"),
    ("json-exists", lambda r, f: [f / "cand.gguf", "--text", f / "text.txt", "--json", f / "old.json"],
     "--overwrite"),
    ("markdown-is-json", lambda r, f: [f / "cand.gguf", "--text", f / "text.txt", "--json", f / "n.json",
                                       "--markdown", f / "n.json"], "same file"),
]


@pytest.mark.parametrize("case", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_eval_outputs_replace_no_input(case, eval_files):
    _, make, needle = case
    ref, files = eval_files
    before = _snapshot(ref, files)
    line = error_line(run_cli("eval", ref, *make(ref, files), *EVAL_BASE))
    assert needle in line, line
    assert _snapshot(ref, files) == before


def test_eval_overwrite_replaces_an_earlier_report(eval_files):
    ref, files = eval_files
    args = ["eval", ref, files / "cand.gguf", "--text", files / "text.txt", "--json", files / "old.json", *EVAL_BASE]
    r = run_cli(*args, "--overwrite")
    assert r.exit_code == 0, r.output[-2000:]
    assert '"candidates"' in (files / "old.json").read_text()


def test_imatrix_onto_an_existing_gguf_is_refused(tiny_model, tiny_gguf, tmp_path):
    model_gguf = tmp_path / "model-Q4_K_M.gguf"
    shutil.copy(tiny_gguf, model_gguf)
    before = model_gguf.read_bytes()
    args = ["imatrix", tiny_model, model_gguf, "--rows", "2", "--seq-len", "16", "--device", "cpu"]
    line = error_line(run_cli(*args))
    assert str(model_gguf) in line and "--overwrite" in line
    assert model_gguf.read_bytes() == before
    r = run_cli(*args, "--overwrite")  # told to: the file becomes an imatrix
    assert r.exit_code == 0, r.output[-2000:]
    assert model_gguf.read_bytes() != before


def test_plan_measure_out_onto_the_calibration_text_is_refused(tiny_model, tmp_path):
    cal = tmp_path / "calibration.txt"
    cal.write_text("calibration words " * 100)
    before = cal.read_bytes()
    line = error_line(run_cli("plan", tiny_model, "--format", "exl3", "--bpw", "3", "--measure", "proxy",
                              "--calibration", cal, "--measure-out", cal, "--device", "cpu"))
    assert str(cal) in line and "--measure-out" in line
    assert cal.read_bytes() == before


def test_plan_measure_out_onto_an_existing_file_is_refused(tiny_model, tmp_path):
    old = tmp_path / "curves.json"
    old.write_text('{"earlier": "curves"}')
    line = error_line(run_cli("plan", tiny_model, "--format", "exl3", "--bpw", "3", "--measure", "proxy",
                              "--measure-out", old, "--device", "cpu"))
    assert str(old) in line and "--overwrite" in line
    assert old.read_text() == '{"earlier": "curves"}'


@pytest.mark.parametrize("flag", ["--plot", "--markdown"])
def test_compare_outputs_onto_an_input_report_are_refused(flag, tmp_path):
    a, b = write_report(tmp_path / "a.json", 1), write_report(tmp_path / "b.json", 2)
    before = _snapshot(tmp_path)
    line = error_line(run_cli("compare", a, b, flag, b))
    assert str(b) in line and "input" in line
    assert _snapshot(tmp_path) == before


def test_compare_onto_an_existing_file_needs_overwrite(tmp_path):
    a = write_report(tmp_path / "a.json", 1)
    md = tmp_path / "table.md"
    md.write_text("my notes")
    assert "--overwrite" in error_line(run_cli("compare", a, "--markdown", md))
    assert md.read_text() == "my notes"
    r = run_cli("compare", a, "--markdown", md, "--overwrite")
    assert r.exit_code == 0, r.output[-2000:]
    assert "KLD" in md.read_text()


def test_demo_refuses_a_directory_of_someone_elses_files(tmp_path):
    d = tmp_path / "work"
    d.mkdir()
    (d / "eval.json").write_text("my report")
    (d / "tiny-Q8_0.gguf").write_bytes(b"my file")
    line = error_line(run_cli("demo", "--out", d))
    assert str(d) in line and "not empty" in line
    assert sorted(p.name for p in d.iterdir()) == ["eval.json", "tiny-Q8_0.gguf"]
    assert (d / "eval.json").read_text() == "my report"


def test_demo_refuses_a_file_as_its_directory(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    assert "not a directory" in error_line(run_cli("demo", "--out", f))
    assert f.read_text() == "mine"
