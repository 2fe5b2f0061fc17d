"""Every command-line mistake is one `mixq: error:` line and exit 2, click's own usage errors included."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from mixq.cli import main


@pytest.mark.parametrize("args, needle", [
    (["convert", "m", "o", "--bogus"], "No such option '--bogus'"),
    (["convert", "m"], "Missing argument 'OUT'"),
    (["convert", "m", "o", "--format", "onnx"], "'onnx' is not one of"),
    (["convert", "m", "o", "--bpw", "four"], "--bpw 'four': expected a number"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_usage_errors_are_one_line(args, needle):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("mixq: error: ")
    assert needle in r.stderr and "Usage:" not in r.stderr


def test_help_is_still_help():
    r = CliRunner().invoke(main, ["convert", "--help"])
    assert r.exit_code == 0 and "--overwrite" in r.output and "Usage:" in r.output


def test_out_of_gpu_memory_is_one_line(monkeypatch, tmp_path):
    """A conversion that runs out of GPU memory ends in one line naming what ran out (exit 1), no traceback."""
    import torch

    from mixq import api

    def convert(model, out, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB.\nmore detail")
    monkeypatch.setattr(api, "convert", convert)
    r = CliRunner().invoke(main, ["convert", str(tmp_path), str(tmp_path / "o.gguf"), "--type", "Q4_K_M"])
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("mixq: error: out of GPU memory (CUDA out of memory. Tried to allocate 4.00 GiB.)")
