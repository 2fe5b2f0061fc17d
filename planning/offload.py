"""``mixq plan --fit --gpu 2x24GB --cpu 128GB``: a GGUF for llama.cpp with the routed experts in host RAM.

llama.cpp keeps the tensors an ``-ot PATTERN=CPU`` (or ``--n-cpu-moe N``) override selects in host memory, keeps
the input layer (``token_embd``) on the CPU always, and splits every other layer over the cards by ``-ts``
(``-ngl 999``: all layers offloaded), each layer's cache with the layer. So two budgets hold:

  host = the overridden experts + token_embd + the host reserve (CPU compute buffer, the process) <= --cpu
  card = its layers' weights + their cache + its share of --reserve                                <= each card

Every tensor is on one side, and the role error model is a sum over tensors, so one allocation per side (each to
its own byte budget) is the optimum under both constraints. A first plan to the cards' total decides which layers
go to which card (contiguous runs in proportion to the cards' sizes); then the host and each card are planned to
their own budgets, so each card holds its bytes exactly. docs/memory-model.md §6 documents the terms; llama.cpp facts from its sources as vendored in llama-cpp-python
0.3.36 (``V:``): the override regexes (V:common/common.h LLM_FFN_EXPS_REGEX, V:common/arg.cpp --n-cpu-moe), the
input layer on the CPU and the -ts layer split (V:src/llama-model.cpp:1556-1614).
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from mixq.errors import InputError, PlanError
from mixq.formats.gguf_names import TOKEN_EMBD
from mixq.planning import memory as mem
from mixq.planning.display import format_plan
from mixq.planning.fit import DEFAULT_RESERVE, cache_for
from mixq.planning.gguf import SideBudgets, predicted_error
from mixq.planning.planner import plan_model
from mixq.planning.sizes import parse_card_sizes, parse_context, parse_size_option
from mixq.planning.types import Plan

# The -ot pattern that keeps every layer's routed experts in host RAM (searched in GGUF tensor names, as
# llama.cpp's std::regex_search does), and llama.cpp's own per-layer pattern of --n-cpu-moe N (layers 0..N-1).
OT_EXPERTS = r"blk\.[0-9]+\.ffn_(gate|up|down)_exps\.weight"
N_CPU_MOE = r"blk\.{}\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# Host reserve when --cpu-reserve is not given: the CPU compute buffer of the offloaded expert matmuls at the
# default n_ubatch, the process and its pinned staging buffers. A round, documented default, not a measurement.
DEFAULT_CPU_RESERVE = 4 * 10**9
NGL = 999  # -ngl: every layer on the cards (what the override leaves there)
_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class DeviceUse:
    """One llama.cpp device's share of the plan: ``CUDA0``.. (its layers) or ``CPU`` (experts, token_embd)."""

    name: str
    capacity: int
    weights: int
    cache: int
    reserve: int
    layers: list[int] = field(default_factory=list)

    @property
    def used(self) -> int:
        return self.weights + self.cache + self.reserve

    @property
    def headroom(self) -> int:
        return self.capacity - self.used

    def to_dict(self) -> dict:
        return {"device": self.name, "capacity_bytes": self.capacity, "weights_bytes": self.weights,
                "cache_bytes": self.cache, "reserve_bytes": self.reserve, "used_bytes": self.used,
                "headroom_bytes": self.headroom, "layers": [min(self.layers), max(self.layers)] if self.layers
                else []}


@dataclass
class OffloadResult:
    """The plan, each device's bytes, and the llama.cpp flags that place the tensors that way."""

    context: int
    cache: mem.CacheBytes
    plan: Plan
    devices: list[DeviceUse]      # the cards in order, then the host
    patterns: tuple[str, ...]     # the regexes whose tensors stay in host RAM
    n_cpu_moe: int | None         # None: every layer's experts (-ot OT_EXPERTS); N: --n-cpu-moe N
    tensor_split: tuple[int, ...]  # -ts: layers per card (the output layer counts as one)
    n_seq: int = 1                 # -np: parallel sequences, the context shared between them
    notes: list[str] = field(default_factory=list)

    @property
    def headroom(self) -> int:
        """The smallest headroom of any device."""
        return min(d.headroom for d in self.devices)

    def flags(self) -> list[str]:
        """llama.cpp's arguments (llama-server / llama-cli) that realise this placement."""
        out = ["-ngl", str(NGL), "-c", str(self.context)]
        if len(self.tensor_split) > 1:
            out += ["-ts", ",".join(map(str, self.tensor_split))]
        if self.n_cpu_moe is None:
            out += ["-ot", f"{OT_EXPERTS}=CPU"]
        elif self.n_cpu_moe:
            out += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.n_cpu_moe != 0:  # host tensors in an allocated buffer (llama.cpp advises it with CPU overrides)
            out += ["--load-mode", "none"]
        if self.n_seq > 1:
            out += ["-np", str(self.n_seq)]
        if self.cache.cache_type != "f16":
            out += ["-ctk", self.cache.cache_type, "-ctv", self.cache.cache_type]
        return out

    def command(self) -> str:
        """The flags as one shell line (the -ot pattern quoted)."""
        return " ".join(f"'{a}'" if "\\" in a or "(" in a else a for a in self.flags())

    def to_dict(self) -> dict:
        return {"context": self.context, "cache": self.cache.to_dict(), "cache_bytes": self.cache.total,
                "devices": [d.to_dict() for d in self.devices], "cpu_patterns": list(self.patterns),
                "n_cpu_moe": self.n_cpu_moe, "n_seq": self.n_seq, "tensor_split": list(self.tensor_split),
                "flags": self.flags(),
                "command": self.command(), "headroom_bytes": self.headroom, "notes": self.notes,
                "plan": self.plan.to_dict()}

    def format(self, per_tensor: bool = False) -> str:
        c = self.cache
        gb = lambda b: f"{b / 1e9:9.3f}"  # noqa: E731
        lines = [format_plan(self.plan, per_tensor=per_tensor), "",
                 f"llama.cpp offload at context {self.context} (cache {c.cache_type}: {c.total / 1e9:.3f} GB, "
                 f"{c.per_token:.0f} B/token + KDA state {c.fixed / 1e9:.3f} GB)",
                 f"  {'device':<6} {'capacity':>9} {'weights':>9} {'cache':>9} {'reserve':>9} {'used':>9} "
                 f"{'headroom':>9}  GB"]
        n_all = max((max(d.layers) for d in self.devices if d.layers), default=0)  # the output layer
        for d in self.devices:
            blk = [i for i in d.layers if i < n_all]
            run = "" if not blk else f"blk {blk[0]}" if len(blk) == 1 else f"blk {blk[0]}-{blk[-1]}"
            span = (run + (" + output" if n_all in d.layers else "")
                    if d.layers else "no layers" if d.name != "CPU" else
                    "token_embd" + ("" if self.n_cpu_moe == 0 else " + routed experts"))
            lines.append(f"  {d.name:<6} {gb(d.capacity)} {gb(d.weights)} {gb(d.cache)} {gb(d.reserve)} "
                         f"{gb(d.used)} {gb(d.headroom)}  {span}")
        lines.append(f"  llama.cpp: {self.command()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def cpu_patterns(n_cpu_moe: int | None) -> tuple[str, ...]:
    """The override regexes: every layer's experts (None) or llama.cpp's --n-cpu-moe N patterns."""
    return (OT_EXPERTS,) if n_cpu_moe is None else tuple(N_CPU_MOE.format(i) for i in range(n_cpu_moe))


def side_function(patterns: Sequence[str]):
    """name -> "cpu" | "gpu": the tensors the overrides select, and the input layer, stay in host RAM."""
    rx = [re.compile(p) for p in patterns]

    def side_of(name: str) -> str:
        return "cpu" if name == TOKEN_EMBD or any(r.search(name) for r in rx) else "gpu"
    return side_of


def layer_devices(tensor_split: Sequence[int], n_layer_all: int, n_gpu_layers: int = NGL) -> list[int]:
    """The card of each layer 0..n_layer_all (the last: the output layer) under ``-ts``, as llama.cpp computes it:
    cumulative split fractions in float32, layer il to the first card whose fraction exceeds il / act_gpu_layers
    (V:src/llama-model.cpp:1579-1614). -1: the layer stays on the CPU."""
    f32 = np.float32
    splits, total = [], f32(0)
    for x in tensor_split:
        total = f32(total + f32(x))
        splits.append(total)
    splits = [f32(s / total) for s in splits]
    start = max(n_layer_all + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer_all + 1)
    out = []
    for il in range(n_layer_all + 1):
        if il < start or il - start >= act:
            out.append(-1)
        else:
            out.append(min(bisect.bisect_right(splits, f32(f32(il - start) / f32(act))), len(splits) - 1))
    return out


def layer_of(name: str, n_all: int) -> int:
    """The llama.cpp layer of a GGUF tensor: N of ``blk.N.``; the output layer (n_all) for the rest."""
    m = _BLK.match(name)
    return int(m.group(1)) if m else n_all


def balance_layers(need: Sequence[int], caps: Sequence[int], shares: Sequence[int]) -> list[int]:
    """The card of each layer: contiguous runs in layer order, each card's run ending where the running total
    (weights + cache, plus the reserve shares) crosses the card's share of the whole in proportion to its
    capacity (a layer goes where most of it falls)."""
    total = sum(need) + sum(shares)
    acc, k, out = float(shares[0]), 0, []
    bounds = [total * sum(caps[:j + 1]) / sum(caps) for j in range(len(caps))]
    for x in need:
        while k < len(caps) - 1 and acc + x / 2 > bounds[k]:
            k += 1
            acc += shares[k]
        out.append(k)
        acc += x
    return out


def card_uses(plan: Plan, side_of, kv: dict[int, int], caps: Sequence[int], shares: Sequence[int],
              assign: Sequence[int]) -> tuple[list[DeviceUse], tuple[int, ...]]:
    """Each card's weights, cache, reserve and layers under ``assign``, and the -ts that reproduces it (checked
    against llama.cpp's own split arithmetic, ``layer_devices``)."""
    n_all = len(assign) - 1
    cards = [DeviceUse(f"CUDA{k}", cap, 0, 0, shares[k]) for k, cap in enumerate(caps)]
    for il, k in enumerate(assign):
        cards[k].layers.append(il)
        cards[k].cache += kv.get(il, 0)
    for t in plan.tensors:
        side = side_of(t.name)
        if side != "cpu":
            cards[int(side[4:])].weights += t.bytes
    ts = tuple(len(c.layers) for c in cards)
    if layer_devices(ts, n_all) != list(assign):  # llama.cpp's float32 split points must land on these layers
        raise PlanError(f"-ts {','.join(map(str, ts))} does not reproduce the planned layer split")
    return cards, ts


def offload_plan(ckpt, *, gpu, cpu, context, cache: str | None = None, reserve=None, cpu_reserve=None,
                 n_cpu_moe: int | str | None = None, n_seq: int = 1, flash_attn: bool | None = None,
                 **plan_kw) -> OffloadResult:
    """The largest GGUF plan whose experts fit ``cpu`` and the rest, with the cache and reserve, each card of
    ``gpu`` (see the module docstring). ``n_cpu_moe``: None = every layer's experts in host RAM (-ot), N = the
    first N layers' (llama.cpp --n-cpu-moe N), "auto" = the N (or all) with the least predicted error. An
    impossible budget is a PlanError naming the side that does not fit."""
    caps = parse_card_sizes("--gpu", gpu)
    host = parse_size_option("--cpu", cpu)
    ctx = parse_context(context)
    res = DEFAULT_RESERVE["gguf"] if reserve is None else parse_size_option("--reserve", reserve, zero_ok=True)
    cres = DEFAULT_CPU_RESERVE if cpu_reserve is None else parse_size_option("--cpu-reserve", cpu_reserve,
                                                                             zero_ok=True)
    cb = cache_for("gguf", ckpt, ctx, cache, n_seq=n_seq, flash_attn=flash_attn)
    n_all = ckpt.num_hidden_layers + (len(ckpt.nextn_layers) if plan_kw.get("include_mtp", True) else 0)
    if isinstance(n_cpu_moe, str) and n_cpu_moe.lower() == "all":
        n_cpu_moe = None
    if n_cpu_moe == "auto":
        return _best_n(ckpt, caps, host, ctx, cb, res, cres, n_all, n_seq, plan_kw)
    if n_cpu_moe is not None and (isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int)
                                  or not 0 <= n_cpu_moe <= n_all):
        raise InputError(f"--n-cpu-moe {n_cpu_moe!r}: all, auto or a layer count 0..{n_all}")
    return _offload(ckpt, caps, host, ctx, cb, res, cres, n_cpu_moe, n_seq, plan_kw)


def _offload(ckpt, caps, host, ctx, cb, res, cres, n_cpu_moe, n_seq, plan_kw) -> OffloadResult:
    """One placement: the overrides of ``n_cpu_moe``; a first plan to the cards' total decides which layers go
    to which card, then each card and the host are planned to their own byte budgets."""
    patterns = cpu_patterns(n_cpu_moe)
    host_side = side_function(patterns)
    host_b = host - cres
    gpu_what = (f"--gpu {sum(caps) / 1e9:.3f} GB less cache {cb.total / 1e9:.3f} GB at context {ctx} and "
                f"--reserve {res / 1e9:.3f} GB")
    held = "every layer's routed experts" if n_cpu_moe is None else f"the routed experts of layers 0-{n_cpu_moe - 1}"
    host_what = (f"--cpu {host / 1e9:.3f} GB less --cpu-reserve {cres / 1e9:.3f} GB for token_embd"
                 + (f" and {held}" if n_cpu_moe != 0 else ""))
    gpu_b = sum(caps) - cb.total - res
    for what, b in ((gpu_what, gpu_b), (host_what, host_b)):
        if b <= 0:
            raise PlanError(f"{what} leave nothing for the weights")
    labels = {"cpu": host_what, "gpu": f"{gpu_what} ({gpu_b / 1e9:.3f} GB for the weights)"}
    first = plan_model(ckpt, "gguf", sides=SideBudgets(host_side, {"cpu": host_b, "gpu": gpu_b}, labels), **plan_kw)
    n_all = 1 + max((int(m.group(1)) for t in first.tensors if (m := _BLK.match(t.name))), default=-1)
    kv = mem.cache_by_layer(ckpt.text_config, cb)
    need = [kv.get(il, 0) for il in range(n_all + 1)]
    for t in first.tensors:
        if host_side(t.name) == "gpu":
            need[layer_of(t.name, n_all)] += t.bytes
    q, r = divmod(res, len(caps))
    shares = [q + (r if k == 0 else 0) for k in range(len(caps))]
    assign = balance_layers(need, caps, shares)

    def side_of(name: str) -> str:
        return "cpu" if host_side(name) == "cpu" else f"CUDA{assign[layer_of(name, n_all)]}"

    budgets, card_labels = {"cpu": host_b}, {"cpu": host_what}
    for k, cap in enumerate(caps):
        layers = [il for il, c in enumerate(assign) if c == k]
        cache_k = sum(kv.get(il, 0) for il in layers)
        budgets[f"CUDA{k}"] = cap - cache_k - shares[k]
        span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
        card_labels[f"CUDA{k}"] = (f"card {k} ({span}) {cap / 1e9:.3f} GB less its cache {cache_k / 1e9:.3f} GB "
                                   f"and reserve {shares[k] / 1e9:.3f} GB")
        if budgets[f"CUDA{k}"] < 0:
            raise PlanError(f"{card_labels[f'CUDA{k}']} leave nothing for the weights")
    plan = plan_model(ckpt, "gguf", sides=SideBudgets(side_of, budgets, card_labels), **plan_kw)
    cards, ts = card_uses(plan, side_of, kv, caps, shares, assign)
    host_use = DeviceUse("CPU", host, sum(t.bytes for t in plan.tensors if side_of(t.name) == "cpu"), 0, cres)
    notes = []
    if any(t.name.startswith(f"blk.{n}.") for t in plan.tensors for n in ckpt.nextn_layers):
        notes.append("the NextN block is counted; llama.cpp allocates it only when it loads the MTP layers")
    return OffloadResult(ctx, cb, plan, cards + [host_use], patterns, n_cpu_moe, ts, n_seq, notes)


def _best_n(ckpt, caps, host, ctx, cb, res, cres, n_all, n_seq, plan_kw) -> OffloadResult:
    """--n-cpu-moe auto: the least predicted error over N = 0..n_all (n_all: every layer's, printed as -ot): a
    coarse scan, then a walk from the best point each way while the error falls; ties go to fewer experts in host
    RAM (faster decoding)."""
    tried: dict[int, tuple[float, OffloadResult | None]] = {}
    failures: list[PlanError] = []

    def score(n: int) -> float:
        if n not in tried:
            try:
                r = _offload(ckpt, caps, host, ctx, cb, res, cres, None if n == n_all else n, n_seq, plan_kw)
                tried[n] = (predicted_error(r.plan), r)
            except PlanError as e:
                tried[n] = (float("inf"), None)
                failures.append(e)
        return tried[n][0]

    step = max(1, n_all // 6)
    for n in sorted(set(range(0, n_all + 1, step)) | {n_all}):
        score(n)
    best = min(tried, key=lambda n: (tried[n][0], n))
    for direction in (-1, 1):  # walk from the best coarse point while the error falls
        n = best + direction
        while 0 <= n <= n_all and score(n) <= tried[n - direction][0]:
            n += direction
    best = min(tried, key=lambda n: (tried[n][0], n))
    r = tried[best][1]
    if r is None:  # nothing fits: say why with every layer's experts in host RAM (the last one tried there)
        raise failures[-1] if n_all in tried and tried[n_all][1] is None else failures[0]
    r.notes.append(f"--n-cpu-moe auto: {len(tried)} layer counts tried, this one has the "
                   "least predicted error")
    return r
