"""Reference log-prob files: streamed safetensors, exact float32 round trip, float16 size, bad input."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from mixq.errors import FormatError, InputError
from mixq.eval.reflogits import RefLogitsReader, RefLogitsWriter, ref_file_bytes, roundtrip
from mixq.runtime.kl_stats import log_probs


def _write(path, dtype, n=3, ctx=10, first=5, vocab=17):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, ctx), generator=g)
    rows = [log_probs(8 * torch.randn(ctx - 1 - first, vocab, generator=g)) for _ in range(n)]  # some below -16
    w = RefLogitsWriter(path, tokens, first, vocab, dtype, meta={"reference": "R", "text": "T"})
    for r in rows:
        w.add(r)
    w.close()
    return tokens, rows


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint16"])
def test_round_trip(tmp_path, dtype):
    p = tmp_path / "ref.safetensors"
    tokens, rows = _write(p, dtype)
    r = RefLogitsReader(p)
    assert (r.ctx, r.first, r.vocab, r.count) == (10, 5, 17, 3)
    assert r.meta["text"] == "T" and torch.equal(r.tokens, tokens)
    for w, row in enumerate(rows):
        got = r.logprobs(w)
        targets = tokens[w, 6:]
        assert torch.equal(got, roundtrip(row, dtype, targets))  # the saving run scores exactly this
        if dtype == "float32":
            assert torch.equal(got, row)
        elif dtype == "float16":
            assert torch.equal(got, row.half().float())
        else:  # a 16-bit grid from -16 to the row maximum; the true tokens exact; -16 and below come back as -16
            kept = row > -16
            low = ~kept
            low[torch.arange(len(targets)), targets] = False
            assert (got[kept] - row[kept]).abs().max() <= 16 / 65535 / 2 + 1e-6
            assert low.any() and torch.equal(got[low], torch.full_like(got[low], -16.0))
            assert torch.equal(got.gather(1, targets[:, None]), row.gather(1, targets[:, None]))
            assert torch.equal(got.argmax(-1), row.argmax(-1))
    header = 8 + int.from_bytes(p.read_bytes()[:8], "little")
    assert header % 8 == 0  # data stays aligned
    assert p.stat().st_size == header + ref_file_bytes(3, 10, 5, 17, dtype)
    with safe_open(str(p), framework="pt") as f:  # a plain safetensors file for other tools
        assert f.get_tensor("logprobs.000002").shape == (4, 17)
    assert not (tmp_path / "ref.safetensors.tmp").exists()


def test_incomplete_file_is_not_left(tmp_path):
    p = tmp_path / "ref.safetensors"
    w = RefLogitsWriter(p, torch.zeros(2, 8, dtype=torch.int64), 4, 5)
    w.add(torch.zeros(3, 5))
    with pytest.raises(ValueError):
        w.close()
    assert not p.exists() and not (tmp_path / "ref.safetensors.tmp").exists()


def test_bad_files(tmp_path):
    with pytest.raises(InputError):
        RefLogitsReader(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 32)
    with pytest.raises(FormatError):
        RefLogitsReader(junk)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(FormatError, match="not a mixq reference"):
        RefLogitsReader(other)
    with pytest.raises(InputError):
        RefLogitsWriter(tmp_path / "x", torch.zeros(1, 4, dtype=torch.int64), 2, 3, dtype="int8")
