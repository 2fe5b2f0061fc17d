"""GGUF integrity: a flipped bit in any tensor's data or in the metadata, or a shard of another conversion in a
split set, makes `mixq verify` exit 1 naming the tensor / file; the seal leaves every tensor data byte as it was."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mixq.cli import main

SHARD = "2MB"  # glm5next-mini Q4_K_M in three shards: token_embd..blk.2 | blk.2..NextN | output, output_norm


def _convert(model, out: Path) -> list[Path]:
    from mixq.conversion.gguf.pipeline import convert_gguf

    res = convert_gguf(model, out, qtype="Q4_K_M", threads=1, progress=False, shard_size=SHARD)
    return [Path(f) for f in res["files"]]


@pytest.fixture(scope="module")
def sealed(mini_model, tmp_path_factory):
    """(shards of mini Q4_K_M, shards of the same conversion of a copy whose final norm differs)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("sealed")
    ours = _convert(mini_model, root / "ours" / "mini.gguf")
    other = root / "other-model"
    shutil.copytree(mini_model, other)
    for p in other.iterdir():
        p.chmod(0o644)
    sd = load_file(other / "model.safetensors")
    sd["model.language_model.norm.weight"] = sd["model.language_model.norm.weight"] * 1.5
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    theirs = _convert(other, root / "theirs" / "mini.gguf")
    return ours, theirs


def _copy_set(shards: list[Path], dst: Path) -> list[Path]:
    dst.mkdir()
    out = []
    for s in shards:
        shutil.copyfile(s, dst / s.name)
        out.append(dst / s.name)
    return out


def _verify(path: Path, *extra: str) -> tuple[int, list[str]]:
    r = CliRunner().invoke(main, ["verify", str(path), "--json", *extra])
    assert "Traceback" not in r.output
    return r.exit_code, json.loads(r.stdout)["problems"]


def _first_of_each_type(shards: list[Path], qtypes) -> dict[str, tuple[Path, str, int, int]]:
    """{type: (shard, tensor name, absolute data offset, bytes)} of the first tensor of each type."""
    import gguf

    found: dict[str, tuple[Path, str, int, int]] = {}
    for p in shards:
        for t in gguf.GGUFReader(p).tensors:
            if t.tensor_type.name in qtypes and t.tensor_type.name not in found:
                found[t.tensor_type.name] = (p, t.name, int(t.data_offset), int(t.n_bytes))
    assert set(found) == set(qtypes), found
    return found


def _flip(path: Path, offset: int, bit: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def test_sealed_set_verifies_clean(sealed):
    ours, _ = sealed
    code, problems = _verify(ours[0])
    assert code == 0 and problems == []
    r = CliRunner().invoke(main, ["verify", str(ours[0]), "--json", "--no-decode"])
    assert r.exit_code == 0 and json.loads(r.stdout)["checksums"] == 151


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "no-decode"])
def test_one_bit_flip_in_tensor_data_is_named(decode, sealed, tmp_path):
    """One bit flipped in the first Q5_0, Q8_0, F32 and BF16 tensor (the types of the review's cases), in
    whichever shard holds it: each tensor is named once, with its shard, and nothing else is reported."""
    shards = _copy_set(sealed[0], tmp_path / "set")
    flipped = {}
    for shard, name, off, n in _first_of_each_type(shards, ("Q5_0", "Q8_0", "F32", "BF16")).values():
        _flip(shard, off + n // 2)
        flipped[name] = shard.name
    code, problems = _verify(shards[0], *([] if decode else ["--no-decode"]))
    assert code == 1
    named = {p.split(":")[0]: p for p in problems if "differs from the conversion" in p}
    assert set(named) == set(flipped), problems
    assert all(flipped[n] in named[n] for n in flipped)
    assert all(p.split(":")[0] in flipped for p in problems), problems  # a flip never blames another tensor


def test_metadata_bit_flip_is_named(sealed, tmp_path):
    import gguf

    shards = _copy_set(sealed[0], tmp_path / "set")
    f = gguf.GGUFReader(shards[0]).fields["glm5-next.attention.layer_norm_rms_epsilon"]
    _flip(shards[0], f.offset + sum(p.nbytes for p in f.parts) - 1, bit=0)  # low bit of the float's last byte
    code, problems = _verify(shards[0], "--no-decode")
    assert code == 1 and any(shards[0].name in p and "metadata" in p for p in problems), problems


def test_shard_of_another_conversion_is_named(sealed, tmp_path):
    ours, theirs = sealed
    shards = _copy_set(ours, tmp_path / "set")
    shutil.copyfile(theirs[2], shards[2])  # same name, layout and size; another model's output_norm
    code, problems = _verify(shards[0], "--no-decode")
    assert code == 1
    assert any(p.startswith(shards[2].name) and "another conversion" in p for p in problems), problems
    assert all(shards[2].name in p for p in problems), problems  # the other shards are fine


def test_seal_leaves_tensor_data_and_other_metadata_unchanged(tmp_path, monkeypatch):
    """The same tensors written by write_gguf (sealed) and by a plain gguf-py writer: identical tensor data
    section, same tensor infos, and the same keys apart from mixq.integrity.*; digests equal the data's."""
    import gguf

    import mixq.formats.gguf_writer as gw
    from mixq.formats.gguf_integrity import KEY_TENSORS, PREFIX, data_sha256

    rng = np.random.default_rng(0)
    data = {"a.weight": rng.standard_normal((4, 64)).astype(np.float32),
            "b.weight": rng.integers(0, 255, (8, 68), dtype=np.uint8),  # raw Q8_0: 8 rows x 2 blocks of 34 B
            "c.bias": rng.standard_normal(7).astype(np.float32)}
    outs = [gw.TensorOut("a.weight", (4, 64), "F32"), gw.TensorOut("b.weight", (8, 64), "Q8_0"),
            gw.TensorOut("c.bias", (7,), "F32")]
    kv = [gw.KV("general.name", "STRING", "t"), gw.KV("x.count", "UINT32", 3)]
    sealed_path = gw.write_gguf(tmp_path / "s.gguf", kv, outs, lambda t: data[t.name], progress=False)[0]
    monkeypatch.setattr(gw, "sealed_writer", lambda path, arch, **kw: gguf.GGUFWriter(path, arch, **kw))
    monkeypatch.setattr(gw, "seal", lambda paths, digests: None)
    plain_path = gw.write_gguf(tmp_path / "p.gguf", kv, outs, lambda t: data[t.name], progress=False)[0]
    s, p = gguf.GGUFReader(sealed_path), gguf.GGUFReader(plain_path)
    assert bytes(s.data[s.data_offset:]) == bytes(p.data[p.data_offset:])
    assert [(t.name, t.tensor_type, list(t.shape), int(t.data_offset) - s.data_offset) for t in s.tensors] == \
           [(t.name, t.tensor_type, list(t.shape), int(t.data_offset) - p.data_offset) for t in p.tensors]
    others = {k: v.contents() for k, v in s.fields.items() if not k.startswith(PREFIX) and k != "GGUF.kv_count"}
    assert others == {k: v.contents() for k, v in p.fields.items() if k != "GGUF.kv_count"}
    assert s.fields["GGUF.kv_count"].contents() == p.fields["GGUF.kv_count"].contents() + 4
    assert s.fields[KEY_TENSORS].contents() == [data_sha256(data[t.name]) for t in s.tensors]


# --- EXL3: the manifest's shard sha256 catches the same corruptions -------------------------------------------
FAKE_ROWS = 4


def _fake_trellis_module():
    """A stand-in for quant.trellis with its layout (trellis int16 (k/16, n/16, 16·K), suh, svh, mul1 marker):
    the codes are the weight's own bytes, so different weights give different files; decodes to zeros."""
    import types

    import torch

    class QL:
        def __init__(self, trellis, suh, svh, shape):
            self.trellis, self.suh, self.svh, self.shape = trellis, suh, svh, tuple(shape)

        @property
        def bits(self):
            return self.trellis.shape[-1] / 16

        def dequantize(self):
            return torch.zeros(self.shape)

        def tensors(self):
            return {"trellis": self.trellis, "suh": self.suh, "svh": self.svh,
                    "mul1": torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)}

    def one(w, bits):
        out_f, in_f = w.shape
        k, n = -(-in_f // 128) * 128, -(-out_f // 128) * 128
        width = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
        need = (k // 16) * (n // 16) * width
        codes = w.to(torch.bfloat16).flatten().view(torch.int16)
        codes = codes.repeat(need // codes.numel() + 1)[:need]
        return QL(codes.view(k // 16, n // 16, width), torch.ones(k, dtype=torch.float16),
                  torch.ones(n, dtype=torch.float16), (out_f, in_f))

    def quantize(weight, bits, hessian=None, codebook="mul1", seed=0):
        return [one(weight[i], bits) for i in range(weight.shape[0])] if weight.dim() == 3 else one(weight, bits)

    m = types.ModuleType("mixq.quant.trellis")
    m.quantize, m.from_tensors, m.QuantizedLinear = quantize, lambda t, shape: QL(t["trellis"], t["suh"], t["svh"], shape), QL
    return m


@pytest.fixture(scope="module")
def fake_trellis():
    import sys

    import mixq.quant

    mp = pytest.MonkeyPatch()
    fake = _fake_trellis_module()
    mp.setitem(sys.modules, "mixq.quant.trellis", fake)
    mp.setattr(mixq.quant, "trellis", fake, raising=False)
    yield fake
    mp.undo()


def _convert_exl3(model: Path, out: Path) -> Path:
    from mixq.conversion.exl3.pipeline import convert_exl3

    convert_exl3(model, out, bpw=4.0, rows=FAKE_ROWS, seq_len=32, device="cpu", shard_size="3MiB", progress=False)
    return out


@pytest.fixture(scope="module")
def exl3_ours(tiny_model, tmp_path_factory, fake_trellis):
    """An EXL3 conversion of the tiny model (fake trellis) in two shards."""
    return _convert_exl3(tiny_model, tmp_path_factory.mktemp("exl3") / "ours")


@pytest.fixture(scope="module")
def exl3_theirs(tiny_model, tmp_path_factory, fake_trellis):
    """The same conversion of a copy of the tiny model whose final norm differs."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("exl3-other")
    other = root / "other-model"
    shutil.copytree(tiny_model, other)
    sd = load_file(other / "model.safetensors")
    sd["model.language_model.norm.weight"] = sd["model.language_model.norm.weight"] * 1.5
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    return _convert_exl3(other, root / "theirs")


def _exl3_shards(d: Path) -> list[str]:
    return sorted(json.loads((d / "mixq_manifest.json").read_text())["shards"])


def _exl3_tensor(d: Path, dtype: str) -> tuple[Path, int, int]:
    """(shard, absolute offset, bytes) of the first stored tensor of safetensors dtype `dtype`."""
    import struct

    for s in _exl3_shards(d):
        raw = (d / s).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        for name, e in header.items():
            if name != "__metadata__" and e["dtype"] == dtype and e["data_offsets"][1] > e["data_offsets"][0]:
                b, end = e["data_offsets"]
                return d / s, 8 + n + b, end - b
    raise AssertionError(f"no {dtype} tensor")


@pytest.mark.parametrize("dtype", ["I16", "F16", "F32", "BF16"])  # trellis codes, fp16/fp32 copies, native bf16
def test_exl3_one_bit_flip_is_named(dtype, exl3_ours, tmp_path):
    d = tmp_path / "x"
    shutil.copytree(exl3_ours, d)
    shard, off, n = _exl3_tensor(d, dtype)
    _flip(shard, off + n // 2)
    code, problems = _verify(d, "--no-decode")
    assert code == 1 and problems == [f"shard {shard.name}: sha256 mismatch"], problems


@pytest.mark.slow  # a second calibrated conversion (~15 s on 2 cores)
def test_exl3_shard_of_another_conversion_is_named(exl3_ours, exl3_theirs, tmp_path):
    ours, theirs = exl3_ours, exl3_theirs
    d = tmp_path / "x"
    shutil.copytree(ours, d)
    assert _verify(d)[0] == 0
    diff = [s for s in _exl3_shards(d) if (d / s).read_bytes() != (theirs / s).read_bytes()]
    assert diff, "the two conversions should differ in some shard"
    shutil.copyfile(theirs / diff[-1], d / diff[-1])
    code, problems = _verify(d, "--no-decode")
    assert code == 1 and any(p.startswith(f"shard {diff[-1]}") for p in problems), problems


# --- llama.cpp loads a sealed file ------------------------------------------------------------------------------
@pytest.mark.slow
def test_llamacpp_loads_sealed_files_with_the_same_logits(sealed, mini_model, tmp_path, monkeypatch):
    """The sealed split set and a single sealed file load in llama-cpp-python 0.3.36 and give exactly the logits
    of the same conversion written without the seal."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import gguf

    import mixq.formats.gguf_writer as gw
    from mixq.conversion.gguf.pipeline import convert_gguf

    single = Path(convert_gguf(mini_model, tmp_path / "one.gguf", qtype="Q4_K_M", threads=1,
                               progress=False)["files"][0])
    monkeypatch.setattr(gw, "sealed_writer", lambda path, arch, **kw: gguf.GGUFWriter(path, arch, **kw))
    monkeypatch.setattr(gw, "seal", lambda paths, digests: None)
    plain = Path(convert_gguf(mini_model, tmp_path / "plain.gguf", qtype="Q4_K_M", threads=1,
                              progress=False)["files"][0])
    assert "mixq.integrity.conversion_id" not in gguf.GGUFReader(plain).fields

    def logits(path: Path) -> np.ndarray:
        m = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
        m.eval(list(range(1, 17)))
        out = np.array(m.scores[:16], dtype=np.float32)
        assert m.metadata.get("mixq.integrity.algorithm") in (None, "sha256")
        m.close()
        return out

    want = logits(plain)
    assert np.isfinite(want).all()
    for f in (single, sealed[0][0]):
        assert np.array_equal(logits(f), want), f
