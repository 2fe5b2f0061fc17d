"""GLM-5.3-Flash at its real widths, a few layers deep: every pipeline stage timed, then projected to 321B.

The slice keeps every width of the release (hidden 4096, vocab 154880, q_lora 1536, kv_lora 512, 64 heads x 256,
KDA 64 heads x 128, DSA indexer 32 x 128, mHC 4, dense intermediate 12288, experts 2048 wide, the vision tower) and
cuts depth and experts: `--layers` (default kda-dense,kda-moe,kda-moe,dsa-moe; dense layers first) with E routed
experts (`--experts`, default 32; the release has 288) plus the shared expert. Weights: transformers' own
initialisation (std 0.02, FLA gate init) for a model built with at most 8 experts; the routed experts and router
rows past those are drawn from the same N(0, 0.02) by a torch.Generator on the build device (the GPU when present),
all with outlier input channels (0.5% of the columns of every matrix x8). Written tensor by tensor as 4 GiB BF16
safetensors shards like the release (a writer thread overlaps the disk with the generation), and unless `--no-fp8`
an FP8 block-scaled copy (GLM's FP8 set, 128x128 scale_inv). A 288-expert MoE layer is 7.25 G weights (14.5 GB).

Stages (each a separate process, so peak host memory is per stage; timings and peaks into one JSON):
  build     write the slice (BF16, FP8 unless --no-fp8): seconds and bytes written
  load      read every tensor through mixq's checkpoint reader (BF16 and FP8 when present)
  exl3      `mixq convert --format exl3 --bpw 3.05` (calibration with every expert, trellis, write), then verify
            when time is left
  eval      `mixq eval` of the candidates against the BF16 slice (16 windows x 4096 tokens)
  gguf      imatrix, then each of `--gguf-types` (default Q4_K_M,iq-2.6bpw: `--type Q4_K_M --imatrix`, and the
            108 GB plan's i-quant types, `--gguf-ladder iq`)
  exllamav3 exllamav3's own convert.py on the same slice at the same bpw (wall time)
  k256      on the trained k256 fixture: exllamav3's converter vs mixq's role and measured plans at equal bytes
  project   each stage scaled to the release per layer type: 3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE, NextN, head;
            a layer type or part this run did not measure comes from `--reference` (the 16-expert run), named in
            the JSON with what was scaled and by how much

Where the time goes: every stage's child process logs its phases as they begin and end (WORK/progress/STAGE.jsonl;
wrappers around mixq's functions, the code unchanged; CUDA synchronised around each). `--deadline-s` bounds the
whole run: a stage is skipped (recorded under "skipped") when too little time is left, a running stage is killed at
the deadline (less `--reserve-s` for `project`) or at its `--stage-limits` share, and its partial result is built
from that log: calibration forward, Hessian accumulation / finalisation seconds, N of M units encoded per role in
Z s, write seconds, the phase it was in; the EXL3 layer it was cut in is completed at the per-unit rate measured in
that layer ("extrapolated within the layer" in the JSON, beside "measured").

    python bench/release/glm53_slice.py --work DIR --json OUT.json --stages build,load,exl3,eval  [--experts 32]
    python bench/release/glm53_slice.py --work DIR --json OUT.json --stages gguf,exllamav3,project
    python bench/release/glm53_slice.py --work DIR --json OUT.json --small --device cpu     # the same code on a toy

On one H200, within 9.5 minutes (18.9 GB BF16 under /tmp, results and logs under $OUT; wheels in .whl/, and shared/
holding models/glm-5.3-flash-shape/config.json and models/glm5next-mini/tokenizer*.json; bench/release/release_timing.sh
runs the release's slice steps this way):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:/tmp/pp && mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/mixq && \
    export MIXQ_SHARED="$PWD/shared" && python3 bench/release/glm53_slice.py --work /tmp/g53 --json $OUT/glm53_slice_288.json \
      --experts 288 --layers kda-dense,kda-moe --no-fp8 --deadline-s 530 --stage-limits exl3=290,gguf=150 \
      --gguf-types Q4_K_M --stages build,exl3,gguf,load,project > $OUT/log.txt 2>&1; \
    cp /tmp/g53/progress/*.jsonl $OUT/ 2>/dev/null; tail -c 3000 $OUT/log.txt
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED, repo_relative  # noqa: E402

from mixq.formats.gguf_layout import FLOAT_TYPES  # noqa: E402

SHAPE_CONFIG = SHARED / "models" / "glm-5.3-flash-shape" / "config.json"
DEFAULT_REFERENCE = REPO / "bench" / "results" / "glm53_slice.json"  # the 16-expert H200 run
LAYER_KINDS = {"kda-dense": ("linear_attention", "dense"), "kda-moe": ("linear_attention", "sparse"),
               "dsa-moe": ("deepseek_sparse_attention", "sparse")}
DEFAULT_LAYERS = ("kda-dense", "kda-moe", "kda-moe", "dsa-moe")
RELEASE_LAYERS = {"kda-dense": 3, "kda-moe": 31, "dsa-moe": 11}  # + the NextN block (DSA+MoE, uncalibrated)
RELEASE_EXPERTS = 288
LAYER_TYPES = tuple(LAYER_KINDS[k][0] for k in DEFAULT_LAYERS)  # the default slice (bench/release/exl3_multigpu.py)
MLP_TYPES = tuple(LAYER_KINDS[k][1] for k in DEFAULT_LAYERS)
SHARD_BYTES = 4 << 30
OUTLIER_FRACTION, OUTLIER_GAIN = 0.005, 8.0
INIT_EXPERTS = 8  # experts transformers initialises; the rest are drawn directly (same distribution)


def parse_layers(spec: str | tuple | list) -> tuple[str, ...]:
    """`kda-dense,kda-moe,...` -> a tuple of layer kinds (dense layers first, as first_k_dense_replace needs)."""
    kinds = tuple(k.strip() for k in (spec.split(",") if isinstance(spec, str) else spec) if k.strip())
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if bad or not kinds:
        raise SystemExit(f"--layers: unknown kind {bad[0] if bad else '(none)'}; use {', '.join(LAYER_KINDS)}")
    mlp = [LAYER_KINDS[k][1] for k in kinds]
    if "dense" in mlp[mlp.count("dense"):]:
        raise SystemExit("--layers: dense layers must come first (first_k_dense_replace)")
    return kinds


# --- the slice -------------------------------------------------------------------------------------------------

def slice_config(shape: dict, experts: int, small: bool = False, layers=DEFAULT_LAYERS) -> dict:
    """The release config cut to `layers` and ``experts`` routed experts (``small``: toy widths for CPU tests)."""
    cfg = copy.deepcopy(shape)
    t = cfg["text_config"]
    kinds = parse_layers(layers)
    n = len(kinds)
    mlp = [LAYER_KINDS[k][1] for k in kinds]
    t.update(num_hidden_layers=n, layer_types=[LAYER_KINDS[k][0] for k in kinds], mlp_layer_types=mlp,
             indexer_types=["full"] * n, first_k_dense_replace=mlp.count("dense"), n_routed_experts=experts,
             num_experts_per_tok=min(int(t["num_experts_per_tok"]), experts), num_nextn_predict_layers=0)
    if small:
        t.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, q_lora_rank=256,
                 kv_lora_rank=256, num_attention_heads=2, num_key_value_heads=2, qk_head_dim=128,
                 qk_nope_head_dim=128, v_head_dim=128, linear_num_heads=2, linear_head_dim=128, index_n_heads=2,
                 index_head_dim=128, index_topk=64, index_kpool=4, vocab_size=8192, pad_token_id=0)
        t["linear_attn_config"] = dict(t["linear_attn_config"], num_heads=2, head_dim=128)
        cfg["vision_config"].update(depth=1, hidden_size=128, intermediate_size=256, num_heads=2,
                                    out_hidden_size=256, projection_intermediate_size=256)
        for k in ("image_end_token_id", "image_start_token_id", "image_token_id", "video_end_token_id",
                  "video_start_token_id", "video_token_id"):
            cfg.pop(k, None)
    cfg["dtype"] = "bfloat16"
    return cfg


def _outlier_cols(w, gen) -> None:
    import torch

    k = max(1, int(w.shape[1] * OUTLIER_FRACTION))
    cols = torch.randperm(w.shape[1], generator=gen, device=gen.device)[:k].to(w.device)
    w[:, cols] *= OUTLIER_GAIN


def _add_outliers(sd: dict, seed: int) -> None:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, w in sd.items():
        if w.dim() != 2 or not name.endswith(".weight") or "embed_tokens" in name or min(w.shape) < 64:
            continue
        _outlier_cols(w, gen)


class ShardWriter:
    """Release-style safetensors shards (<= SHARD_BYTES each) plus the index, fed one tensor at a time; full
    shards are written by a background thread (at most two waiting) while the caller makes the next tensors."""

    def __init__(self, out: Path, *, fp8: bool, dsa: set[int]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.out, self.fp8, self.dsa = out, fp8, dsa
        self.cur: dict = {}
        self.size = 0
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}
        self.total = 0
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending: list = []

    def add(self, name: str, w) -> None:
        import torch

        from mixq.formats.tiny import _is_fp8_target, fp8_quantize_blocks

        parts = {name: w}
        if self.fp8 and _is_fp8_target(name, tuple(w.shape), self.dsa):
            q, s = fp8_quantize_blocks(w)
            parts = {name: q, name + "_scale_inv": s}
        host = {}
        for k, v in parts.items():
            keep = k.endswith("_scale_inv") or v.dtype == torch.float8_e4m3fn  # scales f32, weights e4m3
            host[k] = v.to(v.dtype if keep else torch.bfloat16).to("cpu").contiguous()
        nb = sum(v.numel() * v.element_size() for v in host.values())
        if self.size and self.size + nb > SHARD_BYTES:
            self._flush()
        self.cur.update(host)
        self.size += nb

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.cur:
            return
        path = self.out / f"part-{len(self.files):05d}.safetensors.partial"
        for k, v in self.cur.items():
            self.weight_map[k] = len(self.files)
            self.total += v.numel() * v.element_size()
        self.files.append(path)
        while len([f for f in self.pending if not f.done()]) >= 2:
            time.sleep(0.05)
        self.pending.append(self.pool.submit(save_file, self.cur, str(path), metadata={"format": "pt"}))
        self.cur, self.size = {}, 0

    def close(self) -> int:
        """Write what is left, wait for the writes, give the shards their release names; returns tensor bytes."""
        self._flush()
        for f in self.pending:
            f.result()
        self.pool.shutdown()
        n = len(self.files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for p, name in zip(self.files, names):
            p.rename(self.out / name)
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return self.total


def _dsa_layers(layers=DEFAULT_LAYERS) -> set[int]:
    return {i for i, k in enumerate(parse_layers(layers)) if LAYER_KINDS[k][0] != "linear_attention"}


def _save_shards(sd: dict, out: Path, *, fp8: bool, layers=DEFAULT_LAYERS) -> int:
    """Write ``sd`` (checkpoint names -> tensors on any device) as release-style shards plus an index."""
    w = ShardWriter(out, fp8=fp8, dsa=_dsa_layers(layers))
    for name in sorted(sd, key=_file_order):
        w.add(name, sd[name])
    return w.close()


def _file_order(name: str):
    if ".layers." in name and "visual." not in name:
        rest = name.split(".layers.")[1]
        return (1, int(rest.split(".")[0]), name)
    return (0 if "embed" in name else 2, 0, name)


def _checkpoint_names(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, role) of every tensor of the checkpoint `cfg` describes (shapes only)."""
    import tempfile

    from mixq.formats.checkpoint import checkpoint_from_config

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        ck = checkpoint_from_config(Path(d) / "config.json")
        return {n: (tuple(int(x) for x in ck.shape(n)), ck.info(n).role) for n in ck.names()}


def build(work: Path, experts: int, *, small: bool, device: str, seed: int = 0, layers=DEFAULT_LAYERS,
          fp8: bool = True, progress: "Probe | None" = None) -> dict:
    """Write the BF16 slice to work/bf16 (and the FP8 copy to work/fp8); returns sizes, seconds, peaks."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from mixq.formats.tiny import default_tokenizer_dir

    probe = progress or Probe()
    shape = json.loads(SHAPE_CONFIG.read_text())
    cfg = slice_config(shape, experts, small, layers)
    t = cfg["text_config"]
    e0 = min(experts, INIT_EXPERTS)
    tcfg = copy.deepcopy(cfg)
    tcfg["text_config"].update(n_routed_experts=e0, num_experts_per_tok=min(int(t["num_experts_per_tok"]), e0))
    tcfg["text_config"]["layer_types"] = ["indexed_attention" if k != "linear_attention" else k
                                          for k in t["layer_types"]]
    std = float(t.get("initializer_range", 0.02))
    t0 = time.time()
    with probe.span("init"):
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig(**tcfg))
        with torch.no_grad():
            sd = {k: v.detach() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
            _add_outliers(sd, seed)
    t_init = time.time() - t0
    names = _checkpoint_names(cfg)
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def tensor(name: str):
        """transformers' tensor when its shape is the slice's; else (the experts and router rows past e0) drawn
        here: matrices N(0, std) with outlier columns, vectors (the router's score bias) zero."""
        shp, _role = names[name]
        w = sd.get(name)
        if w is not None and tuple(w.shape) == shp:
            return w
        if len(shp) == 1:
            return torch.zeros(shp, device=device)
        w = torch.empty(shp, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)
        if name.endswith(".weight") and min(shp) >= 64:
            _outlier_cols(w, gen)
        return w

    kinds = ["bf16"] + (["fp8"] if fp8 else [])
    outs = {}
    for kind in ("bf16", "fp8"):
        shutil.rmtree(work / kind, ignore_errors=True)
    for kind in kinds:
        outs[kind] = work / kind
        outs[kind].mkdir(parents=True)
    dsa = _dsa_layers(layers)
    writers = {kind: ShardWriter(outs[kind], fp8=kind == "fp8", dsa=dsa) for kind in kinds}
    extra = sorted(set(sd) - set(names))  # tensors transformers has and the table lacks: kept as they are
    res = {"experts": experts, "layers": list(parse_layers(layers)), "fp8": fp8, "device": device, "small": small,
           "params": sum(math.prod(s) for s, _ in names.values()) + sum(sd[n].numel() for n in extra),
           "init_experts": e0, "init_seconds": round(t_init, 1)}
    t1 = time.time()
    with probe.span("generate+write", params=res["params"]), torch.no_grad():
        for name in sorted(list(names) + extra, key=_file_order):
            w = tensor(name)
            for wr in writers.values():
                wr.add(name, w)
            del w
        for kind, wr in writers.items():
            res[f"{kind}_bytes"] = wr.close()
    res["generate_write_seconds"] = round(time.time() - t1, 1)
    tok = default_tokenizer_dir()
    for kind in kinds:
        c = copy.deepcopy(cfg)
        if kind == "fp8":
            c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
        (outs[kind] / "config.json").write_text(json.dumps(c, indent=2) + "\n")
        if tok is not None:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (tok / f).is_file():
                    shutil.copyfile(tok / f, outs[kind] / f)
        res[f"{kind}_file_bytes"] = sum(f.stat().st_size for f in outs[kind].iterdir())
    written = sum(res[f"{k}_file_bytes"] for k in kinds)
    res["bytes_written"] = written
    res["write_gb_per_s"] = round(written / max(1e-9, time.time() - t1) / 1e9, 3)
    res["tokenizer"] = tok is not None
    del model
    sd.clear()  # the closure `tensor` holds the dict: emptied, not unbound
    res.update(_peaks())
    return res


# --- where the time goes: wrappers around mixq's hot functions (measurement only; the code is unchanged) -------

class Probe:
    """Seconds per key, from wrappers around functions of mixq modules (CUDA synchronised around each call).
    With `log_path`, every call's begin and end go to that JSON-lines file as they happen (flushed per line), so
    the parent can tell where a killed stage's time went."""

    def __init__(self, log_over: float | None = None, log_path: Path | None = None) -> None:
        self.log_over = log_over  # print every call longer than this many seconds (a cut stage shows its steps)
        self.seconds: dict[str, float] = {}
        self.events: list[tuple[str, float, float]] = []
        self.active: set[str] = set()
        self.log = open(log_path, "a", buffering=1) if log_path else None
        self._lock = threading.Lock()

    def emit(self, d: dict) -> None:
        if self.log is not None:
            with self._lock:
                self.log.write(json.dumps(d) + "\n")

    def _sync(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _end(self, name: str, t0: float, extra: dict, begin: bool) -> None:
        t1 = time.time()
        self.seconds[name] = self.seconds.get(name, 0.0) + t1 - t0
        self.events.append((name, t0, t1))
        d = {"k": name, "t0": t0, "t1": t1, **extra}
        if begin:  # phases (not the many small accumulate calls) carry the memory peaks so far
            d.update(_peaks())
        self.emit(d)
        if self.log_over is not None and t1 - t0 > self.log_over:
            print(f"    {name}: {t1 - t0:.2f} s", file=sys.stderr, flush=True)

    @contextmanager
    def span(self, name: str, **extra):
        self._sync()
        t0 = time.time()
        self.emit({"k": name, "t0": t0, "begin": 1, **extra})
        try:
            yield
        finally:
            self._sync()
            self._end(name, t0, extra, True)

    def wrap(self, owners, attr: str, key, group: str | None = None, info=None, begin: bool = True) -> None:
        """Time `attr` of each owner under `key(*args)`; calls nested in another call of the same `group` are
        not counted again. `info(*args)`: a dict logged with the call; `begin`: log its start too."""
        owners = [o for o in owners if hasattr(o, attr)]
        if not owners:
            return
        orig = getattr(owners[0], attr)

        def timed(*a, **k):
            if group is not None and group in self.active:
                return orig(*a, **k)
            if group is not None:
                self.active.add(group)
            name = key(*a, **k)
            extra = info(*a, **k) if info is not None else {}
            behind = threading.current_thread() is not threading.main_thread()
            if behind:  # host work overlapped with the main thread's: no device synchronisation around it
                extra = {**extra, "thread": "behind"}
            else:
                self._sync()
            t0 = time.time()
            if begin:
                self.emit({"k": name, "t0": t0, "begin": 1, **extra})
            try:
                return orig(*a, **k)
            finally:
                if not behind:
                    self._sync()
                self.active.discard(group)
                self._end(name, t0, extra, begin)

        for o in owners:
            if getattr(o, attr) is orig:
                setattr(o, attr, timed)

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in sorted(self.seconds.items())}


def _calibration_probe(p: Probe) -> None:
    """The calibration forward per layer (with statistics: `forward/layer.i`; the pass on the quantized weights:
    `advance/layer.i`), Hessian accumulation and finalisation."""
    from mixq.quant.hessian import HessianAccumulator
    from mixq.runtime.calibration import LayerCalibrator

    p.wrap([LayerCalibrator], "_run_layer",
           lambda self, mod, layer, stats: f"{'forward' if stats is not None else 'advance'}/layer.{layer}")
    p.wrap([LayerCalibrator], "_head_stage", lambda self: "forward/head")
    p.wrap([LayerCalibrator], "_materialize", lambda self, layer, replace: f"materialize/layer.{layer}")
    p.wrap([LayerCalibrator], "_release", lambda self, layer: f"release/layer.{layer}")
    p.wrap([HessianAccumulator], "add", lambda self, x: "hessian_add", begin=False)
    p.wrap([HessianAccumulator], "hessian", lambda self: "hessian_final", begin=False)


def _stage_units(run, stage: str, *a, **k) -> dict:
    """{"units": {role: [trellis units, weights]}} of one EXL3 stage (logged at its start: the M of 'N of M')."""
    out: dict[str, list[int]] = {}
    for u in run.by_stage[stage]:
        if u.kind == "trellis":
            c = out.setdefault(u.role, [0, 0])
            c[0] += 1
            c[1] += math.prod(u.shape)
    return {"units": out}


def _encode_info(units, ws, bits, *a, **k) -> dict:
    """A stacked trellis call: units, weights, rate, and both per role (one call may hold units of several roles
    of one shape; its seconds are shared among them by weights)."""
    by_role: dict[str, list[int]] = {}
    for u, w in zip(units, ws):
        c = by_role.setdefault(u.role, [0, 0])
        c[0] += 1
        c[1] += int(w.numel())
    return {"n": len(units), "w": sum(c[1] for c in by_role.values()), "bits": bits, "by_role": by_role}


def _trellis_profile(p: Probe) -> None:
    """Every stacked trellis call run with `quantize_with_stats(profile=True)` (the device synchronised between its
    phases: regularize, scale search, LDL, Viterbi, LDLQ, refit, pack), its phases logged (`trellis_phases`); the
    dequantized copy each unit hands back (`dequantize`). The split of a routed-expert call inside the conversion,
    to hold beside bench/speed/expert_batch.py's isolated one."""
    import mixq.quant.trellis as tr
    from mixq.quant.trellis.encoder import QuantizedLinear

    full = tr.quantize_with_stats

    def profiled(weight, bits, hessian=None, codebook="mul1", seed=0):
        t0 = time.time()
        q, stats = full(weight, bits, hessian, codebook, seed, profile=True)
        p.emit({"k": "trellis_phases", "t0": t0, "t1": time.time(), "w": int(weight.numel()), "bits": bits,
                "stack": int(weight.shape[0]) if weight.dim() == 3 else 1,
                "phases": {k: round(v, 4) for k, v in stats.seconds.items()}})
        return q

    tr.quantize = profiled
    p.wrap([QuantizedLinear], "dequantize", lambda self: "dequantize", begin=False)


def summarise_trellis(events: list[dict]) -> dict:
    """Per (stack size, rate): calls, weights, seconds of the whole call and per phase, M weights/s; and the
    dequantize calls (the weights handed back for the next layer's calibration)."""
    out: dict[str, dict] = {}
    for e in events:
        if e["k"] != "trellis_phases":
            continue
        d = out.setdefault(f"stack {e['stack']} K={e['bits']}", {"calls": 0, "weights": 0, "seconds": 0.0,
                                                                 "phases": {}})
        d["calls"] += 1
        d["weights"] += e["w"]
        d["seconds"] += e["t1"] - e["t0"]
        for k, v in e["phases"].items():
            d["phases"][k] = d["phases"].get(k, 0.0) + v
    for d in out.values():
        d["mweights_per_s"] = round(d["weights"] / max(d["seconds"], 1e-9) / 1e6, 2)
        d["seconds"] = round(d["seconds"], 2)
        d["phases"] = {k: round(v, 2) for k, v in sorted(d["phases"].items(), key=lambda kv: -kv[1])}
    deq = [e for e in events if e["k"] == "dequantize" and "t1" in e]
    return {"calls": out, "dequantize": {"calls": len(deq), "seconds": round(sum(e["t1"] - e["t0"] for e in deq), 2)}}


def _exl3_probe(log_path: Path | None = None) -> Probe:
    import mixq.conversion.exl3.output as xo
    import mixq.conversion.job as job
    import mixq.conversion.exl3.pipeline as pl
    from mixq.formats import checkpoint_check, exl3_writer

    mods = [xo, pl]
    try:
        import mixq.conversion.exl3.ranks as xr
        mods.append(xr)
    except ImportError:
        pass
    p = Probe(log_path=log_path)
    p.wrap(mods, "quantize_batch", lambda units, *a, **k: f"encode/{units[0].stage}/{units[0].role}",
           info=_encode_info)
    for fn in ("_write_stage", "_encode_stage"):  # calibrated stages are encoded, then written behind the next
        p.wrap([pl], fn, lambda run, stage, *a, **k: f"stage/{stage}", group="stage", info=_stage_units)
    p.wrap([exl3_writer.Exl3Writer], "write_part", lambda self, stage, *a, **k: f"write/{stage}")
    p.wrap([job.Job], "record", lambda self, stage, *a, **k: f"record/{stage}")
    p.wrap([checkpoint_check, pl], "scan_finite", lambda *a, **k: "scan")
    p.wrap(mods, "compile_exl3", lambda *a, **k: "finalize")
    _calibration_probe(p)
    return p


def _calibration_seconds(p: Probe) -> dict[str, float]:
    """Time between one calibrated stage's end and the next one's start: the calibration forward of that layer."""
    stages = sorted((t0, t1, k.split("/", 1)[1]) for k, t0, t1 in p.events if k.startswith("stage/"))
    out, prev_end = {}, None
    for t0, t1, st in stages:
        if (st.startswith("layer.") or st == "head") and prev_end is not None:
            out[st] = round(t0 - prev_end, 3)
        prev_end = t1
    return out


def _encode_probe(p: Probe) -> None:
    """ggml's encoders per type (`encode/TYPE`, the weights of each call); nested calls counted once."""
    from mixq.quant.ggml import encoders

    for fn in ("quantize_stacked", "quantize_tensor", "quantize"):
        p.wrap([encoders], fn, lambda x, qtype, *a, **k: f"encode/{qtype}", group="encode",
               info=lambda x, *a, **k: {"w": int(x.size if hasattr(x, "size") and not callable(x.size)
                                                  else x.numel())})


def _stage_name(layer: int | None) -> str:
    return "head" if layer is None else f"layer.{layer}"


def _block_weights(blocks, qtype: str) -> int:
    """Weights held by ggml blocks of `qtype` (uint8 bytes, any shape)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return int(np.asarray(blocks).size // nbytes * n)


def _rounding_plan(ckpt, specs, types, *a, **k) -> dict:
    """{"todo": {stage: [[GGUF name, type, weights, experts]]}}: what Hessian rounding will encode (the M of
    'N of M'), logged when it starts."""
    from mixq.conversion.gguf.rounding import covered

    todo: dict[str, list] = {}
    for s, t in zip(specs, types):
        if covered(s, t):
            st = "embed" if s.role == "embed" else _stage_name(s.layer)
            todo.setdefault(st, []).append([s.name, t, math.prod(s.shape),
                                            len(s.hf_names) if s.transform == "stack" else 0])
    return {"todo": todo}


def _log_result(p: Probe, owner, attr: str, event) -> None:
    """After each call of `owner.attr`, log `event(result, *args)` (a dict with its "k")."""
    orig = getattr(owner, attr)

    def logged(*a, **k):
        out = orig(*a, **k)
        now = time.time()
        p.emit({"t0": now, "t1": now, **event(out, *a, **k)})  # an instant: t1 = t0
        return out

    setattr(owner, attr, logged)


def _descent_probe(p: Probe) -> None:
    """Every step of block-output tuning's sign descent (`tune_step`, at its start: the steps done when a stage is
    cut) and every held-out check (`tune_check`: the loss of the held-out rows, without gradients)."""
    from mixq.quant.ggml.rounding import block_tuning as bt

    orig = bt.sign_descent

    def descent(params, loss, batches, iters, lr, **kw):
        step = [0]

        def counted(batch):
            step[0] += 1
            now = time.time()
            p.emit({"k": "tune_step", "t0": now, "t1": now, "it": step[0], "of": iters})  # an instant
            return loss(batch)

        score = kw.get("score")
        if score is not None:
            def checked():
                t0 = time.time()
                out = score()  # reads the losses back: the device has finished
                p.emit({"k": "tune_check", "t0": t0, "t1": time.time()})
                return out
            kw["score"] = checked
        return orig(params, counted, batches, iters, lr, **kw)

    bt.sign_descent = descent


def _tuning_probe(p: Probe) -> None:
    """Block-output tuning (conversion/gguf/tuning.py): per layer, its stages (the layer's tensors, then each group of
    experts: weights, steps), the groups it cut the stacks into, the codes' set-up, the tuner's own encodes of the
    tensors Hessian rounding leaves to ggml (`stored_values`) and its host decodes."""
    import mixq.conversion.gguf.rounding as gr
    import mixq.conversion.gguf.tuning as gt
    from mixq.quant.ggml.rounding import block_tuning as bt

    p.wrap([gr], "_tune_stage", lambda tuner, layer, paths, *a: f"tune/{_stage_name(layer)}")
    p.wrap([gt.LayerTuner], "__init__", lambda *a, **k: "tune_init")
    p.wrap([gt.LayerTuner], "layer", lambda self, layer, enc, *a: f"tune_layer/{_stage_name(layer)}")
    p.wrap([gt.LayerTuner], "head", lambda self, enc: "tune_layer/head")
    p.wrap([gt.LayerTuner], "_tune", lambda self, layer, tuned, loss, iters, **k: f"tune_stage/{_stage_name(layer)}",
           info=lambda self, layer, tuned, loss, iters, **k: {"w": sum(int(c.u.numel()) for _, c in tuned),
                                                         "iters": iters, "tensors": len(tuned)})
    _log_result(p, gt.LayerTuner, "_expert_ranges",
                lambda res, self, over: {"k": "tune_groups", "ranges": [list(r) for r in res],
                                         "max_weights": self.max_weights, "over": [s.name for s, _ in over]})
    p.wrap([gt], "stored_values", lambda qtype, w, im, *a: f"stored_values/{qtype}",
           info=lambda qtype, w, im, *a: {"w": int(w.numel())})
    # the streams around a layer's stages, split: the source layer read in, its source pass, the rounded tensors
    # decoded for the module, their values written into it
    p.wrap([gt.DecoderStream], "materialize", lambda *a, **k: "tune_streams/materialize", begin=False)
    p.wrap([gt.DecoderStream], "run_layer", lambda *a, **k: "tune_streams/source_pass", begin=False)
    p.wrap([gt], "decoded_on_host", lambda *a, **k: "tune_streams/decode_rounded", begin=False)
    p.wrap([gt.LayerTuner], "_decode_into", lambda *a, **k: "tune_streams/decode_rounded", begin=False)
    p.wrap([gt], "write_values", lambda *a, **k: "tune_streams/write_values", begin=False)
    p.wrap([gt], "build_tensor", lambda *a, **k: "tune_streams/source_weights", begin=False)
    p.wrap([gt.DecoderStream], "call_layer", lambda *a, **k: "tune_streams/layer_call", begin=False)
    # each expert group's routed sums brought up to its tuned values
    p.wrap([gt.ExpertGroupMoE], "commit", lambda *a, **k: "tune_streams/commit", begin=False)
    for codes in (bt.LevelCodes, bt.IQ2Codes):  # one wrap per class: a wrap calls its first owner's method
        p.wrap([codes], "blocks", lambda *a, **k: "tune_streams/blocks", begin=False)
        p.wrap([codes], "__init__", lambda self, blocks, qtype, *a, **k: f"codes_init/{qtype}",
               info=lambda self, blocks, qtype, *a, **k: {"w": _block_weights(blocks, qtype)}, begin=False)
    _descent_probe(p)


def _hessian_probe(log_path: Path | None = None) -> Probe:
    """The phases of `convert --rounding hessian`: checkpoint check, plan, the calibration forward per layer (with
    the Hessian accumulation), per-expert Hessians, Hessian rounding per tensor and per call (expert slices) with
    its parts (factorisation, ggml's encoder, the refinement passes, host decodes), block-output tuning
    (_tuning_probe), ggml's exact encoders, the write."""
    import mixq.measurement.hessians as gh
    import mixq.conversion.gguf.pipeline as gp
    import mixq.conversion.gguf.rounding as gr
    import mixq.conversion.gguf.tuning as gt
    from mixq.quant.ggml.rounding import block_tuning as bt
    from mixq.quant.ggml.rounding import hessian as kh
    from mixq.quant.ggml.rounding import levels as gl

    p = Probe(log_over=5.0, log_path=log_path)
    _encode_probe(p)
    _calibration_probe(p)
    p.wrap([gp], "validate_checkpoint", lambda *a, **k: "validate")
    p.wrap([gp], "_plan", lambda *a, **k: "plan")
    p.wrap([gp], "write_gguf", lambda *a, **k: "write")
    p.wrap([gr], "encode_hessian_rounded", lambda *a, **k: "hessian_rounding", info=_rounding_plan)
    p.wrap([gh.StageHessians], "experts", lambda self, spec, e0, e1: f"experts_hessian/{_stage_name(self.layer)}",
           info=lambda self, spec, e0, e1: {"n": e1 - e0}, begin=False)
    p.wrap([gr], "embedding_hessian", lambda *a, **k: "embed_hessian")
    p.wrap([gr], "_encode_spec", lambda spec, qtype, *a, **k: f"round/{spec.name}",
           info=lambda spec, qtype, *a, **k: {"type": qtype, "w": math.prod(spec.shape)})
    p.wrap([kh], "quantize_hessian", lambda w, h, qtype, *a, **k: f"round_call/{qtype}",
           info=lambda w, *a, **k: {"w": math.prod(w.shape)}, begin=False)
    for fn, part in (("upper_inverse_factor", "factor"), ("refine_codes", "refine"), ("refine_iq2", "refine"),
                     ("refine_sub_scales", "sub_scales"), ("refit_super_scales", "super_scales")):
        p.wrap([kh], fn, lambda *a, _p=part, **k: f"round_part/{_p}", begin=False)
    p.wrap([kh], "_encode_block", lambda x, qtype, *a, **k: "round_part/ggml_encode", group="encode", begin=False)
    p.wrap([kh, gt, bt], "dequantize_blocks", lambda blocks, qtype: f"host_dequant/{qtype}",
           info=lambda blocks, qtype: {"w": _block_weights(blocks, qtype)}, begin=False)
    p.wrap([gl], "level_grid", lambda blocks, qtype: f"host_level_grid/{qtype}",
           info=lambda blocks, qtype: {"w": _block_weights(blocks, qtype)}, begin=False)
    _tuning_probe(p)
    return p


# --- reading a stage's progress log (a finished stage's and a killed one's alike) -----------------------------

def read_log(path: Path) -> list[dict]:
    """The events of a progress log (a line cut by a kill is dropped)."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _pair(events: list[dict], t_end: float) -> tuple[list[dict], list[dict]]:
    """(finished calls, calls still open at `t_end` with their elapsed seconds)."""
    ended = {(e["k"], e["t0"]) for e in events if "t1" in e}
    done = [e for e in events if "t1" in e]
    open_ = [dict(e, elapsed=round(t_end - e["t0"], 2)) for e in events
             if e.get("begin") and (e["k"], e["t0"]) not in ended]
    return done, open_


def _within(events: list[dict], key: str, t0: float, t1: float) -> float:
    return sum(min(e["t1"], t1) - max(e["t0"], t0) for e in events
               if e["k"] == key and e["t1"] > t0 and e["t0"] < t1)


def _peaks_of(events: list[dict]) -> dict:
    out = {}
    for k in ("peak_rss_mib", "peak_gpu_mib"):
        v = [e[k] for e in events if k in e]
        if v:
            out[k] = max(v)
    return out


def summarise_exl3(events: list[dict], t_end: float | None = None) -> dict:
    """Per EXL3 stage: state (done / cut), seconds, the calibration forward (and the Hessian accumulation inside
    it), Hessian finalisation, per role N of M units encoded in Z s, write / job-record seconds, the advance pass;
    a cut stage is completed at the per-unit rate measured in that stage ("extrapolated within the layer")."""
    t_end = t_end if t_end is not None else max([e.get("t1", e["t0"]) for e in events] or [time.time()])
    done, open_ = _pair(events, t_end)
    closed = done + [dict(e, t1=t_end) for e in open_]  # an open call counts up to the cut
    start = next((e["t0"] for e in events if e["k"] == "child"), None)
    stages: dict[str, dict] = {}

    def entry(st: str) -> dict:
        return stages.setdefault(st, {"state": "not started"})

    for e in closed:
        kind, _, st = e["k"].partition("/")
        if kind in ("forward", "advance") and st:
            d = entry(st)
            d[f"{'calibration_forward' if kind == 'forward' else 'advance_forward'}_s"] = round(e["t1"] - e["t0"], 2)
            if kind == "forward":
                d["hessian_accumulate_s"] = round(_within(done, "hessian_add", e["t0"], e["t1"]), 2)
                if "elapsed" in e:
                    d["state"] = "cut in the calibration forward"
        elif kind == "stage":
            d = entry(st)
            d["seconds"] = round(e["t1"] - e["t0"], 2)
            d["state"] = "cut" if "elapsed" in e else "done"
            d["hessian_finalize_s"] = round(_within(done, "hessian_final", e["t0"], e["t1"]), 2)
            d["_units"] = e.get("units", {})
            d["_t"] = (e["t0"], e["t1"])
        elif kind in ("write", "record"):
            entry(st)[f"{kind}_s"] = round(e["t1"] - e["t0"], 2)
            if e.get("thread") == "behind":  # on the worker thread, while the next stage ran
                entry(st)[f"{kind}_behind"] = True
    rates: dict[str, list[float]] = {}  # role -> [seconds, units] over every stage, for stages cut before a unit
    for e in done:
        if e["k"].startswith("encode/"):
            _, st, role = e["k"].split("/", 2)
            parts = e.get("by_role") or {role: [e.get("n", 0), e.get("w", 0)]}
            tw = sum(w for _, w in parts.values()) or 1
            for r_name, (n, w) in parts.items():
                sec = (e["t1"] - e["t0"]) * w / tw
                enc = entry(st).setdefault("encode", {}).setdefault(r_name, {"units_done": 0, "weights_done": 0,
                                                                             "seconds": 0.0})
                enc["units_done"] += n
                enc["weights_done"] += w
                enc["seconds"] += sec
                r = rates.setdefault(r_name, [0.0, 0])
                r[0] += sec
                r[1] += n
    for st, d in stages.items():
        units = d.pop("_units", {})
        span = d.pop("_t", None)
        enc = d.setdefault("encode", {})
        in_flight = [e for e in open_ if e["k"].startswith(f"encode/{st}/")]
        for role, (n, w) in units.items():
            x = enc.setdefault(role, {"units_done": 0, "weights_done": 0, "seconds": 0.0})
            x.update(units_total=n, weights_total=w)
        for role, x in enc.items():
            x["seconds"] = round(x["seconds"], 2)
            if x["units_done"]:
                x["s_per_unit"] = round(x["seconds"] / x["units_done"], 4)
                x["mweights_per_s"] = round(x["weights_done"] / max(x["seconds"], 1e-9) / 1e6, 2)
        if span is not None:
            d["fetch_other_s"] = round(d["seconds"] - sum(x["seconds"] for x in enc.values())
                                       - (0.0 if d.get("write_behind") else d.get("write_s", 0.0))
                                       - d.get("hessian_finalize_s", 0.0)
                                       - sum(e["elapsed"] for e in in_flight), 2)
        if d["state"] == "cut":
            rest, basis = 0.0, {}
            for role, x in enc.items():
                left = x.get("units_total", x["units_done"]) - x["units_done"]
                if left <= 0:
                    continue
                done_w = sum(y["weights_done"] for y in enc.values())
                if x["units_done"]:
                    rate, src = x["s_per_unit"], "measured in this layer"
                elif rates.get(role, [0, 0])[1]:
                    rate, src = rates[role][0] / rates[role][1], "this role's rate in the run's other stages"
                elif done_w and x.get("weights_total"):
                    rate = sum(y["seconds"] for y in enc.values()) / done_w * x["weights_total"] / max(1, left + x[
                        "units_done"])
                    src = "per weight, the rate of this layer's other roles"
                else:
                    rate, src = None, "no unit of this role finished: not extrapolated"
                basis[role] = {"units_left": left, "s_per_unit": None if rate is None else round(rate, 4),
                               "from": src}
                rest += (rate or 0.0) * left
            spent = sum(e["elapsed"] for e in in_flight)  # units in flight are counted as left
            d["in_flight"] = [{"role": e["k"].split("/")[-1], "units": e.get("n"), "elapsed_s": e["elapsed"]}
                              for e in in_flight]
            d["measured_s"] = d["seconds"]
            d["extrapolated_within_layer"] = {"encode_left_s": round(max(0.0, rest - spent), 2), "per_role": basis,
                                              "stage_seconds": round(d["seconds"] + max(0.0, rest - spent), 2),
                                              "not_reached": [k for k in ("write", "record", "advance_forward")
                                                              if f"{k}_s" not in d]}
    out = {"stages": dict(sorted(stages.items(), key=lambda kv: _stage_order(kv[0]))),
           "scan_s": round(sum(e["t1"] - e["t0"] for e in closed if e["k"] == "scan"), 2),
           "finalize_s": round(sum(e["t1"] - e["t0"] for e in closed if e["k"] == "finalize"), 2),
           "open_at_end": [{"phase": e["k"], "elapsed_s": e["elapsed"]} for e in open_], **_peaks_of(events)}
    first = min([e["t0"] for e in events if e["k"].startswith(("stage/", "forward/"))] or [None]) \
        if events else None
    if start is not None and first is not None:
        out["before_first_stage_s"] = round(first - start, 2)  # imports, plan, NaN scan, job start
    if start is not None:
        out["elapsed_s"] = round(t_end - start, 2)
    rates = next((e for e in events if e["k"] == "exl3_rates"), None)
    if rates is not None:  # the rates the slice was converted at: the release plan's per role
        out["role_rates"] = {"release_bpw": rates["release_bpw"], **rates["rates"]}
    prof = summarise_trellis(events)
    if prof["calls"]:  # --trellis-profile
        out["trellis_profile"] = prof
    return out


def _stage_order(st: str):
    if st.startswith("layer."):
        return (1, int(st.split(".")[1]))
    return ({"embed": 0, "head": 2, "vision": 3}.get(st, 4), 0)


def summarise_gguf(events: list[dict], t_end: float | None = None) -> dict:
    """The GGUF stage's phases: imatrix (per layer forward, accumulation), then per output file: seconds, and per
    ggml type the weights encoded and their seconds (the tensors done, when cut)."""
    t_end = t_end if t_end is not None else max([e.get("t1", e["t0"]) for e in events] or [time.time()])
    done, open_ = _pair(events, t_end)
    closed = done + [dict(e, t1=t_end) for e in open_]
    out: dict = {}
    for e in closed:
        if e["k"] == "imatrix":
            fw = {x["k"].split("/", 1)[1]: round(x["t1"] - x["t0"], 2) for x in done
                  if x["k"].startswith("forward/") and e["t0"] <= x["t0"] <= e["t1"]}
            cut = [{"phase": x["k"], "elapsed_s": x["elapsed"]} for x in open_ if x["k"].startswith("forward/")]
            out["imatrix"] = {"seconds": round(e["t1"] - e["t0"], 2), "state": "cut" if "elapsed" in e else "done",
                              "forward_s": fw, **({"forward_cut": cut} if cut else {}),
                              "accumulate_s": round(_within(done, "hessian_add", e["t0"], e["t1"]), 2)}
        elif e["k"].startswith("convert/"):
            label = e["k"].split("/", 1)[1]
            types = _weights_seconds(done, "encode/", e)
            out[label] = {"seconds": round(e["t1"] - e["t0"], 2), "state": "cut" if "elapsed" in e else "done",
                          "encode": types,
                          "encode_s": round(sum(t["seconds"] for t in types.values()), 2)}
    out["open_at_end"] = [{"phase": e["k"], "elapsed_s": e["elapsed"]} for e in open_]
    out.update(_peaks_of(events))
    return out


# --- the GGUF --rounding hessian stages: their progress logs read back ----------------------------------------

def _spans(closed: list[dict], prefix: str) -> list[dict]:
    return [e for e in closed if e["k"].startswith(prefix) and "t1" in e]


def _in(e: dict, span: dict) -> bool:
    return span["t0"] <= e["t0"] <= span["t1"]


def _secs(events: list[dict], prefix: str, span: dict | None = None) -> float:
    return sum(e["t1"] - e["t0"] for e in events if e["k"].startswith(prefix) and "t1" in e
               and (span is None or _in(e, span)))


def _weights_seconds(events: list[dict], prefix: str, span: dict | None = None) -> dict[str, dict]:
    """{suffix: {"weights", "seconds", "calls"}} of the finished calls under `prefix` (within `span`)."""
    out: dict[str, dict] = {}
    for e in events:
        if e["k"].startswith(prefix) and "t1" in e and (span is None or _in(e, span)):
            d = out.setdefault(e["k"][len(prefix):], {"weights": 0, "seconds": 0.0, "calls": 0})
            d["weights"] += e.get("w", 0)
            d["seconds"] += e["t1"] - e["t0"]
            d["calls"] += 1
    for d in out.values():
        d["seconds"] = round(d["seconds"], 3)
        d["mweights_per_s"] = round(d["weights"] / max(d["seconds"], 1e-9) / 1e6, 3)
    return out


def _tune_stages(done: list[dict], closed: list[dict], layer_span: dict, st: str, groups: list) -> list[dict]:
    """The tuning stages of one layer: the layer's tensors, then each expert group; per stage the weights tuned,
    steps done of the iterations, seconds per step, the held-out checks, the set-up before the first step."""
    out = []
    spans = [s for s in closed if s["k"] == f"tune_stage/{st}" and _in(s, layer_span) and s.get("w")]
    for i, e in enumerate(spans):
        steps = [x["t0"] for x in done if x["k"] == "tune_step" and _in(x, e)]
        checks = [x for x in done if x["k"] == "tune_check" and _in(x, e)]
        first = min(steps) if steps else e["t1"]
        after = sum(x["t1"] - x["t0"] for x in checks if x["t0"] >= first)
        d = {"what": "the layer's tensors" if i == 0 or not groups else f"experts {groups[i - 1][0]}-{groups[i - 1][1]}"
             if i - 1 < len(groups) else "experts", "weights": e.get("w"), "iters": e.get("iters"),
             "steps_done": len(steps), "seconds": round(e["t1"] - e["t0"], 2),
             "state": "cut" if "elapsed" in e else "done", "checks": len(checks),
             "check_s": round(sum(x["t1"] - x["t0"] for x in checks), 2),
             "setup_s": round(first - e["t0"] - (sum(x["t1"] - x["t0"] for x in checks) - after), 2)}
        if steps:
            d["s_per_step"] = round((e["t1"] - first - after) / len(steps), 4)
        out.append(d)
    return out


def _tune_summary(done: list[dict], closed: list[dict], st: str) -> dict | None:
    """One stage's block-output tuning: the tuner's layer call and its parts (stages, groups, codes set-up, the
    tuner's own encodes and host decodes, the streams: materialise, source and quantized passes)."""
    lay = next((e for e in closed if e["k"] == f"tune_layer/{st}"), None)
    if lay is None:
        return None
    outer = next((e for e in closed if e["k"] == f"tune/{st}"), None)
    grp = next((e for e in done if e["k"] == "tune_groups" and _in(e, lay)), None)
    groups = grp["ranges"] if grp else []
    stages = _tune_stages(done, closed, lay, st, groups)
    inline = [e for e in done if e.get("thread") != "behind"]
    behind = [e for e in done if e.get("thread") == "behind"]
    stored = {t: x for t, x in _weights_seconds(closed, "stored_values/", lay).items()
              if t not in FLOAT_TYPES}  # floats are only rounded
    d = {"seconds": round(lay["t1"] - lay["t0"], 2), "state": "cut" if "elapsed" in lay else "done",
         "stages": stages, "groups": groups, "max_weights": grp["max_weights"] if grp else None,
         "codes_init_s": round(_secs(done, "codes_init/", lay), 2),
         "stored_values": stored,
         "stored_values_encode": _weights_seconds(done, "encode/", lay),
         "host_dequant_s": round(_secs(done, "host_dequant/", lay), 2),
         "streams_parts_s": {k: round(_secs(inline, f"tune_streams/{k}", lay), 2)
                             for k in ("materialize", "source_pass", "source_weights", "decode_rounded",
                                       "write_values", "blocks", "commit")}}
    # the expert groups' source weights, read on a worker thread while the group before is tuned: listed, not a part
    d["source_weights_behind_s"] = round(_secs(behind, "tune_streams/source_weights", lay), 2)
    d["streams_parts_s"]["ggml_encode"] = round(sum(x["seconds"] for x in d["stored_values_encode"].values()), 2)
    # the layer's calls outside its stages: the quantized pass that makes the next layer's input
    in_stage = [e for e in closed if e["k"] == f"tune_stage/{st}" and _in(e, lay)]
    d["streams_parts_s"]["quantized_pass"] = round(sum(
        e["t1"] - e["t0"] for e in done if e["k"] == "tune_streams/layer_call" and "t1" in e and _in(e, lay)
        and not any(_in(e, x) for x in in_stage)), 2)
    d["streams_other_s"] = round(d["seconds"] - sum(s["seconds"] for s in stages) - d["codes_init_s"]
                                 - _secs(closed, "stored_values/", lay) - d["host_dequant_s"], 2)
    if outer is not None:
        d["spill_s"] = round((outer["t1"] - outer["t0"]) - d["seconds"], 2)  # the .npy blocks read and rewritten
    return d


def _round_summary(done: list[dict], closed: list[dict], todo: list, t_end: float) -> dict:
    """Hessian rounding of one stage's tensors: per tensor its type, weights done of total, seconds (the
    per-expert Hessians, the weights' fetch and the spill inside), the state."""
    tensors = {}
    for name, qtype, w, experts in todo:
        e = next((x for x in closed if x["k"] == f"round/{name}"), None)
        d = {"type": qtype, "weights": w, "experts": experts, "state": "not started", "weights_done": 0}
        if e is not None:
            calls = [x for x in done if x["k"].startswith("round_call/") and _in(x, e)]
            d["state"] = "cut" if "elapsed" in e else "done"
            d["seconds"] = round(e["t1"] - e["t0"], 2)
            d["weights_done"] = w if d["state"] == "done" else sum(x.get("w", 0) for x in calls)
            d["round_call_s"] = round(sum(x["t1"] - x["t0"] for x in calls), 2)
            if experts:  # each expert slice's call: [seconds, weights] (the first carries the type's warm-up)
                d["calls"] = [[round(x["t1"] - x["t0"], 3), x.get("w", 0)] for x in sorted(calls, key=lambda x: x["t0"])]
            d["experts_hessian_s"] = round(_secs(done, "experts_hessian/", e), 2)
            if d["state"] == "cut":
                last = max([x["t1"] for x in calls] or [e["t0"]])
                d["in_flight_s"] = round(t_end - last, 2)
                if d["weights_done"]:
                    d["s_per_mweight"] = round((last - e["t0"]) / d["weights_done"] * 1e6, 4)
            else:
                d["s_per_mweight"] = round((e["t1"] - e["t0"]) / max(w, 1) * 1e6, 4)
        tensors[name] = d
    return tensors


# a type's first tensor slower than this many times its kind's steady rate carries the type's one-time kernel
# builds (the first call of each ggml type in a process: 15-60 s each on an H200)
WARMUP_FACTOR = 3.0
# a stack's expert-slice calls are of one size, so its first call's excess over the later calls is one-time work
# (the type's kernels built for these shapes) well below WARMUP_FACTOR: on an H200 the IQ2_S and IQ2_XS stacks'
# first calls took 10.5 and 11.5 s, their later ones 3.6-4.4 s
CALL_WARMUP_FACTOR = 1.5


def _timed_tensors(stages: dict) -> list[tuple[str, str, float, int, list]]:
    """(type, "stack"|"matrix", seconds, weights done, [[seconds, weights] per expert-slice call]) of every rounded
    tensor, finished or cut, in run order."""
    out = []
    for d in stages.values():
        for x in d.get("round", {}).get("tensors", {}).values():
            if x.get("s_per_mweight") is not None and x["weights_done"]:
                out.append((x["type"], "stack" if x["experts"] else "matrix",
                            x["s_per_mweight"] * x["weights_done"] / 1e6, x["weights_done"], x.get("calls") or []))
    return out


def _first_call_warmup(calls: list) -> dict | None:
    """The warm-up inside a stack's first expert-slice call, read off its later calls (at least two of them):
    {"seconds", "steady_s_per_mweight", "from"}, or None when the first call is not ``CALL_WARMUP_FACTOR`` times
    slower per weight than they are."""
    later = calls[1:]
    if len(later) < 2 or not calls[0][1] or not sum(w for _, w in later):
        return None
    steady = sum(s for s, _ in later) / sum(w for _, w in later)
    sec, w = calls[0]
    if sec <= CALL_WARMUP_FACTOR * steady * w:
        return None
    return {"seconds": round(sec - steady * w, 2), "steady_s_per_mweight": round(steady * 1e6, 4),
            "from": f"the stack's later {len(later)} expert-slice calls"}


def rounding_warmup(stages: dict) -> dict[str, dict]:
    """The one-time part of each type's first rounded tensor: {type: {"seconds", "steady_s_per_mweight", "from"}}.
    A first tensor counts as warm-up where it is ``WARMUP_FACTOR`` times slower per weight than the steady rate:
    the type's later tensors of the same kind, else the other types' steady tensors of that kind."""
    timed = _timed_tensors(stages)
    firsts = {}
    for i, (t, *_) in enumerate(timed):
        firsts.setdefault(t, i)
    later = [x for i, x in enumerate(timed) if firsts[x[0]] != i]
    out = {}
    for t, i in firsts.items():
        _, kind, sec, w, calls = timed[i]
        inside = _first_call_warmup(calls)
        if inside is not None:
            out[t] = inside
            continue
        same = [x for x in later if x[0] == t and x[1] == kind]
        pool, src = (same, f"{t}'s later {kind} tensors") if same else \
            ([x for x in later if x[1] == kind], f"the other types' later {kind} tensors")
        if not pool:
            continue
        steady = sum(x[2] for x in pool) / sum(x[3] for x in pool)
        if sec > WARMUP_FACTOR * steady * w:
            out[t] = {"seconds": round(sec - steady * w, 2), "steady_s_per_mweight": round(steady * 1e6, 4),
                      "from": src}
    return out


def _round_rates(stages: dict) -> dict[str, dict]:
    """Seconds per M weights of Hessian rounding per type and shape kind ("TYPE/stack", "TYPE/matrix"): finished
    tensors, and the finished part of a cut one, less each type's one-time warm-up (:func:`rounding_warmup`)."""
    warm = rounding_warmup(stages)
    acc: dict[str, list[float]] = {}
    seen: set[str] = set()
    for t, kind, sec, w, _ in _timed_tensors(stages):
        if t not in seen and t in warm:
            sec -= warm[t]["seconds"]
        seen.add(t)
        a = acc.setdefault(f"{t}/{kind}", [0.0, 0])
        a[0] += sec
        a[1] += w
    return {k: {"weights": w, "seconds": round(s, 2), "s_per_mweight": round(s / w * 1e6, 4)}
            for k, (s, w) in sorted(acc.items())}


def _extrapolate_stage(d: dict, rates: dict, t_end: float) -> dict:
    """A cut stage completed at the rates measured: the tensors left to round at their own rate (else their type's
    in this run, else the run's mean per weight), the tuning stage in flight and its groups left at the seconds per
    step measured; what was not reached is listed."""
    left, basis = 0.0, {}
    mean = (sum(r["seconds"] for r in rates.values()) / max(1, sum(r["weights"] for r in rates.values())) * 1e6
            if rates else None)
    for name, x in d.get("round", {}).get("tensors", {}).items():
        if x["state"] == "done":
            continue
        k = f"{x['type']}/{'stack' if x['experts'] else 'matrix'}"
        rate, src = x.get("s_per_mweight"), "measured in this tensor"
        if rate is None and k in rates:
            rate, src = rates[k]["s_per_mweight"], f"{k} in this run"
        elif rate is None and mean is not None:
            rate, src = mean, "the run's mean per weight"
        if rate is None:
            basis[name] = {"from": "no rounding finished: not extrapolated"}
            continue
        rest = (x["weights"] - x["weights_done"]) / 1e6 * rate - x.get("in_flight_s", 0.0)
        left += max(0.0, rest)
        basis[name] = {"weights_left": x["weights"] - x["weights_done"], "s_per_mweight": round(rate, 4), "from": src}
    tune = d.get("tune")
    not_reached = []
    if tune is None:
        not_reached.append("block-output tuning")
    else:
        for k, s in enumerate(tune["stages"]):
            if s["state"] == "cut" and s.get("s_per_step") and s.get("iters"):
                per_check = s["check_s"] / s["checks"] if s["checks"] else 0.0
                # the layer's first stage checks its start and DEFAULT_CHECKS marks; a group only its GROUP_CHECKS
                marks = _checks(s["iters"]) if k == 0 else _checks(s["iters"], _group_checks(), start=False)
                left += max(0, s["iters"] - s["steps_done"]) * s["s_per_step"] + max(0, marks - s["checks"]) * per_check
        n_groups = len(tune["groups"])
        started = max(0, len(tune["stages"]) - 1)
        per = [s for s in tune["stages"][1:] if s.get("s_per_step")]
        if n_groups > started and per:
            g = per[-1]
            left += (n_groups - started) * (g["iters"] * g["s_per_step"] + g["setup_s"] + g["check_s"])
        if tune["state"] == "cut":
            not_reached.append("the tuned layer's quantized pass")
    return {"left_s": round(left, 2), "stage_seconds": round(d.get("seconds", 0.0) + left, 2), "round_basis": basis,
            "not_reached": not_reached}


def summarise_hessian(events: list[dict], t_end: float | None = None) -> dict:
    """The phases of the gguf-hessian stage (and of gguf-tune): the imatrix, the host rates sampled, then per
    calibrated stage of `convert --rounding hessian` the capture forward (with its Hessian accumulation), the
    per-expert Hessians, Hessian rounding per tensor (N of M weights), block-output tuning (stages and expert
    groups, steps, the tuner's own encodes), then ggml's exact encodes and the write; a cut stage is completed
    within the layer at its measured rates ("extrapolated_within_layer")."""
    t_end = t_end if t_end is not None else max([e.get("t1", e["t0"]) for e in events] or [time.time()])
    done, open_ = _pair(events, t_end)
    closed = done + [dict(e, t1=t_end) for e in open_]
    out: dict = {}
    im = next((e for e in closed if e["k"] == "imatrix"), None)
    if im is not None:
        out["imatrix"] = {"seconds": round(im["t1"] - im["t0"], 2), "state": "cut" if "elapsed" in im else "done",
                          "rows": im.get("rows"), "reused": im.get("reused", False),
                          "forward_s": {x["k"].split("/", 1)[1]: round(x["t1"] - x["t0"], 2) for x in done
                                        if x["k"].startswith("forward/") and _in(x, im)}}
    rates = next((e for e in events if e["k"] == "host_rates"), None)
    if rates is not None:
        out["host_rates"] = rates["rates"]
    probed = {k: v for e in events if e["k"] == "round_probe" for k, v in e["rate"].items()}
    if probed:
        out["round_probe"] = probed
    eh = [e for e in done if e["k"].startswith("experts_hessian/")]
    if eh:
        sec, n = sum(e["t1"] - e["t0"] for e in eh), sum(e.get("n", 0) for e in eh)
        out["experts_hessian"] = {"calls": len(eh), "experts": n, "seconds": round(sec, 2),
                                  "s_per_expert": round(sec / max(n, 1), 4)}
    conv = next((e for e in closed if e["k"].startswith(("convert/", "probe/"))), None)
    plan = next((e for e in events if e["k"] == "hessian_rounding" and "todo" in e), None)
    todo = plan["todo"] if plan else {}
    stages: dict[str, dict] = {}
    if conv is not None:
        out["convert"] = {"label": conv["k"].split("/", 1)[1], "seconds": round(conv["t1"] - conv["t0"], 2),
                          "state": "cut" if "elapsed" in conv else "done",
                          "validate_s": round(_secs(done, "validate", conv), 2),
                          "plan_s": round(_secs(done, "plan", conv), 2),
                          "tune_init_s": round(_secs(done, "tune_init", conv), 2)}
        names = set(todo) | {e["k"].split("/", 1)[1] for e in closed if e["k"].startswith(("forward/", "tune_layer/"))
                             and _in(e, conv)}
        for st in sorted(names, key=_stage_order):
            d: dict = {"state": "not started"}
            fwd = next((e for e in closed if e["k"] == f"forward/{st}" and _in(e, conv)), None)
            if fwd is not None:
                d["capture_forward_s"] = round(fwd["t1"] - fwd["t0"], 2)
                d["hessian_accumulate_s"] = round(_within(done, "hessian_add", fwd["t0"], fwd["t1"]), 2)
                d["state"] = "cut in the capture forward" if "elapsed" in fwd else "done"
            # the calibration's own copy of the source layer: read, built and moved to the device, then given back
            moved = [e for e in closed if e["k"] in (f"materialize/{st}", f"release/{st}") and _in(e, conv)]
            if moved:
                d["source_layer_s"] = round(sum(e["t1"] - e["t0"] for e in moved), 2)
            if st in todo:
                t = _round_summary(done, closed, todo[st], t_end)
                spans = [e for e in closed if e["k"].startswith("round/") and e["k"][6:] in t]
                d["round"] = {"seconds": round(sum(e["t1"] - e["t0"] for e in spans), 2), "tensors": t,
                              "parts_s": {k: v["seconds"] for k, v in _weights_seconds(
                                  [e for e in done if any(_in(e, s) for s in spans)], "round_part/").items()},
                              "host_dequant_s": round(sum(_secs(done, "host_dequant/", s) for s in spans), 2),
                              "weights_done": sum(x["weights_done"] for x in t.values()),
                              "weights": sum(x["weights"] for x in t.values())}
                if any(x["state"] != "done" for x in t.values()) and d["state"] == "done":
                    d["state"] = "cut in Hessian rounding" if any(x["state"] == "cut" for x in t.values()) \
                        else "not finished"
            tune = _tune_summary(done, closed, st)
            if tune is not None:
                d["tune"] = tune
                if tune["state"] == "cut":
                    d["state"] = "cut in block-output tuning"
                elif d["state"] == "not started":  # the tune probe: streams and tuning, no capture
                    d["state"] = "done"
            own = (f"forward/{st}", f"tune/{st}", f"tune_layer/{st}", f"materialize/{st}", f"release/{st}")
            starts = [e["t0"] for e in closed if _in(e, conv) and (e["k"] in own
                      or e["k"][6:] in d.get("round", {}).get("tensors", {}))]
            ends = [e["t1"] for e in closed if _in(e, conv) and (e["k"] in own
                    or e["k"][6:] in d.get("round", {}).get("tensors", {}))]
            if starts:
                d["seconds"] = round(max(ends) - min(starts), 2)
            stages[st] = d
        r = _round_rates(stages)
        for st, d in stages.items():
            if d["state"] != "done" and d["state"] != "not started":
                d["measured_s"] = d.get("seconds", 0.0)
                d["extrapolated_within_layer"] = _extrapolate_stage(d, r, t_end)
        out["stages"] = stages
        out["round_rates"] = r
        out["rounding_warmup"] = rounding_warmup(stages)
        wr = next((e for e in closed if e["k"] == "write" and _in(e, conv)), None)
        if wr is not None:
            enc = _weights_seconds(done, "encode/", wr)
            out["write"] = {"seconds": round(wr["t1"] - wr["t0"], 2), "state": "cut" if "elapsed" in wr else "done",
                            "encode": enc, "encode_s": round(sum(x["seconds"] for x in enc.values()), 2)}
        first = min([e["t0"] for e in closed if _in(e, conv) and e["k"].startswith(("forward/", "round/",
                                                                                      "tune_layer/"))] or [None])
        if first is not None:
            out["convert"]["before_first_stage_s"] = round(first - conv["t0"], 2)
    start = next((e["t0"] for e in events if e["k"] == "child"), None)
    if start is not None:
        out["elapsed_s"] = round(t_end - start, 2)
    out["open_at_end"] = [{"phase": e["k"], "elapsed_s": e["elapsed"]} for e in open_]
    out.update(_peaks_of(events))
    return out


def summarise_eval(events: list[dict], t_end: float | None = None) -> dict:
    """The eval stage's phases: the cheap candidate written, then per model (the reference, a candidate) its
    reads / decodes per layer, the forward per layer, the weights' copy to the device, its head and logits; a
    candidate's decode split into the GPU decode kernels (per type) and the rest (bytes in, copies, unbuild)."""
    t_end = t_end if t_end is not None else max([e.get("t1", e["t0"]) for e in events] or [time.time()])
    done, open_ = _pair(events, t_end)
    closed = done + [dict(e, t1=t_end) for e in open_]
    out: dict = {}
    cand = next((e for e in closed if e["k"].startswith("candidate/")), None)
    if cand is not None:
        out["candidate_written"] = {"type": cand["k"].split("/", 1)[1], "seconds": round(cand["t1"] - cand["t0"], 2),
                                    "state": "cut" if "elapsed" in cand else "done",
                                    "encode": _weights_seconds(done, "encode/", cand)}
    models: dict[str, dict] = {}
    for e in done:
        kind, _, rest = e["k"].partition("/")
        if kind not in ("load", "get", "dequant", "forward", "materialize", "logits", "embed"):
            continue
        who = e.get("model", rest)
        m = models.setdefault(who, {})
        sec = e["t1"] - e["t0"]
        if kind == "forward":
            lay = m.setdefault("forward_per_layer_s", {})
            key = f"layer.{e.get('layer')}"
            lay[key] = round(lay.get(key, 0.0) + sec, 3)
        elif kind == "embed":  # its tensor read (get/) is counted there
            sec -= _secs(done, "get/", e)
        m[f"{kind}_s"] = round(m.get(f"{kind}_s", 0.0) + sec, 3)
    for who, m in models.items():
        if who != "reference":
            m["decode"] = _weights_seconds(done, f"decode/{who}/")
            m["decode_s"] = round(sum(x["seconds"] for x in m["decode"].values()), 3)
    out["models"] = models
    out["score_s"] = round(_secs(done, "score"), 2)
    out["open_at_end"] = [{"phase": e["k"], "elapsed_s": e["elapsed"]} for e in open_]
    out.update(_peaks_of(events))
    return out


SUMMARIES = {"exl3": summarise_exl3, "gguf": summarise_gguf, "gguf-hessian": summarise_hessian,
             "gguf-tune": summarise_hessian, "eval": summarise_eval}


def summarise_spans(events: list[dict], t_end: float | None = None) -> dict:
    """Any other stage: seconds per logged phase (open ones up to the cut)."""
    t_end = t_end if t_end is not None else time.time()
    done, open_ = _pair(events, t_end)
    out: dict = {}
    for e in done:
        if e["k"] != "hessian_add":
            out[e["k"]] = round(out.get(e["k"], 0.0) + e["t1"] - e["t0"], 2)
    return {"phases": out, "open_at_end": [{"phase": e["k"], "elapsed_s": e["elapsed"]} for e in open_],
            **_peaks_of(events)}


# --- stages (each runs in a child process: `--child STAGE`) --------------------------------------------------

_LOG: Path | None = None  # this child's progress log (set by main)
_KILL_AT: float | None = None  # when the parent will kill this child (epoch seconds), if it will


def _peaks() -> dict:
    import resource

    import torch

    d = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        d["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return d


def _timed(fn, *a, **k):
    t = time.time()
    out = fn(*a, **k)
    sec = round(time.time() - t, 2)
    # a progress line on stderr (the parent passes it through): a stage cut by a time limit still shows its steps
    print(f"  {getattr(fn, '__name__', fn)}: {sec} s", file=sys.stderr, flush=True)
    return out, sec


def stage_build(work: Path, device: str, experts: int = 32, small: bool = False, layers=DEFAULT_LAYERS,
                fp8: bool = True) -> dict:
    return build(work, experts, small=small, device=device, layers=layers, fp8=fp8, progress=Probe(log_path=_LOG))


def stage_load(work: Path, device: str) -> dict:
    """Read every tensor of the BF16 (and the FP8, when built) slice through mixq's reader (FP8 dequantized)."""
    from mixq.formats.checkpoint import open_checkpoint

    probe = Probe(log_path=_LOG)
    out = {}
    for kind in ("bf16", "fp8"):
        if not (work / kind / "config.json").is_file():
            continue
        with probe.span(f"read/{kind}"):
            ck = open_checkpoint(work / kind)
            t, n = time.time(), 0
            for name in ck.names():
                n += ck.get(name).numel()
            sec = time.time() - t
        nbytes = sum(f.stat().st_size for f in (work / kind).glob("*.safetensors"))
        out[kind] = {"seconds": round(sec, 2), "params": n, "file_bytes": nbytes,
                     "gb_per_s": round(nbytes / sec / 1e9, 3)}
    out.update(_peaks())
    return out


def stage_exl3(work: Path, device: str, bpw: float = 3.05, rows: int = 64, seq_len: int = 512,
               trellis_profile: bool = False) -> dict:
    """mixq's EXL3 conversion of the slice (calibration with every expert, trellis, write), then `verify` when the
    time left allows (about half the conversion's seconds). `trellis_profile`: each trellis call split by phase
    (_trellis_profile)."""
    from mixq.conversion.api import convert, verify
    from mixq.conversion.options import Exl3Options

    out = work / "mixq-exl3"
    shutil.rmtree(out, ignore_errors=True)
    probe = _exl3_probe(_LOG)
    if trellis_profile:
        _trellis_profile(probe)
    rates = release_exl3_rates(bpw)
    probe.emit({"k": "exl3_rates", "t0": time.time(), "t1": time.time(), "release_bpw": bpw, "rates": rates})
    # every budgeted role pinned, so the target only has to admit them (8 bpw admits any rates)
    opts = Exl3Options(bpw=8.0, overrides=[f"{role}={bits:g}" for role, bits in rates.items()], device=device,
                       rows=rows, seq_len=seq_len, progress=False)
    res, sec = _timed(convert, work / "bf16", out, opts)
    d = res.to_dict()
    d.update(wall_seconds=sec, timings=probe.rounded(), calibration=_calibration_seconds(probe))
    if _KILL_AT is None or time.time() + 0.5 * sec < _KILL_AT:
        rep, vsec = _timed(verify, out)
        d.update(verify_seconds=vsec, verify_ok=bool(rep.get("ok", not rep.get("problems"))))
    else:
        d["verify"] = "skipped: too little time before the deadline"
    d["phases"] = summarise_exl3(read_log(_LOG)) if _LOG else {}
    d.update(_peaks())
    return d


EVAL_CANDIDATES = ("mixq-exl3", "slice-iq-2.6bpw.gguf", "slice-Q4_K_M.gguf", "slice-iq-2.6bpw-hessian.gguf",
                   "slice-Q8_0.gguf")


def _complete(path: Path) -> bool:
    """A candidate its stage finished: a GGUF file (renamed into place once written), an EXL3 directory holding its
    config.json (written last; a cut conversion leaves a directory without one)."""
    return path.is_file() or (path / "config.json").is_file()


def _eval_probe(p: Probe) -> None:
    """Per model (the reference, each candidate): its layer reads (`load/CLASS`), single tensors (`get/CLASS`), a
    candidate's decode (`dequant/CLASS`, and inside it torch's GPU decode per type: `decode/NAME/TYPE`), the copy of
    each layer to the device (`materialize`), the forward per layer (`forward`), the embedding, the logits and the
    statistics. Every event names its model and layer."""
    from mixq.eval import api
    from mixq.eval.streamed import StreamedModels
    from mixq.quant.ggml import torch_decode
    from mixq.runtime import dequant, layer_stream

    cur = {"model": "reference", "layer": None}

    def who(src) -> str:
        if not isinstance(src, dequant.DequantSource):
            return cur["model"]
        return "reference" if isinstance(src, dequant.CheckpointSource) else src.path.name

    def at(src, layer=None) -> dict:
        cur.update(model=who(src), layer=layer)
        return dict(cur)

    for cls in (dequant.CheckpointSource, dequant.GGUFSource, dequant.Exl3Source):
        p.wrap([cls], "layer", lambda self, i, _c=cls.__name__: f"load/{_c}", info=lambda self, i: at(self, i))
        p.wrap([cls], "get", lambda self, name, _c=cls.__name__: f"get/{_c}", info=lambda self, name: at(self))
    for cls in (dequant.GGUFSource, dequant.Exl3Source):
        p.wrap([cls], "_decode", lambda self, units, _c=cls.__name__: f"dequant/{_c}",
               info=lambda self, units: {"model": who(self)}, begin=False)
    p.wrap([torch_decode], "dequantize", lambda raw, qtype, shape: f"decode/{cur['model']}/{qtype}",
           info=lambda raw, qtype, shape: {"w": math.prod(shape)}, begin=False)
    for m in ("run_layer", "run_layer_inplace"):
        p.wrap([layer_stream.DecoderStream], m, lambda *a, **k: "forward", info=lambda *a, **k: dict(cur))
    p.wrap([layer_stream.DecoderStream], "materialize", lambda self, layer, fetch: "materialize",
           info=lambda self, layer, fetch: dict(cur))
    p.wrap([layer_stream.DecoderStream], "embed", lambda *a, **k: "embed",
           info=lambda self, ids, fetch, *a, **k: {"model": who(getattr(fetch, "__self__", None))})
    p.wrap([StreamedModels], "scored_logits", lambda self, m, w, first: "logits",
           info=lambda self, m, w, first: {"model": who(m.source)}, begin=False)
    p.wrap([api], "token_quantities", lambda *a, **k: "score", begin=False)


def _cheap_candidate(work: Path, device: str, qtype: str, probe: Probe) -> dict:
    """`convert --type QTYPE` of the slice (a type ggml encodes fast): a candidate for the eval when the conversion
    stages left none."""
    from mixq.conversion.api import convert
    from mixq.conversion.options import GGUFOptions

    _encode_probe(probe)
    enc = {"device": device} if device != "cpu" else {"threads": 1}
    with probe.span(f"candidate/{qtype}"):
        res, sec = _timed(convert, work / "bf16", work / f"slice-{qtype}.gguf",
                          GGUFOptions(qtype=qtype, progress=False, overwrite=True, **enc))
    d = res.to_dict()
    return {"name": f"slice-{qtype}.gguf", "wall_seconds": sec, "bytes": d["bytes"], "types": d["types"]}


def stage_eval(work: Path, device: str, windows: int = 16, ctx: int = 4096, cheap: str = "Q8_0") -> dict:
    """Streaming `mixq eval` against the BF16 slice on held-out text, of every candidate the earlier stages finished
    (mixq's EXL3 directory, the i-quant GGUFs, the Q4_K_M GGUF); with none, the `cheap` GGUF (`--eval-cheap`, made
    here first). One reference pass, each candidate's layers loaded (dequantized) and run; per model its reads,
    decodes, copies, forward per layer and logits (_eval_probe)."""
    from mixq.eval.api import evaluate

    probe = Probe(log_over=5.0, log_path=_LOG)
    cands = [work / n for n in EVAL_CANDIDATES if _complete(work / n)]
    made = None
    if not cands and cheap and cheap.lower() != "none":
        made = _cheap_candidate(work, device, cheap, probe)
        cands = [work / made["name"]]
    if not cands:
        raise SystemExit(f"no candidate in {work}: run the exl3 or gguf stage first")
    _eval_probe(probe)
    rep, sec = _timed(evaluate, work / "bf16", cands, SHARED / "data" / "heldout.txt", ctx=ctx,
                      windows=windows, device=device, progress=False)
    keep = ("kld_mean", "top1", "ppl", "peak_rss_mib", "peak_gpu_mib", "seconds", "timings")
    out = {"wall_seconds": sec, "windows": windows, "ctx": ctx, "timings": probe.rounded(),
           "report": {k: rep[k] for k in keep if k in rep},
           "candidates": [{"name": p.name, **{k: c[k] for k in ("kld_mean", "top1_agreement", "ppl", "bpw",
                                                                 "file_bpw", "bytes") if k in c}}
                          for p, c in zip(cands, rep["candidates"])],
           **_peaks()}
    if made is not None:
        out["cheap_candidate"] = made
    out["phases"] = summarise_eval(read_log(_LOG)) if _LOG else {}
    return out


def _eager_for(types: set[str]) -> None:
    """Encode `types` without the fused Triton kernels (MIXQ_KQUANT_FUSED=0 around their calls): for a type whose
    kernel compiles for longer than the run can wait."""
    from mixq.quant.ggml import encoders

    for fn in ("quantize_stacked", "quantize_tensor", "quantize"):
        orig = getattr(encoders, fn)

        def eager(x, qtype, *a, _orig=orig, **k):
            if qtype not in types:
                return _orig(x, qtype, *a, **k)
            old = os.environ.get("MIXQ_KQUANT_FUSED")
            os.environ["MIXQ_KQUANT_FUSED"] = "0"
            try:
                return _orig(x, qtype, *a, **k)
            finally:
                if old is None:
                    os.environ.pop("MIXQ_KQUANT_FUSED")
                else:
                    os.environ["MIXQ_KQUANT_FUSED"] = old
        setattr(encoders, fn, eager)


GGUF_TYPES = {"Q4_K_M": {"qtype": "Q4_K_M"}, "iq-2.6bpw": {"bpw": 2.6, "gguf_ladder": "iq"}}


def stage_gguf(work: Path, device: str, rows: int = 64, seq_len: int = 512, eager_types: str = "",
               types: str = "Q4_K_M,iq-2.6bpw") -> dict:
    """imatrix, then each of `types`: Q4_K_M with it, the 108 GB plan's i-quant ladder at its bpw."""
    from mixq.conversion.api import convert
    from mixq.conversion.options import GGUFOptions
    from mixq.conversion.gguf.imatrix import make_imatrix

    from mixq.quant.ggml import encoders

    imat = work / "slice.imatrix.gguf"
    imat.unlink(missing_ok=True)
    out: dict = {"eager_types": eager_types}
    if eager_types:
        _eager_for(set(eager_types.split(",")))
    probe = Probe(log_over=2.0, log_path=_LOG)
    for fn in ("quantize_stacked", "quantize_tensor", "quantize"):
        probe.wrap([encoders], fn, lambda x, qtype, *a, **k: f"encode/{qtype}", group="encode",
                   info=lambda x, *a, **k: {"w": int(x.size if hasattr(x, "size") and not callable(x.size)
                                                      else x.numel())})
    _calibration_probe(probe)
    with probe.span("imatrix"):
        _, out["imatrix_seconds"] = _timed(make_imatrix, work / "bf16", imat, rows=rows, seq_len=seq_len,
                                           device=device, progress=False)
    enc = {"device": device} if device != "cpu" else {"threads": 1}  # in this process, where the probe is
    for label in [t for t in types.split(",") if t]:
        if label not in GGUF_TYPES:
            raise SystemExit(f"--gguf-types: unknown {label}; use {', '.join(GGUF_TYPES)}")
        opts = GGUFOptions(imatrix=str(imat), progress=False, overwrite=True, **GGUF_TYPES[label], **enc)
        with probe.span(f"convert/{label}"):
            res, sec = _timed(convert, work / "bf16", work / f"slice-{label}.gguf", opts)
        d = res.to_dict()
        out[label] = {"wall_seconds": sec, "bytes": d["bytes"], "bpw": d["bpw"], "types": d["types"],
                      "weights_by_type": _gguf_weights_by_type(work / f"slice-{label}.gguf"),
                      "timings": {k: v for k, v in probe.rounded().items() if k.startswith("encode/")}}
        probe.seconds.clear()
    out["phases"] = summarise_gguf(read_log(_LOG)) if _LOG else {}
    out.update(_peaks())
    return out


def _gguf_weights_by_type(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    out: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_elements)
    return out


# --- GGUF --rounding hessian: the 108 GB plan's bpw with Hessian rounding and block-output tuning -------------

HESSIAN_LABEL = "iq-2.6bpw-hessian"
HESSIAN_PLAN = dict(GGUF_TYPES["iq-2.6bpw"], rounding="hessian")  # the gguf stage's 108 GB-class plan
SAMPLE_ROWS = 32  # rows of one real matrix encoded and decoded per type on the host (the tuner's host paths)


def _slice_imatrix(work: Path, device: str, probe: Probe, rows: int, seq_len: int) -> Path:
    """The gguf stage's imatrix when it is there, else one made here from `rows` x `seq_len` tokens."""
    from mixq.conversion.gguf.imatrix import make_imatrix

    shared = work / "slice.imatrix.gguf"
    if shared.is_file():
        with probe.span("imatrix", rows=None, reused=True):
            pass
        return shared
    imat = work / "slice-hessian.imatrix.gguf"
    imat.unlink(missing_ok=True)
    with probe.span("imatrix", rows=rows, reused=False):
        _timed(make_imatrix, work / "bf16", imat, rows=rows, seq_len=seq_len, device=device, progress=False)
    return imat


def _sample_matrix(ckpt):
    """SAMPLE_ROWS rows of the first routed-expert matrix reading the hidden stream (else any such matrix)."""
    import torch

    hidden = int(ckpt.text_config["hidden_size"])
    names = [n for n in ckpt.names() if len(ckpt.shape(n)) == 2 and ckpt.shape(n)[1] == hidden
             and ckpt.shape(n)[0] >= SAMPLE_ROWS]
    name = next((n for n in names if ckpt.info(n).role == "routed_expert"), names[0])
    return ckpt.get(name, dtype=torch.float32)[:SAMPLE_ROWS].contiguous().numpy()


def host_rates(work: Path, types: list[str]) -> dict[str, dict]:
    """M weights/s on this host, per type, of what `--rounding hessian` runs with numpy: ggml's encoder in the
    tuner (`stored_values`, the types Hessian rounding leaves to ggml), gguf-py's decoder (the tuner's and the
    rounding's host decodes) and the level grid of the tunable types (the codes' set-up)."""
    import numpy as np

    from mixq.conversion.gguf.workers import encode
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.quant.ggml.rounding import hessian as kh
    from mixq.quant.ggml.rounding import levels as gl

    x = _sample_matrix(open_checkpoint(work / "bf16"))
    im = np.mean(x * x, axis=0) + 1e-6  # a positive importance: the i-quants need one
    out: dict[str, dict] = {}
    for q in types:
        encode(x[:1], q, im)  # the first call of a type builds its tables: not part of the rate
        t = time.time()
        b = encode(x, q, im)
        d = {"numpy_encode": x.size / max(time.time() - t, 1e-9) / 1e6}
        t = time.time()
        kh.dequantize_blocks(b, q)
        d["host_decode"] = x.size / max(time.time() - t, 1e-9) / 1e6
        if q in gl.SCALAR_TYPES:  # IQ2_S's tuned codes are built another way (block_tuning.IQ2Codes)
            t = time.time()
            gl.level_grid(b, q)
            d["level_grid"] = x.size / max(time.time() - t, 1e-9) / 1e6
        out[q] = {k: round(v, 3) for k, v in d.items()}
    return out


def _hessian_types(work: Path) -> list[str]:
    """Quantized types of the slice's hessian plan and of the release's 108 GB plan (the host rates sampled)."""
    from mixq.planning.gguf_assign import assign_types
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import gguf_tensors

    ck = open_checkpoint(work / "bf16")
    kw = {k: v for k, v in HESSIAN_PLAN.items() if k != "rounding"}
    mine = set(assign_types(ck, gguf_tensors(ck), **kw))
    return sorted((mine | set(_release_gguf_weights())) - set(FLOAT_TYPES))


def stage_gguf_hessian(work: Path, device: str, rows: int = 64, seq_len: int = 512, tune_iters: int = 200,
                       imatrix_rows: int | None = None, eager_types: str = "",
                       refine_passes: int | None = None, round_profile: Path | None = None,
                       tune_budget: int | None = None) -> dict:
    """`convert --bpw 2.6 --gguf-ladder iq --rounding hessian --imatrix` of the slice (the gguf stage's 108 GB-class
    plan), every phase logged (_hessian_probe): imatrix (the gguf stage's, else made from `imatrix_rows`), the host
    rates of the tuner's numpy paths, then per layer the capture forward, per-expert Hessians, Hessian rounding,
    block-output tuning (`tune_iters` steps per stage, expert groups), then ggml's encoders and the write.
    `round_profile`: a file for the profile of one stacked rounding call (_profiled_rounding). `tune_budget`: the
    tuner's weights per stage instead of its share of the free memory (larger expert groups, fewer of them)."""
    from mixq.conversion.api import convert
    from mixq.conversion.options import GGUFOptions

    if tune_budget:
        import mixq.conversion.gguf.tuning as gt

        gt.tuning_budget = lambda device: int(tune_budget)

    if eager_types:
        _eager_for(set(eager_types.split(",")))
    probe = _hessian_probe(_LOG)
    imat = _slice_imatrix(work, device, probe, imatrix_rows or rows, seq_len)
    out: dict = {"tune_iters": tune_iters, "rows": rows, "seq_len": seq_len, "imatrix": imat.name,
                 "eager_types": eager_types, "refine_passes": refine_passes}
    with probe.span("host_rates_sample"):
        out["host_rates_mweights_per_s"] = host_rates(work, _hessian_types(work))
    probe.emit({"k": "host_rates", "t0": time.time(), "rates": out["host_rates_mweights_per_s"]})
    enc = {"device": device} if device != "cpu" else {"threads": 1}
    opts = GGUFOptions(imatrix=str(imat), progress=False, overwrite=True, rows=rows, seq_len=seq_len,
                       tune_iters=tune_iters, refine_passes=refine_passes, **HESSIAN_PLAN, **enc)
    with probe.span(f"convert/{HESSIAN_LABEL}"), _profiled_rounding(round_profile):
        res, sec = _timed(convert, work / "bf16", work / f"slice-{HESSIAN_LABEL}.gguf", opts)
    d = res.to_dict()
    out[HESSIAN_LABEL] = {"wall_seconds": sec, "bytes": d["bytes"], "bpw": d["bpw"], "types": d["types"]}
    out["phases"] = summarise_hessian(read_log(_LOG)) if _LOG else {}
    out.update(_peaks())
    return out


def _write_profile(path: Path, title: str, prof, host_rows: int) -> None:
    """Append a finished profile's tables to `path` under `title`: by device time (40 rows, where there is a GPU),
    then by host time (`host_rows`)."""
    import torch

    table = prof.key_averages()
    with open(path, "a") as f:
        f.write(f"== {title}\n")
        if torch.cuda.is_available():
            f.write(table.table(sort_by="cuda_time_total", row_limit=40) + "\n")
        f.write(table.table(sort_by="cpu_time_total", row_limit=host_rows) + "\n")


@contextmanager
def _profiled_rounding(path: Path | None, qtype: str = "IQ2_S", call: int = 2):
    """With `path`, torch's profiler from the end of `qtype`'s first stacked (expert-slice) rounding call to the
    end of its `call`-th: that call's fetch of the slice, its experts' Hessians and the rounding itself, as the
    converter runs them; the tables, by device time and by host time, appended to `path`. The profiled call runs
    slower than the others (the profiler's cost), and its seconds stay among the type's calls."""
    if path is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mixq.quant.ggml.rounding import hessian as kh

    saved = kh.quantize_hessian
    seen = {"n": 0, "prof": None}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def rounded(w, h, qt, *args, **kw):
        out = saved(w, h, qt, *args, **kw)
        if qt != qtype or w.dim() != 3 or seen["n"] >= call:
            return out
        seen["n"] += 1
        if seen["n"] == call - 1:
            seen["prof"] = profile(activities=acts)
            seen["prof"].__enter__()
        elif seen["n"] == call:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof = seen["prof"]
            prof.__exit__(None, None, None)
            _write_profile(path, f"{qtype} stacked rounding call {call} ({w.shape[0]} experts), with its fetch and "
                                 f"Hessians", prof, 40)
        return out

    kh.quantize_hessian = rounded
    try:
        yield
    finally:
        kh.quantize_hessian = saved


@contextmanager
def _profiled_tuning(path: Path | None, stages: tuple[int, ...] = (0, 1)):
    """With `path`, torch's profiler over tuning stages `stages` (0: a layer's first stage, 1: its first expert
    group), the step's parts labelled (codes decoded, expert stacks built, forward, backward); each stage's
    tables, by device time and by host time, appended to `path`."""
    if path is None:
        yield
        return
    import itertools

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import mixq.conversion.gguf.tuning as gt
    from mixq.quant.ggml.rounding import block_tuning as bt

    saved = {"descent": bt.sign_descent, "stacked": gt.stacked_block,
             "level": bt.LevelCodes.dequantized, "iq2": bt.IQ2Codes.dequantized}
    calls = itertools.count()

    def labelled(name: str, fn):
        def call(*args, **kw):
            with record_function(name):
                return fn(*args, **kw)
        return call

    def descent(params, loss, batches, iters, lr, **kw):
        k = next(calls)
        if k not in stages:
            return saved["descent"](params, loss, batches, iters, lr, **kw)
        cuda = torch.cuda.is_available()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

        def timed_loss(batch):
            with record_function("tune/loss (forward)"):
                return loss(batch)
        with profile(activities=acts) as prof:
            out = saved["descent"](params, timed_loss, batches, iters, lr, **kw)
            if cuda:
                torch.cuda.synchronize()
        _write_profile(path, f"tuning stage {k}: {iters} steps, {sum(p.numel() for p in params):,} parameters",
                       prof, 30)
        return out

    bt.sign_descent = descent
    gt.stacked_block = labelled("tune/stacked_block", saved["stacked"])
    bt.LevelCodes.dequantized = labelled("tune/LevelCodes.dequantized", saved["level"])
    bt.IQ2Codes.dequantized = labelled("tune/IQ2Codes.dequantized", saved["iq2"])
    try:
        yield
    finally:
        bt.sign_descent, gt.stacked_block = saved["descent"], saved["stacked"]
        bt.LevelCodes.dequantized, bt.IQ2Codes.dequantized = saved["level"], saved["iq2"]


def stage_gguf_tune(work: Path, device: str, rows: int = 64, seq_len: int = 512, tune_iters: int = 200,
                    probe_iters: int = 20, profile: Path | None = None, tune_budget: int | None = None) -> dict:
    """Block-output tuning of the slice's first MoE layer as `--rounding hessian` runs it (mixq's LayerTuner with
    the hessian stage's plan, its memory budget and expert groups), `probe_iters` steps per tuning stage, started
    from ggml's encoding of the layer's tunable tensors (the same types and bytes as their Hessian rounding: a
    step's cost does not depend on the codes), a routed-expert stack's from its first expert's encoding repeated
    for every expert (encoding all 288 would take most of a call). The layer's other tensors keep their source values (the hessian
    stage costs their encode and host decode); the layers before it only carry the streams. `project` scales the
    seconds per step to `tune_iters`. `tune_budget`: the tuner's budget in weights (default: from the free memory)."""
    import numpy as np
    import torch

    from mixq.planning.gguf_assign import assign_types
    from mixq.conversion.gguf.rounding import covered
    from mixq.conversion.gguf.tuning import LayerTuner
    from mixq.conversion.gguf.workers import encode
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.gguf_names import build_tensor, gguf_tensors
    from mixq.quant.device import pick_device
    from mixq.quant.ggml.rounding import block_tuning as bt
    from mixq.runtime.calibration import calibration_rows, load_tokenizer

    probe = _hessian_probe(_LOG)
    ckpt = open_checkpoint(work / "bf16")
    specs = gguf_tensors(ckpt)
    types = assign_types(ckpt, specs, **{k: v for k, v in HESSIAN_PLAN.items() if k != "rounding"})
    moe = list(ckpt.text_config["mlp_layer_types"]).index("sparse")
    sel = [(s, t) for s, t in zip(specs, types) if s.layer == moe and covered(s, t) and t in bt.TUNABLE]
    dev = pick_device(device)
    ids = calibration_rows(load_tokenizer(ckpt.path), None, rows=rows, seq_len=seq_len,
                           vocab_size=int(ckpt.text_config["vocab_size"]))
    fetch = lambda n: ckpt.get(n, dtype=torch.float32)  # noqa: E731
    # a flat importance: ggml's imatrix variants of the fused kernels compile in seconds, the plain Q4_K/Q5_K
    # search in most of a minute on first use (bench/results/kquant-compile-time.json)
    def start_codes(spec, qtype: str) -> np.ndarray:
        one = dataclasses.replace(spec, hf_names=spec.hf_names[:1], shape=(1, *spec.shape[1:])) \
            if spec.transform == "stack" else spec
        b = encode(build_tensor(one, fetch).numpy(), qtype, np.ones(spec.shape[-1], np.float32),
                   device=None if dev.type == "cpu" else str(dev))
        return np.ascontiguousarray(np.broadcast_to(b, (spec.shape[0], *b.shape[1:]))) if one is not spec else b

    with probe.span("start_codes", w=sum(math.prod(s.shape) for s, _ in sel)):
        encoded = {s.name: start_codes(s, t) for s, t in sel}
    with probe.span(f"probe/tune {probe_iters} steps"), _profiled_tuning(profile):
        tuner = LayerTuner(ckpt, ids, [s for s, _ in sel], [t for _, t in sel], iters=probe_iters, device=dev,
                           max_weights=tune_budget)
        for i in range(moe):
            tuner.layer(i, {})  # the streams into the MoE layer: nothing of these layers is tuned here
        stream = tuner.source   # the source streams entering the MoE layer (the Hessians' stand-in below)
        tuner.layer(moe, encoded)
    del encoded
    rounded = round_probe(_probe_stacks(specs, moe), stream, fetch, dev, probe)
    return {"layer": moe, "probe_iters": probe_iters, "tune_iters": tune_iters, "max_weights": tuner.max_weights,
            "round_probe": rounded,
            "tuned": {s.name: [t, math.prod(s.shape)] for s, t in sel},
            "reports": [{"layer": r.layer, "check_before": r.check_before, "check_after": r.check_after,
                         "kept": r.kept, "changed": round(r.changed, 4), "seconds": round(r.seconds, 2)}
                        for r in tuner.reports],
            "phases": summarise_hessian(read_log(_LOG)) if _LOG else {}, **_peaks()}


def _probe_stacks(specs: list, layer: int) -> list:
    """(slice stack spec, type) per routed-expert stack type Hessian rounding covers in the release's 108 GB plan,
    most weights first: the slice's stack of `layer` as wide as the release's widest-by-weights stack of the type."""
    from mixq.conversion.gguf.rounding import covered

    by: dict[str, dict[int, int]] = {}
    for s, t in _release_gguf_specs():
        if s.transform == "stack" and covered(s, t):
            n = by.setdefault(t, {})
            n[int(s.shape[-1])] = n.get(int(s.shape[-1]), 0) + math.prod(s.shape)
    mine = [s for s in specs if s.layer == layer and s.transform == "stack"]
    if not mine:
        return []
    release_hidden = int(json.loads(SHAPE_CONFIG.read_text())["text_config"]["hidden_size"])
    out = []
    for t, widths in sorted(by.items(), key=lambda kv: -sum(kv[1].values())):
        n = max(widths, key=widths.get)
        # the slice's stack reading the hidden stream when the release's does (a toy slice is narrower)
        want = [s for s in mine if (s.shape[-1] == max(x.shape[-1] for x in mine)) == (n == release_hidden)]
        out.append(((want or mine)[0], t))
    return out


def round_probe(stacks: list, stream, fetch, dev, probe: Probe) -> dict[str, dict]:
    """Hessian rounding of one expert slice (the converter's slice size) of each routed-expert stack type the
    release's plan rounds ("TYPE/stack": seconds per M weights), as `_encode_spec` rounds it, with a stand-in Hessian of the same shape
    for every expert: E[x·xᵀ] of the source stream entering the layer (its first n dimensions). The cost is the
    column loop and the refinement passes over the slice, not the Hessian's values; the per-expert Hessians'
    formation is not in it (the gguf-hessian stage measures that)."""
    import torch

    import mixq.conversion.gguf.rounding as gr
    from mixq.quant.ggml.rounding import hessian as kh

    x = stream[..., 0, :].reshape(-1, stream.shape[-1]).to(dev, torch.float32)
    out: dict[str, dict] = {}
    for spec, qtype in stacks:
        key = f"{qtype}/stack"
        if key in out:
            continue
        n = int(spec.shape[-1])
        e = min(len(spec.hf_names), gr.expert_slice(int(spec.shape[-2]), n, torch.device(dev)))
        h = (x[:, :n].T @ x[:, :n] / x.shape[0]).expand(e, n, n).contiguous()
        w = torch.stack([fetch(name) for name in spec.hf_names[:e]])
        with probe.span(f"round_probe/{key}", w=int(w.numel()), experts=e):
            t = time.time()
            kh.quantize_hessian(w, h, qtype, None, damp=gr.DAMP, refine=gr.REFINE_PASSES, device=dev)
            sec = time.time() - t
        out[key] = {"tensor": spec.name, "experts": e, "weights": int(w.numel()), "seconds": round(sec, 2),
                    "s_per_mweight": round(sec / w.numel() * 1e6, 4)}
        probe.emit({"k": "round_probe", "t0": time.time(), "t1": time.time(), "rate": {key: out[key]}})
        del h, w
    return out


def stage_dequant(work: Path, device: str, rounds: int = 3, max_weights: int = 200_000_000) -> dict:
    """bench/speed/gguf_dequant_speed.py on this stage's device: gguf-py on the host against torch's decoders, on the
    slice's GGUF candidate (capped per type) and one synthetic tensor of each quantized type of the release's
    108 GB plan. Its JSON goes to WORK/gguf_dequant_speed.json and into this stage's result."""
    gg = next((work / n for n in reversed(EVAL_CANDIDATES) if n.endswith(".gguf") and (work / n).is_file()), None)
    types = sorted(t for t in _release_gguf_weights() if t not in FLOAT_TYPES)
    js = work / "gguf_dequant_speed.json"
    js.unlink(missing_ok=True)
    cuda = device != "cpu"
    cmd = [sys.executable, str(REPO / "bench" / "speed" / "gguf_dequant_speed.py"), "--device", "cuda" if cuda else "cpu",
           "--synthetic", ",".join(types), "--synthetic-shape", "4096x4096" if cuda else "64x4096",
           "--rounds", str(rounds), "--json", str(js)]
    if gg is not None:
        cmd += ["--gguf", str(gg), "--max-weights", str(max_weights)]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = {"returncode": r.returncode, "wall_seconds": round(time.time() - t, 1), "gguf": gg.name if gg else None,
           "table": r.stdout[-3000:]}
    if r.returncode:
        out["tail"] = r.stderr[-2000:]
    if js.is_file():
        d = json.loads(js.read_text())
        out["paths"] = d["paths"]
        out["weights_by_type"] = d["weights_by_type"]
    return out


def stage_exllamav3(work: Path, device: str, bpw: float = 3.05, rows: int = 64, seq_len: int = 512,
                    limit_s: float | None = None) -> dict:
    """exllamav3's own converter on the same slice at the same bpw and calibration size. Its log goes to
    WORK/exllamav3-convert.log as it runs; the per-layer seconds it prints are parsed from there, so a run cut
    by `limit_s` still gives them (``project`` scales mixq's projection by their ratio to mixq's layers)."""
    import re

    out, tmp = work / "exllamav3-exl3", work / "exllamav3-work"
    for d in (out, tmp):
        shutil.rmtree(d, ignore_errors=True)
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(work / "bf16"), "-o", str(out),
           "-w", str(tmp), "-b", str(bpw), "-cr", str(rows), "-cc", str(seq_len)]
    log = work / "exllamav3-convert.log"
    t = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    sec = time.time() - t
    text = log.read_text(errors="replace")
    layers = {m[1]: float(m[2]) for m in
              re.finditer(r"Quantized: model\.language_model\.layers\.(\d+)\s.*\[([\d.]+) s\]", text)}
    nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors")) if out.is_dir() else 0
    return {"returncode": rc, "wall_seconds": round(sec, 1), "bytes": nbytes, "bpw": bpw,
            "calibration": f"{rows} x {seq_len}", "layers_seconds": layers,
            "tail": text[-1500:] if rc else ""}


def stage_k256(work: Path, device: str, bpw: float = 3.05, windows: int = 32, ctx: int = 512) -> dict:
    """On the trained k256 fixture: exllamav3's converter at `bpw`, then mixq's role plan and its measured
    (`plan --measure`) plan at exllamav3's bytes; all three scored by `mixq eval` against the BF16 model."""
    model = SHARED / "models" / "glm5next-k256"
    d = work / "k256"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    out: dict = {}

    def run(name: str, cmd: list[str]) -> dict:
        t = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True)
        (d / f"{name}.log").write_text(r.stdout[-20000:] + "\n" + r.stderr[-20000:])
        res = {"returncode": r.returncode, "seconds": round(time.time() - t, 1)}
        if r.returncode:
            res["tail"] = (r.stdout + r.stderr)[-1500:]
        out[name] = res
        return res

    mixq = [sys.executable, "-m", "mixq"]
    run("exllamav3", [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(model), "-o",
                      str(d / "exllamav3"), "-w", str(d / "exllamav3-work"), "-b", str(bpw)])
    size = sum(f.stat().st_size for f in (d / "exllamav3").glob("*.safetensors")) if (d / "exllamav3").is_dir() \
        else None
    out["exllamav3"]["bytes"] = size
    if size:
        run("mixq_role", mixq + ["convert", str(model), str(d / "mixq-role"), "--format", "exl3", "--size",
                                 str(size), "--device", device])
        run("measure", mixq + ["plan", str(model), "--format", "exl3", "--size", str(size), "--measure",
                               "--measure-out", str(d / "curves.json"), "--device", device, "--json"])
        run("mixq_measured", mixq + ["convert", str(model), str(d / "mixq-measured"), "--format", "exl3", "--size",
                                     str(size), "--measure", str(d / "curves.json"), "--device", device])
    cands = [str(d / n) for n in ("exllamav3", "mixq-role", "mixq-measured") if (d / n).is_dir()]
    ev = run("eval", mixq + ["eval", str(model), *cands, "--text", str(SHARED / "data" / "heldout.txt"), "--ctx",
                             str(ctx), "--windows", str(windows), "--device", device, "--json", str(d / "eval.json"),
                             "--overwrite"])
    if ev["returncode"] == 0:
        rep = json.loads((d / "eval.json").read_text())
        out["scores"] = [{k: c.get(k) for k in ("name", "path", "bytes", "bpw", "file_bpw", "kld_mean",
                                                "kld_mean_err", "top1_agreement", "ppl") if k in c}
                         for c in rep["candidates"]]
    return out


# --- projection to the release ---------------------------------------------------------------------------------

def _release_counts(experts: int, layers=DEFAULT_LAYERS) -> dict:
    """Parameters per role of the release and of the slice, from their configs (shapes only)."""
    shape = json.loads(SHAPE_CONFIG.read_text())
    out = {}
    for label, cfg in (("release", shape), ("slice", slice_config(shape, experts, False, layers))):
        roles: dict[str, int] = {}
        for shp, role in _checkpoint_names(cfg).values():
            roles[role] = roles.get(role, 0) + math.prod(shp)
        out[label] = roles
    return out


def _expert_share(roles: dict) -> float:
    """The routed experts' share of a MoE layer's calibration forward, by parameters (as the 16-expert
    projection counted it: shared expert and attention weighted per layer)."""
    r = roles.get("routed_expert", 0)
    return r / max(1, r + roles.get("shared_expert", 0) / 3 + roles.get("attn", 0) / 4)


def _layer_from_phases(d: dict, ex: float, f_exp: float, moe: bool, record_s: float | None,
                      record_behind: bool = False) -> dict:
    """One layer of this run as (calibrated seconds, uncalibrated seconds, parts, basis) at 288 experts.
    `ex`: 288 / the run's experts (1 at the real count: nothing is scaled). A job record made on the worker thread
    while the next stage ran (`record_behind`, or the layer's own `record_behind`) is listed, not added."""
    basis = "measured"
    stage = d.get("seconds", 0.0)
    enc = {}
    for role, x in d.get("encode", {}).items():
        left = max(0, x.get("units_total", x["units_done"]) - x["units_done"])
        rate = x.get("s_per_unit")
        if rate is None:
            rate = (d.get("extrapolated_within_layer", {}).get("per_role", {}).get(role, {}).get("s_per_unit")
                    or 0.0)
        enc[role] = x["seconds"] + left * rate
    if "extrapolated_within_layer" in d:
        stage = d["extrapolated_within_layer"]["stage_seconds"]
        basis = "measured up to the cut + the units left at the rate measured in this layer (extrapolated)"
    non_enc = max(0.0, stage - sum(enc.values()))
    r_w = sum(x.get("weights_total", 0) for r, x in d.get("encode", {}).items() if r == "routed_expert")
    a_w = sum(x.get("weights_total", 0) for x in d.get("encode", {}).values())
    f_w = r_w / a_w if a_w else 0.0
    fwd = d.get("calibration_forward_s")
    parts = {"calibration_forward": None if fwd is None else fwd * ((1 - f_exp + f_exp * ex) if moe else 1.0),
             "hessian_accumulate (inside the forward)": d.get("hessian_accumulate_s"),
             "encode": {r: s * (ex if r == "routed_expert" else 1.0) for r, s in enc.items()},
             "fetch/write/finalize Hessians": non_enc * (1 - f_w + f_w * ex)}
    assumed = []
    adv = d.get("advance_forward_s")
    if adv is None and fwd is not None:
        adv = max(0.0, fwd - (d.get("hessian_accumulate_s") or 0.0))
        assumed.append("advance pass not reached: taken as the calibration forward less its Hessian accumulation "
                       "(the same layer without statistics; routed tokens only, so an upper bound)")
    parts["advance_forward"] = None if adv is None else adv * ((1 - f_exp + f_exp * ex) if moe else 1.0)
    rec = d.get("record_s", record_s)
    if "record_s" not in d and record_s is not None:
        assumed.append("job record (calibration state) not reached: another layer's of this run (the state "
                       "does not depend on the layer)")
    behind = d.get("record_behind", record_behind if "record_s" not in d else False)
    parts["record (behind the next stage: not added)" if behind else "record"] = rec
    if behind and d.get("write_s") is not None:
        parts["write (behind the next stage: not added)"] = d["write_s"]
    enc_total = sum(parts["encode"].values())
    cal = (parts["calibration_forward"] or 0.0) + enc_total + parts["fetch/write/finalize Hessians"] \
        + (parts["advance_forward"] or 0.0) + (0.0 if behind else (rec or 0.0))
    unc = enc_total + parts["fetch/write/finalize Hessians"]
    if ex != 1.0:
        basis += f"; routed experts scaled x{ex:.3g} (288 / the run's experts)"
    out = {"seconds": round(cal, 1), "uncalibrated_seconds": round(unc, 1), "basis": basis,
           "parts": {k: (round(v, 2) if isinstance(v, float) else
                         {a: round(b, 2) for a, b in v.items()} if isinstance(v, dict) else v)
                     for k, v in parts.items()}}
    if assumed:
        out["assumed"] = assumed
    if fwd is None:
        out["missing"] = "calibration forward not measured"
    return out


def _ref_layer(ref_exl3: dict, i: int, moe: bool, ex: float, f_exp: float) -> dict:
    """Layer i of a reference run (its `timings` / `calibration`: the forward includes the previous layer's
    advance and record) at 288 experts: routed experts x ex, the forward's expert share x ex."""
    tm, cal = ref_exl3["timings"], ref_exl3.get("calibration", {})
    enc = {k.rsplit("/", 1)[1]: v for k, v in tm.items() if k.startswith(f"encode/layer.{i}/")}
    stage = tm.get(f"stage/layer.{i}", 0.0)
    non_enc = stage - sum(enc.values())
    fwd = cal.get(f"layer.{i}", 0.0) * ((1 - f_exp + f_exp * ex) if moe else 1.0)
    e = sum(v * (ex if r == "routed_expert" else 1.0) for r, v in enc.items())
    return {"seconds": round(fwd + e + non_enc, 1), "uncalibrated_seconds": round(e + non_enc, 1),
            "encode_s": round(e, 2), "forward_s": round(fwd, 2)}


def _load_reference(path: Path | None, experts: int) -> dict | None:
    if path is None or not Path(path).is_file():
        return None
    ref = json.loads(Path(path).read_text())
    b = ref.get("stages", {}).get("build", {})
    if b.get("experts") == experts and b.get("layers") is not None:
        return None  # the same kind of run: nothing to borrow
    ref["_path"] = str(repo_relative(str(Path(path).resolve())))
    ref["_experts"] = int(b.get("experts", 16))
    ref["_layers"] = tuple(b.get("layers", DEFAULT_LAYERS))
    return ref


def project_exl3(st: dict, layers: tuple, experts: int, counts: dict, ref: dict | None) -> dict:
    """EXL3 3.05 bpw release hours per layer type, from this run's phases (measured at `experts`; a cut layer
    completed within the layer) and, for what it lacks, the reference run's (named in `scaled`)."""
    ph = (st.get("exl3") or {}).get("phases") or {}
    stages = ph.get("stages", {})
    rel, sl = counts["release"], counts["slice"]
    ex = RELEASE_EXPERTS / experts
    f_exp = _expert_share(sl)
    records = [(d["record_s"], bool(d.get("record_behind"))) for k, d in stages.items()
               if k.startswith("layer.") and "record_s" in d]
    record_s, record_behind = max(records) if records else (None, False)
    per_kind: dict[str, dict] = {}
    for i, kind in enumerate(layers):
        d = stages.get(f"layer.{i}")
        if d is None or d.get("state") == "not started" or "seconds" not in d and "calibration_forward_s" not in d:
            continue
        if d.get("state") != "done" and "seconds" not in d:
            continue  # cut in its calibration forward: no unit rate to complete it with
        c = _layer_from_phases(d, ex, f_exp, LAYER_KINDS[kind][1] == "sparse", record_s, record_behind)
        c["from"] = f"this run, layer.{i} ({d.get('state')})"
        per_kind.setdefault(kind, c)  # the first measured layer of each kind
    scaled = []
    rx = (ref or {}).get("stages", {}).get("exl3", {})
    ref_ok = "timings" in rx
    if ref_ok:
        rl = ref["_layers"]
        r_ex = RELEASE_EXPERTS / ref["_experts"]
        r_counts = _release_counts(ref["_experts"], rl)["slice"]
        r_f = _expert_share(r_counts)
        ref_layers = {i: _ref_layer(rx, i, LAYER_KINDS[k][1] == "sparse", r_ex, r_f) for i, k in enumerate(rl)}

        def ref_kind(k):
            idx = [i for i, kk in enumerate(rl) if kk == k]
            if not idx:
                return None
            return {f: round(sum(ref_layers[i][f] for i in idx) / len(idx), 2) for f in ref_layers[idx[0]]}

        if "kda-dense" not in per_kind and ref_kind("kda-dense"):
            per_kind["kda-dense"] = dict(ref_kind("kda-dense"), basis="reference run (no expert, same widths)",
                                         **{"from": ref["_path"]})
            scaled.append({"scaled": "KDA+dense layer from the reference run", "factor": 1.0})
        if "kda-moe" not in per_kind and ref_kind("kda-moe"):
            per_kind["kda-moe"] = dict(ref_kind("kda-moe"), basis=f"reference run, routed experts x{r_ex:.3g}",
                                       **{"from": ref["_path"]})
            scaled.append({"scaled": f"KDA+MoE layer from the {ref['_experts']}-expert run: routed-expert encode "
                                     f"and the forward's expert share", "factor": round(r_ex, 3)})
        if "dsa-moe" not in per_kind and "kda-moe" in per_kind and ref_kind("dsa-moe") and ref_kind("kda-moe"):
            rd, rk = ref_kind("dsa-moe"), ref_kind("kda-moe")
            delta = rd["seconds"] - rk["seconds"]
            delta_u = rd["uncalibrated_seconds"] - rk["uncalibrated_seconds"]
            k = per_kind["kda-moe"]
            per_kind["dsa-moe"] = {"seconds": round(k["seconds"] + delta, 1),
                                   "uncalibrated_seconds": round(k["uncalibrated_seconds"] + delta_u, 1),
                                   "basis": "the KDA+MoE layer above + the reference's DSA-minus-KDA attention "
                                            "difference", "from": f"{k['from']} + {ref['_path']}"}
            scaled.append({"scaled": f"dsa attention from the {ref['_experts']}-expert run: DSA+MoE = KDA+MoE of "
                                     f"this run + (DSA+MoE - KDA+MoE) of that run", "delta_s": round(delta, 2),
                           "factor": 1.0, "why": "the attention does not depend on the expert count"})
    missing = [k for k in RELEASE_LAYERS if k not in per_kind]
    if missing:
        return {"missing": f"no measurement for {', '.join(missing)} (this run or --reference)",
                "per_layer_type": per_kind}
    layers_s = sum(RELEASE_LAYERS[k] * per_kind[k]["seconds"] for k in RELEASE_LAYERS)
    nextn = per_kind["dsa-moe"]["uncalibrated_seconds"]
    once, once_from = 0.0, {}
    for s in ("embed", "head", "vision"):
        d = stages.get(s, {})
        if d.get("state") == "done":
            v = d["seconds"] + (d.get("calibration_forward_s") or 0.0)
            once_from[s] = "this run"
        elif ref_ok and f"stage/{s}" in rx["timings"]:
            v = rx["timings"][f"stage/{s}"] + rx.get("calibration", {}).get(s, 0.0)
            once_from[s] = "reference run (same widths)"
        else:
            v, once_from[s] = 0.0, "not measured"
        once += v
    if any(v.startswith("reference") for v in once_from.values()):
        scaled.append({"scaled": "embed / lm_head / vision stages from the reference run", "factor": 1.0,
                       "which": once_from})
    byte_ratio = sum(rel.values()) / max(1, sum(sl.values()))
    scan = ph.get("scan_s", 0.0) * byte_ratio
    if ph.get("finalize_s"):
        fin = ph["finalize_s"] * byte_ratio
    elif ref_ok:
        r_ratio = sum(rel.values()) / max(1, sum(_release_counts(ref["_experts"], ref["_layers"])["slice"].values()))
        fin = rx["timings"].get("finalize", 0.0) * r_ratio
        scaled.append({"scaled": "finalize from the reference run by bytes", "factor": round(r_ratio, 2)})
    else:
        fin = 0.0
    start = ph.get("before_first_stage_s", 0.0)
    total = layers_s + nextn + once + scan + fin + start
    return {"hours": round(total / 3600, 2),
            "parts_hours": {"decoder layers": round(layers_s / 3600, 2), "nextn": round(nextn / 3600, 3),
                            "embed/head/vision": round(once / 3600, 3), "nan scan": round(scan / 3600, 3),
                            "finalize": round(fin / 3600, 3), "start (imports, plan, job)": round(start / 3600, 3)},
            "per_layer_type": {k: dict(v, release_count=RELEASE_LAYERS.get(k)) for k, v in per_kind.items()},
            "scaled": scaled}


def release_exl3_rates(bpw: float) -> dict[str, float]:
    """Each budgeted role's trellis rate in the release's EXL3 plan at `bpw` (`mixq plan --from-config ... --bpw`),
    the rate most of the role's weights get there; the NextN block (planned at its own --mtp-bits) aside. A slice
    planned at the same bpw is a different budget (its attention, dense MLP and lm_head are a larger share:
    at 3.05 bpw its routed experts get 2.5 bits and everything else 8, where the release gives the experts 3
    and most of the attention 5), so the slice is converted at these rates, each role pinned by an override."""
    from mixq.formats.checkpoint import checkpoint_from_config
    from mixq.formats.glm5next import classify
    from mixq.planning.planner import plan_model

    ckpt = checkpoint_from_config(SHAPE_CONFIG)
    layers = int(ckpt.text_config["num_hidden_layers"])
    weights: dict[str, dict[float, int]] = {}
    for t in plan_model(ckpt, "exl3", bpw=bpw).tensors:
        if t.bits is None or classify(t.name, layers).mtp:
            continue
        by = weights.setdefault(t.role, {})
        by[t.bits] = by.get(t.bits, 0) + math.prod(int(x) for x in t.shape)
    return {role: max(by, key=by.get) for role, by in sorted(weights.items())}


@lru_cache(maxsize=1)
def _release_plan():
    """The 108 GB i-quant plan of the release (`mixq plan --size 108GB --gguf-ladder iq`), made once."""
    from mixq.formats.checkpoint import checkpoint_from_config
    from mixq.planning.planner import plan_model

    return plan_model(checkpoint_from_config(SHAPE_CONFIG), "gguf", size=108 * 10**9, gguf_ladder="iq")


def _release_gguf_weights() -> dict[str, int]:
    """Weights per ggml type of the 108 GB i-quant plan of the release (`mixq plan --size 108GB --gguf-ladder iq`)."""
    out: dict[str, int] = {}
    for t in _release_plan().tensors:
        out[t.type] = out.get(t.type, 0) + math.prod(int(x) for x in t.shape)
    return out


@lru_cache(maxsize=1)
def _release_gguf_specs() -> tuple:
    """(GGUF tensor spec, planned type) of every tensor of the release's 108 GB plan."""
    from mixq.formats.checkpoint import checkpoint_from_config
    from mixq.formats.gguf_names import gguf_tensors

    by = {t.name: t.type for t in _release_plan().tensors}
    return tuple((s, by[s.name]) for s in gguf_tensors(checkpoint_from_config(SHAPE_CONFIG)) if s.name in by)


def _release_kinds() -> dict[int, str]:
    """Decoder layer -> kind (kda-dense / kda-moe / dsa-moe) of the release."""
    t = json.loads(SHAPE_CONFIG.read_text())["text_config"]
    inv = {v: k for k, v in LAYER_KINDS.items()}
    return {i: inv[(a, m)] for i, (a, m) in enumerate(zip(t["layer_types"], t["mlp_layer_types"]))}


def project_gguf(st: dict, layers: tuple, experts: int, counts: dict, ref: dict | None) -> dict:
    """GGUF 108 GB release hours: the imatrix forward per layer type, encoding per type at the measured rates,
    reading/writing/sealing by bytes (from the Q4_K_M file of this run)."""
    g = st.get("gguf") or {}
    ph = g.get("phases") or {}
    rel, sl = counts["release"], counts["slice"]
    ex = RELEASE_EXPERTS / experts
    f_exp = _expert_share(sl)
    scaled: list[dict] = []
    out: dict = {}
    im = ph.get("imatrix", {})
    fw = im.get("forward_s", {})
    per: dict[str, float] = {}
    for i, kind in enumerate(layers):  # the first finished forward of each kind
        if f"layer.{i}" in fw:
            v = fw[f"layer.{i}"]
            per.setdefault(kind, v * ((1 - f_exp + f_exp * ex) if LAYER_KINDS[kind][1] == "sparse" else 1.0))
    rx = (ref or {}).get("stages", {}).get("exl3", {})
    if "dsa-moe" not in per and "kda-moe" in per:
        delta = 0.0
        if "calibration" in rx:
            rl = ref["_layers"]
            c = rx["calibration"]
            dsa = [c.get(f"layer.{i}", 0) for i, k in enumerate(rl) if k == "dsa-moe"]
            kda = [c.get(f"layer.{i}", 0) for i, k in enumerate(rl) if k == "kda-moe"]
            if dsa and kda:
                delta = sum(dsa) / len(dsa) - sum(kda) / len(kda)
        per["dsa-moe"] = per["kda-moe"] + delta
        scaled.append({"scaled": "DSA+MoE imatrix forward = KDA+MoE's of this run + the reference EXL3 run's "
                                 "DSA-minus-KDA calibration-forward difference", "delta_s": round(delta, 2),
                       "factor": 1.0})
    if all(k in per for k in RELEASE_LAYERS) and im:
        other = max(0.0, im["seconds"] - sum(fw.values()))
        imat = sum(RELEASE_LAYERS[k] * per[k] for k in RELEASE_LAYERS) + other + fw.get("head", 0.0)
        out["imatrix_hours"] = round(imat / 3600, 2)
        out["imatrix_forward_per_layer_s"] = {k: round(v, 1) for k, v in per.items()}
    rates: dict[str, float] = {}
    for label, d in ph.items():
        if isinstance(d, dict) and "encode" in d:
            for t, x in d["encode"].items():
                if x["seconds"] > 0 and x["weights"]:
                    rates[t] = x["weights"] / x["seconds"]
    measured = set(rates)
    ref_rates = (ref or {}).get("stages", {}).get("project", {}).get("gguf_rates_mweights_per_s", {})
    borrowed = {t: r * 1e6 for t, r in ref_rates.items() if t not in rates}
    rates.update(borrowed)
    if borrowed:
        scaled.append({"scaled": "encode rates of types this run did not encode, from the reference run",
                       "types": sorted(borrowed), "factor": 1.0})
    real = _release_gguf_weights()
    mean_rate = sum(rates.values()) / len(rates) if rates else float("nan")
    quant = {t: w for t, w in real.items() if t not in FLOAT_TYPES}
    enc = sum(w / rates.get(t, mean_rate) for t, w in quant.items())
    out["types_at_mean_rate"] = {t: round(w / 1e9, 2) for t, w in quant.items() if t not in rates}
    out["rates_mweights_per_s"] = {t: {"rate": round(r / 1e6, 2), "from": "this run" if t in measured
                                       else "reference"} for t, r in rates.items()}
    out["encode_hours"] = round(enc / 3600, 2)
    q = ph.get("Q4_K_M", {})
    if q.get("state") == "done":
        byte_ratio = sum(rel.values()) / max(1, sum(sl.values()))
        rw = max(0.0, q["seconds"] - q["encode_s"]) * byte_ratio
        out["read_write_seal_hours"] = round(rw / 3600, 2)
        out["read_write_seal_basis"] = f"this run's Q4_K_M file less its encoding, x{byte_ratio:.3g} by parameters"
    else:
        rp = (ref or {}).get("stages", {}).get("project", {}).get("gguf_parts_hours", {})
        rw = rp.get("read/write/seal", 0.0) * 3600
        out["read_write_seal_hours"] = round(rw / 3600, 2)
        out["read_write_seal_basis"] = "the reference run's projection" if rp else "not measured"
    if "imatrix_hours" in out:
        out["hours_108GB"] = round(out["imatrix_hours"] + (enc + rw) / 3600, 2)
    out["scaled"] = scaled
    return out


# --- GGUF --rounding hessian, projected: per release layer from its planned tensors and the rates measured ------

HESSIAN_TARGET_HOURS = 3.0
EVAL_TARGET_HOURS = 0.25
RELEASE_EVAL_TOKENS = 16 * 4096  # the release eval: 16 windows x 4096 tokens


class _Rates:
    """Seconds of the hessian path's parts, looked up per type / layer kind, each answer with where it came from;
    every borrowing is kept once in `notes`."""

    def __init__(self) -> None:
        self.notes: dict[str, str] = {}

    def note(self, what: str, src: str) -> None:
        self.notes.setdefault(what, src)


def _first_stage(phases: dict, layers: tuple, kind: str, need) -> dict | None:
    """The first slice stage of `kind` whose phases satisfy `need`."""
    for i, k in enumerate(layers):
        d = (phases.get("stages") or {}).get(f"layer.{i}")
        if k == kind and d and need(d):
            return d
    return None


def _source_layer_seconds(st: dict, layers: tuple, r: _Rates) -> dict[str, float]:
    """The calibration's copy of the source layer per layer kind (read, built, moved to the device, given back),
    from this run's hessian stage; a DSA+MoE layer as a KDA+MoE one (the experts are most of its weights)."""
    hp = (st.get("gguf-hessian") or {}).get("phases") or {}
    out: dict[str, float] = {}
    for kind in LAYER_KINDS:
        d = _first_stage(hp, layers, kind, lambda d: "source_layer_s" in d)
        if d is not None:
            out[kind] = d["source_layer_s"]
    if "dsa-moe" not in out and "kda-moe" in out:
        out["dsa-moe"] = out["kda-moe"]
        r.note("source layer dsa-moe", "the KDA+MoE layer's (the routed experts are most of its weights)")
    if not out:
        r.note("source layer", "not measured in this run (a run before it was probed): left out")
    return out


def _capture_seconds(st: dict, layers: tuple, ref: dict | None, r: _Rates) -> dict[str, float]:
    """The calibration (Hessian capture) forward per layer kind: this run's hessian stage, else the exl3 stage's
    calibration forward (the same LayerCalibrator pass with full Hessians); DSA+MoE from KDA+MoE plus the
    reference's DSA-minus-KDA difference when the slice has no DSA layer."""
    out: dict[str, float] = {}
    hp = (st.get("gguf-hessian") or {}).get("phases") or {}
    xp = ((st.get("exl3") or {}).get("phases") or {})
    for kind in LAYER_KINDS:
        d = _first_stage(hp, layers, kind, lambda d: "capture_forward_s" in d and "capture" not in d["state"])
        if d is not None:
            out[kind] = d["capture_forward_s"]
            r.note(f"capture forward {kind}", "this run's gguf-hessian stage")
            continue
        d = _first_stage(xp, layers, kind, lambda d: "calibration_forward_s" in d
                         and d.get("state") != "cut in the calibration forward")
        if d is not None:
            out[kind] = d["calibration_forward_s"]
            r.note(f"capture forward {kind}", "the exl3 stage's calibration forward (the same full-Hessian pass)")
    if "dsa-moe" not in out and "kda-moe" in out:
        delta = 0.0
        rx = (ref or {}).get("stages", {}).get("exl3", {})
        if "calibration" in rx:
            c, rl = rx["calibration"], ref["_layers"]
            dsa = [c.get(f"layer.{i}", 0) for i, k in enumerate(rl) if k == "dsa-moe"]
            kda = [c.get(f"layer.{i}", 0) for i, k in enumerate(rl) if k == "kda-moe"]
            if dsa and kda:
                delta = sum(dsa) / len(dsa) - sum(kda) / len(kda)
        out["dsa-moe"] = out["kda-moe"] + delta
        r.note("capture forward dsa-moe", f"KDA+MoE + the reference EXL3 run's DSA-minus-KDA difference ({delta:.2f} s)"
               if "calibration" in rx else "KDA+MoE's (no reference run to add the DSA-minus-KDA difference)")
    return out


def _with_probe_rates(hp: dict, tune: dict, r: _Rates) -> dict:
    """The hessian stage's rounding rates, plus the tune probe's one-slice rates of the stack types it did not
    round (with the per-expert Hessians' seconds the hessian stage measured, per expert, added)."""
    rates = dict(_round_rates(hp["stages"]) if hp.get("stages") else hp.get("round_rates") or {})
    probed = (tune.get("phases") or {}).get("round_probe") or tune.get("round_probe") or {}
    eh = hp.get("experts_hessian")
    for k, v in probed.items():
        if k in rates:
            continue
        extra = eh["s_per_expert"] / (v["weights"] / v["experts"]) * 1e6 if eh and eh.get("experts") else 0.0
        rates[k] = {"weights": v["weights"], "seconds": v["seconds"], "s_per_mweight": v["s_per_mweight"] + extra}
        r.note(f"rounding {k}", "the tune probe's one expert slice (stand-in Hessians)"
               + (" + the per-expert Hessians as measured in the gguf-hessian stage" if extra
                  else "; the per-expert Hessians' formation not included (not measured)"))
    return rates


# a type whose Hessian rounding no run has timed, and the timed type whose rate stands in for it
ROUNDING_KIN = {"IQ2_XS": "IQ2_S"}


def _round_rate(rates: dict, qtype: str, stack: bool, r: _Rates) -> float:
    """Seconds per M weights of Hessian rounding (its per-expert Hessians, fetch and spill included) of a tensor
    of `qtype`: this run's rate of the type and shape kind, else of the type, else of its kin (``ROUNDING_KIN``),
    else the run's mean."""
    k = f"{qtype}/{'stack' if stack else 'matrix'}"
    if k in rates:
        return rates[k]["s_per_mweight"]
    same = [v for kk, v in rates.items() if kk.split("/")[0] == qtype]
    if same:
        r.note(f"rounding {k}", f"{qtype}'s rate on the other shape kind in this run")
        return sum(v["seconds"] for v in same) / sum(v["weights"] for v in same) * 1e6
    kin = ROUNDING_KIN.get(qtype)
    if kin is not None and any(kk.split("/")[0] == kin for kk in rates):
        r.note(f"rounding {k}", f"{kin}'s rate: the same group walk and descent, on a codebook half its size, with "
                                f"its sign parity priced over a shortlist of entries (not run)")
        return _round_rate(rates, kin, stack, _Rates())
    if rates:
        r.note(f"rounding {k}", "the run's mean rounding rate per weight (this type was not rounded)")
        return sum(v["seconds"] for v in rates.values()) / sum(v["weights"] for v in rates.values()) * 1e6
    r.note(f"rounding {k}", "no rounding measured: 0")
    return 0.0


def _tune_source(st: dict, layers: tuple, kind: str, r: _Rates) -> dict | None:
    """The measured tuning of a layer like `kind`: MoE layers from the tune probe, else the hessian stage; dense
    layers from the hessian stage, else a MoE layer's (an upper bound); DSA+MoE as KDA+MoE (the slice has no DSA
    layer; a step is the layer's forward and backward)."""
    hp = (st.get("gguf-hessian") or {}).get("phases") or {}
    tp = (st.get("gguf-tune") or {}).get("phases") or {}
    want = "kda-moe" if kind == "dsa-moe" else kind
    tries = [(hp, "gguf-hessian", want)] if want == "kda-dense" else [(tp, "gguf-tune", want), (hp, "gguf-hessian", want)]
    if want == "kda-dense":
        tries += [(tp, "gguf-tune", "kda-moe"), (hp, "gguf-hessian", "kda-moe")]

    def ok(d: dict) -> bool:
        stages = (d.get("tune") or {}).get("stages") or []
        return bool(stages and stages[0].get("s_per_step"))

    for ph, name, k in tries:
        d = _first_stage(ph, layers, k, ok)
        if d is None:
            continue
        why = "" if k == kind else (" (the slice has no DSA layer)" if kind == "dsa-moe"
                                    else " (no dense layer tuned: an upper bound)")
        r.note(f"tuning {kind}", f"the {name} stage's {k} layer{why}")
        return d["tune"]
    return None


def _budget(st: dict) -> int | None:
    """Weights one tuning stage may hold (the tuner's budget on this device), as measured."""
    for name in ("gguf-tune", "gguf-hessian"):
        s = st.get(name) or {}
        if s.get("max_weights"):
            return s["max_weights"]
        for d in ((s.get("phases") or {}).get("stages") or {}).values():
            if (d.get("tune") or {}).get("max_weights"):
                return d["tune"]["max_weights"]
    return None


def _checks(iters: int, checks: int | None = None, start: bool = True) -> int:
    """Held-out checks of a descent of `iters` steps (block_tuning.sign_descent: the `checks` marks, default its
    DEFAULT_CHECKS, and the start unless the stage before ended there: LayerTuner's expert groups after the layer's
    first stage)."""
    from mixq.quant.ggml.rounding import block_tuning as bt

    checks = bt.DEFAULT_CHECKS if checks is None else checks
    return int(start) + len({round(iters * k / checks) for k in range(1, checks + 1)})


def _group_checks() -> int:
    """Held-out checks of an expert group's stage (the tuner's GROUP_CHECKS)."""
    import mixq.conversion.gguf.tuning as gt

    return gt.GROUP_CHECKS


def _stage_cost(stage: dict, iters: int, start: bool = True, checks: int | None = None) -> float:
    """One tuning stage at `iters` steps: the steps at their measured rate, its held-out checks (`checks` marks,
    at their measured seconds each; `start`: the start is checked too) and set-up."""
    check = stage.get("check_s", 0.0) / stage["checks"] if stage.get("checks") else 0.0
    return (iters * stage["s_per_step"] + _checks(iters, checks, start=start) * check
            + max(0.0, stage.get("setup_s", 0.0)))


def _layer_tuning(tensors: list, tune: dict | None, iters: int, budget: int | None,
                  r: _Rates, groups_from: tuple[str, list[dict], float | None] | None = None,
                  decode: tuple[str, dict[str, float], list[tuple[str, int]]] | None = None) -> dict[str, float]:
    """Seconds of block-output tuning of one release layer (its (spec, type, covered) list): the stage of the
    layer's tensors and the expert groups of the stacks over the budget at the measured seconds per step (where
    `groups_from` where given, else this run's, else the layer stage's), the codes' set-up, the tuner's numpy
    encodes of what Hessian rounding leaves to ggml, and the streams (materialise, source and quantized passes)."""
    import mixq.conversion.gguf.tuning as gt
    from mixq.quant.ggml.rounding import block_tuning as bt

    out = {"steps": 0.0, "codes_init": 0.0, "host_decode": 0.0, "streams": 0.0}
    if tune is None:
        return out
    commit = 0.0  # the routed sums' commits of a groups run taken in for this run's groups (see below)
    tun = [(s, t) for s, t, c in tensors if c and t in bt.TUNABLE]
    room = budget if budget is not None else float("inf")
    chosen, over = [], []
    for s, t in sorted(tun, key=lambda m: m[0].transform == "stack"):
        n = math.prod(s.shape)
        if n <= room:
            chosen.append((s, t))
            room -= n
        elif s.transform == "stack":
            over.append((s, t))
    st0 = tune["stages"][0]
    groups = [x for x in tune["stages"][1:] if x.get("s_per_step")]
    out["steps"] = _stage_cost(st0, iters) if chosen else 0.0
    if over and budget:
        per_expert = sum(math.prod(s.shape[1:]) for s, _ in over)
        size = max(1, budget // per_expert)
        n_groups = math.ceil(min(int(s.shape[0]) for s, _ in over) / size)
        g = _pooled_groups(groups_from[1]) if groups_from else _pooled_groups(groups) if groups else st0
        if groups_from:
            r.note("tuning expert groups", f"at the steps and checks of {groups_from[0]}'s groups")
            if groups_from[2] is not None and not (tune.get("streams_parts_s") or {}).get("commit"):
                # that run's tuner commits each group's routed sums after it; this run's did not
                commit = n_groups * groups_from[2]
                r.note("routed-sum commits", f"{groups_from[2]:.3f} s a group, as {groups_from[0]} measured")
        elif not groups:
            r.note("tuning expert groups", "no expert group measured: at the layer stage's seconds per step")
        if decode is not None:
            # the measured groups decoded the slice's stacks; this layer's may be other types. A step's decodes are
            # re-priced per expert at the decode file's rates (a type it lacks counts as free, so where the slice's
            # stacks hold such a type the difference is an upper bound)
            src, rate, sliced = decode
            extra = (sum(rate.get(t, 0.0) * math.prod(sp.shape[1:]) for sp, t in over)
                     - sum(rate.get(t, 0.0) * w for t, w in sliced))
            g = {**g, "s_per_step": g["s_per_step"] + size * extra}
            r.note("tuning expert groups' decodes", f"each step's decodes re-priced per expert for the layer's types at "
                                                    f"{src}'s rates (types it lacks count as free)")
        # the tuner's group steps; each group starts where the stage before ended, so its start is not checked
        out["steps"] += n_groups * _stage_cost(g, max(1, iters // gt.GROUP_ITERS_SHARE), start=not chosen,
                                               checks=gt.GROUP_CHECKS)
    tuned_w = sum(x.get("weights") or 0 for x in tune["stages"])
    if tuned_w:
        out["codes_init"] = tune.get("codes_init_s", 0.0) / tuned_w * sum(math.prod(s.shape) for s, _ in tun)
    # what the tuner does not move is decoded on its device by the torch decoder (the GPU's decode rates make that
    # seconds a layer: not priced, "host_decode" stays 0); what Hessian rounding leaves to ggml the tuner encodes on
    # its device too (priced by the caller at the exact path's rates)
    out["streams"] = max(0.0, tune.get("streams_other_s", 0.0)) + commit
    # the source weights read for the codes and the blocks written back happen per stage: a cut run reached only
    # some of the layer's groups, so those two parts scale to all its tuned weights
    reached = sum(x.get("weights") or 0 for x in tune["stages"])
    per_stage = sum((tune.get("streams_parts_s") or {}).get(k, 0.0) for k in ("source_weights", "blocks"))
    total = sum(math.prod(s.shape) for s, _ in tun)
    if reached and total > reached:
        out["streams"] += per_stage * (total / reached - 1)
    return out


def _pooled_groups(groups: list[dict]) -> dict:
    """The measured expert-group stages as one: seconds per step weighted by the steps each ran, held-out checks
    and set-up averaged over them (a cut group's few steps count as few)."""
    steps = sum(x["steps_done"] for x in groups)
    checks = sum(x.get("checks", 0) for x in groups)
    return {"s_per_step": sum(x["s_per_step"] * x["steps_done"] for x in groups) / max(1, steps),
            "checks": checks, "check_s": sum(x.get("check_s", 0.0) for x in groups) if checks else 0.0,
            "setup_s": sum(max(0.0, x.get("setup_s", 0.0)) for x in groups) / len(groups)}


def _release_layers(specs: tuple) -> dict:
    """Release tensors grouped: decoder layer -> [(spec, type, covered)], plus "nextn" and "head"."""
    from mixq.conversion.gguf.rounding import covered

    out: dict = {}
    for s, t in specs:
        key = "nextn" if s.mtp else ("head" if s.layer is None else s.layer)
        out.setdefault(key, []).append((s, t, covered(s, t)))
    return out


def _exact_rate(exact: dict, qtype: str, r: _Rates) -> float:
    """ggml's encoder on the GPU, M weights/s (the exact projection's rates; the mean where it has none)."""
    rates = {t: v["rate"] for t, v in (exact.get("rates_mweights_per_s") or {}).items()}
    if qtype in rates:
        return rates[qtype]
    r.note(f"exact encode {qtype}", "the exact projection's mean rate (this type was not encoded)")
    return sum(rates.values()) / len(rates) if rates else 1.0


def _hessian_stages(path: Path) -> tuple[str, dict]:
    """(the file, as the repo names it; the per-stage phases of its gguf-hessian run, else of its gguf-tune run)."""
    st = json.loads(Path(path).read_text())["stages"]
    stages = (st.get("gguf-hessian") or st["gguf-tune"])["phases"]["stages"]
    return str(repo_relative(str(Path(path).resolve()))), stages


def measured_groups(path: Path | None) -> tuple[str, list[dict], float | None] | None:
    """(the file, every expert-group stage its gguf-hessian run measured, seconds per finished group of the routed
    sums' commit after it, None where that run's tuner had none), or None (no file, or no group in it)."""
    if path is None:
        return None
    name, stages = _hessian_stages(path)
    tunes = [d["tune"] for d in stages.values() if d.get("tune")]
    groups = [g for t in tunes for g in (t.get("stages") or [])[1:] if g.get("s_per_step")]
    if not groups:
        return None
    finished = sum(g.get("state") == "done" for g in groups)
    commits = [(t.get("streams_parts_s") or {}).get("commit") for t in tunes]
    commit = sum(c for c in commits if c) / finished if finished and any(c is not None for c in commits) else None
    return name, groups, commit


def decode_rates(path: Path | None) -> tuple[str, dict[str, float]] | None:
    """(the file, {type: seconds per weight of the tuner's IQ2 decode, forward + backward}) of a
    bench/speed/iq2_tuning_decode.py run (its one-kernel decode where it ran, else its score-table one), or None."""
    if path is None:
        return None
    d = json.loads(Path(path).read_text())
    rates = {t["type"]: (t.get("one_kernel") or t["scored"])["decode_forward_backward_s"] / t["weights"]
             for t in d["types"]}
    return str(repo_relative(str(Path(path).resolve()))), rates


def _slice_stacks(stages: dict) -> list[tuple[str, int]]:
    """(type, weights per expert) of the routed-expert stacks the run rounded in its first MoE layer."""
    for d in stages.values():
        stacks = [(x["type"], x["weights"] // x["experts"]) for x in (d.get("round") or {}).get("tensors", {}).values()
                  if x.get("experts")]
        if stacks:
            return stacks
    return []


def round_call_ratios(paths: list[Path] | None) -> tuple[str, dict[str, float]] | None:
    """(the two files, {"TYPE/KIND": seconds per weight of the second / of the first}) of two
    bench/speed/hessian_rounding_speed.py runs on one machine (a run's rounding, then a changed one: other descent
    passes), for the rows both hold; None without files."""
    if not paths:
        return None
    a, b = (json.loads(Path(x).read_text()) for x in paths)
    per = [{f"{r['type']}/{r['kind']}": r["seconds"] / r["weights"] for r in d["rows"]} for d in (a, b)]
    names = " / ".join(str(repo_relative(str(Path(x).resolve()))) for x in reversed(paths))
    return names, {k: per[1][k] / per[0][k] for k in per[0].keys() & per[1].keys()}


def _repriced_rounding(rates: dict, stages: dict, ratios: tuple[str, dict[str, float]] | None, r: _Rates) -> dict:
    """The run's rounding rates with each stacked type that `ratios` holds (:func:`round_call_ratios`, kind
    "stack") re-priced: the steady seconds of its expert-slice calls scaled by the ratio, its per-expert
    Hessians, fetch and spill as measured. A "TYPE/stack" ratio serves every stack of that type (gate, up, down)."""
    if ratios is None:
        return rates
    src, ratio = ratios
    calls: dict[str, list[float]] = {}
    for t, kind, _, _, cl in _timed_tensors(stages):
        c = calls.setdefault(f"{t}/{kind}", [0.0, 0.0])
        for sec, w in cl[1:]:  # the first call of a stack may hold a kernel's build
            c[0] += sec
            c[1] += w
    out = dict(rates)
    for k, f in ratio.items():
        if not k.endswith("/stack") or k not in out or not calls.get(k, [0, 0])[1]:
            continue
        call = calls[k][0] / calls[k][1] * 1e6
        new = out[k]["s_per_mweight"] - call * (1.0 - f)
        out[k] = {**out[k], "s_per_mweight": round(new, 4), "seconds": round(new * out[k]["weights"] / 1e6, 2)}
        r.note(f"rounding {k}", f"this run's rate with its expert-slice calls ({call:.4f} s per M weights) scaled by "
                                f"x{f:.3f}, the ratio of {src} (one machine)")
    return out


def warm_encode_rates(path: Path | None) -> tuple[str, dict[str, tuple[float, bool]]] | None:
    """(the file, {type: (M weights/s, with an imatrix)}) of ggml's encoders on the GPU at a GLM-5.3 routed
    expert's shape, warm (bench/speed/kquant_speed.py's mixq CUDA column: host arrays in and out), or None. The NextN
    block has no imatrix entry (llama-imatrix's forward never reaches it), so it is encoded without one: a type's
    rate without an imatrix where the file has it, else its rate with one."""
    if path is None:
        return None
    rows = [r for r in json.loads(Path(path).read_text())["results"]
            if r.get("mixq_cuda_wps") and r["tensor"].startswith("GLM-5.3")]
    rates = {r["type"]: (r["mixq_cuda_wps"] / 1e6, True) for r in rows if r["imatrix"]}
    rates.update({r["type"]: (r["mixq_cuda_wps"] / 1e6, False) for r in rows if not r["imatrix"]})
    return str(repo_relative(str(Path(path).resolve()))), rates


def cold_warmup(path: Path | None) -> tuple[str, dict] | None:
    """(the file, :func:`rounding_warmup` of its gguf-hessian stage) of a run with a cold kernel cache, or None."""
    if path is None:
        return None
    name, stages = _hessian_stages(path)
    return name, rounding_warmup(stages)


def project_gguf_hessian(st: dict, layers: tuple, ref: dict | None, exact: dict,
                         cold: tuple[str, dict] | None = None,
                         groups_from: tuple[str, list[dict], float | None] | None = None,
                         warm_encode: tuple[str, dict[str, tuple[float, bool]]] | None = None,
                         round_ratios: tuple[str, dict[str, float]] | None = None,
                         decode: tuple[str, dict[str, float]] | None = None) -> dict:
    """GGUF 108 GB `--gguf-ladder iq --rounding hessian` release hours on one device: every release layer from
    its planned tensors (the 108 GB plan) at the rates this run measured: the capture forward per layer kind,
    Hessian rounding per type (s per M weights, its per-expert Hessians and spill included), block-output tuning
    (the stage of the layer's tensors and the expert groups over the tuner's budget, at the measured seconds per
    step x `tune_iters`), the tuner's host paths (numpy encodes of the types Hessian rounding leaves to ggml, gguf-py
    decodes of the encoded tensors it does not tune), then ggml's encoders for the rest (NextN included), the
    write; imatrix and read/write/seal from the exact projection; `warm_encode`: ggml's encoders' warm rates
    (:func:`warm_encode_rates`) for the NextN block, whose exact-run rates may hold a kernel's first build. Every
    borrowing is in `scaled`."""
    hs = st.get("gguf-hessian") or {}
    hp = hs.get("phases") or {}
    iters = int(hs.get("tune_iters") or (st.get("gguf-tune") or {}).get("tune_iters") or 200)
    r = _Rates()
    rates = _repriced_rounding(_with_probe_rates(hp, st.get("gguf-tune") or {}, r), hp.get("stages") or {},
                               round_ratios, r)
    host = hp.get("host_rates") or hs.get("host_rates_mweights_per_s") or {}
    capture = _capture_seconds(st, layers, ref, r)
    source_layer = _source_layer_seconds(st, layers, r)
    budget = _budget(st)
    if budget is None:
        r.note("tuning budget", "not measured: every stack tuned with the layer's tensors (a lower bound)")
    kinds = _release_kinds()
    groups = _release_layers(_release_gguf_specs())
    per_layer, missing = {}, []
    tunes = {k: _tune_source(st, layers, k, r) for k in LAYER_KINDS}
    for i in sorted(k for k in groups if isinstance(k, int)):
        kind, tensors = kinds[i], groups[i]
        parts = {"capture_forward": capture.get(kind, 0.0), "source_layer": source_layer.get(kind, 0.0),
                 "hessian_rounding": sum(math.prod(s.shape) / 1e6 * _round_rate(rates, t, s.transform == "stack", r)
                                         for s, t, c in tensors if c)}
        parts.update(_layer_tuning(tensors, tunes[kind], iters, budget, r, groups_from,
                                   None if decode is None else (*decode, _slice_stacks(hp.get("stages") or {}))))
        encode_s = sum(math.prod(s.shape) / 1e6 / _exact_rate(exact, t, r) for s, t, c in tensors
                       if not c and t not in FLOAT_TYPES)
        # ggml's encode of those tensors runs once: in the tuner, on its device at the same rates, where the layer
        # is tuned (the writer takes its blocks), else at the write
        tuned_layer = tunes[kind] is not None
        parts["exact_encode_gpu"] = 0.0 if tuned_layer else encode_s
        parts["stored_values_device"] = encode_s if tuned_layer else 0.0
        stacks = sorted({t for s, t, _ in tensors if s.transform == "stack"})
        per_layer[i] = {"kind": kind, "experts": "+".join(stacks) or "-",
                        "seconds": round(sum(parts.values()), 1), "parts_s": {k: round(v, 2) for k, v in parts.items()}}
    for k in LAYER_KINDS:
        if k not in capture:
            missing.append(f"capture forward of {k}")
        if tunes[k] is None:
            missing.append(f"block-output tuning of a {k} layer")
    if not rates:
        missing.append("Hessian rounding (no tensor finished)")
    layer_s = sum(d["seconds"] for d in per_layer.values())
    encode_warmup: dict[str, float] = {}  # ggml's encoders' first builds, once a type, where NextN is at warm rates
    exact_calls = {}
    for d in ((st.get("gguf") or {}).get("phases") or {}).values():
        for t, x in ((d.get("encode") or {}) if isinstance(d, dict) else {}).items():
            exact_calls.setdefault(t, x)

    def nextn_rate(t: str) -> float:
        if warm_encode is not None and t in warm_encode[1]:
            (rate, with_imatrix), first = warm_encode[1][t], exact_calls.get(t) or {}
            # the exact run's first call of the type less its weights at the warm rate: the kernel's build
            build = max(0.0, first.get("seconds", 0.0) - first.get("weights", 0) / 1e6 / rate)
            encode_warmup[t] = build
            how = "its rate with an imatrix (none measured without)" if with_imatrix else "no imatrix"
            r.note(f"nextn encode {t}", f"ggml's encoder warm on the GPU, {how}, {rate:.0f} M weights/s "
                                        f"({warm_encode[0]}); its first build once, in start: {build:.0f} s (the "
                                        f"exact run's first {t} call less its weights at that rate)")
            return rate
        return _exact_rate(exact, t, r)
    nextn = sum(math.prod(s.shape) / 1e6 / nextn_rate(t) for s, t, c in groups.get("nextn", [])
                if t not in FLOAT_TYPES)
    head = _head_seconds(groups.get("head", []), hp, tunes["kda-dense"], iters, rates, r)
    read_rate = ((st.get("load") or {}).get("bf16") or {}).get("gb_per_s") or 3.5
    spill = sum(_type_bytes(t, math.prod(s.shape)) for k, g in groups.items() if k != "nextn" for s, t, c in g if c)
    spill_read = spill / 1e9 / read_rate
    r.note("spill read at the write", f"the rounded blocks ({spill / 1e9:.0f} GB) read back at the load stage's "
                                      f"{read_rate} GB/s")
    conv = hp.get("convert") or {}
    start = conv.get("validate_s", 0.0) + conv.get("plan_s", 0.0) + conv.get("tune_init_s", 0.0)
    warm = rounding_warmup(hp["stages"]) if hp.get("stages") else {}
    where = ""
    if cold is not None:
        warm, where = cold[1], f" in {cold[0]} (a cold kernel cache)"
    for t, v in warm.items():
        r.note(f"rounding warm-up {t}", f"{v['seconds']} s once (its first tensor less {v['from']}' rate{where}), "
                                        f"in start")
    start += sum(v["seconds"] for v in warm.values()) + sum(encode_warmup.values())
    parts_h = {"imatrix (exact path's)": exact.get("imatrix_hours", 0.0),
               "decoder layers": round(layer_s / 3600, 3), "nextn (ggml encoders)": round(nextn / 3600, 3),
               "head (rounding + tuning)": round(head / 3600, 3),
               "read/write/seal (exact path's)": exact.get("read_write_seal_hours", 0.0),
               "spill read at the write": round(spill_read / 3600, 3),
               "start (and each type's kernel warm-up, once)": round(start / 3600, 3)}
    total = sum(parts_h.values())
    by_part: dict[str, float] = {}
    for d in per_layer.values():
        for k, v in d["parts_s"].items():
            by_part[k] = by_part.get(k, 0.0) + v
    by_kind = _per_layer_type(per_layer)
    return {"hours": round(total, 2), "target_hours": HESSIAN_TARGET_HOURS,
            # a projection with a part missing is no answer either way
            "meets_target": None if missing else total <= HESSIAN_TARGET_HOURS,
            "tune_iters": iters, "tuning_budget_weights": budget,
            "parts_hours": parts_h,
            "decoder_parts_hours": {k: round(v / 3600, 3) for k, v in sorted(by_part.items(), key=lambda x: -x[1])},
            "per_layer_type": by_kind,
            "capture_forward_s": {k: round(v, 2) for k, v in capture.items()},
            "rounding_s_per_mweight": {k: v["s_per_mweight"] for k, v in rates.items()},
            "host_rates_mweights_per_s": host,
            **({"missing": missing} if missing else {}),
            "scaled": [{"scaled": k, "from": v} for k, v in r.notes.items()]}


def _per_layer_type(per_layer: dict) -> dict:
    """The release layers grouped by kind and expert types: count, seconds each (mean), parts, layer indices."""
    out: dict[str, dict] = {}
    for i, d in per_layer.items():
        key = f"{d['kind']}, experts {d['experts']}" if d["experts"] != "-" else d["kind"]
        g = out.setdefault(key, {"count": 0, "layers": [], "seconds": 0.0, "parts_s": {}})
        g["count"] += 1
        g["layers"].append(i)
        g["seconds"] += d["seconds"]
        for k, v in d["parts_s"].items():
            g["parts_s"][k] = g["parts_s"].get(k, 0.0) + v
    for g in out.values():
        n = g["count"]
        g["seconds_each"] = round(g.pop("seconds") / n, 1)
        g["hours_all"] = round(g["seconds_each"] * n / 3600, 3)
        g["parts_s"] = {k: round(v / n, 2) for k, v in g["parts_s"].items()}
    return out


def _type_bytes(qtype: str, weights: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n, b = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return weights // n * b


def _head_seconds(tensors: list, hp: dict, dense_tune: dict | None, iters: int, rates: dict, r: _Rates) -> float:
    """output.weight: its rounding at its type's rate, and its tuning (the KL of the logits) as measured in this run
    when the head was reached, else as one dense layer's tuning stage (named)."""
    sec = sum(math.prod(s.shape) / 1e6 * _round_rate(rates, t, False, r) for s, t, c in tensors if c)
    head = ((hp.get("stages") or {}).get("head") or {}).get("tune")
    if head and head.get("state") == "done" and head["stages"] and head["stages"][0].get("s_per_step"):
        return sec + _stage_cost(head["stages"][0], iters) + max(0.0, head.get("streams_other_s", 0.0))
    if dense_tune is not None and dense_tune["stages"][0].get("s_per_step"):
        r.note("head tuning", "not reached: as the dense layer's tuning stage")
        return sec + _stage_cost(dense_tune["stages"][0], iters)
    return sec


def project_eval(st: dict, n_layers: int, counts: dict) -> dict:
    """One eval run = the reference pass + every candidate's: one candidate costs the reference's load, its own
    load and two of the (1 + n) forward passes; the rest (windows, logits, KLD) is shared."""
    v = st.get("eval", {})
    out: dict = {}
    if "timings" not in v:
        return out
    rel, sl = counts["release"], counts["slice"]
    tm = v["timings"]
    names = [c["name"] for c in v.get("candidates", [])] or ["mixq-exl3"]
    n = len(names)
    ref_load = tm.get("load/CheckpointSource", 0.0)
    fwd = tm.get("forward", 0.0) / (1 + n)
    rest = v["wall_seconds"] - sum(x for k, x in tm.items() if k.startswith("load/")) - tm.get("forward", 0.0)
    w_ratio = (sum(rel.values()) - rel.get("vision", 0)) / max(1, sum(sl.values()) - sl.get("vision", 0))
    depth = 45 / n_layers
    by_format: dict[str, list[str]] = {}
    for name in names:
        by_format.setdefault("GGUFSource" if name.endswith(".gguf") else "Exl3Source", []).append(name)
    for cls, members in by_format.items():
        load = ref_load + tm.get(f"load/{cls}", 0.0) / len(members)
        total = load * w_ratio + 2 * fwd * depth + rest / n
        key = "exl3" if cls == "Exl3Source" else "gguf"
        out[f"one_{key}_candidate_hours"] = round(total / 3600, 2)
        out[f"{key}_parts_hours"] = {"load+dequantize": round(load * w_ratio / 3600, 2),
                                     "forward (reference + candidate)": round(2 * fwd * depth / 3600, 2),
                                     "head+other": round(rest / n / 3600, 3)}
    return out


def project_eval_phases(st: dict, layers: tuple, counts: dict) -> dict:
    """One candidate's eval of the release (16 windows x 4096 unless the run used others): the reference pass and the
    candidate's, part by part. Reads and copies to the device scale by the text weights (BF16 for the reference);
    the candidate's decode splits into torch's decode kernels (per type of the 108 GB plan at the dequant stage's
    rates on this device, else this candidate's rate per weight) and the rest per weight (bytes in, copies,
    unbuild); the forward per layer kind x the release's layers (DSA+MoE as KDA+MoE when the slice has none); the
    embedding, the logits and the statistics as measured (same windows, same widths)."""
    v = st.get("eval") or {}
    models = (v.get("phases") or {}).get("models") or {}
    cand = next((k for k in models if k != "reference"), None)
    if "reference" not in models or cand is None:
        return {}
    # an eval stage cut before the slice's last layer has no forward for some layer kinds, and its reads cover only
    # part of the slice's weights: no projection is made from it (counting the missing forwards as 0 s, and scaling
    # the partial reads by the whole slice's weights, once gave 0.071 h where the same run prices at about 0.5 h)
    unmeasured = {name: [f"layer.{i}" for i in range(len(layers))
                         if f"layer.{i}" not in (models[name].get("forward_per_layer_s") or {})]
                  for name in ("reference", cand)}
    if any(unmeasured.values()):
        return {"incomplete": {k: v for k, v in unmeasured.items() if v},
                "why": "the eval stage did not run every layer of the slice (cut by its deadline?): no projection"}
    r = _Rates()
    rel, sl = counts["release"], counts["slice"]
    w_ratio = (sum(rel.values()) - rel.get("vision", 0)) / max(1, sum(sl.values()) - sl.get("vision", 0))
    slice_w = sum(sl.values()) - sl.get("vision", 0)
    n_kind: dict[str, int] = {}
    for k in _release_kinds().values():
        n_kind[k] = n_kind.get(k, 0) + 1
    rel_w: dict[str, int] = {}
    for s, t in _release_gguf_specs():
        if not s.mtp:  # the eval's forward has no NextN block
            rel_w[t] = rel_w.get(t, 0) + math.prod(s.shape)

    tokens = (v.get("windows") or 16) * (v.get("ctx") or 4096)
    tok = RELEASE_EVAL_TOKENS / tokens  # the forward, logits and statistics scale with the tokens scored
    if tok != 1:
        r.note("tokens", f"forward, logits and statistics x{tok:g} ({RELEASE_EVAL_TOKENS} tokens, this run {tokens})")

    def forward(m: dict) -> float:
        per = m.get("forward_per_layer_s") or {}
        by: dict[str, float] = {}
        for i, k in enumerate(layers):
            if f"layer.{i}" in per:
                by.setdefault(k, per[f"layer.{i}"])
        if "dsa-moe" not in by and "kda-moe" in by:
            by["dsa-moe"] = by["kda-moe"]
            r.note("forward dsa-moe", "the KDA+MoE layer's (the slice has no DSA layer)")
        missing = sorted(k for k in n_kind if k not in by)
        if missing:  # a release layer kind the slice does not hold: never priced as free
            raise ValueError(f"no forward measured for the release's {', '.join(missing)} layers")
        return tok * (sum(n * by[k] for k, n in n_kind.items()) + m.get("embed_s", 0.0))

    ref, c = models["reference"], models[cand]
    parts = {"reference: read BF16": (ref.get("load_s", 0.0) + ref.get("get_s", 0.0)) * w_ratio,
             "reference: copy to the device": ref.get("materialize_s", 0.0) * w_ratio,
             "reference: forward": forward(ref),
             "reference: logits": tok * ref.get("logits_s", 0.0)}
    deq = c.get("load_s", 0.0) + c.get("get_s", 0.0)
    dec = c.get("decode_s", 0.0)
    parts["candidate: decode kernels"] = _release_decode(st, rel_w, c, slice_w, r)
    parts["candidate: bytes in, copies, unbuild"] = max(0.0, deq - dec) / max(1, slice_w) * sum(rel_w.values())
    parts["candidate: copy to the device"] = c.get("materialize_s", 0.0) * w_ratio
    parts["candidate: forward"] = forward(c)
    parts["candidate: logits"] = tok * c.get("logits_s", 0.0)
    parts["statistics (KLD, top-1)"] = tok * (v.get("phases") or {}).get("score_s", 0.0)
    total = sum(parts.values())
    top = max(parts, key=parts.get)
    deq_h = sum(x for k, x in parts.items() if k.startswith("candidate: ") and "forward" not in k
                and "logits" not in k)
    return {"one_candidate_hours": round(total / 3600, 3), "target_hours": EVAL_TARGET_HOURS,
            "meets_target": total / 3600 <= EVAL_TARGET_HOURS, "candidate": cand, "windows": v.get("windows"),
            "ctx": v.get("ctx"), "parts_hours": {k: round(x / 3600, 4) for k, x in parts.items()},
            "largest_part": top, "candidate_dequant_hours": round(deq_h / 3600, 3),
            "dequant_dominates": deq_h > total / 2,
            "scaled": [{"scaled": k, "from": x} for k, x in r.notes.items()]
            + [{"scaled": "reads and copies to the device by the text weights", "factor": round(w_ratio, 2)}]}


def _release_decode(st: dict, rel_w: dict, cand: dict, slice_w: int, r: _Rates) -> float:
    """Seconds of torch's decode kernels over the release's 108 GB candidate: per type at the dequant stage's rate
    on the eval's device (torch-cuda, else the CPU row), else at this candidate's measured decode rate."""
    paths = (st.get("dequant") or {}).get("paths") or {}
    row = paths.get("torch-cuda") or next((p for k, p in paths.items() if k.startswith("torch-cpu")), None)
    own = sum(x["weights"] for x in (cand.get("decode") or {}).values())
    own_rate = own / max(cand.get("decode_s", 0.0), 1e-9) / 1e6 if own else None
    sec = 0.0
    for t, w in rel_w.items():
        rate = (row or {}).get("by_type", {}).get(t)
        if rate:
            r.note("decode rates", "the dequant stage (bench/speed/gguf_dequant_speed.py) on this device")
        elif own_rate:
            rate = own_rate
            r.note(f"decode {t}", "this candidate's decode rate per weight (the dequant stage has no figure)")
        else:
            continue
        sec += w / 1e6 / rate
    return sec


def project(res: dict, experts: int, layers=DEFAULT_LAYERS, reference: Path | None = DEFAULT_REFERENCE,
            cold: Path | None = None, groups: Path | None = None, encode: Path | None = None,
            round_calls: list[Path] | None = None, decode: Path | None = None) -> dict:
    """Each measured stage scaled to the release per layer type (3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE, the NextN
    block uncalibrated, embed/head/vision once), 288 experts per MoE layer. What this run measured at 288
    experts is used as measured; a layer cut mid-way is completed at its own per-unit rate; what the run lacks
    comes from `reference`, each borrowing named in `scaled`; `cold`: a run's JSON whose first rounded tensors
    give the kernels' one-time warm-up (this run's kernels were compiled beforehand); `groups`: a run's JSON whose
    expert groups give their seconds per step and checks instead of this run's; `encode`: bench/speed/kquant_speed.py's JSON,
    ggml's encoders' warm rates for the NextN block; `round_calls`: two bench/speed/hessian_rounding_speed.py JSONs of
    one machine whose ratio re-prices this run's stacked rounding calls (:func:`round_call_ratios`); `decode`:
    bench/speed/iq2_tuning_decode.py's JSON, whose decode rates re-price the expert groups' steps per release layer's
    types (:func:`decode_rates`)."""
    st = res["stages"]
    layers = parse_layers(layers)
    counts = _release_counts(experts, layers)
    small = bool(st.get("build", {}).get("small"))
    ref = None if small else _load_reference(reference, experts)  # toy widths: the reference does not apply
    out: dict = {"assumptions": {"experts_slice": experts, "experts_release": RELEASE_EXPERTS,
                                 "slice_layers": list(layers),
                                 "layers": "3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE, 1 NextN (DSA+MoE, uncalibrated)",
                                 "reference": None if ref is None else ref["_path"]}}
    if (st.get("exl3") or {}).get("phases"):
        out["exl3_3.05"] = project_exl3(st, layers, experts, counts, ref)
        if "hours" in out["exl3_3.05"]:
            out["exl3_3.05_hours"] = out["exl3_3.05"]["hours"]
    x = (st.get("exllamav3") or {}).get("layers_seconds") or {}
    ex_t = ((st.get("exl3") or {}).get("timings") or {})
    moe = [i for i, k in enumerate(layers) if LAYER_KINDS[k][1] == "sparse" and str(i) in x
           and f"stage/layer.{i}" in ex_t]
    if moe and "exl3_3.05_hours" in out:
        mine = sum(ex_t[f"stage/layer.{i}"] for i in moe)
        ratio = sum(x[str(i)] for i in moe) / max(mine, 1e-9)
        out["exllamav3_moe_layer_ratio"] = round(ratio, 3)
        out["exllamav3_3.05_hours_by_layer_ratio"] = round(out["exl3_3.05_hours"] * ratio, 2)
    if (st.get("gguf") or {}).get("phases"):
        out["gguf_108GB"] = project_gguf(st, layers, experts, counts, ref)
        if "hours_108GB" in out["gguf_108GB"]:
            out["gguf_108GB_hours"] = out["gguf_108GB"]["hours_108GB"]
    if any((st.get(k) or {}).get("phases") for k in ("gguf-hessian", "gguf-tune")):
        h = project_gguf_hessian(st, layers, ref, out.get("gguf_108GB", {}), cold_warmup(cold),
                                 measured_groups(groups), warm_encode_rates(encode), round_call_ratios(round_calls),
                                 decode_rates(decode))
        if "gguf_108GB" not in out:
            h.setdefault("missing", []).append("the exact path's projection (imatrix, read/write/seal, ggml's encode "
                                               "rates): run the gguf stage, or start from its JSON (--seed-json)")
        out["gguf_108GB_hessian"] = h
        out["gguf_108GB_hessian_hours"] = h["hours"]
    ev = project_eval_phases(st, layers, counts) or project_eval(st, len(layers), counts)
    if ev:
        out["eval"] = ev
        out["eval_one_candidate_hours"] = ev.get("one_candidate_hours", ev.get("one_exl3_candidate_hours",
                                                                              ev.get("one_gguf_candidate_hours")))
    return out


CHILD_STAGES = {"build": stage_build, "load": stage_load, "exl3": stage_exl3, "eval": stage_eval, "gguf": stage_gguf,
                "gguf-tune": stage_gguf_tune, "gguf-hessian": stage_gguf_hessian, "dequant": stage_dequant,
                "exllamav3": stage_exllamav3, "k256": stage_k256}
MIN_STAGE_S = 20.0  # a stage is not started with less than this left before the deadline


def _vm_hwm_mib(pid: int) -> float | None:
    """Peak RSS of a live process (VmHWM), read before it is killed."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _run_child(stage: str, work: Path, device: str, extra: list[str], kill_at: float | None,
               why: str = "deadline") -> dict:
    """Run one stage in a child process (its own session: a kill takes its helpers too). Past `kill_at` it is
    killed and the result is built from its progress log: where the time went, marked "cut"."""
    prog = work / "progress"
    prog.mkdir(parents=True, exist_ok=True)
    log, stdout = prog / f"{stage}.jsonl", prog / f"{stage}.stdout"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--work", str(work), "--json", os.devnull, "--child", stage, "--device", device,
           "--progress-log", str(log), *extra] + (["--kill-at", repr(kill_at)] if kill_at else [])
    t0 = time.time()
    cut_at, hwm = None, None
    with open(stdout, "w") as so:  # stderr (progress, tracebacks) passes through
        p = subprocess.Popen(cmd, stdout=so, start_new_session=True)
        try:
            p.wait(timeout=None if kill_at is None else max(0.1, kill_at - time.time()))
        except subprocess.TimeoutExpired:
            cut_at, hwm = time.time(), _vm_hwm_mib(p.pid)
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = stdout.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if cut_at is None and p.returncode == 0 and lines:
        return json.loads(lines[-1][len("RESULT "):])
    summary = SUMMARIES.get(stage, summarise_spans)(read_log(log), cut_at or time.time())
    if cut_at is not None:
        d = {"cut": True, "cut_by": why, "cut_after_s": round(cut_at - t0, 1), "phases": summary}
        if hwm is not None:
            d["peak_rss_mib"] = hwm
    else:
        d = {"error": f"exit {p.returncode} (its traceback is on stderr)", "tail": text[-3000:], "phases": summary}
    for k in ("peak_gpu_mib", "peak_rss_mib"):
        if k in summary:
            d.setdefault(k, summary[k])
    return d


def _limits(spec: str) -> dict[str, float]:
    out = {}
    for part in [p for p in spec.split(",") if p]:
        k, _, v = part.partition("=")
        out[k.strip()] = float(v)
    return out


def _child_main(a) -> None:
    """One stage in this process; its JSON on the last stdout line."""
    global _LOG, _KILL_AT
    _LOG, _KILL_AT = a.progress_log, a.kill_at
    if _LOG is not None:
        with open(_LOG, "a") as f:
            f.write(json.dumps({"k": "child", "t0": time.time(), "stage": a.child}) + "\n")
    dev = a.device or "cuda"
    kw: dict = {}
    if a.child == "eval":
        kw = {"windows": a.eval_windows, "ctx": a.eval_ctx, "cheap": a.eval_cheap}
    elif a.child in ("exl3", "gguf", "exllamav3", "gguf-hessian", "gguf-tune"):
        kw = {"rows": a.rows, "seq_len": a.seq_len}
    if a.child == "gguf-hessian":
        kw.update(tune_iters=a.tune_iters, imatrix_rows=a.imatrix_rows, eager_types=a.eager_types,
                  refine_passes=a.refine_passes, round_profile=a.round_profile, tune_budget=a.tune_budget)
    elif a.child == "gguf-tune":
        kw.update(tune_iters=a.tune_iters, probe_iters=a.tune_probe_iters, profile=a.tune_profile,
                  tune_budget=a.tune_budget)
    elif a.child == "dequant":
        kw = {"rounds": a.dequant_rounds}
    if a.child == "build":
        kw = {"experts": a.experts, "small": a.small, "layers": parse_layers(a.layers), "fp8": not a.no_fp8}
    if a.child == "exllamav3":
        kw["limit_s"] = a.exllamav3_limit
    if a.child == "exl3":
        kw["trellis_profile"] = a.trellis_profile
    if a.child == "gguf":
        kw.update(eager_types=a.eager_types, types=a.gguf_types)
    print("RESULT " + json.dumps(CHILD_STAGES[a.child](a.work, dev, **kw)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="directory for the slice and every output")
    ap.add_argument("--json", type=Path, required=True, help="results (updated after every stage)")
    ap.add_argument("--stages", default="build,load,exl3,eval,gguf,exllamav3,k256,project")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", default=",".join(DEFAULT_LAYERS),
                    help=f"layer kinds of the slice, dense first ({', '.join(LAYER_KINDS)})")
    ap.add_argument("--no-fp8", action="store_true", help="build: no FP8 copy (disk and time at 288 experts)")
    ap.add_argument("--small", action="store_true", help="toy widths (CPU test of the script)")
    ap.add_argument("--device", default=None, help="cuda|cpu [default: cuda when present]")
    ap.add_argument("--rows", type=int, default=64, help="calibration rows (mixq and exllamav3)")
    ap.add_argument("--seq-len", type=int, default=512, help="calibration tokens per row")
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--eval-ctx", type=int, default=4096)
    ap.add_argument("--gguf-types", default="Q4_K_M,iq-2.6bpw", help=f"gguf stage outputs ({', '.join(GGUF_TYPES)})")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="wall seconds for the whole run: stages skipped when it is near, a running one killed")
    ap.add_argument("--reserve-s", type=float, default=25.0,
                    help="seconds kept before the deadline for `project` (stages are killed that much earlier)")
    ap.add_argument("--stage-limits", default="", help="STAGE=SECONDS,...: a stage is killed after its seconds")
    ap.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE,
                    help="an earlier run's JSON (other expert count) for what this run does not measure")
    ap.add_argument("--exllamav3-limit", type=float, default=None,
                    help="seconds: stop exllamav3's converter there (its per-layer times are still recorded)")
    ap.add_argument("--trellis-profile", action="store_true",
                    help="exl3: split every trellis call by phase (the device synchronised between phases)")
    ap.add_argument("--eager-types", default="", help="gguf stage: types encoded without the fused kernels")
    ap.add_argument("--tune-iters", type=int, default=200,
                    help="gguf-hessian: block-output tuning steps per stage (the converter's default); gguf-tune and "
                         "project: the steps the seconds per step are scaled to")
    ap.add_argument("--tune-probe-iters", type=int, default=20, help="gguf-tune: steps run per tuning stage")
    ap.add_argument("--tune-budget", type=int, default=None,
                    help="gguf-hessian: the tuner's weights per stage [default: its share of the free memory]")
    ap.add_argument("--round-profile", type=Path, default=None,
                    help="gguf-hessian: torch profiler tables of the second stacked IQ2_S rounding call, its fetch "
                         "and Hessians included")
    ap.add_argument("--tune-profile", type=Path, default=None,
                    help="gguf-tune: torch profiler tables of the layer's first stage and first expert group")
    ap.add_argument("--refine-passes", type=int, default=None,
                    help="gguf-hessian: the converter's --refine-passes [default: the converter's]")
    ap.add_argument("--imatrix-rows", type=int, default=None,
                    help="gguf-hessian: calibration rows of its imatrix when the gguf stage left none [default: --rows]")
    ap.add_argument("--eval-cheap", default="Q8_0",
                    help="eval: the GGUF type written for the eval when no conversion stage finished a candidate "
                         "(none: no such candidate)")
    ap.add_argument("--dequant-rounds", type=int, default=3, help="dequant stage: passes per decoder path")
    ap.add_argument("--warmup-json", type=Path, default=None,
                    help="project: each rounded type's one-time kernel warm-up from this run's JSON (one with a cold "
                         "kernel cache) instead of this run's first tensors")
    ap.add_argument("--groups-json", type=Path, default=None,
                    help="project: the expert groups' seconds per step and checks from this run's JSON (a gguf-hessian "
                         "or gguf-tune run) instead of this run's")
    ap.add_argument("--round-calls-json", type=Path, nargs=2, default=None, metavar=("FROM", "TO"),
                    help="project: this run's stacked rounding calls re-priced by the ratio of two "
                         "bench/speed/hessian_rounding_speed.py runs on one machine (this run's passes, then the new ones)")
    ap.add_argument("--decode-json", type=Path, default=None,
                    help="project: the expert groups' steps re-priced for each release layer's stack types at this "
                         "bench/speed/iq2_tuning_decode.py run's decode rates (the slice's stacks are other types)")
    ap.add_argument("--encode-rates-json", type=Path, default=None,
                    help="project: the NextN block's encode at these warm rates (bench/speed/kquant_speed.py's JSON) "
                         "instead of the exact run's")
    ap.add_argument("--seed-json", type=Path, default=None,
                    help="start the results from this earlier run's JSON (its stages kept unless run again)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--progress-log", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kill-at", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child_main(a)
        return
    t_start = time.time()
    layers = parse_layers(a.layers)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.work.mkdir(parents=True, exist_ok=True)
    res = json.loads(a.json.read_text()) if a.json.is_file() else {}
    if a.seed_json is not None and not res:
        res = json.loads(a.seed_json.read_text())
        res["seeded_from"] = {"json": str(repo_relative(str(a.seed_json.resolve()))),
                              "stages": sorted(res.get("stages", {}))}
    res.setdefault("stages", {})
    res["skipped"], res["cut"] = [], []
    limits = _limits(a.stage_limits)
    end = None if a.deadline_s is None else t_start + a.deadline_s - a.reserve_s
    res["run"] = {"deadline_s": a.deadline_s, "reserve_s": a.reserve_s, "stage_limits": limits,
                  "stages": a.stages, "experts": a.experts, "layers": list(layers), "fp8": not a.no_fp8,
                  "device": device, "gguf_types": a.gguf_types}
    child_args = ["--eval-windows", str(a.eval_windows), "--eval-ctx", str(a.eval_ctx), "--rows", str(a.rows),
                  "--seq-len", str(a.seq_len), "--experts", str(a.experts), "--layers", ",".join(layers),
                  "--gguf-types", a.gguf_types, "--tune-iters", str(a.tune_iters), "--tune-probe-iters",
                  str(a.tune_probe_iters), "--eval-cheap", a.eval_cheap, "--dequant-rounds", str(a.dequant_rounds)] \
        + (["--imatrix-rows", str(a.imatrix_rows)] if a.imatrix_rows else []) + (["--small"] if a.small else []) \
        + (["--no-fp8"] if a.no_fp8 else []) \
        + (["--exllamav3-limit", str(a.exllamav3_limit)] if a.exllamav3_limit else []) \
        + (["--eager-types", a.eager_types] if a.eager_types else []) \
        + (["--refine-passes", str(a.refine_passes)] if a.refine_passes is not None else []) \
        + (["--trellis-profile"] if a.trellis_profile else []) \
        + (["--tune-profile", str(a.tune_profile)] if a.tune_profile else []) \
        + (["--round-profile", str(a.round_profile)] if a.round_profile else []) \
        + (["--tune-budget", str(a.tune_budget)] if a.tune_budget else [])

    def save() -> None:
        text = json.dumps(res, indent=2) + "\n"
        a.json.write_text(text.replace(str(a.work.resolve()), "WORK").replace(str(a.work), "WORK"))

    for stage in [s for s in a.stages.split(",") if s]:
        t = time.time()
        if stage != "project" and end is not None and end - t < MIN_STAGE_S:
            res["skipped"].append({"stage": stage, "reason": f"{end - t:.0f} s left before the deadline "
                                                             f"(less the {a.reserve_s:.0f} s kept for project)",
                                   "at_s": round(t - t_start, 1)})
            print(f"{stage}: skipped ({end - t:.0f} s left)", flush=True)
            save()
            continue
        if stage == "project":
            b = res["stages"].get("build", {})
            out = project(res, b.get("experts", a.experts), tuple(b.get("layers", layers)), a.reference,
                          cold=a.warmup_json, groups=a.groups_json, encode=a.encode_rates_json,
                          round_calls=a.round_calls_json, decode=a.decode_json)
        elif stage in CHILD_STAGES:
            kill_at, why = end, "deadline"
            if stage in limits and (kill_at is None or t + limits[stage] < kill_at):
                kill_at, why = t + limits[stage], f"--stage-limits {stage}={limits[stage]:g}"
            out = _run_child(stage, a.work, device, child_args, kill_at, why)
        else:
            raise SystemExit(f"unknown stage {stage}")
        out["seconds"] = round(time.time() - t, 1)
        out["started_at_s"] = round(t - t_start, 1)
        res["stages"][stage] = out
        if out.get("cut"):
            res["cut"].append({"stage": stage, "by": out["cut_by"], "after_s": out["cut_after_s"]})
        save()
        print(stage, json.dumps(out)[:4000], flush=True)
    res["run"]["wall_seconds"] = round(time.time() - t_start, 1)
    save()


if __name__ == "__main__":
    main()
