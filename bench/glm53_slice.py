"""GLM-5.3-Flash at its real widths, a few layers deep: every pipeline stage timed, then projected to 321B.

The slice keeps every width of the release (hidden 4096, vocab 154880, q_lora 1536, kv_lora 512, 64 heads x 256,
KDA 64 heads x 128, DSA indexer 32 x 128, mHC 4, dense intermediate 12288, experts 2048 wide, the vision tower) and
cuts depth and experts: layers [KDA+dense, KDA+MoE, KDA+MoE, DSA+MoE] with E routed experts (default 32; the
release has 288) plus the shared expert. Weights are transformers' own initialisation (std 0.02, FLA gate init)
with outlier input channels (0.5% of the columns of every matrix x8), written as sharded BF16 safetensors like the
release, and an FP8 block-scaled copy (GLM's FP8 set, 128x128 scale_inv).

Stages (each a separate process, so peak host memory is per stage; timings and peaks into one JSON):
  build     write the slice (BF16 + FP8)
  load      read every tensor through mixq's checkpoint reader (BF16 and FP8)
  exl3      `mixq convert --format exl3 --bpw 3.05` (calibration with every expert, trellis, write), then verify
  eval      `mixq eval` of that EXL3 against the BF16 slice (16 windows x 4096 tokens, past the DSA dense prefix)
  gguf      imatrix, `--type Q4_K_M --imatrix`, and the 108 GB plan's i-quant types (`--gguf-ladder iq`)
  exllamav3 exllamav3's own convert.py on the same slice at the same bpw (wall time)
  k256      on the trained k256 fixture: exllamav3's converter vs mixq's role and measured plans at equal bytes,
            scored by `mixq eval`
  project   each stage scaled to the release: 45 layers (3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE), 288 experts

    python bench/glm53_slice.py --work DIR --json OUT.json --stages build,load,exl3,eval  [--experts 32]
    python bench/glm53_slice.py --work DIR --json OUT.json --stages gguf,exllamav3,project
    python bench/glm53_slice.py --work DIR --json OUT.json --small --device cpu     # the same code on a toy
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED  # noqa: E402

SHAPE_CONFIG = SHARED / "models" / "glm-5.3-flash-shape" / "config.json"
LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "deepseek_sparse_attention")
MLP_TYPES = ("dense", "sparse", "sparse", "sparse")
SHARD_BYTES = 4 << 30
OUTLIER_FRACTION, OUTLIER_GAIN = 0.005, 8.0


# --- the slice -------------------------------------------------------------------------------------------------

def slice_config(shape: dict, experts: int, small: bool = False) -> dict:
    """The release config cut to LAYER_TYPES and ``experts`` routed experts (``small``: toy widths for CPU tests)."""
    cfg = copy.deepcopy(shape)
    t = cfg["text_config"]
    n = len(LAYER_TYPES)
    t.update(num_hidden_layers=n, layer_types=list(LAYER_TYPES), mlp_layer_types=list(MLP_TYPES),
             indexer_types=["full"] * n, first_k_dense_replace=MLP_TYPES.count("dense"), n_routed_experts=experts,
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


def _add_outliers(sd: dict, seed: int) -> None:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, w in sd.items():
        if w.dim() != 2 or not name.endswith(".weight") or "embed_tokens" in name or min(w.shape) < 64:
            continue
        k = max(1, int(w.shape[1] * OUTLIER_FRACTION))
        cols = torch.randperm(w.shape[1], generator=gen)[:k].to(w.device)
        w[:, cols] *= OUTLIER_GAIN


def _save_shards(sd: dict, out: Path, *, fp8: bool) -> int:
    """Write ``sd`` (checkpoint names -> tensors on any device) as release-style shards plus an index."""
    import torch
    from safetensors.torch import save_file

    from mixq.formats.tiny import _is_fp8_target, fp8_quantize_blocks

    dsa = {i for i, t in enumerate(LAYER_TYPES) if t != "linear_attention"}
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(sd, key=_file_order):
        parts = {name: sd[name]}
        if fp8 and _is_fp8_target(name, tuple(sd[name].shape), dsa):
            q, s = fp8_quantize_blocks(sd[name])
            parts = {name: q, name + "_scale_inv": s}
        nb = sum(v.numel() * (4 if k.endswith("_scale_inv") else v.element_size() if v.dtype == torch.float8_e4m3fn
                              else 2) for k, v in parts.items())
        if size and size + nb > SHARD_BYTES:
            shards.append({})
            size = 0
        for k, v in parts.items():
            keep = k.endswith("_scale_inv") or v.dtype == torch.float8_e4m3fn  # scales f32, weights e4m3
            shards[-1][k] = v.to("cpu", v.dtype if keep else torch.bfloat16).contiguous()
        size += nb
    weight_map, total = {}, 0
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(out / fname), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _file_order(name: str):
    if ".layers." in name and "visual." not in name:
        rest = name.split(".layers.")[1]
        return (1, int(rest.split(".")[0]), name)
    return (0 if "embed" in name else 2, 0, name)


def build(work: Path, experts: int, *, small: bool, device: str, seed: int = 0) -> dict:
    """Write the BF16 slice to work/bf16 and the FP8 copy to work/fp8; returns sizes and seconds."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from mixq.formats.tiny import default_tokenizer_dir

    shape = json.loads(SHAPE_CONFIG.read_text())
    cfg = slice_config(shape, experts, small)
    tcfg = copy.deepcopy(cfg)
    tcfg["text_config"]["layer_types"] = ["indexed_attention" if k != "linear_attention" else k
                                          for k in cfg["text_config"]["layer_types"]]
    t0 = time.time()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig(**tcfg))
    with torch.no_grad():
        sd = {k: v.detach() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
        _add_outliers(sd, seed)
    params = sum(v.numel() for v in sd.values())
    t_init = time.time() - t0
    res = {"experts": experts, "params": params, "init_seconds": round(t_init, 1)}
    tok = default_tokenizer_dir()
    for kind in ("bf16", "fp8"):
        out = work / kind
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        t1 = time.time()
        c = copy.deepcopy(cfg)
        if kind == "fp8":
            c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
        with torch.no_grad():
            res[f"{kind}_bytes"] = _save_shards(sd, out, fp8=kind == "fp8")
        (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
        if tok is not None:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (tok / f).is_file():
                    shutil.copyfile(tok / f, out / f)
        res[f"{kind}_write_seconds"] = round(time.time() - t1, 1)
    del model, sd
    return res



# --- where the time goes: wrappers around mixq's hot functions (measurement only; the code is unchanged) -------

class Probe:
    """Seconds per key, from wrappers around functions of mixq modules (CUDA synchronised around each call)."""

    def __init__(self, log_over: float | None = None) -> None:
        self.log_over = log_over  # print every call longer than this many seconds (a cut stage shows its steps)
        self.seconds: dict[str, float] = {}
        self.events: list[tuple[str, float, float]] = []
        self.active: set[str] = set()

    def wrap(self, owners, attr: str, key, group: str | None = None) -> None:
        """Time `attr` of each owner under `key(*args)`; calls nested in another call of the same `group` are
        not counted again."""
        import torch

        owners = [o for o in owners if hasattr(o, attr)]
        if not owners:
            return
        orig = getattr(owners[0], attr)

        def timed(*a, **k):
            if group is not None and group in self.active:
                return orig(*a, **k)
            if group is not None:
                self.active.add(group)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                self.active.discard(group)
                name = key(*a, **k)
                self.seconds[name] = self.seconds.get(name, 0.0) + t1 - t0
                self.events.append((name, t0, t1))
                if self.log_over is not None and t1 - t0 > self.log_over:
                    print(f"    {name}: {t1 - t0:.2f} s", file=sys.stderr, flush=True)

        for o in owners:
            if getattr(o, attr) is orig:
                setattr(o, attr, timed)

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in sorted(self.seconds.items())}


def _exl3_probe() -> Probe:
    import mixq.convert.exl3_output as xo
    import mixq.convert.pipeline as pl
    from mixq.formats import checkpoint_check, exl3_writer

    mods = [xo, pl]
    try:
        import mixq.convert.exl3_ranks as xr
        mods.append(xr)
    except ImportError:
        pass
    p = Probe()
    p.wrap(mods, "quantize_batch", lambda units, *a, **k: f"encode/{units[0].stage}/{units[0].role}")
    p.wrap([pl], "_write_stage", lambda run, stage, *a, **k: f"stage/{stage}")
    p.wrap([exl3_writer.Exl3Writer], "write_part", lambda self, stage, *a, **k: f"write/{stage}")
    p.wrap([checkpoint_check, pl], "scan_finite", lambda *a, **k: "scan")
    p.wrap(mods, "compile_exl3", lambda *a, **k: "finalize")
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


# --- stages (each runs in a child process: `--child STAGE`) --------------------------------------------------

def _peaks() -> dict:
    import resource

    import torch

    d = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available():
        d["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return d


def _timed(fn, *a, **k):
    t = time.time()
    out = fn(*a, **k)
    sec = round(time.time() - t, 2)
    # a progress line on stderr (the parent passes it through): a stage cut by a time limit still shows its steps
    print(f"  {getattr(fn, '__name__', fn)}: {sec} s", file=sys.stderr, flush=True)
    return out, sec


def stage_load(work: Path, device: str) -> dict:
    """Read every tensor of the BF16 and the FP8 slice through mixq's reader (FP8 dequantized)."""
    from mixq.formats.checkpoint import open_checkpoint

    out = {}
    for kind in ("bf16", "fp8"):
        ck = open_checkpoint(work / kind)
        t, n = time.time(), 0
        for name in ck.names():
            n += ck.get(name).numel()
        sec = time.time() - t
        nbytes = sum(f.stat().st_size for f in (work / kind).glob("*.safetensors"))
        out[kind] = {"seconds": round(sec, 2), "params": n, "file_bytes": nbytes,
                     "gb_per_s": round(nbytes / sec / 1e9, 3)}
    return out


def stage_exl3(work: Path, device: str, bpw: float = 3.05, rows: int = 64, seq_len: int = 512) -> dict:
    """mixq's EXL3 conversion of the slice (calibration with every expert, trellis, write), then verify."""
    from mixq.convert import Exl3Options, convert, verify

    out = work / "mixq-exl3"
    shutil.rmtree(out, ignore_errors=True)
    probe = _exl3_probe()
    res, sec = _timed(convert, work / "bf16", out, Exl3Options(bpw=bpw, device=device, rows=rows,
                                                                       seq_len=seq_len, progress=False))
    rep, vsec = _timed(verify, out)
    d = res.to_dict()
    d.update(wall_seconds=sec, timings=probe.rounded(), calibration=_calibration_seconds(probe), verify_seconds=vsec,
             verify_ok=bool(rep.get("ok", not rep.get("problems"))), **_peaks())
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
    probe = Probe(log_over=5.0)
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
    from mixq.quant import kquants

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


def stage_gguf(work: Path, device: str, rows: int = 64, seq_len: int = 512, eager_types: str = "") -> dict:
    """imatrix, then Q4_K_M with it, then the 108 GB plan's i-quant ladder at its bpw."""
    from mixq.convert import GGUFOptions, convert
    from mixq.convert.imatrix import make_imatrix

    from mixq.quant import kquants

    imat = work / "slice.imatrix.gguf"
    imat.unlink(missing_ok=True)
    out: dict = {"eager_types": eager_types}
    if eager_types:
        _eager_for(set(eager_types.split(",")))
    probe = Probe(log_over=2.0)
    for fn in ("quantize_stacked", "quantize_tensor", "quantize"):
        probe.wrap([kquants], fn, lambda x, qtype, *a, **k: f"encode/{qtype}", group="encode")
    _, out["imatrix_seconds"] = _timed(make_imatrix, work / "bf16", imat, rows=rows, seq_len=seq_len, device=device,
                                       progress=False)
    enc = {"device": device} if device != "cpu" else {"threads": 1}  # in this process, where the probe is
    for label, opts in (("Q4_K_M", GGUFOptions(qtype="Q4_K_M", imatrix=str(imat), progress=False, overwrite=True,
                                                **enc)),
                        ("iq-2.6bpw", GGUFOptions(bpw=2.6, gguf_ladder="iq", imatrix=str(imat), progress=False,
                                                  overwrite=True, **enc))):
        res, sec = _timed(convert, work / "bf16", work / f"slice-{label}.gguf", opts)
        d = res.to_dict()
        out[label] = {"wall_seconds": sec, "bytes": d["bytes"], "bpw": d["bpw"], "types": d["types"],
                      "weights_by_type": _gguf_weights_by_type(work / f"slice-{label}.gguf"),
                      "timings": probe.rounded()}
        probe.seconds.clear()
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

def _release_counts(experts: int) -> dict:
    """Parameters per role of the release and of the slice, from their configs (shapes only)."""
    import tempfile

    from mixq.formats.checkpoint import checkpoint_from_config

    shape = json.loads(SHAPE_CONFIG.read_text())
    out = {}
    for label, cfg in (("release", shape), ("slice", slice_config(shape, experts))):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(cfg))
            ck = checkpoint_from_config(Path(d) / "config.json")
            roles: dict[str, int] = {}
            for n in ck.names():
                k = 1
                for x in ck.shape(n):
                    k *= int(x)
                roles[ck.info(n).role] = roles.get(ck.info(n).role, 0) + k
        out[label] = roles
    return out


def _release_gguf_weights() -> dict[str, int]:
    """Weights per ggml type of the 108 GB i-quant plan of the release (`mixq plan --size 108GB --gguf-ladder iq`)."""
    from mixq.planning.planner import plan_model
    from mixq.formats.checkpoint import checkpoint_from_config

    plan = plan_model(checkpoint_from_config(SHAPE_CONFIG), "gguf", size=108 * 10**9, gguf_ladder="iq")
    out: dict[str, int] = {}
    for t in plan.tensors:
        n = 1
        for x in t.shape:
            n *= int(x)
        out[t.type] = out.get(t.type, 0) + n
    return out


def project(res: dict, experts: int) -> dict:
    """Each measured stage scaled to the release: 45 layers (3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE) + NextN, 288
    experts per MoE layer. Parts that scale with the experts (their encode, read and write; the expert share of a
    layer's calibration forward, by parameters) are multiplied by 288/E, the rest counted per layer."""
    st = res["stages"]
    counts = _release_counts(experts)
    rel, sl = counts["release"], counts["slice"]
    ex = 288 / experts
    out: dict = {"assumptions": {"experts_slice": experts, "experts_release": 288,
                                 "layers": "3 KDA+dense, 31 KDA+MoE, 11 DSA+MoE, 1 NextN (DSA+MoE, uncalibrated)"}}
    e = st.get("exl3", {})
    if "timings" in e:
        tm, cal = e["timings"], e.get("calibration", {})
        f_exp = sl.get("routed_expert", 0) / max(1, sl.get("routed_expert", 0) + sl.get("shared_expert", 0) / 3
                                                 + sl.get("attn", 0) / 4)  # expert share of a MoE layer's params

        def parts(i: int) -> tuple[float, float, float, float]:
            """(stage time not scaling with experts, stage time scaling, calibration fixed, calibration scaling)"""
            total = tm.get(f"stage/layer.{i}", 0.0)
            fixed = sum(v for k, v in tm.items() if k.startswith(f"encode/layer.{i}/") and "routed_expert" not in k)
            c = cal.get(f"layer.{i}", 0.0)
            moe = MLP_TYPES[i] == "sparse"
            return fixed, total - fixed, c * (1 - f_exp) if moe else c, c * f_exp if moe else 0.0

        def cost(p: tuple[float, float, float, float], calibrated: bool = True) -> float:
            return p[0] + ex * p[1] + (p[2] + ex * p[3] if calibrated else 0.0)

        p = [parts(i) for i in range(len(LAYER_TYPES))]
        kda_moe = [(x + y) / 2 for x, y in zip(p[1], p[2])]
        layers = 3 * cost(p[0]) + 31 * cost(kda_moe) + 11 * cost(p[3])
        nextn = cost(p[3], calibrated=False)
        once = sum(tm.get(f"stage/{s}", 0.0) for s in ("embed", "head", "vision")) + cal.get("head", 0.0)
        byte_ratio = sum(rel.values()) / max(1, sum(sl.values()))
        scan = tm.get("scan", 0.0) * byte_ratio
        fin = tm.get("finalize", 0.0) * byte_ratio
        total = layers + nextn + once + scan + fin
        out["exl3_3.05_hours"] = round(total / 3600, 2)
        out["exl3_parts_hours"] = {"decoder layers": round(layers / 3600, 2), "nextn": round(nextn / 3600, 2),
                                   "embed/head/vision": round(once / 3600, 3), "nan scan": round(scan / 3600, 2),
                                   "finalize": round(fin / 3600, 3)}
    x = (st.get("exllamav3") or {}).get("layers_seconds") or {}
    moe = [i for i in range(len(LAYER_TYPES)) if MLP_TYPES[i] == "sparse" and str(i) in x]
    if moe and "exl3_3.05_hours" in out:
        mine = sum(e["timings"].get(f"stage/layer.{i}", 0.0) for i in moe)
        ratio = sum(x[str(i)] for i in moe) / max(mine, 1e-9)
        out["exllamav3_moe_layer_ratio"] = round(ratio, 3)
        out["exllamav3_3.05_hours_by_layer_ratio"] = round(out["exl3_3.05_hours"] * ratio, 2)
    g = st.get("gguf", {})
    if "iq-2.6bpw" in g:
        rates = {}
        for label in ("Q4_K_M", "iq-2.6bpw"):
            for k, v in g[label]["timings"].items():
                t = k.split("/", 1)[1]
                w = g[label]["weights_by_type"].get(t, 0)
                if w and v > 0:
                    rates[t] = w / v
        real = _release_gguf_weights()
        mean_rate = sum(rates.values()) / len(rates) if rates else float("nan")
        enc = sum(w / rates.get(t, mean_rate) for t, w in real.items() if t not in ("F32", "F16", "BF16"))
        # release types the slice's plans did not pick are encoded at the mean measured rate
        out["gguf_types_at_mean_rate"] = {t: round(w / 1e9, 2) for t, w in real.items()
                                          if t not in rates and t not in ("F32", "F16", "BF16")}
        rest = g["iq-2.6bpw"]["wall_seconds"] - sum(g["iq-2.6bpw"]["timings"].values())
        byte_ratio = sum(rel.values()) / max(1, sum(sl.values()))
        cal_ratio = 1.0
        if "timings" in e and e.get("calibration"):
            c = e["calibration"]
            cal_ratio = (3 * c.get("layer.0", 0) + 31 * ex * (c.get("layer.1", 0) + c.get("layer.2", 0)) / 2
                         + 11 * ex * c.get("layer.3", 0)) / max(1e-9, sum(c.get(f"layer.{i}", 0) for i in range(4)))
        imat = g.get("imatrix_seconds", 0.0) * cal_ratio
        out["gguf_108GB_hours"] = round((enc + rest * byte_ratio + imat) / 3600, 2)
        out["gguf_parts_hours"] = {"encode": round(enc / 3600, 2), "read/write/seal": round(rest * byte_ratio / 3600, 2),
                                   "imatrix": round(imat / 3600, 2)}
        out["gguf_rates_mweights_per_s"] = {t: round(r / 1e6, 2) for t, r in rates.items()}
    v = st.get("eval", {})
    if "timings" in v:
        # one run = the reference pass + every candidate's: one candidate costs the reference's load, its own
        # load and two of the (1 + n) forward passes; the rest (windows, logits, KLD) is shared
        tm = v["timings"]
        names = [c["name"] for c in v.get("candidates", [])] or ["mixq-exl3"]
        n = len(names)
        ref_load = tm.get("load/CheckpointSource", 0.0)
        fwd = tm.get("forward", 0.0) / (1 + n)
        rest = v["wall_seconds"] - sum(x for k, x in tm.items() if k.startswith("load/")) - tm.get("forward", 0.0)
        w_ratio = (sum(rel.values()) - rel.get("vision", 0)) / max(1, sum(sl.values()) - sl.get("vision", 0))
        by_format: dict[str, list[str]] = {}
        for name in names:
            by_format.setdefault("GGUFSource" if name.endswith(".gguf") else "Exl3Source", []).append(name)
        for cls, members in by_format.items():
            load = ref_load + tm.get(f"load/{cls}", 0.0) / len(members)
            total = load * w_ratio + 2 * fwd * 45 / 4 + rest / n
            key = "exl3" if cls == "Exl3Source" else "gguf"
            out[f"eval_one_{key}_candidate_hours"] = round(total / 3600, 2)
            out[f"eval_{key}_parts_hours"] = {"load+dequantize": round(load * w_ratio / 3600, 2),
                                              "forward (reference + candidate)": round(2 * fwd * 45 / 4 / 3600, 2),
                                              "head+other": round(rest / n / 3600, 3)}
        out["eval_one_candidate_hours"] = out.get("eval_one_exl3_candidate_hours",
                                                  out.get("eval_one_gguf_candidate_hours"))
    return out


CHILD_STAGES = {"load": stage_load, "exl3": stage_exl3, "eval": stage_eval, "gguf": stage_gguf,
                "exllamav3": stage_exllamav3, "k256": stage_k256}


def _run_child(stage: str, work: Path, device: str, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--work", str(work), "--json", os.devnull, "--child", stage, "--device", device,
           *extra]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr (progress, tracebacks) passes through
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        return {"error": f"exit {r.returncode} (its traceback is on stderr)", "tail": r.stdout[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="directory for the slice and every output")
    ap.add_argument("--json", type=Path, required=True, help="results (updated after every stage)")
    ap.add_argument("--stages", default="build,load,exl3,eval,gguf,exllamav3,k256,project")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="toy widths (CPU test of the script)")
    ap.add_argument("--device", default=None, help="cuda|cpu [default: cuda when present]")
    ap.add_argument("--rows", type=int, default=64, help="calibration rows (mixq and exllamav3)")
    ap.add_argument("--seq-len", type=int, default=512, help="calibration tokens per row")
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--eval-ctx", type=int, default=4096)
    ap.add_argument("--exllamav3-limit", type=float, default=None,
                    help="seconds: stop exllamav3's converter there (its per-layer times are still recorded)")
    ap.add_argument("--eager-types", default="", help="gguf stage: types encoded without the fused kernels")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one stage in this process; its JSON on the last stdout line
        dev = a.device or "cuda"
        kw = ({"windows": a.eval_windows, "ctx": a.eval_ctx} if a.child == "eval"
              else {"rows": a.rows, "seq_len": a.seq_len} if a.child in ("exl3", "gguf", "exllamav3") else {})
        if a.child == "exllamav3":
            kw["limit_s"] = a.exllamav3_limit
        if a.child == "gguf":
            kw["eager_types"] = a.eager_types
        print("RESULT " + json.dumps(CHILD_STAGES[a.child](a.work, dev, **kw)), flush=True)
        return
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.work.mkdir(parents=True, exist_ok=True)
    res = json.loads(a.json.read_text()) if a.json.is_file() else {}
    res.setdefault("stages", {})
    for stage in [s for s in a.stages.split(",") if s]:
        t = time.time()
        if stage == "build":
            out = build(a.work, a.experts, small=a.small, device=device)
        elif stage == "project":
            out = project(res, res["stages"].get("build", {}).get("experts", a.experts))
        elif stage in CHILD_STAGES:
            out = _run_child(stage, a.work, device, ["--eval-windows", str(a.eval_windows), "--eval-ctx",
                                                     str(a.eval_ctx), "--rows", str(a.rows), "--seq-len", str(a.seq_len)]
                             + (["--exllamav3-limit", str(a.exllamav3_limit)] if a.exllamav3_limit else [])
                             + (["--eager-types", a.eager_types] if a.eager_types else []))
        else:
            raise SystemExit(f"unknown stage {stage}")
        out["seconds"] = round(time.time() - t, 1)
        res["stages"][stage] = out
        a.json.write_text(json.dumps(res, indent=2) + "\n")
        print(stage, json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
