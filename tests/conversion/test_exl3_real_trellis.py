"""The real trellis encoder end to end on a minimal tiny glm5_next checkpoint (about two minutes on one core).

Kept apart from test_exl3_convert.py, whose module-scoped fixture swaps in a fake encoder for speed."""
from __future__ import annotations

import pytest
import torch

ROWS, SEQ = 4, 32


# ~2 min on one free core, far more on a busy one: its own limit, well above pyproject's 600 s for every test
@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
@pytest.mark.timeout(3600)
def test_real_trellis_end_to_end(tmp_path):
    """The real encoder on a minimal tiny model (KDA + DSA layer, 2 experts, NextN, vocab 512): verify passes,
    weights come back within the 4-bit error, the dequantized model runs in transformers."""
    from mixq.conversion.api import convert, verify
    from mixq.runtime.reference import build_model
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.runtime.dequant import read_exl3
    from mixq.formats.tiny import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src", layer_types=("linear_attention", "deepseek_sparse_attention"),
                                vision=False, vocab=512)
    out = tmp_path / "exl3"
    res = convert(src, out, "exl3", bpw=4.0, rows=ROWS, seq_len=SEQ, device="cpu", progress=False)
    assert verify(out)["ok"] and abs(res.bits - 4.0) <= 0.1 and not res.fallbacks
    ck = open_checkpoint(src)
    w = read_exl3(out)
    for n in ck.names():
        if ck.info(n).exl3 == "trellis":
            rel = ((w[n] - ck.get(n)).norm() / ck.get(n).norm()).item()
            assert rel < 0.35, (n, rel)  # 3.5-7 bits; LDLQ trades weight error for output error (random
            # weights at 3.5 bits: ~0.1-0.25; an undecodable or misordered tensor would be ~1.4)
    model = build_model(out, w, torch.device("cpu"))
    with torch.no_grad():
        logits = model(torch.randint(0, 512, (1, 16))).logits
    assert bool(torch.isfinite(logits).all())
