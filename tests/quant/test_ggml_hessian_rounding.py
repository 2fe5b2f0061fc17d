"""quant/ggml/rounding/hessian.py: same ggml types and bytes count, smaller layer-output error tr(ΔW·H·ΔWᵀ).

Weights and Hessians are real: glm5next-k256 layer-0 q_proj and layer-1 routed experts, with input Hessians from
a short calibration forward (4 rows x 128 tokens of calibration.txt)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mixq.errors import InputError
from mixq.quant.ggml.rounding import levels as gl
from mixq.quant.ggml import encoders
from mixq.quant.ggml.rounding import hessian as kh

Q_PROJ = "model.language_model.layers.0.self_attn.q_proj.weight"
EXPERTS = 4


@pytest.fixture(scope="module")
def k256_real(k256_model, calibration_text):
    """(ckpt, q_proj W, its H, gate W of 4 layer-1 experts, their routing-weighted Hessians)."""
    from mixq.runtime.calibration import calibration_rows, load_tokenizer
    from mixq.measurement.hessians import layer_hessians
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    ck = open_checkpoint(k256_model)
    spec = next(s for s in gguf_tensors(ck) if s.name == "blk.1.ffn_gate_exps.weight")
    ids = calibration_rows(load_tokenizer(ck.path), [calibration_text], rows=4, seq_len=128,
                           vocab_size=int(ck.text_config["vocab_size"]))
    walk = layer_hessians(ck, ids)
    h_q = next(walk).stats[Q_PROJ].hessian()
    st1 = next(walk)
    h_e = st1.experts(spec, 0, EXPERTS)
    w_e = torch.stack([ck.get(n) for n in spec.hf_names[:EXPERTS]])
    walk.close()
    return ck.get(Q_PROJ), h_q, w_e, h_e


def _err(w, blocks, qtype, h) -> float:
    return float(kh.layer_error(w, torch.from_numpy(kh.dequantize_blocks(blocks, qtype)), h).sum())


@pytest.mark.parametrize("qtype, ceiling", [("Q2_K", 0.85), ("Q3_K", 0.85), ("Q4_K", 0.85), ("Q5_K", 0.85),
                                             ("Q6_K", 0.85), ("Q4_0", 0.85), ("Q5_1", 0.85), ("Q8_0", 0.85),
                                             ("IQ2_XS", 0.85), ("IQ2_S", 0.85), ("IQ4_NL", 0.85),
                                             ("IQ4_XS", 0.85), ("IQ1_S", 0.95), ("IQ1_M", 0.95)])
def test_smaller_layer_error_same_bytes(qtype, ceiling, k256_real):
    w, h, _, _ = k256_real
    imx = torch.diagonal(h).numpy().copy()
    exact = encoders.quantize(w.numpy(), qtype, imx)
    mine = kh.quantize_hessian(w, h, qtype, imx)
    assert mine.shape == exact.shape and mine.dtype == np.uint8
    assert _err(w, mine, qtype, h) < ceiling * _err(w, exact, qtype, h)
    if qtype in gl.IQ2_LAYOUTS and gl.IQ2_LAYOUTS[qtype].parity:  # only even sign patterns are stored
        signs = gl.iq2_groups(mine, qtype)[1]
        assert not (np.unpackbits(signs[..., None], axis=-1).sum(-1) % 2).any()


def test_identity_hessian_is_ggml_rounding(k256_real):
    """With H = I there is no feedback: the codes are nearest rounding on ggml's grid, i.e. ggml's own bytes.
    (K-quants only: ggml's legacy imatrix search weighs by the whole row, the block walk sees one block.)"""
    w = k256_real[0][:32]
    ones = np.ones(w.shape[1], np.float32)
    for qtype in ("Q2_K", "Q4_K", "Q6_K"):
        exact = encoders.quantize(w.numpy(), qtype, ones)
        mine = kh.quantize_hessian(w, torch.eye(w.shape[1]), qtype, ones)
        assert (mine == exact).mean() > 0.999, qtype


def test_expert_stack_equals_one_call_per_expert(k256_real):
    _, _, w_e, h_e = k256_real
    stacked = kh.quantize_hessian(w_e, h_e, "Q3_K")
    for e in range(EXPERTS):
        assert np.array_equal(stacked[e], kh.quantize_hessian(w_e[e], h_e[e], "Q3_K"))
    exact = np.stack([encoders.quantize(w_e[e].numpy(), "Q3_K", torch.diagonal(h_e[e]).numpy().copy())
                      for e in range(EXPERTS)])
    assert _err(w_e, stacked, "Q3_K", h_e) < 0.85 * _err(w_e, exact, "Q3_K", h_e)


def test_rank_deficient_hessian_is_damped():
    w = torch.randn(8, 256) * 0.02
    x = torch.randn(16, 256)
    h = x.T @ x / 16  # rank 16 of 256, and one dead input column
    h[:, 3] = 0
    h[3, :] = 0
    b = kh.quantize_hessian(w, h, "Q4_K")
    assert b.shape == (8, 144) and np.isfinite(kh.dequantize_blocks(b, "Q4_K")).all()


def test_upper_factor_inverts_the_damped_hessians_of_a_stack():
    """U upper with UᵀU = (H + λ·mean diag·I)⁻¹ per expert, a rank-deficient one with a dead column included; the
    float32 U the rounding reads is the Cholesky factor of H⁻¹ up to float64 rounding."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, 64, generator=g, dtype=torch.float64) * torch.rand(64, generator=g, dtype=torch.float64)
    h = x.mT @ x / 40
    h[1, :, 5] = 0
    h[1, 5, :] = 0
    u = kh.upper_inverse_factor(h, 0.1)
    assert torch.equal(u, u.triu())
    hd = h.clone()
    torch.diagonal(hd, dim1=-2, dim2=-1)[1, 5] = 1.0  # a dead column gets a unit diagonal before damping
    mean = torch.diagonal(hd, dim1=-2, dim2=-1).mean(-1, keepdim=True)
    hd = hd + torch.diag_embed(0.1 * mean.expand(3, 64))
    assert torch.allclose(u.mT @ u @ hd, torch.eye(64, dtype=torch.float64).expand(3, 64, 64), atol=1e-10)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True)
    assert torch.allclose(u, ref, rtol=1e-12, atol=1e-12 * float(ref.abs().max()))


def test_bad_input_is_one_clear_error():
    w = torch.randn(4, 256)
    with pytest.raises(InputError, match="does not support 'IQ3_S'"):
        kh.quantize_hessian(w, torch.eye(256), "IQ3_S")
    with pytest.raises(InputError, match=r"Hessian shape \(128, 128\) does not fit weights \(4, 256\)"):
        kh.quantize_hessian(w, torch.eye(128), "Q4_K")
    with pytest.raises(InputError, match="row length 100 is not a multiple of 256"):
        kh.quantize_hessian(torch.randn(4, 100), torch.eye(100), "Q4_K")
    w[0, 0] = float("nan")
    with pytest.raises(InputError, match="NaN or infinite"):
        kh.quantize_hessian(w, torch.eye(256), "Q4_K")


@pytest.mark.parametrize("qtype", ["Q2_K", "Q5_0", "IQ2_XS", "IQ2_S", "IQ4_NL", "IQ4_XS"])
def test_refinement_passes_lower_the_error_and_keep_the_scales(qtype, k256_real, monkeypatch):
    """With the scale refits off, refinement moves only the codes."""
    monkeypatch.setattr(kh, "REFIT_SCALES", False)
    w, h, _, _ = k256_real
    w = w[:64]
    walk = kh.quantize_hessian(w, h, qtype, damp=0.1)
    errs = [_err(w, kh.quantize_hessian(w, h, qtype, damp=0.1, refine=p), qtype, kh._damped(h, 0.1)) for p in (0, 1, 3)]
    assert errs[2] <= errs[1] < errs[0]
    refined = kh.quantize_hessian(w, h, qtype, damp=0.1, refine=3)
    if qtype in gl.IQ2_LAYOUTS:
        assert np.array_equal(gl.iq2_group_scales(walk, qtype), gl.iq2_group_scales(refined, qtype))
        return
    step0, base0 = gl.level_grid(walk, qtype)
    step1, base1 = gl.level_grid(refined, qtype)
    assert np.array_equal(step0, step1) and np.array_equal(base0, base1)  # only the codes moved


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ2_XS", "IQ2_S", "IQ4_NL",
                                   "IQ4_XS"])
def test_scale_refits_lower_the_error(qtype, k256_real, monkeypatch):
    """Each scale refit alone never raises the exact quadratic, and with them the refined file beats the
    codes-only refinement; the bytes count stays the type's."""
    w, h, _, _ = k256_real
    w = w[:64]
    hd = kh._damped(h, 0.1)
    walk = kh.quantize_hessian(w, h, qtype, damp=0.1)
    w3, h3 = w[None].float(), hd[None]
    before = _err(w, walk, qtype, hd)
    sup = kh.refit_super_scales(w3, walk[None], qtype, h3)[0]
    assert sup.shape == walk.shape and _err(w, sup, qtype, hd) < before
    if qtype in gl.SUB_SCALES:
        sub = kh.refine_sub_scales(w3, walk[None], qtype, h3)[0]
        assert _err(w, sub, qtype, hd) <= before  # Q5_K: a ±1 step of a 6-bit scale may not pay on the walk
        assert np.array_equal(gl.super_scales(sub, qtype), gl.super_scales(walk, qtype))  # d, dmin kept
        for a, b in zip(gl.sub_scales(sup, qtype), gl.sub_scales(walk, qtype)):  # the super refit keeps these
            assert b is None or np.array_equal(a, b)
    monkeypatch.setattr(kh, "REFIT_SCALES", False)
    codes_only = _err(w, kh.quantize_hessian(w, h, qtype, damp=0.1, refine=2), qtype, hd)
    monkeypatch.setattr(kh, "REFIT_SCALES", True)
    assert _err(w, kh.quantize_hessian(w, h, qtype, damp=0.1, refine=2), qtype, hd) < codes_only


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "IQ2_S", "IQ2_XS"])
def test_cuda_rounding_matches_the_cpu_quality(qtype, k256_real):
    """On CUDA the scale search runs in the torch encoders and the walk on the device: same layout, and the
    layer error within 2% of the CPU result (float sums differ, so the codes may too)."""
    w, h, w_e, h_e = k256_real
    for ww, hh in ((w, h), (w_e, h_e)):
        cpu = kh.quantize_hessian(ww, hh, qtype, damp=0.1, refine=3, device="cpu")
        gpu = kh.quantize_hessian(ww, hh, qtype, damp=0.1, refine=3, device="cuda")
        assert gpu.shape == cpu.shape
        e_cpu, e_gpu = _err(ww, cpu, qtype, hh), _err(ww, gpu, qtype, hh)
        assert abs(e_gpu - e_cpu) <= 0.02 * e_cpu


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS", "IQ4_XS"])
def test_cuda_rounding_matches_the_cpu_on_synthetic_stacks(qtype):
    """The same check as above without the k256 weights (the device's fixture copy has none): a stack of 4 experts
    of 64 x 512 with correlated inputs; on CUDA (the fused codebook search, the windowed sweeps) the layer error is
    within 2% of the CPU's, and IQ2_XS's stored sign patterns are all even there too."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4, 64, 512, generator=g) * 0.02
    mix = torch.eye(512) + 0.3 * torch.randn(512, 512, generator=g) / 512 ** 0.5
    x = torch.randn(4, 1024, 512, generator=g) @ mix
    h = x.mT @ x / x.shape[1]
    cpu = kh.quantize_hessian(w, h, qtype, damp=0.1, refine=3, device="cpu")
    gpu = kh.quantize_hessian(w, h, qtype, damp=0.1, refine=3, device="cuda")
    assert gpu.shape == cpu.shape
    e_cpu, e_gpu = (sum(_err(w[e], b[e], qtype, h[e]) for e in range(4)) for b in (cpu, gpu))
    assert abs(e_gpu - e_cpu) <= 0.02 * e_cpu
    if qtype == "IQ2_XS":
        assert not (np.unpackbits(gl.iq2_groups(gpu, qtype)[1][..., None], axis=-1).sum(-1) % 2).any()


# IQ2_XS takes IQ2_S's group descent (its sign parity aside) through the same window: `slow` alone
@pytest.mark.parametrize("qtype", ["Q4_K", "Q2_K", "IQ2_S", pytest.param("IQ2_XS", marks=pytest.mark.slow), "Q8_0"])
def test_windowed_feedback_is_the_same_descent(qtype, k256_real, monkeypatch):
    """The accelerator's sweep order (the gradient kept current in a window of columns, the rest updated once per
    window) is the same descent in another summation order: run on the CPU with a window of a quarter row, the
    layer error is the CPU order's to 1e-4 and almost every byte is the same (a forgotten update would not be)."""
    w, h, w_e, h_e = k256_real
    for ww, hh in ((w, h), (w_e, h_e)):
        eager = kh.quantize_hessian(ww, hh, qtype, damp=0.1, refine=3)
        monkeypatch.setitem(kh.FEEDBACK_WINDOW, "cpu", ww.shape[-1] // 4)
        windowed = kh.quantize_hessian(ww, hh, qtype, damp=0.1, refine=3)
        monkeypatch.setitem(kh.FEEDBACK_WINDOW, "cpu", None)
        e0, e1 = _err(ww, eager, qtype, hh), _err(ww, windowed, qtype, hh)
        assert abs(e1 - e0) <= 1e-4 * e0
        assert (eager == windowed).mean() >= 0.999


def test_argmin_shortlist_is_topk():
    """The accelerator's shortlist of IQ2_S codebook entries (k passes of argmin) is topk's, in its order."""
    x = torch.randn(500, 1024, generator=torch.Generator().manual_seed(3))
    want = x.topk(kh.IQ2_SHORTLIST, dim=-1, largest=False).indices
    assert torch.equal(kh.smallest_by_argmin(x.clone(), kh.IQ2_SHORTLIST), want)


@pytest.mark.parametrize("sweep", ["iq2s", "sub_scales"])
def test_a_fused_sweep_that_fails_its_check_keeps_the_loop(sweep, k256_real, monkeypatch):
    """A fused sweep whose kernel does not build (raises) or moves nothing (its layer error above the loop's) is
    refused on its first use, with a warning, and the loop's bytes come out."""
    _, _, w_e, h_e = k256_real
    qtype = "IQ2_S" if sweep == "iq2s" else "Q4_K"
    w, h = w_e[:2, :32], h_e[:2].contiguous()
    blocks = np.stack([encoders.quantize(w[e].numpy(), qtype) for e in range(2)])

    def refine():
        return kh.refine_iq2(w, blocks, "IQ2_S", h) if sweep == "iq2s" else kh.refine_sub_scales(w, blocks, qtype, h)

    want = refine()  # the loop: the CPU takes no fused kernel
    assert not np.array_equal(want, blocks)  # the loop moves codes, so a kernel that moves none is worse
    module, launcher = ((kh.triton_iq2s_descent, "iq2s_window") if sweep == "iq2s"
                        else (kh.triton_subscales, "sub_scale_window"))
    # the sweeps ask for a kernel with the weights (E, rows, n); the loop's codebook search asks with its targets
    # (E, rows, 8), and keeps its torch path here (no Triton on a CPU)
    monkeypatch.setattr(kh, "use_fused", lambda t: t.shape[-1] == w.shape[-1])

    def broken(*a, **k):
        raise RuntimeError("no kernel")

    for kernel, why in ((broken, "unavailable"), (lambda *a, **k: None, "above the loop")):
        kh.FUSED_SWEEPS.clear()
        monkeypatch.setattr(module, launcher, kernel)
        with pytest.warns(UserWarning, match=why):
            if not kh.FUSED_BY_DEFAULT[sweep]:  # a kernel that does not serve by default is checked where asked for
                assert kh.allow_fused_sweep(sweep, w.device) is False
            got = refine()
        assert np.array_equal(got, want)
        assert kh.fused_sweep_ok(sweep, w.device) is False  # decided once for the process
    kh.FUSED_SWEEPS.clear()


def test_the_fused_iq2s_descent_serves_only_where_asked_for(k256_real, monkeypatch):
    """The fused IQ2_S group descent (slower than its loop on an H200) is not tried unless a caller asks for it:
    with a kernel that would pass its check, the loop still runs; asked for, the kernel runs."""
    _, _, w_e, h_e = k256_real
    w, h = w_e[:2, :32], h_e[:2].contiguous()
    blocks = np.stack([encoders.quantize(w[e].numpy(), "IQ2_S") for e in range(2)])
    monkeypatch.setattr(kh, "use_fused", lambda t: t.shape[-1] == w.shape[-1])
    calls = []
    monkeypatch.setattr(kh, "_check_sweep", lambda sweep, dev: (0.0, 1.0))
    monkeypatch.setattr(kh, "_fused_iq2s", lambda *a: calls.append(1) or blocks)
    kh.FUSED_SWEEPS.clear()
    try:
        kh.refine_iq2(w, blocks, "IQ2_S", h)
        assert calls == [] and kh.fused_sweep_ok("iq2s", w.device) is False
        assert kh.allow_fused_sweep("iq2s", w.device) is True
        kh.refine_iq2(w, blocks, "IQ2_S", h)
        assert calls == [1]
    finally:
        kh.FUSED_SWEEPS.clear()
