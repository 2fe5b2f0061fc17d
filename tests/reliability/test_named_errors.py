"""User mistakes end in one line naming what is wrong: exit 2, one `mixq: error:` line holding the file, tensor,
option or value to blame, no traceback, and nothing at OUT.

Each case builds its input (a copy of a fixture model with one edit, or bad option values) and the command it
runs; the line must contain every fragment given, and none of the outputs may exist afterwards.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from cli_helpers import copy_model, error_line, run_cli

L = "model.language_model.layers"
INDEX = "model.safetensors.index.json"
GGUF_Q8 = ("--format", "gguf", "--type", "Q8_0", "--threads", "1")
LONG = "a" * 300  # longer than any common filesystem's 255-byte name limit


# --- editing a copy ---------------------------------------------------------------------------------------------
def _edit_json(f: Path, fn) -> None:
    d = json.loads(f.read_text())
    fn(d)
    f.write_text(json.dumps(d))


def _edit_tensors(d: Path, fn) -> None:
    """fn(name -> tensor dict of one file) edits it in place; the index's weight_map follows."""
    index = json.loads((d / INDEX).read_text()) if (d / INDEX).is_file() else None
    for f in sorted(d.glob("*.safetensors")):
        sd = load_file(f)
        before = set(sd)
        fn(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, f, metadata={"format": "pt"})
        if index is not None:
            for k in before - set(sd):
                index["weight_map"].pop(k, None)
    if index is not None:
        (d / INDEX).write_text(json.dumps(index))


def _nan_at(name: str):
    def edit(sd):
        if name in sd:
            t = sd[name].clone()
            t.view(-1)[5] = float("nan")
            sd[name] = t
    return edit


# --- the cases: (tmp, models) -> (command, fragments of the line, outputs that must not exist) ------------------
def _mmproj_case(edit, fragments):
    def case(tmp: Path, m: dict):
        d = copy_model(m["tiny"], tmp / "model")
        edit(d)
        out, mm = tmp / "o.gguf", tmp / "o-mmproj.gguf"
        return ("convert", d, out, *GGUF_Q8, "--mmproj", mm), fragments(d, mm), [out, mm]
    return case


def _drop_vision(d: Path) -> None:
    _edit_tensors(d, lambda sd: [sd.pop(k) for k in [k for k in sd if ".visual." in k]])


def _size_case(cmd: str, opt: str, value: str):
    def case(tmp: Path, m: dict):
        out = tmp / ("o.gguf" if "gguf" in cmd else "o")
        args = {"convert-gguf-size": ("convert", m["tiny"], out, "--format", "gguf", opt, value, "--threads", "1"),
                "convert-gguf-shard": ("convert", m["tiny"], out, *GGUF_Q8, opt, value),
                "convert-exl3-shard": ("convert", m["tiny"], out, "--bpw", "4", "--device", "cpu", opt, value),
                "plan-gguf": ("plan", m["tiny"], "--format", "gguf", opt, value)}[cmd]
        return args, [f"{opt} '{value}'"], [out]
    return case


def _long_name_case(kind: str):
    def case(tmp: Path, m: dict):
        if kind == "gguf":
            out, cmd, gone = tmp / f"{LONG}.gguf", GGUF_Q8, tmp / f"{LONG}.gguf"
        elif kind == "exl3":
            out, cmd, gone = tmp / LONG, ("--bpw", "4", "--device", "cpu"), tmp / LONG
        else:  # a folder of OUT's path is too long: nothing is created on the way to it either
            out, cmd, gone = tmp / "sub" / LONG / "o.gguf", GGUF_Q8, tmp / "sub"
        return ("convert", m["tiny"], out, *cmd), ["OUT", str(out)], [gone]
    return case


def _missing_expert(cmd: str):
    name = f"{L}.2.mlp.experts.7.up_proj.weight"

    def case(tmp: Path, m: dict):
        d = copy_model(m["mini"], tmp / "model")
        _edit_tensors(d, lambda sd: sd.pop(name, None))
        out = tmp / "o.gguf"
        args = ("convert", d, out, *GGUF_Q8) if cmd == "convert" else ("plan", d, "--format", "gguf", "--type",
                                                                          "Q4_K_M")
        return args, [name], [out]
    return case


def _head_dim(fmt: str):
    def case(tmp: Path, m: dict):
        d = copy_model(m["mini"], tmp / "model")
        _edit_json(d / "config.json", lambda c: c["text_config"].update(qk_nope_head_dim=32))
        out = tmp / ("o.gguf" if fmt == "gguf" else "o")
        cmd = GGUF_Q8 if fmt == "gguf" else ("--format", "exl3", "--bpw", "3", "--device", "cpu")
        return ("convert", d, out, *cmd), ["config.json", "qk_nope_head_dim is 32", "imply 64"], [out]
    return case


def _exl3_unused(opt: tuple[str, ...], explicit: bool):
    def case(tmp: Path, m: dict):
        out = tmp / "o"
        fmt = ("--format", "exl3") if explicit else ()
        return ("convert", m["tiny"], out, *fmt, "--bpw", "4", "--device", "cpu", *opt), [opt[0]], [out]
    return case


def _plan_fit(extra: tuple[str, ...], fragments: list[str]):
    def case(tmp: Path, m: dict):
        return ("plan", m["tiny"], "--format", "gguf", *extra), fragments, []
    return case


def _plan_mmproj_text_only(tmp: Path, m: dict):
    d = copy_model(m["tiny"], tmp / "model")
    _drop_vision(d)
    return ("plan", d, "--format", "gguf", "--fit", "10GB", "--context", "1K", "--mmproj"), \
        ["--mmproj", "no vision tower"], []


def _nan_reference(tmp: Path, m: dict):
    name = f"{L}.1.mlp.shared_experts.up_proj.weight"
    d = copy_model(m["mini"], tmp / "model")
    _edit_tensors(d, _nan_at(name))
    rep = tmp / "report.json"
    return (("eval", d, m["mini"], "--text", m["heldout"], "--ctx", "64", "--windows", "1", "--json", rep),
            [f"'{name}'", "NaN"], [rep])


def _set_vision_key(key, value=None):
    def edit(d: Path):
        def fn(c):
            if value is None:
                del c["vision_config"][key]
            else:
                c["vision_config"][key] = value
        _edit_json(d / "config.json", fn)
    return edit


CASES = {
    # class 4: the projector's inputs are checked before the model GGUF is written
    "mmproj-vision-config-lacks-patch-size": _mmproj_case(
        _set_vision_key("patch_size"), lambda d, mm: [f"{d}/config.json", "patch_size"]),
    "mmproj-vision-config-bad-image-size": _mmproj_case(
        _set_vision_key("image_size", 0), lambda d, mm: [f"{d}/config.json", "image_size is 0"]),
    "mmproj-preprocessor-not-json": _mmproj_case(
        lambda d: (d / "preprocessor_config.json").write_text('{"image_mean": [0.5,'),
        lambda d, mm: [f"{d}/preprocessor_config.json", "JSON"]),
    "mmproj-preprocessor-bad-mean": _mmproj_case(
        lambda d: (d / "preprocessor_config.json").write_text('{"image_mean": "abc"}'),
        lambda d, mm: [f"{d}/preprocessor_config.json", "image_mean", "'abc'"]),
    "mmproj-no-vision-tower": _mmproj_case(_drop_vision, lambda d, mm: [f"--mmproj {mm}", "no vision tower"]),
    **{f"{cmd}-{opt.strip('-')}-{v}": _size_case(cmd, opt, v)
       for cmd, opt in (("convert-gguf-size", "--size"), ("convert-gguf-shard", "--shard-size"),
                        ("convert-exl3-shard", "--shard-size"), ("plan-gguf", "--size"))
       for v in ("inf", "nan", "1e400")},
    "plan-size-absurd": _size_case("plan-gguf", "--size", "1e30"),
    "out-name-too-long-gguf": _long_name_case("gguf"),
    "out-name-too-long-exl3": _long_name_case("exl3"),
    "out-folder-name-too-long": _long_name_case("folder"),
    # class 6: the message names the HF tensor, the config key, the option or the bad value
    "missing-routed-expert-convert": _missing_expert("convert"),
    "missing-routed-expert-plan": _missing_expert("plan"),
    "head-dim-disagrees-gguf": _head_dim("gguf"),
    "head-dim-disagrees-exl3": _head_dim("exl3"),
    **{f"exl3-out-{opt[0].strip('-')}{'-explicit' if explicit else ''}": _exl3_unused(opt, explicit)
       for opt in (("--overwrite",), ("--imatrix", "x.imatrix.gguf"), ("--tensor-type", "attn=Q8_0"))
       for explicit in (False, True)},
    "plan-fit-abc": _plan_fit(("--fit", "abc", "--context", "1K"), ["--fit", "'abc'"]),
    "plan-context-abc": _plan_fit(("--fit", "10GB", "--context", "abc"), ["--context 'abc'"]),
    "plan-devices-abc": _plan_fit(("--fit", "10GB", "--context", "1K", "--devices", "64GB,abc"),
                                  ["--devices '64GB,abc'", "'abc'"]),
    "plan-fit-inf": _plan_fit(("--fit", "inf", "--context", "1K"), ["--fit 'inf'"]),
    "plan-context-inf": _plan_fit(("--fit", "10GB", "--context", "inf"), ["--context 'inf'"]),
    "plan-cache-unknown": _plan_fit(("--fit", "10GB", "--context", "1K", "--cache", "q9"), ["--cache 'q9'"]),
    "plan-mmproj-no-vision-tower": _plan_mmproj_text_only,
    "eval-reference-nan": _nan_reference,
}


@pytest.fixture
def models(request) -> dict:
    """The fixture models a case may use, resolved lazily (mini and the held-out text come from ../shared)."""
    class Lazy(dict):
        def __missing__(self, key):
            name = {"tiny": "tiny_model", "mini": "mini_model", "heldout": "heldout_text"}[key]
            self[key] = request.getfixturevalue(name)
            return self[key]
    return Lazy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_mistake_is_one_line_naming_it(case, models, tmp_path):
    args, fragments, outputs = CASES[case](tmp_path, models)
    r = run_cli(*args)
    line = error_line(r)
    for f in fragments:
        assert f in line, (f, line)
    for p in outputs:  # listed, not stat-ed: the name itself may be too long to stat
        assert not (p.parent.is_dir() and p.name in {q.name for q in p.parent.iterdir()}), f"{p} was written"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]  # no partial left next to OUT


def test_mmproj_inputs_of_a_sound_model_pass(tiny_model):
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.mmproj import check_mmproj

    check_mmproj(open_checkpoint(tiny_model))


def test_gguf_tensor_list_names_a_missing_expert_by_its_hf_tensor(mini_model, tmp_path):
    """The library call (no checkpoint check first) names the HF tensor too, not the GGUF stack."""
    from mixq.errors import InputError
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    name = f"{L}.2.mlp.experts.7.up_proj.weight"
    d = copy_model(mini_model, tmp_path / "model")
    _edit_tensors(d, lambda sd: sd.pop(name, None))
    with pytest.raises(InputError, match=name.replace(".", r"\.")):
        gguf_tensors(open_checkpoint(d))
