"""Convert a glm5_next checkpoint to a glm5-next GGUF: plan types -> quantize tensor by tensor -> write (shards).

`convert_gguf(model, out, qtype=... | bpw=... | size=..., imatrix=..., ...)`:
- tensor list and transforms: formats/gguf_names; per-tensor ggml types: the plan (convert/planning, helper D)
  for mixes, or the converter's pure policy for F32/F16/BF16 (F32 pins per formats/glm5next);
- llama-quantize options on GGUF names: `tensor_type` [(regex, TYPE)] (first match wins), `output_tensor_type`,
  `token_embedding_type`; never-quantized tensors (policy f32/keep) are left alone, as llama-quantize does;
- encoders: mixq.quant.kquants (bit-exact ggml), falling back to gguf-py for types it lacks, run on `threads`
  worker processes by convert/gguf_workers (row blocks / expert slices; same bytes as one process);
- the checkpoint is read lazily, one GGUF tensor at a time; output written under temp names, renamed at the end.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from mixq.errors import InputError, PlanError
from mixq.quant.allocator import parse_size  # one size convention: GB = 10^9, GiB = 2^30
from mixq.quant import gguf_mix
from mixq.quant.device import pick_device
from mixq.convert.gguf_workers import TensorEncoder, encode  # noqa: F401  (encode: public here since the start)

PURE_FLOAT = ("F32", "F16", "BF16")
# llama-quantize refuses these target types for a tensor without importance data (token_embd/output excepted)
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS")


def fallback_type(qtype: str, n: int) -> str:
    """The type llama-quantize really uses for a row length `n` (quant.gguf_mix.fallback, the planner's rule);
    a type with no listed fallback whose block does not divide `n` becomes F16, as llama-quantize's last resort."""
    try:
        return gguf_mix.fallback(qtype, n)
    except PlanError:
        return "F16"


def _pure_types(specs, outtype: str) -> list[str]:
    """The converter's policy for a float / Q8_0-style outtype: F32 pins stay F32, the rest takes `outtype`."""
    out = []
    for s in specs:
        if s.policy == "f32" or len(s.shape) == 1:
            out.append("F32")
        else:
            out.append(fallback_type(outtype, s.shape[-1]))
    return out


def _planned_types(ckpt, specs, *, qtype, bpw, size, include_mtp, gguf_ladder="k") -> list[str]:
    try:
        from mixq.convert.planning import plan_model

        plan = plan_model(ckpt, "gguf", qtype=qtype, bpw=bpw, size=size, include_mtp=include_mtp,
                          gguf_ladder=gguf_ladder)
    except ImportError as e:
        if qtype and qtype.upper() in ("Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_1"):
            return _pure_types(specs, qtype.upper())
        raise PlanError(f"GGUF planning (mixq.convert.planning) is not available: {e}") from e
    by = {t.name: t.type for t in plan.tensors}
    missing = [s.name for s in specs if s.name not in by]
    if missing:
        raise PlanError(f"plan lacks GGUF tensors {missing[:3]} ({len(missing)} in all)")
    return [by[s.name] for s in specs]


def assign_types(ckpt, specs, *, qtype=None, bpw=None, size=None, tensor_type=(), output_tensor_type=None,
                 token_embedding_type=None, include_mtp=True, gguf_ladder="k") -> list[str]:
    """Per-GGUF-tensor ggml types, llama-quantize order: (plan or pure policy) -> embed/output -> regex overrides."""
    if sum(v is not None for v in (qtype, bpw, size)) != 1:
        raise InputError("give exactly one of --type, --bpw, --size")
    if qtype is not None and qtype.upper() in PURE_FLOAT:
        types = _pure_types(specs, qtype.upper())
    else:
        types = _planned_types(ckpt, specs, qtype=qtype, bpw=bpw, size=size, include_mtp=include_mtp,
                               gguf_ladder=gguf_ladder)
    rx = []
    for item in tensor_type:
        if isinstance(item, str):
            if "=" not in item:
                raise InputError(f"--tensor-type {item!r}: expected REGEX=TYPE")
            item = tuple(item.rsplit("=", 1))
        pat, t = item
        try:
            rx.append((re.compile(pat), t.upper()))
        except re.error as e:
            raise InputError(f"--tensor-type {pat!r}: bad regex ({e})") from e
    for i, s in enumerate(specs):
        if s.policy in ("f32", "keep") or len(s.shape) < 2:
            continue  # never quantized by llama-quantize (not quantizable / glm5-next exclusions)
        want = None
        if s.name == "output.weight" and output_tensor_type:
            want = output_tensor_type.upper()
        elif s.name == "token_embd.weight" and token_embedding_type:
            want = token_embedding_type.upper()
        else:
            want = next((t for r, t in rx if r.search(s.name)), None)
        if want:
            types[i] = fallback_type(want, s.shape[-1])
    return types


def convert_gguf(model, out, *, qtype: str | None = None, bpw: float | None = None, size: int | str | None = None,
                 imatrix=None, tensor_type=(), output_tensor_type: str | None = None,
                 token_embedding_type: str | None = None, no_mtp: bool = False, shard_size: int | str = 0,
                 tokenizer_pre: str | None = None, chat_template: str | Path | None = None,
                 fix_chat_template: bool = False, mmproj: str | Path | None = None, mmproj_type: str = "F16",
                 gguf_ladder: str = "k", threads: int | None = None, progress: bool = True) -> dict:
    """Convert `model` (dir or hub id) to the GGUF `out` (.gguf). Returns a summary dict (files, types, bytes).

    `gguf_ladder` ("k" | "iq") picks the planner's candidate types for --bpw/--size mixes. `threads` worker
    processes encode the tensors (convert/gguf_workers; default os.cpu_count(), 1 = in this process); the
    bytes do not depend on it."""
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.checkpoint_check import scan_finite, validate_checkpoint
    from mixq.formats.gguf_names import build_tensor, gguf_tensors
    from mixq.formats.gguf_tokenizer import add_tokenizer, tokenizer_metadata
    from mixq.formats.gguf_writer import TensorOut, glm5next_kv, write_gguf

    n_threads = _thread_count(threads)
    ckpt = open_checkpoint(model)
    validate_checkpoint(ckpt)  # config vs weights, before anything is planned or written
    if mmproj is not None:  # the projector file is written after the model: check its weights before either
        scan_finite(ckpt, [n for n in ckpt.names() if ckpt.info(n).role == "vision"], progress=progress)
    include_mtp = not no_mtp
    specs = gguf_tensors(ckpt, include_mtp=include_mtp)
    if isinstance(size, str):
        size = parse_size(size)
    types = assign_types(ckpt, specs, qtype=qtype, bpw=bpw, size=size, tensor_type=tensor_type,
                         output_tensor_type=output_tensor_type, token_embedding_type=token_embedding_type,
                         include_mtp=include_mtp, gguf_ladder=gguf_ladder)
    imx = None
    if imatrix is not None:
        from mixq.formats.imatrix_file import IMatrix, read_imatrix

        imx = (imatrix if isinstance(imatrix, IMatrix) else read_imatrix(imatrix)).means()
    for s, t in zip(specs, types):  # fail before writing anything, naming the first such tensor
        if t in NEEDS_IMATRIX and s.name not in ("token_embd.weight", "output.weight") \
                and (imx is None or imx.get(s.name) is None):
            why = "the imatrix has no entry for it" if imx is not None else "no --imatrix given"
            raise InputError(f"{s.name}: {t} needs an importance matrix ({why}; llama-quantize refuses it too); "
                             "make one with `mixq imatrix`")
    outs = [TensorOut(s.name, tuple(s.shape), t) for s, t in zip(specs, types)]
    by_name = {s.name: s for s in specs}

    def load(name: str) -> tuple[np.ndarray, np.ndarray | None]:
        spec, qt = by_name[name], qtypes[name]
        x = build_tensor(spec, ckpt.get).numpy()
        w = None if imx is None or qt in PURE_FLOAT else imx.get(name)
        if w is not None and w.size != (x.shape[0] if x.ndim == 3 else 1) * x.shape[-1]:
            raise InputError(f"imatrix entry {name} has {w.size} values, tensor needs "
                             f"{(x.shape[0] if x.ndim == 3 else 1) * x.shape[-1]}")
        return x, w

    qtypes = {t.name: t.qtype for t in outs}
    items = [(t.name, t.qtype, f"{by_name[t.name].hf_names[0]} -> {t.name} ({t.qtype})") for t in outs]
    with TensorEncoder(items, load, threads=n_threads) as enc:
        enc.start()  # workers spawn and build their code tables while the tokenizer and metadata are read
        n_vocab = ckpt.shape(next(s for s in specs if s.name == "token_embd.weight").hf_names[0])[0]
        tmeta = tokenizer_metadata(ckpt.path, n_vocab, tokenizer_pre)
        tmpl_report = None
        if chat_template is not None and not Path(chat_template).is_file():
            raise InputError(f"{chat_template}: no such chat template file")
        tmpl = Path(chat_template).read_text(encoding="utf-8") if chat_template is not None else tmeta.chat_template
        if tmpl:
            from mixq.formats.chat_template import prepare_template

            tmpl_report = prepare_template(tmpl, fix=fix_chat_template)
            tmpl = tmpl_report.pop("template")
        label = qtype.upper() if qtype else None
        kv = glm5next_kv(ckpt, include_mtp=include_mtp, file_type=label)
        if imx is not None:
            from mixq.formats.gguf_writer import KV

            kv += [KV("quantize.imatrix.file", "STRING", str(imatrix) if isinstance(imatrix, (str, Path)) else "mixq"),
                   KV("quantize.imatrix.entries_count", "UINT32", len(imx))]
        files = write_gguf(out, kv, outs, lambda t: enc.get(t.name), tokenizer=lambda w: add_tokenizer(w, tmeta, tmpl),
                           shard_size=parse_size(shard_size) if isinstance(shard_size, str) else int(shard_size or 0),
                           progress=progress)
    mm = None
    if mmproj is not None:
        from mixq.formats.mmproj import write_mmproj

        mm = write_mmproj(model, mmproj, mmproj_type, progress=progress)
    counts: dict[str, int] = {}
    for t in outs:
        counts[t.qtype] = counts.get(t.qtype, 0) + 1
    total = sum(t.nbytes for t in outs)
    params = sum(int(np.prod(t.shape)) for t in outs)
    return {"files": [str(f) for f in files], "tensors": len(outs), "types": counts, "bytes": total,
            "bpw": 8.0 * total / max(params, 1), "tokenizer_pre": tmeta.pre, "mtp": include_mtp,
            "chat_template": tmpl_report, "mmproj": mm, "threads": n_threads}


def _thread_count(threads: int | None) -> int:
    """Worker processes for the encoders: `threads`, or every core this process may run on when None."""
    if threads is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):  # not Linux
            return max(1, os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InputError(f"--threads {threads!r}: expected a positive whole number")
    return threads


def collect_imatrix(model, calibration=None, *, rows: int = 64, seq_len: int = 512, device: str | None = None,
                    datasets: list[str] | None = None, progress: bool = True):
    """Importance matrix of `model` from a calibration forward (convert/calibration, layer by layer), keyed by
    GGUF tensor name as llama-imatrix keys it: Σx² per input column and the row count, one vector per expert
    for `*_exps`. Differences to llama-imatrix: every calibration token passes through every routed expert
    (so expert counts equal the token count, none is left at 0), and output.weight is always included.
    Tensors whose inputs the forward never forms (NextN block, attn_k_b/v_b) get no entry, as in llama-imatrix."""
    from tqdm import tqdm

    from mixq.convert.calibration import LayerCalibrator, calibration_rows, load_tokenizer
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.formats.checkpoint_check import validate_checkpoint
    from mixq.formats.gguf_names import gguf_tensors
    from mixq.formats.imatrix_file import IMatrix

    ckpt = open_checkpoint(model)
    validate_checkpoint(ckpt)
    dev = pick_device(device)
    ids = calibration_rows(load_tokenizer(ckpt.path), calibration, rows=rows, seq_len=seq_len,
                           vocab_size=int(ckpt.text_config["vocab_size"]))
    specs = [s for s in gguf_tensors(ckpt, include_mtp=False)
             if len(s.shape) >= 2 and s.transform in ("none", "stack") and s.name != "token_embd.weight"]
    by_hf: dict[str, list] = {}
    for s in specs:
        for e, h in enumerate(s.hf_names):
            by_hf.setdefault(h, []).append((s, e))
    im = IMatrix(datasets=list(datasets or [str(c) for c in (calibration or ["builtin"])]),
                 chunk_count=int(ids.shape[0]), chunk_size=int(ids.shape[1]))
    pending: dict[str, dict[int, tuple]] = {}
    cal = LayerCalibrator(ckpt, ids, device=dev, full=False)
    for stage in tqdm(cal.stages(), total=ckpt.num_hidden_layers + 1, desc="imatrix", disable=not progress):
        for hf, acc in stage.stats.items():
            for s, e in by_hf.get(hf, []):
                if acc.count == 0 or acc.dim != s.shape[-1]:
                    continue
                pending.setdefault(s.name, {})[e] = (acc.sum_sq.cpu().numpy(), acc.count)
    for s in specs:
        got = pending.get(s.name)
        if not got or len(got) != len(s.hf_names):
            continue
        im.add(s.name, np.stack([got[e][0] for e in range(len(s.hf_names))]),
               np.array([got[e][1] for e in range(len(s.hf_names))], dtype=np.float64))
    return im


def make_imatrix(model, out, calibration=None, *, rows: int = 64, seq_len: int = 512, device: str | None = None,
                 progress: bool = True) -> dict:
    """Collect an importance matrix (`collect_imatrix`) and write it in llama.cpp's GGUF imatrix format."""
    from mixq.formats.imatrix_file import write_imatrix

    im = collect_imatrix(model, calibration, rows=rows, seq_len=seq_len, device=device, progress=progress)
    path = write_imatrix(out, im)
    return {"file": str(path), "entries": len(im.sums), "chunks": im.chunk_count, "chunk_size": im.chunk_size,
            "datasets": im.datasets}


