"""Importance matrix collection (calibration forward -> GGUF-named Σx² per expert) and its use in convert_gguf."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from mixq.cli import main
from mixq.formats.imatrix_file import read_imatrix


def test_collect_and_write_imatrix(mini_model, calibration_text, tmp_path):
    out = tmp_path / "imatrix.gguf"
    res = CliRunner().invoke(main, ["imatrix", str(mini_model), str(out), "--calibration", str(calibration_text),
                                    "--rows", "2", "--seq-len", "24", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    im = read_imatrix(out)
    assert im.chunk_count == 2 and im.chunk_size == 24
    # every trunk matmul llama-imatrix would see, by GGUF name
    assert {"blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.3.attn_q_a.weight", "blk.3.attn_q_b.weight",
            "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_shexp.weight", "output.weight"} <= set(im.sums)
    # and every matmul of the NextN block (run on the trunk's final hidden state at t and token t+1's
    # embedding: 2 rows x 23 positions), named as llama.cpp's glm5-next loader reads the block
    # (layer 3 is the trunk's DSA + MoE layer, the NextN block's body kind: the same matmuls, plus eh_proj)
    nextn = {"blk.4." + k[len("blk.3."):] for k in im.sums if k.startswith("blk.3.")} | {"blk.4.nextn.eh_proj.weight"}
    assert len(nextn) == 15 and nextn <= _loader_tensors(mini_model)
    assert nextn == {k for k in im.sums if k.startswith("blk.4.")}
    for k in nextn:
        assert np.all(im.counts[k] == 46) and np.all(im.sums[k] > 0), k
    assert im.sums["blk.4.nextn.eh_proj.weight"].shape == (1, 256)  # [enorm(embedding) | hnorm(hidden)]
    _llamacpp_reads(out, set(im.sums))
    assert im.sums["blk.2.ffn_down_exps.weight"].shape == (16, 64)  # one vector per expert
    assert np.all(im.counts["blk.0.attn_q.weight"] == 48)  # 2 rows x 24 tokens
    # q/k/v read the same normed input: identical statistics
    assert np.array_equal(im.sums["blk.0.attn_q.weight"], im.sums["blk.0.attn_v.weight"])
    m = im.means()
    assert all(np.isfinite(v).all() and (v >= 0).all() for v in m.values())
    assert m["blk.1.ffn_gate_exps.weight"].shape == (16 * 128,)


@pytest.mark.slow
def test_imatrix_changes_kquant_bytes(k256_model, calibration_text, tmp_path):
    from mixq.conversion.gguf.pipeline import collect_imatrix, convert_gguf
    from mixq.formats.gguf_reader import read_gguf

    im = collect_imatrix(k256_model, [calibration_text], rows=4, seq_len=128, progress=False)
    a = convert_gguf(k256_model, tmp_path / "a.gguf", qtype="Q4_K_M", progress=False)
    b = convert_gguf(k256_model, tmp_path / "b.gguf", qtype="Q4_K_M", imatrix=im, progress=False)
    assert a["types"] == b["types"]
    ga, gb = read_gguf(tmp_path / "a.gguf"), read_gguf(tmp_path / "b.gguf")
    n = "blk.1.ffn_up_exps.weight"
    assert ga.tensors[n].qtype == "Q4_K" and not np.array_equal(ga.tensors[n].raw(), gb.tensors[n].raw())
    assert gb.kv["quantize.imatrix.entries_count"] == len(im.sums)


def _loader_tensors(model) -> set[str]:
    """The NextN block's tensors in the text GGUF (the names llama.cpp's glm5-next loader reads)."""
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    return {s.name for s in gguf_tensors(open_checkpoint(model)) if s.mtp}


def _llamacpp_reads(path, names: set[str]) -> None:
    """llama.cpp's own GGUF reader (libggml-base's gguf_init_from_file, as llama-imatrix and llama-quantize load
    an imatrix) opens the file and lists `.in_sum2` and `.counts` for every entry, and the chunk count."""
    import ctypes

    from mixq.quant.ggml.libggml import find_ggml_base

    lib_path = find_ggml_base()
    if lib_path is None:
        pytest.skip("libggml-base (llama-cpp-python) not installed")
    lib = ctypes.CDLL(str(lib_path))

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
    lib.gguf_get_n_tensors.restype = ctypes.c_int64
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    lib.gguf_get_tensor_name.restype = ctypes.c_char_p
    lib.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_find_key.restype = ctypes.c_int64
    lib.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_get_val_u32.restype = ctypes.c_uint32
    lib.gguf_get_val_u32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    ctx = lib.gguf_init_from_file(str(path).encode(), Params(True, None))
    assert ctx, "llama.cpp's gguf reader refused the imatrix file"
    try:
        got = {lib.gguf_get_tensor_name(ctx, i).decode() for i in range(lib.gguf_get_n_tensors(ctx))}
        assert lib.gguf_get_val_u32(ctx, lib.gguf_find_key(ctx, b"imatrix.chunk_count")) == 2
    finally:
        lib.gguf_free(ctx)
    assert got == {f"{n}.{part}" for n in names for part in ("in_sum2", "counts")}


@pytest.mark.slow
def test_nextn_iquants_use_the_imatrix(k256_model, calibration_text, tmp_path):
    """The NextN tensors can take i-quants that need an imatrix (they have entries now), and an entry changes
    their bytes: the same file with the NextN entries' values scaled differs in the NextN tensors alone."""
    from mixq.conversion.gguf.pipeline import collect_imatrix, convert_gguf
    from mixq.formats.gguf_reader import read_gguf

    im = collect_imatrix(k256_model, [calibration_text], rows=2, seq_len=64, progress=False)
    rule = (r"blk\.4\.(ffn_(up|gate|down)_(exps|shexp)|attn_output)\.weight", "IQ2_XS")
    convert_gguf(k256_model, tmp_path / "a.gguf", qtype="Q4_K_M", imatrix=im, tensor_type=[rule], progress=False)
    ga = read_gguf(tmp_path / "a.gguf")
    nextn = [n for n, t in ga.tensors.items() if n.startswith("blk.4.") and t.qtype == "IQ2_XS"]
    assert "blk.4.ffn_down_exps.weight" in nextn and "blk.4.attn_output.weight" in nextn
    tilted = type(im)(sums=dict(im.sums), counts=dict(im.counts), datasets=im.datasets,
                      chunk_count=im.chunk_count, chunk_size=im.chunk_size)
    for n in nextn:  # a different importance per column for the NextN entries only
        tilted.sums[n] = im.sums[n] * np.linspace(0.05, 20.0, im.sums[n].shape[-1], dtype=np.float32)
    convert_gguf(k256_model, tmp_path / "b.gguf", qtype="Q4_K_M", imatrix=tilted, tensor_type=[rule],
                 progress=False)
    gb = read_gguf(tmp_path / "b.gguf")
    differ = {n for n in ga.tensors if bytes(ga.tensors[n].raw().view("uint8")) != bytes(gb.tensors[n].raw().view("uint8"))}
    assert differ and differ <= set(nextn), differ
