"""Streaming EXL3 conversion of a glm5_next checkpoint, in named steps: resolve the options -> validate the
checkpoint and OUT -> plan -> per stage (embedding, each decoder layer with its calibration Hessians, head,
NextN, vision) quantize + write a part -> finalize (compile the output directory) -> ConvertResult.

Each decoder layer is calibrated on the hidden states of the already quantized previous layers (the quantized
weights are handed back to the calibrator), as exllamav3 does. The NextN block is calibrated after the head on
what it sees in that model (the quantized trunk's final hidden state and the next token's embedding); the vision
tower is quantized without calibration. Only one layer's weights and Hessians are held at a time.

With several devices (`devices`, or under torchrun) every rank runs these steps: the routed experts' calibration
statistics and the stacked trellis calls are split over the ranks and their results shared
(conversion/exl3/ranks.py), rank 0 alone writes OUT; the output is the one-device output, byte for byte.
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mixq.errors import InputError, PlanError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.checkpoint_check import scan_finite, validate_checkpoint
from mixq.formats.exl3_names import Exl3Unit, exl3_layout, stage_order
from mixq.formats.exl3_writer import EXL3_VERSION, Exl3Writer, torch_dtype
from mixq.formats.glm5next import global_hf_name
from mixq.formats.model_files import check_model_dir, read_json
from mixq.planning.planner import plan_model
from mixq.planning.sizes import parse_size
from mixq.quant.device import resolve_device

from mixq.runtime import profile
from mixq.runtime.calibration import LayerCalibrator, calibration_rows, load_tokenizer
from mixq.runtime.distributed import RankContext, launch, needs_launch, rank_context
from mixq.runtime.memory_budget import (MemoryBudget, MemoryEstimate, announce, checkpoint_shapes, exl3_batch,
                                        calibration_resident, exl3_estimate, expert_group, resolve_budget, say)
from mixq.runtime.overlap import WriteBehind, host_stack
from mixq.conversion.exl3.drafter import convert_drafter
from mixq.conversion.exl3.ranks import encode_batches, scan_share, share_job, shared_state
from mixq.conversion.exl3.output import ConvertResult, achieved_bits, compile_exl3, quantize_batch, quantize_unit  # noqa: F401
from mixq.conversion.exl3.estimate import check_cpu_time, describe_seconds
from mixq.conversion.job import JOB_DIR, Job, file_digest, rss_peak_mib
from mixq.measurement.trellis import load_curves
from mixq.conversion.options import DEFAULT_EXL3_SHARD, Exl3Options, flag_of, options_for  # noqa: F401
from mixq.formats.outputs import check_distinct, check_free_space, check_output_dir, writing

DEFAULT_SHARD = DEFAULT_EXL3_SHARD


def parse_bytes(s: int | str) -> int:
    """'8GiB', '512MB', '108GB', '1000000' -> bytes, with `mixq plan`'s convention (GB = 10^9, GiB = 2^30), so a
    --size given to convert means the same bytes as the plan's."""
    return parse_size(s)


def _is_drafter(model) -> bool:
    cfg = Path(str(model)) / "config.json"
    try:
        check_model_dir(cfg.parent)  # a config.json that links out of MODEL is refused, not read
        return "DFlash2DraftModel" in (read_json(cfg, "config.json").get("architectures") or [])
    except (OSError, InputError, AttributeError, TypeError):  # the checkpoint reader names what is wrong
        return False


def unit_bits(units: list[Exl3Unit], plan) -> dict[str, float]:
    """Trellis bits of every trellis unit from the plan (a fused unit takes the highest of its sources).
    A head / vision unit planned at 16 bits (or unquantized) becomes an fp16 Linear."""
    by_hf = {}
    for t in plan.tensors:
        for n in t.hf_names or [t.name]:
            by_hf[n] = t.bits
        by_hf.setdefault(t.name, t.bits)
    out = {}
    for u in units:
        if u.kind != "trellis":
            continue
        bits = [by_hf.get(n) for n in u.hf_names]
        if all(b is None or b >= 16 for b in bits) and u.bits_key in ("head_bits", "vision_bits"):
            u.kind, u.dtype = "fp16_linear", "float16"  # --head-bits 16 / --vision-bits 16: stored fp16
            continue
        if any(b is None for b in bits):
            missing = u.hf_names[bits.index(None)]
            raise PlanError(f"the plan has no trellis bits for {missing} (EXL3 unit {u.key})")
        out[u.key] = float(max(bits))
    return out


MAX_BATCH = 16
# Weights + Hessians per stacked call. 2^29 (2 GiB in fp32) stacks MAX_BATCH routed experts of GLM-5.3-Flash
# (2048 x 4096 with a 4096 x 4096 Hessian) where 2^26 stacked two: LDLQ walks a unit 16 input rows at a time, so
# the stack is what fills the GPU on each strip (bench/speed/expert_batch.py). The Viterbi backpointers are chunked on
# their own; this bounds only the stacked inputs.
MAX_BATCH_ELEMS = 1 << 29


def batches(items: list[tuple[Exl3Unit, bool]], bits: dict[str, float],
            budget: MemoryBudget | None = None) -> list[list[int]]:
    """Group the indices of trellis units (with a flag: has a Hessian) into stacked calls: same shape, same
    rate, same Hessian presence, consecutive in stage order, at most MAX_BATCH per call, and no more than
    `budget` (--gpu-memory) holds: a smaller stack than the default encodes other codes (runtime/memory_budget
    STAGES["exl3_encode"])."""
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    for i, (u, has_h) in enumerate(items):
        key = (u.shape, bits[u.key], has_h)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(i)
    out = []
    for key in order:
        idx = groups[key]
        out_f, in_f = key[0]
        per = out_f * in_f + (in_f * in_f if key[2] else 0)
        step = max(1, min(MAX_BATCH, MAX_BATCH_ELEMS // max(per, 1)))
        step = exl3_batch(budget, out_f, in_f, key[2], step)
        out.extend(idx[i:i + step] for i in range(0, len(idx), step))
    return out


def _raw_tensors(u: Exl3Unit, w: torch.Tensor, fetch) -> dict[str, torch.Tensor]:
    if u.kind == "fp16_linear":
        d = {f"{u.key}.weight": w.to(torch.float16).contiguous()}
        if u.bias:
            d[f"{u.key}.bias"] = fetch(u.bias).to(torch.float16).contiguous()
        return d
    return {u.key: w.to(torch_dtype(u.dtype)).contiguous()}


def _bits(b: float | None) -> float | None:
    """A rate as the job fingerprint records it: 6 and 6.0 are one setting (the CLI gives floats)."""
    return None if b is None else float(b)


def _settings(ckpt, plan_bits: dict, *, calibration_files, rows, seq_len, codebook, device, shard_size,
              vision_bits, include_mtp, head_bits, mtp_bits) -> dict:
    files = sorted((p.name, p.stat().st_size) for p in Path(ckpt.path).glob("*.safetensors"))
    return {
        "mixq_exl3": 1, "model": str(Path(ckpt.path).resolve()), "source_files": files,
        "plan_bits": plan_bits, "calibration": [file_digest(f) for f in (calibration_files or [])],
        "rows": rows, "seq_len": seq_len, "codebook": codebook, "device": torch.device(device).type,
        "shard_size": shard_size, "vision_bits": _bits(vision_bits), "include_mtp": include_mtp,
        "head_bits": _bits(head_bits), "mtp_bits": _bits(mtp_bits),
    }


def convert_exl3(model, out, **options) -> ConvertResult:
    """Convert a glm5_next checkpoint (dir or hub id) or a DFlash2 drafter to an EXL3 directory `out`; keyword
    options as in `Exl3Options` (`measure`: error curves or the JSON `mixq plan --measure-out` wrote, for the
    sensitivity plan `mixq plan --measure FILE` prints). See `run_exl3`."""
    return run_exl3(model, out, options_for("exl3", **options))


def run_exl3(model, out, opts: Exl3Options) -> ConvertResult:
    """resolve -> validate -> plan -> per stage (quantize, write a part) -> finalize. Every check that can fail
    on the user's input runs before OUT is created; a failure later leaves a job that --resume continues."""
    t0 = time.time()
    if _is_drafter(model):
        return _convert_drafter(model, out, opts)
    if needs_launch(opts.devices):  # one worker process per device; rank 0's result comes back
        return launch(run_exl3, (model, out, opts), opts.devices)
    with rank_context(opts.devices, opts.device) as ranks:
        with profile.stage("open"):
            run = _resolve(model, out, opts, ranks)
            _validate(run)
        _memory(run)
        with profile.stage("plan"):
            _plan(run)
        if run.progress:  # after every check of the input: a refusal stays the one line on stderr
            say(run.estimate, "convert")
        out_existed = run.out.exists()
        with profile.stage("scan"):  # every weight read once for NaN/Inf (not on --resume)
            _start_job(run)
        try:
            with writing(run.out, hint="free some space and continue with --resume"):
                _run_stages(run)
                if not ranks.is_main:
                    return None  # a worker rank returns nothing
                with profile.stage("finalize"):
                    return _finalize(run, t0)
        except BaseException:
            if ranks.is_main and not opts.resume and not run.job.done:  # nothing to resume: leave nothing behind
                run.job.release()
                shutil.rmtree(run.job.dir, ignore_errors=True)
                if not out_existed and run.out.is_dir() and not any(run.out.iterdir()):
                    run.out.rmdir()
            raise
        finally:
            run.job.release()


@dataclass
class _Exl3Run:
    """The state one conversion's steps share."""
    opts: Exl3Options
    ckpt: object
    out: Path
    device: torch.device
    shard_bytes: int
    size: int | None
    measure: object
    plan: object = None
    units: list[Exl3Unit] = field(default_factory=list)
    bits: dict[str, float] = field(default_factory=dict)
    stages: list[str] = field(default_factory=list)
    by_stage: dict[str, list[Exl3Unit]] = field(default_factory=dict)
    job: Job | None = None
    writer: Exl3Writer | None = None
    fallbacks: list[str] = field(default_factory=list)
    resumed: int = 0
    ranks: RankContext = field(default_factory=RankContext)
    ids: torch.Tensor | None = None  # the calibration rows (token ids)
    budget: MemoryBudget | None = None  # --gpu-memory less the calibration's resident part: the trellis stacks'
    memory: dict | None = None          # the up-front estimate, as the result reports it
    estimate: MemoryEstimate | None = None

    @property
    def progress(self) -> bool:
        """Progress bars: rank 0 only."""
        return self.opts.progress and self.ranks.is_main


def _resolve(model, out, opts: Exl3Options, ranks: RankContext) -> _Exl3Run:
    """Open the checkpoint and turn every option into the value the steps use (device, byte counts, curves)."""
    ckpt = open_checkpoint(model)
    if ckpt.config.get("model_type") != "glm5_next":
        raise InputError(f"{ckpt.path}: model_type {ckpt.config.get('model_type')!r} is not glm5_next")
    profile.note_layers(ckpt.config)
    profile.note_device(ranks.device)
    if opts.bpw is None and opts.size is None:
        raise InputError("give a target: --bpw or --size")
    device = ranks.device
    for f in opts.calibration:
        if not Path(f).is_file():
            raise InputError(f"calibration file not found: {f}")
    measure = opts.measure
    if isinstance(measure, (str, Path)):
        measure = load_curves(measure)
    size = parse_bytes(opts.size) if opts.size is not None else None
    return _Exl3Run(opts, ckpt, Path(out), device, parse_bytes(opts.shard_size), size, measure, ranks=ranks)


def _validate(run: _Exl3Run) -> None:
    """The checkpoint matches its config; OUT can be written and replaces no input."""
    validate_checkpoint(run.ckpt)  # config vs weights, before anything is planned or written
    check_distinct({"OUT": run.out}, {"MODEL": Path(run.ckpt.path), "--measure": _path_or_none(run.opts.measure),
                                      **{f"--calibration {i + 1}": f for i, f in enumerate(run.opts.calibration)}})
    check_output_dir(run.out)
    Job.check_target(run.out, resume=run.opts.resume)  # before the plan and the weight scan, not after
    run.ids = _calibration_ids(run)  # a missing or broken tokenizer is refused before OUT is created


def _memory(run: _Exl3Run) -> None:
    """The device and host memory the conversion needs, said on stderr before any work; a --gpu-memory the
    calibration or one trellis unit cannot meet is refused here (runtime/memory_budget.py)."""
    o = run.opts
    budget = resolve_budget(o.gpu_memory, run.device)
    est = exl3_estimate(budget, checkpoint_shapes(run.ckpt), rows=o.rows, seq_len=o.seq_len,
                        batch_rows=o.batch_rows, default_batch=MAX_BATCH)
    run.memory = announce(est, "convert", show=False)
    run.estimate = est
    run.budget = budget.less(calibration_resident(est.stage("calibration"))) if budget.given else None


def _calibration_ids(run: _Exl3Run) -> torch.Tensor:
    """The calibration rows, tokenized with the checkpoint's own tokenizer."""
    o = run.opts
    return calibration_rows(load_tokenizer(run.ckpt.path), list(o.calibration) or None, rows=o.rows,
                            seq_len=o.seq_len, vocab_size=run.ckpt.shape(global_hf_name("embed"))[0])


def _plan(run: _Exl3Run) -> None:
    """Trellis bits of every unit (the plan `mixq plan` prints) and the stage order."""
    o = run.opts
    run.plan = plan_model(run.ckpt, "exl3", bpw=o.bpw, size=run.size, overrides=o.overrides, head_bits=o.head_bits,
                          mtp_bits=o.mtp_bits, vision_bits=o.vision_bits, include_mtp=o.include_mtp,
                          measure=run.measure, pin=o.pin)
    run.units = exl3_layout(run.ckpt, vision_bits=o.vision_bits, include_mtp=o.include_mtp)
    run.bits = unit_bits(run.units, run.plan)
    run.stages = stage_order(run.units)
    run.by_stage = {s: [] for s in run.stages}
    for u in run.units:
        run.by_stage[u.stage].append(u)
    # on a machine without a GPU: the time estimate up front; hours are refused unless the CPU was asked for
    est = check_cpu_time(run.plan, run.device,
                         explicit=o.device is not None or bool(getattr(o, "devices", None)))
    if est is not None and o.progress:
        tqdm.write(f"EXL3 on the CPU: about {describe_seconds(est)} of trellis encoding", file=sys.stderr)


def _start_job(run: _Exl3Run) -> None:
    """Check the weights and the free space, then open (or continue) the job inside OUT."""
    o = run.opts
    settings = _settings(run.ckpt, run.bits, calibration_files=o.calibration, rows=o.rows, seq_len=o.seq_len,
                         codebook=o.codebook, device=run.device, shard_size=run.shard_bytes,
                         vision_bits=o.vision_bits, include_mtp=o.include_mtp, head_bits=o.head_bits,
                         mtp_bits=o.mtp_bits)
    if not o.resume:  # the job lives inside OUT: read every weight once for NaN/Inf before OUT is created
        scan_finite(run.ckpt, scan_share(run.ranks, run.ckpt.names()), progress=run.progress)
        run.ranks.barrier()  # every rank's share is clean before rank 0 creates OUT
    if run.ranks.is_main:
        held = sum(f.stat().st_size for f in (run.out / JOB_DIR).rglob("*") if f.is_file()) if o.resume else 0
        check_free_space(run.out, 2 * run.plan.total_bytes - held, "the conversion (parts + shards)")
        run.job = Job.open(run.out, settings, resume=o.resume)
        run.writer = Exl3Writer(run.out, run.job.dir, shard_size=run.shard_bytes)
    run.job = share_job(run.ranks, run.job)
    run.resumed = len(run.job.done)
    run.fallbacks = list(run.job.extra.get("fallbacks", []))


def _run_stages(run: _Exl3Run) -> None:
    """Embedding, then the calibrated decoder layers, head and NextN block (resuming after the last finished one),
    then the uncalibrated vision tower; each stage's part is recorded in the job as it is written."""
    job = run.job
    bar = tqdm(total=len(run.stages), desc="exl3", unit="stage", disable=not run.progress, initial=run.resumed)
    if "embed" in run.by_stage and not job.is_done("embed"):
        job.record("embed", _write_stage(run, "embed", None)[0])
        bar.update(1)
    todo = [s for s in run.stages if s.startswith(("layer.", "mtp.")) or s == "head"]
    if any(not job.is_done(s) for s in todo):
        _run_calibrated(run, bar)
    for stage in run.stages:
        if not job.is_done(stage):  # vision: uncalibrated
            job.record(stage, _write_stage(run, stage, None)[0])
            bar.update(1)
    bar.close()


def _run_calibrated(run: _Exl3Run, bar) -> None:
    """Decoder layers (calibrated on the already quantized layers before them), the head and the NextN block."""
    o, ckpt, job = run.opts, run.ckpt, run.job
    state_stage, state = shared_state(run.ranks, job)
    start = int(state_stage.split(".")[1]) + 1 if state_stage else 0
    nextn = any(s.startswith("mtp.") for s in run.stages)
    cal = LayerCalibrator(ckpt, run.ids, device=run.device, batch_rows=o.batch_rows, start_layer=start, state=state,
                          ranks=run.ranks, advance_with_weights=True, nextn=nextn,
                          expert_group=None if run.estimate is None
                          else expert_group(run.estimate.stage("calibration")))
    n_layers = ckpt.num_hidden_layers
    with WriteBehind() as behind:  # a stage's part and job record are written while the next stage runs
        for st in profile.timed("calibrate", cal.stages(), lambda st: profile.walk_label(st.layer, n_layers)):
            trunk = st.layer is not None and st.layer < n_layers
            stage = f"layer.{st.layer}" if trunk else "head" if st.layer is None else f"mtp.{st.layer}"
            if job.is_done(stage):  # the head (or NextN) of a run killed after all layers
                continue
            written, replaced = _encode_stage(run, stage, st.stats)
            if trunk:
                # the layer again, on its quantized weights: the next layer's input
                with profile.stage("advance", profile.walk_label(st.layer, n_layers)):
                    st.advance(replaced)
            state = cal.state() if trunk else None  # new tensors each layer: never changed after
            behind.submit(lambda stage=stage, written=written, state=state, fallbacks=list(run.fallbacks):
                          _commit_stage(run, stage, written, state, fallbacks))
            bar.update(1)
            del st, written, replaced, state


def _profile_layer(run: _Exl3Run, stage: str) -> str:
    """An EXL3 stage's layer as the profile names it: "embed", "head", "vision", a decoder layer's index or
    "nextn"."""
    kind, _, index = stage.partition(".")  # "layer.{i}" and "mtp.{i}" (i counts on after the decoder layers)
    return profile.layer_label(int(index), run.ckpt.num_hidden_layers) if kind in ("layer", "mtp") else stage


def _commit_stage(run: _Exl3Run, stage: str, written, state: dict | None, fallbacks: list[str]) -> None:
    """Write a calibrated stage's part (rank 0) and record it in the job with the calibration state after it."""
    with profile.stage("write", _profile_layer(run, stage)):  # on the write-behind thread
        part = None if written is None else run.writer.write_part(stage, written)
        run.job.extra["fallbacks"] = fallbacks
        run.job.record(stage, part, state=state)


def _stage_hessians(run: _Exl3Run, stage_units: list[Exl3Unit], stats: dict | None):
    """The trellis units of a stage and their Hessians (None without calibration statistics; such units of a
    calibrated stage are recorded as fallbacks)."""
    trellis_units, hs = [], []
    h_cache: dict[int, torch.Tensor | None] = {}  # experts share accumulators: finalise each once
    for u in stage_units:
        if u.kind != "trellis":
            continue
        acc = None if stats is None else stats.get(u.hf_names[0])
        if acc is not None and id(acc) not in h_cache:
            h_cache[id(acc)] = acc.hessian()
        h = h_cache[id(acc)] if acc is not None else None
        if h is None and stats is not None:
            run.fallbacks.append(u.key)
        trellis_units.append(u)
        hs.append(h)
    return trellis_units, hs


def _write_stage(run: _Exl3Run, stage: str, stats: dict | None):
    """Quantize/copy the units of one stage and write its part; returns (PartInfo, {HF name: the stored weight as
    the model will see it (dequantized / fp16-rounded)})."""
    written, replaced = _encode_stage(run, stage, stats)
    with profile.stage("write", _profile_layer(run, stage)):
        return (None if written is None else run.writer.write_part(stage, written)), replaced


def _encode_stage(run: _Exl3Run, stage: str, stats: dict | None):
    """Quantize/copy the units of one stage; returns ([(unit key, {stored tensor: tensor})] in layout order to
    write as its part (None on ranks other than 0), {HF name: the stored weight as the model will see it
    (dequantized / fp16-rounded)})."""
    def fetch(n: str) -> torch.Tensor:
        return run.ckpt.get(n, dtype=torch.float32)

    seeds = {u.key: i for i, u in enumerate(run.units)}
    written: dict[str, dict] = {}
    replaced: dict[str, torch.Tensor] = {}
    stage_units = run.by_stage[stage]
    where = _profile_layer(run, stage)
    with profile.stage("hessians", where):
        trellis_units, hs = _stage_hessians(run, stage_units, stats)
    inner = tqdm(total=len(stage_units), desc=stage, leave=False, disable=not run.progress, unit="t")
    keep = stage.startswith("layer.")  # the next layer is calibrated on these weights: every rank needs them

    def prepare(g: list[int]) -> torch.Tensor:  # on a worker thread, while the batch before is encoded
        return host_stack([trellis_units[i].assemble(fetch) for i in g], run.device)

    def encode(g: list[int], ws: torch.Tensor):
        us = [trellis_units[i] for i in g]
        res = quantize_batch(us, ws, run.bits[us[0].key], [hs[i] for i in g],
                             seed=seeds[us[0].key], codebook=run.opts.codebook, device=run.device, dequantized=keep)
        inner.update(len(us))
        return res

    with profile.stage("encode", where):  # the trellis (and the copies of the raw tensors)
        groups = batches([(u, h is not None) for u, h in zip(trellis_units, hs)], run.bits, run.budget)
        costs = [sum(math.prod(trellis_units[i].padded) for i in g) for g in groups]
        for g, res in encode_batches(run.ranks, groups, costs, prepare, encode, keep_deq=keep):
            for u, (tensors, deq) in zip([trellis_units[i] for i in g], res):
                if u.bias:
                    b = torch.zeros(u.padded[1], dtype=torch.float16)
                    b[: u.shape[0]] = fetch(u.bias).half()
                    tensors[f"{u.key}.bias"] = b
                if deq is not None:
                    replaced.update(u.split_back(deq))
                written[u.key] = tensors
        for u in stage_units:
            if u.kind != "trellis" and (keep or run.ranks.is_main):
                tensors = _raw_tensors(u, u.assemble(fetch), fetch)
                replaced.update(u.split_back(next(iter(tensors.values())).float()))
                written[u.key] = tensors
                inner.update(1)
    inner.close()
    if not run.ranks.is_main:
        return None, replaced
    return [(u.key, written[u.key]) for u in stage_units], replaced  # layout order


def _finalize(run: _Exl3Run, t0: float) -> ConvertResult:
    """quantization_config, then compile the directory (config, index, shards, manifest) and drop the job."""
    units, bits, o = run.units, run.bits, run.opts
    achieved = achieved_bits(units, bits, "bits")
    head = achieved_bits(units, bits, "head_bits")
    qc = {"quant_method": "exl3", "version": EXL3_VERSION, "bits": achieved if achieved is not None else 0.0,
          "head_bits": (int(head) if head is not None and head == int(head) else head) if head else 16,
          "calibration": {"rows": o.rows, "cols": o.seq_len}, "out_scales": "auto", "codebook": o.codebook,
          "quantizer": "mixq"}
    if any(u.bits_key == "mtp_bits" for u in units):
        qc["mtp_bits"] = achieved_bits(units, bits, "mtp_bits")
    if any(u.bits_key == "vision_bits" and u.kind == "trellis" for u in units):
        qc["vision_bits"] = achieved_bits(units, bits, "vision_bits")
    man = compile_exl3(run.writer, units, bits, run.stages, run.ckpt.config, Path(run.ckpt.path), qc, run.job,
                       run.fallbacks)
    run.job.cleanup()
    return ConvertResult(out=str(run.out), bytes=man["total_bytes"], bits=qc["bits"], head_bits=qc["head_bits"],
                         seconds=time.time() - t0, peak_rss_mib=rss_peak_mib(), shards=sorted(man["shards"]),
                         tensors=len(man["tensors"]), quantized=sum(u.kind == "trellis" for u in units),
                         fallbacks=run.fallbacks, resumed_stages=run.resumed, ref_params=run.ckpt.params,
                         device=_device_name(run), memory=run.memory)


def _device_name(run: _Exl3Run) -> str:
    """The device type, with the rank count of a multi-device run ("cuda x2")."""
    t = run.device.type
    return t if run.ranks.world == 1 else f"{t} x{run.ranks.world}"


# options a DFlash2 drafter conversion uses (it is uncalibrated and takes one rate)
_DRAFTER_OPTIONS = ("bpw", "device", "shard_size", "resume", "codebook", "profile", "progress")


def _convert_drafter(model, out, opts: Exl3Options) -> ConvertResult:
    unused = [k for k in opts.given() if k not in _DRAFTER_OPTIONS]
    if unused:
        raise InputError(f"{flag_of(Exl3Options, unused[0])} does not apply to a DFlash2 drafter "
                         "(it is converted uncalibrated at one rate: --bpw, default 6)")
    check_distinct({"OUT": out}, {"MODEL": model})
    check_output_dir(out)
    Job.check_target(out, resume=opts.resume)
    resolve_device(opts.device)
    return convert_drafter(model, out, bits=opts.bpw or 6.0, device=opts.device, shard_size=opts.shard_size,
                           resume=opts.resume, codebook=opts.codebook, progress=opts.progress)


def _path_or_none(x) -> Path | None:
    return Path(x) if isinstance(x, (str, Path)) else None
