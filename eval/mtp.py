"""`mixq eval --mtp`: the NextN (MTP) head's draft agreement of each candidate.

At position t the NextN head drafts token t+2 from the model's own final hidden state at t and the embedding of
the true token t+1 (runtime/nextn.py). Its draft agrees when it equals the reference's own next-next token: the
reference's argmax at t+1 given the text up to t+1 (what greedy speculative decoding would accept). Each torch
candidate's head runs on that candidate's own trunk; the reference's head on the reference's trunk gives the
figure a candidate is compared with (`mtp_relative` = candidate / reference). Positions t scored: the window's
scored positions whose t+1 is still in the window.

Candidates and reference are scored on the same positions, so their difference is read paired: `mtp_gained` /
`mtp_lost` count the positions where only the candidate's / only the reference's draft agrees, and `mtp_delta_se`
is the standard error of the per-position difference. Most positions agree or fail in both heads, so the paired
error is far smaller than two independent rates' would be, and a small loss can be told from noise.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mixq.eval.streamed import StreamedModel, StreamedModels
from mixq.runtime.layer_stream import EMBED_NAME, HEAD_NAME, NORM_NAME
from mixq.runtime.nextn import build_nextn, nextn_inputs

NOT_RUN = {"llamacpp": "llama.cpp does not run the NextN block (its MTP graph is not built)",
           "exllamav3": "the exllamav3 engine scores the trunk only here"}
NO_BLOCK = "the file holds no NextN block"


class _Head:
    """One model's final norm, embedding, lm_head and NextN block on the device."""

    def __init__(self, models: StreamedModels, m: StreamedModel, layer: int) -> None:
        dev = models.device
        self.norm = m.source.get(NORM_NAME)
        self.embed = m.source.get(EMBED_NAME).to(dev)
        self.lm_head = m.source.get(HEAD_NAME).to(dev)
        weights = m.source.nextn_layer(layer)
        self.block = None if not weights else build_nextn(models.stream.text_config, layer, weights.__getitem__,
                                                          device=dev, groups=models.stream.groups)


@torch.no_grad()
def _window(models: StreamedModels, m: StreamedModel, head: _Head, w: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the model's argmax at every position (ctx,), its NextN drafts (ctx-1,) or None) for window w."""
    h = models.stream.final_hidden(m.hidden[w:w + 1], head.norm)
    top = F.linear(h[0], head.lm_head).argmax(-1)
    if head.block is None:
        return top, None
    e = F.embedding(models.tokens[w:w + 1].to(models.device), head.embed)
    out, _ = models.stream.forward_batch(head.block, nextn_inputs(h, e), None)
    return top, F.linear(out[0], head.lm_head).argmax(-1)


def draft_agreement(models: StreamedModels, windows: list[int], first: int, layer: int) -> list[dict]:
    """Per streamed model (models.models order; the first is the reference): {"agreement", "agreed",
    "positions", "gained", "lost"} of its NextN drafts against the reference's next-next tokens ("gained" /
    "lost": positions where only its draft / only the reference's draft agrees), or {"note"} without a block."""
    ctx = models.tokens.shape[1]
    start = max(first, 0)
    heads = [_Head(models, m, layer) for m in models.models]
    agreed, gained, lost = [0] * len(heads), [0] * len(heads), [0] * len(heads)
    n = 0
    for j, _w in enumerate(windows):
        ref_top, ref_drafts = _window(models, models.models[0], heads[0], j)
        target = ref_top[start + 1:ctx]  # the reference's token t+2 for t = start .. ctx-2
        n += target.numel()
        ref_hit = None if ref_drafts is None else ref_drafts[start:ctx - 1] == target
        for k, (m, head) in enumerate(zip(models.models, heads)):
            if head.block is None:
                continue
            drafts = ref_drafts if k == 0 else _window(models, m, head, j)[1]
            hit = drafts[start:ctx - 1] == target
            agreed[k] += int(hit.sum())
            if ref_hit is not None:
                gained[k] += int((hit & ~ref_hit).sum())
                lost[k] += int((ref_hit & ~hit).sum())
    return [{"note": NO_BLOCK} if h.block is None else
            {"agreement": agreed[k] / n if n else 0.0, "agreed": agreed[k], "positions": n,
             "gained": gained[k], "lost": lost[k]}
            for k, h in enumerate(heads)]


def paired_difference(gained: int, lost: int, positions: int) -> tuple[float, float]:
    """(mean, standard error) of the per-position difference candidate - reference, each position +1 (only the
    candidate agrees), -1 (only the reference) or 0."""
    if positions <= 0:
        return 0.0, 0.0
    delta = (gained - lost) / positions
    var = max((gained + lost) / positions - delta * delta, 0.0)
    return delta, math.sqrt(var / positions)


def add_to_report(report: dict, models: StreamedModels, candidates: list, sources: list, engine: str,
                  windows: list[int], first: int, layer: int) -> None:
    """The draft agreement into `report` ("mtp": the reference's) and each candidate's entry ("mtp_agreement",
    "mtp_relative", the paired "mtp_gained" / "mtp_lost" / "mtp_delta" / "mtp_delta_se", or "mtp_note" where its
    head cannot run)."""
    got = draft_agreement(models, windows, first, layer)
    ref = got[0]
    report["mtp"] = {"nextn_layer": layer, **ref}
    by_source = {id(m.source): g for m, g in zip(models.models[1:], got[1:])}
    for entry, src in zip(report["candidates"], sources):
        g = by_source.get(id(src)) if src is not None else {"note": NOT_RUN.get(engine, "not run")}
        if "note" in g or "note" in ref:
            entry["mtp_note"] = g.get("note") or ref["note"]
            continue
        entry["mtp_agreement"] = g["agreement"]
        entry["mtp_relative"] = g["agreement"] / ref["agreement"] if ref["agreement"] else None
        entry["mtp_gained"], entry["mtp_lost"] = g["gained"], g["lost"]
        entry["mtp_delta"], entry["mtp_delta_se"] = paired_difference(g["gained"], g["lost"], g["positions"])
