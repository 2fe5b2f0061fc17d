"""Shared eval fixtures: perturbed HF candidates of glm5next-mini and one evaluation run reused by several tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mixq.formats.checkpoint import open_checkpoint

CTX = 128  # > index_topk + kpool - 1 = 67: the DSA indexer runs sparse in the scored half
WINDOWS = 2


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run eval tests on one intra-op thread, restored afterwards: on a shared, oversubscribed CPU the
    OpenMP workers of a 2-thread pool spin against each other (a 128-token mini forward went from 0.27 s
    to 7 s), and a fixed thread count keeps float reductions reproducible."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def write_noisy_copy(src: Path, dst: Path, sigma: float, seed: int = 0) -> Path:
    """A copy of `src` whose ≥2-D weights are multiplied by (1 + sigma·N(0,1)), stored in BF16."""
    ck = open_checkpoint(src)
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ck.names():
        t = ck.get(name)
        if t.ndim >= 2 and sigma > 0:
            t = t * (1 + sigma * torch.randn(t.shape, generator=g))
        out[name] = t.to(torch.bfloat16).contiguous()
    save_file(out, str(dst / "model.safetensors"))
    shutil.copyfile(src / "config.json", dst / "config.json")
    return dst


@pytest.fixture(scope="session")
def noisy_candidates(mini_model, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("noisy")
    return (
        write_noisy_copy(mini_model, root / "noise-small", 0.01),
        write_noisy_copy(mini_model, root / "noise-large", 0.05),
    )


@pytest.fixture(scope="session")
def first_run(mini_model, heldout_text, noisy_candidates, tmp_path_factory):
    """REF vs [REF, small noise, large noise] on 2 windows of 128 tokens, saving the reference log-probs."""
    from mixq.eval import evaluate

    out = tmp_path_factory.mktemp("run1")
    ref_file = out / "ref.safetensors"
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # session fixtures run outside the per-test thread pinning
    try:
        report = evaluate(
            mini_model, [mini_model, *noisy_candidates], heldout_text, ctx=CTX, windows=WINDOWS,
            save_ref=ref_file, json_out=out / "report.json", markdown_out=out / "report.md", progress=False,
        )
    finally:
        torch.set_num_threads(old)
    return report, ref_file, out
