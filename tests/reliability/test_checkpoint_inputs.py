"""Checkpoint files that are well-formed JSON / safetensors but say something impossible: one line naming the file
and the key or tensor, exit 2, nothing at OUT (before this they ended in tracebacks or were silently accepted)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from cli_helpers import copy_model, error_line, run_cli

INDEX = "model.safetensors.index.json"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
NORM = "model.language_model.layers.0.input_layernorm.weight"


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _block_size(value):
    return lambda c: c["quantization_config"].__setitem__("weight_block_size", value)


def _nested_config(d: Path) -> None:
    depth = 100_000
    (d / "config.json").write_text('{"a": ' + "[" * depth + "]" * depth + "}")


def _tensor_in_two_shards(d: Path) -> None:
    a, b = load_file(d / SHARD1), load_file(d / SHARD2)
    b[NORM] = a[NORM]
    save_file(b, d / SHARD2, metadata={"format": "pt"})


# (case, edit of a copy of the FP8 two-shard tiny model, fragments the line must hold)
CASES = [
    ("block-size-zero", lambda d: _edit_config(d, _block_size([0, 0])), ["config.json", "weight_block_size", "[0, 0]"]),
    ("block-size-text", lambda d: _edit_config(d, _block_size("abc")), ["config.json", "weight_block_size", "'abc'"]),
    ("block-size-three", lambda d: _edit_config(d, _block_size([128, 128, 1])), ["weight_block_size"]),
    ("quant-config-list", lambda d: _edit_config(d, lambda c: c.__setitem__("quantization_config", [1])),
     ["config.json", "quantization_config"]),
    ("config-nested-100k", _nested_config, ["config.json", "nested"]),
    ("tensor-in-two-shards", _tensor_in_two_shards, [SHARD1, SHARD2, NORM]),
]


@pytest.mark.parametrize("command", ["inspect", "convert"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_impossible_checkpoint_is_one_line(case, command, tiny_fp8_model, tmp_path):
    _, edit, fragments = case
    model = copy_model(tiny_fp8_model, tmp_path / "model")
    edit(model)
    out = tmp_path / "out.gguf"
    args = ["inspect", model] if command == "inspect" else ["convert", model, out, "--type", "Q8_0", "--threads", "1"]
    line = error_line(run_cli(*args))
    for f in fragments:
        assert f in line, line
    assert not out.exists()
