"""Names and strings read from files reach the terminal escaped: a tensor name, shard name or imatrix entry
holding a newline and an ANSI escape cannot forge a `mixq: error:` line of its own or recolour the terminal.
Every command still ends in exactly one `mixq: error:` line, and stderr holds no raw ESC and no newline but the
one that ends that line."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import copy_model, error_line, run_cli
from mixq import api
from mixq.errors import MixqWarning, escape
from mixq.formats.imatrix_file import IMatrix, write_imatrix

EVIL = "evil\nmixq: error: all good\n\x1b[31mred"
EVIL_SHOWN = "evil\\nmixq: error: all good\\n\\x1b[31mred"
INDEX = "model.safetensors.index.json"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("raw, shown", [
    (EVIL, EVIL_SHOWN),
    ("tab\there\r", "tab\\there\\r"),
    ("del\x7f csi\x9b nul\x00", "del\\x7f csi\\x9b nul\\x00"),
    ("rtl\u202eoverride sep\u2028arator", "rtl\\u202eoverride sep\\u2028arator"),
    ("not utf-8 \udcff", "not utf-8 \\udcff"),
    ("plain é 中 C:\\dir [x]", "plain é 中 C:\\dir [x]"),
])
def test_escape_writes_controls_as_escapes(raw, shown):
    assert escape(raw) == shown


def _one_clean_line(r) -> str:
    """The run's one error line; stderr holds no raw ESC and no line but it."""
    line = error_line(r)
    assert "\x1b" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.endswith("\n"), r.stderr
    return line


def _commands(model: Path, tmp: Path) -> dict[str, list]:
    return {"inspect": ["inspect", model],
            "plan": ["plan", model, "--format", "gguf", "--type", "Q4_K_M"],
            "convert": ["convert", model, tmp / "o.gguf", "--type", "Q8_0", "--threads", "1"]}


@pytest.fixture(scope="module")
def evil_tensor_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny checkpoint with one more tensor, named EVIL."""
    d = copy_model(tiny_model, tmp_path_factory.mktemp("evil") / "model")
    sd = load_file(d / "model.safetensors")
    sd[EVIL] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("command", ["inspect", "plan", "convert"])
def test_a_tensor_name_with_a_newline_and_an_escape(command, evil_tensor_model, tmp_path):
    line = _one_clean_line(run_cli(*_commands(evil_tensor_model, tmp_path)[command]))
    assert "evil\\nmixq: error: all good\\n\\x1b[31mred" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["inspect", "plan", "convert"])
def test_a_shard_name_with_a_newline_and_an_escape(command, tiny_fp8_model, tmp_path):
    """The index names a shard EVIL + .safetensors that is not there: the message names it, escaped."""
    d = copy_model(tiny_fp8_model, tmp_path / "model")
    index = json.loads((d / INDEX).read_text())
    index["weight_map"] = {k: (EVIL + ".safetensors" if v == SHARD2 else v) for k, v in index["weight_map"].items()}
    (d / INDEX).write_text(json.dumps(index))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    line = _one_clean_line(run_cli(*_commands(d, out_dir)[command]))
    assert EVIL_SHOWN + ".safetensors" in line
    assert not list(out_dir.iterdir())


def test_an_imatrix_entry_name_with_a_newline_and_an_escape(tiny_model, tmp_path):
    """An imatrix entry whose name holds EVIL and whose values are negative: named, escaped."""
    im = IMatrix(datasets=["t"], chunk_count=1)
    im.add("blk.0.attn_k.weight", np.ones((1, 128)), 1.0)
    im.add(EVIL, -np.ones((1, 128)), 1.0)
    imx = write_imatrix(tmp_path / "evil.imatrix.gguf", im)
    out = tmp_path / "o.gguf"
    line = _one_clean_line(run_cli("convert", tiny_model, out, "--type", "Q8_0", "--threads", "1", "--imatrix", imx))
    assert EVIL_SHOWN in line and "negative" in line
    assert not out.exists()


def test_a_warning_is_one_escaped_line(monkeypatch, tmp_path):
    """A warning of mixq's (and a library's) while a command runs: one `mixq: warning:` line each, escaped."""
    def inspect(path):
        warnings.warn(f"{EVIL}: written as Q5_0", MixqWarning)
        warnings.warn(f"library note on {EVIL}", UserWarning)
        raise api.InputError(f"{EVIL}: refused")
    monkeypatch.setattr(api, "inspect", inspect)
    r = run_cli("inspect", tmp_path)
    assert r.exit_code == 2 and "\x1b" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == f"mixq: warning: {EVIL_SHOWN}: written as Q5_0", lines
    assert lines[1].endswith(f"UserWarning: library note on {EVIL_SHOWN}"), lines
    assert lines[2:] == [f"mixq: error: {EVIL_SHOWN}: refused"], lines
