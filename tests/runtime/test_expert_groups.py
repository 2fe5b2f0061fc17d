"""Routed experts streamed a group at a time (runtime/expert_groups.py): the same bytes as the whole layer, for the
forward that eval streams (each of transformers' experts implementations), the calibration's statistics and
streams (imatrix and full Hessians, and the statistics-only pass), and the verbs a budget now lets run."""
from __future__ import annotations


import pytest
import torch

from mixq.conversion.gguf.imatrix import make_imatrix
from mixq.formats.checkpoint import open_checkpoint
from mixq.runtime import expert_groups
from mixq.runtime import memory_budget as mb
from mixq.runtime.calibration import LayerCalibrator
from mixq.runtime.layer_stream import DecoderStream

CPU = torch.device("cpu")


def _ids(ck, rows: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, int(ck.text_config["vocab_size"]), (rows, seq), generator=torch.Generator().manual_seed(0))


def _forward(ck, ids, group, impl, calls):
    s = DecoderStream(ck.config, batch_rows=2)
    s.text_config._experts_implementation = impl  # the reference the groups reproduce
    s.groups = s._stream_experts(group)
    h = s.embed(ids, lambda n: ck.get(n, dtype=torch.float32))
    topk = None
    for i in range(s.num_layers):
        mod = s.materialize(i, lambda n: ck.get(n, dtype=None))
        experts = getattr(mod.mlp, "experts", None)
        if experts is not None and group is not None:
            assert s.text_config._experts_implementation == expert_groups.EXPERT_IMPLEMENTATION
            assert experts.gate_up_proj.device == CPU and experts.expert_groups.reference == impl
        topk = s.run_layer_inplace(mod, h, topk)
        s.release(i)
    return h


@pytest.mark.parametrize("impl", ["grouped_mm", pytest.param("eager", marks=pytest.mark.slow)])
def test_grouped_forward_is_the_whole_layer_bit_for_bit(mini_model, impl, monkeypatch):
    """mini (16 routed experts, top 4), every layer: groups of 2 and of 5 experts give the streams of the whole
    layer, under the default experts implementation (grouped_mm) and (slow) eager."""
    ck = open_checkpoint(mini_model)
    ids = _ids(ck, rows=1, seq=16)
    calls = []
    blocks = expert_groups.expert_blocks

    def counted(experts, *a, **kw):
        for b in blocks(experts, *a, **kw):
            calls.append(b[:2])
            yield b

    monkeypatch.setattr(expert_groups, "expert_blocks", counted)
    whole = _forward(ck, ids, None, impl, calls)
    assert calls == []  # the whole layer: transformers' own implementation, untouched
    for group in (2, 5):  # 8 groups, and 4 with a short last one
        got = _forward(ck, ids, group, impl, calls)
        assert torch.equal(got, whole), (impl, group, (got - whole).abs().max())
    assert (0, 2) in calls and (15, 16) in calls and (10, 15) in calls  # groups of 2 and of 5 ran


def test_batched_mm_is_not_streamed(mini_model):
    """batched_mm's one bmm over all pairs rounds a pair by the number of pairs: streaming it is refused."""
    from mixq.errors import InputError
    s = DecoderStream(open_checkpoint(mini_model).config)
    s.text_config._experts_implementation = "batched_mm"
    with pytest.raises(InputError, match="not 'batched_mm'"):
        s._stream_experts(2)


def test_reductions_sum_as_each_implementation_does():
    """The per-token sums of REDUCTIONS, on pair outputs with known terms: eager adds in ascending expert order,
    the slot implementations over the top-k slots."""
    idx = torch.tensor([[3, 1, 2]])
    pairs = torch.tensor([[1.0], [1e8], [-1e8]])  # slots: expert 3, 1, 2 (float32: 1 + 1e8 == 1e8)
    assert expert_groups.REDUCTIONS["eager"](pairs, idx).item() == 1.0  # experts 1, 2, 3: 1e8 - 1e8 + 1
    assert expert_groups.REDUCTIONS["grouped_mm"](pairs, idx).item() == 0.0  # slots: 1 + 1e8 - 1e8
    assert expert_groups.group_ranges(5, 2) == [(0, 2), (2, 4), (4, 5)]


def _calibrate(ck, ids, group, **kw):
    cal = LayerCalibrator(ck, ids, expert_group=group, **kw)
    out = []
    for st in cal.stages():
        stats = {n: a.state() for n, a in st.stats.items()}
        if st.layer is not None and kw.get("advance_with_weights"):
            # one source tensor handed back as it is: the advance's own pass forms the routed output
            name = next(n for n in ck.names() if n.startswith(cal.stream.layer_prefix(st.layer)))
            st.advance({name: ck.get(name, dtype=None)})
        out.append((st.layer, stats, None if cal.hidden is None else cal.hidden.clone()))
    return out


@pytest.mark.parametrize("kw", [dict(full=False), pytest.param(dict(full=True), marks=pytest.mark.slow),
                                dict(full=True, advance_with_weights=True)],
                         ids=["imatrix", "hessian", "stats-only"])
def test_grouped_calibration_gives_the_same_statistics_and_streams(mini_model, kw):
    """mini, every layer: groups of 3 routed experts give the whole layer's accumulators (Σx², Σxxᵀ, counts)
    and streams, in the pass that also forms the routed output and in the statistics-only pass."""
    ck = open_checkpoint(mini_model)
    ids = _ids(ck, rows=2, seq=16)
    whole, grouped = _calibrate(ck, ids, None, **kw), _calibrate(ck, ids, 3, **kw)
    assert len(whole) == len(grouped) == ck.num_hidden_layers + 1
    n_stats = 0
    for (la, sa, ha), (lb, sb, hb) in zip(whole, grouped):
        assert la == lb and sa.keys() == sb.keys()
        for n in sa:
            assert sa[n]["count"] == sb[n]["count"]
            assert all(torch.equal(sa[n][k], sb[n][k]) for k in sa[n] if k != "count"), n
            n_stats += 1
        assert torch.equal(ha, hb)
    assert n_stats > 3 * 48  # every routed expert's accumulators compared


@pytest.mark.slow
def test_a_budget_that_was_refused_now_streams_the_experts_with_the_same_imatrix(k256_model, tmp_path):
    """k256 on the CPU: a --gpu-memory below one whole MoE layer (which the calibration needed before) but above
    its rest and two routed experts runs the calibration two experts a group, and writes the default's bytes."""
    from conftest import shared_path
    cal = [shared_path("data", "calibration.txt")]
    shapes = mb.checkpoint_shapes(open_checkpoint(k256_model))
    budget = mb.MemoryBudget(CPU, 2**50, True)
    whole = mb.imatrix_estimate(budget, shapes, rows=2, seq_len=32).stage("calibration")
    small = whole.fixed + 2 * whole.per_piece + 1
    assert whole.piece == whole.default_piece == 16 and small < whole.need  # the whole layer does not fit
    ref = make_imatrix(k256_model, tmp_path / "ref.gguf", cal, rows=2, seq_len=32, device="cpu", progress=False)
    got = make_imatrix(k256_model, tmp_path / "small.gguf", cal, rows=2, seq_len=32, device="cpu", progress=False,
                       gpu_memory=small)
    stage = got["memory"]["stages"][0]
    assert stage["stage"] == "calibration" and stage["piece"] == 2 and stage["need"] <= small
    assert ref["memory"]["stages"][0]["piece"] == 16
    assert (tmp_path / "ref.gguf").read_bytes() == (tmp_path / "small.gguf").read_bytes()


@pytest.mark.slow
def test_eval_logits_are_the_same_with_streamed_experts(mini_model, mini_q8_gguf):
    """eval's streamed forward (eval/streamed.py) of mini's Q8_0 GGUF and of mini itself, three routed experts a
    group: the logits of the whole-layer forward, bit for bit. (On mini the logits stage alone needs more than a
    whole layer, so no --gpu-memory the CLI accepts would cut its forward: the group is given here.)"""
    from mixq.eval.streamed import StreamedModels
    from mixq.runtime.dequant import open_dequant

    ck = open_checkpoint(mini_model)
    ids = _ids(ck, rows=2, seq=16)

    def logits(group):
        models = StreamedModels(ck.config, ids, device=CPU, expert_group=group)
        n = int(ck.text_config["num_hidden_layers"])
        models.add("ref", open_dequant(mini_model, "hf", num_hidden_layers=n), "reference")
        models.add("q8", open_dequant(mini_q8_gguf, "gguf", num_hidden_layers=n))
        models.run(progress=False)
        out = []
        for m in models.models:
            with models.head(m):
                out += [models.scored_logits(m, w, 0) for w in range(ids.shape[0])]
        return out

    whole, grouped = logits(None), logits(3)
    assert len(whole) == 4 and all(torch.equal(a, b) for a, b in zip(whole, grouped))


@pytest.mark.gpu
def test_on_cuda_the_groups_give_the_same_bytes_with_less_device_memory(mini_model):
    """On a GPU (host and device apart): the streamed forward under each experts implementation and the
    calibration's statistics are the whole layer's bytes, and a layer's peak device memory is lower."""
    ck = open_checkpoint(mini_model)
    ids = _ids(ck, rows=2, seq=32)
    dev = torch.device("cuda")

    def forward(group, impl):
        s = DecoderStream(ck.config, device=dev, batch_rows=2)
        s.text_config._experts_implementation = impl
        s.groups = s._stream_experts(group)
        h = s.embed(ids, lambda n: ck.get(n, dtype=torch.float32), out_device=dev)
        topk, peaks = None, []
        for i in range(s.num_layers):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            mod = s.materialize(i, lambda n: ck.get(n, dtype=None))
            topk = s.run_layer_inplace(mod, h, topk)
            s.release(i)
            peaks.append(torch.cuda.max_memory_allocated(dev) - base)
        return h.cpu(), max(peaks)

    for impl in ("grouped_mm", "eager"):
        (whole, p_whole), (got, p_got) = forward(None, impl), forward(2, impl)
        assert torch.equal(got, whole), (impl, (got - whole).abs().max())
        assert p_got < p_whole, (impl, p_got, p_whole)
    for kw in (dict(full=False), dict(full=True)):
        a = _calibrate(ck, ids, None, device=dev, **kw)
        b = _calibrate(ck, ids, 3, device=dev, **kw)
        for (_, sa, ha), (_, sb, hb) in zip(a, b):
            assert sa.keys() == sb.keys() and torch.equal(ha, hb)
            for n in sa:
                assert all(torch.equal(sa[n][k], sb[n][k]) for k in sa[n] if k != "count"), n


def test_the_nextn_block_streams_its_experts_with_the_trunk(mini_model):
    """With the trunk's routed experts streamed, the NextN block's are too (kept on the host, a group at a time on
    the device): its calibration statistics are the whole block's, and `eval --mtp`'s drafts are the same."""
    from mixq.eval.mtp import draft_agreement
    from mixq.eval.streamed import StreamedModels
    from mixq.runtime.dequant import open_dequant

    ck = open_checkpoint(mini_model)
    ids = _ids(ck, rows=2, seq=16)
    layer = ck.nextn_layers[0]

    def nextn_stage(group):
        cal = LayerCalibrator(ck, ids, expert_group=group, nextn=True)
        st = [s for s in cal.stages()][-1]
        assert st.layer == layer
        return cal, st, {n: a.state() for n, a in st.stats.items()}

    (_, _, whole), (cal, st, grouped) = nextn_stage(None), nextn_stage(3)
    assert expert_groups.groups_of(st.module.mlp.experts) is cal.stream.groups is not None
    assert whole.keys() == grouped.keys() and len(whole) > 3 * 8
    for n in whole:
        assert all(torch.equal(whole[n][k], grouped[n][k]) for k in whole[n] if k != "count"), n

    def drafts(group):
        models = StreamedModels(ck.config, ids, device=CPU, expert_group=group)
        models.add("ref", open_dequant(mini_model, "hf", num_hidden_layers=ck.num_hidden_layers), "reference")
        models.run(progress=False)
        return draft_agreement(models, list(range(ids.shape[0])), 0, layer)

    assert drafts(3) == drafts(None)
