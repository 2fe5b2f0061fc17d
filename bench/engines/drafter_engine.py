"""exllamav3 1.6.5 driven for bench/engines/drafter_check.py: a glm5_next target and DFlash2 drafters loaded beside it,
greedy (speculative) generation through its Generator with the draft counts it reports, the hidden states the
target exports for a drafter, and single drafting rounds run the way the generator runs them.
Needs a CUDA machine with exllamav3 importable (its extension built).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch


def load_target(model_dir: Path, *, cache_tokens: int, max_batch: int, history: int):
    from exllamav3 import Cache, Config, Model, Tokenizer

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    # a recurrent (KDA) target rolls back speculative passes of up to `history` tokens
    cache = Cache(model, max_num_tokens=cache_tokens, max_history=history, max_batch_size=max_batch)
    model.load()
    return model, cache, Tokenizer.from_config(config)


def load_drafter(model_dir: Path, target, *, cache_tokens: int):
    from exllamav3 import Cache, Config, Model

    model = Model.from_config(Config.from_directory(str(model_dir)))
    cache = Cache(model, max_num_tokens=cache_tokens)  # the generator wants the target cache's size
    model.load()
    model.attach_to(target)  # the generator does it too; the manual drafting rounds need it first
    return model, cache


def prompts_from(text: Path, tokenizer, n: int, length: int) -> list[torch.Tensor]:
    """n consecutive `length`-token windows from the start of a text file, each (1, length)."""
    ids = tokenizer.encode(text.read_text(encoding="utf-8")[: 16 * n * length]).flatten()
    n = min(n, ids.numel() // length)
    return [ids[i * length:(i + 1) * length].view(1, length).clone() for i in range(n)]


def generate(target, cache, tokenizer, prompts: list[torch.Tensor], new_tokens: int, drafter=None,
             draft_cache=None) -> dict:
    """Greedy generation of every prompt (one batch of jobs); tokens per prompt and the draft counts."""
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(model=target, cache=cache, tokenizer=tokenizer, max_batch_size=len(prompts),
                    draft_model=drafter, draft_cache=draft_cache)
    jobs = [Job(input_ids=p, max_new_tokens=new_tokens, sampler=ArgmaxSampler(), identifier=i)
            for i, p in enumerate(prompts)]
    gen.enqueue(jobs)
    tokens: list[list[int]] = [[] for _ in prompts]
    accepted = rejected = 0
    t0 = time.time()
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "error":
                raise r["error"]
            if r.get("stage") != "streaming":
                continue
            i = r["job"].identifier
            if r.get("token_ids") is not None:
                tokens[i] += r["token_ids"].flatten().tolist()
            if r.get("eos"):
                accepted += int(r.get("accepted_draft_tokens", 0))
                rejected += int(r.get("rejected_draft_tokens", 0))
    seconds = time.time() - t0
    del gen
    drafted = accepted + rejected
    return {"tokens": tokens, "accepted": accepted, "drafted": drafted, "seconds": round(seconds, 2),
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_second": round(sum(map(len, tokens)) / seconds, 1)}


def greedy_without_cache(target, prompts: list[torch.Tensor], new_tokens: int, chunk: int = 256) -> list[list[int]]:
    """Greedy continuations through the cache-less forward (``target_states``' path): each step runs the whole
    prefix again. For targets the engine's generator cannot run (its recurrent KDA kernel wants 128 x 128 heads).
    The prompts must have equal lengths (they are batched)."""
    ids = torch.cat([p.reshape(1, -1) for p in prompts])
    vocab = target.config.vocab_size
    for _ in range(new_tokens):
        nxt = []
        for i in range(0, ids.shape[0], chunk):
            logits = target.forward(ids[i:i + chunk], {"attn_mode": "flash_attn_nc"})
            nxt.append(logits[:, -1, :vocab].argmax(-1).cpu())
        ids = torch.cat([ids, torch.cat(nxt)[:, None]], 1)
    p = prompts[0].numel()
    return [row[p:].tolist() for row in ids]


def target_states(target, ids: torch.Tensor, layers: list[int], chunk: int = 1):
    """exllamav3's exported hidden states of the target at `layers` (the states a drafter reads, in tap order:
    list of (N, T, H) fp16) and the target's greedy guess at every position (N, T). One row per forward by default,
    the cache-less path bench/engines/exllamav3_check.py runs."""
    per_layer: list[list[torch.Tensor]] = [[] for _ in layers]
    guesses = []
    vocab = target.config.vocab_size
    for i in range(0, ids.shape[0], chunk):
        params = {"attn_mode": "flash_attn_nc", "export_state_layers": set(layers)}
        logits = target.forward(ids[i:i + chunk], params)
        states = params.get("export_states") or []
        if len(states) != len(layers):
            raise RuntimeError(f"target exported {len(states)} states for tap layers {layers}")
        for acc, s in zip(per_layer, states):  # exported in execution order = sorted layer order
            acc.append(s.to(torch.float16).clone())
        guesses.append(logits[..., :vocab].argmax(-1).cpu().clone())
    order = sorted(range(len(layers)), key=lambda j: layers[j])
    stacked = [torch.cat(per_layer[order.index(j)]) for j in range(len(layers))]
    return stacked, torch.cat(guesses)


def engine_rounds(drafter, cache, target, states: list[torch.Tensor], taps: list[int], ids: torch.Tensor,
                  anchors: list[int], block: int):
    """One drafting round per (row, anchor) through the exllamav3 drafter, as the generator runs it: the draft
    cache gets the target states of positions < p (update_kv_from_target), then the block [ids[p], mask...] at
    positions p..p+b−1. `states` in tap order (`taps` = target_layer_ids). Returns draft logits
    (rows·anchors, b−1, V) float32 and the selector's tokens (rows·anchors, b−1)."""
    from exllamav3.constants import PAGE_SIZE

    # the target hands its states to the drafter in execution order; the drafter reorders them to its taps
    states = [states[j] for j in sorted(range(len(taps)), key=lambda j: taps[j])]
    n = ids.shape[0]
    pages = -(-(ids.shape[1] + block) // PAGE_SIZE)
    table = torch.arange(n * pages, dtype=torch.int32).view(n, pages)
    lm = target.modules[target.logit_layer_idx]
    vocab = target.config.vocab_size
    logits, paths = [], []
    with torch.inference_mode():
        for p in anchors:
            drafter.update_kv_from_target([s[:, :p] for s in states], cache,
                                          {"block_table": table, "cache_seqlens": torch.zeros(n, dtype=torch.int32)})
            params = {"attn_mode": "flash_attn", "block_table": table, "cache": cache,
                      "cache_seqlens": torch.full((n,), p, dtype=torch.int32)}
            state = drafter.forward(ids[:, p:p + 1].clone(), params)
            out = lm.forward(lm.prepare_for_device(state.half(), {}), {})
            logits.append(out[:, 1:, :vocab].float().cpu())
            paths.append(drafter.sample_from_state(state, params)[:, 1:].cpu())
    return torch.stack(logits, 1).flatten(0, 1).clone(), torch.stack(paths, 1).flatten(0, 1).clone()
