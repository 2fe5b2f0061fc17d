"""The reference's own replies: continuations of prompts decoded by transformers' glm5_next forward.

`generate` runs the whole reference (runtime/reference.py `build_model`, float32) once over every prompt at once
(all prompts have the same token length, so no padding and no attention mask), then one token per step with the
key/value and recurrent state transformers keeps for glm5_next (`DynamicCache`): each step costs one position per
sequence, never a recompute of the prefix. Every continuation has exactly `tokens` tokens: an end-of-text token
does not stop it (the scored sequences then all have one length; what follows such a token is still the model's
own output). Row i is greedy (argmax, first maximum) when `greedy[i]`, else sampled at `temperature` from its own
CPU generator seeded with `seeds[i]`: a seed names the same draws on every device.

Memory bound: the whole reference in float32 plus the cache of `len(prompts)` sequences of prompt + `tokens`
positions; a model that does not fit generates elsewhere and hands over the token file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mixq.errors import InputError


@dataclass(frozen=True)
class Continuations:
    """Generated token ids: `prompts` (n, prompt_len) and `continuations` (n, tokens), int64 on the CPU."""

    prompts: torch.Tensor
    continuations: torch.Tensor

    @property
    def sequences(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.continuations], dim=1)


def _next_tokens(logits: torch.Tensor, greedy: Sequence[bool], temperature: float,
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row from float32 logits (n, vocab): argmax where greedy, else a draw from softmax(l / T)."""
    out = logits.argmax(-1).cpu()
    if all(greedy):
        return out
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    for i, g in enumerate(greedy):
        if not g:
            out[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return out


@torch.inference_mode()
def generate(model: torch.nn.Module, prompts: torch.Tensor, tokens: int, *, greedy: Sequence[bool],
             seeds: Sequence[int | None], temperature: float = 1.0,
             progress: Callable[[int], None] | None = None) -> Continuations:
    """`tokens` new tokens after each row of `prompts` (int64 (n, prompt_len)), KV-cached.

    `greedy[i]`: row i decodes greedily; otherwise it samples at `temperature` (> 0) with a CPU generator seeded
    `seeds[i]`. `progress(step)` is called after each new token."""
    n = prompts.shape[0]
    if len(greedy) != n or len(seeds) != n:
        raise ValueError(f"{n} prompts, {len(greedy)} greedy flags, {len(seeds)} seeds")
    if tokens < 1:
        raise InputError(f"continuation length {tokens}: expected at least 1 token")
    if not all(greedy) and not temperature > 0:
        raise InputError(f"sampling temperature {temperature}: expected > 0")
    gens = []
    for g, s in zip(greedy, seeds):
        if g:
            gens.append(None)
            continue
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(s))
        gens.append(gen)
    device = next(model.parameters()).device
    out = model(input_ids=prompts.to(device), use_cache=True, logits_to_keep=1)
    cache, new = out.past_key_values, []
    for step in range(tokens):
        nxt = _next_tokens(out.logits[:, -1].float(), greedy, temperature, gens)
        new.append(nxt)
        if progress is not None:
            progress(step + 1)
        if step + 1 == tokens:
            break
        out = model(input_ids=nxt.view(n, 1).to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    return Continuations(prompts=prompts.cpu().to(torch.int64), continuations=torch.stack(new, dim=1).to(torch.int64))
