"""Per-token KL / top-1 / NLL quantities and the summary statistics of llama-perplexity's KL mode.

Definitions follow gguf-facts.md §7.3-7.4 (llama.cpp `tools/perplexity`):
- KLD_token = Σ_{i : lp_i > -16} p_i (lp_i - lq_i), KL(ref ‖ cand) in nats, truncated to reference
  probabilities above e^-16;
- top-1 agreement: argmax of the candidate logits == argmax of the reference log-probs (first maximum wins);
- nll = -lq_t, nll_ref = -lp_t for the true next token t; Δp = exp(-nll) - exp(-nll_ref).
Per-token scalars are kept (for the percentiles); logits never are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

KLD_LOGP_FLOOR = -16.0  # llama-perplexity ignores reference entries with log p <= -16


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the vocabulary (the form reference log-probs are kept and stored in)."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


ROW_CHUNK = 64  # rows per float64 pass: bounds temporaries to ~64·vocab·8 bytes (80 MB at GLM-5.3's 154,880)


def token_quantities(ref_logprobs: torch.Tensor, cand_logits: torch.Tensor, targets: torch.Tensor, *,
                     rows: int = ROW_CHUNK) -> dict[str, torch.Tensor]:
    """Per-position quantities for scored rows.

    ref_logprobs: (n, vocab) reference log-probabilities (`log_probs` of the reference logits); cand_logits:
    (n, vocab) candidate logits (any normalisation); targets: (n,) the true next tokens. Returns float64
    tensors kld, nll, nll_ref, dp and a bool tensor same_top, all of shape (n,), on the CPU. `rows` per float64
    pass (the memory budget's piece: every row is computed on its own, so the values do not depend on it).
    """
    if ref_logprobs.shape != cand_logits.shape:
        raise ValueError(f"reference {tuple(ref_logprobs.shape)} and candidate {tuple(cand_logits.shape)} shapes differ")
    parts = [
        _rows(ref_logprobs[i : i + rows], cand_logits[i : i + rows], targets[i : i + rows])
        for i in range(0, ref_logprobs.shape[0], max(1, int(rows)))
    ]
    return {k: torch.cat([p[k] for p in parts]) for k in ("kld", "nll", "nll_ref", "dp", "same_top")}


def _rows(ref_logprobs: torch.Tensor, cand_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    # Both sides normalised in float32 (as llama.cpp does), products and sums in float64: identical logits
    # give exactly zero, and stored float32 reference log-probs reproduce the on-the-fly numbers bit for bit.
    lp = ref_logprobs.to(torch.float32).to(torch.float64)
    lq = log_probs(cand_logits).to(torch.float64)
    keep = lp > KLD_LOGP_FLOOR
    p = torch.exp(lp)
    kld = torch.where(keep, p * (lp - lq), torch.zeros((), dtype=torch.float64, device=lp.device)).sum(-1)
    t = targets.to(lp.device).long().unsqueeze(-1)
    nll = -lq.gather(-1, t).squeeze(-1)
    nll_ref = -lp.gather(-1, t).squeeze(-1)
    dp = torch.exp(-nll) - torch.exp(-nll_ref)
    same_top = cand_logits.argmax(-1) == ref_logprobs.argmax(-1)
    return {"kld": kld.cpu(), "nll": nll.cpu(), "nll_ref": nll_ref.cpu(), "dp": dp.cpu(), "same_top": same_top.cpu()}


def mean_and_uncertainty(s: float, s2: float, n: int) -> tuple[float, float]:
    """μ = S/N, σ = sqrt((S2/N - μ²)/(N-1)); σ is 0 when N <= 10 or the variance is not positive."""
    mu = s / n
    var = s2 / n - mu * mu
    if n <= 10 or var <= 0:
        return mu, 0.0
    return mu, math.sqrt(var / (n - 1))


def covariance(sab: float, sa: float, sb: float, n: int) -> float:
    """(Σab/N - (Σa/N)(Σb/N)) / (N-1), 0 when N < 10 (llama-perplexity's `cov`)."""
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


@dataclass
class KLAccumulator:
    """Collects per-token quantities window by window (only O(positions) scalars are kept)."""

    kld: list[np.ndarray] = field(default_factory=list)
    nll: list[np.ndarray] = field(default_factory=list)
    nll_ref: list[np.ndarray] = field(default_factory=list)
    dp: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    def add(self, q: dict[str, torch.Tensor]) -> None:
        for k in ("kld", "nll", "nll_ref", "dp", "same_top"):
            getattr(self, k).append(q[k].numpy())

    @property
    def positions(self) -> int:
        return int(sum(len(a) for a in self.kld))

    def summary(self) -> dict[str, float | int]:
        """All statistics of llama-perplexity's KL mode (probabilities as fractions, not %)."""
        n = self.positions
        if n == 0:
            raise ValueError("no scored positions")
        kld = np.concatenate(self.kld).astype(np.float64)
        nll = np.concatenate(self.nll).astype(np.float64)
        nll_ref = np.concatenate(self.nll_ref).astype(np.float64)
        dp = np.concatenate(self.dp).astype(np.float64)
        same = int(np.concatenate(self.same_top).sum())
        return summarize(kld, nll, nll_ref, dp, same)


def _exp(x: float) -> float:
    """exp that gives inf instead of raising (a broken candidate can have a mean NLL in the thousands)."""
    return math.exp(x) if x < 709.0 else math.inf


def summarize(kld: np.ndarray, nll: np.ndarray, nll_ref: np.ndarray, dp: np.ndarray, n_same_top: int) -> dict[str, float | int]:
    """Summary statistics from per-token arrays (float64); keys as in the `mixq eval` JSON plus their errors."""
    n = len(kld)
    mu_nll, s_nll = mean_and_uncertainty(float(nll.sum()), float((nll * nll).sum()), n)
    mu_ref, s_ref = mean_and_uncertainty(float(nll_ref.sum()), float((nll_ref * nll_ref).sum()), n)
    cov = covariance(float((nll * nll_ref).sum()), float(nll.sum()), float(nll_ref.sum()), n)
    ppl, ppl_ref = _exp(mu_nll), _exp(mu_ref)
    u_ppl, u_ref = ppl * s_nll, ppl_ref * s_ref
    dppl_var = u_ppl**2 + u_ref**2 - 2.0 * ppl * ppl_ref * cov if math.isfinite(ppl) else math.inf
    kld_mu, kld_err = mean_and_uncertainty(float(kld.sum()), float((kld * kld).sum()), n)
    dp2 = dp * dp
    dp2_mu, dp2_err = mean_and_uncertainty(float(dp2.sum()), float((dp2 * dp2).sum()), n)
    rms = math.sqrt(dp2_mu)
    top1 = n_same_top / n
    # percentiles by linear interpolation at f·(N-1); the median averages the two middle values for even N
    p90, p99, p999 = (float(v) for v in np.quantile(kld, [0.90, 0.99, 0.999]))
    pinned = {  # the `mixq eval` JSON keys, in their documented order (docs/eval.md)
        "kld_mean": kld_mu,
        "kld_mean_err": kld_err,
        "kld_median": float(np.median(kld)),
        "kld_p90": p90,
        "kld_p99": p99,
        "kld_p999": p999,
        "kld_max": float(kld.max()),
        "top1": top1,
        "ppl_ref": ppl_ref,
        "ppl": ppl,
        "dppl": ppl - ppl_ref,
        "rms_dp": rms,
        "positions": n,
    }
    extra = {  # llama-perplexity's other printed statistics
        "kld_min": float(kld.min()),
        "top1_err": math.sqrt(top1 * (1 - top1) / (n - 1)) if n > 1 else 0.0,
        "ppl_ref_err": u_ref,
        "ppl_err": u_ppl,
        "dppl_err": math.sqrt(dppl_var) if dppl_var > 0 else 0.0,
        "ln_ppl_ratio": mu_nll - mu_ref,
        "rms_dp_err": 0.5 * dp2_err / rms if rms > 0 else 0.0,
        "dp_mean": float(dp.mean()),
    }
    return {**pinned, **extra}
