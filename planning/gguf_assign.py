"""Every GGUF tensor's ggml type, as `mixq convert` writes it and `mixq plan` shows it, in llama-quantize's order:
the plan (or the pure float / Q8_0-style policy), then --output-tensor-type / --token-embedding-type, then the
--tensor-type rules (first match wins), each type asked for a row length it cannot hold taking its shape fallback
(said, never silent).
"""
from __future__ import annotations

from mixq.errors import InputError, PlanError
from mixq.formats.gguf_layout import FLOAT_TYPES
from mixq.planning.gguf_mix import DEFAULT_LADDER
from mixq.planning.gguf_rules import TypeRules, fallback_type
from mixq.planning.planner import plan_model
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS


def pure_types(specs, outtype: str) -> list[str]:
    """The policy for a float / Q8_0-style outtype: F32 pins stay F32, the rest takes `outtype`."""
    out = []
    for s in specs:
        if s.policy == "f32" or len(s.shape) == 1:
            out.append("F32")
        else:
            out.append(fallback_type(outtype, s.shape[-1]))
    return out


def planned_types(ckpt, specs, *, qtype, bpw, size, include_mtp, gguf_ladder=DEFAULT_LADDER, overrides=(),
                   head_bits=DEFAULT_HEAD_BITS, mtp_bits=DEFAULT_MTP_BITS, measure=None,
                   type_rules: TypeRules | None = None, imatrix_given: bool = False, pin=(),
                   pin_size=None) -> list[str]:
    plan = plan_model(ckpt, "gguf", qtype=qtype, bpw=bpw, size=size, include_mtp=include_mtp,
                      gguf_ladder=gguf_ladder, overrides=overrides, head_bits=head_bits, mtp_bits=mtp_bits,
                      measure=measure, type_rules=type_rules, imatrix_given=imatrix_given, pin=pin,
                      pin_size=pin_size)
    by = {t.name: t.type for t in plan.tensors}
    missing = [s.name for s in specs if s.name not in by]
    if missing:
        raise PlanError(f"plan lacks GGUF tensors {missing[:3]} ({len(missing)} in all)")
    return [by[s.name] for s in specs]


def assign_types(ckpt, specs, *, qtype=None, bpw=None, size=None, tensor_type=(), output_tensor_type=None,
                 token_embedding_type=None, include_mtp=True, gguf_ladder=DEFAULT_LADDER, overrides=(),
                 head_bits=DEFAULT_HEAD_BITS, mtp_bits=DEFAULT_MTP_BITS, measure=None,
                 imatrix_given: bool = False, pin=(), pin_size=None) -> list[str]:
    """Per-GGUF-tensor ggml types, llama-quantize order: (plan or pure policy) -> embed/output -> regex overrides
    (planning/gguf_rules.TypeRules, which `mixq plan` applies the same way).
    `measure`: measured curves {tensor: {bpw: error}} for a --bpw/--size plan (measurement/gguf_errors);
    `imatrix_given`: the conversion has an importance matrix (a named mix may choose otherwise with one);
    `pin`: groups a measured plan keeps at the role plan's types (planning/pin.py), that plan made at `pin_size`
    when given."""
    if sum(v is not None for v in (qtype, bpw, size)) != 1:
        raise InputError("give exactly one of --type, --bpw, --size")
    rules = TypeRules(tensor_type, output_tensor_type, token_embedding_type)
    if qtype is not None and qtype.upper() in FLOAT_TYPES:
        return rules.apply(specs, pure_types(specs, qtype.upper()))
    return planned_types(ckpt, specs, qtype=qtype, bpw=bpw, size=size, include_mtp=include_mtp,
                         gguf_ladder=gguf_ladder, overrides=overrides, head_bits=head_bits, mtp_bits=mtp_bits,
                         measure=measure, type_rules=rules, imatrix_given=imatrix_given, pin=pin,
                         pin_size=pin_size)
