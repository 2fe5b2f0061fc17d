"""`mixq eval` checks what it scores before any forward (eval/api._resolve, eval/candidates.check_candidate,
eval/reflogits.RefLogitsReader): a candidate whose vocabulary is the reference's with permuted ids, windows longer
than the reference's max_position_embeddings, a --ref-logits file with NaN log-probs, metadata that disagrees with
its tensors or token ids outside its vocabulary, --cache-type where no llama.cpp cache runs, a sealed GGUF whose
data digest fails. Each is one `mixq: error:` line naming the file or option, exit 2; the intact inputs score."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cli_helpers import copy_model, error_line, rewrite_gguf, run_cli

CTX, WINDOWS = "64", "1"
SWAP = (302, 303)  # two ordinary BPE tokens of glm5next-mini ('Ġp', 'Ġb'): the same vocabulary, ids permuted


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread (restored afterwards): the forward's numbers do not depend on a busy machine's pool."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _eval(ref: Path, *args) -> object:
    return run_cli("eval", ref, *args)


def _scores(ref: Path, *args) -> dict:
    """The JSON report of an evaluation that must succeed."""
    r = _eval(ref, *args, "--json", "-")
    assert r.exit_code == 0, r.output[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def ref_file(mini_model, heldout_text, tmp_path_factory) -> Path:
    """Reference log-probs of glm5next-mini: 2 windows of 64 tokens."""
    out = tmp_path_factory.mktemp("eval-inputs") / "ref.safetensors"
    r = _eval(mini_model, "--text", heldout_text, "--ctx", CTX, "--windows", "2", "--save-ref", out)
    assert r.exit_code == 0, r.output[-2000:]
    return out


# --- the candidate's vocabulary -------------------------------------------------------------------------------
def test_gguf_with_permuted_token_ids_is_refused_naming_the_first_id(mini_model, mini_q8_gguf, heldout_text, tmp_path):
    tokens = list(gguf.GGUFReader(mini_q8_gguf).fields["tokenizer.ggml.tokens"].contents())
    a, b = SWAP
    tokens[a], tokens[b] = tokens[b], tokens[a]
    same = rewrite_gguf(mini_q8_gguf, tmp_path / "same.gguf")  # seal-less copy: the vocabulary alone decides
    permuted = rewrite_gguf(mini_q8_gguf, tmp_path / "permuted.gguf", kv={"tokenizer.ggml.tokens": tokens})
    line = error_line(_eval(mini_model, permuted, "--text", heldout_text, "--ctx", CTX, "--windows", WINDOWS))
    assert str(permuted) in line and f"token id {a} is {tokens[a]!r} here, {tokens[b]!r} in" in line, line
    report = _scores(mini_model, same, "--text", heldout_text, "--ctx", CTX, "--windows", WINDOWS)
    assert report["candidates"][0]["kld_mean"] < 0.01  # the intact copy scores as Q8_0 does


def test_hf_candidate_with_permuted_tokenizer_json_is_refused(mini_model, heldout_text, tmp_path):
    cand = copy_model(mini_model, tmp_path / "cand")
    tj = json.loads((cand / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    a, b = SWAP
    vocab[by_id[a]], vocab[by_id[b]] = b, a
    (cand / "tokenizer.json").write_text(json.dumps(tj))
    line = error_line(_eval(mini_model, cand, "--text", heldout_text, "--ctx", CTX, "--windows", WINDOWS))
    assert f"{cand / 'tokenizer.json'}: not the reference's vocabulary: token id {a} is {by_id[b]!r} here" in line


# --- the context ----------------------------------------------------------------------------------------------
def test_ctx_beyond_max_position_embeddings_is_refused(mini_model, heldout_text, tmp_path):
    ref = copy_model(mini_model, tmp_path / "ref4k")
    cfg = json.loads((ref / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 4096
    (ref / "config.json").write_text(json.dumps(cfg))
    line = error_line(_eval(ref, ref, "--text", heldout_text, "--ctx", "8192", "--windows", WINDOWS))
    assert line == (f"mixq: error: --ctx 8192 tokens: longer than {ref}/config.json's max_position_embeddings 4096")
    report = _scores(ref, ref, "--text", heldout_text, "--ctx", CTX, "--windows", WINDOWS)
    assert report["candidates"][0]["kld_mean"] == 0.0


# --- reference log-prob files ---------------------------------------------------------------------------------
def _edit_ref(src: Path, dst: Path, *, tensors=None, meta=None) -> Path:
    """A copy of a reference log-prob file with some tensors and metadata entries replaced."""
    with safe_open(str(src), framework="pt") as f:
        data = {k: f.get_tensor(k) for k in f.keys()}
        md = dict(f.metadata())
    data.update(tensors or {})
    md.update(meta or {})
    save_file(data, str(dst), metadata=md)
    return dst


def _lp(ref_file: Path, name: str) -> torch.Tensor:
    with safe_open(str(ref_file), framework="pt") as f:
        return f.get_tensor(name).clone()


@pytest.mark.parametrize("case", ["nan", "ctx", "vocab", "windows", "token-id"])
def test_bad_ref_logits_are_refused_naming_the_file(case, mini_model, mini_q8_gguf, ref_file, tmp_path):
    bad = tmp_path / f"{case}.safetensors"
    if case == "nan":
        lp = _lp(ref_file, "logprobs.000001")
        lp[3, 7] = float("nan")
        _edit_ref(ref_file, bad, tensors={"logprobs.000001": lp})
        needle = "window 1 holds non-finite log-probs (1 NaN, 0 Inf of"
    elif case == "ctx":
        _edit_ref(ref_file, bad, meta={"ctx": "128"})
        needle = "metadata says 2 windows of 128 tokens, the tokens tensor is [2, 64]"
    elif case == "vocab":
        _edit_ref(ref_file, bad, meta={"vocab": "4096"})
        needle = "logprobs.000000 is [31, 8192], the metadata (ctx 64, first 32, vocab 4096) implies [31, 4096]"
    elif case == "windows":
        _edit_ref(ref_file, bad, meta={"windows": "3"})
        needle = "metadata says 3 windows of 64 tokens, the tokens tensor is [2, 64]"
    else:  # a token id past the vocabulary ended in an IndexError traceback
        tokens = _lp(ref_file, "tokens")
        tokens[1, 40] = 9000
        _edit_ref(ref_file, bad, tensors={"tokens": tokens})
        needle = "token id 9000 (window 1, position 40) is outside the file's vocabulary of 8192"
    line = error_line(_eval(mini_model, mini_q8_gguf, "--ref-logits", bad, "--windows", "2"))
    assert f"{bad}: {needle}" in line, line


def test_intact_ref_logits_score(mini_model, mini_q8_gguf, ref_file):
    report = _scores(mini_model, mini_q8_gguf, "--ref-logits", ref_file, "--windows", "2")
    assert report["windows"] == 2 and report["candidates"][0]["kld_mean"] < 0.01


# --- --cache-type -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine,cand,needle", [
    ("torch", "gguf", "--cache-type q8_0 applies to --engine llamacpp only; --engine torch keeps no llama.cpp KV"),
    ("llamacpp", "hf", "--cache-type q8_0 applies to GGUF candidates, and none is given"),
])
def test_cache_type_where_no_llamacpp_cache_runs_is_refused(engine, cand, needle, mini_model, mini_q8_gguf, heldout_text):
    c = mini_q8_gguf if cand == "gguf" else mini_model
    line = error_line(_eval(mini_model, c, "--text", heldout_text, "--ctx", CTX, "--windows", WINDOWS,
                            "--engine", engine, "--cache-type", "q8_0"))
    assert needle in line, line


# --- the seal of a GGUF -----------------------------------------------------------------------------------------
def test_sealed_gguf_with_a_flipped_bit_is_refused_as_verify_finds_it(mini_model, mini_q8_gguf, heldout_text, tmp_path):
    bad = tmp_path / "flipped.gguf"
    bad.write_bytes(mini_q8_gguf.read_bytes())
    t = next(t for t in gguf.GGUFReader(bad).tensors if t.name == "blk.1.ffn_down_exps.weight")
    with open(bad, "r+b") as f:
        f.seek(int(t.data_offset) + 100)
        byte = f.read(1)[0]
        f.seek(int(t.data_offset) + 100)
        f.write(bytes([byte ^ 0x10]))
    v = run_cli("verify", bad, "--no-decode")
    assert v.exit_code == 1 and "blk.1.ffn_down_exps.weight: data differs" in v.stdout
    line = error_line(_eval(mini_model, bad, "--text", heldout_text, "--ctx", CTX, "--windows", WINDOWS))
    assert f"{bad}: fails its integrity seal: blk.1.ffn_down_exps.weight: data differs" in line, line
