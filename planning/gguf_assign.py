"""Every GGUF tensor's ggml type, as `mixq convert` writes it and `mixq plan` shows it, in llama-quantize's order:
the plan (or the pure float / Q8_0-style policy), then --output-tensor-type / --token-embedding-type, then the
--tensor-type rules (first match wins), each type asked for a row length it cannot hold taking its shape fallback
(said, never silent).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from mixq.errors import InputError, PlanError
from mixq.formats.gguf_layout import FLOAT_TYPES
from mixq.formats.gguf_names import OUTPUT, TOKEN_EMBD
from mixq.planning import gguf_mix
from mixq.planning.planner import plan_model
from mixq.planning.substitutions import Substitutions
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS


def fallback_type(qtype: str, n: int) -> str:
    """The type llama-quantize really uses for a row length `n` (planning.gguf_mix.fallback, the planner's rule);
    a type with no listed fallback whose block does not divide `n` becomes F16, as llama-quantize's last resort."""
    try:
        return gguf_mix.fallback(qtype, n)
    except PlanError:
        return "F16"


def pure_types(specs, outtype: str) -> list[str]:
    """The policy for a float / Q8_0-style outtype: F32 pins stay F32, the rest takes `outtype`."""
    out = []
    for s in specs:
        if s.policy == "f32" or len(s.shape) == 1:
            out.append("F32")
        else:
            out.append(fallback_type(outtype, s.shape[-1]))
    return out


def planned_types(ckpt, specs, *, qtype, bpw, size, include_mtp, gguf_ladder="k", overrides=(),
                   head_bits=DEFAULT_HEAD_BITS, mtp_bits=DEFAULT_MTP_BITS, measure=None,
                   imatrix_given=False) -> list[str]:
    plan = plan_model(ckpt, "gguf", qtype=qtype, bpw=bpw, size=size, include_mtp=include_mtp,
                      gguf_ladder=gguf_ladder, overrides=overrides, head_bits=head_bits, mtp_bits=mtp_bits,
                      measure=measure, imatrix_given=imatrix_given)
    by = {t.name: t.type for t in plan.tensors}
    missing = [s.name for s in specs if s.name not in by]
    if missing:
        raise PlanError(f"plan lacks GGUF tensors {missing[:3]} ({len(missing)} in all)")
    return [by[s.name] for s in specs]


def assign_types(ckpt, specs, *, qtype=None, bpw=None, size=None, tensor_type=(), output_tensor_type=None,
                 token_embedding_type=None, include_mtp=True, gguf_ladder="k", overrides=(),
                 head_bits=DEFAULT_HEAD_BITS, mtp_bits=DEFAULT_MTP_BITS, measure=None,
                 imatrix_given=False) -> list[str]:
    """Per-GGUF-tensor ggml types, llama-quantize order: (plan or pure policy) -> embed/output -> regex overrides.
    `measure`: measured curves {tensor: {bpw: error}} for a --bpw/--size plan (measurement/gguf_errors);
    `imatrix_given`: the conversion has an importance matrix (a named mix may choose otherwise with one)."""
    if sum(v is not None for v in (qtype, bpw, size)) != 1:
        raise InputError("give exactly one of --type, --bpw, --size")
    if qtype is not None and qtype.upper() in FLOAT_TYPES:
        types = pure_types(specs, qtype.upper())
    else:
        types = planned_types(ckpt, specs, qtype=qtype, bpw=bpw, size=size, include_mtp=include_mtp,
                               gguf_ladder=gguf_ladder, overrides=overrides, head_bits=head_bits,
                               mtp_bits=mtp_bits, measure=measure, imatrix_given=imatrix_given)
    rx = []
    for item in tensor_type:
        if isinstance(item, str):
            if "=" not in item:
                raise InputError(f"--tensor-type {item!r}: expected REGEX=TYPE")
            item = tuple(item.rsplit("=", 1))
        pat, t = item
        try:
            rx.append((re.compile(pat), t.upper()))
        except re.error as e:
            raise InputError(f"--tensor-type {pat!r}: bad regex ({e})") from e
    names = {s.name for s in specs}
    for flag, value, name in (("--output-tensor-type", output_tensor_type, OUTPUT),
                              ("--token-embedding-type", token_embedding_type, TOKEN_EMBD)):
        if value and name not in names:
            raise InputError(f"{flag} {value}: this model's GGUF has no {name}")
    uses = [RuleUse(f"--tensor-type {r.pattern}={t}") for r, t in rx]
    subs = Substitutions()  # what a rule or flag asked and the shape fallback changed: said, not silent
    for i, s in enumerate(specs):
        hits = [k for k, (r, _) in enumerate(rx) if r.search(s.name)]
        if s.policy in ("f32", "keep") or len(s.shape) < 2:
            for k in hits:  # never quantized by llama-quantize (not quantizable / glm5-next exclusions)
                uses[k].unquantized = uses[k].unquantized or s.name
            continue
        want, by, first = None, None, None
        if s.name == OUTPUT and output_tensor_type:
            want, by = output_tensor_type.upper(), "--output-tensor-type"
        elif s.name == TOKEN_EMBD and token_embedding_type:
            want, by = token_embedding_type.upper(), "--token-embedding-type"
        elif hits:  # first match wins, as in llama-quantize
            first = hits[0]
            want, by = rx[first][1], uses[first].rule
            uses[first].decided = True
        for k in hits:
            if k != first:
                uses[k].shadowed = uses[k].shadowed or (s.name, by)
        if want:
            types[i] = fallback_type(want, s.shape[-1])
            asked_by = by if first is not None else f"{by} {want}"  # a rule names its type, a flag does not
            subs.note(s.name, asked_by, want, types[i], s.shape[-1])
    for u in uses:
        u.check()
    subs.warn()
    return types


@dataclass
class RuleUse:
    """What one --tensor-type rule met: a tensor it decided, a never-quantized tensor it matched, a tensor it
    matched that an earlier rule (or --output-tensor-type / --token-embedding-type) decided."""
    rule: str
    decided: bool = False
    unquantized: str | None = None
    shadowed: tuple[str, str] | None = None

    def check(self) -> None:
        """InputError when the rule changes no tensor's type: it would be silently without effect."""
        if self.decided:
            return
        if self.shadowed is not None:
            name, by = self.shadowed
            raise InputError(f"{self.rule} decides no tensor: {by} comes first for every tensor it matches "
                             f"(e.g. {name})")
        if self.unquantized is not None:
            raise InputError(f"{self.rule} matches only tensors that are never quantized (e.g. {self.unquantized}: "
                             "F32 pins and the glm5-next exclusions keep their type)")
        raise InputError(f"{self.rule} matches no tensor of this model (a regex searched in GGUF tensor names such "
                         "as blk.0.attn_q.weight, blk.1.ffn_down_exps.weight)")
