"""Chat template check/fix for llama.cpp's C++ Jinja engine: numeric attribute access flagged, rewritten to
indexing, renders identically in jinja2, and embedded in the GGUF."""
from __future__ import annotations

import json

import gguf
import pytest

from mixq.errors import FormatError
from mixq.formats.chat_template import check_render_equal, check_template, fix_template, prepare_template, render, \
    sample_conversations

# A GLM-style template that indexes lists with `.0` (and a chained `.0.0`), the construct llama.cpp refuses.
GLM_LIKE = """[gMASK]<sop>
{%- if tools -%}<|system|>
# Tools
{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.description }}
{% endfor %}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}<|assistant|>
{{ m.content if m.content else '' }}
{%- if m.tool_calls %}{% set first = m.tool_calls.0 %}
<tool_call>{{ first.function.name }}{% for tc in m.tool_calls %}|{{ tc.function.name }}{% endfor %}
{%- set pair = [[m.tool_calls.0.function.name, 'x']] %} [{{ pair.0.0 }}]</tool_call>
{%- endif -%}
{%- elif m.role == 'tool' -%}<|observation|>
{{ m.content }} (text "a.0" stays)
{%- else -%}<|{{ m.role }}|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""


def test_numeric_access_flagged_and_fixed():
    issues = check_template(GLM_LIKE)
    texts = [i.text for i in issues]
    assert [i.kind for i in issues] == ["numeric-attr"] * 4
    assert texts == ["tool_calls.0", "tool_calls.0", "pair.0", "0.0"] and issues[0].line == 9
    fixed = fix_template(GLM_LIKE)
    assert "m.tool_calls[0]" in fixed and "pair[0][0]" in fixed and '"a.0"' in fixed
    assert check_template(fixed) == []
    assert check_render_equal(GLM_LIKE, fixed) == 4
    out = render(fixed, sample_conversations()[2], bos_token="", eos_token="")
    assert "<tool_call>get_weather|get_weather [get_weather]</tool_call>" in out


def test_prepare_reports_diff_and_statements():
    p = prepare_template(GLM_LIKE, fix=True)
    assert p["fixed"] and "-{%- if m.tool_calls %}{% set first = m.tool_calls.0 %}" in p["diff"]
    assert len(p["issues"]) == 4 and p["remaining"] == []
    q = prepare_template("{% for m in messages %}{% with c = m.content %}{{ c }}{% endwith %}{% endfor %}", fix=True)
    assert q["issues"] == ["line 1: statement '{% with %}' (not auto-fixable)"] and not q["fixed"]
    with pytest.raises(FormatError, match="unknown tag 'do'"):  # jinja2 itself rejects it: refused, not reported
        prepare_template("{% for m in messages %}{% do m.update({'x': 1}) %}{{ m.content }}{% endfor %}")
    assert prepare_template(GLM_LIKE)["template"] == GLM_LIKE  # without --fix nothing changes


def test_render_difference_is_an_error():
    with pytest.raises(FormatError, match="differently"):
        check_render_equal(GLM_LIKE, GLM_LIKE.replace("<|observation|>", "<|tool|>"))


def test_gguf_carries_fixed_template(mini_model, tmp_path):
    from mixq.conversion.gguf.pipeline import convert_gguf

    tmpl = tmp_path / "t.jinja"
    tmpl.write_text(GLM_LIKE)
    s = convert_gguf(mini_model, tmp_path / "m.gguf", qtype="BF16", chat_template=tmpl, fix_chat_template=True,
                     no_mtp=True, progress=False)
    assert s["chat_template"]["fixed"] and len(s["chat_template"]["issues"]) == 4
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["tokenizer.chat_template"].contents() == fix_template(GLM_LIKE)


# --- the real engine: llama.cpp's C++ Jinja (common/jinja/ of the llama.cpp vendored in llama-cpp-python 0.3.36),
# compiled with a small driver of ours (not llama-server: that build costs ~25 min on 2 cores).
_DRIVER = r'''
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include "json.h"
#include "jinja/runtime.h"
#include "jinja/parser.h"
#include "jinja/lexer.h"
static std::string slurp(const char * p) { std::ifstream f(p, std::ios::binary); std::stringstream s; s << f.rdbuf(); return s.str(); }
extern "C" void ggml_abort(const char * file, int line, const char *, ...) { std::cerr << file << ":" << line << "\n"; std::abort(); }
int main(int argc, char ** argv) {
    if (argc != 3) return 2;
    try {
        std::string tmpl = slurp(argv[1]);
        auto vars = common_json::parse(slurp(argv[2]));
        jinja::lexer lexer;
        jinja::program prog = jinja::parse_from_tokens(lexer.tokenize(tmpl));
        jinja::context ctx(tmpl);
        jinja::global_from_json(ctx, vars, false);
        jinja::runtime rt(ctx);
        std::cout << rt.gather_string_parts(rt.execute(prog))->as_string().str();
    } catch (const std::exception & e) { std::cout << "ERROR: " << e.what(); return 1; }
    return 0;
}
'''


@pytest.fixture(scope="module")
def cpp_jinja(tmp_path_factory):
    import os
    import shutil
    import subprocess
    from pathlib import Path

    # default: the llama-cpp-python sdist unpacked in ../vendor next to the repo (bench/tools/llamacpp_tools.py)
    src = Path(os.environ.get("MIXQ_LLAMA_CPP_SRC") or
               Path(__file__).resolve().parents[3] / "vendor" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp")
    if not (src / "common" / "jinja" / "runtime.cpp").is_file() or shutil.which("g++") is None:
        pytest.skip("vendored llama.cpp sources (MIXQ_LLAMA_CPP_SRC) or g++ not available")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mixq" / "llamacpp-jinja-driver"
    if not cache.is_file():
        d = tmp_path_factory.mktemp("jinja")
        (d / "driver.cpp").write_text(_DRIVER)
        cache.parent.mkdir(parents=True, exist_ok=True)
        files = [str(d / "driver.cpp")] + sorted(str(p) for p in (src / "common" / "jinja").glob("*.cpp"))
        files += [str(src / "common" / "unicode.cpp"), str(src / "common" / "json.cpp")]
        subprocess.run(["g++", "-std=c++17", "-O1", "-w", "-I", str(src / "common"), "-I", str(src / "vendor"),
                        "-I", str(src / "ggml" / "include"), *files, "-o", str(cache)], check=True)

    def run(template: str, conv: dict, tmp) -> tuple[int, str]:
        (tmp / "t.jinja").write_text(template)
        (tmp / "c.json").write_text(json.dumps(dict(conv, bos_token="[gMASK]", eos_token="<|endoftext|>")))
        r = subprocess.run([str(cache), str(tmp / "t.jinja"), str(tmp / "c.json")], capture_output=True, text=True)
        return r.returncode, r.stdout

    return run


@pytest.mark.slow
def test_llamacpp_engine_refuses_original_accepts_fixed(cpp_jinja, tmp_path):
    fixed = fix_template(GLM_LIKE)
    refused = 0
    for conv in sample_conversations():
        rc, out = cpp_jinja(GLM_LIKE, conv, tmp_path)
        refused += rc != 0
        rc, out = cpp_jinja(fixed, conv, tmp_path)
        assert rc == 0, out
        assert out == render(fixed, conv, bos_token="[gMASK]", eos_token="<|endoftext|>")  # same text as jinja2
    assert refused == 2  # both tool-call conversations hit the chained `.0.0` access
