"""mixq.quant.ggml.torch_decode gives gguf-py's dequantized values, bit for bit, for every type it decodes.

Each type's bytes are gguf-py's own encoding of random rows where gguf-py quantizes the type (the float and legacy
types), else random bytes made valid: every fp16 scale field overwritten by a finite small value (the k- and
i-quants, which gguf-py only decodes). Random bytes reach every bit pattern of the codes, sub-block scales, signs and
grid indices. With ``-m gpu`` the same bytes are decoded on CUDA too.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from mixq.errors import FormatError
from mixq.quant.ggml import torch_decode

TYPES = sorted(torch_decode.DECODABLE)
REQUIRED = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"}
SCALE_FIELDS = ("d", "dmin", "m")  # fp16 fields of torch_decode.FIELDS
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite fp16 scales, both signs, a few zeros -> (n, 2) uint8."""
    h = rng.uniform(-2.0, 2.0, n).astype(np.float16)
    h[rng.random(n) < 0.05] = 0
    return h.view(np.uint8).reshape(n, 2)


def valid_random_bytes(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``qtype`` with every fp16 scale finite -> (rows, row bytes) uint8."""
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (rows, cols // per_block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    at = 0
    for name, size in torch_decode.FIELDS[qtype]:
        if name in SCALE_FIELDS:
            blocks[:, at:at + 2] = finite_halves(rng, len(blocks))
        elif qtype == "IQ1_M" and name == "scales":
            # IQ1_M keeps its fp16 scale in the top nibbles of its four 16-bit scale words (low nibble first)
            h = finite_halves(rng, len(blocks)).view(np.uint16)[:, 0]
            for j in range(4):
                hi = at + 2 * j + 1
                blocks[:, hi] = (blocks[:, hi] & 0x0F) | (((h >> (4 * j)) & 0xF) << 4).astype(np.uint8)
        at += size
    return raw


def encoded(qtype: str, rows: int = 8, cols: int = 1024, seed: int = 0) -> tuple[np.ndarray, str]:
    """(row bytes as stored, how they were made): gguf-py's quantizer where it has one, else valid random bytes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 10, (rows, 1)).astype(np.float32)
    x[0, : cols // 2] = 0  # all-zero blocks (scale 0)
    x[1, 3] = 1e4          # one outlier block
    try:
        raw = gguf_quants.quantize(x, GGMLQuantizationType[qtype])
    except NotImplementedError:
        return valid_random_bytes(qtype, rows, cols, rng), "random"
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1), "gguf-py"


def reference(raw: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_quants.dequantize(raw, GGMLQuantizationType[qtype]), dtype=np.float32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal float32 bit patterns (tells -0.0 from 0.0, unlike torch.equal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def test_every_asked_type_is_decodable():
    assert REQUIRED <= torch_decode.DECODABLE
    assert all(torch_decode.can_decode(t) for t in REQUIRED)
    assert not torch_decode.can_decode("TQ2_0") and not torch_decode.can_decode("nonsense")


@pytest.mark.parametrize("qtype", TYPES)
def test_decode_is_gguf_py_bit_for_bit(qtype):
    raw, made = encoded(qtype)
    want = reference(raw, qtype)
    assert bool(torch.isfinite(want).all()), made
    got = torch_decode.dequantize(torch.from_numpy(raw.copy()), qtype, tuple(want.shape))
    assert got.dtype == torch.float32 and same_bits(got, want), f"{qtype} ({made} bytes)"


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q4_0", "Q5_1", "Q3_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ1_M"])
def test_several_rows_and_dims_and_steps(qtype, monkeypatch):
    """A 3-D tensor (experts, rows, cols) decoded in several steps with a ragged last one, from bytes that start at
    an odd offset, and in one step; the result owns its memory (F32 included)."""
    per_block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
    raw, _ = encoded(qtype, rows=6, cols=512, seed=1)
    want = reference(raw, qtype).reshape(2, 3, 512)
    monkeypatch.setitem(torch_decode.CHUNK_WEIGHTS, "cpu", 5 * max(per_block, 64))
    flat = torch.from_numpy(raw.copy()).reshape(-1)
    odd = torch.cat((torch.zeros(1, dtype=torch.uint8), flat))[1:]   # storage offset 1: no aligned views
    got = torch_decode.dequantize(odd, qtype, (2, 3, 512))
    assert same_bits(got, want)
    assert got.untyped_storage().data_ptr() != odd.untyped_storage().data_ptr()
    monkeypatch.undo()  # one step
    whole = torch_decode.dequantize(flat.reshape(6, -1), qtype, (6, 512))
    assert same_bits(whole, want.reshape(6, 512))
    assert whole.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


def test_bad_inputs_are_format_errors():
    raw, _ = encoded("Q4_K", rows=2, cols=256)
    t = torch.from_numpy(raw.copy())
    with pytest.raises(FormatError, match="bytes stored"):
        torch_decode.dequantize(t, "Q4_K", (3, 256))
    with pytest.raises(FormatError, match="no torch decoder"):
        torch_decode.dequantize(t, "TQ1_0", (2, 256))
    with pytest.raises(FormatError, match="uint8"):
        torch_decode.dequantize(t.to(torch.int16), "Q4_K", (2, 256))


def test_stored_bytes_of_a_read_only_map(tmp_path):
    """gguf-py's reader hands out read-only memory maps, typed for F32/F16: the bytes come back as uint8."""
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    p = tmp_path / "x.bin"
    x.tofile(p)
    mm = np.memmap(p, dtype=np.float32, mode="r", shape=x.shape)
    b = torch_decode.stored_bytes(mm)
    assert b.dtype == torch.uint8 and b.numel() == x.nbytes
    assert same_bits(torch_decode.dequantize(b, "F32", x.shape), torch.from_numpy(x))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", TYPES)
def test_cuda_decode_is_the_cpu_decode(qtype):
    raw, made = encoded(qtype, rows=64, cols=2048, seed=3)
    want = reference(raw, qtype)
    got = torch_decode.dequantize(torch.from_numpy(raw.copy()).to("cuda"), qtype, tuple(want.shape))
    assert got.device.type == "cuda"
    got = got.cpu()
    rel = float(((got - want).abs() / want.abs().clamp_min(1e-30)).max())
    assert rel <= 1e-6, f"{qtype} ({made} bytes): max relative difference {rel}"
    assert same_bits(torch_decode.dequantize(torch.from_numpy(raw.copy()), qtype, tuple(want.shape)), want)
