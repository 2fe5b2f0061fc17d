"""Sizes and contexts as the user writes them, parsed once at the edge: one convention for every option.

Sizes: GB = 10^9 bytes, GiB = 2^30 (as disks and Hugging Face count them); contexts: K = 1024 tokens.
"""
from __future__ import annotations

import math
import re

from mixq.errors import InputError

MAX_SIZE = 2**60  # beyond any disk or memory (a larger size is a typo), well within 64-bit byte counts


def parse_size(text: str | int | float) -> int:
    """"108GB" -> 108e9, "100GiB" -> 100·2^30, "512MB", "1.5TB", plain numbers are bytes. InputError for
    anything else, a non-finite number (inf, nan, 1e400) or more than MAX_SIZE bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(checked_size(text, text))
    s = str(text).strip().replace("_", "")
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    num = s.rstrip("kKmMgGtTiIbB ")
    unit = s[len(num):].strip().upper()
    try:
        value = float(num)
    except ValueError:
        value = None
    if value is None or unit not in units or value <= 0:
        raise InputError(f"cannot parse size {text!r}: use e.g. 108GB (10^9 bytes) or 100GiB (2^30 bytes)")
    return int(round(checked_size(value * units[unit], text)))


def checked_size(value: float, text) -> float:
    """`value` when it is a finite byte count of at most MAX_SIZE."""
    if not math.isfinite(value):
        raise InputError(f"size {text!r} is not a finite number of bytes: use e.g. 108GB or 100GiB")
    if value > MAX_SIZE:
        raise InputError(f"size {text!r} is {value:.3g} bytes, more than any disk or memory holds (at most 1 EiB)")
    return value


def parse_size_option(flag: str, v, *, zero_ok: bool = False) -> int:
    """The bytes of size option `flag` (a byte count, or "8GiB" / "108GB" with the planner's convention). Anything
    else, a non-finite number (inf, nan, 1e400) or more than MAX_SIZE is an InputError naming `flag` and `v`."""
    if isinstance(v, bool):
        raise InputError(f"{flag} {v!r}: expected a size such as 8GiB")
    if zero_ok and v in (0, "0"):
        return 0
    try:
        n = parse_size(v)  # refuses inf, nan, 1e400 and more than any disk holds
    except InputError as e:
        raise InputError(f"{flag} {v!r}: {e}") from None
    if n <= 0:
        raise InputError(f"{flag} {v!r}: expected a positive size")
    return n


def parse_context(text: str | int) -> int:
    """"262144", "256K" (x1024), "1M" (x2^20)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    mult = {"K": 1024, "M": 1024**2}.get(s[-1:], 1)
    try:
        n = int(float(s[:-1] if mult > 1 else s) * mult)
    except (ValueError, OverflowError):  # OverflowError: inf, 1e400
        raise InputError(f"--context {text!r}: a token count such as 262144 or 256K") from None
    if n <= 0:
        raise InputError(f"--context {text!r}: must be positive")
    return n


def parse_card_sizes(flag: str, v) -> tuple[int, ...]:
    """Per-card sizes as the user writes them: "2x24GB" (N cards of one size), "24GB,16GB", or a sequence of
    sizes; each parsed by `parse_size_option`. InputError naming `flag` for anything else."""
    if isinstance(v, (list, tuple)):
        items = list(v)
    else:
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\S.*?)\s*", str(v))
        if m:
            if not 1 <= int(m.group(1)) <= 64:
                raise InputError(f"{flag} {v!r}: {m.group(1)} cards; expected 1 to 64")
            items = [m.group(2)] * int(m.group(1))
        else:
            items = str(v).split(",")
    if not items or any(str(x).strip() == "" for x in items):
        raise InputError(f"{flag} {v!r}: expected card sizes such as 2x24GB or 24GB,16GB")
    return tuple(parse_size_option(flag, x.strip() if isinstance(x, str) else x) for x in items)
