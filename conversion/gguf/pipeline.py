"""Convert a glm5_next checkpoint to a glm5-next GGUF, in named steps: resolve the options -> validate the checkpoint
and the outputs -> plan the types -> encode tensor by tensor and write (shards) -> ConvertResult.

`run_gguf(model, out, GGUFOptions(...))` (or `convert_gguf(model, out, qtype=... | bpw=... | size=..., ...)`):
- tensor list and transforms: formats/gguf_names; per-tensor ggml types: the plan (planning/planner)
  for mixes, or the converter's pure policy for F32/F16/BF16 (F32 pins per formats/glm5next);
- llama-quantize options on GGUF names: `tensor_type` [(regex, TYPE)] (first match wins), `output_tensor_type`,
  `token_embedding_type`; never-quantized tensors (policy f32/keep) are left alone, as llama-quantize does; a rule
  that decides no tensor (matches nothing, only never-quantized tensors, or only tensors an earlier rule decides)
  is an InputError, as are an imatrix naming no tensor of the model and i-quants without importance data;
- the chat template (--chat-template, else the model's own) is linted with jinja2 before anything is written;
- encoders: mixq.quant.ggml.encoders (bit-exact ggml), falling back to gguf-py for types it lacks, run on `threads`
  worker processes by conversion/gguf/workers (row blocks / expert slices; same bytes as one process);
- the checkpoint is read lazily, one GGUF tensor at a time; output written under temp names, renamed at the end;
- --size is an upper bound of the file(s) on disk: the real header is measured and the plan redone when the
  estimate would pass it (`_fit_size`); every file carries its receipt (`mixq.receipt.*`, conversion/gguf/receipt.py);
- `run_gguf(..., cache=EncodeCache)` (a family, conversion/gguf/family.py): encodings served from and stored in the cache,
  the bytes unchanged.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from mixq.errors import InputError, PlanError
from mixq.formats import mmproj  # mmproj.write_mmproj looked up per call (tests replace it)
from mixq.formats.chat_template import model_template, prepare_template
from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.checkpoint_check import scan_finite, validate_checkpoint
from mixq.formats.gguf_layout import FLOAT_TYPES, tensor_bytes
from mixq.formats.gguf_names import TOKEN_EMBD, build_tensor, gguf_tensors
from mixq.formats.gguf_tokenizer import add_tokenizer, tokenizer_metadata
from mixq.formats.gguf_writer import KV, TensorOut, gguf_file_nbytes, glm5next_kv, output_set, write_gguf
from mixq.formats.imatrix_file import IMatrix, check_names, read_imatrix
from mixq.formats.receipt import receipt_kv
from mixq.planning.sizes import parse_size  # one size convention: GB = 10^9, GiB = 2^30
from mixq.planning import gguf_mix
from mixq.planning.gguf import gguf_metadata_bytes, gguf_mix_context
from mixq.planning.gguf_assign import assign_types
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS
from mixq.measurement.encode_cache import EncodeCache
from mixq.conversion.gguf.receipt import conversion_receipt
from mixq.conversion.gguf.rounding import expert_slice, hessian_rounded
from mixq.conversion.gguf.tuning import BYTES_PER_TUNED_WEIGHT
from mixq.conversion.gguf.workers import TASK_WEIGHTS
from mixq.conversion.gguf.workers import TensorEncoder, encode  # noqa: F401  (encode: public here since the start)
from mixq.conversion.gguf.imatrix import collect_imatrix, make_imatrix  # noqa: F401  (re-exported)
from mixq.conversion.job import rss_peak_mib
from mixq.measurement.trellis import MEASURE_MODES, load_curves
from mixq.conversion.options import GGUFOptions, options_for
from mixq.formats.outputs import (check_distinct, check_free_space, check_output_file, gguf_partials_lock,
                                  writing)
from mixq.conversion.result import ConvertResult
from mixq.quant.device import pick_device, resolve_device
from mixq.quant.ggml.torch_encoders import chunk_weights
from mixq.runtime import profile
from mixq.runtime.memory_budget import (MemoryBudget, MemoryEstimate, announce, calibration_resident,
                                        checkpoint_shapes, expert_group, gguf_estimate, resolve_budget, say)

METADATA_ROOM = 64 * 2**20  # free space kept for the header, tokenizer and alignment beyond the tensor data
# --size: re-plans with the measured header overshoot taken off the budget; the receipt's type counts move the
# header by a few bytes per round, so two rounds suffice in practice
FIT_ROUNDS = 4



def convert_gguf(model, out, **options) -> dict:
    """Convert `model` (dir or hub id) to the GGUF `out` (.gguf); keyword options as in `GGUFOptions` (`no_mtp`
    is accepted for include_mtp=False). Returns the summary dict (`ConvertResult.to_dict()`: files, types,
    bytes, ...). `threads` worker processes encode the tensors (default: every core); the bytes do not depend
    on it."""
    return run_gguf(model, out, options_for("gguf", **options)).to_dict()


def run_gguf(model, out, opts: GGUFOptions, cache: EncodeCache | None = None) -> ConvertResult:
    """resolve -> validate -> plan -> encode and write (then the --mmproj file) -> result. Every check that can
    fail on the user's input runs before the first byte is written. `cache` (a family's, conversion/gguf/family.py):
    encoded tensors are served from it and new encodings stored in it; the bytes are those of a run without."""
    t0 = time.time()
    with profile.stage("open"):
        run = _resolve(model, out, opts)
        run.cache = cache
        _validate(run)
    _memory(run)
    with profile.stage("plan"):
        _plan(run)
    if opts.progress:  # after every check of the input: a refusal stays the one line on stderr
        say(run.pieces, "convert")
    mm_out = Path(opts.mmproj) if opts.mmproj is not None else None
    with gguf_partials_lock(run.out, mm_out), writing(run.out, *([mm_out] if mm_out else [])):
        files = _write(run)
        mm = None
        if mm_out is not None:
            try:
                with profile.stage("mmproj", "vision"):
                    mm = mmproj.write_mmproj(model, mm_out, opts.mmproj_type, progress=opts.progress,
                                             overwrite=opts.overwrite)
            except BaseException:  # the conversion asked for both files: a model file alone is not its output
                for f in files:
                    f.unlink(missing_ok=True)
                raise
    return _result(run, files, mm, t0)


@dataclass
class _GGUFRun:
    """The state one conversion's steps share."""
    opts: GGUFOptions
    ckpt: object
    out: Path
    specs: list
    threads: int
    size: int | None
    template: str | list | None  # --chat-template text; after _validate, the template to embed (None: none)
    device: str | None = None  # an accelerator that encodes; None: CPU worker processes
    imx: dict | None = None
    imatrix_obj: object | None = None  # the IMatrix read for --imatrix (its datasets and chunks go to the receipt)
    types: list[str] = field(default_factory=list)
    tokenizer_pre: str | None = None
    template_report: dict | None = None
    cache: EncodeCache | None = None  # a family's encode cache; None: every tensor encoded here
    tmeta: object | None = None       # tokenizer metadata, read once (the --size fit measures the header with it)
    budget: MemoryBudget | None = None  # --gpu-memory on the device that works (runtime/memory_budget.py)
    memory: dict | None = None          # the up-front estimate, as the result reports it
    pieces: MemoryEstimate | None = None


def _resolve(model, out, opts: GGUFOptions) -> _GGUFRun:
    """Open the checkpoint, check it against its config, list the GGUF tensors, read the --chat-template text,
    count the encoder processes."""
    device = _encode_device(opts)
    threads = 1 if device is not None else _thread_count(opts.threads)
    ckpt = open_checkpoint(model)
    profile.note_layers(ckpt.config)
    profile.note_device(device or "cpu")
    # config vs weights first: a missing or misshapen tensor is named as the checkpoint spells it, not by the
    # GGUF tensor (an expert stack, a kv_b half) it would have gone into
    validate_checkpoint(ckpt)
    specs = gguf_tensors(ckpt, include_mtp=opts.include_mtp)
    size = parse_size(opts.size) if opts.size is not None else None
    return _GGUFRun(opts, ckpt, Path(out), specs, threads, size, _read_template(opts.chat_template), device)


def _encode_device(opts: GGUFOptions) -> str | None:
    """Where the quantized types are encoded: --device, else CUDA when present unless --threads asks for CPU
    worker processes. None: the CPU worker processes."""
    if opts.device is None and opts.threads is not None:
        return None
    dev = resolve_device(opts.device)
    if dev.type != "cpu" and opts.threads is not None:
        raise InputError(f"--threads applies to CPU encoding, not to --device {opts.device}")
    return None if dev.type == "cpu" else str(dev)


def _read_template(path) -> str | None:
    """The --chat-template file as text: one line naming the file when it is missing or not UTF-8 text."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such chat template file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not a text (UTF-8) chat template file (byte {e.start} is {e.object[e.start]:#04x})") \
            from None
    if "\x00" in text:
        raise InputError(f"{p}: not a text chat template file (it holds NUL bytes)")
    return text


def _validate(run: _GGUFRun) -> None:
    """The outputs can be written, replace no input and no existing file (the checkpoint was checked against its
    config when it was opened)."""
    o = run.opts
    _check_template(run)
    imatrix_path = o.imatrix if isinstance(o.imatrix, (str, Path)) else None
    check_distinct({"OUT": run.out, "--mmproj": o.mmproj},
                   {"MODEL": Path(run.ckpt.path), "--imatrix": imatrix_path, "--chat-template": o.chat_template})
    check_output_file(run.out, overwrite=o.overwrite, suffix=".gguf")
    if not o.overwrite:
        splits = [p for p in output_set(run.out) if p != run.out]
        if splits:
            raise InputError(f"OUT {run.out}: the split file {splits[0]} already exists; pass --overwrite to "
                             "replace it")
    if o.mmproj is not None:
        check_output_file(o.mmproj, overwrite=o.overwrite, label="--mmproj", suffix=".gguf")
        # the projector file is written after the model: check its inputs and weights before either
        mmproj.check_mmproj(run.ckpt, o.mmproj_type, f"--mmproj {o.mmproj}")
        scan_finite(run.ckpt, run.ckpt.vision_names(), progress=o.progress)


def _check_template(run: _GGUFRun) -> None:
    """Lint, check (and with --fix-chat-template, repair) the template to embed: --chat-template, else the model's
    own; a template jinja2 rejects is refused here, naming its file, instead of being embedded."""
    o = run.opts
    if run.template is not None:
        tmpl, where = run.template, str(o.chat_template)
        if not tmpl.strip():  # an empty file would embed nothing and drop the model's own template
            raise InputError(f"{where}: empty chat template file")
    else:
        tmpl, where = model_template(run.ckpt.path)
    run.template, run.template_report = None, None
    if tmpl:
        run.template_report = prepare_template(tmpl, fix=o.fix_chat_template, where=where)
        run.template = run.template_report.pop("template")


def _plan(run: _GGUFRun) -> None:
    """Every tensor's ggml type; the importance data they need; the room they take on disk."""
    o = run.opts
    run.types = _assign(run, run.size)
    if o.imatrix is not None:
        im = o.imatrix if isinstance(o.imatrix, IMatrix) else read_imatrix(o.imatrix)
        check_names(im, [s.name for s in run.specs],
                    f"--imatrix {o.imatrix}" if isinstance(o.imatrix, (str, Path)) else "--imatrix")
        run.imx = im.means()
        run.imatrix_obj = im
    _fit_size(run)
    for s, t in zip(run.specs, run.types):  # fail before writing anything, naming the first such tensor
        if gguf_mix.requires_imatrix(t, s.name, o.qtype) and (run.imx is None or run.imx.get(s.name) is None):
            why = "the imatrix has no entry for it" if run.imx is not None else "no --imatrix given"
            raise InputError(f"{s.name}: {t} needs an importance matrix ({why}; llama-quantize refuses it too); "
                             "make one with `mixq imatrix`")
    need = sum(tensor_bytes(t, s.shape) for s, t in zip(run.specs, run.types)) + METADATA_ROOM
    if o.rounding == "hessian":  # the rounded tensors are spilled next to OUT before the file is written
        need *= 2
    if o.mmproj is not None:
        need += sum(run.ckpt.nbytes(n) for n in run.ckpt.vision_names())
    check_free_space(run.out, need, "the GGUF output")


def _memory(run: _GGUFRun) -> None:
    """The device and host memory the conversion needs, said on stderr before any work, and the pieces that keep
    every stage within --gpu-memory (runtime/memory_budget.py); a budget the smallest piece of a stage cannot
    meet is refused here."""
    o = run.opts
    hessian = o.rounding == "hessian"
    device = pick_device(o.device) if hessian else torch.device(run.device or "cpu")
    run.budget = resolve_budget(o.gpu_memory, device)
    encode_default = chunk_weights("Q4_K", device) if run.device is not None else None
    workers = run.threads if run.device is None and run.threads > 1 else 0
    est = gguf_estimate(run.budget, checkpoint_shapes(run.ckpt), hessian=hessian, rows=o.rows, seq_len=o.seq_len,
                        tune=o.tune_iters > 0, tune_bytes_per_weight=BYTES_PER_TUNED_WEIGHT,
                        rounding_default=_rounding_default(run), encode_default=encode_default,
                        largest_tensor=max(math.prod(s.shape) for s in run.specs), host_workers=workers,
                        task_weights=TASK_WEIGHTS)
    run.memory = announce(est, "convert", show=False)
    run.pieces = est


def _rounding_default(run: _GGUFRun) -> int:
    """Routed experts per Hessian-rounding call without a budget, for the largest stack."""
    stacks = [s for s in run.specs if s.transform == "stack"]
    if not stacks:
        return 1
    s = max(stacks, key=lambda s: math.prod(s.shape[-2:]))
    return min(s.shape[0], expert_slice(s.shape[-2], s.shape[-1], pick_device(run.opts.device)))


def _assign(run: _GGUFRun, size: int | None) -> list[str]:
    """The ggml types of run.specs for the options, to `size` bytes when the target is a size."""
    o = run.opts
    return assign_types(run.ckpt, run.specs, qtype=o.qtype, bpw=o.bpw, size=size,
                        tensor_type=o.tensor_type, output_tensor_type=o.output_tensor_type,
                        token_embedding_type=o.token_embedding_type, include_mtp=o.include_mtp,
                        gguf_ladder=o.gguf_ladder or gguf_mix.DEFAULT_LADDER, overrides=o.overrides,
                        head_bits=DEFAULT_HEAD_BITS if o.head_bits is None else o.head_bits,
                        mtp_bits=DEFAULT_MTP_BITS if o.mtp_bits is None else o.mtp_bits, measure=_curves(o.measure),
                        imatrix_given=o.imatrix is not None, pin=o.pin, pin_size=run.size)


def _fit_size(run: _GGUFRun) -> None:
    """--size: the file(s) as they will be written (tokenizer, chat template, receipt, seal placeholders, tensor
    infos, alignment: measured, gguf_writer.gguf_file_nbytes) at or below the target. The planner estimates the
    header; when the real file would be larger, the plan is made again with the estimate's error taken off its
    budget. A plan that already fits is kept as it is."""
    if run.size is None:
        return
    kv_estimate = gguf_metadata_bytes(run.ckpt, gguf_mix_context(run.ckpt, run.opts.include_mtp).n_layer_all)
    asked = run.size
    for _ in range(FIT_ROUNDS):
        kv, tokenizer, outs = _metadata(run)
        real = gguf_file_nbytes(kv, outs, tokenizer=tokenizer, shard_size=_shard_bytes(run.opts))
        if real <= run.size:
            return
        estimate, _ = gguf_mix.gguf_file_bytes([(t.name, t.shape, t.qtype) for t in outs], kv_estimate)
        # the planner fills its budget up to its own estimate: take the estimate's error off the budget (and at
        # least the overshoot, should the error be negative)
        asked = min(asked - (real - run.size), run.size - (real - estimate))
        run.types = _assign(run, asked)
    raise PlanError(f"--size {run.opts.size}: no plan keeps the file at or below {run.size:,} bytes "
                    f"(the last one is {real:,})")


def _shard_bytes(o: GGUFOptions) -> int:
    return 0 if o.shard_size in (0, "0", None) else parse_size(o.shard_size)


def _curves(measure):
    """--measure for GGUF: a curves mapping as given, or the JSON file `mixq plan --measure-out` wrote."""
    if measure is None or isinstance(measure, Mapping):
        return measure
    if str(measure) in MEASURE_MODES:
        raise InputError(f"--measure {measure}: one GGUF file is planned from curves measured before it (`mixq plan "
                         "MODEL --format gguf --measure --measure-out CURVES.json`, then --measure CURVES.json); "
                         "a family (--size A,B,C) measures its own with --measure stream (or kld)")
    return load_curves(measure)


def _write(run: _GGUFRun) -> list[Path]:
    """Encode every tensor (worker processes) and stream the file(s): metadata, tokenizer, tensor data."""
    o, ckpt, imx = run.opts, run.ckpt, run.imx
    by_name = {s.name: s for s in run.specs}
    qtypes = {s.name: t for s, t in zip(run.specs, run.types)}

    def load(name: str) -> tuple[np.ndarray, np.ndarray | None]:
        x = build_tensor(by_name[name], ckpt.get).numpy()
        w = None if imx is None or qtypes[name] in FLOAT_TYPES else imx.get(name)
        if w is not None and w.size != (x.shape[0] if x.ndim == 3 else 1) * x.shape[-1]:
            raise InputError(f"imatrix entry {name} has {w.size} values, tensor needs "
                             f"{(x.shape[0] if x.ndim == 3 else 1) * x.shape[-1]}")
        return x, w

    outs = [TensorOut(s.name, tuple(s.shape), t) for s, t in zip(run.specs, run.types)]
    items = [(t.name, t.qtype, f"{by_name[t.name].hf_names[0]} -> {t.name} ({t.qtype})") for t in outs]
    last = outs[-1].name if outs else None
    n_layers = ckpt.num_hidden_layers
    with _rounded(run, load) as pre, profile.Switch() as switch:
        keys, cached = _cache_keys(run, outs, pre, load)
        piece = run.pieces.stage("gguf_encode") if run.pieces is not None else None
        with TensorEncoder([i for i in items if i[0] not in pre and i[0] not in cached], load,
                           threads=run.threads, device=run.device,
                           chunk=piece.piece if piece is not None and run.budget.given else None) as enc:
            enc.start()  # workers spawn and build their code tables while the tokenizer and metadata are read
            kv, tokenizer, outs = _metadata(run)

            def produce(t: TensorOut) -> np.ndarray:
                # the encode (or wait for the workers) and write of each layer's tensors; after the last, the seal
                switch("encode", _profile_layer(by_name[t.name], n_layers))
                try:
                    return _produce(t)
                finally:
                    if t.name == last:
                        switch("seal")

            def _produce(t: TensorOut) -> np.ndarray:
                if t.name in pre:
                    return pre[t.name]()
                if t.name in cached:  # the cache's bytes are those the encoder gives (content-addressed key)
                    return run.cache.get(keys[t.name])
                data = enc.get(t.name)
                if t.name in keys:
                    run.cache.put(keys[t.name], data)
                return data

            files = write_gguf(run.out, kv, outs, produce, tokenizer=tokenizer, shard_size=_shard_bytes(o),
                               progress=o.progress, overwrite=o.overwrite)
    return files


def _profile_layer(spec, n_layers: int) -> str:
    """A GGUF tensor's layer as the profile names it: a decoder layer's index, "nextn", "embed" or "head"."""
    if spec.layer is not None:
        return profile.layer_label(spec.layer, n_layers)
    return "embed" if spec.role == "embed" else "head"


def _cache_keys(run: _GGUFRun, outs: list, pre, load) -> tuple[dict[str, str], set[str]]:
    """With a family's cache: the key of every tensor ggml's encoders make (casts to F32/F16/BF16 and Hessian-
    rounded tensors excepted), and the names whose entry is already stored."""
    if run.cache is None:
        return {}, set()
    src = str(run.ckpt.path)
    keys = {t.name: run.cache.key(src, t.name, t.qtype, t.shape, lambda n=t.name: load(n))
            for t in outs if t.name not in pre and t.qtype not in FLOAT_TYPES}
    return keys, {n for n, k in keys.items() if run.cache.has(k)}


def _metadata(run: _GGUFRun):
    """(KVs, tokenizer adder, tensor list) of the file to write: the model's keys, the imatrix keys, the receipt
    (formats/receipt), and the tokenizer with the prepared chat template; the tokenizer is read once per run."""
    o, ckpt, imx = run.opts, run.ckpt, run.imx
    if run.tmeta is None:
        n_vocab = ckpt.shape(next(s for s in run.specs if s.name == TOKEN_EMBD).hf_names[0])[0]
        run.tmeta = tokenizer_metadata(ckpt.path, n_vocab, o.tokenizer_pre)
    tmeta = run.tmeta
    run.tokenizer_pre = tmeta.pre
    tmpl = run.template  # linted and prepared by _validate (the model's own when no --chat-template)
    kv = glm5next_kv(ckpt, include_mtp=o.include_mtp, file_type=o.qtype)
    if imx is not None:
        kv += [KV("quantize.imatrix.file", "STRING",
                  str(o.imatrix) if isinstance(o.imatrix, (str, Path)) else "mixq"),
               KV("quantize.imatrix.entries_count", "UINT32", len(imx))]
    kv += receipt_kv(conversion_receipt(run))
    outs = [TensorOut(s.name, tuple(s.shape), t) for s, t in zip(run.specs, run.types)]
    return kv, (lambda w: add_tokenizer(w, tmeta, tmpl)), outs


def _rounded(run: _GGUFRun, load):
    """--rounding hessian: a context holding loaders of the tensors Hessian rounding encodes (its calibration pass
    runs on entry, conversion/gguf/rounding.py; a family's cache serves the codes another member rounded, `load`
    giving their keys); exact: an empty mapping, every tensor goes to ggml's encoders."""
    o = run.opts
    if o.rounding != "hessian":
        return contextlib.nullcontext({})
    return hessian_rounded(run.ckpt, run.specs, run.types, run.out, imatrix=run.imx,
                           calibration=list(o.calibration) or None, rows=o.rows, seq_len=o.seq_len,
                           tune_iters=o.tune_iters, tune_group_iters=o.tune_group_iters,
                           refine_passes=o.refine_passes, device=o.device,
                           progress=o.progress, cache=run.cache, load=load, budget=_stage_budget(run),
                           expert_group=None if run.pieces is None or run.pieces.stage("calibration") is None
                           else expert_group(run.pieces.stage("calibration")))


def _stage_budget(run: _GGUFRun) -> MemoryBudget | None:
    """The budget the rounding and tuning pieces share: --gpu-memory less what the calibration keeps resident."""
    if run.budget is None or run.pieces is None:
        return None
    cal = run.pieces.stage("calibration")
    return run.budget.less(calibration_resident(cal) if cal is not None else 0)


def _result(run: _GGUFRun, files: list[Path], mm: dict | None, t0: float) -> ConvertResult:
    counts: dict[str, int] = {}
    for t in run.types:
        counts[t] = counts.get(t, 0) + 1
    total = sum(tensor_bytes(t, s.shape) for s, t in zip(run.specs, run.types))
    params = sum(int(np.prod(s.shape)) for s in run.specs)
    return ConvertResult(format="gguf", out=str(files[0]), files=[str(f) for f in files], bytes=total,
                         bpw=8.0 * total / max(params, 1), tensors=len(run.specs), seconds=time.time() - t0,
                         peak_rss_mib=rss_peak_mib(), types=counts, tokenizer_pre=run.tokenizer_pre,
                         mtp=run.opts.include_mtp, chat_template=run.template_report, mmproj=mm,
                         threads=run.threads, device=run.device or "cpu", ref_params=run.ckpt.params,
                         memory=run.memory)


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
