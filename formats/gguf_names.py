"""The upstream llama.cpp `glm5-next` tensor list: HF checkpoint tensors -> GGUF tensors, and the data transforms.

GGUF names and transforms come from the architecture table (formats/glm5next). `gguf_tensors(ckpt)` walks a
Checkpoint's names (shapes only, no data needed) and returns every tensor of the text GGUF in file order, with
the HF tensors each is built from. Facts: ../shared/reference/gguf-glm5-next.md §2.

Transforms (applied by `build_tensor`, undone by `unbuild_tensor`):
  none         plain rename
  stack        routed experts stacked in expert order: E x (out, in) -> (E, out, in)
  kv_b_k       K_nope half of kv_b, per head transposed -> (H, r_kv, n)
  kv_b_v       V half of kv_b, per head as is -> (H, v, r_kv)
  neg_exp      A_log -> -exp(A_log) in f32, flattened to (H,)
  conv         conv1d (Dk, 1, c) -> (1, Dk, 1, c), a pure reshape
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mixq.errors import FormatError, InputError
from mixq.formats.glm5next import classify, global_gguf_name, gguf_sources

TOKEN_EMBD = global_gguf_name("embed")
OUTPUT = global_gguf_name("lm_head")


@dataclass
class GGUFTensorSpec:
    """One tensor of the glm5-next GGUF. `shape` is the numpy shape handed to gguf-py (row = shape[-1])."""

    name: str
    hf_names: list[str]
    shape: tuple[int, ...]
    role: str
    layer: int | None
    mtp: bool
    transform: str
    extra: dict = field(default_factory=dict)  # transform parameters (kv_b: heads, nope, v)
    policy: str = "quant"  # glm5next GGUF policy: quant | q8_floor | keep | f32


def _tc(ckpt) -> dict:
    return getattr(ckpt, "text_config", None) or ckpt.config.get("text_config", ckpt.config)


def gguf_tensors(ckpt, include_mtp: bool = True) -> list[GGUFTensorSpec]:
    """Every tensor of the glm5-next text GGUF built from `ckpt` (a Checkpoint; shapes only, no data read).

    Names and roles come from formats/glm5next.classify; vision tensors are dropped (they go to the
    mmproj); with include_mtp=False the NextN block is left out. Order: token_embd, blocks, output_norm, output.
    """
    tc = _tc(ckpt)
    n_trunk = int(ckpt.num_hidden_layers)
    specs: dict[str, GGUFTensorSpec] = {}
    stacks: dict[str, dict[int, str]] = {}
    for name in ckpt.names():
        info = classify(name, n_trunk)
        if not info.gguf_names:  # vision -> mmproj
            continue
        if info.mtp and not include_mtp:
            continue
        shape = tuple(int(s) for s in ckpt.shape(name))
        for gname, tr in zip(info.gguf_names, info.gguf_transforms):
            common = dict(role=info.role, layer=info.layer, mtp=info.mtp, transform=tr, policy=info.gguf)
            if tr == "stack":
                stacks.setdefault(gname, {})[int(info.expert)] = name
                if gname not in specs:
                    specs[gname] = GGUFTensorSpec(gname, [], shape, **common)
                continue
            extra: dict = {}
            if tr in ("kv_b_k", "kv_b_v"):
                h = int(tc["num_attention_heads"])
                n = int(tc["qk_nope_head_dim"]) + int(tc.get("qk_rope_head_dim") or 0)
                v = int(tc["v_head_dim"])
                rows, r_kv = shape
                if rows != h * (n + v):
                    raise FormatError(f"{name}: {rows} rows, but config.json's num_attention_heads {h} x "
                                      f"(qk_nope_head_dim {int(tc['qk_nope_head_dim'])} + qk_rope_head_dim "
                                      f"{int(tc.get('qk_rope_head_dim') or 0)} + v_head_dim {v}) is {h * (n + v)}")
                extra = {"heads": h, "nope": n, "v": v}
                gshape = (h, r_kv, n) if tr == "kv_b_k" else (h, v, r_kv)
            elif tr == "neg_exp":
                lac = tc.get("linear_attn_config") or {}
                gshape = (int(tc.get("linear_num_heads") or lac.get("num_heads") or tc["num_attention_heads"]),)
            elif tr == "conv":
                if len(shape) != 3:
                    raise FormatError(f"{name}: conv1d weight should be (channels, 1, kernel), got {shape}")
                gshape = (1,) + shape
            else:
                gshape = shape
            if gname in specs:
                raise FormatError(f"{name}: second tensor for GGUF name {gname} (from {specs[gname].hf_names[0]})")
            specs[gname] = GGUFTensorSpec(gname, [name], gshape, extra=extra, **common)
    for gname, members in stacks.items():
        spec = specs[gname]
        idx = sorted(members)
        if idx != list(range(len(idx))):
            raise _expert_gap(gname, members)
        spec.hf_names = [members[e] for e in idx]
        spec.shape = (len(idx),) + spec.shape
    if OUTPUT not in specs and TOKEN_EMBD in specs:
        # tied embeddings: the loader requires output.weight (no fallback to token_embd)
        te = specs[TOKEN_EMBD]
        specs[OUTPUT] = GGUFTensorSpec(OUTPUT, list(te.hf_names), te.shape, "lm_head", None, False, "none",
                                       policy="quant")
    return sorted(specs.values(), key=_order)


def _expert_gap(gname: str, members: dict[int, str]) -> InputError:
    """The error for an expert stack with holes: it names the first missing expert's tensor as the checkpoint
    spells it (the canonical name from the table), not the GGUF stack it would have gone into."""
    n = max(members) + 1
    missing = [e for e in range(n) if e not in members]
    src = gguf_sources(gname, (n,))
    name = src.hf_names[missing[0]] if src is not None and len(src.hf_names) == n else f"expert {missing[0]}"
    return InputError(f"{name}: routed expert {missing[0]} is missing from the checkpoint ({len(missing)} of "
                      f"experts 0..{n - 1} missing; the GGUF tensor {gname} stacks them all)")


def _order(s: GGUFTensorSpec):
    if s.name == TOKEN_EMBD:
        return (0, 0, "")
    if s.layer is None:
        return (2, 0, s.name)
    return (1, s.layer, s.name)


def build_tensor(spec: GGUFTensorSpec, get) -> torch.Tensor:
    """Make the float32 tensor of `spec` from HF tensors; `get(hf_name) -> torch.Tensor` loads one."""
    tr = spec.transform
    if tr == "stack":
        out = torch.empty(spec.shape, dtype=torch.float32)
        for e, n in enumerate(spec.hf_names):
            out[e] = get(n).float()
        return out
    w = get(spec.hf_names[0]).float()
    if tr == "none":
        t = w
    elif tr == "conv":
        t = w.reshape(spec.shape)
    elif tr == "neg_exp":
        t = -torch.exp(w.flatten()[: spec.shape[0]])
    elif tr in ("kv_b_k", "kv_b_v"):
        h, n, v = spec.extra["heads"], spec.extra["nope"], spec.extra["v"]
        w3 = w.reshape(h, n + v, w.shape[-1])
        t = w3[:, :n, :].transpose(1, 2) if tr == "kv_b_k" else w3[:, n:, :]
    else:
        raise FormatError(f"{spec.name}: unknown transform {tr!r}")
    if tuple(t.shape) != tuple(spec.shape):
        raise FormatError(f"{spec.name}: built shape {tuple(t.shape)} != expected {spec.shape}")
    return t.contiguous()


def unbuild_tensor(spec: GGUFTensorSpec, t: torch.Tensor, hf_shapes: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """Inverse of `build_tensor`: GGUF tensor -> {hf_name: tensor} (kv_b halves come back as partial dicts
    keyed `hf_name` with the other half missing; `merge_kv_b` joins them)."""
    tr = spec.transform
    if tr == "stack":
        return {n: t[e] for e, n in enumerate(spec.hf_names)}
    name = spec.hf_names[0]
    if tr == "none":
        return {name: t}
    if tr == "conv":
        # HF keeps (channels, 1, kernel); mixq writes (1, channels, 1, kernel), llama-quantize may keep 3-D
        return {name: t.reshape(-1, 1, spec.shape[-1])}
    if tr == "neg_exp":
        # A_log = log(-ssm_a); values are negative by construction
        a = torch.log(-t.float())
        shp = (hf_shapes or {}).get(name)
        return {name: a.reshape(shp) if shp else a}
    if tr == "kv_b_k":
        return {name + "#k": t.transpose(1, 2)}
    if tr == "kv_b_v":
        return {name + "#v": t}
    raise FormatError(f"{spec.name}: unknown transform {tr!r}")


def merge_kv_b(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Join `name#k` (H, n, r) and `name#v` (H, v, r) halves back into kv_b (H*(n+v), r)."""
    out = {k: v for k, v in parts.items() if "#" not in k}
    for key in [k for k in parts if k.endswith("#k")]:
        base = key[:-2]
        vkey = base + "#v"
        if vkey not in parts:
            raise InputError(f"{base}: attn_v_b missing, cannot rebuild kv_b")
        k, v = parts[key], parts[vkey]
        w = torch.cat([k, v], dim=1)
        out[base] = w.reshape(-1, w.shape[-1])
    return out
