"""Types written other than asked: a tensor a user gave a type (``--tensor-type``, ``--override``,
``--output-tensor-type``, ``--token-embedding-type``, ``--head-bits`` / ``--mtp-bits``, a float ``--type``) whose
rows that type cannot store is written in its shape fallback instead (as llama-quantize does). Each such change is
said: one MixqWarning per (request, asked type, written type, row length), naming the first tensor and the count.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from mixq.errors import MixqWarning
from mixq.planning.gguf_mix import block_size


@dataclass
class Substitutions:
    """The tensors of one plan written in another type than their request asked for."""
    groups: dict[tuple[str, str, str, int], list[str]] = field(default_factory=dict)

    def note(self, name: str, by: str, asked: str, written: str, ne0: int) -> None:
        """Record ``name`` (rows of ``ne0``) asked as ``asked`` by ``by`` and planned as ``written``."""
        if written != asked:
            self.groups.setdefault((by, asked, written, int(ne0)), []).append(name)

    def messages(self) -> list[str]:
        """One line per group: the tensor(s), the type asked and by what, the type written and why."""
        out = []
        for (by, asked, written, ne0), names in self.groups.items():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            out.append(f"{names[0]}{more}: written as {written}, not the {asked} asked by {by}: rows of {ne0} "
                       f"values are not a multiple of {asked}'s {block_size(asked)}-value blocks")
        return out

    def warn(self) -> None:
        """Each message as a MixqWarning (the command line prints them as `mixq: warning: ...`)."""
        for m in self.messages():
            warnings.warn(m, MixqWarning, stacklevel=2)
