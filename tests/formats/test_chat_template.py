"""Chat template check/fix for llama.cpp's C++ Jinja engine: numeric attribute access flagged, rewritten to
indexing, renders identically in jinja2, and embedded in the GGUF."""
from __future__ import annotations

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
    q = prepare_template("{% for m in messages %}{% do m.update({'x': 1}) %}{{ m.content }}{% endfor %}", fix=True)
    assert q["issues"] == ["line 1: statement '{% do %}' (not auto-fixable)"] and not q["fixed"]
    assert prepare_template(GLM_LIKE)["template"] == GLM_LIKE  # without --fix nothing changes


def test_render_difference_is_an_error():
    with pytest.raises(FormatError, match="differently"):
        check_render_equal(GLM_LIKE, GLM_LIKE.replace("<|observation|>", "<|tool|>"))


def test_gguf_carries_fixed_template(mini_model, tmp_path):
    from mixq.convert.gguf_pipeline import convert_gguf

    tmpl = tmp_path / "t.jinja"
    tmpl.write_text(GLM_LIKE)
    s = convert_gguf(mini_model, tmp_path / "m.gguf", qtype="BF16", chat_template=tmpl, fix_chat_template=True,
                     no_mtp=True, progress=False)
    assert s["chat_template"]["fixed"] and len(s["chat_template"]["issues"]) == 4
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["tokenizer.chat_template"].contents() == fix_template(GLM_LIKE)
