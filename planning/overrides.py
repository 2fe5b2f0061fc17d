"""``--override PATTERN=VALUE``: per-tensor bits (EXL3) or types (GGUF), matched by role, glob or regex."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from mixq.errors import InputError, PlanError
from mixq.formats.glm5next import ROLES
from mixq.planning.allocator import EXL3_RATES


@dataclass
class Override:
    """One ``--override``: a role name, glob or regex and the bits or type it sets."""
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
    """``PATTERN=VALUE`` strings (or pairs) as Overrides, in the order given (the first match wins)."""
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


def first_override(ovs: Sequence[Override], role: str, names: Iterable[str]) -> Override | None:
    """The first override matching ``role`` or any of ``names``, marked used."""
    names = list(names)
    for o in ovs:  # first match wins, as llama-quantize's --tensor-type
        if o.matches(role, names):
            o.used = True
            return o
    return None


def exl3_override_bits(o: Override) -> float:
    """An EXL3 override's bits: one of the trellis rates or 16 (kept at fp16)."""
    try:
        b = float(o.value)
    except ValueError:
        raise PlanError(f"--override {o.pattern}={o.value}: EXL3 takes bits, one of {EXL3_RATES} or 16") from None
    if b != 16 and b not in EXL3_RATES:
        raise PlanError(f"--override {o.pattern}={o.value}: EXL3 bits must be one of {EXL3_RATES} or 16")
    return b


def check_unused(ovs: Sequence[Override]) -> None:
    """An override that matched nothing is a typo: refuse it rather than plan without it."""
    for o in ovs:
        if not o.used:
            raise PlanError(f"--override {o.pattern}={o.value} matches no quantizable tensor")
