"""`mixq eval --text generated[:N]`: the reference's own replies, generated on mini, saved and scored again."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import copy_model, error_line, run_cli

from mixq.eval import compare, evaluate
from mixq.eval import generated as gen
from mixq.eval.card import write_card
from mixq.eval.family import read_family, record_scores
from mixq.formats.checkpoint import load_tokenizer
from mixq.runtime import reference as refm
from mixq.runtime.dequant import CheckpointSource
from mixq.runtime.generate import generate

REPLIES, TOKENS, PROMPT = 4, 10, 12
SCORES = ("kld_mean", "kld_max", "top1", "ppl", "ppl_ref", "positions")


@pytest.fixture(scope="module")
def own_run(mini_model, mini_q8_gguf, heldout_text, tmp_path_factory):
    """REF vs [REF, Q8_0 GGUF] on 4 replies of 10 tokens the reference writes (2 greedy, 2 sampled)."""
    out = tmp_path_factory.mktemp("own")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = evaluate(mini_model, [mini_model, mini_q8_gguf], f"generated:{REPLIES}", prompts=heldout_text,
                          gen_tokens=TOKENS, gen_prompt_tokens=PROMPT, json_out=out / "own.json",
                          markdown_out=out / "own.md", progress=False)
    finally:
        torch.set_num_threads(old)
    return report, out


@pytest.fixture(scope="module")
def mini_model_fp32(mini_model):
    src = CheckpointSource(mini_model)
    weights = {n: src.ckpt.get(n, dtype=torch.float32) for n in src.ckpt.names()}
    return refm.build_model(mini_model, weights, torch.device("cpu"))


def test_reference_against_itself_is_zero_and_q8_is_not(own_run):
    report, out = own_run
    ref, q8 = report["candidates"]
    assert report["text_kind"] == "generated"
    assert ref["kld_mean"] == 0.0 and ref["kld_max"] == 0.0 and ref["top1"] == 1.0
    assert q8["kld_mean"] > 0
    # only the continuation tokens are scored: one position per generated token
    assert ref["positions"] == q8["positions"] == REPLIES * TOKENS
    g = report["generated"]
    assert (g["greedy"], g["sampled"], g["seeds"]) == (2, 2, [1, 3])
    assert "own replies" in (out / "own.md").read_text()


def test_token_file_reused_byte_for_byte(own_run, mini_model, mini_q8_gguf, tmp_path):
    report, out = own_run
    tokens = out / f"own{gen.TOKEN_FILE_SUFFIX}"
    before = tokens.read_bytes()
    doc = json.loads(before)
    assert doc["format"] == gen.FORMAT_TAG and len(doc["sequences"]) == REPLIES
    assert all(len(s["prompt"]) == PROMPT and len(s["continuation"]) == TOKENS for s in doc["sequences"])
    again = evaluate(mini_model, [mini_model, mini_q8_gguf], tokens, save_ref=tmp_path / "ref.safetensors",
                     progress=False)
    assert tokens.read_bytes() == before  # read, never regenerated or rewritten
    assert again["generated"]["sha256"] == report["generated"]["sha256"]
    for a, b in zip(report["candidates"], again["candidates"]):
        assert {k: a[k] for k in SCORES} == {k: b[k] for k in SCORES}
    # the windows scored are exactly the file's ids (the --save-ref file holds the tokens it scored)
    from mixq.eval.reflogits import RefLogitsReader

    r = RefLogitsReader(tmp_path / "ref.safetensors")
    want = torch.tensor([s["prompt"] + s["continuation"] for s in doc["sequences"]])
    assert torch.equal(r.tokens, want) and r.first == PROMPT - 1


def test_greedy_replies_are_the_uncached_argmax(own_run, mini_model_fp32):
    """The KV-cached decode against transformers' plain forward over the whole sequence: each greedy token is the
    argmax of the logits at the position before it."""
    _, out = own_run
    doc = json.loads((out / f"own{gen.TOKEN_FILE_SUFFIX}").read_text())
    for s in doc["sequences"]:
        if s["mode"] != "greedy":
            continue
        ids = torch.tensor([s["prompt"] + s["continuation"]])
        with torch.inference_mode():
            logits = mini_model_fp32(input_ids=ids, use_cache=False).logits[0]
        assert logits[PROMPT - 1:-1].argmax(-1).tolist() == s["continuation"]


def test_generation_reproducible(mini_model_fp32):
    prompts = torch.randint(1, 8000, (3, 8), generator=torch.Generator().manual_seed(0))
    kw = dict(greedy=[True, False, False], seeds=[None, 5, 6], temperature=1.0)
    a = generate(mini_model_fp32, prompts, 6, **kw)
    b = generate(mini_model_fp32, prompts, 6, **kw)
    assert torch.equal(a.continuations, b.continuations)
    c = generate(mini_model_fp32, prompts, 6, greedy=[True, False, False], seeds=[None, 7, 8], temperature=1.0)
    assert torch.equal(a.continuations[0], c.continuations[0])  # greedy ignores the seeds
    assert not torch.equal(a.continuations[1:], c.continuations[1:])


def test_compare_shows_both_texts_side_by_side(own_run, mini_model, mini_q8_gguf, heldout_text, tmp_path):
    _, out = own_run
    evaluate(mini_model, [mini_q8_gguf], heldout_text, ctx=32, windows=2, json_out=tmp_path / "held.json",
             progress=False)
    res = compare([tmp_path / "held.json", out / "own.json"])
    md = res["markdown"]
    assert "KLD text `heldout.txt`" in md and "KLD own replies (4 x 10 tokens" in md
    q8_rows = [ln for ln in md.splitlines() if ln.startswith(f"| {mini_q8_gguf.name} ")]
    assert len(q8_rows) == 1 and "| |" not in q8_rows[0]  # one row, both texts filled


def test_chat_template_prompts(mini_model, heldout_text, tmp_path):
    d = copy_model(mini_model, tmp_path / "chat")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    ids, where = gen.prompt_ids(tok, d, heldout_text, 3, 8)
    pre = tok("<|user|>", add_special_tokens=False)["input_ids"]
    post = tok("<|assistant|>", add_special_tokens=False)["input_ids"]
    plain, none = gen.prompt_ids(tok, mini_model, heldout_text, 3, 8)
    assert none is None and where.endswith("tokenizer_config.json")
    assert ids.tolist() == [pre + row + post for row in plain.tolist()]


def test_card_carries_both(own_run, tmp_path):
    """record_scores keeps held-out and own-reply scores apart in family.json; the card shows both columns."""
    report, out = own_run
    q8 = report["candidates"][1]
    root = tmp_path / "fam"
    root.mkdir()
    shutil.copyfile(q8["path"], root / "m.gguf")
    doc = {"format": "gguf", "model": "mini", "members": [{"file": "m.gguf", "bytes": q8["bytes"], "bpw": q8["bpw"]}]}
    (root / "family.json").write_text(json.dumps(doc))
    fam = read_family(root)
    held = dict(report, text="heldout.txt", text_kind="text", generated=None,
                candidates=[dict(q8, path=str(root / "m.gguf"), kld_mean=0.5)])
    own = dict(report, candidates=[dict(q8, path=str(root / "m.gguf"))])
    record_scores(held, [fam])
    record_scores(own, [fam])
    m = json.loads((root / "family.json").read_text())["members"][0]
    assert m["scores"]["kld_mean"] == 0.5 and m["scores_own_replies"]["kld_mean"] == q8["kld_mean"]
    card = Path(write_card(root, plot=False)["card"]).read_text()
    assert "KLD own replies" in card and "Own replies:" in card


def test_spec_spellings():
    assert gen.parse_text("generated") == gen.GeneratedSpec(gen.DEFAULT_COUNT)
    assert gen.parse_text("generated:7") == gen.GeneratedSpec(7)
    assert gen.parse_text("generated_text.txt") == "generated_text.txt"  # a file name, not a spec
    assert gen.parse_text(Path("generated:3")) == Path("generated:3")  # a Path is always a file


@pytest.mark.parametrize("spec", ["generated:0", "generated:x", "generated:3:7", "generated:"])
def test_bad_spec_refused(mini_model, heldout_text, spec):
    line = error_line(run_cli("eval", mini_model, mini_model, "--text", spec, "--prompts", heldout_text))
    assert f"--text {spec}" in line


@pytest.mark.parametrize("args,says", [
    (["--text", "generated:2"], "needs --prompts"),
    (["--text", "HELD", "--gen-tokens", "5"], "--gen-tokens applies to --text generated"),
    (["--text", "generated:2", "--prompts", "HELD", "--ctx", "64"], "--ctx applies to text files"),
    (["--text", "generated:2", "--prompts", "HELD", "--score", "all"], "continuation tokens only"),
    (["--text", "generated:2", "--prompts", "HELD", "--gen-temperature", "-1"], "--gen-temperature"),
    (["--text", "generated:40", "--prompts", "HELD"], "--windows 32 scores fewer than the 40 replies"),
])
def test_bad_generation_options_refused(mini_model, heldout_text, args, says):
    args = [str(heldout_text) if a == "HELD" else a for a in args]
    assert says in error_line(run_cli("eval", mini_model, mini_model, *args))


@pytest.mark.parametrize("edit,says", [
    (lambda d: d.update(vocab=d["vocab"] * 2), "vocabulary"),
    (lambda d: d["reference"].update(tokenizer_sha256="0" * 64), "another tokenizer"),
    (lambda d: d["sequences"][0]["continuation"].append(1), "lengths differ"),
    (lambda d: d["sequences"][1]["prompt"].__setitem__(0, 10 ** 6), "outside the vocabulary"),
])
def test_foreign_token_file_refused(own_run, mini_model, tmp_path, edit, says):
    _, out = own_run
    doc = json.loads((out / f"own{gen.TOKEN_FILE_SUFFIX}").read_text())
    edit(doc)
    bad = tmp_path / "bad.tokens.json"
    bad.write_text(gen.token_file_text(doc))
    line = error_line(run_cli("eval", mini_model, mini_model, "--text", bad))
    assert says in line and str(bad) in line
