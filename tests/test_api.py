"""The façade: `import mixq` gives every verb, and its spellings of one conversion write the same bytes."""
from __future__ import annotations

import pytest

import mixq
from mixq.conversion.options import family_options


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


def test_family_takes_its_options_object_or_keywords_not_a_bag(mini_model, tmp_path):
    """`mixq.family` builds FamilyOptions from keywords as `convert --size A,B,C` does; a FamilyOptions is taken as
    it is (its format decides the pipeline); everything is checked before any output is written."""
    o = family_options("exl3", bpw="2.5,3", device="cpu")
    assert isinstance(o, mixq.FamilyOptions) and o.base.format == "exl3" and len(o.targets) == 2
    assert family_options(size="1MB,2MB").base.format == "gguf"  # the format's default, said once
    cases = [
        (dict(fmt="onnx", size="1MB,2MB"), "unknown format 'onnx'"),
        (dict(size="1MB,2MB", qtyp="Q4_K_M"), "unknown convert option 'qtyp'"),
        (dict(fmt="exl3", size="1MB,2MB", tensor_type=["x=Q8_0"]), "--tensor-type applies to --format gguf only"),
        (dict(options=o, size="1MB,2MB"), "as FamilyOptions or as keywords, not both"),
        (dict(options=mixq.GGUFOptions(qtype="Q8_0")), "expected FamilyOptions, not GGUFOptions"),
    ]
    for kwargs, message in cases:
        with pytest.raises(mixq.InputError, match=message):
            mixq.family(mini_model, tmp_path / "f", **kwargs)
    assert not (tmp_path / "f").exists()
