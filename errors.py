"""One error hierarchy: the CLI turns any MixqError into one stderr line and exit code 2.

Messages carry names and strings read from files (tensor names, index entries, paths, JSON keys). `escape` makes
any such text safe to print on one terminal line: a newline or an ANSI escape in a tensor name must not forge a
line of its own or recolour the terminal. The CLI escapes every error and warning line it prints.
"""
from __future__ import annotations

import unicodedata

# characters a terminal acts on or that end a line: C0/C1 controls and DEL (Cc), format characters such as the
# bidirectional overrides (Cf), the line and paragraph separators (Zl, Zp), and lone surrogates (Cs: bytes of a
# file name that are not UTF-8)
_UNSAFE_CATEGORIES = {"Cc", "Cf", "Zl", "Zp", "Cs"}
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class MixqError(Exception):
    """Base class of every error mixq reports to a user."""


class InputError(MixqError):
    """A model, file or argument the user gave is missing, unreadable or malformed."""


class PlanError(MixqError):
    """A budget, override or plan that cannot be satisfied."""


class FormatError(MixqError):
    """A file on disk does not follow the format it claims (safetensors, EXL3, GGUF)."""


class MixqWarning(UserWarning):
    """mixq did something other than what was asked (another type written, an option without effect): the
    message names what was asked, what was done and why."""


def _escaped_char(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def escape(text: object) -> str:
    """``str(text)`` with every control, format or line-separating character written as a Python escape
    (``\\n``, ``\\x1b``, ``\\u202e``): printable on one line, with nothing a terminal would act on. Other text,
    backslashes included, is left as it is."""
    s = str(text)
    if s.isprintable() and "\x1b" not in s:  # the common case: nothing to do (isprintable is False for all above)
        return s
    return "".join(_escaped_char(c) if unicodedata.category(c) in _UNSAFE_CATEGORIES else c for c in s)
