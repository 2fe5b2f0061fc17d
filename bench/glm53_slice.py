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

    python bench/glm53_slice.py --work DIR --json OUT.json --stages build,load,exl3,eval  [--experts 32]
    python bench/glm53_slice.py --work DIR --json OUT.json --stages gguf,exllamav3,project
    python bench/glm53_slice.py --work DIR --json OUT.json --small --device cpu     # the same code on a toy

One H200 device call (9.5 min hard limit; 18.9 GB BF16 under /tmp, results and logs under $OUT; needs `carry:
[".whl"]` and shared/ holding models/glm-5.3-flash-shape/config.json and models/glm5next-mini/tokenizer*.json):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:/tmp/pp && mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/mixq && \
    export MIXQ_SHARED="$PWD/shared" && python3 bench/glm53_slice.py --work /tmp/g53 --json $OUT/glm53_slice_288.json \
      --experts 288 --layers kda-dense,kda-moe --no-fp8 --deadline-s 530 --stage-limits exl3=290,gguf=150 \
      --gguf-types Q4_K_M --stages build,exl3,gguf,load,project > $OUT/log.txt 2>&1; \
    cp /tmp/g53/progress/*.jsonl $OUT/ 2>/dev/null; tail -c 3000 $OUT/log.txt
"""
from __future__ import annotations

import argparse
import copy
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED, repo_relative  # noqa: E402

SHAPE_CONFIG = SHARED / "models" / "glm-5.3-flash-shape" / "config.json"
DEFAULT_REFERENCE = REPO / "bench" / "results" / "glm53_slice.json"  # the 16-expert H200 run
LAYER_KINDS = {"kda-dense": ("linear_attention", "dense"), "kda-moe": ("linear_attention", "sparse"),
               "dsa-moe": ("deepseek_sparse_attention", "sparse")}
DEFAULT_LAYERS = ("kda-dense", "kda-moe", "kda-moe", "dsa-moe")
RELEASE_LAYERS = {"kda-dense": 3, "kda-moe": 31, "dsa-moe": 11}  # + the NextN block (DSA+MoE, uncalibrated)
RELEASE_EXPERTS = 288
LAYER_TYPES = tuple(LAYER_KINDS[k][0] for k in DEFAULT_LAYERS)  # the default slice (bench/exl3_multigpu.py)
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
    del model, sd
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
            self._sync()
            t0 = time.time()
            if begin:
                self.emit({"k": name, "t0": t0, "begin": 1, **extra})
            try:
                return orig(*a, **k)
            finally:
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


def _exl3_probe(log_path: Path | None = None) -> Probe:
    import mixq.convert.exl3_output as xo
    import mixq.convert.job as job
    import mixq.convert.pipeline as pl
    from mixq.formats import checkpoint_check, exl3_writer

    mods = [xo, pl]
    try:
        import mixq.convert.exl3_ranks as xr
        mods.append(xr)
    except ImportError:
        pass
    p = Probe(log_path=log_path)
    p.wrap(mods, "quantize_batch", lambda units, *a, **k: f"encode/{units[0].stage}/{units[0].role}",
           info=_encode_info)
    p.wrap([pl], "_write_stage", lambda run, stage, *a, **k: f"stage/{stage}", info=_stage_units)
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
                                       - d.get("write_s", 0.0) - d.get("hessian_finalize_s", 0.0)
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
            types: dict[str, dict] = {}
            for x in done:
                if x["k"].startswith("encode/") and e["t0"] <= x["t0"] <= e["t1"]:
                    t = types.setdefault(x["k"].split("/", 1)[1], {"weights": 0, "seconds": 0.0, "calls": 0})
                    t["weights"] += x.get("w", 0)
                    t["seconds"] += x["t1"] - x["t0"]
                    t["calls"] += 1
            for t in types.values():
                t["seconds"] = round(t["seconds"], 3)
                t["mweights_per_s"] = round(t["weights"] / max(t["seconds"], 1e-9) / 1e6, 2)
            out[label] = {"seconds": round(e["t1"] - e["t0"], 2), "state": "cut" if "elapsed" in e else "done",
                          "encode": types,
                          "encode_s": round(sum(t["seconds"] for t in types.values()), 2)}
    out["open_at_end"] = [{"phase": e["k"], "elapsed_s": e["elapsed"]} for e in open_]
    out.update(_peaks_of(events))
    return out


SUMMARIES = {"exl3": summarise_exl3, "gguf": summarise_gguf}


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


def stage_exl3(work: Path, device: str, bpw: float = 3.05, rows: int = 64, seq_len: int = 512) -> dict:
    """mixq's EXL3 conversion of the slice (calibration with every expert, trellis, write), then `verify` when the
    time left allows (about half the conversion's seconds)."""
    from mixq.convert import Exl3Options, convert, verify

    out = work / "mixq-exl3"
    shutil.rmtree(out, ignore_errors=True)
    probe = _exl3_probe(_LOG)
    res, sec = _timed(convert, work / "bf16", out, Exl3Options(bpw=bpw, device=device, rows=rows,
                                                                       seq_len=seq_len, progress=False))
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


EVAL_CANDIDATES = ("mixq-exl3", "slice-iq-2.6bpw.gguf", "slice-Q4_K_M.gguf")


def stage_eval(work: Path, device: str, windows: int = 16, ctx: int = 4096) -> dict:
    """Streaming `mixq eval` against the BF16 slice on held-out text, of every candidate the earlier stages left
    (mixq's EXL3 directory, the i-quant GGUF, the Q4_K_M GGUF): one reference pass, each candidate's layers
    loaded (dequantized) and run; the load times are kept per source format."""
    from mixq.runtime import dequant, layer_stream
    from mixq.eval.api import evaluate

    cands = [work / n for n in EVAL_CANDIDATES if (work / n).exists()]
    if not cands:
        raise SystemExit(f"no candidate in {work}: run the exl3 or gguf stage first")
    probe = Probe(log_over=5.0, log_path=_LOG)
    for cls in (dequant.CheckpointSource, dequant.GGUFSource, dequant.Exl3Source):
        probe.wrap([cls], "layer", lambda self, i, _c=cls.__name__: f"load/{_c}")
    for m in ("run_layer", "run_layer_inplace"):
        probe.wrap([layer_stream.DecoderStream], m, lambda *a, **k: "forward")
    rep, sec = _timed(evaluate, work / "bf16", cands, SHARED / "data" / "heldout.txt", ctx=ctx,
                      windows=windows, device=device, progress=False)
    keep = ("kld_mean", "top1", "ppl", "peak_rss_mib", "peak_gpu_mib", "seconds", "timings")
    return {"wall_seconds": sec, "windows": windows, "ctx": ctx, "timings": probe.rounded(),
            "report": {k: rep[k] for k in keep if k in rep},
            "candidates": [{"name": p.name, **{k: c[k] for k in ("kld_mean", "top1_agreement", "ppl", "bpw", "file_bpw",
                                                               "bytes") if k in c}}
                           for p, c in zip(cands, rep["candidates"])],
            **_peaks()}


def _eager_for(types: set[str]) -> None:
    """Encode `types` without the fused Triton kernels (MIXQ_KQUANT_FUSED=0 around their calls): for a type whose
    kernel compiles for longer than the run can wait."""
    from mixq.quant.ggml import encoders as kquants

    for fn in ("quantize_stacked", "quantize_tensor", "quantize"):
        orig = getattr(kquants, fn)

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
        setattr(kquants, fn, eager)


GGUF_TYPES = {"Q4_K_M": {"qtype": "Q4_K_M"}, "iq-2.6bpw": {"bpw": 2.6, "gguf_ladder": "iq"}}


def stage_gguf(work: Path, device: str, rows: int = 64, seq_len: int = 512, eager_types: str = "",
               types: str = "Q4_K_M,iq-2.6bpw") -> dict:
    """imatrix, then each of `types`: Q4_K_M with it, the 108 GB plan's i-quant ladder at its bpw."""
    from mixq.convert import GGUFOptions, convert
    from mixq.convert.imatrix import make_imatrix

    from mixq.quant.ggml import encoders as kquants

    imat = work / "slice.imatrix.gguf"
    imat.unlink(missing_ok=True)
    out: dict = {"eager_types": eager_types}
    if eager_types:
        _eager_for(set(eager_types.split(",")))
    probe = Probe(log_over=2.0, log_path=_LOG)
    for fn in ("quantize_stacked", "quantize_tensor", "quantize"):
        probe.wrap([kquants], fn, lambda x, qtype, *a, **k: f"encode/{qtype}", group="encode",
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


def _layer_from_phases(d: dict, ex: float, f_exp: float, moe: bool, record_s: float | None) -> dict:
    """One layer of this run as (calibrated seconds, uncalibrated seconds, parts, basis) at 288 experts.
    `ex`: 288 / the run's experts (1 at the real count: nothing is scaled)."""
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
    parts["record"] = rec
    enc_total = sum(parts["encode"].values())
    cal = (parts["calibration_forward"] or 0.0) + enc_total + parts["fetch/write/finalize Hessians"] \
        + (parts["advance_forward"] or 0.0) + (rec or 0.0)
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
    records = [d["record_s"] for k, d in stages.items() if k.startswith("layer.") and "record_s" in d]
    record_s = max(records) if records else None
    per_kind: dict[str, dict] = {}
    for i, kind in enumerate(layers):
        d = stages.get(f"layer.{i}")
        if d is None or d.get("state") == "not started" or "seconds" not in d and "calibration_forward_s" not in d:
            continue
        if d.get("state") != "done" and "seconds" not in d:
            continue  # cut in its calibration forward: no unit rate to complete it with
        c = _layer_from_phases(d, ex, f_exp, LAYER_KINDS[kind][1] == "sparse", record_s)
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


def _release_gguf_weights() -> dict[str, int]:
    """Weights per ggml type of the 108 GB i-quant plan of the release (`mixq plan --size 108GB --gguf-ladder iq`)."""
    from mixq.planning.planner import plan_model
    from mixq.formats.checkpoint import checkpoint_from_config

    plan = plan_model(checkpoint_from_config(SHAPE_CONFIG), "gguf", size=108 * 10**9, gguf_ladder="iq")
    out: dict[str, int] = {}
    for t in plan.tensors:
        out[t.type] = out.get(t.type, 0) + math.prod(int(x) for x in t.shape)
    return out


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
    quant = {t: w for t, w in real.items() if t not in ("F32", "F16", "BF16")}
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


def project(res: dict, experts: int, layers=DEFAULT_LAYERS, reference: Path | None = DEFAULT_REFERENCE) -> dict:
    """Each measured stage scaled to the release per layer type (3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE, the NextN
    block uncalibrated, embed/head/vision once), 288 experts per MoE layer. What this run measured at 288
    experts is used as measured; a layer cut mid-way is completed at its own per-unit rate; what the run lacks
    comes from `reference`, each borrowing named in `scaled`."""
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
    ev = project_eval(st, len(layers), counts)
    if ev:
        out["eval"] = ev
        out["eval_one_candidate_hours"] = ev.get("one_exl3_candidate_hours", ev.get("one_gguf_candidate_hours"))
    return out


CHILD_STAGES = {"build": stage_build, "load": stage_load, "exl3": stage_exl3, "eval": stage_eval, "gguf": stage_gguf,
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
        kw = {"windows": a.eval_windows, "ctx": a.eval_ctx}
    elif a.child in ("exl3", "gguf", "exllamav3"):
        kw = {"rows": a.rows, "seq_len": a.seq_len}
    if a.child == "build":
        kw = {"experts": a.experts, "small": a.small, "layers": parse_layers(a.layers), "fp8": not a.no_fp8}
    if a.child == "exllamav3":
        kw["limit_s"] = a.exllamav3_limit
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
    ap.add_argument("--eager-types", default="", help="gguf stage: types encoded without the fused kernels")
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
    res.setdefault("stages", {})
    res["skipped"], res["cut"] = [], []
    limits = _limits(a.stage_limits)
    end = None if a.deadline_s is None else t_start + a.deadline_s - a.reserve_s
    res["run"] = {"deadline_s": a.deadline_s, "reserve_s": a.reserve_s, "stage_limits": limits,
                  "stages": a.stages, "experts": a.experts, "layers": list(layers), "fp8": not a.no_fp8,
                  "device": device, "gguf_types": a.gguf_types}
    child_args = ["--eval-windows", str(a.eval_windows), "--eval-ctx", str(a.eval_ctx), "--rows", str(a.rows),
                  "--seq-len", str(a.seq_len), "--experts", str(a.experts), "--layers", ",".join(layers),
                  "--gguf-types", a.gguf_types] + (["--small"] if a.small else []) \
        + (["--no-fp8"] if a.no_fp8 else []) \
        + (["--exllamav3-limit", str(a.exllamav3_limit)] if a.exllamav3_limit else []) \
        + (["--eager-types", a.eager_types] if a.eager_types else [])

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
            out = project(res, b.get("experts", a.experts), tuple(b.get("layers", layers)), a.reference)
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
