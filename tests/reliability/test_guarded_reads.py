"""Every JSON or text file mixq reads from a model directory or the user goes through one guarded reader
(formats/model_files.read_text / read_json): a truncated, invalid, non-UTF-8, 100,000-level nested or self-linked
file is one `mixq: error:` line naming it (exit 2), never a traceback, with nothing at OUT. A config whose sizes
lie beyond any glm5_next model is refused at once, naming the key and the bound."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_helpers import copy_model, error_line, run_cli, write_compare_report

DEPTH = 100_000


def _nested(p: Path) -> None:
    p.write_text('{"a": ' + "[" * DEPTH + "]" * DEPTH + "}")


def _truncated(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _not_utf8(p: Path) -> None:
    p.write_bytes(b'{"model": "\xff\xfe"}')


def _self_link(p: Path) -> None:
    p.unlink()
    p.symlink_to(p.name)


def _invalid(p: Path) -> None:
    p.write_text('{"chat_template": "x",, }')


# (case, file of the tiny checkpoint, edit, fragments of the line besides the file's name)
MODEL_FILE_CASES = [
    ("tokenizer-truncated", "tokenizer.json", _truncated, ["not valid JSON"]),
    ("tokenizer-nested", "tokenizer.json", _nested, ["nested too deeply"]),
    ("tokenizer-not-utf8", "tokenizer.json", _not_utf8, ["not UTF-8", "0xff"]),
    ("tokenizer-self-link", "tokenizer.json", _self_link, ["loops"]),
    ("tokenizer-config-invalid", "tokenizer_config.json", _invalid, ["not valid JSON", "line 1 column"]),
    ("tokenizer-config-nested", "tokenizer_config.json", _nested, ["nested too deeply"]),
    ("generation-config-nested", "generation_config.json", _nested, ["nested too deeply"]),
    ("preprocessor-config-nested", "preprocessor_config.json", _nested, ["nested too deeply"]),
    ("shard-self-link", "model.safetensors", _self_link, ["loops"]),
]


@pytest.mark.parametrize("case", MODEL_FILE_CASES, ids=[c[0] for c in MODEL_FILE_CASES])
def test_a_broken_model_file_in_a_gguf_convert_is_one_line(case, tiny_model, tmp_path):
    _, name, edit, fragments = case
    model = copy_model(tiny_model, tmp_path / "model")
    edit(model / name)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    extra = ["--mmproj", out_dir / "mm.gguf"] if name == "preprocessor_config.json" else []
    line = error_line(run_cli("convert", model, out_dir / "o.gguf", "--type", "Q8_0", "--threads", "1", *extra))
    assert f"{model / name}:" in line, line
    for f in fragments:
        assert f in line, line
    assert not list(out_dir.iterdir())


@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_a_shard_linked_to_itself_is_one_line(command, tiny_model, tmp_path):
    model = copy_model(tiny_model, tmp_path / "model")
    _self_link(model / "model.safetensors")
    args = ["inspect", model] if command == "inspect" else ["plan", model, "--format", "gguf", "--type", "Q4_K_M"]
    line = error_line(run_cli(*args))
    assert f"{model / 'model.safetensors'}: a symbolic link that loops" in line, line


@pytest.mark.parametrize("edit, needle", [(_nested, "nested too deeply"), (_truncated, "not valid JSON"),
                                          (_self_link, "loops")], ids=["nested", "truncated", "self-link"])
def test_a_broken_compare_report_is_one_line(edit, needle, tmp_path):
    rep = write_compare_report(tmp_path)
    edit(rep)
    line = error_line(run_cli("compare", rep))
    assert f"{rep}: report" in line and needle in line, line


@pytest.mark.parametrize("edit, needle", [(_nested, "nested too deeply"), (_truncated, "not valid JSON")],
                         ids=["nested", "truncated"])
def test_a_broken_curves_file_is_one_line(edit, needle, mini_model, tmp_path):
    curves = tmp_path / "curves.json"
    curves.write_text(json.dumps({"model.language_model.layers.0.mlp": {"2": 0.5, "4": 0.1}}))
    edit(curves)
    line = error_line(run_cli("plan", mini_model, "--format", "exl3", "--bpw", "3", "--measure", curves))
    assert f"{curves}: --measure curves file" in line and needle in line, line


# --- configs beyond any glm5_next model ---------------------------------------------------------------------------
def _flash_with(flash_config: Path, tmp_path: Path, section: str, **values) -> Path:
    cfg = json.loads(flash_config.read_text())
    cfg[section].update(values)
    if "num_hidden_layers" in values:  # per-layer lists of the real length would disagree first
        for k in ("layer_types", "mlp_layer_types", "indexer_types"):
            cfg["text_config"].pop(k, None)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


ABSURD = [
    ("layers", "text_config", {"num_hidden_layers": 100_000}, "text_config.num_hidden_layers is 100000, above the 512"),
    ("experts", "text_config", {"n_routed_experts": 1_000_000}, "text_config.n_routed_experts is 1000000, above the 2048"),
    ("hidden", "text_config", {"hidden_size": 1 << 20}, "text_config.hidden_size is 1048576, above the 65536"),
    ("vocab", "text_config", {"vocab_size": 10**9}, "text_config.vocab_size is 1000000000, above the 4194304"),
    ("layers-x-experts", "text_config", {"num_hidden_layers": 500, "n_routed_experts": 2000},
     "500 x 2000 = 1000000 routed experts, above the 262144"),
    ("vision-depth", "vision_config", {"depth": 50_000}, "vision_config.depth is 50000, above the 1024"),
    ("layers-text", "text_config", {"num_hidden_layers": "45"}, "num_hidden_layers"),
    ("width-text", "text_config", {"moe_intermediate_size": "2048"}, "text_config.moe_intermediate_size is '2048', not"),
    ("experts-float", "text_config", {"n_routed_experts": 288.5}, "text_config.n_routed_experts is 288.5, not a whole"),
]


@pytest.mark.parametrize("case", ABSURD, ids=[c[0] for c in ABSURD])
def test_an_absurd_config_is_refused_at_once(case, flash_config, tmp_path):
    _, section, values, needle = case
    cfg = _flash_with(flash_config, tmp_path, section, **values)
    line = error_line(run_cli("plan", "--from-config", cfg, "--format", "gguf", "--type", "Q4_K_M"))
    assert f"{cfg}:" in line and needle in line, line


def test_configs_within_the_bounds_are_planned(flash_config, tmp_path):
    """GLM-5.3-Flash itself, and with twice its routed experts (on 4 of its layers: reading a config costs time
    per expert tensor), are read as before."""
    twice = _flash_with(flash_config, tmp_path, "text_config", n_routed_experts=576, num_hidden_layers=4)
    for cfg in (flash_config, twice):
        r = run_cli("inspect", cfg, "--json")
        assert r.exit_code == 0, r.output[-2000:]
        assert "mixq: error" not in r.stderr


def test_a_nested_calibration_line_is_one_line(tiny_model, tmp_path):
    """A JSONL calibration file with a line nested 100,000 levels: named with its line."""
    cal = tmp_path / "cal.jsonl"
    cal.write_text('{"text": "hello"}\n' + "[" * DEPTH + "]" * DEPTH + "\n")
    out = tmp_path / "o.imatrix.gguf"
    line = error_line(run_cli("imatrix", tiny_model, out, "--calibration", cal))
    assert f"calibration file {cal} line 2" in line and "nested too deeply" in line, line
    assert not out.exists()
    assert os.listdir(tmp_path) == ["cal.jsonl"]
