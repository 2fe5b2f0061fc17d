"""Streaming EXL3 conversion of a glm5_next checkpoint: plan → per stage (embedding, each decoder layer with its
calibration Hessians, head, NextN, vision) quantize + write a part → compile the output directory → summary.

Each decoder layer is calibrated on the hidden states of the already quantized previous layers (the quantized
weights are handed back to the calibrator), as exllamav3 does. The NextN block and the vision tower are
quantized without calibration. Only one layer's weights and Hessians are held at a time.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from mixq.errors import InputError, PlanError
from mixq.formats.exl3_names import Exl3Unit, exl3_layout, stage_order
from mixq.formats.exl3_writer import EXL3_VERSION, Exl3Writer, check_free_space
from mixq.quant.device import pick_device

from .exl3_output import ConvertResult, achieved_bits, compile_exl3, quantize_batch, quantize_unit  # noqa: F401
from .job import JOB_DIR, Job, file_digest, rss_peak_mib, sleep_hook

DEFAULT_ROWS = 64
DEFAULT_SEQ_LEN = 512
DEFAULT_SHARD = 8192 * 2**20


def parse_bytes(s: int | str) -> int:
    """'8GiB', '512MB', '108GB', '1000000' -> bytes, with `mixq plan`'s convention (GB = 10^9, GiB = 2^30), so a
    --size given to convert means the same bytes as the plan's."""
    from mixq.quant.allocator import parse_size

    return parse_size(s)


def _is_drafter(model) -> bool:
    import json

    cfg = Path(str(model)) / "config.json"
    try:
        return "DFlash2DraftModel" in (json.loads(cfg.read_text()).get("architectures") or [])
    except (OSError, ValueError):
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
MAX_BATCH_ELEMS = 1 << 26  # weights + Hessians per stacked call


def batches(items: list[tuple[Exl3Unit, bool]], bits: dict[str, float]) -> list[list[int]]:
    """Group the indices of trellis units (with a flag: has a Hessian) into stacked calls: same shape, same
    rate, same Hessian presence, consecutive in stage order, at most MAX_BATCH per call."""
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
        out.extend(idx[i:i + step] for i in range(0, len(idx), step))
    return out


def _raw_tensors(u: Exl3Unit, w: torch.Tensor, fetch) -> dict[str, torch.Tensor]:
    from mixq.formats.exl3_writer import torch_dtype

    if u.kind == "fp16_linear":
        d = {f"{u.key}.weight": w.to(torch.float16).contiguous()}
        if u.bias:
            d[f"{u.key}.bias"] = fetch(u.bias).to(torch.float16).contiguous()
        return d
    return {u.key: w.to(torch_dtype(u.dtype)).contiguous()}


def _settings(ckpt, plan_bits: dict, *, calibration_files, rows, seq_len, codebook, device, shard_size,
              vision_bits, include_mtp, head_bits, mtp_bits) -> dict:
    files = sorted((p.name, p.stat().st_size) for p in Path(ckpt.path).glob("*.safetensors"))
    return {
        "mixq_exl3": 1, "model": str(Path(ckpt.path).resolve()), "source_files": files,
        "plan_bits": plan_bits, "calibration": [file_digest(f) for f in (calibration_files or [])],
        "rows": rows, "seq_len": seq_len, "codebook": codebook, "device": torch.device(device).type,
        "shard_size": shard_size, "vision_bits": vision_bits, "include_mtp": include_mtp,
        "head_bits": head_bits, "mtp_bits": mtp_bits,
    }


def convert_exl3(model, out, *, bpw: float | None = None, size: int | str | None = None, overrides=(),
                 calibration=None, rows: int = DEFAULT_ROWS, seq_len: int = DEFAULT_SEQ_LEN,
                 device: str | None = None, shard_size: int | str = DEFAULT_SHARD, resume: bool = False,
                 head_bits: float = 6, mtp_bits: float = 4, vision_bits: float | None = None,
                 include_mtp: bool = True, codebook: str = "mul1", batch_rows: int = 4, measure=None,
                 progress: bool = True) -> ConvertResult:
    """Convert a glm5_next checkpoint (dir or hub id) to an EXL3 directory `out`. See the module docstring.

    ``measure``: error curves {unit: {bits: loss}} or the JSON file `mixq plan --measure-out` wrote; the plan is
    then the sensitivity plan (`plan_model(measure=...)`) that `mixq plan --measure FILE` prints."""
    from tqdm.auto import tqdm

    from mixq.convert.planning import plan_model
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.checkpoint_check import scan_finite, validate_checkpoint

    t0 = time.time()
    if _is_drafter(model):
        from .drafter import convert_drafter

        return convert_drafter(model, out, bits=bpw or 6.0, device=device, shard_size=shard_size, resume=resume,
                               codebook=codebook, progress=progress)
    ckpt = open_checkpoint(model)
    if ckpt.config.get("model_type") != "glm5_next":
        raise InputError(f"{ckpt.path}: model_type {ckpt.config.get('model_type')!r} is not glm5_next")
    validate_checkpoint(ckpt)  # config vs weights, before anything is planned or written
    if bpw is None and size is None:
        raise InputError("give a target: --bpw or --size")
    device = pick_device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda requested but CUDA is not available")
    shard_bytes = parse_bytes(shard_size)
    if isinstance(size, str):
        size = parse_bytes(size)
    for f in calibration or []:
        if not Path(f).is_file():
            raise InputError(f"calibration file not found: {f}")
    if isinstance(measure, (str, Path)):
        from mixq.convert.measure import load_curves

        measure = load_curves(measure)
    plan = plan_model(ckpt, "exl3", bpw=bpw, size=size, overrides=overrides, head_bits=head_bits,
                      mtp_bits=mtp_bits, vision_bits=vision_bits, include_mtp=include_mtp, measure=measure)
    units = exl3_layout(ckpt, vision_bits=vision_bits, include_mtp=include_mtp)
    bits = unit_bits(units, plan)
    settings = _settings(ckpt, bits, calibration_files=calibration, rows=rows, seq_len=seq_len,
                         codebook=codebook, device=device, shard_size=shard_bytes, vision_bits=vision_bits,
                         include_mtp=include_mtp, head_bits=head_bits, mtp_bits=mtp_bits)
    out = Path(out)
    if not resume:  # the job lives inside OUT: read every weight once for NaN/Inf before OUT is created
        scan_finite(ckpt, progress=progress)
    job = Job.open(out, settings, resume=resume)
    resumed = len(job.done)
    check_free_space(out, 2 * plan.total_bytes, "conversion (parts + shards)")
    writer = Exl3Writer(out, job.dir, shard_size=shard_bytes)
    stages = stage_order(units)
    by_stage: dict[str, list[Exl3Unit]] = {s: [] for s in stages}
    for u in units:
        by_stage[u.stage].append(u)
    seeds = {u.key: i for i, u in enumerate(units)}
    fallbacks: list[str] = list(job.extra.get("fallbacks", []))

    def fetch(n: str) -> torch.Tensor:
        return ckpt.get(n, dtype=torch.float32)

    bar = tqdm(total=len(stages), desc="exl3", unit="stage", disable=not progress, initial=resumed)

    def run_stage(stage: str, stats: dict | None):
        """Quantize/copy the units of one stage and write its part; returns (PartInfo, {HF name: the stored
        weight as the model will see it (dequantized / fp16-rounded)})."""
        written: dict[str, dict] = {}
        replaced: dict[str, torch.Tensor] = {}
        stage_units = by_stage[stage]
        trellis_units, hs = [], []
        h_cache: dict[int, torch.Tensor | None] = {}  # experts share accumulators: finalise each once
        for u in stage_units:
            if u.kind == "trellis":
                acc = None if stats is None else stats.get(u.hf_names[0])
                if acc is not None and id(acc) not in h_cache:
                    h_cache[id(acc)] = acc.hessian()
                h = h_cache[id(acc)] if acc is not None else None
                if h is None and stats is not None:
                    fallbacks.append(u.key)
                trellis_units.append(u)
                hs.append(h)
        groups = batches([(u, h is not None) for u, h in zip(trellis_units, hs)], bits)
        inner = tqdm(total=len(stage_units), desc=stage, leave=False, disable=not progress, unit="t")
        for g in groups:
            us = [trellis_units[i] for i in g]
            res = quantize_batch(us, [u.assemble(fetch) for u in us], bits[us[0].key], [hs[i] for i in g],
                                 seed=seeds[us[0].key], codebook=codebook, device=device)
            for u, (tensors, deq) in zip(us, res):
                if u.bias:
                    b = torch.zeros(u.padded[1], dtype=torch.float16)
                    b[: u.shape[0]] = fetch(u.bias).half()
                    tensors[f"{u.key}.bias"] = b
                replaced.update(u.split_back(deq))
                written[u.key] = tensors
            inner.update(len(us))
        for u in stage_units:
            if u.kind != "trellis":
                tensors = _raw_tensors(u, u.assemble(fetch), fetch)
                replaced.update(u.split_back(next(iter(tensors.values())).float()))
                written[u.key] = tensors
                inner.update(1)
        inner.close()
        written = [(u.key, written[u.key]) for u in stage_units]  # parts keep the layout order
        part = writer.write_part(stage, written)
        return part, replaced

    # calibrated stages: decoder layers and the head, in order, resuming after the last finished one
    layer_stages = [s for s in stages if s.startswith("layer.")]
    todo_calibrated = [s for s in layer_stages + ["head"] if s in by_stage and not job.is_done(s)]
    for stage in ["embed"]:
        if stage in by_stage and not job.is_done(stage):
            part, _ = run_stage(stage, None)
            job.record(stage, part)
            bar.update(1)
            sleep_hook()
    if todo_calibrated:
        from .calibration import LayerCalibrator, calibration_rows, load_tokenizer

        state_stage, state = job.load_state()
        start = int(state_stage.split(".")[1]) + 1 if state_stage else 0
        ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows, seq_len=seq_len,
                               vocab_size=ckpt.shape("model.language_model.embed_tokens.weight")[0])
        cal = LayerCalibrator(ckpt, ids, device=device, batch_rows=batch_rows, start_layer=start, state=state)
        for st in cal.stages():
            stage = f"layer.{st.layer}" if st.layer is not None else "head"
            if job.is_done(stage):  # the head of a run killed after all layers but before the head
                continue
            part, replaced = run_stage(stage, st.stats)
            if st.layer is not None:
                st.advance(replaced)
            job.extra["fallbacks"] = fallbacks
            job.record(stage, part, state=cal.state() if st.layer is not None else None)
            bar.update(1)
            sleep_hook()
            del st
    for stage in stages:
        if not job.is_done(stage):  # NextN and vision: uncalibrated
            part, _ = run_stage(stage, None)
            job.record(stage, part)
            bar.update(1)
            sleep_hook()
    bar.close()

    # compile the directory
    achieved = achieved_bits(units, bits, "bits")
    head = achieved_bits(units, bits, "head_bits")
    qc = {"quant_method": "exl3", "version": EXL3_VERSION, "bits": achieved if achieved is not None else 0.0,
          "head_bits": (int(head) if head is not None and head == int(head) else head) if head else 16,
          "calibration": {"rows": rows, "cols": seq_len}, "out_scales": "auto", "codebook": codebook,
          "quantizer": "mixq"}
    if any(u.bits_key == "mtp_bits" for u in units):
        qc["mtp_bits"] = achieved_bits(units, bits, "mtp_bits")
    if any(u.bits_key == "vision_bits" and u.kind == "trellis" for u in units):
        qc["vision_bits"] = achieved_bits(units, bits, "vision_bits")
    man = compile_exl3(writer, units, bits, stages, ckpt.config, Path(ckpt.path), qc, job, fallbacks)
    job.cleanup()
    return ConvertResult(out=str(out), bytes=man["total_bytes"], bits=qc["bits"], head_bits=qc["head_bits"],
                         seconds=time.time() - t0, peak_rss_mib=rss_peak_mib(), shards=sorted(man["shards"]),
                         tensors=len(man["tensors"]), quantized=sum(u.kind == "trellis" for u in units),
                         fallbacks=fallbacks, resumed_stages=resumed, device=device.type)
