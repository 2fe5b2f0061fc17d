"""mixq against exllamav3 itself: tests/data/exllamav3_tiny holds two EXL3 directories written by exllamav3 1.6.5's
own converter (MCG at 2 bpw, MUL1 at 2.5 bpw; head at 6, NextN block at 3 / 3.5) from a tiny glm5_next model, with
the weights exllamav3 reconstructs, its rotated-basis codebook values and its `Model.forward` logits, all saved
in the same GPU run by bench/engines/exllamav3_oracle.py (its docstring: the device command, what each file holds).

mixq inspects and verifies the directories, decodes the saved Linears to exllamav3's values (fp16 rounding; the
rotated basis bit for bit), its torch forward of the decoded weights gives exllamav3's logits, and `mixq eval`
scores the directories against their source, which the bench's `build_source` rebuilds here byte for byte.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mixq
from cli_helpers import run_cli
from module_loader import BENCH, load_module
from mixq.formats.exl3_reader import Exl3Dir
from mixq.quant.trellis import from_tensors
from mixq.runtime.calibration import BUILTIN_TEXT
from mixq.runtime.dequant import read_exl3

DATA = Path(__file__).resolve().parents[1] / "data" / "exllamav3_tiny"
CODEBOOKS = ("mcg", "mul1")
# exllamav3 reconstructs in fp16 (each Hadamard's result and each scale product rounded to fp16): a few fp16
# ulps of the largest weight; a wrong codebook, bit order or scale is off by the weights' own size
WEIGHT_TOL = 2.0 ** -8
# exllamav3 runs the model in fp16, transformers in fp32: centred logits agree to a few per cent at most
LOGITS_REL_TOL = 0.05
LOGITS_KLD_TOL = 1e-3

pytestmark = pytest.mark.skipif(
    not (DATA / "oracle.json").is_file(),
    reason="tests/data/exllamav3_tiny absent: written on a CUDA machine by bench/engines/exllamav3_oracle.py "
           "(python3 bench/engines/exllamav3_oracle.py --out OUT/exllamav3_tiny, then copied to tests/data)")


@pytest.fixture(scope="module")
def oracle() -> dict:
    return json.loads((DATA / "oracle.json").read_text())


@pytest.fixture(scope="module")
def values() -> dict[str, torch.Tensor]:
    return load_file(str(DATA / "oracle.safetensors"))


@pytest.fixture(scope="module")
def bench():
    return load_module("exllamav3_oracle", BENCH / "engines" / "exllamav3_oracle.py")


@pytest.fixture(scope="module")
def source(bench, tmp_path_factory) -> Path:
    """The checkpoint exllamav3 converted, rebuilt by the bench's own recipe."""
    return bench.build_source(tmp_path_factory.mktemp("oracle") / "src")


@pytest.fixture(scope="module")
def decoded() -> dict[str, dict[str, torch.Tensor]]:
    """mixq's read of each directory: {codebook: {HF name: float32 tensor}}."""
    return {cb: read_exl3(exl3_dir(cb)) for cb in CODEBOOKS}


def exl3_dir(codebook: str) -> Path:
    return DATA / f"tiny-{codebook}"


def test_oracle_is_complete(oracle, values):
    """Both directories, every saved tensor, exllamav3 1.6.5 wrote them."""
    assert oracle["versions"]["exllamav3"] == "1.6.5" and not oracle["errors"]
    assert sorted(oracle["dirs"]) == sorted(CODEBOOKS)
    for cb in CODEBOOKS:
        assert exl3_dir(cb).is_dir() and f"{cb}/logits" in values
        assert all(f"{cb}/weight/{k}" in values for k in oracle["weights"])
        assert all(f"{cb}/rotated/{k}" in values for k in oracle["rotated"])
    assert "source/logits" in values and values["input_ids"].tolist() == oracle["input_ids"]


def test_source_rebuilds_byte_for_byte(bench, source, oracle):
    """The recipe gives the very files exllamav3 converted (else the eval below scores another model).
    tokenizer.json's bytes follow the tokenizers release that wrote it: there its vocabulary and merges must be
    those of the copy exllamav3's converter put in its directories."""
    got, want = bench.file_digests(source), dict(oracle["source"]["sha256"])
    assert sorted(got) == sorted(want)
    got.pop("tokenizer.json"), want.pop("tokenizer.json")
    assert got == want

    def bpe(p: Path) -> tuple:
        m = json.loads(p.read_text())["model"]
        return m["vocab"], m["merges"]

    assert bpe(source / "tokenizer.json") == bpe(exl3_dir(CODEBOOKS[0]) / "tokenizer.json")


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_inspect_and_verify_accept(codebook, oracle):
    """The façade and the CLI read exllamav3's directory: its writer, codebook and rates; verify finds nothing
    wrong and says that structure and decode were checked (there is no mixq manifest)."""
    d, rates = exl3_dir(codebook), oracle["dirs"][codebook]
    info = mixq.inspect(d)
    assert info["writer"] == "exllamav3 1.6.5" and info["mixq_manifest"] is False
    assert info["quantization_config"]["codebook"] == codebook
    assert info["codebooks"] == {codebook: info["kinds"]["trellis"]} and info["kinds"]["trellis"] > 20
    assert info["rates"]["head_bits"]["bpw"] == rates["head_bits"]
    assert info["rates"]["mtp_bits"]["bpw"] == rates["mtp_bits"]
    assert info["rates"]["bits"]["bpw"] == rates["bits"]
    assert info["bytes"] == sum(p.stat().st_size for p in d.glob("*.safetensors"))

    rep = mixq.verify(d)
    assert rep["ok"] and rep["problems"] == [] and rep["manifest"] is False, rep["problems"]
    assert rep["integrity"] == "no mixq manifest: structure and decode checked"
    r = run_cli("verify", d, "--no-decode")  # the decode was the façade's (the same code, and the slow part)
    assert r.exit_code == 0 and "no mixq manifest: structure checked" in r.stdout, r.output[-3000:]
    r = run_cli("inspect", d, "--json")
    assert r.exit_code == 0, r.output[-3000:]
    assert json.loads(r.stdout)["codebooks"] == info["codebooks"]


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_decode_matches_exllamav3(codebook, oracle, values, decoded):
    """read_exl3 gives the weights exllamav3 reconstructs (fused KDA qkv, attention, a NextN expert, the head)
    to fp16 rounding."""
    units = {u.key: u for u in Exl3Dir(exl3_dir(codebook)).units}
    for key in oracle["weights"]:
        want = values[f"{codebook}/weight/{key}"].float()
        got = torch.cat([decoded[codebook][n] for n in units[key].hf_names], 0)[: want.shape[0], : want.shape[1]]
        assert got.shape == want.shape, key
        err = (got - want).abs().max().item()
        assert err <= WEIGHT_TOL * want.abs().max().item(), (key, err, want.abs().max().item())


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_rotated_decode_is_exact(codebook, oracle, values):
    """Before the Hadamards and scales the decode is the codebook itself: exllamav3's values bit for bit (the
    trellis bit order, the tail-biting state, the codebook multiplier)."""
    d = Exl3Dir(exl3_dir(codebook))
    units = {u.key: u for u in d.units}
    for key in oracle["rotated"]:
        t = {n[len(key) + 1:]: v for n, v in d.unit_tensors(units[key]).items()}
        k, n = t["trellis"].shape[0] * 16, t["trellis"].shape[1] * 16
        got = from_tensors(t, (n, k)).rotated()
        assert torch.equal(got, values[f"{codebook}/rotated/{key}"].float()), key


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_torch_forward_matches_exllamav3_logits(codebook, bench, values, decoded):
    """The reference architecture holding mixq's decode gives exllamav3's own logits on the saved tokens."""
    got = bench.torch_logits(exl3_dir(codebook), decoded[codebook], values["input_ids"])
    want = values[f"{codebook}/logits"]
    assert bench.centered_rel_diff(want, got) < LOGITS_REL_TOL
    assert bench.kld(want, got) < LOGITS_KLD_TOL


def test_source_forward_matches_exllamav3_logits(source, bench, values):
    """The rebuilt source in the reference architecture gives exllamav3's logits of the unquantized source."""
    got = bench.torch_logits(source, load_file(str(source / "model.safetensors")), values["input_ids"])
    want = values["source/logits"]
    assert bench.centered_rel_diff(want, got) < LOGITS_REL_TOL
    assert bench.kld(want, got) < LOGITS_KLD_TOL


def test_eval_scores_against_the_source(source, tmp_path):
    """`mixq eval` (the façade and the CLI) scores both directories against their source: finite, positive."""
    text = tmp_path / "text.txt"
    text.write_text(BUILTIN_TEXT)
    dirs = [exl3_dir(cb) for cb in CODEBOOKS]
    rep = mixq.evaluate(source, dirs, text, windows=1, ctx=32, device="cpu", progress=False)
    assert [c["format"] for c in rep["candidates"]] == ["exl3", "exl3"]
    for c in rep["candidates"]:
        assert math.isfinite(c["kld_mean"]) and c["kld_mean"] > 0 and 0 <= c["top1"] <= 1
    r = run_cli("eval", source, dirs[0], "--text", text, "--ctx", 32, "--windows", 1, "--device", "cpu",
                "--json", "-")
    assert r.exit_code == 0, r.output[-3000:]
    cli = json.loads(r.stdout[r.stdout.index("{"):])
    assert cli["candidates"][0]["kld_mean"] == rep["candidates"][0]["kld_mean"]
