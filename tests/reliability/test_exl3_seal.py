"""EXL3 seal: the manifest records the sha256 and size of every file of the directory and its own digest, so an
edit of config.json, quantization_config.json or the manifest, a flipped bit in a side file, a deleted sealed file
or a stray shard makes `mixq verify` exit 1 with a problem line naming the file; the JSON files are also held
against the stored tensors (a re-sealed manifest whose bits disagree with the trellis shapes is still named).

The directory is conftest's `tiny_exl3_cheap` (random well-formed trellis codes: seconds on the CPU)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_helpers import run_cli
from mixq.formats.exl3_seal import MANIFEST, manifest_sha256
from mixq.formats.exl3_writer import Exl3Writer


def _verify(d: Path, *extra: str) -> tuple[int, list[str]]:
    r = run_cli("verify", d, "--json", *extra)
    assert "Traceback" not in r.output, r.output[-2000:]
    return r.exit_code, json.loads(r.stdout)["problems"]


def _edit_json(f: Path, fn) -> None:
    d = json.loads(f.read_text())
    fn(d)
    f.write_text(json.dumps(d, indent=2))


def _first_trellis_unit(man: dict) -> dict:
    return next(u for u in man["units"] if u["kind"] == "trellis")


def _flip_bit(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x08
    f.write_bytes(bytes(data))


@pytest.fixture
def sealed_copy(tiny_exl3_cheap, tmp_path) -> Path:
    d = tmp_path / "x"
    shutil.copytree(tiny_exl3_cheap, d)
    return d


def test_untouched_directory_verifies_clean(tiny_exl3_cheap):
    """With the trellis decode: no problem, and every file but the manifest is sealed."""
    r = run_cli("verify", tiny_exl3_cheap, "--json")
    assert r.exit_code == 0, r.output[-2000:]
    rep = json.loads(r.stdout)
    assert rep["problems"] == [] and rep["quantized"] > 0
    files = sorted(p.name for p in tiny_exl3_cheap.iterdir() if p.is_file() and p.name != MANIFEST)
    man = json.loads((tiny_exl3_cheap / MANIFEST).read_text())
    assert sorted(man["files"]) == files and rep["sealed_files"] == len(files)
    assert {"config.json", "quantization_config.json", "model.safetensors"} <= set(files)
    assert man["seal"] == {"algorithm": "sha256", "manifest_sha256": manifest_sha256(man)}


def _hidden_size(d: Path):
    _edit_json(d / "config.json", lambda c: c["text_config"].__setitem__("hidden_size", 256))
    return "config.json", "text_config.hidden_size 256"


def _quant_config_bits(d: Path):
    _edit_json(d / "quantization_config.json", lambda c: c.__setitem__("bits", c["bits"] - 0.5))
    return "quantization_config.json", "the stored trellis tensors of the bits units"


def _manifest_unit_bits(d: Path):
    key = []

    def edit(m):
        u = _first_trellis_unit(m)
        u["bits"] = 2.0 if u["bits"] != 2.0 else 3.0
        key.append(u["key"])
    _edit_json(d / MANIFEST, edit)
    return MANIFEST, f"unit {key[0]} has bits"


def _tokenizer_bit(d: Path):
    if not (d / "tokenizer.json").exists():
        pytest.skip("the tiny model has no tokenizer (../shared missing)")
    _flip_bit(d / "tokenizer.json")
    return "tokenizer.json", "sha256 differs from the seal"


def _deleted(d: Path):
    (d / "generation_config.json").unlink()
    return "generation_config.json", "missing"


def _extra_shard(d: Path):
    shutil.copyfile(d / "model.safetensors", d / "model-00002-of-00002.safetensors")
    return "model-00002-of-00002.safetensors", "not sealed"


CASES = {"config_hidden_size": _hidden_size, "quant_config_bits": _quant_config_bits,
         "manifest_unit_bits": _manifest_unit_bits, "tokenizer_bit_flip": _tokenizer_bit,
         "sealed_file_deleted": _deleted, "extra_shard": _extra_shard}


@pytest.mark.parametrize("case", list(CASES))
def test_change_is_named(case, sealed_copy):
    """Each change: exit 1, a line naming the file with what is wrong, and no line about another file."""
    fname, fragment = CASES[case](sealed_copy)
    code, problems = _verify(sealed_copy, "--no-decode")
    assert code == 1, problems
    assert any(fname in p and fragment in p for p in problems), problems
    assert all(fname in p for p in problems), problems


@pytest.mark.parametrize("edit", ["unit_bits", "hidden_size", "layers"])
def test_resealed_edit_is_still_caught_by_the_tensors(edit, sealed_copy):
    """An edit whose seal entries are recomputed (the file's sha256 and the manifest's own digest) still
    disagrees with the stored tensors: the consistency line names the file and key."""
    d = sealed_copy
    man = json.loads((d / MANIFEST).read_text())
    if edit == "unit_bits":
        u = _first_trellis_unit(man)
        u["bits"] = 2.0 if u["bits"] != 2.0 else 3.0
        want = (MANIFEST, f"unit {u['key']} has bits", f"the stored {u['key']}.trellis")
    else:
        key, value = ("hidden_size", 256) if edit == "hidden_size" else ("num_hidden_layers", 3)
        _edit_json(d / "config.json", lambda c: c["text_config"].__setitem__(key, value))
        data = (d / "config.json").read_bytes()
        man["files"]["config.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        want = ("config.json", f"text_config.{key} {value}", "stored" if edit == "hidden_size" else "decoder layers")
    man["seal"]["manifest_sha256"] = manifest_sha256(man)
    (d / MANIFEST).write_text(json.dumps(man, indent=1))
    code, problems = _verify(d, "--no-decode")
    assert code == 1 and len(problems) == 1, problems
    assert all(w in problems[0] for w in want), problems


def test_manifest_without_seal_is_named(sealed_copy):
    _edit_json(sealed_copy / MANIFEST, lambda m: (m.pop("seal"), m.pop("files")))
    code, problems = _verify(sealed_copy, "--no-decode")
    assert code == 1 and problems == [f"{MANIFEST}: no seal (no 'files' / 'seal' fields): the JSON and side "
                                      "files cannot be checked"], problems


def test_writer_seals_every_file_as_written(tmp_path, mini_model):
    """Three shards, the index, side files, both configs: each sealed with the sha256 and size of its bytes on
    disk (shards hashed while streamed, not read back)."""
    out = tmp_path / "out"
    w = Exl3Writer(out, tmp_path / "work", shard_size=9000)
    g = torch.Generator().manual_seed(0)
    for st in ("layer.0", "layer.1"):
        w.write_part(st, [(f"{st}.u{i}", {f"{st}.u{i}.a": torch.randn(1000, generator=g).half(),
                                          f"{st}.u{i}.b": torch.arange(1000, dtype=torch.int16)}) for i in range(3)])
    man = w.finalize(["layer.0", "layer.1"], source_dir=mini_model,
                     config={"quantization_config": {"quant_method": "exl3"}}, tensor_storage={},
                     manifest={"format": "exl3"})
    on_disk = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != MANIFEST}
    assert "model.safetensors.index.json" in on_disk and "tokenizer.json" in on_disk and len(man["shards"]) == 3
    assert man["files"] == {n: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for n, b in on_disk.items()}
    written = json.loads((out / MANIFEST).read_text())
    assert written == man and written["seal"]["manifest_sha256"] == manifest_sha256(written)
