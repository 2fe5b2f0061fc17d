"""The files of a model directory stay inside it: a model directory is untrusted input.

An index entry such as ``../outside/x.safetensors`` or ``/etc/passwd``, or a symbolic link that points out of the
directory, would make mixq read (and convert, or print) a file the user never gave it. Every file mixq opens for a
model is named relative to the directory and must resolve, after symbolic links, inside the directory's trust
root: the directory itself, or for a Hugging Face hub snapshot (``models--org--name/snapshots/<rev>``) the repo's
cache folder, whose ``blobs/`` the snapshot's links point into.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from mixq.errors import InputError, MixqError


def read_text(path: str | os.PathLike, what: str, error: type[MixqError] = InputError) -> str:
    """The UTF-8 text of a file mixq was given (a model's JSON or template, a report, a curves file): InputError
    naming ``path`` and ``what`` when it is missing or unreadable (a link that loops, a directory, no permission),
    ``error`` when it is not UTF-8. Every file a user or a model directory hands mixq is read through here or
    ``read_json``."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{p}: {what} not found") from None
    except UnicodeDecodeError as e:
        raise error(f"{p}: {what} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x})") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InputError(f"{p}: {what} is a symbolic link that loops (it never reaches a file)") from None
        raise InputError(f"{p}: cannot read {what} ({e.strerror or e})") from None


def parse_json(text: str, where: str, what: str, error: type[MixqError] = InputError) -> Any:
    """``json.loads(text)``; ``error`` (InputError unless given) ``WHERE: WHAT is not valid JSON (...)`` when it is
    not (truncated, a number too long for Python) or is nested too deeply for the parser."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: {what} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})") \
            from None
    except ValueError as e:  # e.g. an integer beyond Python's digit limit
        raise error(f"{where}: {what} is not valid JSON ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise error(f"{where}: {what} is nested too deeply to be read (not a file mixq or a model writes)") \
            from None


def read_json(path: str | os.PathLike, what: str, error: type[MixqError] = InputError) -> Any:
    """The JSON value of a file (see ``read_text`` and ``parse_json``): one line naming ``path`` and ``what`` for
    any file that cannot be read (InputError) or parsed (``error``: FormatError where an API promises it)."""
    return parse_json(read_text(path, what, error), str(path), what, error)


def resolved(path: str | os.PathLike) -> Path:
    """``Path(path).resolve()``; InputError naming the path when its symbolic links loop (Python raises
    RuntimeError or OSError for that, depending on its version)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):
        raise InputError(f"{path}: a symbolic link that loops (it never reaches a file)") from None


def trust_root(model_dir: str | os.PathLike) -> Path:
    """The resolved directory that every file of ``model_dir`` must resolve into."""
    d = resolved(model_dir)
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith(("models--", "datasets--")):
        return d.parent.parent  # a hub snapshot: its files are links into the repo's blobs/
    return d


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def model_file(model_dir: str | os.PathLike, name: object, what: str) -> Path:
    """``model_dir / name`` for a file the model names itself (an index entry, a config key). InputError naming
    ``what`` and the entry when ``name`` is not a non-empty relative path string or resolves outside the
    directory (``..`` components, an absolute path, a symbolic link that leaves it)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InputError(f"{what}: entry {name!r} is not a file name")
    d = Path(model_dir)
    if Path(name).is_absolute():
        raise InputError(f"{what}: entry {name!r} is an absolute path; files of a model must be inside "
                         f"{d}")
    p = d / name
    if not _inside(resolved(p), trust_root(d)):
        raise InputError(f"{what}: entry {name!r} resolves outside the model directory {d}")
    return p


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """InputError naming the entry when a file or folder directly in ``model_dir`` is a symbolic link that
    resolves outside the directory's trust root (then no later read of ``model_dir / NAME`` can leave it).
    Returns ``model_dir``."""
    d = Path(model_dir)
    root = trust_root(d)
    with os.scandir(d) as it:
        for entry in it:
            if entry.is_symlink() and not _inside(resolved(entry.path), root):
                raise InputError(f"{entry.path}: a symbolic link that points outside the model directory {d} "
                                 f"(to {os.path.realpath(entry.path)})")
    return d


# the files gguf-py's SpecialVocab (and transformers' tokenizer loader) read from a model directory with their own
# unguarded json.load / open
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "chat_template.json", "config.json",
                  "special_tokens_map.json", "generation_config.json")
TOKENIZER_TEXT = ("chat_template.jinja", "merges.txt")


def check_tokenizer_files(model_dir: str | os.PathLike) -> None:
    """Read every tokenizer or template file of ``model_dir`` that exists through the guarded readers, so that a
    truncated, invalid, deeply nested or looping one is one InputError naming it before a library (gguf-py,
    transformers) parses it with a traceback."""
    d = Path(model_dir)
    for name in TOKENIZER_JSON:
        if os.path.lexists(d / name):
            read_json(model_file(d, name, str(d)), name)
    extra = sorted((d / "additional_chat_templates").glob("*.jinja")) if (d / "additional_chat_templates").is_dir() \
        else []
    for name in [*TOKENIZER_TEXT, *(f"additional_chat_templates/{p.name}" for p in extra)]:
        if os.path.lexists(d / name):
            read_text(model_file(d, name, str(d)), name)
