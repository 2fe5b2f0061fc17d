"""runtime/memory_budget.py: the pieces each stage takes from --gpu-memory, the refusal of a budget a stage's
smallest piece cannot meet, GLM-5.3-Flash's estimate from its config, and (slow) the estimate against the peak
resident set of a real calibration on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from mixq.errors import InputError
from mixq.formats.checkpoint import checkpoint_from_config, open_checkpoint
from mixq.runtime import memory_budget as mb
from mixq.runtime.kl_stats import ROW_CHUNK, token_quantities

CPU = torch.device("cpu")
GB = 10**9


def _budget(n: int) -> mb.MemoryBudget:
    return mb.MemoryBudget(CPU, int(n), True)


def test_a_piece_fits_the_budget_and_never_passes_the_default():
    b = _budget(1000)
    assert b.piece(100, 100, 16) == 9          # (1000 - 100) // 100
    assert b.piece(100, 10, 16) == 16          # room for 90: the default bounds it
    assert b.piece(5000, 100, 16) == 1         # nothing fits: the smallest piece (the refusal is check's)
    assert b.less(300).bytes == 700 and b.less(5000).bytes == 0


def test_a_large_budget_gives_every_stage_its_default_piece():
    big = _budget(2**50)
    assert mb.rounding_slice(big, 2048, 4096, 32) == 32
    assert mb.exl3_batch(big, 2048, 4096, True, 16) == 16
    assert mb.kl_rows(big, 154880, 4096, ROW_CHUNK) == ROW_CHUNK
    assert mb.encode_chunk(big, 1 << 26) == 1 << 26
    assert mb.rounding_slice(None, 2048, 4096, 32) == 32 and mb.exl3_batch(None, 1, 1, False, 7) == 7


def test_a_small_budget_cuts_the_pieces_to_what_fits():
    per = mb.rounding_expert_bytes(2048, 4096)
    assert mb.rounding_slice(_budget(3 * per + 1), 2048, 4096, 32) == 3
    per = mb.exl3_unit_bytes(2048, 4096)
    assert mb.exl3_batch(_budget(5 * per), 2048, 4096, True, 16) == 5
    assert mb.exl3_unit_bytes(2048, 4096, hessian=False) < per


def test_every_stage_has_its_fact():
    for name, fact in mb.STAGES.items():
        assert fact.name == name and fact.why
    assert not mb.STAGES["exl3_encode"].invariant and not mb.STAGES["gguf_tuning"].invariant
    assert mb.STAGES["gguf_rounding"].invariant and mb.STAGES["eval_logits"].invariant


@pytest.fixture(scope="module")
def glm_shapes(shared_glm_config):
    return mb.checkpoint_shapes(checkpoint_from_config(shared_glm_config))


@pytest.fixture(scope="module")
def shared_glm_config():
    from conftest import shared_path
    return shared_path("models", "glm-5.3-flash-shape", "config.json")


def test_glm53_moe_layer_from_its_config(glm_shapes):
    s = glm_shapes
    assert s.experts == 288 and s.hidden == 4096 and s.hc_mult == 4 and s.vocab == 154880
    # a MoE layer: 288 routed + 1 shared expert of 3 x 2048 x 4096, plus attention and router
    assert 289 * 3 * 2048 * 4096 < s.layer_params < 1.05 * 289 * 3 * 2048 * 4096
    assert set(s.expert_shapes) == {(2048, 4096), (4096, 2048)}


def test_a_budget_below_the_calibration_is_refused_naming_the_stage(glm_shapes):
    est = mb.exl3_estimate(mb.MemoryBudget(torch.device("cuda"), 4 * GB, True), glm_shapes, rows=64, seq_len=512,
                           batch_rows=4, default_batch=16)
    cal = est.stage("calibration")
    # the layer without its routed experts, its accumulators and one batch: beyond 4 GB
    assert cal.minimum > 4 * GB and cal.piece == 1
    with pytest.raises(InputError) as e:
        est.check()
    msg = str(e.value)
    assert msg.startswith("--gpu-memory 3.73 GiB: the calibration stage needs") and f"{cal.minimum:,} bytes" in msg
    assert "\n" not in msg


def test_a_24gb_card_streams_the_routed_experts_of_glm53(glm_shapes):
    """GLM-5.3-Flash's largest MoE layer (288 routed experts, 29 GB in float32) under 24 GB: every verb plans
    (the tuned GGUF excepted: its tuning holds a whole layer), the calibration and eval's forward with the
    experts in groups; the arithmetic of the piece."""
    b = mb.MemoryBudget(torch.device("cuda"), 24 * GB, True)
    per_expert = 3 * 2048 * 4096
    assert glm_shapes.expert_params == per_expert and glm_shapes.expert_inputs == (2048,)
    whole = mb.calibration_need(glm_shapes, 64, 512, 4)
    assert whole.piece == whole.default_piece == 288 and whole.need > 24 * GB  # refused before
    cal = mb.calibration_need(glm_shapes, 64, 512, 4, budget=b)
    assert cal.per_piece == 4 * per_expert + 4 * 2048 * 2048 and cal.fixed == whole.fixed
    assert cal.piece == (24 * GB - cal.fixed) // cal.per_piece < 288 and cal.need <= 24 * GB
    assert mb.expert_group(cal) == cal.piece and mb.expert_group(whole) is None
    assert mb.calibration_resident(cal) == cal.fixed and mb.calibration_resident(whole) == whole.need
    ests = [mb.exl3_estimate(b, glm_shapes, rows=64, seq_len=512, batch_rows=4, default_batch=16),
            mb.imatrix_estimate(b, glm_shapes, rows=64, seq_len=512),
            mb.gguf_estimate(b, glm_shapes, hessian=True, rows=64, seq_len=512, tune=False, tune_bytes_per_weight=40,
                             rounding_default=32, encode_default=1 << 26, largest_tensor=10**9),
            mb.eval_estimate(b, glm_shapes, ctx=4096, batch_windows=1, models=2, state_bytes=10**9,
                             kl_default=64)[0]]
    for est in ests:
        est.check()
        assert est.device_need <= 24 * GB and mb.expert_group(est.stages[0]) is not None
    assert ests[0].stage("exl3_encode").piece == 16  # the trellis stacks keep their default beside the rest
    tuned = mb.gguf_estimate(b, glm_shapes, hessian=True, rows=64, seq_len=512, tune=True, tune_bytes_per_weight=40,
                             rounding_default=32, encode_default=1 << 26, largest_tensor=10**9)
    with pytest.raises(InputError, match="the calibration stage needs .* for its whole"):
        tuned.check()


def test_the_trellis_stack_shrinks_to_what_is_left_beside_the_calibration(glm_shapes):
    cal = mb.calibration_need(glm_shapes, 64, 512, 4).need
    per = mb.exl3_unit_bytes(2048, 4096)
    est = mb.exl3_estimate(mb.MemoryBudget(torch.device("cuda"), cal + 4 * per, True), glm_shapes, rows=64,
                           seq_len=512, batch_rows=4, default_batch=16)
    enc = est.stage("exl3_encode")
    assert enc.piece == 4 and enc.default_piece == 16 and enc.need <= est.budget.bytes
    est.check()  # fits
    d = est.to_dict()
    assert d["device_bytes"] == enc.need and d["stages"][1]["invariant"] is False
    assert "GPU cuda needs ~" in est.line() and "(largest stage: exl3_encode)" in est.line()


def test_kl_rows_change_no_score():
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(37, 300, generator=g), -1)
    cand = ref + 0.1 * torch.randn(37, 300, generator=g)
    tgt = torch.randint(0, 300, (37,), generator=g)
    a, b = token_quantities(ref, cand, tgt), token_quantities(ref, cand, tgt, rows=3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_k256_shapes_from_its_checkpoint(k256_model):
    ck = open_checkpoint(k256_model)
    s = mb.checkpoint_shapes(ck)
    per_layer: dict[int, int] = {}
    for n in ck.names():
        info = ck.info(n)
        if info.layer is not None and not info.mtp:
            per_layer[info.layer] = per_layer.get(info.layer, 0) + int(torch.Size(ck.shape(n)).numel())
    assert s.layer_params == max(per_layer.values()) and s.experts == 16


_MEASURE = textwrap.dedent("""
    import json, sys, torch
    from mixq.conversion.gguf.imatrix import make_imatrix
    from mixq.eval.peak_memory import peak_rss_mib, reset_peaks
    model, cal, out, rows, seq = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    # the same path once on one short row: imports, tokenizer and tables are loaded before the measurement
    make_imatrix(model, out, [cal], rows=1, seq_len=8, progress=False, overwrite=True, device="cpu")
    rss = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    reset_peaks(torch.device("cpu"))
    d = make_imatrix(model, out, [cal], rows=rows, seq_len=seq, progress=False, overwrite=True, device="cpu")
    print(json.dumps({"growth_mib": peak_rss_mib() - rss, "estimate_mib": d["memory"]["host_bytes"] / 2**20}))
""")


@pytest.mark.slow
def test_estimate_against_the_measured_peak_of_a_cpu_calibration(k256_model, tmp_path):
    """The growth of the peak resident set between two calibrations (4 rows x 64 tokens, 8 x 256) is the estimate's
    growth within 30%: the difference cancels what the process holds either way (libraries, the tokenizer, mapped
    checkpoint pages); the larger run's own peak growth stays within its estimate plus 192 MiB of those."""
    from conftest import shared_path
    cal = shared_path("data", "calibration.txt")
    got = []
    for rows, seq in ((4, 64), (8, 256)):
        r = subprocess.run([sys.executable, "-c", _MEASURE, str(k256_model), str(cal), str(tmp_path / "x.gguf"),
                            str(rows), str(seq)], capture_output=True, text=True, check=True)
        got.append(json.loads(r.stdout.strip().splitlines()[-1]))
    measured = got[1]["growth_mib"] - got[0]["growth_mib"]
    estimated = got[1]["estimate_mib"] - got[0]["estimate_mib"]
    assert abs(measured - estimated) <= 0.3 * estimated, got
    assert got[1]["growth_mib"] <= got[1]["estimate_mib"] + 192, got
