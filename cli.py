"""Command-line interface: click commands only; every command calls one function of `mixq.api` (the only
module it imports) and prints its result.

Only this module turns a MixqError into one stderr line and exit code 2.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import warnings
from contextlib import contextmanager

import click
import torch
from tqdm import tqdm

from mixq import api


class _Stopped(KeyboardInterrupt):
    """SIGTERM / SIGHUP raised where the command is, as Ctrl-C is: every cleanup on the way out runs (partial
    outputs removed, encoder processes stopped)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise _Stopped(signum)


@contextmanager
def _stop_signals():
    """While a command runs: Ctrl-C raises KeyboardInterrupt and SIGTERM / SIGHUP raise _Stopped; the previous
    handlers come back after it (the command may run inside a test or another program)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    old = {}
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        current = signal.getsignal(sig)
        if sig == signal.SIGINT and current in (signal.SIG_IGN, signal.SIG_DFL, None):
            # a shell starts `mixq ... &` of a script with Ctrl-C ignored; an interrupt of the process group
            # must still stop the run (and remove its partial output) instead of letting it finish unasked
            old[sig] = signal.signal(sig, signal.default_int_handler)
        elif sig != signal.SIGINT and current == signal.SIG_DFL:  # an ignored SIGHUP (nohup) stays ignored
            old[sig] = signal.signal(sig, _raise_stopped)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _error_line(message: str) -> None:
    """`mixq: error: MESSAGE` on a line of its own, also when a progress bar of the failed step is still drawn
    on stderr (tqdm clears it first, instead of the message being appended to the bar's line). Names from files
    in MESSAGE are escaped: a newline or terminal escape in a tensor name cannot forge a line or colour."""
    tqdm.write(f"mixq: error: {api.escape(message)}", file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one escaped stderr line: `mixq: warning: ...` for mixq's own (a type written other than
    asked), `FILE:LINE: Category: ...` for a library's."""
    text = api.escape(message)
    if issubclass(category, api.MixqWarning):
        tqdm.write(f"mixq: warning: {text}", file=sys.stderr)
    else:
        tqdm.write(f"{filename}:{lineno}: {category.__name__}: {text}", file=sys.stderr)


@contextmanager
def _warning_lines():
    """While a command runs, every warning is printed by `_show_warning`, each of mixq's once per message; the
    caller's warning settings come back after it (the command may run inside a test or another program)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default", api.MixqWarning)
        warnings.showwarning = _show_warning
        yield


def _reports_errors(fn):
    """Turn MixqError (user mistakes) into one line on stderr and exit 2, never a traceback; running out of GPU
    memory into one line and exit 1; an interrupt (Ctrl-C,
    SIGTERM, SIGHUP) into one line and exit 128 + the signal number (130 for Ctrl-C), after the command's own
    cleanup removed its partial output."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with _stop_signals(), _warning_lines():
                return fn(*args, **kwargs)
        except api.MixqError as e:
            _error_line(str(e))
            sys.exit(2)
        except torch.OutOfMemoryError as e:  # not a user mistake, but a traceback would say nothing more
            _error_line(f"out of GPU memory ({str(e).splitlines()[0]}); fewer --rows, --tune-iters 0 or a GPU "
                        "with more memory")
            sys.exit(1)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            ctx = click.get_current_context(silent=True)
            what = ctx.info_name if ctx is not None and ctx.info_name else "mixq"
            _error_line(f"{what} interrupted ({signal.Signals(signum).name})")
            sys.exit(128 + signum)

    return wrapper


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


class _UsageLine(click.ClickException):
    """A command-line mistake (unknown option, bad value), reported like a MixqError: one line, exit 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"mixq: error: {self.format_message()}", err=True)


class _OneLineGroup(click.Group):
    """click's usage errors as one line (`mixq: error: ...`, exit 2) instead of usage + hint + error."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:
            raise _UsageLine(e.format_message()) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:
            raise _UsageLine(e.format_message()) from None


def _quiet_transformers() -> None:
    """transformers' notes (kernel fallbacks, load reports) off for every command; mixq's own messages stay.
    The environment variable reaches transformers when it is first imported (and the GGUF encoder processes);
    an already imported transformers is told directly. A TRANSFORMERS_VERBOSITY the user set is kept."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
    if "transformers" in sys.modules and os.environ["TRANSFORMERS_VERBOSITY"] == "error":
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()


@click.group(cls=_OneLineGroup)
@click.version_option(package_name="mixq")
def main() -> None:
    """mixq: plan, quantize (EXL3 / GGUF), verify and evaluate glm5_next MoE checkpoints.

    \b
    Start here:
      mixq demo                                      # a tiny model through every step, in a few minutes
      mixq inspect MODEL                             # what is in a checkpoint
      mixq plan MODEL --format gguf --type Q4_K_M    # sizes and bits before converting
      mixq convert MODEL OUT.gguf --type Q4_K_M      # the format follows OUT: .gguf or a directory (EXL3)
    """
    _quiet_transformers()


# --- options built from the fields of the options objects (api.PlanOptions, ...): flag, help and default once ---
_CLICK_TYPES = {"int": int, "float": float, "text": str}


def _click_option(f, *, defaults: bool = True):
    """The click option of options field `f` (its metadata: flag, help, how it is read). `defaults` False: the
    option has no default of its own (convert's, whose defaults depend on the format)."""
    m = f.metadata
    kw = {"help": m["help"], "show_default": m["show_default"] and defaults}
    if m["is_flag"]:
        kw["is_flag"] = True
    elif m["choices"]:
        kw["type"] = click.Choice(list(m["choices"]), case_sensitive=m["case_sensitive"])
    elif m["click_type"] == "path":
        kw["type"] = click.Path(exists=m["must_exist"])
    elif m["click_type"]:
        kw["type"] = _CLICK_TYPES[m["click_type"]]
    if m["multiple"]:
        kw["multiple"] = True
    if m["flag_value"] is not None:
        kw.update(is_flag=False, flag_value=m["flag_value"])
    if m["metavar"]:
        kw["metavar"] = m["metavar"]
    if m["required"]:
        kw["required"] = True
    elif defaults and not m["is_flag"] and not m["multiple"]:
        kw["default"] = f.default
    decls = [m["flag"]] + ([m["secondary"]] if m["secondary"] else [])
    return click.option(*decls, f.name, **kw)


def _field_options(*classes, defaults: bool = True):
    """Decorator: a click option for every command-line field of `classes` (a name two classes share, once)."""
    seen: dict[str, object] = {}
    for cls in classes:
        for f in api.cli_fields(cls):
            seen.setdefault(f.name, f)

    def decorate(fn):
        for f in reversed(list(seen.values())):  # click lists the options in the order they are applied, reversed
            fn = _click_option(f, defaults=defaults)(fn)
        return fn

    return decorate


def _given(params: dict, *classes) -> dict:
    """The options the user gave (not click's defaults, which are the fields' own), as field values: a switch
    such as --no-mtp that turns a field off gives False."""
    ctx = click.get_current_context()
    negated = {f.name for cls in classes for f in api.cli_fields(cls) if f.metadata["negate"]}
    return {k: (not v if k in negated else v) for k, v in params.items()
            if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}


# --- commands are added below, one function each ---


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the full JSON (every tensor with its role).")
@_reports_errors
def inspect(model: str, as_json: bool) -> None:
    """Roles, tensor counts, parameters and bytes of MODEL (directory, hub repo id, config.json or .gguf).

    \b
    Examples:
      mixq inspect ./GLM-5.3-Flash
      mixq inspect ./GLM-5.3-Flash/config.json     # shapes only, no weights needed
      mixq inspect glm-Q4_K_M.gguf --json
    """
    d = api.inspect(model)
    if as_json:
        _print_json(d)
    else:
        click.echo(api.format_report(d))


@main.command(name="eval")
@click.argument("reference")
@click.argument("candidates", nargs=-1)
@click.option("--text", type=click.Path(), help="Held-out text file (not needed with --ref-logits); 'generated' or "
              "'generated:N': N replies the reference writes to --prompts (only their tokens scored); a token file "
              "(--save-generated) scores those replies again.")
@_field_options(api.EvalOptions)
@_reports_errors
def eval_cmd(reference, candidates, text, **params) -> None:
    """KLD, top-1 agreement and perplexity of CANDIDATES (HF dirs, EXL3 dirs, GGUF files) against REFERENCE.

    Scores the first 32 windows of --ctx tokens by default (like llama-perplexity --chunks 32); the progress
    bar shows the time left. --windows all scores the whole text.

    \b
    Examples:
      mixq eval ./GLM-5.3-Flash glm-Q4_K_M.gguf --text heldout.txt
      mixq eval ./GLM-5.3-Flash --text heldout.txt --save-ref ref.bin           # reference once
      mixq eval ./GLM-5.3-Flash glm-exl3 glm.gguf --ref-logits ref.bin --json -
      mixq eval ./GLM-5.3-Flash glm.gguf --text generated:16 --prompts heldout.txt --json own.json
      mixq eval ./GLM-5.3-Flash glm-exl3 --text own.tokens.json                 # the same replies again
    """
    given = _given(params, api.EvalOptions)
    json_out = given.pop("json_out", None)
    if json_out != "-":  # "-": the report is printed here, not written by evaluate
        given["json_out"] = json_out
    report = api.evaluate(reference, list(candidates), text, **given)
    if report is None:  # a rank other than 0 of a torchrun evaluation: rank 0 reports
        return
    if json_out == "-":
        _print_json(report)
    elif report["candidates"]:
        click.echo(api.render_markdown(report), nl=False)
    else:
        click.echo(f"reference log-probs written to {given.get('save_ref')}")


@main.command()
@click.argument("reports", nargs=-1, required=True)
@click.option("--plot", type=click.Path(), help="Write a KLD-vs-size PNG (log y).")
@click.option("--markdown", "markdown_out", type=click.Path(), help="Also write the table to OUT.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--overwrite", is_flag=True, help="Replace existing --plot / --markdown files.")
@_reports_errors
def compare(reports, plot, markdown_out, as_json, overwrite) -> None:
    """One table across `mixq eval --json` REPORTS (bytes, bpw, KLD, top-1, ΔPPL) and an optional plot.

    \b
    Examples:
      mixq compare q4.json q3.json exl3.json
      mixq compare reports/*.json --plot kld_vs_size.png --markdown table.md
    """
    res = api.compare(list(reports), plot=plot, markdown=markdown_out, overwrite=overwrite)
    if as_json:
        _print_json({"rows": res["rows"], "plot": res["plot"]})
    else:
        click.echo(res["markdown"], nl=False)


@main.command()
@click.argument("model")
@click.argument("out")
@click.option("--format", "fmt", type=click.Choice(["exl3", "gguf"]), default=None, help="Output format.  [default: gguf when OUT ends in .gguf, else exl3]")
@_field_options(api.Exl3Options, api.GGUFOptions, defaults=False)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_reports_errors
def convert(model, out, fmt, as_json, **params) -> None:
    """Convert MODEL (glm5_next dir / hub id, or a DFlash2 drafter) to OUT: a .gguf file (GGUF) or a directory
    (EXL3). Options another format uses, or that the chosen target does not use, are errors. Without a GPU an
    EXL3 conversion that would take more than a few minutes is refused unless --device cpu is given.

    \b
    Examples:
      mixq convert ./GLM-5.3-Flash glm-Q4_K_M.gguf --type Q4_K_M --imatrix glm.imatrix.gguf
      mixq convert ./GLM-5.3-Flash glm-Q4_K_M.gguf --type Q4_K_M --imatrix glm.imatrix.gguf --rounding hessian
      mixq convert ./GLM-5.3-Flash glm-108G.gguf --size 108GB --gguf-ladder iq
      mixq convert ./GLM-5.3-Flash glm-exl3-2.7 --bpw 2.7          # EXL3 (a directory); wants a GPU
      mixq convert ./GLM-5.3-Flash glm-gguf --format gguf --size 95GB,108GB,120GB   # a family, one pass
      mixq convert ./GLM-5.3-Flash glm-exl3 --format exl3 --bpw 2.5,3.05,4   # glm-exl3/GLM-5.3-Flash-exl3-2.5bpw/ ...

    \b
    A family (--bpw x,y,z or --size A,B,C) writes one member per target into the directory OUT, with family.json:
    GGUF <model>-<label>.gguf sharing one imatrix and one encode per (tensor, type); EXL3 <model>-exl3-<label>/
    sharing one set of error curves (--measure FILE, else measured once into OUT/<model>.exl3-curves.json), each
    member calibrated and trellis-encoded on its own (its layers see its own quantized hidden states). Run the
    same command again to keep the finished members and continue an interrupted one.
    """
    res = api.convert(model, out, fmt, **_given(params, api.Exl3Options, api.GGUFOptions))
    if res is None:  # a rank other than 0 of a torchrun conversion: rank 0 reports
        return
    if as_json:
        _print_json(res.to_dict())
    else:
        click.echo(res.summary())


@main.command()
@click.argument("out_dir")
@click.option("--base-model", default=None, help="Hub id of the source model for the card's base_model [default: the source directory's name].")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT_DIR/README.md.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@_reports_errors
def card(out_dir, base_model, overwrite, as_json) -> None:
    """Write OUT_DIR/README.md: a Hugging Face model card of the GGUF or EXL3 family in OUT_DIR (sizes, the scores
    `mixq eval MODEL OUT_DIR` recorded, how the files were made). Uploading stays yours (huggingface-cli upload).

    \b
    Examples:
      mixq convert ./GLM-5.3-Flash glm-gguf --format gguf --size 95GB,108GB,120GB
      mixq eval ./GLM-5.3-Flash glm-gguf --text heldout.txt
      mixq card glm-gguf --base-model zai-org/GLM-5.3-Flash
    """
    d = api.card(out_dir, base_model=base_model, overwrite=overwrite)
    if as_json:
        _print_json(d)
    else:
        click.echo(f"model card written to {d['card']}" + (f" (plot {d['plot']})" if d["plot"] else ""))


@main.command()
@click.argument("path")
@click.option("--no-decode", is_flag=True, help="Skip decoding the quantized tensors.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_reports_errors
def verify(path, no_decode, as_json) -> None:
    """Re-read an EXL3 dir or .gguf (written by mixq or anyone); exit 1 listing the problems.

    \b
    Examples:
      mixq verify glm-Q4_K_M.gguf
      mixq verify glm-exl3-2.7 --no-decode        # headers and sizes only, no trellis decode
    """
    rep = api.verify(path, decode=not no_decode)
    if as_json:
        _print_json(rep)
    else:
        for p in rep["problems"]:  # one line each, whatever names a damaged file holds
            click.echo(f"problem: {api.escape(p)}")
        n = len(rep["problems"])
        status = "OK" if not n else f"{n} problem(s)"
        click.echo(f"{path}: {status} ({rep.get('tensors', '?')} tensors, {rep.get('quantized', '?')} decoded)")
        if rep.get("integrity"):  # what could be checked: mixq's seal, or (written by anyone) structure and decode
            click.echo(f"{path}: {rep['integrity']}")
        if rep.get("receipt") == "checked":  # a family member's receipt, beside its sealed directory
            click.echo(f"{path}: its receipt ({os.path.basename(str(path).rstrip('/'))}.receipt.json) checked against "
                       "the units it holds")
    if rep["problems"]:
        sys.exit(1)


@main.command()
@click.argument("model", required=False)
@_field_options(api.PlanOptions)
@click.option("--tensors/--summary", "--per-tensor", "per_tensor", default=False, help="Also print every tensor pattern (layers/experts collapsed) with its bits/type mix.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (or fit) as JSON.")
@_reports_errors
def plan(model, per_tensor, as_json, **params) -> None:
    """Plan every tensor's bits/type and bytes for MODEL (or --from-config) before converting. Prints the
    per-role summary and the file size (--tensors: every tensor pattern too); with --fit, whether it fits.

    \b
    Examples:
      mixq plan ./GLM-5.3-Flash --format gguf --type Q4_K_M
      mixq plan --from-config config.json --format exl3 --size 108GB --fit 121GB --context 256K
      mixq plan ./GLM-5.3-Flash --format exl3 --bpw 2.7 --tensors
    """
    res = api.plan(model, **_given(params, api.PlanOptions))
    if as_json:
        _print_json(res.to_dict())
    elif hasattr(res, "headroom"):
        click.echo(res.format(per_tensor=per_tensor))
    else:
        click.echo(api.format_plan(res, per_tensor=per_tensor))


@main.command()
@click.option("--out", "out_dir", default=api.DEMO_DIR, show_default=True, type=click.Path(),
              help="Directory for the tiny checkpoint and every step's output.")
@click.option("--no-exl3", is_flag=True, help="Leave out the EXL3 conversion (the slowest step without a GPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the demo report as JSON.")
@_reports_errors
def demo(out_dir: str, no_exl3: bool, as_json: bool) -> None:
    """Write a tiny random glm5_next checkpoint and run every step on it: inspect, plan, GGUF and EXL3
    convert, verify, eval. A few minutes on 2 CPU cores; prints what each number means and what to try next.

    \b
    Examples:
      mixq demo
      mixq demo --out /tmp/mixq-demo --no-exl3 --json
    """
    report = api.demo(out_dir, progress=True, skip=("convert_exl3",) if no_exl3 else ())
    if as_json:
        _print_json(report)
    else:
        click.echo(api.format_demo(report))


@main.command()
@click.argument("model")
@click.argument("out")
@_field_options(api.ImatrixOptions)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_reports_errors
def imatrix(model, out, as_json, **params) -> None:
    """Collect an importance matrix of MODEL and write it as a llama.cpp GGUF imatrix file OUT.

    \b
    Examples:
      mixq imatrix ./GLM-5.3-Flash glm.imatrix.gguf --calibration calibration.txt
      mixq convert ./GLM-5.3-Flash glm-Q3_K_M.gguf --type Q3_K_M --imatrix glm.imatrix.gguf
    """
    d = api.imatrix(model, out, **_given(params, api.ImatrixOptions))
    if as_json:
        _print_json(d)
    else:
        click.echo(f"{d['file']}: {d['entries']} entries, {d['chunks']} chunks of {d['chunk_size']} tokens")
