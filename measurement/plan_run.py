"""What ``mixq plan`` runs: open MODEL (or shapes from a config), resolve ``--measure`` to curves, then plan or fit."""
from __future__ import annotations

from typing import Sequence

from mixq.measurement.trellis import resolve_measure
from mixq.errors import InputError
from mixq.formats.checkpoint import Checkpoint, checkpoint_from_config, open_checkpoint
from mixq.planning.fit import FitResult, fit_plan
from mixq.planning.planner import plan_model
from mixq.planning.sizes import parse_size_option
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS, Plan


def run_plan(model: "str | Checkpoint | None", fmt: str, *, from_config: str | None = None, bpw: float | None = None,
             size: str | None = None, qtype: str | None = None, overrides: Sequence[str] = (),
             head_bits: float = DEFAULT_HEAD_BITS, mtp_bits: float = DEFAULT_MTP_BITS, vision_bits: float | None = None, include_mtp: bool = True,
             gguf_ladder: str = "k", measure: str | None = None, fit: str | None = None,
             context: str | int | None = None, cache: str | None = None, reserve: str | None = None,
             mmproj: bool = False, devices: str | None = None, n_seq: int = 1,
             calibration: Sequence[str] = (), measure_out: str | None = None, measure_sample: str = "auto",
             device: str | None = None) -> Plan | FitResult:
    """What ``mixq plan`` runs: open MODEL (or build shapes from --from-config), then plan or fit. MODEL may be a
    Checkpoint already opened (and checked against its config) by the caller."""
    if (model is None) == (from_config is None):
        raise InputError("give either MODEL or --from-config CONFIG.json")
    if size is not None:  # before the checkpoint is opened, as convert checks it
        parse_size_option("--size", size)
    if isinstance(model, Checkpoint):
        ckpt = model
    else:
        ckpt = open_checkpoint(model) if model is not None else checkpoint_from_config(from_config)
    curves = resolve_measure(ckpt, measure, fmt, calibration=calibration or None, measure_out=measure_out,
                             sample=measure_sample, device=device)
    kw = dict(overrides=tuple(overrides), head_bits=head_bits, mtp_bits=mtp_bits, vision_bits=vision_bits,
              include_mtp=include_mtp, measure=curves, gguf_ladder=gguf_ladder)
    if fit is not None:
        if context is None:
            raise InputError("--fit needs --context TOKENS")
        if bpw is not None or size is not None or qtype is not None:
            raise InputError("--fit plans to the memory left; do not combine it with --bpw, --size or --type")
        return fit_plan(ckpt, fmt, fit=fit, context=context, cache=cache, reserve=reserve, mmproj=mmproj,
                        devices=devices, n_seq=n_seq, **kw)
    if context is not None or cache is not None or devices is not None:
        raise InputError("--context/--cache/--devices only apply with --fit")
    return plan_model(ckpt, fmt, bpw=bpw, size=size, qtype=qtype, **kw)
