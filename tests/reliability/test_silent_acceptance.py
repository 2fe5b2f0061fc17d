"""Input that would be accepted and then silently do nothing (or write a file llama.cpp refuses) is one line (exit 2)
naming the file, option or tensor, before any output: an imatrix that names no tensor of the model, i-quants
without importance data, --tensor-type rules that change nothing, unknown pre-tokenizer names, an OUT that
disagrees with --format / --type, a plan of a checkpoint convert refuses, chat templates jinja2 rejects."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import copy_model, error_line, run_cli
from mixq.errors import FormatError, InputError
from mixq.formats.imatrix_file import IMatrix, check_names, write_imatrix

GGUF = ["--type", "Q8_0", "--threads", "1"]
EXPS = r"ffn_(gate|up|down)_exps"


def _imatrix(path: Path, names: list[str], n: int = 128) -> Path:
    im = IMatrix(datasets=["test"], chunk_count=1)
    for name in names:
        im.add(name, np.ones((1, n), np.float32), 1.0)
    return write_imatrix(path, im)


def _refused(args, out_dir: Path, *needles: str) -> str:
    """The one error line of `mixq ARGS`, holding every needle, with nothing written in `out_dir`."""
    line = error_line(run_cli(*args))
    for n in needles:
        assert n in line, line
    assert not list(out_dir.iterdir()), list(out_dir.iterdir())
    return line


@pytest.fixture
def out_dir(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


# --- imatrix --------------------------------------------------------------------------------------------------
def test_imatrix_naming_no_tensor_of_the_model_is_refused(tiny_model, tmp_path, out_dir):
    imx = _imatrix(tmp_path / "other.imatrix.gguf", ["model.layers.0.mlp.down_proj.weight", "foo.weight"])
    _refused(["convert", tiny_model, out_dir / "o.gguf", *GGUF, "--imatrix", imx], out_dir,
             f"--imatrix {imx}", "none of the imatrix's 2 entries", "foo.weight")


def test_empty_imatrix_is_refused(tiny_model, tmp_path, out_dir):
    imx = _imatrix(tmp_path / "empty.imatrix.gguf", [])
    _refused(["convert", tiny_model, out_dir / "o.gguf", *GGUF, "--imatrix", imx], out_dir,
             f"--imatrix {imx}", "no entries")


def test_imatrix_matching_some_tensors_passes_the_name_check():
    im = IMatrix()
    im.add("blk.1.ffn_down_exps.weight", np.ones((1, 8)), 1.0)
    im.add("blk.9.ffn_down_exps.weight", np.ones((1, 8)), 1.0)  # a layer the model lacks: normal, not an error
    assert check_names(im, ["blk.1.ffn_down_exps.weight", "blk.1.ffn_up_exps.weight"]) is im
    with pytest.raises(InputError, match=r"^x\.dat: none of the imatrix's 2 entries"):
        check_names(im, ["token_embd.weight"], "x.dat")


def test_in_memory_imatrix_naming_nothing_is_refused(tiny_model, tmp_path):
    from mixq.conversion.gguf.pipeline import convert_gguf

    im = IMatrix()
    im.add("nothing.weight", np.ones((1, 128)), 1.0)
    with pytest.raises(InputError, match=r"^--imatrix: none of the imatrix's 1 entries"):
        convert_gguf(tiny_model, tmp_path / "o.gguf", qtype="Q8_0", imatrix=im, threads=1, progress=False)
    assert not list(tmp_path.iterdir())


# --- i-quants that need importance data -------------------------------------------------------------------------
# every way a plan can reach IQ2_XXS / IQ2_XS / IQ1_S / IQ1_M (k256: rows of 256, so no fallback)
IQ_CASES = [
    ("tensor-type", ["--type", "Q4_K_M", "--tensor-type", f"{EXPS}=IQ2_XXS"], "IQ2_XXS"),
    ("override", ["--type", "Q4_K_M", "--override", "routed_expert=IQ2_XS"], "IQ2_XS"),
    ("ladder-bpw", ["--bpw", "2.5", "--gguf-ladder", "iq"], "needs an importance matrix"),
    ("ladder-size", ["--size", "14MB", "--gguf-ladder", "iq"], "needs an importance matrix"),
    ("token-embd", ["--type", "Q8_0", "--token-embedding-type", "IQ2_XXS"], "token_embd.weight: IQ2_XXS"),
    ("output", ["--type", "Q8_0", "--output-tensor-type", "IQ2_XS"], "output.weight: IQ2_XS"),
    ("iq1-override", ["--type", "Q4_K_M", "--override", "attn=IQ1_S"], "IQ1_S"),
    ("iq1-token-embd", ["--type", "Q8_0", "--token-embedding-type", "IQ1_S"], "token_embd.weight: IQ1_S"),
]


@pytest.mark.parametrize("case", IQ_CASES, ids=[c[0] for c in IQ_CASES])
def test_iquants_without_an_imatrix_are_refused_naming_tensor_and_type(case, k256_model, tmp_path, out_dir):
    _, opts, needle = case
    line = _refused(["convert", k256_model, out_dir / "o.gguf", *opts, "--threads", "1"], out_dir, needle)
    assert "IQ" in line


# --- --tensor-type rules that change nothing -----------------------------------------------------------------
RULE_CASES = [
    ("no-match", ["--tensor-type", "no_such_tensor=Q4_0"], "--tensor-type no_such_tensor=Q4_0 matches no tensor"),
    ("only-never-quantized", ["--tensor-type", r"_norm\.weight=Q4_0"], "matches only tensors that are never quantized"),
    ("only-excluded", ["--tensor-type", "ssm_f_a=Q4_0"], "blk.0.ssm_f_a.weight"),
    ("shadowed", ["--tensor-type", "ffn_=Q4_0", "--tensor-type", "ffn_down_exps=Q5_0"],
     "--tensor-type ffn_down_exps=Q5_0 decides no tensor: --tensor-type ffn_=Q4_0 comes first"),
    ("output-option-first", ["--tensor-type", r"^output\.=Q4_0", "--output-tensor-type", "Q5_0"],
     "--output-tensor-type comes first"),
]


@pytest.mark.parametrize("case", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_tensor_type_rule_without_effect_is_refused(case, tiny_model, tmp_path, out_dir):
    _, opts, needle = case
    _refused(["convert", tiny_model, out_dir / "o.gguf", *GGUF, *opts], out_dir, needle)


def test_tensor_type_rule_that_also_matches_excluded_tensors_is_kept(tiny_model):
    """A rule that decides one tensor is fine, whatever else it matches (llama-quantize leaves those alone)."""
    from mixq.planning.gguf_assign import assign_types
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    ckpt = open_checkpoint(tiny_model)
    specs = gguf_tensors(ckpt)
    types = dict(zip([s.name for s in specs], assign_types(ckpt, specs, qtype="Q8_0",
                                                           tensor_type=[("ssm_f_a|ffn_down_shexp", "Q4_0")])))
    assert types["blk.1.ffn_down_shexp.weight"] == "Q4_0" and types["blk.0.ssm_f_a.weight"] == "BF16"


# --- pre-tokenizer names ----------------------------------------------------------------------------------------
def test_unknown_tokenizer_pre_is_refused(tiny_model, tmp_path, out_dir):
    _refused(["convert", tiny_model, out_dir / "o.gguf", *GGUF, "--tokenizer-pre", "glm-4"], out_dir,
             "--tokenizer-pre 'glm-4'", "llama.cpp", "glm4")


def test_pre_tokenizer_table(mini_model):
    from mixq.formats.gguf_tokenizer import KNOWN_PRE, LLAMACPP_PRE, check_pre, tokenizer_metadata

    assert set(KNOWN_PRE.values()) <= LLAMACPP_PRE  # every name mixq picks itself loads
    assert {"gpt-2", "glm4", "glm5", "chatglm-bpe", "default", "qwen2", "llama-bpe"} <= LLAMACPP_PRE
    assert check_pre("gpt-2") == "gpt-2"
    for bad in ("GPT-2", "gpt2", "", "glm-4.5"):
        with pytest.raises(InputError, match="not a pre-tokenizer llama.cpp knows"):
            check_pre(bad)
    with pytest.raises(InputError, match="--tokenizer-pre 'bogus'"):
        tokenizer_metadata(mini_model, 8192, tokenizer_pre="bogus")


# --- OUT against --format / --type ----------------------------------------------------------------------------
def test_gguf_format_needs_a_gguf_out(tiny_model, tmp_path, out_dir):
    import mixq

    _refused(["convert", tiny_model, out_dir / "model", "--format", "gguf", *GGUF], out_dir,
             f"OUT {out_dir / 'model'}: must end in .gguf")
    with pytest.raises(InputError, match="must end in .gguf"):
        mixq.convert(tiny_model, out_dir / "model.bin", mixq.GGUFOptions(qtype="Q8_0"))
    assert not list(out_dir.iterdir())


@pytest.mark.parametrize("opts", [["--type", "Q4_K_M"], ["--bpw", "4", "--imatrix", "x.gguf"]], ids=["type", "imatrix"])
def test_gguf_option_with_an_exl3_out_names_out(opts, tiny_model, tmp_path, out_dir):
    flag = opts[-2] if "--imatrix" in opts else opts[0]
    _refused(["convert", tiny_model, out_dir / "model-q4", *opts], out_dir,
             f"{flag} applies to --format gguf only", f"OUT {out_dir / 'model-q4'}", ".gguf")


def test_python_convert_follows_out(tiny_model, tmp_path):
    import mixq

    res = mixq.convert(tiny_model, tmp_path / "t.gguf", qtype="Q8_0", threads=1, progress=False)
    assert res.format == "gguf" and Path(res.out).read_bytes()[:4] == b"GGUF"


# --- plan refuses the checkpoint convert refuses ----------------------------------------------------------------
def test_plan_refuses_a_config_that_disagrees_with_the_weights(tiny_model, tmp_path, out_dir):
    d = copy_model(tiny_model, tmp_path / "bad")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["n_routed_experts"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    plan = error_line(run_cli("plan", d, "--format", "gguf", "--type", "Q8_0"))
    assert "n_routed_experts" in plan and str(d) in plan
    convert = _refused(["convert", d, out_dir / "o.gguf", *GGUF], out_dir, "n_routed_experts")
    assert plan == convert  # one check, one message
    exl3 = error_line(run_cli("plan", d, "--format", "exl3", "--bpw", "4"))
    assert exl3 == plan
    r = run_cli("plan", "--from-config", d / "config.json", "--format", "gguf", "--type", "Q8_0")
    assert r.exit_code == 0, r.output  # the config alone has no weights to disagree with


def test_plan_model_of_a_path_checks_the_checkpoint(tiny_model, tmp_path):
    from mixq.planning.planner import plan_model

    d = copy_model(tiny_model, tmp_path / "bad")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="hidden_size"):
        plan_model(d, "gguf", qtype="Q8_0")


# --- chat templates ---------------------------------------------------------------------------------------------
BAD_TEMPLATES = [
    ("unclosed-for", "{% for m in messages %}\n{{ m.content }}\nbye", "line 2", "does not parse", "endfor"),
    ("if-no-condition", "{% if %}{% endif %}", "line 1", "does not parse", "Expected an expression"),
    ("unclosed-print", "{{ messages[0].content\n", "line", "does not parse", "end of print statement"),
    ("unknown-filter", "hello\n{{ messages | nosuchfilter }}", "line 2", "does not parse", "nosuchfilter"),
    ("runtime-undefined-call", "{% for m in messages %}\n{{ m.content }}{{ helper(m) }}\n{% endfor %}", "line 2",
     "renders none of the sample conversations", "'helper' is undefined"),
    ("do-statement", "{% for m in messages %}{% do m.update({}) %}{% endfor %}", "line 1", "does not parse", "'do'"),
]


@pytest.mark.parametrize("case", BAD_TEMPLATES, ids=[c[0] for c in BAD_TEMPLATES])
def test_chat_template_file_jinja2_rejects_is_refused(case, tiny_model, tmp_path, out_dir):
    _, text, *needles = case
    t = tmp_path / "t.jinja"
    t.write_text(text)
    _refused(["convert", tiny_model, out_dir / "o.gguf", *GGUF, "--chat-template", t], out_dir,
             f"{t}: chat template", *needles)


def test_empty_chat_template_file_is_refused(tiny_model, tmp_path, out_dir):
    t = tmp_path / "empty.jinja"
    t.write_text("\n")
    _refused(["convert", tiny_model, out_dir / "o.gguf", *GGUF, "--chat-template", t], out_dir,
             f"{t}: empty chat template")


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_model_own_template_is_linted_naming_its_file(where, tiny_model, tmp_path, out_dir):
    d = copy_model(tiny_model, tmp_path / "m")
    bad = "{% for m in messages %}{{ m.content }}{% endif %}"
    if where == "tokenizer_config.json":
        cfg = json.loads((d / where).read_text())
        (d / where).write_text(json.dumps({**cfg, "chat_template": bad}))
    else:
        (d / where).write_text(bad)
    _refused(["convert", d, out_dir / "o.gguf", *GGUF], out_dir, f"{d / where}: chat template does not "
             "parse (jinja2, line 1:", "endif")


def test_named_templates_are_linted_each(tiny_model, tmp_path, out_dir):
    d = copy_model(tiny_model, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
                            {"name": "tool_use", "template": "{% if tools %}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    _refused(["convert", d, out_dir / "o.gguf", *GGUF], out_dir,
             "tokenizer_config.json (template 'tool_use'): chat template does not parse")


def test_lint_accepts_what_transformers_renders():
    from mixq.formats.chat_template import lint_template, prepare_template

    ok = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
          "{% elif m.role == 'system' %}{{ raise_exception('no system role') }}{% else %}{{ m.content }}{% endif %}"
          "{% endfor %}{{ strftime_now('%Y') }}")
    lint_template(ok)  # the system sample raises, the others render: accepted
    assert prepare_template(ok)["template"] == ok
    with pytest.raises(FormatError, match=r"^x\.jinja: chat template renders none .*line 1: TemplateError: always"):
        lint_template("{{ raise_exception('always') }}", "x.jinja")
