"""The rehearsal model: GLM-5.3-Flash at its real widths with every part and one decoder layer of each kind.

From ../shared/models/glm-5.3-flash-shape/config.json's shapes (hidden 4096, vocab 154880, q_lora 1536, kv_lora 512,
64 heads x 256, KDA 64 heads x 128, DSA indexer 32 x 128, mHC 4, dense intermediate 12288, experts 2048 wide, the
24-block vision tower): the decoder layers `kinds` (default KDA + dense MLP, KDA + MoE, DSA + MoE; dense layers
first), each MoE layer with `experts` routed experts (default 288, the release's) plus the shared one, the NextN
block (DSA + MoE, as in the release), the full-vocabulary embedding and head. A 288-expert MoE layer is 7.25 G
weights (14.5 GB BF16); the default model (two MoE layers and the NextN block) is about 47 GB BF16.

Weights: transformers' own initialisation (std 0.02, its KDA gate init) of a model built with at most 8 experts;
the routed experts and router rows past those, and the NextN block's matrices, are drawn from the same N(0, 0.02)
by a torch.Generator on the build device (the GPU when present); every matrix gets outlier input channels (0.5% of
its columns x8). Written tensor by tensor as 4 GiB BF16 safetensors shards with an index, like the release (a
writer thread overlaps the disk with the generation), and with `fp8` a copy in GLM's FP8 layout (e4m3 weights of
GLM's FP8 set with 128x128 float32 `weight_scale_inv` blocks; quantization_config fp8). Each copy is written to
OUT/bf16.partial (OUT/fp8.partial) and renamed when complete.

    python bench/release/rehearsal_model.py OUT [--experts 288] [--kinds kda-dense,kda-moe,dsa-moe] [--no-fp8]
    python bench/release/rehearsal_model.py OUT --small --device cpu     # the same structure at toy widths
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))
from paths import SHARED  # noqa: E402

SHAPE_CONFIG = SHARED / "models" / "glm-5.3-flash-shape" / "config.json"
# layer kind -> (layer_types entry, mlp_layer_types entry) of the release config
LAYER_KINDS = {"kda-dense": ("linear_attention", "dense"), "kda-moe": ("linear_attention", "sparse"),
               "dsa-moe": ("deepseek_sparse_attention", "sparse")}
DEFAULT_KINDS = ("kda-dense", "kda-moe", "dsa-moe")
# decoder layers of each kind in GLM-5.3-Flash (45 = 3 + 31 + 11), besides the NextN block (DSA + MoE)
RELEASE_LAYERS = {"kda-dense": 3, "kda-moe": 31, "dsa-moe": 11}
RELEASE_EXPERTS = 288
SHARD_BYTES = 4 << 30
OUTLIER_FRACTION, OUTLIER_GAIN = 0.005, 8.0
INIT_EXPERTS = 8  # experts transformers initialises; the rest are drawn directly (same distribution)
SMALL_WIDTHS = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, q_lora_rank=256,
                    kv_lora_rank=256, num_attention_heads=2, num_key_value_heads=2, qk_head_dim=128,
                    qk_nope_head_dim=128, v_head_dim=128, linear_num_heads=2, linear_head_dim=128, index_n_heads=2,
                    index_head_dim=128, index_topk=64, index_kpool=4, vocab_size=8192, pad_token_id=0)
MEDIA_TOKEN_KEYS = ("image_end_token_id", "image_start_token_id", "image_token_id", "video_end_token_id",
                    "video_start_token_id", "video_token_id")
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def parse_kinds(spec: str | tuple | list) -> tuple[str, ...]:
    """`kda-dense,kda-moe,...` -> a tuple of layer kinds (dense layers first, as first_k_dense_replace needs)."""
    kinds = tuple(k.strip() for k in (spec.split(",") if isinstance(spec, str) else spec) if k.strip())
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if bad or not kinds:
        raise SystemExit(f"layer kinds: unknown kind {bad[0] if bad else '(none)'}; use {', '.join(LAYER_KINDS)}")
    mlp = [LAYER_KINDS[k][1] for k in kinds]
    if "dense" in mlp[mlp.count("dense"):]:
        raise SystemExit("layer kinds: dense layers must come first (first_k_dense_replace)")
    return kinds


def layer_types(kinds=DEFAULT_KINDS) -> tuple[str, ...]:
    """The config's `layer_types` of a model of `kinds`."""
    return tuple(LAYER_KINDS[k][0] for k in parse_kinds(kinds))


def rehearsal_config(shape: dict, experts: int, *, small: bool = False, kinds=DEFAULT_KINDS, nextn: bool = True,
                     vocab: int | None = None) -> dict:
    """The release config cut to `kinds` and `experts` routed experts (`small`: toy widths; `vocab`: a cut
    vocabulary, the pad id then 0 and the media token ids dropped; `nextn`: keep the NextN block)."""
    cfg = copy.deepcopy(shape)
    t = cfg["text_config"]
    kinds = parse_kinds(kinds)
    n = len(kinds)
    mlp = [LAYER_KINDS[k][1] for k in kinds]
    t.update(num_hidden_layers=n, layer_types=[LAYER_KINDS[k][0] for k in kinds], mlp_layer_types=mlp,
             indexer_types=["full"] * n, first_k_dense_replace=mlp.count("dense"), n_routed_experts=experts,
             num_experts_per_tok=min(int(t["num_experts_per_tok"]), experts),
             num_nextn_predict_layers=1 if nextn else 0)
    if small:
        t.update(SMALL_WIDTHS)
        t["linear_attn_config"] = dict(t["linear_attn_config"], num_heads=2, head_dim=128)
        cfg["vision_config"].update(depth=1, hidden_size=128, intermediate_size=256, num_heads=2,
                                    out_hidden_size=256, projection_intermediate_size=256)
    if vocab is not None and int(t["vocab_size"]) > vocab:
        t.update(vocab_size=vocab, pad_token_id=0)  # the release's pad id lies outside the cut vocabulary
    if small or vocab is not None:
        for k in MEDIA_TOKEN_KEYS:
            cfg.pop(k, None)
    cfg["dtype"] = "bfloat16"
    return cfg


def transformers_config(cfg: dict) -> dict:
    """`cfg` as transformers' Glm5NextConfig takes it (its name for the DSA layers, the model's own experts
    capped at INIT_EXPERTS: the rest are drawn by `build`)."""
    t = cfg["text_config"]
    e0 = min(int(t["n_routed_experts"]), INIT_EXPERTS)
    tcfg = copy.deepcopy(cfg)
    tcfg["text_config"].update(n_routed_experts=e0, num_experts_per_tok=min(int(t["num_experts_per_tok"]), e0))
    tcfg["text_config"]["layer_types"] = ["indexed_attention" if k != "linear_attention" else k
                                          for k in t["layer_types"]]
    return tcfg


def outlier_columns(w, gen) -> None:
    """Scale OUTLIER_FRACTION of the input columns of matrix `w` by OUTLIER_GAIN, in place."""
    import torch

    k = max(1, int(w.shape[1] * OUTLIER_FRACTION))
    cols = torch.randperm(w.shape[1], generator=gen, device=gen.device)[:k].to(w.device)
    w[:, cols] *= OUTLIER_GAIN


def add_outliers(sd: dict, seed: int) -> None:
    """Outlier columns in every matrix of `sd` but the embedding (whose columns are not input channels)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, w in sd.items():
        if w.dim() != 2 or not name.endswith(".weight") or "embed_tokens" in name or min(w.shape) < 64:
            continue
        outlier_columns(w, gen)


def peaks() -> dict:
    """Peak host RSS of this process and peak GPU memory allocated by torch, MiB."""
    import torch

    d = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        d["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return d


class ShardWriter:
    """Release-style safetensors shards (<= SHARD_BYTES each) plus the index, fed one tensor at a time; full
    shards are written by a background thread (at most two waiting) while the caller makes the next tensors.
    With `fp8`, GLM's FP8 set is stored as e4m3 with 128x128 `_scale_inv` blocks (`dsa`: the MLA layers)."""

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

        from mixq.formats.tiny import fp8_quantize_blocks, is_fp8_target

        parts = {name: w}
        if self.fp8 and is_fp8_target(name, tuple(w.shape), self.dsa):
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


def mla_layers(cfg: dict) -> set[int]:
    """Indices of the MLA (DSA) decoder layers of `cfg`, the NextN block's among them."""
    t = cfg["text_config"]
    n = int(t["num_hidden_layers"])
    dsa = {i for i, k in enumerate(t["layer_types"]) if k != "linear_attention"}
    return dsa | ({n} if int(t.get("num_nextn_predict_layers") or 0) else set())


def file_order(name: str):
    """Sort key: embedding first, then the decoder layers (NextN last) in order, then the rest."""
    if ".layers." in name and "visual." not in name:
        rest = name.split(".layers.")[1]
        return (1, int(rest.split(".")[0]), name)
    return (0 if "embed" in name else 2, 0, name)


def save_shards(sd: dict, out: Path, *, fp8: bool, dsa: set[int]) -> int:
    """Write `sd` (checkpoint names -> tensors on any device) as release-style shards plus an index."""
    w = ShardWriter(out, fp8=fp8, dsa=dsa)
    for name in sorted(sd, key=file_order):
        w.add(name, sd[name])
    return w.close()


def checkpoint_names(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, role) of every tensor of the checkpoint `cfg` describes (shapes only, mixq's table)."""
    from mixq.formats.checkpoint import checkpoint_from_config

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        ck = checkpoint_from_config(Path(d) / "config.json")
        return {n: (tuple(int(x) for x in ck.shape(n)), ck.info(n).role) for n in ck.names()}


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build(out_dir: str | Path, *, experts: int = RELEASE_EXPERTS, kinds=DEFAULT_KINDS, fp8: bool = True,
          small: bool = False, device: str | None = None, seed: int = 0, nextn: bool = True,
          vocab: int | None = None) -> dict:
    """Write the rehearsal model to OUT/bf16 (and with `fp8` its FP8 copy to OUT/fp8); returns what was built:
    layer kinds, parameters, bytes, seconds, peak host and GPU memory."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from mixq.formats.tiny import default_tokenizer_dir

    out_dir = Path(out_dir)
    device = device or default_device()
    kinds = parse_kinds(kinds)
    cfg = rehearsal_config(json.loads(SHAPE_CONFIG.read_text()), experts, small=small, kinds=kinds, nextn=nextn,
                           vocab=vocab)
    t = cfg["text_config"]
    n_layers = len(kinds)
    std = float(t.get("initializer_range", 0.02))
    t0 = time.time()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig(**transformers_config(cfg)))
    with torch.no_grad():
        sd = {k: v.detach() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
        add_outliers(sd, seed)
    del model
    t_init = time.time() - t0
    names = checkpoint_names(cfg)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    nextn_prefix = f".layers.{n_layers}."

    def tensor(name: str):
        """transformers' tensor when its shape is the model's; else drawn here: matrices N(0, std) with outlier
        columns; vectors the NextN block's twin in the last decoder layer (its norms), else zero (the router's
        score bias), else a norm's ones."""
        shp, _role = names[name]
        w = sd.get(name)
        if w is not None and tuple(w.shape) == shp:
            return w
        if len(shp) == 1:
            twin = sd.get(name.replace(nextn_prefix, f".layers.{n_layers - 1}.")) if nextn_prefix in name else None
            if twin is not None and tuple(twin.shape) == shp:
                return twin
            if name.endswith("norm.weight"):
                return torch.ones(shp, device=device)
            return torch.zeros(shp, device=device)
        w = torch.empty(shp, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)
        if len(shp) == 2 and name.endswith(".weight") and min(shp) >= 64:
            outlier_columns(w, gen)
        return w

    copies = ["bf16"] + (["fp8"] if fp8 else [])
    parts = {}
    for kind in ("bf16", "fp8"):
        shutil.rmtree(out_dir / kind, ignore_errors=True)
        shutil.rmtree(out_dir / f"{kind}.partial", ignore_errors=True)
    for kind in copies:
        parts[kind] = out_dir / f"{kind}.partial"
        parts[kind].mkdir(parents=True)
    dsa = mla_layers(cfg)
    writers = {kind: ShardWriter(parts[kind], fp8=kind == "fp8", dsa=dsa) for kind in copies}
    # tensors transformers has and the table lacks (none today) are kept as they are
    extra = sorted(set(sd) - set(names))
    res = {"experts": experts, "kinds": list(kinds), "nextn": nextn, "fp8": fp8, "device": device, "small": small,
           "hidden_size": int(t["hidden_size"]), "vocab_size": int(t["vocab_size"]),
           "params": sum(math.prod(s) for s, _ in names.values()) + sum(sd[n].numel() for n in extra),
           "init_experts": min(experts, INIT_EXPERTS), "init_seconds": round(t_init, 1)}
    t1 = time.time()
    with torch.no_grad():
        for name in sorted(list(names) + extra, key=file_order):
            w = tensor(name)
            for wr in writers.values():
                wr.add(name, w)
            del w
        for kind, wr in writers.items():
            res[f"{kind}_bytes"] = wr.close()
    res["generate_write_seconds"] = round(time.time() - t1, 1)
    tok = default_tokenizer_dir()
    for kind in copies:
        c = copy.deepcopy(cfg)
        if kind == "fp8":
            c["quantization_config"] = dict(FP8_QUANTIZATION)
        (parts[kind] / "config.json").write_text(json.dumps(c, indent=2) + "\n")
        if tok is not None:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (tok / f).is_file():
                    shutil.copyfile(tok / f, parts[kind] / f)
        res[f"{kind}_file_bytes"] = sum(f.stat().st_size for f in parts[kind].iterdir())
        parts[kind].rename(out_dir / kind)
    written = sum(res[f"{k}_file_bytes"] for k in copies)
    res["bytes_written"] = written
    res["write_gb_per_s"] = round(written / max(1e-9, time.time() - t1) / 1e9, 3)
    res["tokenizer"] = tok is not None
    res["seconds"] = round(time.time() - t0, 1)
    sd.clear()  # the closure `tensor` holds the dict: emptied, not unbound
    res.update(peaks())
    return res


def built(out_dir: str | Path, copy_name: str = "bf16") -> bool:
    """Whether OUT holds a complete copy (`bf16` or `fp8`): renamed from .partial only once written."""
    return (Path(out_dir) / copy_name / "model.safetensors.index.json").is_file()


def release_exl3_rates(bpw: float) -> dict[str, float]:
    """Each budgeted role's trellis rate in the release's EXL3 plan at `bpw` (`mixq plan` of the shape config),
    the rate most of the role's weights get there, the NextN block (planned at its own --mtp-bits) aside. The
    rehearsal model planned at the same bpw is a different budget (its attention, dense MLP and head are a larger
    share), so it is converted at these rates, each role pinned by an `--override`."""
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


def release_exl3_overrides(bpw: float, n_layers: int) -> list[str]:
    """`--override` values converting a rehearsal model of `n_layers` decoder layers at the release plan's rates
    (release_exl3_rates): its NextN block (layers.`n_layers`) first, kept at the default --mtp-bits as in the
    release plan (a role override would reach it too: the first match wins), then each budgeted role."""
    from mixq.planning.types import DEFAULT_MTP_BITS

    nextn = [f"model.language_model.layers.{n_layers}.*={DEFAULT_MTP_BITS:g}"]
    return nextn + [f"{role}={bits:g}" for role, bits in release_exl3_rates(bpw).items()]


RELEASE_GGUF_SIZE = 108 * 10**9  # the 108 GB i-quant plan (`mixq plan --size 108GB --gguf-ladder iq`)


def release_layer_kinds() -> dict[int, str]:
    """Release decoder layer -> kind (kda-dense / kda-moe / dsa-moe); the NextN block (layer 45) -> "nextn"."""
    t = json.loads(SHAPE_CONFIG.read_text())["text_config"]
    inv = {v: k for k, v in LAYER_KINDS.items()}
    out = {i: inv[(a, m)] for i, (a, m) in enumerate(zip(t["layer_types"], t["mlp_layer_types"]))}
    out[len(out)] = "nextn"
    return out


def release_gguf_overrides(cfg: dict) -> list[str]:
    """`--override` values pinning every budgeted GGUF tensor of the rehearsal model `cfg` to the type the release's
    108 GB i-quant plan gives it: per layer kind (the NextN block to the NextN block) and tensor, the type most of
    that tensor's weights get over the release layers of the kind; the tensors outside the layers by name."""
    import collections
    import re

    from mixq.formats.checkpoint import checkpoint_from_config
    from mixq.formats.gguf_names import gguf_tensors
    from mixq.planning.planner import plan_model

    block = re.compile(r"blk\.(\d+)\.(.+)$")
    rel_kinds = release_layer_kinds()
    votes: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in plan_model(checkpoint_from_config(SHAPE_CONFIG), "gguf", size=RELEASE_GGUF_SIZE, gguf_ladder="iq").tensors:
        m = block.match(t.name)
        votes[(rel_kinds[int(m[1])], m[2]) if m else (None, t.name)][t.type] += math.prod(int(x) for x in t.shape)
    t = cfg["text_config"]
    kinds = {i: k for i, k in enumerate(parse_kinds(
        [{v: k for k, v in LAYER_KINDS.items()}[(a, m)] for a, m in zip(t["layer_types"], t["mlp_layer_types"])]))}
    kinds[len(kinds)] = "nextn"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        specs = gguf_tensors(checkpoint_from_config(Path(d) / "config.json"))
    out = []
    for s in specs:
        if s.policy != "quant":
            continue
        m = block.match(s.name)
        typ = votes[(kinds[int(m[1])], m[2]) if m else (None, s.name)].most_common(1)[0][0]
        out.append(f"^{re.escape(s.name)}$={typ}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="directory: OUT/bf16 and OUT/fp8 are written")
    ap.add_argument("--experts", type=int, default=RELEASE_EXPERTS)
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"layer kinds of {', '.join(LAYER_KINDS)}")
    ap.add_argument("--no-fp8", action="store_true", help="write the BF16 copy only")
    ap.add_argument("--no-nextn", action="store_true", help="leave the NextN block out")
    ap.add_argument("--small", action="store_true", help="toy widths (CPU tests)")
    ap.add_argument("--device", default=None, help="where the weights are generated [default: cuda when present]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write what was built here")
    a = ap.parse_args(argv)
    res = build(a.out, experts=a.experts, kinds=a.kinds, fp8=not a.no_fp8, small=a.small, device=a.device,
                seed=a.seed, nextn=not a.no_nextn)
    text = json.dumps(res, indent=2) + "\n"
    if a.json:
        a.json.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
