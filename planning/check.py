"""The one check that a plan can be written: `mixq plan` and `mixq convert` both run it (from `plan_model`), so the
planner never shows a plan that the converter then refuses."""
from __future__ import annotations

from mixq.errors import PlanError
from mixq.planning.allocator import EXL3_RATES
from mixq.planning.gguf_mix import encodable_types, has_encoder

# EXL3 budget keys whose Linears may be stored unquantized (fp16) when planned at 16 bits
EXL3_UNQUANTIZED_KEYS = ("head_bits", "vision_bits")


def check_plan(ckpt, plan) -> None:
    """PlanError naming the first tensor the converter of `plan.format` could not write as planned.

    GGUF: every planned type has an encoder in mixq (`gguf_mix.has_encoder`). EXL3: a trellis Linear planned
    unquantized (16 bits) must be lm_head or in the vision tower; everything else needs a trellis rate."""
    if plan.format == "gguf":
        for t in plan.tensors:
            if not has_encoder(t.type):
                raise PlanError(f"{t.name}: planned as {t.type} (by an --override, or the fallback of its type for "
                                f"rows of {t.shape[-1]}), which mixq cannot write; use one of "
                                f"{', '.join(encodable_types())}")
        return
    if plan.format == "exl3":
        for t in plan.tensors:
            info = ckpt.info(t.hf_names[0] if t.hf_names else t.name)
            if info.exl3 != "trellis" or t.bits is not None:
                continue
            key = info.exl3_bits_key
            if key in EXL3_UNQUANTIZED_KEYS:
                continue
            how = "--mtp-bits 16" if key == "mtp_bits" else "an --override to 16 bits"
            raise PlanError(f"{t.name}: {how} leaves this {info.role} Linear unquantized, which EXL3 allows only "
                            f"for lm_head (--head-bits 16) and the vision tower; use trellis bits {EXL3_RATES}")
