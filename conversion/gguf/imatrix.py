"""`mixq imatrix`: an importance matrix from a calibration forward, in llama.cpp's GGUF imatrix format.

`collect_imatrix(model, calibration)` runs runtime/calibration layer by layer and keys Σx² per input column (and
the row counts) by GGUF tensor name; `make_imatrix(model, out, ...)` checks OUT first, then collects and writes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from mixq.errors import InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.checkpoint_check import validate_checkpoint
from mixq.formats.gguf_names import TOKEN_EMBD, gguf_tensors
from mixq.formats.imatrix_file import IMatrix, write_imatrix
from mixq.quant.device import resolve_device
from mixq.runtime import profile
from mixq.runtime.calibration import (CALIBRATION_ROWS, CALIBRATION_SEQ_LEN, LayerCalibrator, calibration_rows,
                                      load_tokenizer)

from mixq.formats.outputs import check_free_space, check_outputs, writing
from mixq.runtime.memory_budget import announce, checkpoint_shapes, expert_group, imatrix_estimate, resolve_budget


def imatrix_bytes(model) -> int:
    """An upper bound of the imatrix file's size: a float32 sum and a count per input column of every matrix
    (per expert for stacked experts), plus 1 MiB of names and metadata (GLM-5.3: ~0.8 GB)."""
    n = 0
    for s in gguf_tensors(open_checkpoint(model)):
        if len(s.shape) >= 2:
            n += (s.shape[0] if len(s.shape) == 3 else 1) * (int(s.shape[-1]) + 1) * 4
    return n + 2**20


def collect_imatrix(model, calibration=None, *, rows: int = CALIBRATION_ROWS, seq_len: int = CALIBRATION_SEQ_LEN, device: str | None = None,
                    datasets: list[str] | None = None, progress: bool = True, gpu_memory: int | None = None,
                    memory: dict | None = None):
    """Importance matrix of `model` from a calibration forward (runtime/calibration, layer by layer), keyed by
    GGUF tensor name as llama-imatrix keys it: Σx² per input column and the row count, one vector per expert
    for `*_exps`. Differences to llama-imatrix: every calibration token passes through every routed expert
    (so expert counts equal the token count, none is left at 0), output.weight is always included, and the NextN
    block is run as the model runs it (the trunk's final hidden state at t with token t+1's embedding), so its
    matmuls have entries too. attn_k_b/v_b (made from kv_b by a transform) get no entry, as in llama-imatrix.
    `gpu_memory`: the device's budget (None: its free memory); the estimate is said on stderr (with `progress`),
    a budget the calibration cannot meet refused, and the estimate stored into `memory` when given."""
    dev = resolve_device(device)  # before the checkpoint is read: a missing CUDA is a one-line error
    with profile.stage("open"):
        ckpt = open_checkpoint(model)
        profile.note_layers(ckpt.config)
        profile.note_device(dev)
        validate_checkpoint(ckpt)
        ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows, seq_len=seq_len,
                               vocab_size=int(ckpt.text_config["vocab_size"]))
    # after the inputs are checked (a refusal stays the one line on stderr), before the forward
    est = imatrix_estimate(resolve_budget(gpu_memory, dev), checkpoint_shapes(ckpt), rows=rows, seq_len=seq_len)
    said = announce(est, "imatrix", show=progress)
    if memory is not None:
        memory.update(said)
    specs = [s for s in gguf_tensors(ckpt)
             if len(s.shape) >= 2 and s.transform in ("none", "stack") and s.name != TOKEN_EMBD]
    by_hf: dict[str, list] = {}
    for s in specs:
        for e, h in enumerate(s.hf_names):
            by_hf.setdefault(h, []).append((s, e))
    im = IMatrix(datasets=list(datasets or [str(c) for c in (calibration or ["builtin"])]),
                 chunk_count=int(ids.shape[0]), chunk_size=int(ids.shape[1]))
    pending: dict[str, dict[int, tuple]] = {}
    cal = LayerCalibrator(ckpt, ids, device=dev, full=False, nextn=True,
                          expert_group=expert_group(est.stage("calibration")))
    walk = profile.timed("calibrate", cal.stages(), lambda st: profile.walk_label(st.layer, ckpt.num_hidden_layers))
    total = ckpt.num_hidden_layers + 1 + len(ckpt.nextn_layers[:1])
    for stage in tqdm(walk, total=total, desc="imatrix", disable=not progress):
        for hf, acc in stage.stats.items():
            for s, e in by_hf.get(hf, []):
                if acc.count == 0 or acc.dim != s.shape[-1]:
                    continue
                pending.setdefault(s.name, {})[e] = (acc.sum_sq.cpu().numpy(), acc.count)
    for s in specs:
        got = pending.get(s.name)
        if not got or len(got) != len(s.hf_names):
            continue
        im.add(s.name, np.stack([got[e][0] for e in range(len(s.hf_names))]),
               np.array([got[e][1] for e in range(len(s.hf_names))], dtype=np.float64))
    return im


def make_imatrix(model, out, calibration=None, *, rows: int = CALIBRATION_ROWS, seq_len: int = CALIBRATION_SEQ_LEN, device: str | None = None,
                 progress: bool = True, overwrite: bool = False, profile_out=None,
                 gpu_memory: int | None = None) -> dict:
    """Collect an importance matrix (`collect_imatrix`) and write it in llama.cpp's GGUF imatrix format. OUT may
    not be an input, nor an existing file unless `overwrite`. `profile_out`: write the run's profile there
    (runtime/profile.py)."""
    check_outputs({"OUT": out, "--profile": profile_out},
                  {"MODEL": model, **{f"--calibration {i + 1}": c for i, c in enumerate(calibration or [])}},
                  overwrite=overwrite)
    out = Path(out)
    check_free_space(out, imatrix_bytes(model), "the importance matrix")
    memory: dict = {}
    with profile.recording(profile_out, "imatrix", "gguf", table=progress):
        im = collect_imatrix(model, calibration, rows=rows, seq_len=seq_len, device=device, progress=progress,
                             gpu_memory=gpu_memory, memory=memory)
        if not im.sums:  # a file with no entries would be refused by every conversion that reads it
            raise InputError(f"OUT {out}: the calibration forward gave no tensor importance data; nothing written")
        out.parent.mkdir(parents=True, exist_ok=True)
        with writing(out), profile.stage("write"):
            path = write_imatrix(out, im)
    return {"file": str(path), "entries": len(im.sums), "chunks": im.chunk_count, "chunk_size": im.chunk_size,
            "datasets": im.datasets, "memory": memory}


