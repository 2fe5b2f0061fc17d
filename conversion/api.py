"""Public entry points of `mixq convert` and `mixq verify`: typed options in, one result type out.

    import mixq
    res = mixq.convert("glm5next-mini", "mini-Q4_K_M.gguf", mixq.GGUFOptions(qtype="Q4_K_M"))
    res = mixq.convert("glm5next-mini", "mini-exl3", mixq.Exl3Options(bpw=3.05))

Every option is checked when its options object is built, every input and output before anything is written.
The keyword form `convert(model, out, "gguf", qtype="Q4_K_M")` builds the options the same way.
Several targets (`size="A,B,C"` or a list, likewise `bpw`) with format "gguf" or "exl3" write a family into the
directory `out` (conversion/gguf/family.py, conversion/exl3/family.py, docs/family.md) and return its FamilyResult.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from mixq.errors import InputError

from mixq.conversion.options import (OPTION_CLASSES, Exl3Options, FamilyOptions, GGUFOptions, family_options, flag_of,
                                     is_family, options_for, replace)
from mixq.conversion.result import ConvertResult
from mixq.conversion.exl3.pipeline import run_exl3
from mixq.conversion.gguf.pipeline import run_gguf
from mixq.conversion.exl3.family import run_exl3_family
from mixq.conversion.gguf.family import run_family
from mixq.formats.gguf_reader import verify_gguf
from mixq.formats.exl3_reader import verify_exl3
from mixq.formats.exl3_seal import integrity_note
from mixq.formats.outputs import check_distinct, check_output_file
from mixq.runtime import profile
from mixq.runtime.dequant import exl3_decode_check

FORMATS = tuple(OPTION_CLASSES)


def output_format(out) -> str:
    """The format an OUT path asks for: "gguf" for a name ending in .gguf, else "exl3" (a directory)."""
    return "gguf" if Path(out).suffix.lower() == ".gguf" else "exl3"


def convert(model, out, options: Exl3Options | GGUFOptions | str | None = None, **kwargs) -> ConvertResult:
    """Convert `model` (a glm5_next directory or hub id, or a DFlash2 drafter directory for EXL3) to `out`: an
    EXL3 directory or a .gguf file, as `options` says (`Exl3Options` / `GGUFOptions`, or a format name whose
    options are then built from `kwargs`; with an options object, `kwargs` replace fields of it; None: the
    format `out` names, `output_format(out)`).

    Returns a ConvertResult for either format. Raises InputError / PlanError / FormatError (one line naming the
    option, file or tensor) for bad input, before any output is written."""
    if "format" in kwargs:  # the keyword spelling of the old signature
        if options not in (None, kwargs["format"]):
            raise InputError("give the format once: as the options or as format=")
        options = kwargs.pop("format")
    if options in (None, "gguf", "exl3") and is_family(kwargs.get("size"), kwargs.get("bpw")):
        with profiled(model, out, kwargs.get("profile"), options, overwrite=bool(kwargs.get("overwrite")),
                       progress=kwargs.get("progress", True)):
            return _family(model, out, options, kwargs)
    if options is None:
        options = output_format(out)
        if options == "exl3":
            _check_exl3_out(out, kwargs)
    if isinstance(options, (Exl3Options, GGUFOptions)):
        opts = replace(options, **kwargs) if kwargs else options
    elif isinstance(options, str):
        opts = options_for(options, **kwargs)
    else:
        raise InputError(f"convert options: expected Exl3Options, GGUFOptions or a format name, "
                         f"got {type(options).__name__}")
    if opts.format == "exl3" and output_format(out) == "gguf":
        raise InputError(f"OUT {out}: a .gguf name for an EXL3 output (a directory); leave --format out to "
                         "write GGUF, or name the EXL3 directory without .gguf")
    if opts.format == "gguf" and Path(out).suffix != ".gguf":
        raise InputError(f"OUT {out}: must end in .gguf (--format gguf writes a .gguf file, or a split set named "
                         "after it)")
    with profiled(model, out, opts.profile, opts.format, overwrite=getattr(opts, "overwrite", False),
                   progress=opts.progress):
        if opts.format == "exl3":
            return run_exl3(model, out, opts)
        return run_gguf(model, out, opts)


def profiled(model, out, path, fmt: str | None, *, overwrite: bool = False, progress: bool = True):
    """A conversion's (or family's) --profile: the file checked as an output (not OUT, not an input; an existing one
    only with --overwrite), then the run recorded into it (runtime/profile.py); without it, nothing."""
    if path is not None:
        check_distinct({"OUT": out, "--profile": path}, {"MODEL": model})
        check_output_file(path, overwrite=overwrite, label="--profile")
    return profile.recording(path, "convert", fmt, table=progress)


def _family(model, out, fmt: str | None, kwargs: dict):
    """`--size A,B,C` / `--bpw x,y,z`: a family in the directory `out`."""
    if fmt is None:
        raise InputError(f"--size/--bpw with several targets writes a family into the directory {out}: give "
                         "--format gguf or --format exl3")
    return family(model, out, family_options(fmt, **kwargs))


def family(model, out, options: FamilyOptions):
    """The family `options` describes in the directory `out` (GGUF: conversion/gguf/family.py; EXL3:
    conversion/exl3/family.py). Returns its FamilyResult."""
    if options.base.format == "exl3":
        return run_exl3_family(model, out, options)
    return run_family(model, out, options)


def _check_exl3_out(out, kwargs: dict) -> None:
    """An OUT without .gguf means EXL3: a GGUF-only option then says which OUT made it so (the user most likely
    meant a .gguf file)."""
    exl3 = {f.name for f in fields(Exl3Options)}
    gguf_only = [k for k in kwargs if k not in exl3 and k in {f.name for f in fields(GGUFOptions)}]
    if gguf_only:
        raise InputError(f"{flag_of(GGUFOptions, gguf_only[0])} applies to --format gguf only, and OUT {out} does "
                         "not end in .gguf, so it names an EXL3 directory; end OUT in .gguf to write GGUF")


def verify(path, *, model=None, decode: bool = True) -> dict:
    """Verify an EXL3 directory or a .gguf file, written by mixq or by anyone. Returns a report with `problems`
    and `integrity`: what could be checked (mixq's seal and checksums where the output carries them, else the
    structure and the decode of every quantized tensor)."""
    p = Path(path)
    if p.suffix == ".gguf" or (p.is_file() and _magic(p) == b"GGUF"):
        return verify_gguf(p, model=model, decode=decode)
    if p.is_dir():
        report = verify_exl3(p)
        if decode:  # the trellis decode lives in the runtime (formats does not import quant)
            report["quantized"], problems = exl3_decode_check(p)
            report["problems"] += problems
            report["ok"] = not report["problems"]
            report["integrity"] = integrity_note(report["manifest"], report["sealed_files"], decoded=True)
        return report
    raise InputError(f"{p}: neither an EXL3 directory nor a .gguf file")


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)
