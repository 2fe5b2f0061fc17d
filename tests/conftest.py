"""Shared test fixtures: paths into ../shared (present locally and in CI)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("MIXQ_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared fixture missing: {p}")
    return p


@pytest.fixture(scope="session")
def mini_model() -> Path:
    return shared_path("models", "glm5next-mini")


@pytest.fixture(scope="session")
def k256_model() -> Path:
    return shared_path("models", "glm5next-k256")


@pytest.fixture(scope="session")
def k256_fp8_model() -> Path:
    return shared_path("models", "glm5next-k256-fp8")


@pytest.fixture(scope="session")
def flash_config() -> Path:
    return shared_path("models", "glm-5.3-flash-shape", "config.json")


@pytest.fixture(scope="session")
def heldout_text() -> Path:
    return shared_path("data", "heldout.txt")


@pytest.fixture(scope="session")
def calibration_text() -> Path:
    return shared_path("data", "calibration.txt")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random BF16 glm5_next checkpoint (formats/tiny.py defaults: widths 128, KDA×3 + DSA, 2 experts,
    NextN block, vision tower, fixture tokenizer when ../shared is present)."""
    from mixq.formats.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16")


@pytest.fixture(scope="session")
def tiny_fp8_model(tmp_path_factory) -> Path:
    """The same random model as tiny_model (same seed), stored GLM-FP8 style in 2 shards + index."""
    from mixq.formats.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "fp8", fp8=True, shards=2)
