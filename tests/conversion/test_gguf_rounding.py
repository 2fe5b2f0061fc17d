"""conversion/gguf/rounding.py: GGUF `--rounding hessian` — same tensors, types and byte counts as ggml's encoder,
codes chosen for the layer-output error (glm5next-k256, a short calibration)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mixq.conversion.options import check_rounding
from mixq.conversion.gguf import rounding as gr
from mixq.errors import InputError
from mixq.quant.ggml import encoders
from mixq.quant.ggml.rounding import hessian as kh

PICK = {"token_embd.weight": "Q4_K", "blk.0.attn_q.weight": "Q2_K", "blk.1.ffn_up_exps.weight": "Q3_K",
        "output.weight": "Q6_K", "blk.3.attn_k_b.weight": "BF16", "blk.0.ssm_f_a.weight": "Q4_K",
        "blk.4.ffn_up_exps.weight": "Q4_K", "blk.0.attn_v.weight": "IQ3_S"}


@pytest.fixture(scope="module")
def k256_specs(k256_model):
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    ck = open_checkpoint(k256_model)
    specs = [s for s in gguf_tensors(ck) if s.name in PICK]
    return ck, specs, [PICK[s.name] for s in specs]


def test_rounding_modes_are_checked():
    assert check_rounding("Hessian") == "hessian" and check_rounding("exact") == "exact"
    with pytest.raises(InputError, match="--rounding 'gptq': expected one of exact, hessian"):
        check_rounding("gptq")


def test_covered_tensors(k256_specs):
    _, specs, types = k256_specs
    got = {s.name for s, t in zip(specs, types) if gr.covered(s, t)}
    # BF16 keeps its bytes; the NextN block (blk.4) has no calibration input; ssm_f_a is a covered Linear; IQ3_S
    # is left to ggml's encoder
    assert got == {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_up_exps.weight", "output.weight",
                   "blk.0.ssm_f_a.weight"}


@pytest.mark.slow
def test_hessian_rounded_blocks_have_ggml_layout(k256_specs, calibration_text, tmp_path):
    ck, specs, types = k256_specs
    with gr.hessian_rounded(ck, specs, types, tmp_path / "m.gguf", calibration=[calibration_text], rows=2,
                            seq_len=64, tune_iters=2, progress=False) as loaders:
        assert len(list(tmp_path.glob(".m.partial-hessian-*"))) == 1
        # the covered tensors, and the one the tuner had ggml encode for its layer (the writer takes its bytes)
        assert set(loaders) == {s.name for s, t in zip(specs, types) if gr.covered(s, t)} | {"blk.0.attn_v.weight"}
        got = {n: f() for n, f in loaders.items()}
    assert not list(tmp_path.glob(".m.partial-hessian-*"))  # the spill directory is gone
    from mixq.formats.gguf_names import build_tensor

    for s, t in zip(specs, types):
        if s.name not in got:
            continue
        x = build_tensor(s, ck.get).numpy()
        exact = np.stack([encoders.quantize(e, t) for e in x]) if x.ndim == 3 else encoders.quantize(x, t)
        assert got[s.name].shape == exact.shape and got[s.name].dtype == np.uint8, s.name
        if not gr.covered(s, t):
            assert np.array_equal(got[s.name], exact), s.name  # ggml's own bytes, as the writer would encode them
            continue
        d = kh.dequantize_blocks(got[s.name], t)
        assert np.isfinite(d).all()
        # the codes moved, the weights stayed close: decoded values within a few steps of ggml's own decoding
        rel = np.abs(d - kh.dequantize_blocks(exact, t)).mean() / np.abs(x).mean()
        assert 0 < rel < 0.5, (s.name, rel)


def test_work_directory_is_removed_on_error(k256_specs, tmp_path, monkeypatch):
    ck, specs, types = k256_specs

    def boom(*a, **k):
        raise InputError("calibration failed")

    monkeypatch.setattr(gr, "encode_hessian_rounded", boom)
    with pytest.raises(InputError, match="calibration failed"):
        with gr.hessian_rounded(ck, specs, types, tmp_path / "m.gguf"):
            pass
    assert not list(tmp_path.iterdir())


def _layout(path):
    import gguf

    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors}


def _llama_logits_finite(path) -> bool:
    """The file loads in llama-cpp-python 0.3.36 and scores a short window with finite logits."""
    from mixq.eval.llamacpp import LlamaCppScorer

    sc = LlamaCppScorer(path, ctx=33, first=0, cache_type="f32")
    try:
        return bool(torch.isfinite(sc(torch.arange(1, 34))).all())
    finally:
        sc.close()


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q4_K_M", "IQ2_S-exps", "IQ2_XS-exps"])
def test_convert_rounding_hessian_same_layout_loads_and_verifies(mix, k256_model, calibration_text, tmp_path):
    """`mixq convert --rounding hessian`: every tensor keeps llama-quantize's type and byte count, the covered
    tensors' codes change, the file passes `mixq verify` and llama.cpp loads and runs it."""
    pytest.importorskip("llama_cpp")
    from mixq.conversion.api import verify
    from mixq.conversion.gguf.pipeline import convert_gguf, make_imatrix

    imx = tmp_path / "imx.gguf"
    make_imatrix(k256_model, imx, [calibration_text], rows=2, seq_len=64, progress=False)
    kw = dict(qtype="Q4_K_M", imatrix=imx, threads=1, progress=False,
              tensor_type=[rf"blk\.[0-3]\.ffn_(gate|up|down)_exps={mix.removesuffix('-exps')}"]
              if mix != "Q4_K_M" else [])
    convert_gguf(k256_model, tmp_path / "exact.gguf", **kw)
    convert_gguf(k256_model, tmp_path / "hess.gguf", rounding="hessian", calibration=[calibration_text], rows=2,
                 seq_len=64, tune_iters=4, **kw)
    a, b = _layout(tmp_path / "exact.gguf"), _layout(tmp_path / "hess.gguf")
    assert a == b
    import gguf

    da = {t.name: bytes(t.data) for t in gguf.GGUFReader(tmp_path / "exact.gguf").tensors}
    db = {t.name: bytes(t.data) for t in gguf.GGUFReader(tmp_path / "hess.gguf").tensors}
    changed = {n for n in da if da[n] != db[n]}
    assert {"token_embd.weight", "blk.1.ffn_up_exps.weight", "output.weight"} <= changed
    assert not any(n.startswith("blk.4.") for n in changed)  # the NextN block keeps ggml's bytes
    assert not list(tmp_path.glob(".hess.partial-*"))
    assert verify(tmp_path / "hess.gguf", model=k256_model)["problems"] == []
    assert _llama_logits_finite(tmp_path / "hess.gguf")


@pytest.mark.slow  # one of the longest of the default run: bench/results/ci_fresh_clone_283e8d1_durations.tsv
def test_mini_iq4nl_experts_are_rounded_tuned_and_load(mini_model, calibration_text, tmp_path):
    """On mini (128-wide rows) IQ2_S experts fall back to IQ4_NL and the K-quants to Q5_0/Q8_0: with
    `--rounding hessian` the IQ4_NL stacks get their own codes and the Q5_0 tensors learned block scales, the
    layout stays llama-quantize's, the file passes `mixq verify` and llama.cpp runs it."""
    pytest.importorskip("llama_cpp")
    import gguf

    from mixq.conversion.api import verify
    from mixq.conversion.gguf.pipeline import convert_gguf, make_imatrix

    imx = tmp_path / "imx.gguf"
    make_imatrix(mini_model, imx, [calibration_text], rows=2, seq_len=64, progress=False)
    kw = dict(qtype="Q4_K_M", imatrix=imx, threads=1, progress=False,
              tensor_type=[r"blk\.[0-3]\.ffn_(gate|up|down)_exps=IQ2_S"])
    convert_gguf(mini_model, tmp_path / "exact.gguf", **kw)
    convert_gguf(mini_model, tmp_path / "hess.gguf", rounding="hessian", calibration=[calibration_text], rows=4,
                 seq_len=64, tune_iters=8, **kw)
    assert _layout(tmp_path / "exact.gguf") == _layout(tmp_path / "hess.gguf")
    ta = {t.name: t for t in gguf.GGUFReader(tmp_path / "exact.gguf").tensors}
    tb = {t.name: t for t in gguf.GGUFReader(tmp_path / "hess.gguf").tensors}
    exps = [n for n in ta if "_exps" in n and not n.startswith("blk.4.")]
    assert exps and all(ta[n].tensor_type.name == "IQ4_NL" for n in exps)
    assert all(bytes(ta[n].data) != bytes(tb[n].data) for n in exps)
    q5 = ta["blk.0.attn_q.weight"]
    assert q5.tensor_type.name == "Q5_0"
    d = [np.asarray(t.data).reshape(-1, 22)[:, :2] for t in (q5, tb["blk.0.attn_q.weight"])]
    assert not np.array_equal(d[0], d[1])                  # block scales learned (layer 0 is tuned)
    assert verify(tmp_path / "hess.gguf", model=mini_model)["problems"] == []
    assert _llama_logits_finite(tmp_path / "hess.gguf")


@pytest.mark.slow
def test_convert_measured_plan_hits_the_size_loads_and_verifies(k256_model, tmp_path):
    """`mixq convert --size S --measure CURVES`: the file is within 0.1% of S, has the plan's types, passes
    `mixq verify` and runs in llama.cpp (curves shaped like a good quantizer's, so no calibration is needed)."""
    pytest.importorskip("llama_cpp")
    import json
    import math

    from mixq.conversion.api import verify
    from mixq.planning.gguf_measured import measured_units
    from mixq.conversion.gguf.pipeline import convert_gguf
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.planning import gguf_mix as gm

    units = measured_units(open_checkpoint(k256_model))
    curves = {n: {f"{gm.type_bpw(t):g}": (20.0 if s.role == "embed" else 1.0) * math.prod(s.shape)
                  * 4.0 ** -gm.type_bpw(t) for t in lad} for n, (s, lad) in units.items()}
    (tmp_path / "curves.json").write_text(json.dumps(curves))
    size = 12_674_400  # llama.cpp's Q3_K_M file of k256
    out = tmp_path / "m.gguf"
    convert_gguf(k256_model, out, size=size, measure=tmp_path / "curves.json", threads=1, progress=False)
    assert abs(out.stat().st_size - size) / size < 1e-3
    assert _layout(out)["token_embd.weight"][0] != "BF16"  # the measured plan budgets the embedding
    assert verify(out, model=k256_model)["problems"] == []
    assert _llama_logits_finite(out)


def test_embedding_metric_adds_the_residual_path(k256_specs, calibration_text, monkeypatch):
    """token_embd's metric: one normalised term per group of first-layer Linears reading the residual stream (mean
    diagonal 1 each), plus EMBED_RESIDUAL x its mean diagonal on the identity for the residual path."""
    import mixq.measurement.hessians as gh
    from mixq.runtime.calibration import calibration_rows, load_tokenizer

    ck = k256_specs[0]
    ids = calibration_rows(load_tokenizer(ck.path), [calibration_text], rows=2, seq_len=64,
                           vocab_size=int(ck.text_config["vocab_size"]))
    walk = gh.layer_hessians(ck, ids)
    stage = next(walk)
    embed = ck.get("model.language_model.embed_tokens.weight", dtype=torch.float32)
    freq = gh.token_frequency(ids, embed.shape[0])
    monkeypatch.setattr(gh, "EMBED_RESIDUAL", 0.0)
    m0 = gh.embedding_hessian(stage, ck, embed, freq).double()
    monkeypatch.setattr(gh, "EMBED_RESIDUAL", 4.0)
    m4 = gh.embedding_hessian(stage, ck, embed, freq).double()
    walk.close()
    groups = round(float(torch.diagonal(m0).mean()))
    assert groups >= 2 and float(torch.diagonal(m0).mean()) == pytest.approx(groups, rel=1e-5)
    assert torch.allclose(m0, m0.T, atol=1e-5 * groups)
    assert torch.allclose(m4 - m0, 4.0 * groups * torch.eye(m0.shape[0], dtype=torch.float64), atol=1e-4)


def test_a_stage_lends_its_source_layer_with_the_routing_capture_paused(k256_specs, calibration_text):
    """A MoE stage lends the calibration's own layer module (its source weights); while lent, running it keeps
    nothing in the routing capture, and the capture records again after the block."""
    import mixq.measurement.hessians as gh
    from mixq.runtime.calibration import calibration_rows, load_tokenizer

    ck = k256_specs[0]
    ids = calibration_rows(load_tokenizer(ck.path), [calibration_text], rows=2, seq_len=32,
                           vocab_size=int(ck.text_config["vocab_size"]))
    walk = gh.layer_hessians(ck, ids)
    stage = next(s for s in walk if s.capture is not None)
    kept = len(stage.capture.x)
    experts = stage.module.mlp.experts
    x = torch.randn(5, experts.gate_up_proj.shape[-1])
    idx, w = torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
    down0 = ck.get(f"model.language_model.layers.{stage.layer}.mlp.experts.0.down_proj.weight", dtype=torch.float32)
    with stage.lent_layer() as mod:
        assert mod is stage.module and torch.equal(mod.mlp.experts.down_proj[0], down0)
        mod.mlp.experts(x, idx, w)
        assert len(stage.capture.x) == kept
    experts(x, idx, w)
    assert len(stage.capture.x) == kept + 1
    walk.close()


def test_expert_slices_read_ahead_round_as_one_at_a_time(k256_specs, calibration_text, tmp_path, monkeypatch):
    """A stack's slices, read one ahead as stored (BF16), give the bytes of rounding each slice by hand from its
    float32 weights with that slice's Hessians (uneven slices: 3 experts a call)."""
    import mixq.measurement.hessians as gh
    from mixq.runtime.calibration import calibration_rows, load_tokenizer

    ck, specs, types = k256_specs
    spec = next(s for s in specs if s.name == "blk.1.ffn_up_exps.weight")
    ids = calibration_rows(load_tokenizer(ck.path), [calibration_text], rows=2, seq_len=32,
                           vocab_size=int(ck.text_config["vocab_size"]))
    walk = gh.layer_hessians(ck, ids)
    stage = next(s for s in walk if s.layer == spec.layer)
    monkeypatch.setattr(gr, "expert_slice", lambda rows, n, dev: 3)
    dev = torch.device("cpu")
    assert gr._encode_spec(spec, "Q3_K", stage, lambda n: ck.get(n, dtype=None), None, tmp_path / "a.npy", dev, 1)
    E = len(spec.hf_names)
    want = [kh.quantize_hessian(torch.stack([ck.get(spec.hf_names[e]) for e in range(e0, min(E, e0 + 3))]),
                                stage.experts(spec, e0, min(E, e0 + 3)), "Q3_K", damp=gr.DAMP, refine=1, device=dev)
            for e0 in range(0, E, 3)]
    walk.close()
    assert E % 3 and np.array_equal(np.load(tmp_path / "a.npy"), np.concatenate(want))


@pytest.mark.slow
def test_mini_iq4_xs_mix_with_hessian_rounding_reads_back(mini_model, calibration_text, tmp_path):
    """A llama-quantize name beyond the K-quant mixes (`--type IQ4_XS`: IQ4_NL on mini's 128-wide rows, output at
    Q8_0) with `--rounding hessian`: llama-quantize's layout, the covered tensors' codes changed, and gguf-py reads
    every tensor back to finite weights."""
    import gguf

    from mixq.conversion.gguf.pipeline import convert_gguf

    kw = dict(qtype="IQ4_XS", threads=1, progress=False)
    convert_gguf(mini_model, tmp_path / "exact.gguf", **kw)
    convert_gguf(mini_model, tmp_path / "hess.gguf", rounding="hessian", calibration=[calibration_text], rows=2,
                 seq_len=64, tune_iters=2, **kw)
    assert _layout(tmp_path / "exact.gguf") == _layout(tmp_path / "hess.gguf")
    ta = {t.name: t for t in gguf.GGUFReader(tmp_path / "exact.gguf").tensors}
    tb = {t.name: t for t in gguf.GGUFReader(tmp_path / "hess.gguf").tensors}
    assert {"IQ4_NL", "Q8_0"} <= {t.tensor_type.name for t in tb.values()}
    changed = [n for n in ta if bytes(ta[n].data) != bytes(tb[n].data)]
    assert "blk.1.ffn_up_exps.weight" in changed and "blk.0.attn_q.weight" in changed
    for t in tb.values():
        w = gguf.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name


@pytest.mark.slow
def test_expert_slices_of_any_size_give_the_same_codes(k256_specs, calibration_text, tmp_path, monkeypatch):
    """--gpu-memory's piece of the Hessian rounding (runtime/memory_budget.STAGES["gguf_rounding"]): a stack rounded
    2 experts a call and 16 a call (k256's 16 experts at once) has the same bytes."""
    import mixq.measurement.hessians as gh
    from mixq.runtime.calibration import calibration_rows, load_tokenizer

    ck, specs, types = k256_specs
    spec = next(s for s in specs if s.name == "blk.1.ffn_up_exps.weight")
    ids = calibration_rows(load_tokenizer(ck.path), [calibration_text], rows=2, seq_len=32,
                           vocab_size=int(ck.text_config["vocab_size"]))
    walk = gh.layer_hessians(ck, ids)
    stage = next(s for s in walk if s.layer == spec.layer)
    dev = torch.device("cpu")
    for step in (2, 16):
        monkeypatch.setattr(gr, "expert_slice", lambda rows, n, d, step=step: step)
        assert gr._encode_spec(spec, "Q3_K", stage, lambda n: ck.get(n, dtype=None), None, tmp_path / f"{step}.npy",
                               dev, 1)
    walk.close()
    assert np.array_equal(np.load(tmp_path / "2.npy"), np.load(tmp_path / "16.npy"))
