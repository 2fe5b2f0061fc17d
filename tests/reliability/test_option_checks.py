"""Options are never silently ignored or replaced: an unknown type or value, an option of the other format, or one
the chosen target does not use is one line (exit 2) naming the option; `plan` refuses what `convert` would."""
from __future__ import annotations

import pytest

from cli_helpers import error_line as _error_line
from cli_helpers import run_cli as _cli
from mixq.errors import InputError, MixqError


GGUF = ["--format", "gguf"]
# (case id, convert options, fragment of the message)
OPTION_CASES = [
    ("tensor-type-unknown-type", [*GGUF, "--type", "Q8_0", "--tensor-type", "attn=Q9_K"], "attn=Q9_K"),
    ("tensor-type-no-encoder", [*GGUF, "--type", "Q8_0", "--tensor-type", "attn=MXFP4"], "no encoder for MXFP4"),
    ("tensor-type-no-equals", [*GGUF, "--type", "Q8_0", "--tensor-type", "attn"], "REGEX=TYPE"),
    ("tensor-type-bad-regex", [*GGUF, "--type", "Q8_0", "--tensor-type", "([=Q8_0"], "bad regex"),
    ("output-tensor-type-unknown", [*GGUF, "--type", "Q8_0", "--output-tensor-type", "FOO"], "--output-tensor-type"),
    ("token-embedding-type-unknown", [*GGUF, "--type", "Q8_0", "--token-embedding-type", "Q3_X"],
     "--token-embedding-type"),
    ("type-unknown-mix", [*GGUF, "--type", "Q9_K_M"], "--type 'Q9_K_M'"),
    ("gguf-two-targets", [*GGUF, "--type", "Q8_0", "--bpw", "4"], "--type and --bpw"),
    ("gguf-no-target", [*GGUF], "give a target"),
    ("gguf-head-bits-with-mix", [*GGUF, "--type", "Q4_K_M", "--head-bits", "8"], "--head-bits"),
    ("gguf-ladder-with-mix", [*GGUF, "--type", "Q4_K_M", "--gguf-ladder", "iq"], "--gguf-ladder"),
    ("gguf-override-with-float", [*GGUF, "--type", "BF16", "--override", "attn=Q8_0"], "--override"),
    ("gguf-mmproj-type-alone", [*GGUF, "--type", "Q8_0", "--mmproj-type", "Q8_0"], "--mmproj-type"),
    ("gguf-rows", [*GGUF, "--type", "Q8_0", "--rows", "8"], "--rows applies to GGUF with --rounding hessian"),
    ("gguf-rounding-unknown", [*GGUF, "--type", "Q8_0", "--rounding", "gptq"], "--rounding"),
    ("gguf-tune-iters", [*GGUF, "--type", "Q8_0", "--tune-iters", "8"],
     "--tune-iters applies to GGUF with --rounding hessian"),
    ("gguf-tune-iters-negative", [*GGUF, "--type", "Q8_0", "--rounding", "hessian", "--tune-iters", "-1"],
     "--tune-iters -1: expected a whole number >= 0"),
    ("gguf-measure-with-mix", [*GGUF, "--type", "Q4_K_M", "--measure", "c.json"], "--measure plans a GGUF"),
    ("gguf-resume", [*GGUF, "--type", "Q8_0", "--resume"], "--resume applies to --format exl3 only"),
    ("gguf-vision-bits", [*GGUF, "--type", "Q8_0", "--vision-bits", "4"], "--vision-bits"),
    ("gguf-threads-zero", [*GGUF, "--type", "Q8_0", "--threads", "0"], "--threads 0"),
    ("gguf-shard-size", [*GGUF, "--type", "Q8_0", "--shard-size", "lots"], "--shard-size"),
    ("exl3-imatrix", ["--bpw", "4", "--imatrix", "x.gguf"], "--imatrix applies to --format gguf only"),
    ("exl3-overwrite", ["--bpw", "4", "--overwrite"], "--overwrite applies to --format gguf only"),
    ("exl3-type", ["--bpw", "4", "--type", "Q4_K_M"], "--type applies to --format gguf only"),
    ("exl3-two-targets", ["--bpw", "4", "--size", "1G"], "--bpw and --size"),
    ("exl3-rows-zero", ["--bpw", "4", "--rows", "0"], "--rows 0"),
    ("exl3-bpw-negative", ["--bpw", "-3"], "--bpw -3"),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_bad_or_unused_options_are_one_line(case, tiny_model, tmp_path):
    _, opts, needle = case
    out = tmp_path / ("o.gguf" if "gguf" in opts else "o")
    line = _error_line(_cli("convert", tiny_model, out, *opts))
    assert needle in line
    assert not list(tmp_path.iterdir())


def test_eval_ctx_zero_is_refused():
    line = _error_line(_cli("eval", "ref", "cand", "--ctx", "0"))
    assert "--ctx" in line and "0" in line


# --- plan and convert agree -------------------------------------------------------------------------------
PLAN_CASES = [
    ("exl3-dense-mlp-16", ["--format", "exl3", "--bpw", "4", "--override", "dense_mlp=16"], "dense_mlp"),
    ("exl3-attn-16", ["--format", "exl3", "--bpw", "4", "--override", "attn=16"], "attn"),
    ("exl3-mtp-bits-16", ["--format", "exl3", "--bpw", "4", "--mtp-bits", "16"], "--mtp-bits 16"),
    ("gguf-override-no-encoder", ["--format", "gguf", "--type", "Q4_K_M", "--override", "attn=MXFP4"],
     "cannot write"),
]


@pytest.mark.parametrize("cmd", ["plan", "convert"])
@pytest.mark.parametrize("case", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_refuses_what_convert_refuses_with_the_same_line(case, cmd, tiny_model, tmp_path):
    _, opts, needle = case
    out = tmp_path / ("o.gguf" if "gguf" in opts else "o")
    convert = ["convert", tiny_model, out, *opts] + (["--device", "cpu"] if "exl3" in opts else [])
    line = _error_line(_cli(*(["plan", tiny_model, *opts] if cmd == "plan" else convert)))
    assert needle in line
    assert not list(tmp_path.iterdir())
    other = convert if cmd == "plan" else ["plan", tiny_model, *opts]
    assert _error_line(_cli(*other)) == line  # one check, one message


def test_iq_ladder_plans_only_types_with_an_encoder(mini_model):
    """mini's 128-wide rows turn IQ4_XS into IQ4_NL; a type without an encoder never enters the plan."""
    from mixq.planning.planner import plan_model
    from mixq.planning.gguf_mix import has_encoder

    plan = plan_model(mini_model, "gguf", bpw=5.0, gguf_ladder="iq")
    assert plan.tensors and all(has_encoder(t.type) for t in plan.tensors)


# --- the Python API -------------------------------------------------------------------------------------------
API_CASES = [
    ("exl3-threads", "exl3", {"bpw": 4, "threads": 4}, "--threads applies to --format gguf only"),
    ("gguf-rows", "gguf", {"qtype": "Q8_0", "rows": 4}, "--rows applies to GGUF with --rounding hessian"),
    ("gguf-rounding", "gguf", {"qtype": "Q8_0", "rounding": "gptq"}, "--rounding 'gptq': expected one of"),
    ("gguf-tune-iters", "gguf", {"qtype": "Q8_0", "rounding": "hessian", "tune_iters": 2.5},
     "--tune-iters 2.5: expected a whole number >= 0"),
    ("unknown-option", "gguf", {"qtype": "Q8_0", "colour": "red"}, "unknown convert option 'colour'"),
    ("unknown-format", "onnx", {}, "unknown format 'onnx'"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_refuses_options_with_an_input_error(case, tiny_model, tmp_path):
    import mixq

    _, fmt, kwargs, needle = case
    with pytest.raises(InputError, match=needle):
        mixq.convert(tiny_model, tmp_path / "o", fmt, **kwargs)
    assert not list(tmp_path.iterdir())


def test_options_objects_are_frozen_checked_and_versioned():
    import dataclasses

    from mixq import Exl3Options, GGUFOptions

    o = GGUFOptions(qtype="q4_k_m", tensor_type=["ffn_.*_exps=q4_0"], threads=2)
    assert o.qtype == "Q4_K_M" and o.tensor_type == (("ffn_.*_exps", "Q4_0"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.threads = 3
    d = o.to_dict()
    assert d["format"] == "gguf" and d["version"] == 1 and GGUFOptions.from_dict(d) == o
    with pytest.raises(InputError, match="newer"):
        GGUFOptions.from_dict({**d, "version": 99})
    with pytest.raises(MixqError, match="exl3"):
        Exl3Options.from_dict(d)
    e = Exl3Options(bpw=3.05, overrides=["attn=6"])
    assert e.overrides == ("attn=6",) and Exl3Options.from_dict(e.to_dict()) == e
