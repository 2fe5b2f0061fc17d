"""Plan a model: every tensor's bits (EXL3) or ggml type (GGUF) and bytes, before anything is converted.

``plan_model(ckpt, fmt, ...)`` reads only names and shapes (a Checkpoint from ``open_checkpoint`` or a
shapes-only one from ``checkpoint_from_config``), takes storage policy from the architecture table
(``formats/glm5next``; GGUF tensor list from ``formats/gguf_names``), and hands the budget to
``planning/allocator`` (EXL3 and custom GGUF) or ``planning/gguf_mix`` (llama.cpp's named mixes).
The result is the pinned ``Plan`` contract of docs/INTERNALS.md; docs/planning.md explains the conventions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from mixq.errors import InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.checkpoint_check import validate_checkpoint
from mixq.planning.sizes import parse_size
from mixq.planning.check import check_plan
from mixq.planning.exl3 import plan_exl3
from mixq.planning.gguf import SideBudgets, plan_gguf
from mixq.planning.gguf_mix import DEFAULT_LADDER
from mixq.planning.gguf_measured import plan_gguf_measured
from mixq.planning.gguf_rules import TypeRules
from mixq.planning.overrides import parse_overrides
from mixq.planning.pin import parse_pin, pinned_choices
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS, Plan


def plan_model(ckpt, fmt: str, *, bpw: float | None = None, size: int | str | None = None, qtype: str | None = None,
               overrides: Sequence[str | tuple[str, str]] = (), head_bits: float = DEFAULT_HEAD_BITS, mtp_bits: float = DEFAULT_MTP_BITS,
               vision_bits: float | None = None, include_mtp: bool = True,
               measure: Mapping[str, Mapping[float, float]] | None = None, gguf_ladder: str = DEFAULT_LADDER,
               sides: SideBudgets | None = None, imatrix_given: bool = False,
               type_rules: TypeRules | None = None, pin: Sequence[str] | str = (),
               pin_size: int | str | None = None) -> Plan:
    """Plan every tensor of ``ckpt`` for ``fmt`` ("exl3" | "gguf").

    Targets (at most one): ``bpw`` (EXL3: exllamav3's ``bits`` convention; GGUF: bytes·8/elements of the
    budgeted tensors), ``size`` (bytes of the main model files, headers included; "108GB" / "100GiB" accepted),
    ``qtype`` (GGUF only: a llama-quantize mix name such as "Q4_K_M", reproduced exactly). None: role defaults.
    ``measure``: per-unit error curves {unit key: {bits: error}} for the sensitivity solver (EXL3; GGUF:
    planning/gguf_measured.plan_gguf_measured, which also budgets token_embd and output.weight).
    ``gguf_ladder``: custom GGUF candidate types, "k" (Q2_K..Q8_0, what mixq writes) or "iq" (adds IQ2_XXS..IQ4_XS).
    ``sides``: GGUF only, instead of a target: a byte budget per side of a split machine (planning/offload).
    ``imatrix_given``: a GGUF ``qtype`` converted with an importance matrix (llama-quantize's mixes depend on it).
    ``type_rules``: GGUF --tensor-type / --output-tensor-type / --token-embedding-type, applied after the plan.
    ``pin``: with ``measure``, groups of planning/pin.PIN_GROUPS kept at the bits / types of the role plan of the
    same target (that plan made first; a GGUF --bpw target becomes that plan's bytes, since a measured GGUF's bpw
    also counts token_embd and output); without ``measure`` the role plan is what they hold anyway. ``pin_size``:
    the --size that role plan is made at, where a caller re-plans below the user's target (convert's fit loop).
    A path ``ckpt`` is opened and checked against its config (``validate_checkpoint``), as convert checks it."""
    if isinstance(ckpt, (str, Path)):
        ckpt = open_checkpoint(ckpt)
        validate_checkpoint(ckpt)  # a config that disagrees with the weights: refused, as convert refuses it
    fmt = fmt.lower()
    if sum(x is not None for x in (bpw, size, qtype)) > 1:
        raise InputError("give at most one of --bpw, --size, --type")
    size_b = parse_size(size) if size is not None else None
    if sides is not None and (fmt != "gguf" or measure is not None or any(x is not None for x in (bpw, size, qtype))):
        raise InputError("per-side budgets plan a GGUF by the role model alone (not with --bpw, --size, --type "
                         "or --measure)")
    ovs = parse_overrides(overrides)
    pins = None
    groups = parse_pin(pin)
    if groups and measure is not None:
        role = plan_model(ckpt, fmt, bpw=bpw, size=size if pin_size is None else pin_size, overrides=overrides,
                          head_bits=head_bits, mtp_bits=mtp_bits,
                          vision_bits=vision_bits, include_mtp=include_mtp, gguf_ladder=gguf_ladder)
        pins = pinned_choices(ckpt, role, groups)
        if fmt == "gguf" and bpw is not None:  # a measured GGUF's bpw counts token_embd and output too: the
            bpw, size_b = None, role.total_bytes  # pinned plan spends the role plan's bytes instead
    if fmt == "exl3":
        if type_rules:
            raise InputError("--tensor-type, --output-tensor-type and --token-embedding-type are GGUF options")
        if qtype is not None:
            raise InputError(f"--type {qtype}: named mixes are GGUF only; use --bpw or --size for EXL3")
        plan = plan_exl3(ckpt, bpw=bpw, size=size_b, overrides=ovs, head_bits=head_bits, mtp_bits=mtp_bits,
                          vision_bits=vision_bits, include_mtp=include_mtp, measure=measure, pinned=pins)
    elif fmt == "gguf" and measure is not None:
        if qtype is not None or ovs or (bpw is None and size_b is None):
            raise InputError("--measure plans a GGUF to --bpw or --size (not with --type or --override)")
        plan = plan_gguf_measured(ckpt, measure, bpw=bpw, size=size_b, ladder=gguf_ladder, include_mtp=include_mtp,
                                  mtp_bits=mtp_bits, type_rules=type_rules, pinned=pins)
    elif fmt == "gguf":
        plan = plan_gguf(ckpt, bpw=bpw, size=size_b, qtype=qtype, overrides=ovs, head_bits=head_bits,
                          mtp_bits=mtp_bits, include_mtp=include_mtp, ladder=gguf_ladder, sides=sides,
                          imatrix_given=imatrix_given, type_rules=type_rules)
    else:
        raise InputError(f"--format {fmt!r}: exl3 or gguf")
    check_plan(ckpt, plan)  # what plan shows, convert can write (one check for both)
    plan.ref_params = getattr(ckpt, "params", None)  # file_bpw's denominator, the same in convert and eval
    return plan
