"""What ``mixq plan`` runs: open MODEL (or shapes from a config), resolve ``--measure`` to curves, then plan or fit."""
from __future__ import annotations

from mixq.errors import InputError
from mixq.formats.checkpoint import Checkpoint, checkpoint_from_config, open_checkpoint
from mixq.measurement.options import FIT_OFFLOAD, PlanOptions
from mixq.measurement.trellis import resolve_measure
from mixq.planning.fit import FitResult, fit_plan
from mixq.planning.offload import OffloadResult, offload_plan
from mixq.planning.planner import plan_model
from mixq.planning.types import Plan


def run_plan(model: "str | Checkpoint | None", options: PlanOptions,
             curves=None) -> Plan | FitResult | OffloadResult:
    """What ``mixq plan`` runs: open MODEL (or build shapes from --from-config), then plan or fit. MODEL may be a
    Checkpoint already opened (and checked against its config) by the caller; `curves`, when given, are the curves
    the caller measured (they stand for `options.measure`, and nothing is measured or saved here)."""
    o = options
    if (model is None) == (o.from_config is None):
        raise InputError("give either MODEL or --from-config CONFIG.json")
    if isinstance(model, Checkpoint):
        ckpt = model
    else:
        ckpt = open_checkpoint(model) if model is not None else checkpoint_from_config(o.from_config)
    measured = curves is not None
    curves = resolve_measure(ckpt, curves if measured else o.measure, o.fmt, calibration=o.calibration or None,
                             measure_out=None if measured else o.measure_out, sample=o.measure_sample,
                             device=o.device)
    kw = dict(overrides=o.overrides, head_bits=o.head_bits, mtp_bits=o.mtp_bits, vision_bits=o.vision_bits,
              include_mtp=o.include_mtp, measure=curves, gguf_ladder=o.gguf_ladder)
    if o.fit == FIT_OFFLOAD:
        return offload_plan(ckpt, gpu=o.gpu, cpu=o.cpu, context=o.context, cache=o.cache, reserve=o.reserve,
                            cpu_reserve=o.cpu_reserve, n_cpu_moe=o.n_cpu_moe, n_seq=o.n_seq, **kw)
    if o.fit is not None:
        return fit_plan(ckpt, o.fmt, fit=o.fit, context=o.context, cache=o.cache, reserve=o.reserve,
                        mmproj=o.mmproj, devices=o.devices or None, n_seq=o.n_seq, **kw)
    return plan_model(ckpt, o.fmt, bpw=o.bpw, size=o.size, qtype=o.qtype, imatrix_given=o.imatrix is not None,
                      type_rules=o.type_rules(), pin=o.pin, **kw)
