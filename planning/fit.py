"""``mixq plan --fit``: the largest plan whose weights + cache + reserve fit a machine at a given context.

memory = weights (the plan's file bytes) + cache (``planning/memory``) + reserve (compute buffers, scratch,
driver) + companions (the mmproj file, a drafter). The weights budget is what is left; the allocator plans to
it exactly as ``--size`` does. With ``--devices`` the layers are split in order over the cards (llama.cpp's
layer split, exllamav3's autosplit) and each card must hold its layers' weights and cache plus its share of
the reserve. docs/memory-model.md documents every term and the defaults.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence

from mixq.errors import InputError, PlanError
from mixq.planning import memory as mem
from mixq.planning.display import format_plan
from mixq.planning.planner import plan_model
from mixq.planning.sizes import parse_context, parse_size, parse_size_option
from mixq.planning.types import Plan

# Compute/scratch reserve per engine when --reserve is not given: llama.cpp's compute buffers at the default
# n_ubatch 512 plus backend/driver context, exllamav3's forward scratch at its default chunk size. A round,
# documented default (docs/memory-model.md §4), not a measurement.
DEFAULT_RESERVE = {"gguf": 4 * 10**9, "exl3": 4 * 10**9}
DEFAULT_CACHE = {"gguf": "f16", "exl3": "fp16"}
_LAYER = re.compile(r"(?:^blk\.|\.layers\.)(\d+)\.")


@dataclass
class DeviceSplit:
    capacity: list[int]
    used: list[int]
    layers: list[list[int]]
    fits: bool
    note: str = ""

    def to_dict(self) -> dict:
        return {"capacity": self.capacity, "used": self.used, "layers": [[min(x), max(x)] if x else [] for x in
                                                                        self.layers], "fits": self.fits,
                "note": self.note}


@dataclass
class FitResult:
    fit_bytes: int
    context: int
    cache: mem.CacheBytes
    reserve: int
    companions: int
    plan: Plan
    devices: DeviceSplit | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def weights(self) -> int:
        return self.plan.total_bytes

    @property
    def total(self) -> int:
        return self.weights + self.cache.total + self.reserve + self.companions

    @property
    def headroom(self) -> int:
        return self.fit_bytes - self.total

    def to_dict(self) -> dict:
        return {"fit_bytes": self.fit_bytes, "context": self.context, "weights_bytes": self.weights,
                "cache_bytes": self.cache.total, "cache": self.cache.to_dict(), "reserve_bytes": self.reserve,
                "companion_bytes": self.companions, "total_bytes": self.total, "headroom_bytes": self.headroom,
                "devices": self.devices.to_dict() if self.devices else None, "notes": self.notes,
                "plan": self.plan.to_dict()}

    def format(self, per_tensor: bool = False) -> str:
        c = self.cache
        gb = lambda b: f"{b / 1e9:9.3f} GB"  # noqa: E731
        lines = [format_plan(self.plan, per_tensor=per_tensor), "",
                 f"fit {self.fit_bytes / 1e9:.3f} GB at context {self.context} ({c.engine}, cache {c.cache_type})",
                 f"  weights    {gb(self.weights)}",
                 f"  cache      {gb(c.total)}  (MLA {c.mla / 1e9:.3f} + indexer {(c.indexer + c.kpool) / 1e9:.3f}"
                 f" + KDA state {c.fixed / 1e9:.3f}; {c.per_token:.0f} B/token)",
                 f"  reserve    {gb(self.reserve)}",
                 f"  companions {gb(self.companions)}",
                 f"  total      {gb(self.total)}",
                 f"  headroom   {gb(self.headroom)}"]
        if self.devices:
            d = self.devices
            for i, (cap, used, ls) in enumerate(zip(d.capacity, d.used, d.layers)):
                span = f"layers {min(ls)}-{max(ls)}" if ls else "no layers"
                lines.append(f"  device {i}: {used / 1e9:.3f} / {cap / 1e9:.3f} GB, {span}")
            lines.append(f"  split: {'fits' if d.fits else 'does NOT fit'} {d.note}".rstrip())
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def cache_for(fmt: str, ckpt, context: int, cache: str | None, *, n_seq: int = 1,
              flash_attn: bool | None = None) -> mem.CacheBytes:
    """The cache of the engine that runs ``fmt`` (gguf: llama.cpp, exl3: exllamav3) for this checkpoint."""
    known = mem.LLAMA_CACHE_TYPES if fmt == "gguf" else mem.EXL3_CACHE_BITS
    if cache is not None and str(cache).lower() not in known:
        raise InputError(f"--cache {cache!r}: not a {'llama.cpp' if fmt == 'gguf' else 'exllamav3'} cache type; "
                         f"use one of {', '.join(known)}")
    geo = mem.CacheGeometry.from_config(ckpt.text_config)
    if fmt == "gguf":
        return mem.llama_cpp_cache(geo, context, cache_type=cache or DEFAULT_CACHE[fmt], flash_attn=flash_attn,
                                   n_seq=n_seq)
    return mem.exllamav3_cache(geo, context, cache=cache or DEFAULT_CACHE[fmt], batch=n_seq)


def mmproj_bytes(ckpt) -> int:
    """The vision projector file: the vision tower in F16 (F32 for 1-D tensors) plus ~1 MB of metadata."""
    n = 0
    for name in ckpt.names():
        if ckpt.info(name).role == "vision":
            shape = ckpt.shape(name)
            n += math.prod(shape) * (4 if len(shape) < 2 else 2)
    return n + 10**6


def split_layers(plan: Plan, cache: mem.CacheBytes, ckpt, capacities: Sequence[int], reserve: int) -> DeviceSplit:
    """Fill the cards in layer order (llama.cpp --split-mode layer / exllamav3 autosplit); tensors outside the
    layers (embedding, head, final norm, vision) go to the first/last card; the reserve is shared evenly."""
    n = ckpt.num_hidden_layers
    kinds = ckpt.layer_types
    per_layer = {}
    outside_first, outside_last = 0, 0
    for t in plan.tensors:
        m = _LAYER.search(t.name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + t.bytes
        elif t.role in ("embed", "vision"):
            outside_first += t.bytes
        else:
            outside_last += t.bytes
    geo = mem.CacheGeometry.from_config(ckpt.text_config)
    dsa_each = (cache.mla + cache.indexer + cache.kpool) // max(1, geo.dsa_layers)
    kda_each = cache.fixed // max(1, geo.kda_layers)
    for i in range(n):
        per_layer[i] = per_layer.get(i, 0) + (kda_each if kinds[i] == "linear_attention" else dsa_each)
    share = reserve // len(capacities)
    used = [share for _ in capacities]
    used[0] += outside_first
    used[-1] += outside_last
    layers: list[list[int]] = [[] for _ in capacities]
    d = 0
    fits = True
    for i in sorted(per_layer):
        while d < len(capacities) - 1 and used[d] + per_layer[i] > capacities[d]:
            d += 1
        used[d] += per_layer[i]
        layers[d].append(i)
    over = [k for k, (u, c) in enumerate(zip(used, capacities)) if u > c]
    if over:
        fits = False
    note = "" if fits else f"(device {over[0]} over by {(used[over[0]] - capacities[over[0]]) / 1e9:.3f} GB)"
    return DeviceSplit(list(capacities), used, layers, fits, note)


def fit_plan(ckpt, fmt: str, *, fit: int | str, context: int | str, cache: str | None = None,
             reserve: int | str | None = None, mmproj: bool = False, companions: int | str = 0,
             devices: Sequence[int | str] | str | None = None, n_seq: int = 1, flash_attn: bool | None = None,
             **plan_kw) -> FitResult:
    """Plan the weights to ``fit − cache(context) − reserve − companions`` (see the module docstring).

    Impossible fits raise PlanError naming what does not fit."""
    fmt = fmt.lower()
    if fmt not in ("gguf", "exl3"):
        raise InputError(f"--format {fmt!r}: exl3 or gguf")
    fit_b = parse_size_option("--fit", fit)
    ctx = parse_context(context)
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq < 1:
        raise InputError(f"--seqs {n_seq!r}: expected a whole number >= 1")
    res = DEFAULT_RESERVE[fmt] if reserve is None else parse_size_option("--reserve", reserve, zero_ok=True)
    notes = []
    comp = parse_size(companions) if companions not in (0, "0", None) else 0
    if mmproj:
        if fmt == "gguf":
            if not ckpt.vision_names():
                raise InputError(f"--mmproj: {ckpt.path} has no vision tower (model.visual.*): there is no "
                                 "projector file to hold")
            comp += mmproj_bytes(ckpt)
        else:
            notes.append("--mmproj ignored: the EXL3 directory holds the vision tower (counted in the weights)")
    cb = cache_for(fmt, ckpt, ctx, cache, n_seq=n_seq, flash_attn=flash_attn)
    weights = fit_b - cb.total - res - comp
    if weights <= 0:
        raise PlanError(f"--fit {fit_b / 1e9:.3f} GB: cache {cb.total / 1e9:.3f} GB at context {ctx} + reserve "
                        f"{res / 1e9:.3f} GB + companions {comp / 1e9:.3f} GB leave nothing for the weights")
    try:
        plan = plan_model(ckpt, fmt, size=weights, **plan_kw)
    except PlanError as e:
        raise PlanError(f"--fit {fit_b / 1e9:.3f} GB at context {ctx}: {weights / 1e9:.3f} GB left for the "
                        f"weights after cache {cb.total / 1e9:.3f} GB and reserve {res / 1e9:.3f} GB; {e}") from None
    split = None
    if devices:
        caps = [parse_size_option(f"--devices {devices!r}", d)
                for d in (devices.split(",") if isinstance(devices, str) else devices)]
        if sum(caps) < fit_b:
            notes.append(f"--devices sum {sum(caps) / 1e9:.3f} GB < --fit {fit_b / 1e9:.3f} GB")
        split = split_layers(plan, cb, ckpt, caps, res)
    return FitResult(fit_b, ctx, cb, res, comp, plan, split, notes)
