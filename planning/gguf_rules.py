"""llama-quantize's per-tensor type options, applied after a plan: --output-tensor-type and
--token-embedding-type, then --tensor-type REGEX=TYPE (first match wins), each type asked for a row length it
cannot hold taking its shape fallback (said, never silent). `mixq plan --format gguf` and `mixq convert` read these
options with the same parsers (`tensor_type_rule`, `encodable_type`) and apply them with the same `TypeRules`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from mixq.errors import InputError, MixqError, PlanError
from mixq.formats.gguf_names import OUTPUT, TOKEN_EMBD
from mixq.planning import gguf_mix
from mixq.planning.option_fields import as_tuple
from mixq.planning.substitutions import Substitutions

# how the command line reads each option (`mixq plan` and `mixq convert` build their flags from these)
RULE_FLAGS: dict[str, dict[str, Any]] = {
    "--tensor-type": dict(help="GGUF: REGEX=TYPE on GGUF tensor names (repeatable; first match wins).",
                          multiple=True),
    "--output-tensor-type": dict(help="GGUF: type of output.weight.", click_type="text"),
    "--token-embedding-type": dict(help="GGUF: type of token_embd.weight.", click_type="text"),
}


def encodable_type(name: str, what: str) -> str:
    """The upper-case ggml type `name` if mixq can write it, else InputError naming `what`."""
    t = str(name).upper()
    try:
        gguf_mix.ggml_type(t)
    except MixqError:
        raise InputError(f"{what}: unknown GGUF type {name!r}") from None
    if not gguf_mix.has_encoder(t):
        raise InputError(f"{what}: mixq has no encoder for {t} (it writes {', '.join(gguf_mix.encodable_types())})")
    return t


def tensor_type_rule(item) -> tuple[str, str]:
    """("REGEX", "TYPE") from "REGEX=TYPE" or a pair; the regex compiles and the type can be written."""
    if isinstance(item, str):
        if "=" not in item:
            raise InputError(f"--tensor-type {item!r}: expected REGEX=TYPE")
        item = tuple(item.rsplit("=", 1))
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise InputError(f"--tensor-type {item!r}: expected REGEX=TYPE")
    pat, qtype = str(item[0]), str(item[1])
    try:
        re.compile(pat)
    except re.error as e:
        raise InputError(f"--tensor-type {pat!r}: bad regex ({e})") from None
    return pat, encodable_type(qtype, f"--tensor-type {pat}={qtype}")


def tensor_type_rules(items) -> tuple[tuple[str, str], ...]:
    """Every --tensor-type rule (one "REGEX=TYPE", a pair, or a sequence of them), parsed by `tensor_type_rule`."""
    return tuple(tensor_type_rule(x) for x in as_tuple(items))


def fallback_type(qtype: str, n: int) -> str:
    """The type llama-quantize really uses for a row length `n` (planning.gguf_mix.fallback, the planner's rule);
    a type with no listed fallback whose block does not divide `n` becomes F16, as llama-quantize's last resort."""
    try:
        return gguf_mix.fallback(qtype, n)
    except PlanError:
        return "F16"


@dataclass(frozen=True)
class TypeRules:
    """--tensor-type rules ((REGEX, TYPE) pairs or "REGEX=TYPE"), --output-tensor-type and
    --token-embedding-type, parsed when built; `apply` retypes a plan's tensors as llama-quantize's options do."""
    tensor_type: tuple = ()
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor_type", tensor_type_rules(self.tensor_type))
        for name in ("output_tensor_type", "token_embedding_type"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, encodable_type(getattr(self, name), "--" + name.replace("_", "-")))

    def __bool__(self) -> bool:
        return bool(self.tensor_type or self.output_tensor_type or self.token_embedding_type)

    def apply(self, specs: Sequence, types: Sequence[str]) -> list[str]:
        """`types` (one per GGUF tensor spec) with the options applied: output / embedding flags first, then the
        first --tensor-type rule that matches; never-quantized tensors keep their type. InputError for a flag
        naming a tensor this model lacks, or a rule that changes no tensor."""
        types = list(types)
        rx = [(re.compile(pat), t) for pat, t in self.tensor_type]
        names = {s.name for s in specs}
        for flag, value, name in (("--output-tensor-type", self.output_tensor_type, OUTPUT),
                                  ("--token-embedding-type", self.token_embedding_type, TOKEN_EMBD)):
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
            if s.name == OUTPUT and self.output_tensor_type:
                want, by = self.output_tensor_type, "--output-tensor-type"
            elif s.name == TOKEN_EMBD and self.token_embedding_type:
                want, by = self.token_embedding_type, "--token-embedding-type"
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
