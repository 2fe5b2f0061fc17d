"""Command-line interface: click commands only; every command calls one public API function.

Only this module turns a MixqError into one stderr line and exit code 2.
"""
from __future__ import annotations

import functools
import json
import sys

import click

from mixq.errors import MixqError


def _reports_errors(fn):
    """Turn MixqError (user mistakes) into one line on stderr and exit 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MixqError as e:
            click.echo(f"mixq: error: {e}", err=True)
            sys.exit(2)

    return wrapper


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@click.group()
@click.version_option(package_name="mixq")
def main() -> None:
    """mixq: plan, quantize (EXL3 / GGUF), verify and evaluate glm5_next MoE checkpoints."""


# --- commands are added below, one function each ---


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the full JSON (every tensor with its role).")
@_reports_errors
def inspect(model: str, as_json: bool) -> None:
    """Roles, tensor counts, parameters and bytes of MODEL (directory, hub repo id, config.json or .gguf)."""
    from mixq.formats.inspect import format_report, inspect_path

    d = inspect_path(model)
    if as_json:
        _print_json(d)
    else:
        click.echo(format_report(d))
