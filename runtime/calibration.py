"""Calibration: tokenized rows, and a layer-by-layer forward through transformers' glm5_next modules.

`LayerCalibrator` walks the decoder one layer at a time. Only the current layer's weights are materialised (the
model skeleton lives on the meta device), so peak memory does not grow with the number of layers. Per layer it
yields a `Stage` with the input statistics of every Linear (`{hf_tensor_name: HessianAccumulator}`; Linears that
read the same input share one accumulator object). Routed experts: every calibration token goes through every
expert for the statistics, while the output fed forward uses the model's real top-k routing. The caller may hand
the quantized weights back (`stage.advance(...)`) so the next layer sees the quantized model's hidden states.

Over several ranks (`ranks`, runtime/distributed.py) each rank runs the layer's forward itself and puts every
token through its own block of routed experts only (the all-expert statistics are what costs E times a forward);
each expert's finished Hessian is then shared with every rank, so every rank yields the same statistics as one
process. The statistics pass then leaves the routed output out, so `advance` needs the weights to run the layer.
A caller that advances every layer with its weights anyway (the EXL3 conversion) says so (`advance_with_weights`):
one process then leaves the routed output out of the statistics pass too, since nothing reads that pass's hidden
streams, and saves the down projection of every token through every expert (a third of the pass's expert work).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mixq.errors import InputError
from mixq.formats import glm5next
from mixq.formats.checkpoint import load_tokenizer  # noqa: F401 - re-exported for callers
from mixq.quant.hessian import HessianAccumulator
from mixq.runtime.distributed import block_owner
from mixq.runtime.expert_groups import expert_blocks, groups_of, routed_experts
from mixq.runtime.layer_stream import BATCH_ROWS, EMBED_NAME, DecoderStream, module_sources, module_to_hf
from mixq.runtime.nextn import build_nextn, nextn_inputs, nextn_to_hf
from mixq.formats.model_files import parse_json

if TYPE_CHECKING:
    from mixq.runtime.distributed import RankContext

RANDOM_ROW_FRACTION = 0.15  # a share of uniform random-token rows, so rarely seen embeddings still get data
# the calibration pass of a conversion (EXL3, GGUF --rounding hessian) and of an imatrix: rows x tokens per row
CALIBRATION_ROWS = 64
CALIBRATION_SEQ_LEN = 512


# ---------------------------------------------------------------------------------------------- calibration rows


def read_calibration_texts(files: Sequence[str | Path] | None) -> list[str]:
    """Documents from .txt (one document per file) / .jsonl (`{"text": ...}` or a JSON string per line) files;
    the built-in sample when `files` is empty."""
    if not files:
        return [BUILTIN_TEXT]
    docs: list[str] = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise InputError(f"calibration file not found: {p}")
        try:
            raw = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"calibration file {p} is not readable UTF-8 text: {e}") from None
        if p.suffix == ".jsonl":
            for ln, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                obj = parse_json(line, f"calibration file {p} line {ln}", "the line")
                text = obj.get("text") if isinstance(obj, dict) else obj
                if not isinstance(text, str):
                    raise InputError(f"calibration file {p} line {ln}: expected a string or an object with 'text'")
                docs.append(text)
        elif p.suffix in (".txt", ".md", ""):
            docs.append(raw)
        else:
            raise InputError(f"calibration file {p}: unsupported type {p.suffix!r} (use .txt or .jsonl)")
    if not any(d.strip() for d in docs):
        raise InputError("calibration files contain no text")
    return docs


def calibration_rows(tokenizer, files: Sequence[str | Path] | None = None, *, rows: int = CALIBRATION_ROWS,
                     seq_len: int = CALIBRATION_SEQ_LEN, vocab_size: int | None = None, seed: int = 0) -> torch.Tensor:
    """(rows, seq_len) int64 token ids: windows of the tokenized text spread evenly over it (wrapping when the
    text is short), plus ~15% rows of uniform random ids over the vocabulary. Deterministic for a given seed."""
    if rows < 1 or seq_len < 2:
        raise InputError(f"calibration needs rows >= 1 and seq_len >= 2 (got rows={rows}, seq_len={seq_len})")
    docs = read_calibration_texts(files)
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
    if len(ids) < 2:
        raise InputError("calibration text tokenizes to fewer than 2 tokens")
    vocab = int(vocab_size or len(tokenizer))
    if any(i >= vocab for i in ids):
        # a tokenizer larger than the embedding (test checkpoints): fold ids into the model's vocabulary
        ids = [i % vocab for i in ids]
    n_random = int(rows * RANDOM_ROW_FRACTION) if rows >= 4 else 0
    n_text = rows - n_random
    stream = torch.tensor(ids, dtype=torch.long)
    if stream.numel() < seq_len:
        stream = stream.repeat(seq_len // stream.numel() + 1)
    span = stream.numel() - seq_len
    starts = [round(i * span / max(n_text - 1, 1)) for i in range(n_text)] if n_text > 1 else [0]
    out = [stream[s:s + seq_len] for s in starts]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_random):
        out.append(torch.randint(0, vocab, (seq_len,), generator=gen))
    rows_t = torch.stack(out)
    rng = random.Random(seed)
    order = list(range(rows))
    rng.shuffle(order)  # mix random rows among text rows so a --rows prefix keeps both kinds
    return rows_t[order].contiguous()


# ---------------------------------------------------------------------------------------------- the stages

@dataclass
class Stage:
    """One calibrated stage: a decoder layer (`layer` = its index) or the output head (`layer` = None)."""

    layer: int | None
    stats: dict[str, HessianAccumulator]
    _advance: Callable[[dict[str, torch.Tensor] | None], None] | None = field(default=None, repr=False)
    advanced: bool = False
    # the decoder layer with its source weights, as the calibration forward ran it (None for the head); valid until
    # the walk moves on, and read by the walk only through the stage's advance with weights
    module: nn.Module | None = field(default=None, repr=False)

    def advance(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Move the calibration state past this stage, using `weights` (HF name -> dequantized weight) in
        place of the source tensors they name. Without a call the source weights are used."""
        if not self.advanced and self._advance is not None:
            self._advance(weights)
        self.advanced = True


class SharedHessian:
    """A finished Hessian in place of its accumulator (an expert another rank accumulated): `hessian()` only."""

    def __init__(self, h: torch.Tensor | None) -> None:
        self.h = h

    def hessian(self) -> torch.Tensor | None:
        return self.h


class LayerCalibrator:
    """Drives transformers' glm5_next decoder one layer at a time over calibration rows.

    ckpt: a `mixq.formats.checkpoint.Checkpoint` (only `.config` and `.get(name)` are used).
    input_ids: (rows, seq_len) token ids. full=False accumulates only Σx² (imatrix), not Σxxᵀ.
    ranks: a multi-rank run's RankContext (full=True only): routed-expert statistics split over the ranks.
    advance_with_weights: every layer stage will be advanced with its weights (`Stage.advance(weights)`), so the
    statistics pass need not form the routed experts' output (full=True only).
    nextn: after the head stage, one stage per NextN block (`layer` = its decoder index), its inputs what the block
    sees in the model: the trunk's final hidden state at t (of the model as advanced) and token t+1's embedding.
    expert_group: routed experts per group on the device, their weights and accumulators kept on the host
    (runtime/expert_groups.py; None: the whole layer on the device). The statistics and the output are the same
    bytes whatever the group.
    """

    def __init__(self, ckpt, input_ids: torch.Tensor, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, full: bool = True, batch_rows: int = BATCH_ROWS,
                 start_layer: int = 0, state: dict | None = None, ranks: RankContext | None = None,
                 advance_with_weights: bool = False, nextn: bool = False, expert_group: int | None = None) -> None:
        self.ckpt = ckpt
        self.nextn = nextn
        self.stream = DecoderStream(ckpt.config, device=device, dtype=dtype, batch_rows=batch_rows,
                                    expert_group=expert_group)
        self.device = self.stream.device
        self.dtype = dtype
        self.full = full
        self.batch_rows = self.stream.batch_rows
        self.input_ids = input_ids.long()
        self.text_config = self.stream.text_config
        self.skeleton = self.stream.skeleton
        self.num_layers = self.stream.num_layers
        self.start_layer = start_layer
        # state: hidden streams (rows, seq, hc, hidden) and the DSA top-k carried to "shared" indexer layers
        self.hidden: torch.Tensor | None = None if state is None else state["hidden"]
        self.topk: torch.Tensor | None = None if state is None else state.get("topk")
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        if self.ranks is not None and not full:
            raise ValueError("a calibration split over ranks accumulates full Hessians (full=True)")
        if advance_with_weights and not full:
            raise ValueError("advance_with_weights applies to full Hessians (full=True)")
        # the statistics pass leaves the routed output out: split over ranks, or the caller re-runs every layer
        self.stats_only = self.ranks is not None or advance_with_weights
        self._expert_inputs: dict[str, list[str]] = {}  # routed experts' down_proj names of the last stats pass

    # -- helpers
    def _get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name, dtype=torch.float32)

    def _materialize(self, layer: int, replace: dict[str, torch.Tensor] | None) -> nn.Module:
        replace = replace or {}

        def fetch(n: str) -> torch.Tensor:  # as stored: the stream widens it on its device
            t = replace.get(n)
            return t if t is not None else self.ckpt.get(n, dtype=None)

        return self.stream.materialize(layer, fetch)

    def _release(self, layer: int) -> None:
        self.stream.release(layer)

    def _embed(self) -> None:
        self.hidden = self.stream.embed(self.input_ids, self._get)

    def state(self) -> dict:
        """The calibration state after the last advanced stage (saved by the job for --resume)."""
        d = {"hidden": self.hidden}
        if self.topk is not None:
            d["topk"] = self.topk
        return d

    def _batches(self):
        return self.stream.batches(self.input_ids.shape[0])

    # -- one layer
    def _run_layer(self, mod: nn.Module, layer: int, stats: dict[str, HessianAccumulator] | None, *,
                   hidden: torch.Tensor | None = None, topk: torch.Tensor | None = None,
                   name_of: Callable[[int, str], str] = module_to_hf) -> tuple:
        """Forward all rows (`hidden`, else the walk's streams) through `mod`; accumulate into `stats` when given.
        `name_of(layer, local)`: a Linear's checkpoint name. Returns (hidden, topk)."""
        if hidden is None:
            hidden, topk = self.hidden, self.topk
        hooks, experts_patch = [], None
        acc_by_input: dict[tuple, HessianAccumulator] = {}
        fed: set[tuple] = set()
        live: list[torch.Tensor] = []  # keeps this batch's inputs alive so data_ptr keys stay unique

        def feed(x: torch.Tensor, name: str) -> HessianAccumulator:
            """Accumulate x for `name`; Linears reading the very same tensor share one accumulator."""
            key = (x.data_ptr(), x.numel(), x.shape[-1]) if x.is_contiguous() else (id(x),)
            a = stats.get(name)
            if a is None:
                a = acc_by_input.get(key)
                if a is None:
                    a = HessianAccumulator(x.shape[-1], full=self.full, device=self.device)
                stats[name] = a
            acc_by_input.setdefault(key, a)
            if (id(a), key) not in fed:
                fed.add((id(a), key))
                live.append(x)
                a.add(x)
            return a

        if stats is not None:
            for local, sub in mod.named_modules():
                if isinstance(sub, nn.Linear):
                    def pre(m, args, _name=name_of(layer, local + ".weight")):
                        feed(args[0], _name)
                    hooks.append(sub.register_forward_pre_hook(pre))
        experts = routed_experts(mod)
        if experts is not None:
            experts_patch = experts
            path = next(n for n, m in mod.named_modules() if m is experts)
            experts.forward = self._all_experts_forward(experts, path, layer, stats, feed)

        def new_batch(_sl: slice) -> None:
            fed.clear()
            acc_by_input.clear()
            live.clear()

        try:
            hidden, topk = self.stream.run_layer(mod, hidden, topk, before_batch=new_batch)
        finally:
            for hk in hooks:
                hk.remove()
            if experts_patch is not None:
                del experts_patch.forward
            live.clear()
        return hidden, topk

    def _all_experts_forward(self, experts: nn.Module, path: str, layer: int, stats, feed):
        """Replacement for the experts' forward (``path``: the experts module inside the layer): every token
        through every expert for the statistics, the output weighted by the real routing (tokens not routed to
        an expert get weight 0). The router reads the same input as the experts."""
        limit = float(getattr(experts, "swiglu_limit", 10.0))
        router = module_to_hf(layer, path.rsplit(".", 1)[0] + ".gate.weight")

        def forward(hidden_states, top_k_index, top_k_weights):
            x = hidden_states
            n_exp = experts.gate_up_proj.shape[0]
            gate_up = module_sources(layer, f"{path}.gate_up_proj", n_exp)  # [expert][gate, up]
            down = [parts[0] for parts in module_sources(layer, f"{path}.down_proj", n_exp)]
            if stats is not None:
                a = feed(x, gate_up[0][0])
                for parts in gate_up:
                    for n in parts:
                        stats.setdefault(n, a)
                stats.setdefault(router, a)
            # dense routing weights (T, E): the real top-k weights, zero elsewhere
            w = torch.zeros(x.shape[0], n_exp + 1, dtype=x.dtype, device=x.device)
            w.scatter_(1, top_k_index, top_k_weights.to(x.dtype))
            out = torch.zeros_like(x)
            if stats is not None and self.stats_only:
                if self.ranks is not None:
                    self._expert_inputs[path] = down
                self._own_expert_stats(experts, x, down, stats, limit)
                return out  # statistics only: the routed output is left out (see the module docstring)
            # a group of experts on the device at a time (all of them unless streamed, runtime/expert_groups.py);
            # the output still gathers the experts one by one in ascending order
            for e0, e1, gu, dn in expert_blocks(experts, x.device):
                for e in range(e0, e1):
                    if stats is None:  # no statistics wanted: only the routed tokens matter
                        rows = w[:, e].nonzero().squeeze(1)
                        if rows.numel():
                            gate, up = F.linear(x[rows], gu[e - e0]).chunk(2, dim=-1)
                            act = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
                            out.index_add_(0, rows, F.linear(act, dn[e - e0]) * w[rows, e:e + 1])
                        continue
                    gate, up = F.linear(x, gu[e - e0]).chunk(2, dim=-1)
                    act = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
                    self._expert_acc(stats, down[e], experts).add(act)
                    out += F.linear(act, dn[e - e0]) * w[:, e:e + 1]
                if stats is not None:
                    self._park(stats, down[e0:e1], experts)
            return out

        return forward

    def _own_expert_stats(self, experts: nn.Module, x: torch.Tensor, down: list[str], stats, limit: float) -> None:
        """This rank's block of routed experts (all of them in one process): every token through each, its down_proj
        input accumulated (the same operations as the loop that also forms the output, so the same sums)."""
        for e0, e1, gu, _ in expert_blocks(experts, x.device):
            for e in range(e0, e1):
                if self.ranks is not None and block_owner(e, len(down), self.ranks.world) != self.ranks.rank:
                    continue
                gate, up = F.linear(x, gu[e - e0]).chunk(2, dim=-1)
                act = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
                self._expert_acc(stats, down[e], experts).add(act)
            self._park(stats, down[e0:e1], experts)

    def _expert_acc(self, stats, name: str, experts: nn.Module) -> HessianAccumulator:
        """The accumulator of a routed expert's down_proj input, on the device for its update (made there, or
        brought back from the host where a streamed group left it)."""
        acc = stats.get(name)
        if acc is None:
            acc = stats[name] = HessianAccumulator(experts.down_proj.shape[-1], full=self.full, device=self.device)
        elif groups_of(experts) is not None:
            acc.move(self.device)
        return acc

    def _park(self, stats, names: list[str], experts: nn.Module) -> None:
        """Streamed experts: their group's accumulators back to the host, where the experts' weights stay (over
        several ranks each keeps its block's on its device: they are shared from there)."""
        if groups_of(experts) is None or self.device.type == "cpu" or self.ranks is not None:
            return
        for n in names:
            if n in stats:
                stats[n].move("cpu")

    def _share_expert_hessians(self, stats: dict) -> None:
        """Every routed expert's Hessian from the rank that accumulated it to every rank, in place of the
        accumulators (a SharedHessian each, None where an expert saw no finite token)."""
        for down in self._expert_inputs.values():
            for r in range(self.ranks.world):
                names = [n for e, n in enumerate(down) if block_owner(e, len(down), self.ranks.world) == r]
                mine = None
                if r == self.ranks.rank:
                    mine = {n: h for n in names if (h := stats[n].hessian()) is not None}
                got = self.ranks.share_tensors(mine, src=r)
                for n in names:
                    stats[n] = SharedHessian(got.get(n))
        self._expert_inputs.clear()

    # -- the walk
    def stages(self) -> Iterator[Stage]:
        """Yield one Stage per decoder layer (from `start_layer`), then the head stage (lm_head input), then with
        `nextn` one stage per NextN block."""
        if self.hidden is None:
            self._embed()
        for i in range(self.start_layer, self.num_layers):
            mod = self._materialize(i, None)
            stats: dict[str, HessianAccumulator] = {}
            hidden, topk = self._run_layer(mod, i, stats)
            if self.ranks is not None:
                self._share_expert_hessians(stats)

            def advance(weights, _i=i, _hidden=hidden, _topk=topk):
                if self.stats_only and not weights:
                    raise ValueError("this calibration's statistics pass left the routed output out: advance each "
                                     "layer with its weights")
                if weights:
                    self._release(_i)
                    m = self._materialize(_i, weights)
                    _hidden, _topk = self._run_layer(m, _i, None)
                self.hidden, self.topk = _hidden, _topk

            stage = Stage(layer=i, stats=stats, _advance=advance, module=mod)
            yield stage
            stage.advance(None)
            self._release(i)
            del hidden, topk, stage
        yield self._head_stage()
        if self.nextn:
            for j in self.ckpt.nextn_layers[:1]:  # GLM's checkpoints hold one NextN block
                yield self._nextn_stage(j)

    def _final_hidden(self) -> torch.Tensor:
        """The trunk's final hidden state norm(mean of the mHC streams) of every row, on the CPU."""
        w = self._get(glm5next.global_hf_name("norm")).to(self.device, self.dtype)
        return torch.cat([self.stream.final_hidden(self.hidden[sl], w).cpu() for sl in self._batches()])

    def _nextn_stage(self, layer: int) -> Stage:
        """The statistics of NextN block `layer`, run on the final hidden states of the walk's model."""
        final = self._final_hidden()
        emb = F.embedding(self.input_ids, self._get(EMBED_NAME).to(self.dtype))
        x = nextn_inputs(final, emb)
        del final, emb
        mod = build_nextn(self.text_config, layer, lambda n: self.ckpt.get(n, dtype=None), device=self.device,
                          dtype=self.dtype, groups=self.stream.groups)
        stats: dict[str, HessianAccumulator] = {}
        self._run_layer(mod, layer, stats, hidden=x, topk=None, name_of=nextn_to_hf)
        if self.ranks is not None:
            self._share_expert_hessians(stats)
        return Stage(layer=layer, stats=stats, module=mod)

    def _head_stage(self) -> Stage:
        w = self._get(glm5next.global_hf_name("norm")).to(self.device, self.dtype)
        eps = float(self.text_config.rms_norm_eps)
        acc = HessianAccumulator(self.hidden.shape[-1], full=self.full, device=self.device)
        for sl in self._batches():
            h = self.hidden[sl].to(self.device, self.dtype).mean(dim=2)  # unweighted mean over the mHC streams
            hf = h.float()
            y = (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)).to(self.dtype) * w
            acc.add(y)
        return Stage(layer=None, stats={glm5next.global_hf_name("lm_head"): acc})


def calibrate(ckpt, input_ids: torch.Tensor, **kw) -> Iterator[Stage]:
    """Shorthand: `LayerCalibrator(ckpt, input_ids, **kw).stages()`."""
    return LayerCalibrator(ckpt, input_ids, **kw).stages()


# A small calibration sample written for mixq (prose, code, lists, several languages), used when no
# --calibration file is given. It is deliberately varied rather than large; pass real text for real quants.
BUILTIN_TEXT = """\
The river had been rising for three days before anyone in the valley took it seriously. On the fourth morning the
ferryman tied his boat to the old oak behind the mill, climbed the hill with his dog, and sat on a flat stone to
watch the water spread across the meadows. By noon the road to the market town was gone, and the children who had
laughed at him the day before came up the path carrying their grandmother's chairs.

Chapter 2. A short history of measurement
Before standard units, a foot was the length of a particular king's foot, a cubit ran from elbow to fingertip, and
a day's ploughing defined a field. Merchants carried their own weights and argued at every border. The metre was
first defined in 1793 as one ten-millionth of the distance from the equator to the North Pole along a meridian;
since 1983 it has been the distance light travels in vacuum in 1/299,792,458 of a second.

Q: Why does ice float on water?
A: Water expands when it freezes because its molecules lock into an open hexagonal lattice held together by
hydrogen bonds, so ice is about 9% less dense than liquid water at 0 degrees Celsius.

def moving_average(values, window):
    \"\"\"Return the simple moving average of a list of numbers.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total, out = 0.0, []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i + 1 >= window:
            out.append(total / window)
    return out

for (int i = 0; i < n; ++i) {
    sum += a[i] * b[i];
}
SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name ORDER BY orders DESC;

Shopping list: 2 kg flour, 12 eggs, butter (unsalted), 3 lemons, a jar of honey, coffee beans, 500 g lentils.

Le marché ouvre à sept heures; les pêcheurs arrivent avec les caisses de sardines encore couvertes de glace.
Der Zug nach München hat heute zwanzig Minuten Verspätung, weil ein Baum auf die Gleise gefallen ist.
El niño dibujó un mapa del barrio con la panadería, la plaza y el árbol donde vive el gato del vecino.
今天下午我们在图书馆讨论了这个项目的时间安排和预算。
東京の朝は早く、駅のホームには静かに電車を待つ人々が並んでいる。
Сегодня вечером в парке будет концерт, и вход для всех свободный.

The committee reviewed 14 proposals, approved 9, and asked for revised budgets on the remaining 5. Total spend
for the year is expected to reach 2.4 million, about 6% above the previous estimate, mostly because of energy costs.
She opened the letter slowly, read the first line twice, and then laughed out loud for the first time in weeks.
"""


class RoutingCapture:
    """Forward pre-hook on a layer's experts module: keeps its input tokens (float32) and their routing, for the
    per-expert statistics of `plan --measure` and `--rounding hessian`."""

    def __init__(self) -> None:
        self.x: list[torch.Tensor] = []
        self.idx: list[torch.Tensor] = []
        self.w: list[torch.Tensor] = []
        self.module = None
        self.paused = False  # another user of the layer runs it: nothing is kept

    def __call__(self, module, args) -> None:
        if self.paused:
            return
        x, idx, w = args[:3]
        self.module = module
        self.x.append(x.detach().float())
        self.idx.append(idx.detach())
        self.w.append(w.detach().float())

    def clear(self) -> None:
        self.x, self.idx, self.w, self.module = [], [], [], None

    def routed(self, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x (T, hidden), dense gates (T, E))."""
        x = torch.cat(self.x)
        # a spare column: the router may emit index n_experts for "no expert" (as the calibrator's dense routing)
        g = torch.zeros(x.shape[0], n_experts + 1, dtype=x.dtype, device=x.device)
        g.scatter_(1, torch.cat(self.idx).long(), torch.cat(self.w).to(x.dtype))
        return x, g[:, :n_experts]


def expert_activation(module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Routed expert e's down_proj input for tokens x: glm5_next's clamped SwiGLU, as the calibrator computes it."""
    limit = float(getattr(module, "swiglu_limit", 10.0))
    gate, up = F.linear(x, module.gate_up_proj[e].to(x)).chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def capture_routing(cal: "LayerCalibrator") -> dict[int, RoutingCapture]:
    """A RoutingCapture hooked on the routed experts of every MoE layer of `cal`'s skeleton, by layer index."""
    captures: dict[int, RoutingCapture] = {}
    for i, layer in enumerate(cal.skeleton.layers):
        ex = getattr(getattr(layer, "mlp", None), "experts", None)
        if ex is not None and hasattr(ex, "gate_up_proj"):
            captures[i] = RoutingCapture()
            ex.register_forward_pre_hook(captures[i])
    return captures
