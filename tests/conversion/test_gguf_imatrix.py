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
    # every trunk matmul llama-imatrix would see, by GGUF name; none for the NextN block (never run)
    assert {"blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.3.attn_q_a.weight", "blk.3.attn_q_b.weight",
            "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_shexp.weight", "output.weight"} <= set(im.sums)
    assert not any(k.startswith("blk.4.") for k in im.sums)
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
