"""Calibration rows, Hessian accumulation, and the layer-by-layer glm5_next forward against transformers' model."""
from __future__ import annotations

import json

import pytest
import torch

from mixq.errors import InputError
from mixq.quant.hessian import HessianAccumulator
from thread_helpers import at_threads

def test_hessian_accumulator_sums_and_drops_nonfinite():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g)
    acc = HessianAccumulator(8)
    acc.add(x[:2])
    acc.add(x[2])
    bad = torch.randn(2, 8, generator=g)
    bad[1, 3] = float("nan")
    acc.add(bad)
    rows = torch.cat([x.reshape(-1, 8), bad[:1]])
    assert acc.count == 16 and acc.dropped == 1
    torch.testing.assert_close(acc.hessian(), rows.T @ rows / 16, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc.mean_sq(), rows.square().mean(0), rtol=1e-5, atol=1e-6)
    diag = HessianAccumulator(8, full=False)
    diag.add(rows)
    assert diag.hessian() is None and diag.xtx is None
    torch.testing.assert_close(diag.mean_sq(), acc.mean_sq())
    other = HessianAccumulator(8)
    other.add(rows)
    acc.merge(other)
    assert acc.count == 32
    torch.testing.assert_close(acc.hessian(), rows.T @ rows / 16, rtol=1e-5, atol=1e-6)
    assert HessianAccumulator(4).hessian() is None


def test_hessian_accumulator_sums_the_same_at_any_thread_count():
    """xᵀx of a narrow input over many rows: a BLAS product splits such a sum over its threads; the accumulator's
    sums are the same bytes at one thread and at two, and the caller's thread count comes back."""
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(3))

    def acc():
        a = HessianAccumulator(64)
        a.add(x)
        a.add(x[:1500])
        return a.xtx, torch.get_num_threads()

    (one, n1), (two, n2) = at_threads(1, acc), at_threads(2, acc)
    assert (n1, n2) == (1, 2) and torch.equal(one, two)
    ref = x.double().T @ x.double() + x[:1500].double().T @ x[:1500].double()
    torch.testing.assert_close(one.double(), ref, rtol=1e-5, atol=1e-3)


def test_calibration_statistics_do_not_follow_the_thread_count(mini_model):
    """Every stage's Σxᵀx (decoder layers, head, NextN) and the streams are the same bytes at one thread and at
    two, over batches of 1024 tokens: enough for the CPU BLAS to split sums over its threads."""
    from mixq.runtime.calibration import LayerCalibrator
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(mini_model)
    ids = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(4))

    def walk():
        cal = LayerCalibrator(ck, ids, batch_rows=8, nextn=True)
        out = {}
        for st in cal.stages():
            out.update({n: a.xtx.clone() for n, a in st.stats.items()})
            if st.layer is not None and cal.hidden is not None:
                out[f"hidden {st.layer}"] = cal.hidden.clone()
        return out

    one, two = at_threads(1, walk), at_threads(2, walk)
    assert one.keys() == two.keys() and any("nextn" in n or "layers.4." in n for n in one)
    assert [n for n in one if not torch.equal(one[n], two[n])] == []


class _Tok:
    """Byte-level stand-in tokenizer for the row-builder tests."""
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

    def __len__(self):
        return 256


def test_calibration_rows_txt_jsonl_and_defaults(tmp_path):
    from mixq.runtime.calibration import calibration_rows

    a = tmp_path / "a.txt"
    a.write_text("hello world " * 50)
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "json row text " * 20}) + "\n\n" + json.dumps("plain string " * 10) + "\n")
    ids = calibration_rows(_Tok(), [a, j], rows=8, seq_len=32)
    assert ids.shape == (8, 32) and ids.dtype == torch.long
    again = calibration_rows(_Tok(), [a, j], rows=8, seq_len=32)
    assert torch.equal(ids, again)  # deterministic
    text_rows = [r for r in ids if set(r.tolist()) <= set(b"hello world json row text plain string") | {0}]
    assert len(text_rows) == 7  # 15% of 8 -> one random row
    builtin = calibration_rows(_Tok(), None, rows=4, seq_len=64)
    assert builtin.shape == (4, 64)
    with pytest.raises(InputError, match="not found"):
        calibration_rows(_Tok(), [tmp_path / "missing.txt"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(InputError, match="line 1"):
        calibration_rows(_Tok(), [bad])
    pdf = tmp_path / "c.pdf"
    pdf.write_text("x")
    with pytest.raises(InputError, match="unsupported"):
        calibration_rows(_Tok(), [pdf])
    with pytest.raises(InputError, match="rows"):
        calibration_rows(_Tok(), [a], rows=0)


def test_layerwise_forward_matches_transformers_and_collects_stats(mini_model, calibration_text):
    """The streamed layer-by-layer forward reproduces the full model's final hidden state; statistics cover
    every Linear and every expert, with shared inputs sharing one accumulator."""
    import transformers

    from mixq.runtime.calibration import LayerCalibrator, calibration_rows, load_tokenizer
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(mini_model)
    ids = calibration_rows(load_tokenizer(mini_model), [calibration_text], rows=3, seq_len=48)
    cal = LayerCalibrator(ck, ids, batch_rows=2)
    stages = []
    for st in cal.stages():
        stages.append(st)
    assert [s.layer for s in stages] == [0, 1, 2, 3, None]
    tokens = 3 * 48
    p = "model.language_model.layers"
    s1 = stages[1].stats
    assert s1[f"{p}.1.self_attn.q_proj.weight"] is s1[f"{p}.1.self_attn.k_proj.weight"]
    assert s1[f"{p}.1.self_attn.q_proj.weight"] is not s1[f"{p}.1.self_attn.o_proj.weight"]
    gate0 = s1[f"{p}.1.mlp.experts.0.gate_proj.weight"]
    assert gate0 is s1[f"{p}.1.mlp.experts.15.up_proj.weight"] is s1[f"{p}.1.mlp.shared_experts.gate_proj.weight"]
    downs = [s1[f"{p}.1.mlp.experts.{e}.down_proj.weight"] for e in range(16)]
    assert len({id(d) for d in downs}) == 16
    # all tokens through all experts, each token counted once per accumulator
    assert all(d.count == tokens and d.dim == 64 for d in downs) and gate0.count == tokens
    s3 = stages[3].stats
    assert s3[f"{p}.3.self_attn.q_b_proj.weight"] is s3[f"{p}.3.self_attn.indexer.wq_b.weight"]
    assert s3[f"{p}.3.self_attn.kv_b_proj.weight"].dim == 32
    names = set().union(*(s.stats for s in stages))
    for n in ck.names():
        info = ck.info(n)
        if info.exl3 == "trellis" and not info.mtp and info.role != "vision":
            assert n in names, n

    model = transformers.Glm5NextForConditionalGeneration.from_pretrained(str(mini_model), dtype=torch.float32)
    with torch.no_grad():
        ref = model.model.language_model(input_ids=ids).last_hidden_state
    head = stages[-1].stats["lm_head.weight"]
    flat = ref.reshape(-1, ref.shape[-1]).double()
    torch.testing.assert_close(head.hessian().double(), flat.T @ flat / flat.shape[0], rtol=1e-4, atol=1e-5)


def test_advance_with_replaced_weights_changes_the_next_layer(mini_model):
    from mixq.runtime.calibration import LayerCalibrator
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(mini_model)
    ids = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(1))
    hs = []
    for zero in (False, True):
        cal = LayerCalibrator(ck, ids, batch_rows=1, full=False)
        it = cal.stages()
        st = next(it)
        name = "model.language_model.layers.0.mlp.down_proj.weight"
        assert st.stats[name].xtx is None and st.stats[name].count == 48
        st.advance({name: torch.zeros(ck.shape(name))} if zero else None)
        hs.append(cal.hidden.clone())
        st2 = next(it)
        hs.append(st2.stats["model.language_model.layers.1.mlp.experts.0.gate_proj.weight"].mean_sq())
    assert not torch.allclose(hs[0], hs[2])
    assert not torch.allclose(hs[1], hs[3])


def test_statistics_pass_without_routed_output_gives_the_same_hessians_and_streams(mini_model):
    """advance_with_weights (the EXL3 conversion): the statistics pass leaves the routed experts' output out; the
    Hessians are the very same sums, and layers advanced with their weights give the very same hidden streams."""
    from mixq.runtime.calibration import LayerCalibrator
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(mini_model)
    ids = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(2))
    full = LayerCalibrator(ck, ids, batch_rows=1)
    lean = LayerCalibrator(ck, ids, batch_rows=1, advance_with_weights=True)
    experts_seen = 0
    for a, b in zip(full.stages(), lean.stages()):
        assert a.layer == b.layer and a.stats.keys() == b.stats.keys()
        for n in a.stats:
            ha, hb = a.stats[n].hessian(), b.stats[n].hessian()
            assert a.stats[n].count == b.stats[n].count and torch.equal(ha, hb), n
        experts_seen += sum(".experts." in n for n in a.stats)
        if a.layer is None:
            break
        weights = {n: ck.get(n) for n in a.stats if n in set(ck.names())}
        a.advance(dict(weights))
        b.advance(dict(weights))
        assert torch.equal(full.hidden, lean.hidden)
    assert experts_seen > 0
    with pytest.raises(ValueError, match="advance each layer with its weights"):
        st = next(LayerCalibrator(ck, ids, batch_rows=1, advance_with_weights=True).stages())
        st.advance(None)
    with pytest.raises(ValueError, match="full=True"):
        LayerCalibrator(ck, ids, full=False, advance_with_weights=True)
