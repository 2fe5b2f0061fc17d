"""GGUF families (conversion/gguf/family.py): several byte targets from one calibration and one encode per (tensor, type);
each member within its bytes, verified, carrying its receipt, and byte-identical to the same member converted
alone with the same imatrix."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cli_helpers import error_line, run_cli
from mixq.api import convert, inspect, verify
from mixq.measurement.encode_cache import CACHE_DIR
from mixq.conversion.gguf.family import CURVES_SUFFIX as GGUF_CURVES, FAMILY_JSON, run_family
from mixq.measurement.gguf_errors import measure_gguf_errors
from mixq.measurement.trellis import load_curves, save_curves
from mixq.conversion.options import family_options
from mixq.errors import InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.imatrix_file import read_imatrix
from mixq.planning import gguf_mix as gm
from mixq.planning.gguf_measured import measured_units
from mixq.eval.llamacpp import LlamaCppScorer
from mixq.runtime.reference import load_tokenizer, tokenize_text
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.receipt import read_receipt
from mixq.formats.safetensors_io import sha256_file
from mixq.planning.planner import plan_model

# on glm5next-mini a --size plan keeps token_embd in BF16 and output at 6 bits, more than the Q3_K_M..Q5_K_M
# mixes' whole files: with token_embd at Q4_K and output at 5 bits their byte counts are reachable
STEER = {"overrides": ("embed=Q4_K",), "head_bits": 5}
MIXES = ("Q3_K_M", "Q4_K_M", "Q5_K_M")
CALIB = {"rows": 4, "seq_len": 64}  # the family's own imatrix: a few rows keep it to seconds on a CPU


def mix_bytes(model) -> list[int]:
    """The whole-file bytes of the llama-quantize mixes, as the planner gives them."""
    return [plan_model(model, "gguf", qtype=q).total_bytes for q in MIXES]


@pytest.fixture(scope="module")
def family(mini_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("family") / "mini-gguf"
    sizes = mix_bytes(mini_model)
    res = convert(mini_model, out, "gguf", size=sizes, threads=1, progress=False, **STEER, **CALIB)
    return out, sizes, res


def test_members_within_their_bytes_and_verified(family):
    out, sizes, res = family
    doc = json.loads((out / FAMILY_JSON).read_text())
    assert [m["target_bytes"] for m in doc["members"]] == sizes
    for m, size in zip(doc["members"], sizes):
        f = out / m["file"]
        assert f.name == f"glm5next-mini-{size / 1e6:.4g}MB.gguf"  # <model>-<size>.gguf
        assert m["bytes"] == f.stat().st_size <= size  # never above its target
        assert m["within_0.1%"] == (size - m["bytes"] <= 0.001 * size)
        assert m["within_0.1%"] or "below the target" in m["note"]  # a coarse ladder is said, not hidden
        assert m["bpw"] == pytest.approx(m["bytes"] * 8 / doc["ref_params"])
        rep = verify(f)
        assert rep["problems"] == [] and "seal" in rep["integrity"]
    assert doc["members"][0]["within_0.1%"]  # the Q3_K_M-sized member lands within 0.1%
    assert doc["imatrix"]["computed"] and (out / doc["imatrix"]["file"]).is_file()
    # one encode per (tensor, type): later members were served what earlier ones encoded
    assert res.cache["hits"] > 0 and res.cache["writes"] == res.cache["entries"]


# the default run converts one member alone (the middle one: a member after the first, whose family encodes the
# cache may have served); `slow` converts every member alone
@pytest.mark.parametrize("members", [slice(1, 2), pytest.param(slice(None), marks=pytest.mark.slow)],
                         ids=["middle", "every"])
def test_members_identical_to_single_conversions(members, family, mini_model, tmp_path):
    out, sizes, res = family
    imatrix = out / "glm5next-mini.imatrix.gguf"
    for m, size in list(zip(res.members, sizes))[members]:
        single = tmp_path / f"single-{size}.gguf"
        convert(mini_model, single, "gguf", size=size, imatrix=imatrix, threads=2, progress=False, **STEER)
        assert single.read_bytes() == (out / m["file"]).read_bytes(), m["file"]


def test_receipt_in_every_member(family):
    out, sizes, res = family
    im_sha = sha256_file(out / "glm5next-mini.imatrix.gguf")
    for m, size in zip(res.members, sizes):
        r = read_receipt(read_gguf(out / m["file"]).kv)
        assert r["target"] == {"size": size} and r["source"] == "glm5next-mini"
        assert r["calibration"]["imatrix"]["sha256"] == im_sha
        assert r["calibration"]["imatrix"]["chunks"] == CALIB["rows"]
        assert r["calibration"]["imatrix"]["chunk_size"] == CALIB["seq_len"]
        assert r["plan"]["types"] == m["plan"]["types"]
        assert r["options"]["overrides"] == ["embed=Q4_K"] and "threads" not in r["options"]
        d = inspect(out / m["file"])
        assert d["receipt"] == r and f"target size={size}" in d["receipt_summary"]
        assert f"tensors {r['plan']['tensor_bytes']:,} bytes" in d["receipt_summary"]
        assert r["plan"]["tensor_bytes"] == m["plan"]["tensor_bytes"]


def test_rerun_keeps_members_and_serves_the_cache(family, mini_model):
    out, sizes, res = family
    gone = out / res.members[1]["file"]
    before = gone.read_bytes()
    entries = len(list((out / CACHE_DIR).glob("*.npy")))
    gone.unlink()  # as if the run had been killed before this member
    again = convert(mini_model, out, "gguf", size=sizes, threads=1, progress=False, **STEER, **CALIB)
    assert [m["kept"] for m in again.members] == [True, False, True]
    assert again.cache["writes"] == 0 and again.cache["hits"] > 0  # every encode came from the cache
    assert gone.read_bytes() == before
    assert len(list((out / CACHE_DIR).glob("*.npy"))) == entries


def test_cli_family_and_its_errors(family, mini_model, tmp_path):
    out, sizes, res = family
    r = run_cli("convert", mini_model, out, "--format", "gguf", "--size", ",".join(map(str, sizes)),
                "--override", "embed=Q4_K", "--head-bits", "5", "--rows", "4", "--seq-len", "64", "--threads", "1",
                "--json")
    assert r.exit_code == 0, r.output[-2000:]
    d = json.loads(r.stdout)
    assert [m["kept"] for m in d["members"]] == [True, True, True]
    assert "give --format gguf" in error_line(run_cli("convert", mini_model, tmp_path / "f", "--size", "6MB,7MB"))
    assert "--resume with a family" in error_line(run_cli("convert", mini_model, tmp_path / "f", "--format",
                                                          "exl3", "--bpw", "2.5,3", "--resume"))
    assert "given twice" in error_line(run_cli("convert", mini_model, tmp_path / "f", "--format", "gguf",
                                               "--size", "6MB,6MB"))
    assert "--bpw 'x'" in error_line(run_cli("convert", mini_model, tmp_path / "f", "--format", "gguf",
                                             "--bpw", "3,x"))
    assert not (tmp_path / "f").exists()  # nothing written for a refused family


@pytest.mark.slow
def test_members_load_in_llama_cpp(family, mini_model, heldout_text):
    """Every member is a file llama.cpp itself runs: finite logits on a held-out window, and the smaller members
    agree with the largest one on most next tokens (they are quants of one model, not noise)."""
    pytest.importorskip("llama_cpp")
    out, sizes, _ = family
    ids = torch.tensor(tokenize_text(load_tokenizer(mini_model), heldout_text, need_tokens=512)[256:512])
    members = json.loads((out / FAMILY_JSON).read_text())["members"]
    logits = []
    for m in members:
        sc = LlamaCppScorer(out / m["file"], ctx=256, first=0, cache_type="f32")
        try:
            logits.append(sc(ids))
        finally:
            sc.close()
        assert torch.isfinite(logits[-1]).all(), m["file"]
    top = [lg.argmax(-1) for lg in logits]
    for t in top[:-1]:
        assert (t == top[-1]).float().mean() > 0.8


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_hessian_family_rounds_each_tensor_type_once_and_matches_single_conversions(mini_model, calibration_text,
                                                                                     tmp_path, monkeypatch):
    """`--rounding hessian`: a (tensor, type) two members share is Hessian-rounded once (its codes before tuning
    come from the cache), each member is still tuned on its own streams, and every member is byte-identical to
    the same member converted alone with the same imatrix and calibration."""
    from mixq.quant.ggml.rounding import hessian as kh

    calls: list[tuple] = []
    real = kh.quantize_hessian

    def counted(w, h, qtype, *a, **k):
        calls.append((tuple(w.shape), qtype))
        return real(w, h, qtype, *a, **k)

    sizes = mix_bytes(mini_model)[1:]  # the Q4_K_M- and Q5_K_M-sized members
    hess = dict(rounding="hessian", calibration=[calibration_text], rows=2, seq_len=64, tune_iters=2, threads=1,
                progress=False, **STEER)
    out = tmp_path / "fam"
    monkeypatch.setattr(kh, "quantize_hessian", counted)
    res = convert(mini_model, out, "gguf", size=sizes, **hess)
    in_family = len(calls)
    imatrix = out / "glm5next-mini.imatrix.gguf"
    alone = []
    for m, size in zip(res.members, sizes):
        calls.clear()
        single = tmp_path / f"single-{size}.gguf"
        convert(mini_model, single, "gguf", size=size, imatrix=imatrix, **hess)
        alone.append(len(calls))
        assert single.read_bytes() == (out / m["file"]).read_bytes(), m["file"]
    types = [m["plan"]["types"] for m in res.members]
    assert types[0] != types[1]  # the members differ ...
    assert 0 < in_family < sum(alone)  # ... and the tensors they share in one type were rounded once
    assert res.cache["hits"] >= sum(alone) - in_family


MEASURED = ("blk.1.ffn_gate_exps.weight", "blk.0.attn_q.weight", "token_embd.weight")  # a stack, a Linear, the embed


def _part_measured(calls: list):
    """A family's curve measurer for the test: the real layer-error measurement (measurement/gguf_errors) of MEASURED,
    its exact encodes kept in the family's cache, and synthetic curves for the other units (numel·4^-bpw; the
    end-to-end rescaling is eval's, tested in test_gguf_errors)."""
    def measure(ckpt, out, *, calibration, imatrix, ladder, rounding, device, cache, progress, method):
        assert method == "kld"
        im = read_imatrix(imatrix).means()
        m = measure_gguf_errors(ckpt, calibration, ladder=ladder, rounding=rounding, imatrix=im, rows=2, seq_len=64,
                                only=MEASURED, cache=cache, progress=False)
        curves = {n: {gm.type_bpw(t): math.prod(s.shape) * 4.0 ** -gm.type_bpw(t) for t in types}
                  for n, (s, types) in measured_units(ckpt, ladder=ladder).items()}
        curves.update(m.curves)
        calls.append({"entries": cache.entries(), "im": im})
        save_curves(curves, out)
    return measure


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_measured_family_serves_every_member_from_the_measurement(k256_model, tmp_path):
    sizes = mix_bytes(k256_model)
    out, calls = tmp_path / "fam", []
    fam = family_options(size=sizes, measure="kld", threads=1, progress=False, **CALIB)
    res = run_family(k256_model, out, fam, _part_measured(calls))
    assert len(calls) == 1 and calls[0]["entries"] > 0  # the measurement stored its exact encodes
    curves = out / f"glm5next-k256{GGUF_CURVES}"
    assert res.curves["file"] == curves.name and res.curves["measured"]
    doc = json.loads((out / FAMILY_JSON).read_text())
    assert doc["curves"]["sha256"] == sha256_file(curves)
    imatrix = out / "glm5next-k256.imatrix.gguf"
    for m, size in zip(res.members, sizes):
        f = out / m["file"]
        assert m["bytes"] <= size and verify(f)["problems"] == []
        # bytes as a conversion alone with the family's curves and imatrix, no cache: the stored encodes are right
        single = tmp_path / f"single-{size}.gguf"
        convert(k256_model, single, "gguf", size=size, imatrix=imatrix, measure=curves, threads=2, progress=False)
        assert single.read_bytes() == f.read_bytes(), m["file"]
        kinds = {n: e.qtype for n, e in read_gguf(f).tensors.items()}
        assert all(kinds[n] in measured_units(open_checkpoint(k256_model))[n][1] for n in MEASURED)
    # each member's encode of a measured tensor was a hit: the members encoded only the other tensors
    members_new = res.cache["writes"] - calls[0]["entries"]
    per_member = len(read_gguf(out / res.members[0]["file"]).tensors)
    assert res.cache["hits"] >= len(sizes) * len(MEASURED) and members_new < per_member * len(sizes)
    # the cache does not change what is measured
    plain = measure_gguf_errors(open_checkpoint(k256_model), None, imatrix=calls[0]["im"], rows=2, seq_len=64,
                                only=MEASURED, progress=False)
    assert load_curves(curves) == {**load_curves(curves), **plain.curves}
    again = run_family(k256_model, out, fam, _part_measured(calls))  # a rerun keeps curves and members
    assert len(calls) == 1 and [m["kept"] for m in again.members] == [True] * len(sizes)


def test_measured_family_errors_are_one_line(k256_model, mini_model, tmp_path):
    size = mix_bytes(k256_model)[-1]
    assert "a family (--size A,B,C) measures its own with --measure stream (or kld)" in error_line(
        run_cli("convert", k256_model, tmp_path / "one.gguf", "--size", str(size), "--measure", "kld"))
    assert "--measure proxy: EXL3's measurement" in error_line(
        run_cli("convert", k256_model, tmp_path / "f", "--format", "gguf", "--size", "12MB,14MB",
                "--measure", "proxy"))
    assert not (tmp_path / "f").exists() and not (tmp_path / "one.gguf").exists()
