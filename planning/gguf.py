"""The GGUF planner: llama-quantize's named mixes, or ladder types per tensor to a --bpw or --size target."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from mixq.errors import PlanError
from mixq.formats.glm5next import gguf_policy
from mixq.formats.gguf_names import gguf_tensors
from mixq.formats.model_files import read_json
from mixq.planning import allocator as al
from mixq.planning import gguf_mix as gm
from mixq.planning.gguf_rules import TypeRules
from mixq.planning.budget import budget_bits, target_label
from mixq.planning.overrides import check_unused, first_override
from mixq.planning.substitutions import Substitutions
from mixq.planning.types import Plan, PlannedTensor, numel, role_summary

BUDGET_ROLES = ("attn", "routed_expert", "shared_expert", "dense_mlp")  # the roles a GGUF --bpw/--size budget sets


@dataclass(frozen=True)
class SideBudgets:
    """Byte budgets for disjoint sets of tensors (llama.cpp's host RAM and GPU memory): ``side_of`` names the side
    of a GGUF tensor, ``budgets`` the bytes of tensor data each side may hold, ``labels`` how messages name each
    budget. The error is a sum over tensors and every tensor is on one side, so one allocation per side is the
    joint optimum under both constraints."""

    side_of: Callable[[str], str]
    budgets: Mapping[str, int]
    labels: Mapping[str, str]


def role_bits() -> dict[str, float]:
    """The bits of each budgeted role's default type: the centre of the role error model (allocator.role_errors)."""
    return {r: gm.type_bpw(t) for r, t in gm.GGUF_ROLE_TYPES.items()}


def predicted_error(plan: Plan) -> float:
    """The allocator's objective for a custom GGUF plan: Σ numel·4^(d_role − bpw) over the budgeted roles' tensors
    (allocator.role_errors at each tensor's planned type); lower is better."""
    d = role_bits()
    return sum(numel(t.shape) * 4.0 ** (d[t.role] - gm.type_bpw(t.type)) for t in plan.tensors
               if t.role in BUDGET_ROLES and gm.is_quantized_type(t.type))


def gguf_mix_context(ckpt, include_mtp: bool) -> gm.MixContext:
    """What llama.cpp's type-mix rules read of a model: layer and expert counts, GQA, the glm5-next policy."""
    tc = ckpt.text_config
    n_all = ckpt.num_hidden_layers + (len(ckpt.nextn_layers) if include_mtp else 0)
    first_kda = (ckpt.layer_types or ["linear_attention"])[0] == "linear_attention"
    n_gqa = 0 if first_kda else int(tc.get("num_attention_heads", 1))  # head_count_kv = 1 on DSA layers
    return gm.MixContext(n_layer_all=n_all, n_expert=int(tc.get("n_routed_experts", 0) or 0), n_gqa=n_gqa,
                         policy=gguf_policy)


def gguf_metadata_bytes(ckpt, n_layer_all: int) -> int:
    """GGUF metadata estimate, exact token/merge byte counts when tokenizer.json is present."""
    vocab = int(ckpt.text_config.get("vocab_size", 0) or 0)
    tb = mb = None
    tpl = 4096
    tok = Path(ckpt.path) / "tokenizer.json"
    try:
        if tok.is_file():
            j = read_json(tok, "tokenizer.json")
            model = j.get("model", {})
            v = model.get("vocab") or {}
            toks = list(v) + [a.get("content", "") for a in j.get("added_tokens", [])]
            tb = sum(len(t.encode()) for t in toks) + 10 * max(0, vocab - len(toks))
            merges = model.get("merges") or []
            mb = sum(len((" ".join(m) if isinstance(m, list) else m).encode()) for m in merges)
            tcfg = Path(ckpt.path) / "tokenizer_config.json"
            if tcfg.is_file():
                tpl = len(str(read_json(tcfg, "tokenizer_config.json").get("chat_template", "")).encode()) or tpl
    except (AttributeError, TypeError):  # valid JSON of another shape: no exact counts, the estimate stands
        tb = mb = None
    return gm.estimate_kv_bytes(n_layer_all, vocab, tb, mb, tpl)


def outside_bytes(specs: Sequence, types: Sequence[str], in_budget: Sequence[bool], kv: int) -> int:
    """Bytes of a GGUF outside its budget: the header and every tensor that is not budgeted, at its type."""
    fixed = sum(gm.stored_bytes(types[i], s.shape) for i, s in enumerate(specs) if not in_budget[i])
    return fixed + gm.header_bytes([(s.name, len(s.shape)) for s in specs], kv)


def plan_gguf(ckpt, *, bpw, size, qtype, overrides, head_bits, mtp_bits, include_mtp, ladder=gm.DEFAULT_LADDER,
              sides: SideBudgets | None = None, imatrix_given: bool = False,
              type_rules: TypeRules | None = None) -> Plan:
    """Every tensor of ``ckpt``'s GGUF: a llama-quantize mix (``qtype``) reproduced exactly, or ladder types per
    budgeted tensor to the target, the rest at their floor, override or source type; then ``type_rules``
    (--tensor-type, --output-tensor-type, --token-embedding-type), as convert applies them. ``sides`` (instead of
    a target): one byte budget per side of a split machine, each side's tensor data planned to its own budget.
    ``imatrix_given``: the conversion has an importance matrix (some mixes choose otherwise with one, as
    llama-quantize does)."""
    specs = gguf_tensors(ckpt, include_mtp=include_mtp)
    ctx = gguf_mix_context(ckpt, include_mtp)
    src = ["F32" if s.policy == "f32" else "BF16" for s in specs]
    quantizable = [s.policy in ("quant", "q8_floor") and gm.allows_quantization(s.name, s.shape, s.policy)
                   for s in specs]
    manual: dict[int, str] = {}
    asked_by: dict[int, str] = {}  # the --override that set manual[i], named when its type cannot be written
    for i, s in enumerate(specs):
        if quantizable[i]:
            o = first_override(overrides, s.role, [s.name] + list(s.hf_names))
            if o:
                manual[i] = gm.ggml_type(o.value).name
                asked_by[i] = f"--override {o.pattern}={o.value}"
    check_unused(overrides)
    kv = gguf_metadata_bytes(ckpt, ctx.n_layer_all)
    in_budget = [quantizable[i] and not s.mtp and s.role not in ("lm_head", "embed") for i, s in enumerate(specs)]
    if qtype is not None:
        default = gm.MIX_DEFAULT[gm.normalize_mix(qtype)]
        if not gm.has_encoder(default):
            raise PlanError(f"--type {qtype.upper()}: not implemented yet (mixq has no {default} encoder)")
        types = gm.mix_types([(s.name, s.shape, src[i]) for i, s in enumerate(specs)], qtype, ctx, manual=manual,
                             imatrix=imatrix_given)
    else:
        types, units, unit_types = [""] * len(specs), [], {}
        rbits = role_bits()
        for i, s in enumerate(specs):
            ne0 = int(s.shape[-1])
            if not quantizable[i] or (s.role == "embed" and i not in manual):
                types[i] = src[i]
            elif i in manual:
                types[i] = gm.fallback(manual[i], ne0) if gm.is_quantized_type(manual[i]) else manual[i]
            elif s.policy == "q8_floor":
                types[i] = gm.fallback("Q8_0", ne0)
            elif s.mtp:
                types[i] = gm.fallback(gm.bits_to_type(mtp_bits), ne0)
            elif s.role == "lm_head":
                t = gm.bits_to_type(head_bits)
                types[i] = gm.fallback(t, ne0) if gm.is_quantized_type(t) else t
            elif s.role in BUDGET_ROLES:
                lad = gm.ladder(ne0, kind=ladder)
                unit_types[s.name] = {gm.type_bpw(t): t for t in lad}
                units.append(al.Unit(key=s.name, role=s.role, numel=numel(s.shape),
                                     levels=tuple(gm.type_bpw(t) for t in lad),
                                     costs=tuple(8 * gm.stored_bytes(t, s.shape) for t in lad),
                                     layer=s.layer, n_layers=ckpt.num_hidden_layers))
            else:
                types[i] = src[i]
            if types[i] and in_budget[i]:  # fixed members of the budget set (floor, overrides)
                units.append(al.Unit(key=s.name, role=s.role, numel=numel(s.shape), levels=(0.0,),
                                     costs=(8 * gm.stored_bytes(types[i], s.shape),), fixed=0.0))
        if sides is not None:
            levels = allocate_sides(specs, types, in_budget, units, sides, rbits)
        elif bpw is not None or size is not None:
            outside = 0 if size is None else outside_bytes(specs, types, in_budget, kv)
            what = target_label(bpw, size)
            budget = budget_bits(units, bpw=bpw, size=size, outside_bytes=outside, what=what)
            if ladder == "k":
                what += " with K-quants (Q2_K is the smallest; --gguf-ladder iq adds IQ2_XXS..IQ4_XS)"
            levels = al.allocate(units, budget, default_bits=rbits, what=what)
        else:
            levels = {u.key: rbits[u.role] if u.fixed is None else u.fixed for u in units}
        for i, s in enumerate(specs):
            if not types[i]:
                lv = levels[s.name]
                t = unit_types[s.name].get(lv) or gm.fallback(gm.GGUF_ROLE_TYPES[s.role], int(s.shape[-1]))
                types[i] = t
    subs = Substitutions()
    for i, asked in manual.items():
        subs.note(specs[i].name, asked_by[i], asked, types[i], int(specs[i].shape[-1]))
    subs.warn()
    if type_rules:
        types = type_rules.apply(specs, types)
    return gguf_plan(specs, types, [in_budget[i] and gm.is_quantized_type(t) for i, t in enumerate(types)], kv)


def gguf_plan(specs: Sequence, types: Sequence[str], counted: Sequence[bool], kv: int) -> Plan:
    """The Plan of GGUF tensors `specs` at `types`: each tensor's bytes, the file's bytes with `kv` bytes of
    metadata, and the bits per weight of the `counted` tensors (the budgeted ones)."""
    tensors = [PlannedTensor(s.name, s.role, list(s.hf_names), tuple(s.shape), None, types[i],
                             gm.tensor_nbytes(types[i], s.shape)) for i, s in enumerate(specs)]
    total, _ = gm.gguf_file_bytes([(t.name, t.shape, t.type) for t in tensors], kv)
    bud = [t for i, t in enumerate(tensors) if counted[i]]
    num = sum(t.bytes * 8 for t in bud)
    den = sum(numel(t.shape) for t in bud)
    return Plan("gguf", total, num / den if den else 0.0, tensors, role_summary(tensors))


def allocate_sides(specs, types: Sequence[str], in_budget: Sequence[bool], units: Sequence[al.Unit],
                   sides: SideBudgets, rbits: Mapping[str, float]) -> dict[str, float]:
    """One allocation per side: its budget less the bytes of its tensors outside the budget (at their fixed
    types); a side whose fixed tensors alone overfill it is a PlanError naming the side."""
    levels: dict[str, float] = {}
    for side, cap in sides.budgets.items():
        fixed = sum(gm.tensor_nbytes(types[i], s.shape) for i, s in enumerate(specs)
                    if not in_budget[i] and sides.side_of(s.name) == side)
        mine = [u for u in units if sides.side_of(u.key) == side]
        what = sides.labels[side]
        if cap - fixed < 0 or (cap - fixed == 0 and mine):
            raise PlanError(f"{what}: the fixed-type tensors there alone take {fixed / 1e9:.3f} GB")
        levels.update(al.allocate(mine, (cap - fixed) * 8, default_bits=rbits,
                                  what=f"{what}, of which the fixed-type tensors take {fixed / 1e9:.3f} GB,"))
    return levels
