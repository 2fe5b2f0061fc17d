"""`--pin`: tensors a measured plan keeps at the role plan's bits (EXL3) or types (GGUF).

The fixtures spend a large share of their weights on tensors that are a small share of GLM-5.3-Flash (there the
routed experts are 97% of the weights, token_embd and output 0.4%): a measured plan that moves bits into them
gains what the real model cannot. Pinning them at the role plan's choice, at the same target, leaves the measured
plan only the freedom the real model offers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from mixq.errors import InputError


@dataclass(frozen=True)
class PinGroup:
    """A pinnable group: the tensors of `role` (None: any), in decoder layer `layer` (None: any layer or none)."""

    name: str
    role: str | None
    layer: int | None
    what: str


PIN_GROUPS: tuple[PinGroup, ...] = (
    PinGroup("token_embd", "embed", None, "the token embedding"),
    PinGroup("output", "lm_head", None, "the output head"),
    PinGroup("vision", "vision", None, "the vision tower"),
    PinGroup("layer0", None, 0, "every tensor of decoder layer 0 (the fixtures' dense layer)"),
)
PIN_NAMES = tuple(g.name for g in PIN_GROUPS)


def parse_pin(value: str | Iterable[str] | None, flag: str = "--pin") -> tuple[str, ...]:
    """`value` ("token_embd,output" or a sequence of names) as a tuple of pinnable group names, in table order."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [x for v in value for x in str(v).split(",")]
    names = {x.strip().lower() for x in items if x.strip()}
    unknown = sorted(names - set(PIN_NAMES))
    if unknown:
        raise InputError(f"{flag} {unknown[0]!r}: not a pinnable group ({', '.join(PIN_NAMES)})")
    return tuple(n for n in PIN_NAMES if n in names)


def is_pinned(info, groups: Sequence[str]) -> bool:
    """Whether a tensor (its architecture-table info: role, layer, mtp) belongs to one of `groups`."""
    for g in PIN_GROUPS:
        if g.name in groups and (g.role is None or info.role == g.role) \
                and (g.layer is None or (info.layer == g.layer and not info.mtp)):
            return True
    return False


def pinned_choices(ckpt, role_plan, groups: Sequence[str]) -> dict[str, float | str]:
    """{planned tensor name: its bits (EXL3, quantized tensors) or ggml type (GGUF)} in `role_plan` of every
    tensor of `groups`; a tensor counts as pinned when all its source tensors are."""
    out: dict[str, float | str] = {}
    for t in role_plan.tensors:
        if t.hf_names and all(is_pinned(ckpt.info(h), groups) for h in t.hf_names):
            if role_plan.format == "gguf":
                out[t.name] = t.type
            elif t.bits is not None:
                out[t.name] = t.bits
    return out

