"""Plan a model: every tensor's bits (EXL3) or ggml type (GGUF) and bytes, before anything is converted.

``plan_model(ckpt, fmt, ...)`` reads only names and shapes (a Checkpoint from ``open_checkpoint`` or a
shapes-only one from ``checkpoint_from_config``), takes storage policy from the architecture table
(``formats/glm5next``; GGUF tensor list from ``formats/gguf_names``), and hands the budget to
``quant/allocator`` (EXL3 and custom GGUF) or ``quant/gguf_mix`` (llama.cpp's named mixes).
The result is the pinned ``Plan`` contract of docs/INTERNALS.md; docs/planning.md explains the conventions.
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from mixq.errors import InputError, PlanError
from mixq.formats.atomic import write_json
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.checkpoint_check import validate_checkpoint
from mixq.formats.exl3_layout import shard_count
from mixq.formats.exl3_names import storage_dtype
from mixq.formats.glm5next import ROLES, gguf_policy
from mixq.quant import allocator as al
from mixq.quant import gguf_mix as gm


@dataclass
class PlannedTensor:
    name: str               # EXL3: HF tensor name; GGUF: GGUF tensor name
    role: str
    hf_names: list[str]     # the source tensors (several for stacked GGUF experts / fused EXL3 keys)
    shape: tuple[int, ...]
    bits: float | None      # EXL3 trellis K; None when stored unquantized
    type: str               # GGUF: ggml type name; EXL3: "trellis" or the storage dtype ("fp16", "fp32", "bf16")
    bytes: int


@dataclass
class Plan:
    format: str             # "exl3" | "gguf"
    total_bytes: int
    bpw: float
    tensors: list[PlannedTensor]
    roles: dict[str, dict]  # role -> {"tensors", "params", "bytes", "bpw"}
    ref_params: int | None = None  # parameters of the source checkpoint (every tensor; plan_model sets it)

    @property
    def params(self) -> int:
        return sum(_numel(t.shape) for t in self.tensors)

    @property
    def file_bpw(self) -> float:
        """mixq's one bits-per-weight figure: file bytes (total_bytes, headers included) x 8 / the source
        checkpoint's parameters (`ref_params`; the planned tensors' own count when unknown). `mixq convert` and
        `mixq eval` report the same figure of the written file."""
        p = self.ref_params or self.params
        return self.total_bytes * 8 / p if p else 0.0

    def to_dict(self) -> dict:
        """The JSON of ``mixq plan --json``, with ``file_bpw`` and ``params``."""
        tensors = []
        for t in self.tensors:
            d = {"name": t.name, "role": t.role}
            if self.format == "exl3":
                d["bits"] = t.bits
                d["storage"] = t.type
            else:
                d["type"] = t.type
            d.update(bytes=t.bytes, shape=list(t.shape), hf_names=list(t.hf_names))
            tensors.append(d)
        return {"format": self.format, "total_bytes": self.total_bytes, "bpw": round(self.bpw, 4),
                "file_bpw": round(self.file_bpw, 4), "params": self.params, "ref_params": self.ref_params,
                "tensors": tensors, "roles": self.roles}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        fmt = d["format"]
        tensors = [PlannedTensor(name=t["name"], role=t["role"], hf_names=list(t.get("hf_names") or [t["name"]]),
                                 shape=tuple(t.get("shape") or ()), bits=t.get("bits"),
                                 type=t.get("type") or t.get("storage") or ("trellis" if t.get("bits") else ""),
                                 bytes=int(t["bytes"])) for t in d["tensors"]]
        return cls(format=fmt, total_bytes=int(d["total_bytes"]), bpw=float(d["bpw"]), tensors=tensors,
                   roles=dict(d.get("roles") or {}), ref_params=d.get("ref_params"))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# --- overrides ---------------------------------------------------------------------------------------------
@dataclass
class Override:
    pattern: str
    value: str
    used: bool = False

    def matches(self, role: str, names: Iterable[str]) -> bool:
        """A role name, or a glob (fnmatch on the whole name) or regex (searched) on any of ``names``."""
        if self.pattern in ROLES:
            return role == self.pattern
        for n in names:
            if fnmatch.fnmatchcase(n, self.pattern):
                return True
            try:
                if re.search(self.pattern, n):
                    return True
            except re.error:
                pass
        return False


def parse_overrides(overrides: Iterable[str | tuple[str, str]]) -> list[Override]:
    out = []
    for o in overrides:
        if isinstance(o, str):
            if "=" not in o:
                raise InputError(f"--override {o!r}: expected PATTERN=BITS (EXL3) or PATTERN=TYPE (GGUF)")
            pat, val = o.rsplit("=", 1)
        else:
            pat, val = o
        if not pat.strip() or not val.strip():
            raise InputError(f"--override {o!r}: empty pattern or value")
        out.append(Override(pat.strip(), val.strip()))
    return out


def _first(ovs: Sequence[Override], role: str, names: Iterable[str]) -> Override | None:
    names = list(names)
    for o in ovs:  # first match wins, as llama-quantize's --tensor-type
        if o.matches(role, names):
            o.used = True
            return o
    return None


def _exl3_bits(o: Override) -> float:
    try:
        b = float(o.value)
    except ValueError:
        raise PlanError(f"--override {o.pattern}={o.value}: EXL3 takes bits, one of {al.EXL3_RATES} or 16") from None
    if b != 16 and b not in al.EXL3_RATES:
        raise PlanError(f"--override {o.pattern}={o.value}: EXL3 bits must be one of {al.EXL3_RATES} or 16")
    return b


def _check_unused(ovs: Sequence[Override]) -> None:
    for o in ovs:
        if not o.used:
            raise PlanError(f"--override {o.pattern}={o.value} matches no quantizable tensor")


# --- entry point -------------------------------------------------------------------------------------------
def plan_model(ckpt, fmt: str, *, bpw: float | None = None, size: int | str | None = None, qtype: str | None = None,
               overrides: Sequence[str | tuple[str, str]] = (), head_bits: float = 6, mtp_bits: float = 4,
               vision_bits: float | None = None, include_mtp: bool = True,
               measure: Mapping[str, Mapping[float, float]] | None = None, gguf_ladder: str = "k") -> Plan:
    """Plan every tensor of ``ckpt`` for ``fmt`` ("exl3" | "gguf").

    Targets (at most one): ``bpw`` (EXL3: exllamav3's ``bits`` convention; GGUF: bytes·8/elements of the
    budgeted tensors), ``size`` (bytes of the main model files, headers included; "108GB" / "100GiB" accepted),
    ``qtype`` (GGUF only: a llama-quantize mix name such as "Q4_K_M", reproduced exactly). None: role defaults.
    ``measure``: per-unit error curves {unit key: {bits: error}} for the sensitivity solver (EXL3; GGUF:
    convert/gguf_measure.plan_gguf_measured, which also budgets token_embd and output.weight).
    ``gguf_ladder``: custom GGUF candidate types, "k" (Q2_K..Q8_0, what mixq writes) or "iq" (adds IQ2_XXS..IQ4_XS).
    A path ``ckpt`` is opened and checked against its config (``validate_checkpoint``), as convert checks it."""
    if isinstance(ckpt, (str, Path)):
        ckpt = open_checkpoint(ckpt)
        validate_checkpoint(ckpt)  # a config that disagrees with the weights: refused, as convert refuses it
    fmt = fmt.lower()
    if sum(x is not None for x in (bpw, size, qtype)) > 1:
        raise InputError("give at most one of --bpw, --size, --type")
    size_b = al.parse_size(size) if size is not None else None
    ovs = parse_overrides(overrides)
    if fmt == "exl3":
        if qtype is not None:
            raise InputError(f"--type {qtype}: named mixes are GGUF only; use --bpw or --size for EXL3")
        plan = _plan_exl3(ckpt, bpw=bpw, size=size_b, overrides=ovs, head_bits=head_bits, mtp_bits=mtp_bits,
                          vision_bits=vision_bits, include_mtp=include_mtp, measure=measure)
    elif fmt == "gguf" and measure is not None:
        if qtype is not None or ovs or (bpw is None and size_b is None):
            raise InputError("--measure plans a GGUF to --bpw or --size (not with --type or --override)")
        from mixq.convert.gguf_measure import plan_gguf_measured

        plan = plan_gguf_measured(ckpt, measure, bpw=bpw, size=size_b, ladder=gguf_ladder, include_mtp=include_mtp,
                                  mtp_bits=mtp_bits)
    elif fmt == "gguf":
        plan = _plan_gguf(ckpt, bpw=bpw, size=size_b, qtype=qtype, overrides=ovs, head_bits=head_bits,
                          mtp_bits=mtp_bits, include_mtp=include_mtp, ladder=gguf_ladder)
    else:
        raise InputError(f"--format {fmt!r}: exl3 or gguf")
    from mixq.convert.plan_check import check_plan

    check_plan(ckpt, plan)  # what plan shows, convert can write (one check for both)
    plan.ref_params = getattr(ckpt, "params", None)  # file_bpw's denominator, the same in convert and eval
    return plan


def role_summary(tensors: Sequence[PlannedTensor]) -> dict[str, dict]:
    """role -> {"tensors", "params", "bytes", "bpw"} (bpw = bytes·8 / params of that role)."""
    roles: dict[str, dict] = {}
    for t in tensors:
        r = roles.setdefault(t.role, {"tensors": 0, "params": 0, "bytes": 0, "bpw": 0.0})
        r["tensors"] += 1
        r["params"] += _numel(t.shape)
        r["bytes"] += t.bytes
    for r in roles.values():
        r["bpw"] = round(r["bytes"] * 8 / r["params"], 4) if r["params"] else 0.0
    order = {k: i for i, k in enumerate(ROLES)}
    return dict(sorted(roles.items(), key=lambda kv: order.get(kv[0], 99)))


_NUM = re.compile(r"(?<=\.)\d+(?=\.)")


def collapse(name: str) -> str:
    """Layer and expert numbers -> ``*`` (one row per tensor pattern in ``mixq plan``'s table)."""
    return _NUM.sub("*", name)


def pattern_table(plan: Plan) -> list[dict]:
    """Rows per collapsed name: role, count, bits/type histogram, params, bytes (the per-tensor view of
    ``mixq plan``)."""
    rows: dict[str, dict] = {}
    for t in plan.tensors:
        k = collapse(t.name)
        r = rows.setdefault(k, {"pattern": k, "role": t.role, "count": 0, "levels": {}, "params": 0, "bytes": 0})
        r["count"] += 1
        lv = (f"{t.bits:g}" if t.bits is not None else t.type) if plan.format == "exl3" else t.type
        r["levels"][lv] = r["levels"].get(lv, 0) + 1
        r["params"] += _numel(t.shape)
        r["bytes"] += t.bytes
    return list(rows.values())


def format_plan(plan: Plan, *, per_tensor: bool = True) -> str:
    """The human view of ``mixq plan``: with ``per_tensor`` one row per tensor pattern (layer and expert numbers
    collapsed) and its bits/type mix, then always the per-role summary, the file size and the one bpw figure."""
    lines = []
    if per_tensor:
        lines.append(f"{'tensor (layers/experts collapsed)':<64} {'role':<14} {'n':>6} {'bits/type':<22} {'GB':>9}")
        for r in pattern_table(plan):
            lv = " ".join(f"{k}x{v}" if len(r["levels"]) > 1 else k for k, v in sorted(r["levels"].items()))
            lines.append(f"{r['pattern'][:64]:<64} {r['role']:<14} {r['count']:>6} {lv[:22]:<22} "
                         f"{r['bytes'] / 1e9:>9.4f}")
        lines.append("")
    lines.append(f"{'role':<14} {'tensors':>8} {'params':>16} {'bytes':>16} {'GB':>9} {'bits/param':>10}")
    for role, r in plan.roles.items():
        lines.append(f"{role:<14} {r['tensors']:>8} {r['params']:>16,} {r['bytes']:>16,} {r['bytes'] / 1e9:>9.3f} "
                     f"{r['bpw']:>10.3f}")
    lines.append(f"{'total':<14} {len(plan.tensors):>8} {plan.params:>16,} {plan.total_bytes:>16,} "
                 f"{plan.total_bytes / 1e9:>9.3f}")
    lines.append("")
    lines.extend(plan_totals(plan))
    return "\n".join(lines)


def plan_totals(plan: Plan) -> list[str]:
    """The closing lines of ``mixq plan``: file size, the one bpw figure and what ``--bpw`` counted."""
    conv = ("exllamav3's bits: the budgeted Linears" if plan.format == "exl3"
            else "bits per weight of the budgeted tensors")
    params = plan.ref_params or plan.params
    gb, gib = plan.total_bytes / 1e9, plan.total_bytes / 2**30
    return [f"{plan.format} file  {gb:.3f} GB ({gib:.3f} GiB), headers included",
            f"bpw        {plan.file_bpw:.3f} = file bytes x 8 / {params:,} model parameters "
            "(the figure convert and eval report)",
            f"--bpw      counts {plan.bpw:.3f} ({conv})"]


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan JSON under a temporary name, then rename."""
    write_json(path, plan.to_dict(), indent=1, newline=False)


def load_plan(path: str | Path) -> Plan:
    try:
        return Plan.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"{path}: not a mixq plan JSON ({e})") from None




# --- EXL3 ----------------------------------------------------------------------------------------------------
_STORAGE_LABEL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # the plan JSON's "storage" values


def _exl3_stored(ckpt, name: str, policy: str) -> tuple[str, int]:
    """(storage label, bytes) of an unquantized tensor, stored as formats/exl3_names stores it."""
    dt = storage_dtype(policy, ckpt.source_dtype(name), name)
    return _STORAGE_LABEL[dt], getattr(torch, dt).itemsize * _numel(ckpt.shape(name))


def _st_header(names_shapes: Iterable[tuple[str, int]], n_shards: int) -> int:
    """safetensors header estimate: 8-byte length + per tensor ``"name":{"dtype":"I16","shape":[..],
    "data_offsets":[a,b]},`` (measured ~69 bytes besides the name on the fixtures) (exl3-format.md §1.1)."""
    per = sum(len(n) + 53 + 8 * nd for n, nd in names_shapes)
    return per + n_shards * 10


def allocator_unit(info, name: str) -> str:
    """The allocator unit of a trellis tensor (the table's group: a layer's routed experts share one rate, a fused
    EXL3 Linear is one unit, anything else is its own)."""
    return info.exl3_group


def _plan_exl3(ckpt, *, bpw, size, overrides, head_bits, mtp_bits, vision_bits, include_mtp, measure) -> Plan:
    nl = ckpt.num_hidden_layers
    fixed: dict[str, tuple[float | None, str, int]] = {}  # name -> (bits, storage, bytes) of non-budgeted tensors
    members: dict[str, list[str]] = {}
    unit_info: dict[str, tuple[str, int | None, float | None]] = {}
    linears: dict[str, tuple[int, int]] = {}
    order = []
    for name in ckpt.names():
        info = ckpt.info(name)
        if info.mtp and not include_mtp:
            continue
        order.append(name)
        shape = tuple(ckpt.shape(name))
        ov = _first(overrides, info.role, [name]) if info.exl3 == "trellis" else None
        if info.exl3 != "trellis":
            dt, nb = _exl3_stored(ckpt, name, info.exl3)
            fixed[name] = (None, dt, nb)
            continue
        out_f, in_f = shape[0], _numel(shape[1:])
        linears[name] = (out_f, in_f)
        key = info.exl3_bits_key
        bits = _exl3_bits(ov) if ov else None
        if key != "bits" or bits == 16:
            if bits is None:
                bits = {"head_bits": head_bits, "mtp_bits": mtp_bits, "vision_bits": vision_bits}[key]
            if bits is None:  # vision tower kept at source precision
                dt, nb = _exl3_stored(ckpt, name, "native")
                fixed[name] = (None, dt, nb)
            elif bits >= 16:
                fixed[name] = (None, "fp16", 2 * al.exl3_padded_numel(out_f, in_f))
            else:
                if bits not in al.EXL3_RATES:
                    raise PlanError(f"{key.replace('_', '-')} {bits}: EXL3 bits must be one of {al.EXL3_RATES} or 16")
                fixed[name] = (bits, "trellis", al.exl3_linear_bytes(out_f, in_f, bits))
            continue
        g = allocator_unit(info, name) + (f"@{bits:g}" if bits is not None else "")
        members.setdefault(g, []).append(name)
        unit_info.setdefault(g, (info.role, info.layer, bits))
    _check_unused(overrides)
    units = []
    for g, names in members.items():
        role, layer, bits = unit_info[g]
        units.append(al.Unit(key=g, role=role, numel=sum(al.exl3_padded_numel(*linears[n]) for n in names),
                             fixed=bits, layer=layer, n_layers=nl, members=names))
    if measure is not None:
        _apply_measure(units, measure)
    overhead = {}
    for g, names in members.items():
        for j, n in enumerate(names):
            o, i = linears[n]
            fused = g.split("@")[0].endswith("qkv_proj")
            overhead[n] = 2 * al.pad128(o) + ((2 * al.pad128(i) + 4) if (j == 0 or not fused) else 0)
    # stored tensors for the header estimate: trellis/suh/svh/marker per quantized Linear, one per other tensor
    n_stored = [(n, 2) for n in linears for _ in range(4)] + [(n, 2) for n in fixed if n not in linears]
    fixed_bytes = sum(b for _, _, b in fixed.values()) + sum(overhead.values())
    if bpw is not None:
        levels = al.allocate(units, al.bpw_budget(units, bpw), what=f"--bpw {bpw}")
    elif size is not None:
        shards = shard_count(size)
        budget = (size - fixed_bytes - _st_header(n_stored, shards)) * 8
        if budget <= 0:
            raise PlanError(f"--size {size / 1e9:.3f} GB: the fixed-precision tensors alone take "
                            f"{fixed_bytes / 1e9:.3f} GB")
        levels = al.allocate(units, budget, what=f"--size {size / 1e9:.3f} GB")
    else:
        levels = {u.key: (u.fixed if u.fixed is not None else al.EXL3_ROLE_BITS.get(u.role, 4.0)) for u in units}
    tensors = []
    level_of = {n: levels[g] for g, names in members.items() for n in names}
    for name in order:
        info = ckpt.info(name)
        shape = tuple(ckpt.shape(name))
        if name in level_of:
            o, i = linears[name]
            b = level_of[name]
            tensors.append(PlannedTensor(name, info.role, [name], shape, b, "trellis",
                                         al.exl3_trellis_bytes(o, i, b) + overhead[name]))
        else:
            b, dt, nb = fixed[name]
            tensors.append(PlannedTensor(name, info.role, [name], shape, b, dt, nb))
    data = sum(t.bytes for t in tensors)
    shards = shard_count(data)
    total = data + _st_header(n_stored, shards)
    return Plan("exl3", total, al.achieved_bpw(units, levels), tensors, role_summary(tensors))


def _apply_measure(units: Sequence[al.Unit], measure: Mapping[str, Mapping[float, float]]) -> None:
    """Sensitivity mode: replace the role model by measured error curves {unit key: {bits: error}}."""
    missing = [u.key for u in units if u.fixed is None and u.key not in measure]
    if missing:
        raise PlanError(f"--measure: no error curve for {len(missing)} budgeted units, e.g. {missing[0]!r}")
    for u in units:
        if u.fixed is not None:
            continue
        curve = {float(b): float(e) for b, e in measure[u.key].items() if float(b) in al.EXL3_RATES}
        if len(curve) < 1:
            raise PlanError(f"--measure: the curve of {u.key!r} has no valid EXL3 bitrate")
        u.levels = tuple(sorted(curve))
        u.errors = tuple(curve[b] for b in u.levels)


# --- GGUF ----------------------------------------------------------------------------------------------------
BUDGET_ROLES = ("attn", "routed_expert", "shared_expert", "dense_mlp")  # the roles a GGUF --bpw/--size budget sets


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
            j = json.loads(tok.read_text())
            model = j.get("model", {})
            v = model.get("vocab") or {}
            toks = list(v) + [a.get("content", "") for a in j.get("added_tokens", [])]
            tb = sum(len(t.encode()) for t in toks) + 10 * max(0, vocab - len(toks))
            merges = model.get("merges") or []
            mb = sum(len((" ".join(m) if isinstance(m, list) else m).encode()) for m in merges)
            tcfg = Path(ckpt.path) / "tokenizer_config.json"
            if tcfg.is_file():
                tpl = len(str(json.loads(tcfg.read_text()).get("chat_template", "")).encode()) or tpl
    except (OSError, ValueError):
        tb = mb = None
    return gm.estimate_kv_bytes(n_layer_all, vocab, tb, mb, tpl)


def _plan_gguf(ckpt, *, bpw, size, qtype, overrides, head_bits, mtp_bits, include_mtp, ladder="k") -> Plan:
    from mixq.formats.gguf_names import gguf_tensors

    specs = gguf_tensors(ckpt, include_mtp=include_mtp)
    ctx = gguf_mix_context(ckpt, include_mtp)
    src = ["F32" if s.policy == "f32" else "BF16" for s in specs]
    quantizable = [s.policy in ("quant", "q8_floor") and gm.allows_quantization(s.name, s.shape, s.policy)
                   for s in specs]
    manual: dict[int, str] = {}
    for i, s in enumerate(specs):
        if quantizable[i]:
            o = _first(overrides, s.role, [s.name] + list(s.hf_names))
            if o:
                manual[i] = gm.ggml_type(o.value).name
    _check_unused(overrides)
    kv = gguf_metadata_bytes(ckpt, ctx.n_layer_all)
    in_budget = [quantizable[i] and not s.mtp and s.role not in ("lm_head", "embed") for i, s in enumerate(specs)]
    if qtype is not None:
        types = gm.mix_types([(s.name, s.shape, src[i]) for i, s in enumerate(specs)], qtype, ctx, manual=manual)
    else:
        types, units, unit_types = [""] * len(specs), [], {}
        role_bits = {r: gm.type_bpw(t) for r, t in gm.GGUF_ROLE_TYPES.items()}
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
                units.append(al.Unit(key=s.name, role=s.role, numel=_numel(s.shape),
                                     levels=tuple(gm.type_bpw(t) for t in lad),
                                     costs=tuple(8 * gm._pad(gm.tensor_nbytes(t, s.shape)) for t in lad),
                                     layer=s.layer, n_layers=ckpt.num_hidden_layers))
            else:
                types[i] = src[i]
            if types[i] and in_budget[i]:  # fixed members of the budget set (floor, overrides)
                units.append(al.Unit(key=s.name, role=s.role, numel=_numel(s.shape), levels=(0.0,),
                                     costs=(8 * gm._pad(gm.tensor_nbytes(types[i], s.shape)),), fixed=0.0))
        if bpw is not None or size is not None:
            if bpw is not None:
                budget = al.bpw_budget(units, bpw)
            else:
                outside = [(s.name, s.shape, types[i]) for i, s in enumerate(specs) if not in_budget[i]]
                fixed_bytes = sum(gm._pad(gm.tensor_nbytes(t, sh)) for _, sh, t in outside)
                header = gm._pad(24 + kv + sum(gm.tensor_info_bytes(s.name, len(s.shape)) for s in specs))
                budget = (size - fixed_bytes - header) * 8
                if budget <= 0:
                    raise PlanError(f"--size {size / 1e9:.3f} GB: the fixed-type tensors alone take "
                                    f"{(fixed_bytes + header) / 1e9:.3f} GB")
            what = f"--bpw {bpw}" if bpw is not None else f"--size {size / 1e9:.3f} GB"
            if ladder == "k":
                what += " with K-quants (Q2_K is the smallest; --gguf-ladder iq adds IQ2_XXS..IQ4_XS)"
            levels = al.allocate(units, budget, default_bits=role_bits, what=what)
        else:
            levels = {u.key: role_bits[u.role] if u.fixed is None else u.fixed for u in units}
        for i, s in enumerate(specs):
            if not types[i]:
                lv = levels[s.name]
                t = unit_types[s.name].get(lv) or gm.fallback(gm.GGUF_ROLE_TYPES[s.role], int(s.shape[-1]))
                types[i] = t
    tensors = [PlannedTensor(s.name, s.role, list(s.hf_names), tuple(s.shape), None, types[i],
                             gm.tensor_nbytes(types[i], s.shape)) for i, s in enumerate(specs)]
    total, _ = gm.gguf_file_bytes([(t.name, t.shape, t.type) for t in tensors], kv)
    bud = [t for i, t in enumerate(tensors) if in_budget[i] and gm.is_quantized_type(t.type)]
    num = sum(t.bytes * 8 for t in bud)
    den = sum(_numel(t.shape) for t in bud)
    return Plan("gguf", total, num / den if den else 0.0, tensors, role_summary(tensors))


# --- sensitivity proxy (--measure without a curves file) ---------------------------------------------------
def measure_proxy(ckpt, calibration: Sequence[str] | None = None, *, rows: int = 16, seq_len: int = 256,
                  device: str = "cpu") -> dict[str, dict[float, float]]:
    """Per-unit error curves {unit key: {bits: error}} for the EXL3 sensitivity solver, from one calibration pass.

    Proxy of the Hessian-weighted loss E[tr(ΔW·H·ΔWᵀ)]: after the random-Hadamard incoherence transform the
    trellis error is close to i.i.d. with variance D(K)·mean(W²), so the loss is D(K)·mean(W²)·out·tr(H) with
    tr(H) = Σx² / N over all N calibration tokens (the calibrator sends every token through every expert, so
    routing is not reflected) and D(K) = 2^(−2K), the rate–distortion slope the trellis tracks (quant/trellis). Not a
    per-rate trellis measurement: every unit's curve has the same shape, only its weight is measured. This is
    ``--measure proxy``; ``--measure`` alone measures with the trellis (``convert/measure.py``)."""
    from mixq.runtime.calibration import calibrate, calibration_rows, load_tokenizer

    tok = load_tokenizer(ckpt.path)
    ids = calibration_rows(tok, calibration, rows=rows, seq_len=seq_len)
    n_tokens = int(ids.numel())
    weight: dict[str, float] = {}
    for stage in calibrate(ckpt, ids, full=False, device=device):
        for name, acc in stage.stats.items():
            info = ckpt.info(name)
            if info.exl3 != "trellis" or info.exl3_bits_key != "bits":
                continue
            w = ckpt.get(name)
            tr_h = float(acc.sum_sq.sum()) / max(1, n_tokens)
            key = allocator_unit(info, name)
            weight[key] = weight.get(key, 0.0) + float(w.square().mean()) * w.shape[0] * tr_h
        stage.advance()
    return {k: {b: v * 2.0 ** (-2 * b) for b in al.EXL3_RATES} for k, v in weight.items()}
