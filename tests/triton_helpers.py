"""Triton for the kernel tests: a test that needs it skips where it is absent, except under CI (the CI variable set,
as .ci/run sets it), where a missing Triton fails the test: CI installs it, so a skip there would hide the kernels."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module: str = "triton") -> ModuleType:
    """`module` imported; outside CI a skip when it cannot be, under CI a failure."""
    if not under_ci():
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} cannot be imported under CI ({e}); .ci/run installs Triton, so the kernel tests "
                    "must run", pytrace=False)
