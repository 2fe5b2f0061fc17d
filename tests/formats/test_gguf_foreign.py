"""GGUF files written by anyone (llama-quantize, gguf-split, gguf-py): no mixq integrity seal
(formats/gguf_integrity), read by `mixq verify` (structure and decode, saying there was no seal), `inspect`
(per-tensor types, bpw) and `eval` like mixq's own.

llama-quantize is not available here, so the seal-less files are written with gguf-py's GGUFWriter directly, the
way llama.cpp's tools write them: conftest's `tiny_gguf` (mixq's Q4_K_M of the tiny model, llama.cpp's glm5-next
tensor names of formats/gguf_names) copied key by key and tensor by tensor (raw quantized blocks), without mixq's
`mixq.integrity.*` keys; once as one file, once as a split set of three shards (split.* keys, gguf-py's names).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from cli_helpers import run_cli
from mixq.formats.gguf_integrity import PREFIX
from mixq.formats.gguf_reader import read_gguf

REPO = Path(__file__).resolve().parents[2]


def write_without_seal(src: Path, dst: Path, *, split_max_tensors: int = 0, poison: str | None = None) -> Path:
    """Copy a GGUF through gguf-py's GGUFWriter, leaving out mixq's integrity keys (and the source's split keys,
    which the writer sets itself). `poison`: a float tensor whose first value is written as NaN."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents(), split_max_tensors=split_max_tensors)
    for name, f in r.fields.items():
        if name.startswith(("GGUF.", PREFIX, "split.")) or name == "general.architecture":
            continue
        vtype = f.types[0]
        w.add_key_value(name, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name == poison:
            data.reshape(-1)[0] = np.nan
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst if not split_max_tensors else dst.with_name(f"{dst.stem}-00001-of-00003.gguf")


@pytest.fixture(scope="module")
def unsealed(tiny_gguf, tmp_path_factory) -> tuple[Path, Path]:
    """(one file, first shard of a 3-shard split set), both without mixq's seal."""
    d = tmp_path_factory.mktemp("gguf-unsealed")
    return write_without_seal(tiny_gguf, d / "plain.gguf"), write_without_seal(tiny_gguf, d / "split.gguf",
                                                                               split_max_tensors=60)


def test_files_without_the_seal_hold_the_same_tensors(tiny_gguf, unsealed):
    """The copies are what they claim: no mixq.* key, the same tensors with the same types and bytes."""
    ref = read_gguf(tiny_gguf)
    assert any(k.startswith(PREFIX) for k in ref.kv)
    for p in unsealed:
        g = read_gguf(p)
        assert not any(k.startswith(PREFIX) for k in g.kv)
        assert sorted(g.tensors) == sorted(ref.tensors)
        for n, e in g.tensors.items():
            assert (e.qtype, e.shape) == (ref.tensors[n].qtype, ref.tensors[n].shape)
            assert np.array_equal(e.raw(), ref.tensors[n].raw())
    assert len(read_gguf(unsealed[1]).paths) == 3


def test_verify_says_no_seal_and_exits_0(tiny_gguf, unsealed):
    """`python -m mixq verify FILE`: exit 0 with the "no mixq seal" line for the single file and for any shard of
    the split set; mixq's own file says what its seal checked. (One run in a process of its own, for its exit
    status; the shards in this process, where starting Python again would prove nothing more.)"""
    for i, p in enumerate((unsealed[0], unsealed[1], unsealed[1].with_name("split-00002-of-00003.gguf"))):
        if i == 0:
            r = subprocess.run([sys.executable, "-m", "mixq", "verify", str(p)], capture_output=True, text=True,
                               cwd=REPO)
            code, stdout = r.returncode, r.stdout
        else:
            r = run_cli("verify", p)
            code, stdout = r.exit_code, r.stdout
        assert code == 0, stdout + r.stderr[-3000:]
        assert f"{p}: no mixq seal: structure and decode checked" in stdout
        assert "problem" not in stdout
    r = run_cli("verify", tiny_gguf)
    assert r.exit_code == 0 and "mixq seal: 151 tensor sha256 and structure and decode checked" in r.stdout
    j = json.loads(run_cli("verify", unsealed[0], "--json").stdout)
    assert j["checksums"] == 0 and j["quantized"] > 0 and j["integrity"] == "no mixq seal: structure and decode checked"


def test_verify_without_seal_still_finds_a_bad_tensor(tiny_gguf, tmp_path):
    """Without checksums the decode is what catches damage: a NaN in a norm is named, exit 1."""
    norm = "blk.0.attn_norm.weight"
    bad = write_without_seal(tiny_gguf, tmp_path / "nan.gguf", poison=norm)
    r = run_cli("verify", bad)
    assert r.exit_code == 1 and f"problem: {norm}: non-finite values" in r.stdout, r.output[-3000:]
    assert "no mixq seal: structure and decode checked" in r.stdout


def test_inspect_reads_types_and_bpw(tiny_gguf, unsealed):
    """inspect: every tensor's type, per-type and total bpw, the same as for the sealed file; the seal is named."""
    ref = json.loads(run_cli("inspect", tiny_gguf, "--json").stdout)
    for p in unsealed:
        r = run_cli("inspect", p, "--json")
        assert r.exit_code == 0, r.output[-3000:]
        d = json.loads(r.stdout)
        assert d["mixq_seal"] is False and ref["mixq_seal"] is True
        assert {t["name"]: t["type"] for t in d["tensor_list"]} == {t["name"]: t["type"] for t in ref["tensor_list"]}
        assert {k: (v["tensors"], v["params"]) for k, v in d["types"].items()} == \
            {k: (v["tensors"], v["params"]) for k, v in ref["types"].items()}
        q = d["types"]["Q8_0"]
        assert q["bpw"] == round(8 * q["bytes"] / q["params"], 4) and 8.4 < q["bpw"] < 8.6  # 34 bytes / 32 weights
        assert 0 < d["bpw"] < 32 and d["tensors"] == ref["tensors"]
    assert len(json.loads(run_cli("inspect", unsealed[1], "--json").stdout)["files"]) == 3


def test_eval_scores_them_like_the_sealed_file(tiny_model, tiny_gguf, unsealed, heldout_text):
    """eval reads the seal-less file and the split set: the same tensors give the same numbers."""
    from mixq.eval import evaluate

    rep = evaluate(tiny_model, [tiny_gguf, *unsealed], heldout_text, ctx=32, windows=1, progress=False)
    a, b, c = rep["candidates"]
    assert a["kld_mean"] > 0
    for k in ("kld_mean", "top1", "ppl"):
        assert a[k] == b[k] == c[k], k
