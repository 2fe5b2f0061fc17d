"""conversion/gguf/tuning.py: block-output tuning of the encoded codes on glm5next-k256 (real weights, a short
calibration): the quantized stream, the keep-the-best guard, the embedding with the first layer, the head."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mixq.conversion.gguf import tuning as gt
from mixq.quant.ggml.rounding import block_tuning as bt
from mixq.quant.ggml import encoders

PICK = {"token_embd.weight": "Q4_K", "blk.0.attn_q.weight": "Q2_K", "blk.0.ffn_down.weight": "Q3_K",
        "blk.0.ffn_up.weight": "Q4_K", "blk.0.attn_norm.weight": "F32", "output.weight": "Q6_K",
        "blk.0.ssm_f_a.weight": "F16"}


@pytest.fixture(scope="module")
def setup(k256_model, calibration_text):
    from mixq.runtime.calibration import calibration_rows, load_tokenizer
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import build_tensor, gguf_tensors

    ck = open_checkpoint(k256_model)
    specs = [s for s in gguf_tensors(ck) if s.name in PICK]
    types = [PICK[s.name] for s in specs]
    ids = calibration_rows(load_tokenizer(ck.path), [calibration_text], rows=8, seq_len=64,
                           vocab_size=int(ck.text_config["vocab_size"]))
    encoded = {s.name: encoders.quantize(build_tensor(s, ck.get).numpy(), t) for s, t in zip(specs, types)
               if t not in gt.FLOAT_TYPES}
    return ck, specs, types, ids, encoded


def test_layer_tuning_keeps_bytes_and_lowers_the_held_out_loss(setup):
    ck, specs, types, ids, encoded = setup
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=24, lr=0.5)
    assert len(tuner.fit) == 1 and len(tuner.check) == 1  # 8 rows in batches of 4: one fits, one checks
    layer0 = {n: b for n, b in encoded.items() if n.startswith("blk.0.") or n == "token_embd.weight"}
    out = tuner.layer(0, layer0)
    # the Linears of layer 0 at a scalar type and the embedding; F32/F16 tensors are not tuned
    assert set(out) == {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight"}
    for n, b in out.items():
        assert b.shape == layer0[n].shape and b.dtype == np.uint8, n
    (rep,) = tuner.reports
    assert rep.layer == 0 and rep.kept and rep.check_after < 0.99 * rep.check_before and rep.changed > 0.01
    assert any(not np.array_equal(out[n], layer0[n]) for n in out)
    # both streams advanced past layer 0, the quantized one close to the source one
    assert tuner.quant.shape == tuner.source.shape == (8, 64, tuner.stream.hc_mult, 256)
    rel = float((tuner.quant - tuner.source).norm() / tuner.source.norm())
    assert 0 < rel < 0.2
    head = tuner.head({"output.weight": encoded["output.weight"]})
    assert set(head) == {"output.weight"} and head["output.weight"].shape == encoded["output.weight"].shape
    rep = tuner.reports[-1]
    assert rep.layer is None and rep.kept and rep.check_after < rep.check_before


def test_zero_iterations_return_the_encoded_bytes(setup):
    ck, specs, types, ids, encoded = setup
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=0)
    layer0 = {n: b for n, b in encoded.items() if n.startswith("blk.0.") or n == "token_embd.weight"}
    out = tuner.layer(0, layer0)
    assert all(np.array_equal(out[n], layer0[n]) for n in out) and not tuner.reports


def test_a_stage_past_the_memory_budget_keeps_its_rounding(setup):
    """With room for no weight, every tensor keeps its encoded bytes and the stage is not tuned."""
    ck, specs, types, ids, encoded = setup
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=4, max_weights=0)
    layer0 = {n: b for n, b in encoded.items() if n.startswith("blk.0.") or n == "token_embd.weight"}
    assert tuner.layer(0, layer0) == {} and not tuner.reports
    tunable = {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight"}
    assert tuner.held == sum(int(np.prod(s.shape)) for s in specs if s.name in tunable)
    assert gt.tuning_budget(torch.device("cpu")) > 10 ** 6


def test_stored_values_are_what_the_file_holds(setup):
    """Tensors the tuner does not move enter the quantized stream as the file holds them."""
    from gguf import GGMLQuantizationType, quants

    ck, specs, *_ = setup
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gt.stored_values("F16", w, None), w.half().float())
    assert torch.equal(gt.stored_values("F32", w, None), w)
    ref = quants.dequantize(encoders.quantize(w.numpy(), "Q4_K"), GGMLQuantizationType.Q4_K)
    assert np.array_equal(gt.stored_values("Q4_K", w, None).numpy(), ref)


def test_block_scales_are_learned_only_for_the_32_weight_types(setup):
    """A Q5_0 tensor learns its fp16 block scales with its codes; a K-quant keeps every scale byte; the types and
    sizes stay."""
    ck, specs, types, ids, encoded = setup
    types = ["Q5_0" if s.name == "blk.0.ffn_up.weight" else t for s, t in zip(specs, types)]
    up = next(s for s in specs if s.name == "blk.0.ffn_up.weight")
    from mixq.formats.gguf_names import build_tensor

    layer0 = {n: b for n, b in encoded.items() if n.startswith("blk.0.")}
    layer0["blk.0.ffn_up.weight"] = encoders.quantize(build_tensor(up, ck.get).numpy(), "Q5_0")
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=24, lr=0.5, scale_lr=0.2)
    out = tuner.layer(0, layer0)
    q5 = out["blk.0.ffn_up.weight"].reshape(-1, 22)         # Q5_0: fp16 d, 4 bytes of fifth bits, 16 of nibbles
    d0, d1 = (b.reshape(-1, 22)[:, :2].copy().view("<f2")[:, 0].astype(np.float32)
              for b in (layer0["blk.0.ffn_up.weight"], out["blk.0.ffn_up.weight"]))
    assert q5.shape == layer0["blk.0.ffn_up.weight"].reshape(-1, 22).shape
    moved = np.abs(d1 / d0 - 1)
    reach = 0.2 * (24 + 1) / (2 * 24)  # the decaying steps of 24 iterations add up to scale_lr·(n+1)/2n
    assert 0 < float((moved > 0).mean()) and float(moved.max()) <= reach + 1e-3  # (+ fp16 rounding)
    q2 = out["blk.0.attn_q.weight"].reshape(-1, 84)           # Q2_K: 16 scale bytes, 64 code bytes, d, dmin
    src = layer0["blk.0.attn_q.weight"].reshape(-1, 84)
    assert np.array_equal(q2[:, :16], src[:, :16]) and np.array_equal(q2[:, 80:], src[:, 80:])
    assert tuner.reports[-1].kept and tuner.reports[-1].check_after < tuner.reports[-1].check_before


MOE = {"blk.1.attn_q.weight": "Q4_K", "blk.1.ffn_gate_exps.weight": "Q3_K", "blk.1.ffn_up_exps.weight": "Q3_K",
       "blk.1.ffn_down_exps.weight": "Q4_K", "blk.1.ffn_up_shexp.weight": "Q4_K"}


@pytest.fixture(scope="module")
def moe(setup):
    """The MOE tensors of layer 1: (specs, types, ggml blocks (a stack's (E, rows, bytes), as encoded), the
    routed-expert stacks' specs, weights per expert over those stacks)."""
    from mixq.formats.gguf_names import build_tensor, gguf_tensors

    ck = setup[0]
    specs = [s for s in gguf_tensors(ck) if s.name in MOE]
    types = [MOE[s.name] for s in specs]
    encoded = {s.name: (encoders.quantize_stacked if s.transform == "stack" else encoders.quantize)(
        build_tensor(s, ck.get).numpy(), t) for s, t in zip(specs, types)}
    stacks = [s for s in specs if s.transform == "stack"]
    return specs, types, encoded, stacks, sum(int(np.prod(s.shape[1:])) for s in stacks)


def test_experts_over_the_budget_are_tuned_in_groups(setup, moe):
    """With a budget that holds the layer's other tensors and a quarter of its 16 experts, the routed experts are
    still tuned: four stages of 4 experts after the other tensors' stage, the experts' stages lowering the layer's
    held-out loss further; the keep-the-best guard holds per stage (a stage that does not help leaves its experts
    at their rounding); the bytes' shapes kept; an expert alone over the budget keeps its rounding."""
    ck, _, _, ids, _ = setup
    specs, types, encoded, stacks, per_expert = moe
    others = sum(int(np.prod(s.shape)) for s in specs if s.transform != "stack")
    assert others < 4 * per_expert  # the budget below holds the rest, not one whole stack beside it
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=32, lr=0.5, max_weights=4 * per_expert, group_iters=32)
    tuner.layer(0, {})  # layer 0 has none of these tensors: both streams advance
    out = tuner.layer(1, encoded)
    assert set(out) == set(MOE) and tuner.held == 0
    for n, b in out.items():
        assert b.shape == encoded[n].shape and b.dtype == np.uint8, n
    stages = [r for r in tuner.reports if r.layer == 1]
    assert len(stages) == 1 + 4  # the other tensors, then 4 groups of 4 experts
    assert stages[0].kept and all(r.check_after <= r.check_before for r in stages)
    # one stage starts where the last ended: its start is that stage's best, not checked again
    assert all(a.check_before == b.check_after for a, b in zip(stages[1:], stages))
    assert stages[-1].check_after < 0.99 * stages[0].check_after  # the experts' stages lowered the loss further
    assert sum(r.kept for r in stages[1:]) >= 2
    for k, r in enumerate(stages[1:]):
        for s in stacks:  # a kept stage moved each of its experts; a reverted one left them as encoded
            moved = [not np.array_equal(out[s.name][e], encoded[s.name][e]) for e in range(4 * k, 4 * k + 4)]
            assert moved == [r.kept] * 4, (s.name, k)
    small = gt.LayerTuner(ck, ids, specs, types, iters=4, max_weights=per_expert - 1)
    small.layer(0, {})
    out = small.layer(1, encoded)
    assert all(s.name not in out for s in stacks) and small.held == sum(int(np.prod(s.shape)) for s in stacks)


def test_a_held_out_check_decodes_each_tensor_once(setup, moe, monkeypatch):
    """A held-out check runs several batches on the same codes: each tensor decodes once per check. The layer's
    first stage checks its start; each expert group starts where the stage before ended and checks only its marks."""
    ck, _, _, ids, _ = setup
    specs, types, encoded, stacks, per_expert = moe
    tuner = gt.LayerTuner(ck, ids.repeat(2, 1), specs, types, iters=4, batch_rows=1, max_weights=4 * per_expert,
                          group_iters=4)
    assert len(tuner.check) == 2  # 16 batches of one row: two check
    decodes: list[int] = []
    for cls in (bt.LevelCodes, bt.IQ2Codes):
        monkeypatch.setattr(cls, "dequantized",
                            lambda self, real=cls.dequantized: decodes.append(id(self)) or real(self))
    real_descent, checks = bt.sign_descent, []

    def descent(params, loss, batches, iters, lr, *, score=None, **kw):
        def counted():
            n = len(decodes)
            out = score()
            checks.append(decodes[n:])
            return out
        return real_descent(params, loss, batches, iters, lr, score=counted, **kw)
    monkeypatch.setattr(bt, "sign_descent", descent)
    tuner.layer(0, {})
    tuner.layer(1, encoded)
    groups = len([r for r in tuner.reports if r.layer == 1]) - 1
    assert groups == 4
    assert len(checks) == 5 + gt.GROUP_CHECKS * groups
    assert all(c and len(c) == len(set(c)) for c in checks)


def test_an_expert_group_no_token_reaches_in_a_batch_is_stepped_over(setup, moe):
    """Groups of one expert each: a batch that routes no token to the group has a loss with nothing to move (no
    gradient); the descent steps over that batch instead of failing, and every stack comes back whole."""
    ck, _, _, ids, _ = setup
    specs, types, encoded, stacks, per_expert = moe
    # 3 tokens a row: a batch of 4 rows routes 12 tokens, too few to reach every one of the 16 experts
    tuner = gt.LayerTuner(ck, ids[:, :3], specs, types, iters=4, max_weights=per_expert, group_iters=4)
    tuner.layer(0, {})
    unrouted = []
    real = gt.ExpertGroupMoE._fixed

    def fixed(self, hidden):
        out = real(self, hidden)
        if out[3].numel() == 0:
            unrouted.append((self.e0, self.batch))
        return out
    gt.ExpertGroupMoE._fixed = fixed
    try:
        out = tuner.layer(1, encoded)
    finally:
        gt.ExpertGroupMoE._fixed = real
    assert unrouted  # some one-expert group saw a batch with none of its tokens
    assert all(out[s.name].shape == encoded[s.name].shape for s in stacks)
    assert len([r for r in tuner.reports if r.layer == 1]) == 1 + stacks[0].shape[0]


def _counted_builds(tuner) -> list:
    """A list that gains an entry each time the tuner builds a layer of its own (its stream's materialise)."""
    built = []
    real = tuner.stream.materialize
    tuner.stream.materialize = lambda *a, **k: built.append(1) or real(*a, **k)
    return built


def test_a_lent_source_layer_gives_the_same_codes(setup, moe):
    """Tuning a layer on a lent copy of the source layer (the calibration's) gives the bytes and streams of the
    tuner's own copy; the tuner builds none of its own then, leaves the lent module where it was (not released)
    and has written the quantized values into it."""
    from mixq.runtime.layer_stream import DecoderStream

    ck, _, _, ids, _ = setup
    specs, types, encoded, stacks, per_expert = moe
    runs = []
    for lend in (False, True):
        tuner = gt.LayerTuner(ck, ids, specs, types, iters=4, max_weights=4 * per_expert, group_iters=4)
        tuner.layer(0, {})
        lent = DecoderStream(ck.config).materialize(1, lambda n: ck.get(n, dtype=torch.float32)) if lend else None
        source = None if lent is None else lent.mlp.experts.down_proj.detach().clone()
        built = _counted_builds(tuner)
        out = tuner.layer(1, encoded, lent)
        runs.append((out, tuner.quant.clone(), built))
        if lent is not None:
            assert lent.mlp.experts.down_proj.device.type == "cpu"  # still materialised: not released
            assert not torch.equal(lent.mlp.experts.down_proj, source)  # the quantized values written into it
    (own, q_own, built_own), (lent_out, q_lent, built_lent) = runs
    assert built_own == [1] and built_lent == []
    assert set(own) == set(lent_out) and all(np.array_equal(own[n], lent_out[n]) for n in own)
    assert torch.equal(q_own, q_lent)


def test_the_lent_layer_is_borrowed_whatever_the_device_spelling(setup, moe):
    """A tuner asked for "cpu:0" borrows a lent layer whose tensors report "cpu" (on a GPU: "cuda" against the
    tensors' "cuda:0"), instead of building a second copy of the layer."""
    from mixq.runtime.layer_stream import DecoderStream

    ck, _, _, ids, _ = setup
    specs, types, encoded, stacks, per_expert = moe
    tuner = gt.LayerTuner(ck, ids, specs, types, iters=2, max_weights=4 * per_expert, group_iters=2, device="cpu:0")
    tuner.layer(0, {})
    lent = DecoderStream(ck.config).materialize(1, lambda n: ck.get(n, dtype=torch.float32))
    built = _counted_builds(tuner)
    tuner.layer(1, encoded, lent)
    assert built == []


def test_same_device_reads_through_the_spelling(monkeypatch):
    from mixq.quant.device import same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device("cpu", torch.device("cpu:0")) and same_device("cuda", "cuda:1")
    assert not same_device("cuda", "cuda:0") and not same_device("cpu", "cuda:1")


def test_attention_cache_serves_each_batch_once():
    """Inside the cache a batch's attention output is computed once and then served as the very same tensors;
    leaving it restores the module's own forward."""
    calls = []

    class Attn(torch.nn.Module):
        def forward(self, x):
            calls.append(1)
            return x * 2

    attn = Attn()
    x, y = torch.ones(3), torch.full((3,), 5.0)
    with gt.AttentionCache(attn) as cache:
        cache.batch = (0, 4)
        a = attn(x)
        assert attn(x * 7) is a  # served again for the same batch
        cache.batch = (4, 8)
        assert torch.equal(attn(y), y * 2)
    assert len(calls) == 2 and "forward" not in vars(attn)
    assert torch.equal(attn(x * 7), x * 14) and len(calls) == 3


def test_expert_group_block_matches_the_whole_block(setup):
    """An expert-group stage's MoE block (the other experts' sum formed once, a step running the moving experts on
    their own slots) gives the layer's output and the moving weights' gradients of the whole block to float
    rounding, and runs no expert outside the group in a step."""
    from mixq.runtime.layer_stream import DecoderStream, layer_params, stacked_rows

    ck = setup[0]
    layer, (e0, e1) = 1, (4, 8)
    fetch = lambda n: ck.get(n, dtype=torch.float32)  # noqa: E731
    stream = DecoderStream(ck.config, batch_rows=2)
    g = torch.Generator().manual_seed(0)
    p = f"model.language_model.layers.{layer}.mlp.experts"
    moved = {f"{p}.{e}.{part}.weight": (fetch(f"{p}.{e}.{part}.weight") + 0.01 * torch.randn(
        ck.shape(f"{p}.{e}.{part}.weight"), generator=g)).requires_grad_(True)
        for e in range(e0, e1) for part in ("gate_proj", "up_proj", "down_proj")}
    hidden = torch.randn(2, 32, stream.hc_mult, int(ck.text_config["hidden_size"]), generator=g)
    target = torch.randn(hidden.shape, generator=g)

    whole = stream.materialize(layer, fetch).requires_grad_(False)
    out_whole, _ = stream.call_layer(whole, hidden, None, params=layer_params(whole, layer, moved, fetch))
    loss_whole = torch.nn.functional.mse_loss(out_whole, target)
    grads_whole = torch.autograd.grad(loss_whole, list(moved.values()))

    mod = DecoderStream(ck.config).materialize(layer, fetch).requires_grad_(False)
    seen = []
    experts_forward = type(mod.mlp.experts).forward

    def counted(self, x, index, weight):
        seen.append(int(self.num_experts))
        return experts_forward(self, x, index, weight)
    mod.mlp.experts.forward = counted.__get__(mod.mlp.experts)

    def weights():
        return tuple(stacked_rows(mod, layer, f"mlp.experts.{k}", range(e0, e1), moved, fetch)
                     for k in ("gate_up_proj", "down_proj"))
    with gt.ExpertGroupMoE(mod.mlp, e0, e1, weights) as moe:
        moe.batch = (0, 2)
        for _ in range(2):  # the second call serves the batch's fixed part formed by the first
            out, _ = stream.call_layer(mod, hidden, None)
            loss = torch.nn.functional.mse_loss(out, target)
            grads = torch.autograd.grad(loss, list(moved.values()))
    # all experts once (the routed sum), the 4 moving ones at their start (taken out of it), then per step
    assert seen == [16, 4, 4, 4]
    torch.testing.assert_close(out, out_whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, grads_whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
    assert "forward" not in vars(mod.mlp)


def test_routed_sums_follow_the_groups_as_they_end(setup):
    """The layer's routed sums, formed once per batch and shared by its expert groups: after one group ends at new
    weights (committed, then written into the block as the tuner writes them), the next group's block gives the
    whole block's output with both groups' new weights, on the batch both ran and on one only the second ran (its
    sum formed again from the block's weights); no expert outside a group runs again for a batch already formed."""
    from mixq.runtime.layer_stream import DecoderStream, layer_params, stacked_rows, write_values

    ck = setup[0]
    layer = 1
    fetch = lambda n: ck.get(n, dtype=torch.float32)  # noqa: E731
    stream = DecoderStream(ck.config, batch_rows=2)
    g = torch.Generator().manual_seed(1)
    p = f"model.language_model.layers.{layer}.mlp.experts"
    moved = {f"{p}.{e}.{part}.weight": fetch(f"{p}.{e}.{part}.weight") + 0.05 * torch.randn(
        ck.shape(f"{p}.{e}.{part}.weight"), generator=g) for e in range(16) for part in ("gate_proj", "up_proj",
                                                                                     "down_proj")}
    hidden = {b: torch.randn(2, 32, stream.hc_mult, int(ck.text_config["hidden_size"]), generator=g)
              for b in ((0, 2), (2, 4))}
    mod = DecoderStream(ck.config).materialize(layer, fetch).requires_grad_(False)
    seen = []
    experts_forward = type(mod.mlp.experts).forward
    mod.mlp.experts.forward = (lambda self, x, index, weight: seen.append(int(self.num_experts))
                               or experts_forward(self, x, index, weight)).__get__(mod.mlp.experts)
    sums = gt.RoutedSums(mod.mlp)
    mod_whole = None  # the block with the first group's new weights, made once that group is written
    for (e0, e1), batches in (((0, 8), [(0, 2)]), ((8, 16), [(0, 2), (2, 4)])):
        def weights(e0=e0, e1=e1):
            return tuple(stacked_rows(mod, layer, f"mlp.experts.{k}", range(e0, e1), moved, fetch)
                         for k in ("gate_up_proj", "down_proj"))
        with torch.no_grad(), gt.ExpertGroupMoE(mod.mlp, e0, e1, weights, sums) as moe:
            for b in batches:
                moe.batch = b
                out, _ = stream.call_layer(mod, hidden[b], None)
                if e0 == 8:  # the whole block with both groups' new weights
                    want, _ = stream.call_layer(mod_whole, hidden[b], None,
                                                params=layer_params(mod_whole, layer, moved, fetch))
                    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            moe.commit(*weights())
        group = {n: v for n, v in moved.items() if e0 <= int(n.split(".")[-3]) < e1}
        write_values(mod, layer, group, fetch)
        if e0 == 0:
            mod_whole = DecoderStream(ck.config).materialize(layer, fetch).requires_grad_(False)
            assert seen == [16, 8, 8, 8] and set(sums.batches) == {(0, 2)}  # formed, start, step, commit
    # the second group: its start out of the kept sum of (0, 2) and a step, then (2, 4) formed whole, its start and
    # a step, then its commit on each
    assert seen[4:] == [8, 8, 16, 8, 8, 8, 8]


@pytest.mark.parametrize("qtype", ["Q2_K", "Q4_K", "IQ2_S", "IQ4_XS", "Q5_0"])
def test_encoded_values_are_decoded_on_the_device_as_gguf_py_decodes_them(setup, monkeypatch, qtype):
    """Encoded tensors the tuner does not move are decoded by the torch decoder, a slice of rows at a time, to
    gguf-py's values bit for bit (on the CPU); the stacked shape is kept."""
    from gguf import GGMLQuantizationType, quants

    ck, *_ = setup
    w = ck.get("model.language_model.layers.0.mlp.down_proj.weight", dtype=torch.float32)[:24, :512]
    blocks = np.stack([encoders.quantize(w[i:i + 8].numpy(), qtype) for i in (0, 8, 16)])  # (3, 8, bytes)
    monkeypatch.setattr(gt, "DECODE_ROWS_WEIGHTS", 5 * 512)  # 5 rows a slice: slices cross the stacked dim
    got = gt.decoded_on_host(blocks, qtype, torch.device("cpu"))
    want = quants.dequantize(blocks, GGMLQuantizationType[qtype])
    assert got.shape == (3, 8, 512) and np.array_equal(got.numpy(), want)


def test_expert_groups_take_their_own_step_count(setup, moe):
    """An expert group's stage takes `group_iters` steps (default: iters / 8); 0 leaves the experts that do not fit
    the budget at their Hessian rounding, the other tensors still tuned."""
    from mixq.quant.ggml.rounding import block_tuning as bt

    ck, _, _, ids, _ = setup
    specs, types, encoded, stacks, per_expert = moe
    assert gt.LayerTuner(ck, ids, specs, types, iters=200).group_iters == 200 // gt.GROUP_ITERS_SHARE
    assert gt.LayerTuner(ck, ids, specs, types, iters=0).group_iters == 0
    steps = []
    descent = bt.sign_descent

    def counted(params, loss, batches, iters, lr, **kw):
        steps.append(iters)
        return descent(params, loss, batches, iters, lr, **kw)

    for group_iters in (3, 0):
        steps.clear()
        bt.sign_descent = counted
        try:
            tuner = gt.LayerTuner(ck, ids, specs, types, iters=8, max_weights=4 * per_expert, group_iters=group_iters)
            tuner.layer(0, {})
            out = tuner.layer(1, encoded)
        finally:
            bt.sign_descent = descent
        if group_iters:
            assert steps == [8, 3, 3, 3, 3]  # the layer's other tensors, then 4 groups of 4 experts
        else:
            assert steps == [8]
            assert all(s.name not in out for s in stacks)  # their Hessian-rounded blocks stand
