"""Statistics of llama-perplexity's KL mode against hand-computed values."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mixq.runtime.kl_stats import (
    KLAccumulator,
    covariance,
    log_probs,
    mean_and_uncertainty,
    summarize,
    token_quantities,
)


def test_kld_top1_nll_dp_by_hand():
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]], dtype=torch.float64))
    cand = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]], dtype=torch.float64)) + 3.0  # unnormalised
    q = token_quantities(ref.float(), cand.float(), torch.tensor([1, 0]))
    # KL = 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) = 0.25 ln 2 ; identical rows give 0
    assert q["kld"][0].item() == pytest.approx(0.25 * math.log(2), abs=1e-6)
    assert q["kld"][1].item() == pytest.approx(0.0, abs=1e-7)
    assert q["same_top"].tolist() == [False, True]
    assert q["nll"][0].item() == pytest.approx(-math.log(0.5), abs=1e-6)
    assert q["nll_ref"][0].item() == pytest.approx(-math.log(0.25), abs=1e-6)
    assert q["dp"][0].item() == pytest.approx(0.25, abs=1e-6)  # p_cand(t) - p_ref(t) = 0.5 - 0.25


def test_kld_ignores_reference_entries_below_e_minus_16():
    p = torch.tensor([1 - 2e-8, 1e-8, 1e-8], dtype=torch.float64)
    ref = torch.log(p).float()
    cand = torch.log(torch.tensor([1 - 2e-8, 1e-9, 1.9e-8], dtype=torch.float64)).float()
    q = token_quantities(ref[None], cand[None], torch.tensor([0]))
    # entries 1 and 2 have ln p ≈ -18.4 < -16: only entry 0 counts, and its term is ~0
    assert abs(q["kld"].item()) < 1e-7


def test_identical_logits_give_exact_zero():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g) * 4
    q = token_quantities(log_probs(logits), logits, torch.arange(7))
    assert torch.all(q["kld"] == 0) and torch.all(q["dp"] == 0) and bool(q["same_top"].all())


def test_mean_and_uncertainty_and_cov():
    x = np.arange(1.0, 13.0)  # 12 values
    mu, sd = mean_and_uncertainty(x.sum(), (x * x).sum(), len(x))
    assert mu == pytest.approx(6.5)
    assert sd == pytest.approx(math.sqrt((np.mean(x * x) - 6.5**2) / 11))
    assert mean_and_uncertainty(10.0, 30.0, 10) == (1.0, 0.0)  # N <= 10: no uncertainty
    y = 2 * x + 1
    assert covariance((x * y).sum(), x.sum(), y.sum(), 12) == pytest.approx(2 * (np.mean(x * x) - 6.5**2) / 11)
    assert covariance(1.0, 1.0, 1.0, 9) == 0.0


def test_percentiles_and_median_by_hand():
    """Linear interpolation at f·(N-1) on the sorted values; the mean of the two middle values for even N."""
    n = 4
    kld = np.array([10.0, 0.0, 2.0, 1.0])  # unsorted on purpose
    out = summarize(kld, np.ones(n), np.ones(n), np.zeros(n), n)
    assert out["kld_median"] == 1.5 and out["kld_min"] == 0.0 and out["kld_max"] == 10.0
    assert out["kld_p90"] == pytest.approx(2.0 + 0.7 * 8.0)  # position 0.9·3 = 2.7
    assert out["kld_p99"] == pytest.approx(2.0 + 0.97 * 8.0)
    odd = summarize(np.array([9.0, 3.0, 5.0]), np.ones(3), np.ones(3), np.zeros(3), 3)
    assert odd["kld_median"] == 5.0


def test_summarize_by_hand():
    n = 20
    kld = np.linspace(0.0, 0.19, n)
    nll = np.full(n, 2.0)
    nll[::2] = 3.0
    nll_ref = np.full(n, 2.5)
    dp = np.where(np.arange(n) % 2 == 0, 0.1, -0.1)
    s = summarize(kld, nll, nll_ref, dp, n_same_top=15)
    assert s["positions"] == n and s["top1"] == 0.75
    assert s["top1_err"] == pytest.approx(math.sqrt(0.75 * 0.25 / 19))
    assert s["kld_mean"] == pytest.approx(0.095)
    assert s["kld_median"] == pytest.approx(0.095)
    assert s["kld_p90"] == pytest.approx(0.171)
    assert s["kld_max"] == pytest.approx(0.19)
    assert s["ppl"] == pytest.approx(math.exp(2.5)) and s["ppl_ref"] == pytest.approx(math.exp(2.5))
    assert s["dppl"] == pytest.approx(0.0, abs=1e-12)
    assert s["ppl_err"] == pytest.approx(math.exp(2.5) * math.sqrt(0.25 / 19))
    assert s["rms_dp"] == pytest.approx(0.1)
    assert s["rms_dp_err"] == 0.0  # Δp² constant: zero variance


def test_accumulator_concatenates_windows():
    acc = KLAccumulator()
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        ref, cand = torch.randn(30, 11, generator=g), torch.randn(30, 11, generator=g)
        acc.add(token_quantities(log_probs(ref), cand, torch.randint(0, 11, (30,), generator=g)))
    s = acc.summary()
    assert s["positions"] == 60 and s["kld_mean"] > 0
    with pytest.raises(ValueError):
        KLAccumulator().summary()


def test_row_chunks_do_not_change_results():
    from mixq.runtime import kl_stats as stats

    g = torch.Generator().manual_seed(3)
    ref, cand = torch.randn(150, 40, generator=g) * 3, torch.randn(150, 40, generator=g) * 3
    tgt = torch.randint(0, 40, (150,), generator=g)
    whole = stats._rows(log_probs(ref), cand, tgt)
    chunked = token_quantities(log_probs(ref), cand, tgt)  # 64 + 64 + 22 rows
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)
