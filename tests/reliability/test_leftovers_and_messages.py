"""Leftovers of killed runs are cleaned by the next run into the same OUT, a second writer of one EXL3 job is
refused, and error lines name what really holds the problem (the expert, the projection, the file)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mixq.formats.partials import make_partial_dir

from cli_helpers import error_line as _error_line
from cli_helpers import run_cli as _cli

GGUF = ["--format", "gguf", "--type", "Q8_0", "--threads", "1"]


def _stale(d: Path, stem: str, kind: str = "") -> Path:
    """What a GGUF run killed mid-write leaves: its marked temporary directory with a half-written file."""
    p = make_partial_dir(d / f"{stem}.gguf", kind)
    (p / f"{stem}.gguf").write_bytes(b"GGUF half written")
    return p


def test_a_later_run_removes_the_stale_partials_of_its_out(tiny_model, tmp_path):
    mine, hessian, other = _stale(tmp_path, "o"), _stale(tmp_path, "o", "hessian"), _stale(tmp_path, "other")
    r = _cli("convert", tiny_model, tmp_path / "o.gguf", *GGUF)
    assert r.exit_code == 0, r.output[-2000:]
    assert not mine.exists() and not hessian.exists() and other.exists()  # only OUT's own leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "o.gguf"]


@pytest.mark.parametrize("name", [".o.partial-mine", ".o.partial-abcd1234", ".o.partial-hessian-notmixq"])
def test_a_users_look_alike_folder_is_never_removed(name, tiny_model, tmp_path):
    """A folder named like a partial but not made by mixq (no mark, or a name mkdtemp never makes) stays."""
    d = tmp_path / name
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    if name.endswith("abcd1234"):  # the right name shape, but no mark file: still not mixq's
        (d / "o.gguf").write_bytes(b"GGUF?")
    r = _cli("convert", tiny_model, tmp_path / "o.gguf", *GGUF)
    assert r.exit_code == 0, r.output[-2000:]
    assert (d / "notes.txt").read_text() == "mine"


def test_a_second_run_that_finishes_later_does_not_replace_the_first(tiny_model, tmp_path, monkeypatch):
    """Two converts to one OUT without --overwrite: the one that publishes second fails, the first file stays."""
    from mixq.formats import gguf_writer

    out = tmp_path / "o.gguf"
    real_publish = gguf_writer.publish

    def first_run_finishes_meanwhile(pairs, *, overwrite):
        out.write_bytes(b"the other run's finished file")
        return real_publish(pairs, overwrite=overwrite)

    monkeypatch.setattr(gguf_writer, "publish", first_run_finishes_meanwhile)
    line = _error_line(_cli("convert", tiny_model, out, *GGUF))
    assert str(out) in line and "another run" in line
    assert out.read_bytes() == b"the other run's finished file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]  # no partial left


def test_two_converts_to_one_out_at_once(tiny_model, tmp_path):
    """Real processes: of two converts started together into one OUT, at most one succeeds; OUT is whole."""
    out = tmp_path / "o.gguf"
    cmd = [sys.executable, "-m", "mixq", "convert", str(tiny_model), str(out), *GGUF]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes[0] == 0 and codes[1] == 2, results
    failed = next(err for rc, err in results if rc == 2)
    assert str(out) in failed and "mixq: error:" in failed
    assert out.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]


def test_overwrite_of_a_split_set_with_one_file_removes_the_old_shards(tiny_model, tmp_path):
    out = tmp_path / "m.gguf"
    r = _cli("convert", tiny_model, out, *GGUF, "--shard-size", "1M")
    assert r.exit_code == 0, r.output[-2000:]
    old = sorted(p.name for p in tmp_path.glob("m-*-of-*.gguf"))
    assert len(old) >= 2
    r = _cli("convert", tiny_model, out, *GGUF, "--overwrite")
    assert r.exit_code == 0, r.output[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    r = _cli("convert", tiny_model, out, *GGUF, "--shard-size", "1M", "--overwrite")  # and back to a split set
    assert r.exit_code == 0, r.output[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == old


def test_partials_stay_while_another_run_writes_in_the_directory(tiny_model, tmp_path):
    """A run writing in the same directory holds a shared lock there: its partial may be live, so none is removed."""
    import fcntl

    mine = _stale(tmp_path, "o")
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # as a concurrent `mixq convert` into this directory does
        r = _cli("convert", tiny_model, tmp_path / "o.gguf", *GGUF)
        assert r.exit_code == 0, r.output[-2000:]
        assert mine.exists()
    finally:
        os.close(fd)


def test_resume_while_another_process_writes_the_job_is_refused(tiny_model, tmp_path):
    """The EXL3 job dir holds a lock file with the writer's pid, flock-ed while it runs."""
    import fcntl

    out = tmp_path / "o"
    job = out / ".mixq-job"
    job.mkdir(parents=True)
    (job / "job.json").write_text(json.dumps({"fingerprint": "x", "settings": {}, "done": []}))
    fd = os.open(job / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        line = _error_line(_cli("convert", tiny_model, out, "--bpw", "4", "--device", "cpu", "--resume"))
        assert str(out) in line and "another mixq process (pid 4242)" in line
    finally:
        os.close(fd)
    assert sorted(p.name for p in job.iterdir()) == ["job.json", "lock"]  # the other run's state untouched
    line = _error_line(_cli("convert", tiny_model, out, "--bpw", "4", "--device", "cpu", "--resume"))
    assert "settings differ" in line  # lock gone with its holder: the resume gets to the real check


# --- messages name the right thing --------------------------------------------------------------------------
def _with_nan(src: Path, dst: Path, suffix: str, index: int = 5) -> str:
    """A copy of `src` with a NaN in the last tensor whose name ends in `suffix`; returns its name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    shard = next(p for p in sorted(dst.glob("*.safetensors")) if "mtp" not in p.name)
    sd = load_file(shard)
    name = sorted(n for n in sd if n.endswith(suffix))[-1]
    sd[name] = sd[name].clone()
    sd[name].view(-1)[index] = float("nan")
    save_file(sd, shard, metadata={"format": "pt"})
    return name


NAN_CASES = [
    ("gguf-stacked-expert-1", "mlp.experts.1.up_proj.weight", GGUF),
    ("gguf-fused-kv-b", "self_attn.kv_b_proj.weight", GGUF),
    ("exl3-fused-qkv-k", "self_attn.k_proj.weight", ["--bpw", "4", "--device", "cpu"]),
]


@pytest.mark.parametrize("case", NAN_CASES, ids=[c[0] for c in NAN_CASES])
def test_nan_error_names_the_tensor_that_holds_it(case, tiny_model, tmp_path):
    """GGUF stacks experts and EXL3 fuses q/k/v: the line names the source tensor with the NaN, not the first of
    the group."""
    _, suffix, opts = case
    name = _with_nan(tiny_model, tmp_path / "m", suffix)
    out = tmp_path / ("o.gguf" if "gguf" in opts else "o")
    line = _error_line(_cli("convert", tmp_path / "m", out, *opts))
    assert f"'{name}'" in line or f" {name}" in line, line
    assert "NaN" in line or "non-finite" in line
    assert not out.exists()


@pytest.mark.parametrize("content", [b"", b"\xfc\x80garbage" * 8, b"\x05\x00\x00\x00" + b"\xff" * 40,
                                     b"\xff\xff\xff\xff" + b"\x00" * 16],
                         ids=["empty", "random-bytes", "bad-name", "negative-count"])
def test_garbage_imatrix_is_not_a_gguf_imatrix_file(content, tiny_model, tmp_path):
    im = tmp_path / "im.dat"
    im.write_bytes(content)
    out = tmp_path / "o.gguf"
    line = _error_line(_cli("convert", tiny_model, out, "--format", "gguf", "--type", "Q4_K_M", "--imatrix", im))
    assert str(im) in line and "not a GGUF imatrix file" in line
    assert not out.exists()



def test_exl3_refused_for_its_tokenizer_leaves_no_out(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").unlink()
    out = tmp_path / "out-exl3"
    line = _error_line(_cli("convert", model, out, "--bpw", "4", "--device", "cpu"))
    assert "tokenizer.json" in line
    assert not out.exists()


def test_exl3_failing_before_its_first_stage_is_done_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    """Nothing finished means nothing to resume: the job directory goes, and OUT if this run made it."""
    from mixq.conversion.exl3 import pipeline
    from mixq.errors import InputError

    def fail(*a, **k):
        raise InputError("the first stage failed")

    monkeypatch.setattr(pipeline, "_write_stage", fail)
    made, given = tmp_path / "made", tmp_path / "given"
    given.mkdir()
    for out in (made, given):
        # one line of its own, although the stage's progress bar was drawn when the error came
        assert "first stage failed" in _error_line(_cli("convert", tiny_model, out, "--bpw", "4", "--device", "cpu"))
    assert not made.exists()
    assert given.is_dir() and list(given.iterdir()) == []  # the user's empty directory stays


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError(28, "No space left on device")],
                         ids=["interrupt", "disk-full"])
def test_a_failed_projector_write_takes_the_model_file_back(error, tiny_model, tmp_path, monkeypatch):
    """`--mmproj` asks for two files: when the projector cannot be written, the model file goes too."""
    from mixq.formats import mmproj

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(mmproj, "write_mmproj", fail)
    r = _cli("convert", tiny_model, tmp_path / "o.gguf", *GGUF, "--mmproj", tmp_path / "p.gguf")
    assert r.exit_code in (2, 130) and "Traceback" not in r.output
    assert "mixq: error:" in r.stderr
    assert list(tmp_path.iterdir()) == []
