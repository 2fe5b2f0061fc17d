"""llama.cpp imatrix files: GGUF format round trip (raw sums + counts), means as llama-quantize computes them,
legacy .dat reading."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from mixq.errors import FormatError
from mixq.formats.imatrix_file import IMatrix, read_imatrix, write_imatrix


def test_gguf_roundtrip_and_means(tmp_path):
    rng = np.random.default_rng(1)
    im = IMatrix(datasets=["calibration.txt"], chunk_count=7, chunk_size=512)
    im.add("blk.1.ffn_up_exps.weight", rng.random((4, 64)) * 10, [10, 0, 3, 5])  # expert 1 never routed
    im.add("blk.0.attn_q.weight", rng.random(64), 100)
    im.add("blk.0.attn_q.weight", np.ones(64), 28)  # accumulates
    p = write_imatrix(tmp_path / "imatrix.gguf", im)
    r = gguf.GGUFReader(p)
    assert r.fields["general.type"].contents() == "imatrix" and "general.architecture" not in r.fields
    assert r.fields["imatrix.chunk_count"].contents() == 7 and r.fields["imatrix.datasets"].contents() == ["calibration.txt"]
    names = [t.name for t in r.tensors]
    bases = [n.rsplit(".", 1)[0] for n in names[::2]]
    assert bases == sorted(bases) and all(n.endswith(".in_sum2") for n in names[::2])  # sorted by weight name
    t = {t.name: t for t in r.tensors}
    assert list(t["blk.1.ffn_up_exps.weight.in_sum2"].shape) == [64, 4]  # ne [n_cols, n_mat]
    assert list(t["blk.1.ffn_up_exps.weight.counts"].shape) == [1, 4]
    back = read_imatrix(p)
    assert back.chunk_size == 512 and back.datasets == ["calibration.txt"]
    assert np.allclose(back.counts["blk.0.attn_q.weight"], [128])
    m = back.means()
    s = im.sums["blk.1.ffn_up_exps.weight"]
    want = np.concatenate([s[0] / 10, np.ones(64), s[2] / 3, s[3] / 5]).astype(np.float32)
    assert np.allclose(m["blk.1.ffn_up_exps.weight"], want, rtol=1e-6)
    assert m["blk.1.ffn_up_exps.weight"].shape == (256,)


def test_legacy_dat(tmp_path):
    vals = np.arange(1, 9, dtype=np.float32)  # mean * ncall
    blob = struct.pack("<i", 1)
    name = b"blk.0.ffn_down.weight"
    blob += struct.pack("<i", len(name)) + name + struct.pack("<ii", 4, 8) + vals.tobytes()
    blob += struct.pack("<ii", 12, 3) + b"cal"
    (tmp_path / "x.dat").write_bytes(blob)
    im = read_imatrix(tmp_path / "x.dat")
    assert np.allclose(im.means()["blk.0.ffn_down.weight"], vals / 4)
    assert im.chunk_count == 12 and im.datasets == ["cal"]
    (tmp_path / "bad.dat").write_bytes(struct.pack("<i", 3) + b"\x05")
    with pytest.raises(FormatError):
        read_imatrix(tmp_path / "bad.dat")
