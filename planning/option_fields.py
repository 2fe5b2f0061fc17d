"""Fields of the typed options objects: each carries its command-line flag, help and default, once.

Every verb's options (`PlanOptions`, `MeasureOptions`, `EvalOptions`, `ImatrixOptions`, the convert options) is a
frozen dataclass whose fields are made by `opt`; its `__post_init__` parses and checks each value once (sizes to
bytes, devices to torch.device, regexes compiled). The command line builds its options from `cli_fields`, so a
default, a flag or a help text is written in one place. `options_from(cls, kwargs, verb)` is the keyword form of
the API (`mixq.plan(model, "gguf", qtype="Q4_K_M")`).
"""
from __future__ import annotations

import math
from dataclasses import MISSING, Field, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from mixq.errors import InputError


def opt(default: Any = None, flag: str | None = None, help: str = "", *, cli: bool = True,
        choices: Sequence[str] | None = None, click_type: str | None = None, multiple: bool = False,
        is_flag: bool = False, negate: bool = False, flag_value: Any = None, required: bool = False,
        show_default: bool = False, metavar: str | None = None, must_exist: bool = False,
        case_sensitive: bool = True, secondary: str | None = None) -> Any:
    """A dataclass field of an options object. `flag`: its command-line spelling (also in messages); `help`:
    its --help text; `cli` False: an API-only setting. The rest tells the command line how to read it:
    `click_type` "int" | "float" | "path" | "text" (None: from the default), `multiple` (repeatable),
    `is_flag` (a switch that sets True; `negate`: one that sets False, as --no-mtp does), `flag_value` (the value
    of the flag given bare), `required`, `show_default`, `must_exist` (a path that must exist), `secondary` (the
    off switch of a --x/--y pair)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable default")
    meta = {"flag": flag, "help": help, "cli": cli and flag is not None and flag.startswith("--"),
            "choices": tuple(choices) if choices else None, "click_type": click_type, "multiple": multiple,
            "is_flag": is_flag or negate, "negate": negate, "flag_value": flag_value, "required": required,
            "show_default": show_default, "metavar": metavar, "must_exist": must_exist,
            "case_sensitive": case_sensitive, "secondary": secondary}
    return field(default=default, metadata=meta)


def flag_of(cls, name: str) -> str:
    """The command-line spelling of option `name` of an options class ("--seq-len" for seq_len)."""
    f = next((f for f in fields(cls) if f.name == name), None)
    return (f.metadata.get("flag") if f is not None else None) or "--" + name.replace("_", "-")


def cli_fields(cls) -> list[Field]:
    """The fields of `cls` the command line offers, in declaration order."""
    return [f for f in fields(cls) if f.metadata.get("cli")]


def default_of(cls, name: str) -> Any:
    """The default of option `name` of `cls` (the one place it is written)."""
    f = next(f for f in fields(cls) if f.name == name)
    return None if f.default is MISSING else f.default


def options_from(cls, kwargs: Mapping[str, Any], verb: str):
    """`cls(**kwargs)`, with every keyword `cls` does not have named in one InputError."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(k for k in kwargs if k not in names)
    if unknown:
        raise InputError(f"unknown {verb} option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(sorted(names))})")
    return cls(**kwargs)


def given(options) -> dict[str, Any]:
    """The options that differ from their defaults (what a user set)."""
    return {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) != f.default}


def set_field(options, name: str, value: Any) -> None:
    """Store a normalised value on a frozen options object (only in its __post_init__)."""
    object.__setattr__(options, name, value)


def check_int(cls, name: str, v, minimum: int = 1) -> int:
    """`v` when it is a whole number >= `minimum`, else InputError naming the option."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{flag_of(cls, name)} {v!r}: expected a whole number >= {minimum}")
    return v


def check_positive(cls, name: str, v) -> float:
    """`v` when it is a finite positive number, else InputError naming the option."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InputError(f"{flag_of(cls, name)} {v!r}: expected a positive number")
    return v


def check_choice(cls, name: str, v, choices: Sequence[str]) -> str:
    """`v` when it is one of `choices`, else InputError naming the option and the choices."""
    if v not in choices:
        raise InputError(f"{flag_of(cls, name)} {v!r}: expected one of {', '.join(choices)}")
    return v


def as_tuple(v) -> tuple:
    """A repeatable option as a tuple: None -> (), one value (a path or text) -> (value,)."""
    if v is None:
        return ()
    if isinstance(v, (str, Path, bytes)):
        return (v,)
    return tuple(v)
