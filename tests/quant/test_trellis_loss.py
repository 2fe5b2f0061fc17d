"""quant/trellis/loss.py on a real glm5next-mini tensor with its calibration Hessian."""
from __future__ import annotations

import pytest
import torch

from mixq.planning import allocator as al
from mixq.quant.trellis import loss as qs
from mixq.quant import trellis

Q_PROJ = "model.language_model.layers.0.self_attn.q_proj.weight"
# strips=1 (16 of 128 rotated columns) against the exact encode at K=4: the claim checked here is ±25%
# (the spread over seeds and tensors is in docs/planning.md §3).
SAMPLING_BOUND = 0.25


@pytest.fixture(scope="module")
def layer0(mini_model, calibration_text):
    """(checkpoint, Hessians of layers 0-1) of mini from a short real calibration pass (4 rows x 64 tokens)."""
    from mixq.runtime.calibration import LayerCalibrator, calibration_rows, load_tokenizer
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(mini_model)
    ids = calibration_rows(load_tokenizer(ck.path), [str(calibration_text)], rows=4, seq_len=64,
                           vocab_size=ck.shape("model.language_model.embed_tokens.weight")[0])
    hs = {}
    for stage in LayerCalibrator(ck, ids, full=True).stages():
        hs.update({n: a.hessian() for n, a in stage.stats.items()})
        if stage.layer == 1:
            break
        stage.advance()
    return ck, hs


def test_proxy_loss_is_output_mse():
    torch.manual_seed(0)
    w, wq, x = (torch.randn(s, dtype=torch.float64) for s in ((8, 16), (8, 16), (100, 16)))
    h = x.T @ x / 100
    direct = ((x @ (w - wq).T) ** 2).sum(1).mean()
    assert float(qs.proxy_loss(w, wq, h)) == pytest.approx(float(direct), rel=1e-9)


def test_strip_sample_deterministic_spread_and_stratified():
    a, wa = qs.strip_sample(24, 3, seed=5)
    assert (a, wa) == qs.strip_sample(24, 3, seed=5)
    assert len(a) == 3 and a[0] < 8 <= a[1] < 16 <= a[2] < 24  # one per third
    assert wa == [8.0] * 3  # each stands for 8 strips
    peak = torch.full((24,), 3.6)
    peak[20] = 4.95  # the outlier strip of mini's layers.1 qkv_proj (its loss is 3.4x the mean at K=6)
    b, wb = qs.strip_sample(24, 1, seed=5, peak=peak)
    assert b[0] == 20 and wb[0] == 1.0 and len(b) == 2 and b[1] != 20 and wb[1] == 23.0
    assert sum(wb) == 24


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_measured_curve_decreases_and_matches_full_quantization(layer0):
    ck, hs = layer0
    w, h = ck.get(Q_PROJ), hs[Q_PROJ]
    loss = qs.measure(w, h, al.EXL3_RATES, strips=1)[:, 0]
    assert bool((loss[1:] < loss[:-1]).all()), loss.tolist()
    # roughly the trellis slope: about 2 bits of log2 loss per bit of rate between K=2 and K=6
    slope = float(torch.log2(loss[2] / loss[8])) / 4
    assert 1.6 < slope < 2.3
    # an actual full quantization (the pipeline's call) at K=4
    q = trellis.quantize(w, 4.0, hessian=h)
    actual = float(qs.proxy_loss(w, q.dequantize(), h))
    sampled = float(loss[al.EXL3_RATES.index(4.0)])
    assert abs(sampled / actual - 1) < SAMPLING_BOUND, (sampled, actual)
    # exact mode is that very quantization
    exact = float(qs.measure(w, h, [4.0])[0, 0])
    assert exact == pytest.approx(actual, rel=1e-9)


def test_column_plan_partial_blocks():
    peak = torch.full((24,), 3.6)
    idx, wt, exact = qs.column_plan(32, 1, 0, peak)  # r = 32 divides 128: sample the 2 unique strips
    assert len(idx) == 1 and idx[0] in (0, 1) and wt == [2 * 16.0] and exact == []
    idx, wt, exact = qs.column_plan(128 + 48, 1, 0, peak)  # r = 48: the partial block is encoded whole
    assert len(idx) == 1 and idx[0] < 8 and wt == [8.0] and exact == list(range(8, 16))


def test_partial_block_matches_full_quantization(layer0):
    """A 64-row Linear (one half-filled 128 block): the sampled estimate keeps the loss of the correlated
    rotated columns (a plain per-column sum would report about half)."""
    ck, hs = layer0
    name = "model.language_model.layers.1.mlp.shared_experts.gate_proj.weight"
    w, h = ck.get(name), hs[name]
    sampled = float(qs.measure(w, h, [4.0], strips=1)[0, 0])
    actual = float(qs.proxy_loss(w, trellis.quantize(w, 4.0, hessian=h).dequantize(), h))
    assert abs(sampled / actual - 1) < SAMPLING_BOUND, (sampled, actual)


def test_stacked_routing_weighted_loss(layer0):
    """Stacked (E, out, in) input: one loss per matrix; the loss Hessian (routing weight) scales it linearly."""
    ck, hs = layer0
    w = ck.get(Q_PROJ)
    h = hs[Q_PROJ]
    ws, hh = torch.stack([w, 0.5 * w]), torch.stack([h, h])
    base = qs.measure(ws, hh, [3.0], strips=1)[0]
    weighted = qs.measure(ws, hh, [3.0], loss_hessian=torch.stack([0.25 * h, h]), strips=1)[0]
    assert weighted[0] == pytest.approx(0.25 * float(base[0]), rel=1e-6)
    assert weighted[1] == pytest.approx(float(base[1]), rel=1e-6)
    assert 0.15 < float(base[1] / base[0]) < 0.35  # half the weight: about a quarter of the loss
