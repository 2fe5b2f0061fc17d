"""`mixq plan --format gguf` shows the types `mixq convert` writes: one assignment (planning/gguf_assign, with the
type rules of planning/gguf_rules) serves both, and the file read back by gguf-py holds, tensor by tensor, the
plan's type and byte count."""
from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli
from gguf import GGUFReader

import mixq
from mixq.errors import InputError


@pytest.mark.parametrize("target", [{"qtype": "Q4_K_M"}, {"qtype": "IQ3_M"}, {"bpw": 5.0}],
                         ids=["Q4_K_M", "IQ3_M", "bpw5"])
def test_every_planned_tensor_is_written_with_its_type_and_bytes(mini_model, tmp_path, target):
    plan = mixq.plan(mini_model, "gguf", **target)
    out = tmp_path / "m.gguf"
    mixq.convert(mini_model, out, "gguf", threads=1, progress=False, **target)
    written = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(out).tensors}
    planned = {t.name: (t.type, t.bytes) for t in plan.tensors}
    assert written == planned
    assert len({t for t, _ in planned.values()}) > 2  # a mix, not one type everywhere


def test_plan_type_with_imatrix_plans_what_an_imatrix_conversion_takes(k256_model, tmp_path):
    """llama-quantize's IQ3_XXS mix puts the attn_v tensors at IQ3_S without an importance matrix and keeps them at
    IQ3_XXS with one: `plan --type IQ3_XXS --imatrix IMX` plans the latter (the file is only named, not read)."""
    imx = tmp_path / "imx.gguf"
    imx.write_bytes(b"")
    without = {t.name: t.type for t in mixq.plan(k256_model, "gguf", qtype="IQ3_XXS").tensors}
    with_ = {t.name: t.type for t in mixq.plan(k256_model, "gguf", qtype="IQ3_XXS", imatrix=imx).tensors}
    assert without["blk.0.attn_v.weight"] == "IQ3_S" and with_["blk.0.attn_v.weight"] == "IQ3_XXS"
    assert without["blk.0.attn_q.weight"] == with_["blk.0.attn_q.weight"] == "IQ2_S"


# llama-quantize's per-tensor options: a rule, a rule whose K-type the 64-value rows cannot hold (its fallback is
# planned and written), and the two flags; the command line's `mixq plan` reads them as `mixq convert` does
RULES = ["--tensor-type", "attn_q=Q8_0", "--tensor-type", "ffn_down_exps=Q6_K", "--output-tensor-type", "q5_0",
         "--token-embedding-type", "Q4_1"]


def test_type_rules_are_planned_as_convert_writes_them(mini_model, tmp_path):
    out = tmp_path / "m.gguf"
    r = run_cli("convert", mini_model, out, "--type", "Q4_K_M", "--threads", "1", *RULES)
    assert r.exit_code == 0, r.output[-2000:]
    r = run_cli("plan", mini_model, "--format", "gguf", "--type", "Q4_K_M", "--json", *RULES)
    assert r.exit_code == 0, r.output[-2000:]
    planned = {t["name"]: (t["type"], t["bytes"]) for t in json.loads(r.stdout)["tensors"]}
    written = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(out).tensors}
    assert written == planned
    assert written["output.weight"][0] == "Q5_0" and written["token_embd.weight"][0] == "Q4_1"
    assert written["blk.0.attn_q.weight"][0] == "Q8_0" and written["blk.1.ffn_down_exps.weight"][0] == "Q8_0"
    assert "written as Q8_0, not the Q6_K asked by --tensor-type ffn_down_exps=Q6_K" in r.stderr
    plain = {t.name: t.type for t in mixq.plan(mini_model, "gguf", qtype="Q4_K_M").tensors}
    assert plain["output.weight"] != "Q5_0" and plain["blk.0.attn_q.weight"] != "Q8_0"  # the rules changed them


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_type": ["attn_q"]}, "--tensor-type 'attn_q': expected REGEX=TYPE"),
    ({"tensor_type": ["(=Q8_0"]}, "--tensor-type '\\(': bad regex"),
    ({"tensor_type": ["attn_q=Q9_K"]}, "unknown GGUF type 'Q9_K'"),
    ({"output_tensor_type": "Q1_X"}, "--output-tensor-type: unknown GGUF type"),
    ({"token_embedding_type": "Q8_0", "fmt": "exl3"}, "apply to --format gguf"),
    ({"tensor_type": ["attn_q=Q8_0"], "fit": "1GB", "context": "8K"}, "--fit plans by role"),
])
def test_plan_type_rules_are_checked_when_built(kwargs, message):
    with pytest.raises(InputError, match=message):
        mixq.PlanOptions(**{"fmt": "gguf", **kwargs})


def test_a_rule_that_decides_nothing_is_refused_by_plan_as_by_convert(mini_model):
    with pytest.raises(InputError, match="matches no tensor of this model"):
        mixq.plan(mini_model, "gguf", qtype="Q4_K_M", tensor_type=["no_such_tensor=Q8_0"])
