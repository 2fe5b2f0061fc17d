"""EXL3 directories written by anyone (formats/exl3_reader, formats/exl3_foreign): without mixq's manifest the
units are derived from config.json and the stored tensors, and inspect, verify (structure + decode, saying that no
manifest was there to check) and eval read the directory.

Directories: the tiny random model converted by mixq with conftest's `cheap_trellis` (well-formed random codes,
real decoder) at 4 bpw with the vision tower at 6; a mixq directory with its manifest deleted; and the same
rewritten into exllamav3 1.6.5's own layout by tests/exllamav3_layout.py (vision qkv split into q/k/v, one KDA
layer unfused, an MCG and a 3INST Linear, an fp16 head, two plain shards with an index, exllamav3's JSON files).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from cli_helpers import run_cli
from exllamav3_layout import write_plain_safetensors, to_exllamav3_layout
from mixq.formats.exl3_reader import Exl3Dir
from mixq.formats.exl3_seal import MANIFEST
from mixq.formats.safetensors_io import load_tensors
from mixq.quant import trellis
from mixq.runtime.dequant import decode_linear, read_exl3

L = "model.language_model.layers"
MCG_KEY = f"{L}.1.self_attn.o_proj"
PLAIN_KEY = f"{L}.3.self_attn.q_b_proj"


def _convert(model: Path, out: Path, **kw) -> Path:
    from conftest import cheap_trellis
    from mixq.conversion.api import convert

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trellis, "quantize", cheap_trellis)
        convert(model, out, "exl3", bpw=4.0, vision_bits=6.0, rows=2, seq_len=16, device="cpu", progress=False, **kw)
    return out


@pytest.fixture(scope="module")
def tiny_v6(tiny_model, tmp_path_factory) -> Path:
    """tiny_model (every width 128) as EXL3 by mixq, vision tower quantized at 6 bpw."""
    return _convert(tiny_model, tmp_path_factory.mktemp("exl3-v6") / "tiny-v6")


@pytest.fixture(scope="module")
def no_manifest(tiny_v6, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("exl3-nomanifest") / "tiny-v6"
    shutil.copytree(tiny_v6, d)
    (d / MANIFEST).unlink()
    return d


@pytest.fixture(scope="module")
def foreign(tiny_v6, tmp_path_factory) -> Path:
    return to_exllamav3_layout(tiny_v6, tmp_path_factory.mktemp("exl3-foreign") / "tiny-exllamav3",
                               mcg_key=MCG_KEY, plain_key=PLAIN_KEY)


def _verify(d: Path, *extra: str):
    r = run_cli("verify", d, *extra)
    assert "Traceback" not in r.output, r.output[-3000:]
    return r


def _inspect(d: Path) -> dict:
    r = run_cli("inspect", d, "--json")
    assert r.exit_code == 0, r.output[-3000:]
    return json.loads(r.stdout)


def test_manifest_removed_reads_verifies_and_inspects_the_same(tiny_v6, no_manifest):
    """The derived units are the manifest's, unit for unit; the weights decode bit for bit the same; verify
    passes with the no-manifest line (the sealed directory says what its seal checked); inspect agrees."""
    sealed, bare = Exl3Dir(tiny_v6), Exl3Dir(no_manifest)
    assert sealed.has_manifest and not bare.has_manifest
    assert {u.key: u for u in bare.units} == {u.key: u for u in sealed.units}
    assert bare.bits == sealed.bits and sum(b is not None for b in bare.bits.values()) > 50

    a, b = read_exl3(tiny_v6), read_exl3(no_manifest)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)

    r_sealed, r_bare = _verify(tiny_v6), _verify(no_manifest)
    assert r_sealed.exit_code == 0 and r_bare.exit_code == 0, r_bare.output[-3000:]
    assert "no mixq manifest: structure and decode checked" in r_bare.stdout
    n_files = sum(1 for f in tiny_v6.iterdir() if f.name != MANIFEST)
    assert f"mixq manifest: {n_files} sealed files' sha256 and structure and decode checked" in r_sealed.stdout
    j = json.loads(_verify(no_manifest, "--json", "--no-decode").stdout)
    assert j["manifest"] is False and j["sealed_files"] == 0 and j["integrity"] == "no mixq manifest: structure checked"

    i_sealed, i_bare = _inspect(tiny_v6), _inspect(no_manifest)
    assert i_bare["mixq_manifest"] is False and i_sealed["mixq_manifest"] is True
    for k in ("writer", "units", "kinds", "rates", "codebooks", "bytes", "params"):
        assert i_bare[k] == i_sealed[k], k
    by_key = lambda rows: sorted(rows, key=lambda r: r["key"])  # noqa: E731 - the derived units keep config order
    assert by_key(i_bare["unit_list"]) == by_key(i_sealed["unit_list"])
    assert i_bare["rates"]["vision_bits"]["bpw"] == 6.0 and i_bare["rates"]["head_bits"]["bpw"] == 6.0


def test_padded_widths_are_derived_from_the_config(tmp_path):
    """A model whose matmuls are 64 wide (every quantized Linear padded to 128, exl3-format.md §1.6; no NextN block:
    its eh_proj is not padded and must be 128-aligned): the units
    derived without the manifest still have the logical shapes, splits and rates the writer recorded."""
    from mixq.formats.tiny import write_tiny_checkpoint

    out = _convert(write_tiny_checkpoint(tmp_path / "h64", hidden=64, vision=False, nextn=False), tmp_path / "h64-exl3")
    sealed = Exl3Dir(out)
    (out / MANIFEST).unlink()
    bare = Exl3Dir(out)
    padded = [u for u in sealed.units if u.kind == "trellis" and u.padded != (u.shape[1], u.shape[0])]
    assert len(padded) > 20
    assert {u.key: u for u in bare.units} == {u.key: u for u in sealed.units} and bare.bits == sealed.bits
    r = _verify(out, "--no-decode")
    assert r.exit_code == 0 and "no mixq manifest: structure checked" in r.stdout, r.output[-3000:]


def _decode_as_stored(d: Path, key: str) -> torch.Tensor:
    """A Linear decoded straight from its stored tensors (whatever marker it carries), padded."""
    shards = sorted(d.glob("*.safetensors"))
    return decode_linear({k: v for f in shards for k, v in load_tensors(f).items() if k.startswith(key + ".")}, key)


def test_exllamav3_layout_reads_and_decodes(tiny_v6, foreign):
    """exllamav3's layout: split vision qkv joined back, the unfused KDA layer read member by member, MCG / 3INST
    markers honoured, the fp16 head read as stored; every other tensor decodes to mixq's own read of the source."""
    d = Exl3Dir(foreign)
    assert not d.has_manifest and d.shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    units = {u.key: u for u in d.units}
    parts = [units[f"model.visual.blocks.0.attn.{p}_proj"] for p in "qkv"]
    assert all(u.part and u.kind == "trellis" and u.hf_names == ["model.visual.blocks.0.attn.qkv.weight"]
               for u in parts) and d.bits[parts[0].key] == 6.0
    assert "model.visual.blocks.0.attn.qkv" not in units and f"{L}.0.self_attn.qkv_proj" not in units
    assert units[f"{L}.0.self_attn.k_proj"].hf_names == [f"{L}.0.self_attn.k_proj.weight"]
    assert units[f"{L}.0.self_attn.v_conv1d.weight"].kind == "raw" and f"{L}.1.self_attn.qkv_proj" in units
    assert units[MCG_KEY].marker == "mcg" and units[PLAIN_KEY].marker is None
    assert units["lm_head"].kind == "fp16_linear" and d.bits["lm_head"] is None

    src, got = read_exl3(tiny_v6), read_exl3(foreign)
    assert sorted(got) == sorted(src)
    changed = {"lm_head.weight", MCG_KEY + ".weight", PLAIN_KEY + ".weight"}
    assert [n for n in src if n not in changed and not torch.equal(src[n], got[n])] == []
    assert torch.equal(got["lm_head.weight"], src["lm_head.weight"].half().float())
    for key in (MCG_KEY, PLAIN_KEY):
        out_f, in_f = src[key + ".weight"].shape
        want = _decode_as_stored(foreign, key)[:out_f, :in_f]
        assert torch.equal(got[key + ".weight"], want) and not torch.allclose(want, src[key + ".weight"])

    r = _verify(foreign)
    assert r.exit_code == 0, r.output[-3000:]
    assert "no mixq manifest: structure and decode checked" in r.stdout
    info = _inspect(foreign)
    assert info["writer"] == "exllamav3 1.6.5" and info["mixq_manifest"] is False and info["shards"] == 2
    assert info["rates"]["head_bits"]["bpw"] == 16.0 and info["rates"]["vision_bits"]["bpw"] == 6.0
    assert info["codebooks"]["mcg"] == 1 and info["codebooks"]["3inst"] == 1 and info["codebooks"]["mul1"] > 50
    assert info["bytes"] == sum(p.stat().st_size for p in foreign.glob("*.safetensors"))


def test_foreign_problems_are_named(foreign, tmp_path):
    """Without a manifest verify still names what is wrong: a tensor gone from its shard (and the index entry no
    shard backs), a stray tensor, a trellis whose last dim is no EXL3 rate, quantization_config.json's
    tensor_storage against the shards."""
    d = tmp_path / "bad"
    shutil.copytree(foreign, d)
    shard = d / "model-00001-of-00002.safetensors"
    t = load_tensors(shard)
    gone = next(n for n in t if n.endswith("mlp.shared_experts.up_proj.suh"))
    bad_rate = next(n for n in t if n.endswith(".trellis") and "shared_experts.down_proj" in n)
    t.pop(gone)
    t[bad_rate] = t[bad_rate][..., :20].contiguous()  # 20 / 16 = 1.25 bits: no EXL3 rate
    t["model.language_model.layers.0.stray.weight"] = torch.zeros(3)
    write_plain_safetensors(shard, t)
    r = _verify(d, "--json", "--no-decode")
    assert r.exit_code == 1
    problems = json.loads(r.stdout)["problems"]
    want = [f"tensor {gone} missing", "unexpected tensor model.language_model.layers.0.stray.weight",
            f"tensor {bad_rate}: shape", f"model.safetensors.index.json: maps {gone} to", "quantization_config.json"]
    for w in want:
        assert any(p.startswith(w) for p in problems), (w, problems)


def test_manifest_removed_evaluates_to_the_same_kld(tiny_model, tiny_v6, no_manifest, foreign, heldout_text):
    """eval reads all three directories; with and without the manifest the numbers are identical, and the
    exllamav3-laid-out one (other head and codebooks) is scored by the torch engine like the others."""
    from mixq.eval import evaluate

    rep = evaluate(tiny_model, [tiny_v6, no_manifest, foreign], heldout_text, ctx=32, windows=1, progress=False)
    a, b, c = rep["candidates"]
    assert a["kld_mean"] > 0 and math.isfinite(c["kld_mean"])
    for k in ("kld_mean", "kld_max", "top1", "ppl"):
        assert a[k] == b[k], k
    assert [x["format"] for x in (a, b, c)] == ["exl3"] * 3 and {x["engine"] for x in (a, b, c)} == {"torch"}
