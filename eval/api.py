"""`evaluate`: KLD / top-1 / PPL of candidates against the reference model, window by window."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mixq.errors import FormatError, InputError
from mixq.eval import candidates as cands
from mixq.eval import reference as refm
from mixq.eval.reflogits import RefLogitsReader, RefLogitsWriter
from mixq.eval.report import render_markdown
from mixq.eval.stats import KLAccumulator, log_probs, token_quantities
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.checkpoint_check import validate_checkpoint

ENGINES = ("torch", "llamacpp")


def _write_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _candidate_scorer(cand: cands.Candidate, ref_dir: Path, ref_weights: dict, n_layers: int, device, engine: str, cache_type: str, ctx: int, first: int):
    """A function window(int64 ctx) -> logits (scored, vocab) for one candidate.

    With engine 'llamacpp', GGUF candidates take llama.cpp's own logits; other formats always run in torch."""
    if engine == "llamacpp" and cand.format == "gguf":
        from mixq.eval.llamacpp import LlamaCppScorer

        return LlamaCppScorer(cand.path, ctx=ctx, first=first, cache_type=cache_type)
    weights = cands.merge_with_reference(cands.read_candidate_weights(cand), ref_weights, n_layers, cand.path)
    model = refm.build_model(ref_dir, weights, device)
    del weights
    return lambda window: refm.scored_logits(model, window, first)


def evaluate(
    reference: str | Path,
    candidates: list[str | Path] = (),
    text: str | Path | None = None,
    *,
    ctx: int | None = None,
    windows: int | None = None,
    score: str = "half",
    save_ref: str | Path | None = None,
    ref_logits: str | Path | None = None,
    ref_dtype: str = "float32",
    engine: str = "torch",
    cache_type: str = "f32",
    device: str | None = None,
    json_out: str | Path | None = None,
    markdown_out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Score every candidate against `reference` (an HF checkpoint) on `text`, returning the report dict.

    Windows of `ctx` tokens (default 512) are cut as llama-perplexity does and the second half of each
    (or all positions with score='all') is scored. With `ref_logits`, reference log-probs and tokens come
    from that file (no reference forward, no text needed); `save_ref` writes them for later runs.
    Candidates are held in memory together (dequantized, fp32) and run one window at a time.
    """
    if engine not in ENGINES:
        raise InputError(f"--engine must be one of {ENGINES}, not {engine!r}")
    if ref_logits and save_ref:
        raise InputError("--save-ref and --ref-logits cannot be combined")
    if not candidates and not save_ref:
        raise InputError("give at least one CANDIDATE (or --save-ref to only store reference log-probs)")
    ref_dir = Path(reference)
    if not ref_dir.is_dir():
        raise InputError(f"{reference}: the reference must be an HF checkpoint directory")
    validate_checkpoint(open_checkpoint(ref_dir))  # a reference whose config disagrees with its weights: refused
    dev = refm.pick_device(device)
    config = refm.read_config(ref_dir)
    n_layers = refm.num_hidden_layers(config)
    ref_weights = cands.read_hf_weights(ref_dir)
    ref_params = int(sum(t.numel() for t in ref_weights.values()))

    reader = None
    if ref_logits:
        reader = RefLogitsReader(Path(ref_logits))
        if ctx is not None and ctx != reader.ctx:
            raise InputError(f"--ctx {ctx} differs from {ref_logits} (ctx {reader.ctx})")
        n = reader.count if windows is None else min(windows, reader.count)
        win = refm.Windows(tokens=reader.tokens[:n], first=reader.first)
        text_name = reader.meta.get("text", "")
    else:
        if text is None:
            raise InputError("--text is required unless --ref-logits is given")
        ctx = ctx or 512
        tok = refm.load_tokenizer(ref_dir)
        ids = refm.tokenize_text(tok, Path(text), need_tokens=None if windows is None else windows * ctx)
        win = refm.make_windows(ids, ctx, windows, score)
        text_name = str(text)

    cand_list = [cands.open_candidate(c) for c in candidates]
    scorers = [
        _candidate_scorer(c, ref_dir, ref_weights, n_layers, dev, engine, cache_type, win.ctx, win.first) for c in cand_list
    ]
    ref_model = None if reader else refm.build_model(ref_dir, ref_weights, dev)
    del ref_weights

    writer = None
    if save_ref:
        vocab = int(config.get("text_config", config)["vocab_size"])
        writer = RefLogitsWriter(
            Path(save_ref), win.tokens, win.first, vocab, ref_dtype, meta={"reference": str(ref_dir), "text": text_name}
        )
    accs = [KLAccumulator() for _ in cand_list]
    secs = [0.0 for _ in cand_list]
    ref_secs = 0.0
    try:
        for w in tqdm(range(win.count), desc="eval windows", unit="win", disable=not progress):
            window = win.tokens[w]
            if reader is not None:
                lp = reader.logprobs(w)
            else:
                t0 = time.perf_counter()
                lp = log_probs(refm.scored_logits(ref_model, window, win.first))
                ref_secs += time.perf_counter() - t0
            if writer is not None:
                writer.add(lp)
                lp = lp.to(writer.torch_dtype).to(torch.float32)  # score exactly what a later --ref-logits run reads
            targets = win.targets(w)
            for i, scorer in enumerate(scorers):
                t0 = time.perf_counter()
                logits = scorer(window)
                secs[i] += time.perf_counter() - t0
                if not bool(torch.isfinite(logits).all()):
                    raise FormatError(f"{cand_list[i].path}: non-finite logits in window {w}")
                if logits.shape[-1] != lp.shape[-1]:
                    raise InputError(f"{cand_list[i].path}: vocabulary {logits.shape[-1]} differs from the reference {lp.shape[-1]}")
                accs[i].add(token_quantities(lp.to(logits.device), logits, targets))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()

    window_tokens = win.count * win.ctx
    report = {
        "reference": str(ref_dir),
        "text": text_name,
        "ctx": win.ctx,
        "score": "all" if win.first == 0 else "half",
        "windows": win.count,
        "engine": engine,
        "device": str(dev),
        "ref_params": ref_params,
        "ref_tokens_per_s": (window_tokens / ref_secs) if ref_secs > 0 else None,
        "ref_logits": str(ref_logits or save_ref or "") or None,
        "candidates": [],
    }
    for c, acc, s in zip(cand_list, accs, secs):
        entry = {"path": str(c.path), "format": c.format, "bytes": c.bytes, "bpw": c.bytes * 8 / ref_params}
        entry.update(acc.summary())
        entry["engine"] = engine if c.format == "gguf" else "torch"
        if entry["engine"] == "llamacpp":
            entry["cache_type"] = cache_type
        entry["tokens_per_s"] = window_tokens / s if s > 0 else None
        report["candidates"].append(entry)
    if json_out:
        _write_atomic(Path(json_out), json.dumps(report, indent=2) + "\n")
    if markdown_out:
        _write_atomic(Path(markdown_out), render_markdown(report))
    return report
