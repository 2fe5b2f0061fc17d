"""`mixq eval MODEL FAMILY_DIR`: a family expands to its members, the reference runs once for all of them, each
member gets the KLD a separate evaluation gives, the scores land in family.json and `<file>.receipt.json`, and
`mixq card` writes a model card huggingface_hub parses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import run_cli
from mixq.api import card, convert, evaluate
from mixq.eval.family import expand_families
from mixq.formats.receipt import receipt_json_path
from mixq.runtime.dequant import CheckpointSource

from .conftest import CTX, WINDOWS

SIZES = ("5.8MB", "6.2MB")  # within glm5next-mini's --size range (its BF16 token_embd is kept)


@pytest.fixture(scope="module")
def fam_dir(mini_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("evalfam") / "mini-gguf"
    convert(mini_model, out, "gguf", size=",".join(SIZES), rows=4, seq_len=64, threads=1, progress=False)
    return out


def _eval(mini_model, cands, text, **kw):
    return evaluate(mini_model, cands, text, ctx=CTX, windows=WINDOWS, device="cpu", progress=False, **kw)


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_family_eval_runs_the_reference_once(fam_dir, mini_model, heldout_text, monkeypatch):
    calls: list[int] = []
    layer = CheckpointSource.layer

    def counted(self, i, *a, **k):  # the reference's weights of decoder layer i (HF candidates would count too)
        calls.append(i)
        return layer(self, i, *a, **k)

    monkeypatch.setattr(CheckpointSource, "layer", counted)
    rep = _eval(mini_model, [fam_dir], heldout_text)
    n_layers = json.loads((mini_model / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert sorted(calls) == list(range(n_layers))  # each reference layer once, for both members
    members, _ = expand_families([fam_dir])
    assert [c["path"] for c in rep["candidates"]] == [str(m) for m in members] and len(members) == 2
    monkeypatch.setattr(CheckpointSource, "layer", layer)
    for c, m in zip(rep["candidates"], members):  # the same numbers as evaluating the member alone
        alone = _eval(mini_model, [m], heldout_text)["candidates"][0]
        assert c["kld_mean"] == alone["kld_mean"] and c["top1"] == alone["top1"]
    doc = json.loads((fam_dir / "family.json").read_text())
    for m, c in zip(doc["members"], rep["candidates"]):
        assert m["scores"]["kld_mean"] == c["kld_mean"] and m["scores"]["engine"] == "torch"
        assert m["scores"]["text_sha256"] and m["scores"]["windows"] == WINDOWS
        rj = json.loads(receipt_json_path(fam_dir / m["file"]).read_text())
        assert rj["scores"]["kld_mean"] == c["kld_mean"] and rj["receipt"]["target"]["size"] == m["target_bytes"]


def test_card_parses_as_a_model_card(fam_dir, mini_model, heldout_text):
    hub = pytest.importorskip("huggingface_hub")
    if not any("scores" in m for m in json.loads((fam_dir / "family.json").read_text())["members"]):
        _eval(mini_model, [fam_dir], heldout_text)
    d = card(fam_dir, base_model="example/glm5next-mini")
    text = Path(d["card"]).read_text()
    mc = hub.ModelCard.load(d["card"])
    assert mc.data.base_model == "example/glm5next-mini" and mc.data.base_model_relation == "quantized"
    assert mc.data.library_name == "gguf" and "gguf" in mc.data.tags
    for m in json.loads((fam_dir / "family.json").read_text())["members"]:
        row = next(ln for ln in text.splitlines() if f"`{m['file']}`" in ln)
        assert f"{m['bytes']:,}" in row and f"{m['scores']['kld_mean']:.4g} ±" in row and "torch" in row
    assert "huggingface-cli upload" in text and "imatrix" in text
    try:
        import matplotlib  # noqa: F401
        assert d["plot"] and Path(d["plot"]).stat().st_size > 0
    except ImportError:
        assert d["plot"] is None
    r = run_cli("card", fam_dir)  # exists: refused without --overwrite, one line
    assert r.exit_code == 2 and "already exists" in r.stderr
    assert run_cli("card", fam_dir, "--overwrite", "--json").exit_code == 0
