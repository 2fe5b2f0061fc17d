"""Public entry points of `mixq convert` and `mixq verify`: dispatch on the output format / path."""
from __future__ import annotations

from pathlib import Path

from mixq.errors import InputError

FORMATS = ("exl3", "gguf")


def convert(model, out, format: str = "exl3", **opts):
    """Convert `model` to `format` at `out`. EXL3 → `convert_exl3` (returns a ConvertResult);
    GGUF → `mixq.convert.gguf_pipeline.convert_gguf` (returns its summary dict; `threads=N` worker processes
    encode the tensors, default all cores)."""
    fmt = str(format).lower()
    if fmt == "exl3":
        from .pipeline import convert_exl3

        return convert_exl3(model, out, **opts)
    if fmt == "gguf":
        from .gguf_pipeline import convert_gguf

        return convert_gguf(model, out, **opts)
    raise InputError(f"unknown format {format!r}; expected one of {FORMATS}")


def verify(path, *, model=None, decode: bool = True) -> dict:
    """Verify a converted output: an EXL3 directory or a .gguf file. Returns a report with `problems`."""
    p = Path(path)
    if p.suffix == ".gguf" or (p.is_file() and _magic(p) == b"GGUF"):
        from mixq.formats.gguf_reader import verify_gguf

        return verify_gguf(p, model=model, decode=decode)
    if p.is_dir():
        from mixq.formats.exl3_reader import verify_exl3

        return verify_exl3(p, decode=decode)
    raise InputError(f"{p}: neither an EXL3 directory nor a .gguf file")


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)
