"""The façade: `import mixq` gives every verb, and its spellings of one conversion write the same bytes."""
from __future__ import annotations

import mixq


def test_keyword_and_options_spellings_write_the_same_bytes(tiny_model, tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    mixq.convert(tiny_model, a, qtype="Q8_0", threads=1, progress=False)
    mixq.convert(tiny_model, b, mixq.GGUFOptions(qtype="Q8_0", threads=1, progress=False))
    mixq.api.convert(tiny_model, c, "gguf", qtype="Q8_0", threads=1, progress=False)
    assert a.read_bytes() == b.read_bytes() == c.read_bytes()
    assert mixq.verify(a)["problems"] == []


def test_inspect_and_plan_through_the_facade(tiny_model):
    d = mixq.inspect(tiny_model)
    plan = mixq.plan(tiny_model, "gguf", qtype="Q8_0")
    assert plan.total_bytes > 0 and d["params"] > 0
    assert mixq.api.format_plan(plan, per_tensor=False)
