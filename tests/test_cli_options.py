"""The command line's options come from the options objects: every field has its flag, every flag its field, and
cli.py spells no default that a field defines (issue 56 item 4)."""
from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import click
import pytest

import mixq
from mixq.cli import main
from mixq.errors import InputError
from mixq.planning.option_fields import cli_fields

CLI = Path(__file__).resolve().parent.parent / "cli.py"
# command -> (its options classes, the parameters that are the command's own: inputs and how it prints)
COMMANDS = {
    "plan": ((mixq.PlanOptions,), {"model", "per_tensor", "as_json"}),
    "eval": ((mixq.EvalOptions,), {"reference", "candidates", "text"}),
    "convert": ((mixq.Exl3Options, mixq.GGUFOptions), {"model", "out", "fmt", "as_json"}),
    "imatrix": ((mixq.ImatrixOptions,), {"model", "out", "as_json"}),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_has_a_flag_and_every_flag_a_field(command):
    classes, own = COMMANDS[command]
    params = {p.name: p for p in main.commands[command].params}
    names = {f.name: f for cls in classes for f in cli_fields(cls)}
    assert set(params) - own == set(names), command
    for name, f in names.items():
        assert f.metadata["flag"] in params[name].opts, (command, name)
        assert params[name].help and f.metadata["help"] in params[name].help


def _option_param(call: ast.Call) -> str | None:
    """The parameter name of a `click.option(...)` call: an explicit name, else the first flag's."""
    texts = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    named = [t for t in texts if not t.startswith("-")]
    if named:
        return named[0]
    return texts[0].lstrip("-").split("/")[0].replace("-", "_") if texts else None


# the functions of cli.py whose options are built from fields
BUILT = {"plan": (mixq.PlanOptions,), "eval_cmd": (mixq.EvalOptions,),
         "convert": (mixq.Exl3Options, mixq.GGUFOptions), "imatrix": (mixq.ImatrixOptions,)}


def test_cli_spells_no_default_an_options_field_defines():
    spelled = []
    for fn in ast.walk(ast.parse(CLI.read_text(encoding="utf-8"))):
        if not (isinstance(fn, ast.FunctionDef) and fn.name in BUILT):
            continue
        field_names = {f.name for cls in BUILT[fn.name] for f in fields(cls)}
        for node in fn.decorator_list:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "option"):
                continue
            name = _option_param(node)
            if name not in field_names:
                continue
            spelled += [f"cli.py:{node.lineno} {name} {k.arg}" for k in node.keywords
                        if k.arg in ("default", "show_default") or (
                            k.arg == "help" and isinstance(k.value, ast.Constant) and "[default:" in k.value.value)]
    assert spelled == []


def test_plan_help_lists_every_flag():
    text = click.testing.CliRunner().invoke(main, ["plan", "--help"]).output
    for f in cli_fields(mixq.PlanOptions):
        assert f.metadata["flag"] in text


def test_keywords_build_the_options_and_unknown_ones_are_one_error():
    o = mixq.PlanOptions(fmt="exl3", size="108GB", device="cpu", measure_sample="4,8", fit=None)
    assert o.size == 108 * 10**9 and o.device.type == "cpu" and o.measure_sample == (4, 8)
    with pytest.raises(InputError, match="unknown plan options 'foo', 'qtyp'"):
        mixq.plan("unused", "gguf", qtyp="Q4_K_M", foo=1)
    with pytest.raises(InputError, match="unknown eval option 'ctxx'"):
        mixq.evaluate("unused", ["x"], "t.txt", ctxx=4)
    e = mixq.EvalOptions(windows="all", devices="cpu,cpu", device="cpu")
    assert e.windows is None and e.devices == ("cpu", "cpu") and e.device.type == "cpu"
    assert mixq.EvalOptions().windows == mixq.DEFAULT_WINDOWS


@pytest.mark.parametrize("kwargs, message", [
    ({"size": "10XB"}, "--size '10XB'"),
    ({"bpw": 3, "qtype": "Q4_K_M"}, "at most one of --bpw, --size, --type"),
    ({"fit": "121GB"}, "--fit needs --context"),
    ({"context": "256K"}, "only apply with --fit"),
    ({"fit": "121GB", "context": "8K", "size": "100GB"}, "do not combine"),
    ({"device": "tpu"}, "--device 'tpu'"),
    ({"measure_sample": "x"}, "--measure-sample 'x'"),
    ({"rounding": "hessian"}, "--rounding applies"),
    ({"imatrix": "x.gguf", "bpw": 4}, "--imatrix applies"),
    ({"fmt": "onnx"}, "--format 'onnx'"),
])
def test_plan_options_are_checked_when_built(kwargs, message):
    with pytest.raises(InputError, match=message):
        mixq.PlanOptions(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"ctx": 3}, "--ctx 3 is too small"),
    ({"windows": "0"}, "--windows must be at least 1"),
    ({"engine": "vllm"}, "--engine 'vllm'"),
    ({"cache_type": "q8_0"}, "applies to --engine llamacpp only"),
    ({"save_ref": "r.bin", "ref_logits": "r.bin"}, "cannot be combined"),
    ({"save_ref": "r.bin", "devices": "cpu,cpu"}, "give one device"),
])
def test_eval_options_are_checked_when_built(kwargs, message):
    with pytest.raises(InputError, match=message):
        mixq.EvalOptions(**kwargs)
