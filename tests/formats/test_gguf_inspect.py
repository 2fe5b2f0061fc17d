"""mixq inspect on a GGUF: types, sizes, metadata and chat-template warnings."""
from __future__ import annotations

import json

from click.testing import CliRunner

from mixq.cli import main
from mixq.conversion.gguf.pipeline import convert_gguf
from mixq.formats.gguf_inspect import inspect_gguf


def test_inspect_gguf_with_template_warning(mini_model, tmp_path):
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{% for m in messages %}{{ m.content }}{{ messages.0.role }}{% endfor %}")
    out = tmp_path / "m.gguf"
    convert_gguf(mini_model, out, qtype="Q8_0", chat_template=tmpl, no_mtp=True, progress=False)
    d = inspect_gguf(out)
    assert d["architecture"] == "glm5-next" and d["tensors"] == 122 and d["block_count"] == 4
    assert 0.9 * out.stat().st_size < d["bytes"] < out.stat().st_size  # tensor data only, no metadata
    assert sum(v["tensors"] for v in d["types"].values()) == 122 and d["types"]["F32"]["tensors"] > 0
    assert d["chat_template_warnings"] == ["line 1: numeric-attr 'messages.0'"]
    assert d["metadata"]["tokenizer.ggml.tokens"] == "<array of 8192>"
    assert {r["name"] for r in d["tensor_list"]} >= {"token_embd.weight", "output.weight"}
    res = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["bpw"] == d["bpw"]
    res = CliRunner().invoke(main, ["inspect", str(out)])
    assert "numeric-attr" in res.output and "Q8_0 x" in res.output
