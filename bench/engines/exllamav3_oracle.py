"""exllamav3 1.6.5's own EXL3 conversion of a tiny glm5_next model, kept as a test oracle (tests/data/exllamav3_tiny).

Device command (CUDA; exllamav3 1.6.5, transformers 5.23 and their needs on /tmp/site, /tmp/pp/mixq a link to this
checkout, as bench/tools/gpu_suite.sh sets them up; the same TORCH_CUDA_ARCH_LIST keeps exllamav3's JIT-built extension):

    PYTHONPATH=/tmp/site:/tmp/pp PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \\
        python3 bench/engines/exllamav3_oracle.py --out $OUT/exllamav3_tiny

then copy $OUT/exllamav3_tiny to tests/data/exllamav3_tiny (tests/formats/test_exllamav3_oracle.py reads it).
About 2 minutes once exllamav3's extension is built (its first import builds it: 5-7 minutes more).

1. `build_source`: the tiny random checkpoint (formats/tiny.py, SOURCE: one KDA layer with a dense MLP, the NextN
   block with MLA attention and 2 routed experts, widths 128, no vision tower, torch seed 0) with the demo's
   byte-level BPE tokenizer (vocabulary 384 = 3 x 128, so every token id the converter's calibration makes is
   inside the embedding), a processor_config.json and the image token ids exllamav3's glm5_next config reader
   requires. It is deterministic: the tests rebuild it and compare its sha256 (oracle.json `source`).
2. exllamav3's converter, once per codebook (CONVERSIONS: mcg at 2 bpw, mul1 at the half rate 2.5; head at 6 bits,
   NextN at 3 / 3.5, vision tower absent so `-vb 16`), 16 calibration rows of 256 tokens; its work directories
   are dropped.
3. With exllamav3's own code: the dense weight of each WEIGHTS Linear (`LinearEXL3.get_weight_tensor`, HF
   orientation (out, in), fp16, the first `columns` input columns where given), the codebook values in the
   rotated basis of ROTATED (`get_inner_weight_tensor`, exact fp16), and `Model.forward` logits of both
   directories and of the unquantized source on the fixed tokens `input_ids`.
4. mixq's reading of the same directories (verify, decode against 3., its torch forward against exllamav3's
   logits), printed and kept under `mixq` in oracle.json: what the tests will assert, seen at once.

Output under --out: tiny-mcg/ and tiny-mul1/ (exllamav3's directories, untouched), oracle.safetensors (tensors
`input_ids`, `source/logits`, `{codebook}/logits`, `{codebook}/weight/{key}`, `{codebook}/rotated/{key}`) and
oracle.json (versions, commands, the source recipe and digests, what each tensor is, timings, mixq's agreement).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mixq.demo_run import write_demo_tokenizer
from mixq.formats.tiny import write_tiny_checkpoint
from mixq.runtime.calibration import BUILTIN_TEXT

L = "model.language_model.layers"
VOCAB = 384  # the demo tokenizer's vocabulary: 256 bytes + 7 special tokens + merges, 3 x 128
SOURCE = {"layer_types": ("linear_attention",), "n_experts": 2, "dense_layers": 1, "nextn": True,
          "vision": False, "vocab": VOCAB, "seed": 0}
# exllamav3's glm5_next config reader requires these (no default); the text-only model never uses them
CONFIG_EXTRA = {"image_start_token_id": VOCAB - 2, "image_end_token_id": VOCAB - 1}
# exllamav3's glm5_next config reader opens processor_config.json and requires these image_processor keys
PROCESSOR_CONFIG = {
    "image_processor": {
        "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "patch_expand_factor": 1, "min_image_tokens": 16, "max_image_tokens": 8000,
        "size": {"longest_edge": 1}, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Glm5NextImageProcessor"},
    "processor_class": "Glm5NextProcessor",
}
# codebook -> converter rates: trunk (-b), head (-hb), NextN block (-mb); mul1 alone allows the half rates
CONVERSIONS = {"mcg": {"bits": 2.0, "head_bits": 6, "mtp_bits": 3.0},
               "mul1": {"bits": 2.5, "head_bits": 6, "mtp_bits": 3.5}}
CAL_ROWS, CAL_COLS = 16, 256
# module key -> input columns kept (None: all); wide ones are cut to keep tests/data small
WEIGHTS = {
    f"{L}.0.self_attn.qkv_proj": 32,       # the fused KDA q | k | v (384 x 128)
    f"{L}.0.self_attn.o_proj": None,
    f"{L}.1.mlp.experts.1.down_proj": None,  # a routed expert of the NextN block (NextN rate, uncalibrated)
    "lm_head": 64,                            # the head at its own rate (384 x 128)
}
ROTATED = (f"{L}.1.mlp.experts.1.down_proj", f"{L}.0.self_attn.o_proj")
N_TOKENS = 32
SIZE_LIMIT = 2_000_000  # bytes: what tests/data may hold of it


def build_source(out: Path) -> Path:
    """The tiny checkpoint at `out` (must not exist or be empty): SOURCE through formats/tiny.py with the demo
    tokenizer, processor_config.json and CONFIG_EXTRA. The same bytes on every run with the same torch and
    transformers."""
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        tok = write_demo_tokenizer(Path(tmp) / "tokenizer", VOCAB)
        (tok / "processor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2) + "\n")
        write_tiny_checkpoint(out, tokenizer_dir=tok, **SOURCE)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(CONFIG_EXTRA)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def file_digests(d: Path) -> dict[str, str]:
    """sha256 of every file of directory `d`, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def input_ids(src: Path) -> torch.Tensor:
    """The fixed forward tokens: the first N_TOKENS ids of the built-in text under the source's tokenizer."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(BUILTIN_TEXT[:1000], add_special_tokens=False).ids
    return torch.tensor(ids[:N_TOKENS], dtype=torch.long)


def convert_command(src: Path, dst: Path, work: Path, codebook: str) -> list[str]:
    """exllamav3 1.6.5's converter (exllamav3/conversion/convert_model.py flags) for one CONVERSIONS entry."""
    r = CONVERSIONS[codebook]
    return [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(dst),
            "-w", str(work), "-b", str(r["bits"]), "-hb", str(r["head_bits"]), "-mb", str(r["mtp_bits"]),
            "-vb", "16", "-cb", codebook, "-cr", str(CAL_ROWS), "-cc", str(CAL_COLS), "-d", "0"]


def run_converter(cmd: list[str], log: Path) -> float:
    """Run the converter, its output to `log` (the tail printed); seconds. Raises on a failed run."""
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    tail = log.read_text(errors="replace").splitlines()[-25:]
    print("\n".join("    | " + ln for ln in tail), flush=True)
    if rc != 0 or "All done" not in log.read_text(errors="replace"):
        raise RuntimeError(f"converter exited {rc}: {' '.join(cmd)}")
    return time.time() - t0


def stored_linear(d: Path, key: str) -> dict[str, torch.Tensor]:
    """The stored tensors `key.*` of an EXL3 directory (every shard), names without the key."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        for n, t in load_file(str(f)).items():
            if n.startswith(key + ".") and "." not in n[len(key) + 1:]:
                out[n[len(key) + 1:]] = t
    return out


def exllamav3_linear(d: Path, key: str):
    """exllamav3's own LinearEXL3 over the stored tensors of `key` (on the GPU)."""
    from exllamav3.modules.quant.exl3 import LinearEXL3

    t = stored_linear(d, key)
    trellis = t["trellis"].cuda()
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    return LinearEXL3(None, k, n, suh=t["suh"].cuda(), svh=t["svh"].cuda(), trellis=trellis, mcg=t.get("mcg"),
                      mul1=t.get("mul1"), bias=t["bias"].cuda() if "bias" in t else None, out_dtype=torch.half,
                      key=key)


def exllamav3_forward(d: Path, ids: torch.Tensor, module_keys: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict]:
    """Logits (T, vocab) of `Model.forward` on `ids`, and for each of `module_keys` found in the loaded model the
    dense weight its Linear reconstructs (k, n) (None where the loaded module keeps none)."""
    from exllamav3 import Config, Model

    model = Model.from_config(Config.from_directory(str(d)))
    model.load()
    weights: dict[str, torch.Tensor | None] = {}
    try:
        with torch.inference_mode():
            logits = model.forward(ids.view(1, -1), {"attn_mode": "flash_attn_nc"})[0].cpu()
            for key in module_keys:
                try:
                    inner = model.find_module(key).inner
                    weights[key] = inner.get_weight_tensor().cpu() if inner is not None else None
                except (KeyError, AttributeError):
                    weights[key] = None
    finally:
        model.unload()
        del model
        torch.cuda.empty_cache()
    return logits, weights


def compact_logits(x: torch.Tensor) -> torch.Tensor:
    """fp16 when that loses nothing (exllamav3's head writes fp16), else float32."""
    return x.half() if torch.equal(x.half().float(), x.float()) else x.float()


def exllamav3_values(d: Path, codebook: str, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """oracle.safetensors entries of one directory, and notes (whether the loaded model's Linears reconstruct the
    same weights as the stand-alone LinearEXL3)."""
    out: dict[str, torch.Tensor] = {}
    notes: dict[str, dict] = {}
    dense: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for key, cols in WEIGHTS.items():
            lin = exllamav3_linear(d, key)
            w = lin.get_weight_tensor().cpu()  # (k, n) = (in, out), fp16
            dense[key] = w
            hf = w.t()
            out[f"{codebook}/weight/{key}"] = (hf if cols is None else hf[:, :cols]).contiguous()
            notes[key] = {"K": lin.K, "codebook": "mcg" if lin.mcg else "mul1" if lin.mul1 else "3inst",
                          "shape": list(hf.shape), "columns": cols}
        for key in ROTATED:
            out[f"{codebook}/rotated/{key}"] = exllamav3_linear(d, key).get_inner_weight_tensor().cpu().contiguous()
    logits, in_model = exllamav3_forward(d, ids, tuple(WEIGHTS))
    out[f"{codebook}/logits"] = compact_logits(logits)
    for key, w in in_model.items():
        notes[key]["loaded_module_same"] = None if w is None else bool(torch.equal(w, dense[key]))
    return out, notes


def mixq_agreement(d: Path, codebook: str, values: dict[str, torch.Tensor]) -> dict:
    """What the tests assert, measured here: mixq's verify, its decode against exllamav3's weights (max abs
    difference / max abs weight), its rotated decode (exact?), its torch forward against exllamav3's logits."""
    import mixq
    from mixq.formats.exl3_reader import Exl3Dir
    from mixq.quant.trellis import from_tensors
    from mixq.runtime.dequant import read_exl3

    rep: dict = {}
    v = mixq.verify(d)
    rep["verify_problems"] = v.get("problems")
    hf = read_exl3(d)
    units = {u.key: u for u in Exl3Dir(d).units}
    rel = {}
    for key, cols in WEIGHTS.items():
        got = torch.cat([hf[n] for n in units[key].hf_names], 0)
        want = values[f"{codebook}/weight/{key}"].float()
        got = got[: want.shape[0], : want.shape[1]]
        rel[key] = float((got - want).abs().max() / want.abs().max())
    rep["weight_max_rel_diff"] = rel
    exact = {}
    for key in ROTATED:
        t = stored_linear(d, key)
        k, n = t["trellis"].shape[0] * 16, t["trellis"].shape[1] * 16
        exact[key] = bool(torch.equal(from_tensors(t, (n, k)).rotated(), values[f"{codebook}/rotated/{key}"].float()))
    rep["rotated_exact"] = exact
    lg = torch_logits(d, hf, values["input_ids"])
    ref = values[f"{codebook}/logits"].float()
    rep["logits_kld"] = kld(ref, lg)
    rep["logits_rel_diff"] = centered_rel_diff(ref, lg)
    return rep


def mixq_eval(src: Path, dirs: list[Path], work: Path) -> dict:
    """`mixq eval` of the directories against the source, one 32-token window of the built-in text, with the
    torch engine (what the tests run on the CPU) and the exllamav3 engine: {engine: {dir: scores} or error}."""
    import mixq

    text = work / "eval.txt"
    text.write_text(BUILTIN_TEXT)
    out: dict = {}
    for engine, device in (("torch", "cpu"), ("exllamav3", "cuda")):
        try:
            rep = mixq.evaluate(src, dirs, text, windows=1, ctx=32, device=device, engine=engine, progress=False)
            out[engine] = {Path(c["path"]).name: {k: c[k] for k in ("engine", "kld_mean", "top1")}
                           for c in rep["candidates"]}
        except Exception:
            out[engine] = {"error": traceback.format_exc(limit=4)}
    return out


def torch_logits(model_dir: Path, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, vocab) of the reference architecture (transformers, fp32, CPU) holding `weights` on `ids`.
    No cache: transformers' cache cannot report a length for a model without attention layers (one KDA layer)."""
    from mixq.runtime.reference import build_model

    with torch.no_grad():
        model = build_model(Path(model_dir), weights, torch.device("cpu"))
        return model(ids.view(1, -1), use_cache=False).logits[0].float()


def kld(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) from logits (T, vocab)."""
    lp, lq = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def centered_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """|| (a - mean a) - (b - mean b) || / || a - mean a ||, per-position means: logits that agree up to the
    softmax's free constant give ~0."""
    a = a.float() - a.float().mean(-1, keepdim=True)
    b = b.float() - b.float().mean(-1, keepdim=True)
    return float((a - b).norm() / a.norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (created; must not hold files)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("exllamav3_oracle: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = args.out
    if out.exists() and any(out.iterdir()):
        print(f"exllamav3_oracle: {out} exists and is not empty", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="exllamav3-oracle-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report: dict = {"timings": {}, "errors": {}}
    import exllamav3  # first: its extension's JIT build (when not cached) shows here, not inside a conversion

    report["timings"]["import_exllamav3"] = round(time.time() - t0, 1)
    print(f"-- exllamav3 {exllamav3.__version__} imported in {report['timings']['import_exllamav3']} s", flush=True)
    t0 = time.time()

    src = build_source(work / "src")
    ids = input_ids(src)
    report["source"] = {"recipe": {**SOURCE, "layer_types": list(SOURCE["layer_types"])},
                        "config_extra": CONFIG_EXTRA, "sha256": file_digests(src),
                        "build": "bench/engines/exllamav3_oracle.py build_source"}
    report["timings"]["source"] = round(time.time() - t0, 1)
    values: dict[str, torch.Tensor] = {"input_ids": ids}

    report["dirs"] = {}
    for cb in CONVERSIONS:
        dst, job = out / f"tiny-{cb}", work / f"job-{cb}"
        cmd = convert_command(src, dst, job, cb)
        print(f"-- exllamav3 convert ({cb}): {' '.join(cmd[1:])}", flush=True)
        entry = {"dir": dst.name, "command": ["python"] + cmd[1:], **CONVERSIONS[cb]}
        try:
            report["timings"][f"convert_{cb}"] = round(run_converter(cmd, work / f"convert-{cb}.log"), 1)
        except Exception as e:  # the other codebook's directory is still worth having
            report["errors"][f"convert_{cb}"] = str(e)
            shutil.rmtree(dst, ignore_errors=True)
            continue
        finally:
            shutil.rmtree(job, ignore_errors=True)
        entry["command"] = [str(c).replace(str(src), "SRC").replace(str(dst), "DST").replace(str(job), "WORK")
                            for c in entry["command"]]
        report["dirs"][cb] = entry

    report["versions"] = {"exllamav3": exllamav3.__version__, "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(0)}
    t1 = time.time()
    try:
        logits, _ = exllamav3_forward(src, ids)
        values["source/logits"] = compact_logits(logits)
    except Exception:
        report["errors"]["source_forward"] = traceback.format_exc(limit=3)
    for cb in list(report["dirs"]):
        try:
            v, notes = exllamav3_values(out / f"tiny-{cb}", cb, ids)
            values.update(v)
            report["dirs"][cb]["linears"] = notes
        except Exception:
            report["errors"][f"values_{cb}"] = traceback.format_exc(limit=3)
    report["timings"]["exllamav3_values"] = round(time.time() - t1, 1)
    report["weights"] = {k: {"columns": c} for k, c in WEIGHTS.items()}
    report["rotated"] = list(ROTATED)
    report["input_ids"] = ids.tolist()
    save_file(values, str(out / "oracle.safetensors"), metadata={"writer": "bench/engines/exllamav3_oracle.py"})

    report["mixq"] = {}
    for cb in report["dirs"]:
        try:
            report["mixq"][cb] = mixq_agreement(out / f"tiny-{cb}", cb, values)
        except Exception:
            report["mixq"][cb] = {"error": traceback.format_exc(limit=4)}
    if "source/logits" in values:
        try:
            lg = torch_logits(src, load_file(str(src / "model.safetensors")), ids)
            report["mixq"]["source"] = {"logits_kld": kld(values["source/logits"].float(), lg),
                                        "logits_rel_diff": centered_rel_diff(values["source/logits"], lg)}
        except Exception:
            report["mixq"]["source"] = {"error": traceback.format_exc(limit=4)}

    report["mixq"]["eval"] = mixq_eval(src, [out / f"tiny-{cb}" for cb in report["dirs"]], work)

    report["timings"]["total"] = round(time.time() - t0, 1)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    report["bytes"] = total
    (out / "oracle.json").write_text(json.dumps(report, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(json.dumps({k: report[k] for k in ("timings", "errors", "mixq")}, indent=2))
    print(f"-- {out}: {total} bytes" + (f" (over {SIZE_LIMIT})" if total > SIZE_LIMIT else ""))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if report["errors"] or len(report["dirs"]) < len(CONVERSIONS) else 0


if __name__ == "__main__":
    sys.exit(main())
