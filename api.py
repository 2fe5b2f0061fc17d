"""mixq's public API: one function per verb, each checking its own inputs before any work.

    import mixq
    mixq.inspect("glm5next-mini")                                   # roles, tensors, bytes
    plan = mixq.plan("glm5next-mini", "gguf", qtype="Q4_K_M")       # bits / types and bytes per tensor
    res = mixq.convert("glm5next-mini", "mini-Q4_K_M.gguf", qtype="Q4_K_M")
    mixq.verify(res.out)
    report = mixq.evaluate("glm5next-mini", [res.out], "heldout.txt")

`mixq` re-exports every name of `__all__`; the command line (cli.py) calls these functions and only translates
flags into their arguments and their errors (`mixq.errors`) into one line and exit code 2.
"""
from __future__ import annotations

import os
from typing import Sequence

from mixq.conversion import api as convert_api
from mixq.conversion.api import output_format, verify
from mixq.conversion.gguf.imatrix import make_imatrix
from mixq.conversion.gguf.family import FamilyResult
from mixq.conversion.options import (Exl3Options, FamilyOptions, GGUFOptions, ImatrixOptions, family_options,
                                     options_for)
from mixq.formats.outputs import writing
from mixq.planning.display import format_plan
from mixq.conversion.result import ConvertResult
from mixq.demo_run import DEMO_DIR, format_demo, run_demo
from mixq.errors import FormatError, InputError, MixqError, MixqWarning, PlanError, escape
from mixq.eval.options import DEFAULT_WINDOWS, EvalOptions
from mixq.eval.card import write_card
from mixq.eval.api import evaluate as _evaluate_streamed
from mixq.measurement.kld import run_measure, run_plan
from mixq.measurement.options import MeasureOptions, PlanOptions
from mixq.planning.fit import FitResult
from mixq.planning.offload import OffloadResult
from mixq.planning.option_fields import cli_fields, options_from
from mixq.planning.types import Plan
from mixq.eval.report import compare, render_markdown
from mixq.formats.model_summary import format_report, inspect_path
from mixq.quant.device import resolve_device

__all__ = ["inspect", "plan", "measure", "convert", "family", "verify", "evaluate", "compare", "card", "imatrix",
           "demo",
           "output_format", "PlanOptions", "MeasureOptions", "EvalOptions", "ImatrixOptions", "Exl3Options",
           "GGUFOptions", "FamilyOptions", "options_for", "ConvertResult", "DEFAULT_WINDOWS",
           "format_report", "format_plan", "render_markdown", "format_demo",
           "MixqError", "InputError", "PlanError", "FormatError", "MixqWarning", "escape"]


def inspect(path: str | os.PathLike) -> dict:
    """What is in a checkpoint directory (or hub id), a config.json (shapes only) or a .gguf: roles, tensor
    counts, parameters, bytes, layer types. `format_report` renders it."""
    return inspect_path(path)


def plan(model: str | os.PathLike | None = None, fmt: str | None = None, options: PlanOptions | None = None,
         **kwargs) -> Plan | FitResult | OffloadResult:
    """Bits (EXL3) or ggml types (GGUF) and bytes of every tensor of `model` (or `from_config=CONFIG`), to a
    target (`bpw`, `size` or `qtype`); with `fit`, whether the files fit a machine at a `context` (with `gpu` and
    `cpu`: llama.cpp's expert offload, an OffloadResult with each device's bytes and the flags). `options`: a
    PlanOptions, or its fields as keywords (`fmt` included; an unknown keyword is an InputError). Returns a Plan
    (`format_plan` renders it) or a FitResult."""
    options = _options(PlanOptions, options, kwargs, "plan", fmt=fmt)
    return run_plan(None if model is None else str(model), options)


def _options(cls, options, kwargs: dict, verb: str, build=None, **positional):
    """`options` as given, or built from keywords (and the positional ones that were given) by `build` (default:
    `cls`'s fields, an unknown keyword an InputError); not both."""
    kwargs = {**{k: v for k, v in positional.items() if v is not None}, **kwargs}
    if options is None:
        return build(**kwargs) if build is not None else options_from(cls, kwargs, verb)
    if not isinstance(options, cls):
        raise InputError(f"{verb} options: expected {cls.__name__}, not {type(options).__name__}")
    if kwargs:
        raise InputError(f"give {verb} options as {cls.__name__} or as keywords, not both "
                         f"({', '.join(sorted(kwargs))})")
    return options


def measure(model: str | os.PathLike, fmt: str | None = None, options: MeasureOptions | None = None,
            **kwargs) -> dict[str, dict[float, float]]:
    """Error curves {unit: {bits or type: error}} of every budgeted unit, for `plan(..., measure=curves)` and
    `convert(..., measure=curves)`. `options`: a MeasureOptions, or its fields as keywords (`method` "kld": end to
    end, the whole model in memory; "stream": end to end, one layer in memory, weighted by a streamed backward; both
    EXL3 or GGUF with the conversion's `rounding` and `imatrix`; or "trellis" / "proxy" (EXL3); `out` saves the
    curves as the JSON `--measure FILE` reads; an unknown keyword is an InputError)."""
    return run_measure(model, _options(MeasureOptions, options, kwargs, "measure", fmt=fmt))


def convert(model: str | os.PathLike, out: str | os.PathLike, options=None, **kwargs):
    """Convert `model` to `out` (mixq.conversion.api.convert: the options, result and errors there)."""
    return convert_api.convert(model, out, options, **kwargs)


def evaluate(reference: str | os.PathLike, candidates: Sequence[str | os.PathLike] = (),
             text: str | os.PathLike | None = None, options: EvalOptions | None = None, **kwargs) -> dict | None:
    """KLD / top-1 / PPL of `candidates` (HF, EXL3 directories, GGUF files) against `reference` on held-out
    `text` (or `ref_logits=FILE`). `options`: an EvalOptions, or its fields as keywords (`ctx`, `windows`,
    `json_out`, `markdown_out`, `save_ref`, `overwrite`, `engine`, `device`, ...; `windows` is DEFAULT_WINDOWS
    unless given, "all" or None for every window; an unknown keyword is an InputError). The device is resolved
    and the outputs are checked before the (long) forward; a full disk met while writing them is one InputError.
    Returns the report (None on a worker rank of a multi-device run)."""
    options = _options(EvalOptions, options, kwargs, "eval")
    if options.device is not None:
        resolve_device(options.device)  # a CUDA device this machine lacks: refused before anything is read
    outs = [options.json_out, options.markdown_out, options.save_ref, options.profile]
    with writing(*[p for p in outs if p is not None and p != "-"]):
        return _evaluate_streamed(reference, list(candidates), text, options)


def family(model: str | os.PathLike, out_dir: str | os.PathLike, fmt: str | None = None,
           options: FamilyOptions | None = None, **kwargs) -> FamilyResult:
    """A family in `out_dir` from one pass. `options`: a FamilyOptions, or `size` ("A,B,C" or a list) or `bpw`
    (likewise) and the other options as `convert` takes them for `fmt` ("gguf" unless given; docs/family.md).
    GGUF: one calibration and one encode per (tensor, type); EXL3 ("exl3"): one set of error curves, each member
    calibrated and encoded on its own. `convert(model, out_dir, fmt, size="A,B,C")` does the same."""
    o = _options(FamilyOptions, options, kwargs, "family", build=family_options, format=fmt)
    with convert_api.profiled(model, out_dir, o.base.profile, o.base.format, overwrite=o.base.overwrite,
                              progress=o.base.progress):
        return convert_api.family(model, out_dir, o)


def card(out_dir: str | os.PathLike, *, base_model: str | None = None, overwrite: bool = False) -> dict:
    """Write `out_dir`/README.md, a Hugging Face model card of the family there (members, sizes, scores recorded
    by `evaluate(model, [out_dir], ...)`, how they were made); returns {"card", "plot", "members"}."""
    return write_card(out_dir, base_model=base_model, overwrite=overwrite)


def imatrix(model: str | os.PathLike, out: str | os.PathLike, calibration: Sequence[str] | None = None,
            options: ImatrixOptions | None = None, **kwargs) -> dict:
    """A llama.cpp GGUF importance matrix of `model` from a calibration forward, written to `out`. `options`: an
    ImatrixOptions, or its fields as keywords (`rows`, `seq_len`, `device`, `overwrite`, `profile`,
    `gpu_memory`). Returns {"file", "entries", "chunks", "chunk_size", "datasets", "memory"} ("memory": the
    up-front estimate of runtime/memory_budget.py)."""
    o = _options(ImatrixOptions, options, kwargs, "imatrix", calibration=calibration or None)
    return make_imatrix(model, out, list(o.calibration) or None, rows=o.rows, seq_len=o.seq_len, device=o.device,
                        progress=o.progress, overwrite=o.overwrite, profile_out=o.profile,
                        gpu_memory=o.gpu_memory)


def demo(out_dir: str | os.PathLike = DEMO_DIR, *, skip: Sequence[str] = (), progress: bool = False) -> dict:
    """A tiny random glm5_next model through every step in `out_dir` (`format_demo` renders the report)."""
    return run_demo(out_dir, progress=progress, skip=tuple(skip))

