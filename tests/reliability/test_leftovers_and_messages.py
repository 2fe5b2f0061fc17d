"""Leftovers of killed runs are cleaned by the next run into the same OUT, a second writer of one EXL3 job is
refused, and error lines name what really holds the problem (the expert, the projection, the file)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cli_helpers import error_line as _error_line
from cli_helpers import run_cli as _cli

GGUF = ["--format", "gguf", "--type", "Q8_0", "--threads", "1"]


def _stale(d: Path, stem: str) -> Path:
    """What a GGUF run killed mid-write leaves: its temporary directory with a half-written file."""
    p = d / f".{stem}.partial-k1ll3d"
    p.mkdir(parents=True)
    (p / f"{stem}.gguf").write_bytes(b"GGUF half written")
    return p


def test_a_later_run_removes_the_stale_partials_of_its_out(tiny_model, tmp_path):
    mine, other = _stale(tmp_path, "o"), _stale(tmp_path, "other")
    r = _cli("convert", tiny_model, tmp_path / "o.gguf", *GGUF)
    assert r.exit_code == 0, r.output[-2000:]
    assert not mine.exists() and other.exists()  # only OUT's own leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-k1ll3d", "o.gguf"]


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

