"""mixq's GGUF files in the real llama.cpp (llama-cpp-python 0.3.36): they load, and their logits match
transformers' on a held-out window as well as llama.cpp's own converter + quantizer do (issue 6 yardsticks,
measured by the reference sheet on 256 tokens with an F32 KV cache). Slow: converts and runs both engines."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp")

from mixq.convert.gguf_pipeline import convert_gguf  # noqa: E402
from mixq.eval.llamacpp import LlamaCppScorer  # noqa: E402
from mixq.eval.reference import build_model, load_tokenizer, scored_logits, tokenize_text  # noqa: E402
from mixq.formats.checkpoint import open_checkpoint  # noqa: E402
from mixq.formats.gguf_reader import read_gguf_weights  # noqa: E402

CTX = 257  # scored positions 0..255: 256 tokens, as the yardsticks
# KLD(transformers || llama.cpp) of llama.cpp's own converter + llama-quantize on 256 tokens (issue 6)
YARDSTICK = {("mini", "Q8_0"): 6e-4, ("k256", "Q8_0"): 1.4e-3, ("mini", "Q4_K_M"): 4.6e-3, ("k256", "Q4_K_M"): 1.7e-2}
RESULTS = os.environ.get("MIXQ_GGUF_RESULTS")  # optional JSON lines file to record the measured numbers


def _kld(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> float:
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(cand_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.fixture(scope="module")
def windows(mini_model, heldout_text):
    tok = load_tokenizer(mini_model)  # both fixtures share the 8k tokenizer
    ids = tokenize_text(tok, heldout_text, need_tokens=4 * CTX)
    return torch.tensor(ids[CTX:2 * CTX])  # skip the file head; one 256-token window


@pytest.fixture(scope="module")
def reference(request, windows):
    cache = {}

    def get(model_dir):
        if model_dir not in cache:
            ck = open_checkpoint(model_dir)
            w = {n: ck.get(n) for n in ck.names()}
            m = build_model(model_dir, w, torch.device("cpu"))
            cache[model_dir] = scored_logits(m, windows, 0).cpu()
        return cache[model_dir]

    return get


def _record(**kw):
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps(kw) + "\n")


@pytest.mark.parametrize("name", ["mini", "k256"])
@pytest.mark.parametrize("qtype", ["BF16", "Q8_0", "Q4_K_M"])
def test_llamacpp_logits_vs_transformers(name, qtype, request, tmp_path, windows, reference):
    model_dir = request.getfixturevalue(f"{name}_model")
    out = tmp_path / f"{name}-{qtype}.gguf"
    summary = convert_gguf(model_dir, out, qtype=qtype, progress=False)
    scorer = LlamaCppScorer(out, ctx=CTX, first=0, cache_type="f32")
    try:
        got = scorer(windows)
    finally:
        scorer.close()
    ref = reference(model_dir)
    kld = _kld(ref, got)
    top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    rec = dict(model=name, qtype=qtype, kld=kld, top1=top1, bpw=summary["bpw"], types=summary["types"])
    if qtype == "Q4_K_M":
        # llama.cpp's logits vs mixq's own dequantized weights in transformers: the file means what mixq thinks
        deq = scored_logits(build_model(model_dir, read_gguf_weights(out), torch.device("cpu")), windows, 0).cpu()
        rec["kld_vs_dequant"] = _kld(deq, got)
        assert rec["kld_vs_dequant"] < 1e-3, rec
    _record(**rec)
    print(rec)
    if qtype == "BF16":
        assert kld < 2e-4 and top1 > 0.98, rec
    else:
        assert kld <= YARDSTICK[(name, qtype)], rec


def test_sharded_gguf_loads(mini_model, tmp_path, windows):
    one = tmp_path / "one.gguf"
    convert_gguf(mini_model, one, qtype="Q8_0", progress=False)
    split = convert_gguf(mini_model, tmp_path / "split.gguf", qtype="Q8_0", shard_size="2M", progress=False)
    assert len(split["files"]) >= 2 and split["files"][0].endswith("-00001-of-0000%d.gguf" % len(split["files"]))
    a = LlamaCppScorer(one, ctx=CTX, first=0)
    b = LlamaCppScorer(split["files"][0], ctx=CTX, first=0)
    try:
        la, lb = a(windows), b(windows)
    finally:
        a.close()
        b.close()
    assert torch.equal(la, lb)


@pytest.mark.parametrize("qtype,ftype", [("Q4_K_M", 15), ("Q2_K", 10)])
def test_same_as_llama_quantize(qtype, ftype, k256_model, tmp_path, windows, reference):
    """llama.cpp's own quantizer (C API llama_model_quantize, no imatrix) applied to mixq's BF16 file (the
    converter's layout) vs mixq's direct conversion: same types per tensor, and mixq's KLD is no higher."""
    from mixq.formats.gguf_reader import read_gguf

    bf16 = tmp_path / "bf16.gguf"
    convert_gguf(k256_model, bf16, qtype="BF16", progress=False)
    theirs = tmp_path / f"llama-{qtype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(bf16).encode(), str(theirs).encode(), params)
    assert rc == 0
    ours = tmp_path / f"mixq-{qtype}.gguf"
    convert_gguf(k256_model, ours, qtype=qtype, progress=False)
    ga, gb = read_gguf(ours), read_gguf(theirs)
    assert set(ga.tensors) == set(gb.tensors)
    type_diff = {n: (ga.tensors[n].qtype, gb.tensors[n].qtype) for n in ga.tensors
                 if ga.tensors[n].qtype != gb.tensors[n].qtype}
    same_bytes = sum(bool((ga.tensors[n].raw() == gb.tensors[n].raw()).all()) for n in ga.tensors if n not in type_diff)
    ref = reference(k256_model)
    klds = {}
    for tag, path in (("mixq", ours), ("llama-quantize", theirs)):
        sc = LlamaCppScorer(path, ctx=CTX, first=0, cache_type="f32")
        try:
            klds[tag] = _kld(ref, sc(windows))
        finally:
            sc.close()
    rec = dict(model="k256", qtype=qtype, klds=klds, type_diff=type_diff, same_bytes=same_bytes,
               tensors=len(ga.tensors))
    _record(**rec)
    print(rec)
    assert not type_diff, rec
    assert klds["mixq"] <= klds["llama-quantize"] * 1.02 + 1e-6, rec
