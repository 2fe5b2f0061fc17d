"""`evaluate`: KLD / top-1 / PPL of candidates against the reference model.

Four steps: resolve (paths, windows, weight sources) -> validate (every candidate against the reference, before
any forward) -> forward (the reference and every torch candidate layer by layer over all windows,
eval/streamed.py) -> finalize (logits window by window, statistics, the reference log-prob file, the report).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from mixq.runtime.dequant import CheckpointSource, DequantSource
from mixq.runtime.distributed import RankContext, launch, needs_launch, parse_devices, rank_context
from mixq.formats.outputs import check_outputs
from mixq.errors import FormatError, InputError, escape
from mixq.formats.atomic import write_text
from mixq.eval import candidates as cands
from mixq.eval.family import expand_families, record_scores
from mixq.eval import exllamav3_engine
from mixq.runtime import profile
from mixq.eval import generated as gen
from mixq.eval import mtp as mtp_head
from mixq.runtime import reference as refm
from mixq.eval.llamacpp import LlamaCppScorer
from mixq.eval.peak_memory import peak_gpu_mib, peak_rss_mib, reset_peaks
from mixq.eval.reflogits import RefLogitsReader, RefLogitsWriter, roundtrip
from mixq.eval.report import render_markdown
from mixq.runtime.kl_stats import ROW_CHUNK, KLAccumulator, log_probs, token_quantities
from mixq.runtime.memory_budget import announce, checkpoint_shapes, eval_estimate, expert_group, resolve_budget
from mixq.eval.streamed import StreamedModel, StreamedModels, state_bytes
from mixq.eval.window_split import gather_in_order, rank_window_ids
from mixq.eval.options import DEFAULT_CTX, SAVE_REF_ONE_DEVICE, EvalOptions
from mixq.planning.option_fields import default_of, flag_of, options_from
from mixq.formats.checkpoint_check import validate_checkpoint

# the candidates an engine other than torch scores itself (the others go through the torch engine)
ENGINE_FORMATS = {"llamacpp": "gguf", exllamav3_engine.ENGINE: exllamav3_engine.FORMAT}
GPU_STATE_SHARE = 0.5  # hidden streams go to the GPU when all of them take at most this share of its free memory


@dataclass
class EvalRun:
    """Everything `evaluate` resolved from its arguments."""

    ref_dir: Path
    config: dict
    ref: CheckpointSource
    device: torch.device
    windows: refm.Windows
    text_name: str
    candidates: list[cands.Candidate]
    sources: list[DequantSource | None]   # None: logits from the engine itself (llama.cpp GGUF, exllamav3 EXL3)
    reader: RefLogitsReader | None
    engine: str
    cache_type: str
    save_ref: Path | None
    ref_dtype: str
    state_dtype: str
    batch_windows: int
    ranks: RankContext = field(default_factory=RankContext)
    mine: list[int] = field(default_factory=list)  # this rank's windows (indices into `windows`)
    generated: dict | None = None  # a generated set: gen.summary of it (None: a text file)
    token_file: tuple[Path, str] | None = None  # a newly generated set: (where, its text), written with the report
    prompts: tuple[torch.Tensor, str | None] | None = None  # replies still to generate: (prompt ids, template file)
    memory: dict | None = None        # the up-front memory estimate (runtime/memory_budget.py)
    streams_on_device: bool | None = None  # --gpu-memory's choice of where the hidden streams live
    kl_rows: int = ROW_CHUNK          # rows of logits per KL pass (the budget's piece)
    expert_group: int | None = None   # routed experts per group on the device (None: the whole layer)

    @property
    def n_layers(self) -> int:
        return refm.num_hidden_layers(self.config)

    @property
    def local_tokens(self) -> torch.Tensor:
        """The token rows of this rank's windows."""
        t = self.windows.tokens
        return t if len(self.mine) == t.shape[0] else t[self.mine]


def evaluate(reference: str | Path, candidates: list[str | Path] = (), text: str | Path | None = None,
             options: EvalOptions | None = None, **kwargs) -> dict | None:
    """Score every candidate against `reference` (an HF checkpoint) on `text`, returning the report dict.

    `options`: an EvalOptions, or its fields as keywords (an unknown keyword is an InputError). Windows of `ctx`
    tokens are cut as llama-perplexity does and the second half of each (or all positions with score='all') is
    scored. With `ref_logits`, reference log-probs and tokens come from that file (no reference forward, no text
    needed); `save_ref` writes them for later runs. The models run layer by layer over all windows at once: peak
    memory is about one layer of the reference plus one of a candidate plus the hidden streams (`state_dtype`),
    independent of the number of layers. `batch_windows` > 1 runs several windows per layer call. `devices`
    ("0,1", "cpu,cpu"; or a torchrun launch): the windows dealt over one rank per device, the same numbers.
    `windows`: at most that many windows (the first ones); None or "all": every window of the text (or of the
    `ref_logits` file). The output files (`json_out`, `markdown_out`, `save_ref`) may not be an input or an
    existing file unless `overwrite`. Returns None on a rank other than 0 of a multi-device run.
    """
    o = options if options is not None else options_from(EvalOptions, kwargs, "eval")
    if options is not None and kwargs:
        raise InputError(f"give eval options as EvalOptions or as keywords, not both ({', '.join(sorted(kwargs))})")
    every = list(candidates)  # as given, for the worker ranks of a multi-device run
    candidates, families = expand_families(every)  # a family directory: its members, in the one forward
    text = gen.parse_text(text)
    save_generated = _check_generated(text, o)
    check_outputs({"--json": None if o.json_out == "-" else o.json_out, "--markdown": o.markdown_out,
                   "--save-ref": o.save_ref, "--save-generated": save_generated, "--profile": o.profile},
                  eval_inputs(reference, candidates, text, o.ref_logits, o.prompts), overwrite=o.overwrite)
    if needs_launch(o.devices):
        return launch(evaluate, (reference, every, text, o), o.devices)
    with profile.recording(o.profile, "eval", table=o.progress):
        return _evaluate(reference, candidates, text, o, families)


def _evaluate(reference, candidates: list, text, o: EvalOptions, families) -> dict | None:
    """`evaluate` after its outputs are checked, in this process (one rank of a multi-device run)."""
    with rank_context(o.devices, o.device) as ranks:
        with profile.stage("open"):
            run = _resolve(reference, candidates, text, o, ranks.device if ranks.world > 1 else o.device)
            _validate(run)
        profile.note_device(run.device)
        profile.note_layers(run.config)
        if run.prompts is not None:  # every input checked: now the replies, once
            with profile.stage("generate"):
                _generate(run, o)
        _split_windows(run, ranks)
        progress = o.progress and ranks.is_main
        _memory(run, o.gpu_memory, progress)
        if progress:
            tqdm.write(_announce(run, o.windows), file=sys.stderr)
        reset_peaks(run.device)
        models = _forward(run, progress)
        report = _finalize(run, models, progress)
        if report is None:
            return None  # a rank other than 0: rank 0 reports
        if o.mtp:
            _mtp(run, models, report)
        with profile.stage("write"):
            _write_outputs(report, o.json_out, o.markdown_out, run.token_file)
            record_scores(report, families)  # family.json and each member's <file>.receipt.json
        return report


# --- resolve -------------------------------------------------------------------------------------------------------
_GEN_FIELDS = ("gen_tokens", "gen_prompt_tokens", "gen_temperature", "gen_seed", "prompts", "save_generated")


def _check_generated(text, o: EvalOptions) -> Path | None:
    """The --text generated options, checked before any work: the generation settings apply to a generated set
    only, it needs --prompts, generates in one process and is scored on its continuations alone. Returns where
    the new token file goes (None: no generation, or no file asked for)."""
    new = isinstance(text, gen.GeneratedSpec)
    if not new:
        for name in _GEN_FIELDS:
            if getattr(o, name) != default_of(EvalOptions, name):
                raise InputError(f"{flag_of(EvalOptions, name)} applies to {gen.SPEC_HELP}")
        if not (text is not None and not o.ref_logits and gen.is_token_file(text)):
            return None
    if o.ref_logits:
        raise InputError(f"--text {text} with --ref-logits: the file's tokens are scored; give one of them")
    if o.ctx is not None:
        raise InputError(f"--ctx applies to text files; the windows of --text {text} are its sequences "
                         "(prompt + continuation)")
    if o.score != default_of(EvalOptions, "score"):
        raise InputError(f"--score {o.score}: --text {text} scores the continuation tokens only")
    if not new:
        return None
    if o.prompts is None:
        raise InputError(f"--text {text} needs --prompts FILE (held-out text the prompts are cut from)")
    if o.windows is not None and o.windows < text.count:
        raise InputError(f"--windows {o.windows} scores fewer than the {text.count} replies of --text {text}: give "
                         f"--windows {text.count} (or all), or ask for generated:{o.windows}")
    if len(parse_devices(o.devices or None)) > 1:
        raise InputError(f"--text {text} generates in one process: give one device (then score its token file, "
                         "--save-generated, on several)")
    return Path(o.save_generated) if o.save_generated else gen.default_token_file(o.json_out)


def eval_inputs(reference, candidates, text, ref_logits, prompts=None) -> dict[str, Path | None]:
    """Every file an evaluation reads, by label: the outputs may replace none of them (a GGUF split candidate
    with all its shards, a directory with every file in it)."""
    text = None if isinstance(text, gen.GeneratedSpec) else text
    inputs: dict[str, Path | None] = {"REFERENCE": Path(reference), "--text": Path(text) if text else None,
                                      "--ref-logits": Path(ref_logits) if ref_logits else None,
                                      "--prompts": Path(prompts) if prompts else None}
    for c in candidates:
        for p in cands.gguf_split_paths(Path(c)):
            inputs[f"CANDIDATE {p}"] = p
    return inputs


def _resolve(reference, candidates, text, o: EvalOptions, device: torch.device | None) -> EvalRun:
    """Open the reference and candidates (headers only) and cut the windows: the checks that need them (each
    option on its own was checked when `o` was built). `device`: this rank's, or `o.device`."""
    ctx, windows = o.ctx, o.windows
    if not candidates and not o.save_ref:
        raise InputError("give at least one CANDIDATE (or --save-ref to only store reference log-probs)")
    ref_dir = Path(reference)
    if not ref_dir.is_dir():
        raise InputError(f"{reference}: the reference must be an HF checkpoint directory")
    ref = CheckpointSource(ref_dir)
    validate_checkpoint(ref.ckpt)  # a reference whose config disagrees with its weights: refused
    dev = refm.pick_device(device)
    reader, win, text_name, tokenizer, generated, token_file = None, None, "", None, None, None
    if o.ref_logits:
        reader = RefLogitsReader(Path(o.ref_logits))
        if ctx is not None and ctx != reader.ctx:
            raise InputError(f"--ctx {ctx} differs from {o.ref_logits} (ctx {reader.ctx})")
        n = reader.count if windows is None else min(windows, reader.count)
        _check_context(reader.ctx, ref_dir, ref.ckpt.config, f"{o.ref_logits}'s windows of")
        reader.check_values(n)
        win = refm.Windows(tokens=reader.tokens[:n], first=reader.first)
        text_name = reader.meta.get("text", "")
    elif isinstance(text, gen.GeneratedSpec) or gen.is_token_file(text):
        tokenizer = refm.load_tokenizer(ref_dir)
        if isinstance(text, gen.GeneratedSpec):
            # the prompts now (their length sets the windows' the candidates are checked against), the replies
            # once every input has been checked (_generate)
            prompts = gen.prompt_ids(tokenizer, ref_dir, Path(o.prompts), text.count, o.gen_prompt_tokens)
            ctx = int(prompts[0].shape[1]) + o.gen_tokens
            text_name = str(text)
        else:
            doc = gen.read_token_file(Path(text), _vocab(ref.ckpt.config), ref_dir)
            generated = gen.summary(doc, Path(text), Path(text).read_bytes())
            text_name = str(text)
            win = gen.windows_of(doc, windows)
            ctx = win.ctx
        _check_context(ctx, ref_dir, ref.ckpt.config, f"--text {text_name}: sequences of")
    else:
        if text is None:
            raise InputError("--text is required unless --ref-logits is given")
        ctx = DEFAULT_CTX if ctx is None else ctx
        _check_context(ctx, ref_dir, ref.ckpt.config, "--ctx")
        tokenizer = refm.load_tokenizer(ref_dir)
        ids = refm.tokenize_text(tokenizer, Path(text), need_tokens=None if windows is None else windows * ctx)
        win = refm.make_windows(ids, ctx, windows, o.score, source=text)
        text_name = str(text)
    cand_list = [cands.open_candidate(c) for c in candidates]
    cache_type = _cache_type(o.cache_type, cand_list)
    ref_tokens = cands.reference_tokens(ref_dir, _vocab(ref.ckpt.config), tokenizer) if cand_list else None
    for c in cand_list:
        cands.check_candidate(c, ref_tokens, ref_dir, win.ctx if win is not None else ctx)
    n_layers = ref.ckpt.num_hidden_layers
    native = [ENGINE_FORMATS.get(o.engine) == c.format for c in cand_list]
    if o.engine == exllamav3_engine.ENGINE and any(native):
        exllamav3_engine.check_engine(dev)  # no exllamav3 or no CUDA: one error line before any forward
    sources = [None if own else cands.open_weights(c, n_layers, dev) for c, own in zip(cand_list, native)]
    return EvalRun(ref_dir, ref.ckpt.config, ref, dev, win, text_name, cand_list, sources, reader, o.engine,
                   cache_type, Path(o.save_ref) if o.save_ref else None, o.ref_dtype, o.state_dtype,
                   o.batch_windows, generated=generated, token_file=token_file,
                   prompts=prompts if isinstance(text, gen.GeneratedSpec) else None)


def _generate(run: EvalRun, o: EvalOptions) -> None:
    """The reference's replies to `run.prompts` (eval/generated.py): the run's windows, its token file (written
    with the report) and what the report says of them."""
    ids, template = run.prompts
    doc = gen.generate_set(run.ref_dir, run.ref.ckpt, ids, template, Path(o.prompts),
                           prompt_tokens=o.gen_prompt_tokens, tokens=o.gen_tokens, temperature=o.gen_temperature,
                           seed=o.gen_seed, device=run.device, progress=o.progress)
    where = Path(o.save_generated) if o.save_generated else gen.default_token_file(o.json_out)
    body = gen.token_file_text(doc)
    run.token_file = (where, body) if where else None
    run.generated = gen.summary(doc, where, body.encode("utf-8"))
    run.text_name = str(where or run.text_name)
    run.windows = gen.windows_of(doc, o.windows)
    run.prompts = None


def _check_context(ctx: int, ref_dir: Path, config: dict, what: str) -> None:
    """Windows no longer than the reference was built for (config.json's max_position_embeddings)."""
    limit = config.get("text_config", config).get("max_position_embeddings")
    if isinstance(limit, int) and ctx > limit:
        raise InputError(f"{what} {ctx} tokens: longer than {ref_dir}/config.json's max_position_embeddings {limit}")


def _cache_type(cache_type: str | None, candidates: list[cands.Candidate]) -> str:
    """The llama.cpp KV cache type (f32 unless given); refused where no candidate runs in llama.cpp, where it
    would change nothing (EvalOptions refused it under another engine)."""
    if cache_type is None:
        return "f32"
    if not any(c.format == ENGINE_FORMATS["llamacpp"] for c in candidates):
        raise InputError(f"--cache-type {cache_type} applies to GGUF candidates, and none is given")
    return cache_type


# --- validate ------------------------------------------------------------------------------------------------------
def _validate(run: EvalRun) -> None:
    """Every torch candidate holds the reference's text tensors with the reference's shapes; a reference log-prob
    file matches the reference's vocabulary. Nothing has run yet."""
    ref_shapes = run.ref.shapes()
    for c, src in zip(run.candidates, run.sources):
        if src is not None:
            cands.check_against_reference(src.shapes(), ref_shapes, run.n_layers, c.path)
    vocab = _vocab(run.config)
    if run.reader is not None and run.reader.vocab != vocab:
        raise InputError(f"{run.reader.path}: vocabulary {run.reader.vocab} differs from the reference's {vocab}")


def _announce(run: EvalRun, windows: int | None) -> str:
    """The line `evaluate` prints before the forward: what is scored, and how to score more."""
    w = run.windows
    torch_models = (0 if run.reader else 1) + sum(s is not None for s in run.sources)
    capped = windows is not None and w.count == windows
    if run.generated:
        return (f"eval: {w.count} of the reference's own replies, {w.scored_per_window} tokens each after "
                f"{w.first + 1}-token prompts ({w.count * w.scored_per_window:,} scored tokens) through "
                f"{torch_models} model{'s' if torch_models != 1 else ''}, {run.n_layers} layers each")
    return (f"eval: {w.count} window{'s' if w.count != 1 else ''} of {w.ctx} tokens ({w.count * w.ctx:,} tokens"
            f"{', the first of the text' if capped else ''}) through {torch_models} model"
            f"{'s' if torch_models != 1 else ''}, {run.n_layers} layers each"
            + ("; --windows all scores the whole text" if capped else ""))


def _split_windows(run: EvalRun, ranks: RankContext) -> None:
    """This rank's windows (eval/window_split.py); with several ranks, the options that need every window in one
    process are refused first."""
    if ranks.world > 1:
        if run.save_ref:
            raise InputError(SAVE_REF_ONE_DEVICE)
        if any(s is None for s in run.sources):
            raise InputError(f"--engine {run.engine} scores {ENGINE_FORMATS[run.engine].upper()} candidates "
                             "itself: give one device")
    run.ranks = ranks
    run.mine = rank_window_ids(run.windows.count, run.batch_windows, ranks)


def _memory(run: EvalRun, gpu_memory: int | None, show: bool) -> None:
    """The device and host memory the forward and the scoring need, said on stderr before any work; a
    --gpu-memory one layer and one window cannot meet is refused here (runtime/memory_budget.py). A given budget
    decides where the hidden streams live and the rows of each KL pass; any budget (the free memory too) the
    routed experts per group of the forward when a whole layer does not fit (the same numbers)."""
    names = (0 if run.reader else 1) + sum(s is not None for s in run.sources)
    budget = resolve_budget(gpu_memory, run.device)
    est, on_device = eval_estimate(
        budget, checkpoint_shapes(run.ref.ckpt), ctx=run.windows.ctx, batch_windows=run.batch_windows,
        models=names, state_bytes=state_bytes(run.config, len(run.mine), run.windows.ctx, run.state_dtype),
        kl_default=ROW_CHUNK)
    run.memory = announce(est, "eval", show=show)
    fwd = est.stage("eval_forward")
    run.expert_group = expert_group(fwd) if fwd is not None else None
    if budget.given:
        run.streams_on_device = on_device
        run.kl_rows = est.stage("eval_logits").piece


def _vocab(config: dict) -> int:
    return int(config.get("text_config", config)["vocab_size"])


# --- forward -------------------------------------------------------------------------------------------------------
def _state_device(run: EvalRun, n_models: int) -> torch.device:
    """The GPU when every model's hidden streams fit in GPU_STATE_SHARE of its free memory, else the host."""
    if run.device.type != "cuda" or n_models == 0:
        return torch.device("cpu")
    if run.streams_on_device is not None:  # --gpu-memory decided
        return run.device if run.streams_on_device else torch.device("cpu")
    need = n_models * state_bytes(run.config, len(run.mine), run.windows.ctx, run.state_dtype)
    free, _ = torch.cuda.mem_get_info(run.device)
    return run.device if need <= GPU_STATE_SHARE * free else torch.device("cpu")


def _forward(run: EvalRun, progress: bool) -> StreamedModels:
    """The reference (unless its log-probs come from a file) and every torch candidate through all layers."""
    names = ([] if run.reader else [(str(run.ref_dir), run.ref)]) + [
        (str(c.path), s) for c, s in zip(run.candidates, run.sources) if s is not None]
    models = StreamedModels(run.config, run.local_tokens, device=run.device, state_dtype=run.state_dtype,
                            state_device=_state_device(run, len(names)), batch_windows=run.batch_windows,
                            expert_group=run.expert_group)
    for j, (name, src) in enumerate(names):
        models.add(name, src, "reference" if j == 0 and not run.reader else "candidate")
    models.run(progress)
    return models


def _mtp(run: EvalRun, models: StreamedModels, report: dict) -> None:
    """--mtp: every candidate's NextN draft agreement (eval/mtp.py), the reference's beside it."""
    nextn = run.ref.ckpt.nextn_layers
    if not nextn:
        raise InputError(f"--mtp: the reference {run.ref_dir} has no NextN block (num_nextn_predict_layers)")
    with profile.stage("mtp", "nextn"):
        mtp_head.add_to_report(report, models, run.candidates, run.sources, run.engine, run.mine,
                               run.windows.first, nextn[0])


# --- finalize ------------------------------------------------------------------------------------------------------
class _TorchLogits:
    """A streamed candidate's logits window by window, its final norm and lm_head held while scoring."""

    def __init__(self, models: StreamedModels, model: StreamedModel, first: int):
        self.models, self.model, self.first = models, model, first

    def __enter__(self):
        self._head = self.models.head(self.model)
        self._head.__enter__()
        return self

    def __exit__(self, *exc):
        return self._head.__exit__(*exc)

    def __call__(self, w: int) -> torch.Tensor:
        return self.models.scored_logits(self.model, w, self.first)

    @property
    def seconds(self) -> float:
        return self.model.seconds


class _LlamaCppLogits:
    """A GGUF candidate's logits from llama.cpp itself (--engine llamacpp); the library is loaded while scoring."""

    def __init__(self, path: Path, windows: refm.Windows, cache_type: str):
        self.path, self.windows, self.cache_type, self.seconds = path, windows, cache_type, 0.0

    def __enter__(self):
        self.scorer = LlamaCppScorer(self.path, ctx=self.windows.ctx, first=self.windows.first,
                                     cache_type=self.cache_type)
        return self

    def __exit__(self, *exc):
        self.scorer.close()

    def __call__(self, w: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.scorer(self.windows.tokens[w])
        self.seconds += time.perf_counter() - t0
        return out


def _candidate_logits(run: EvalRun, models: StreamedModels, i: int):
    c, src = run.candidates[i], run.sources[i]
    if src is None and run.engine == exllamav3_engine.ENGINE:
        return exllamav3_engine.Exllamav3Logits(c.path, run.windows, _vocab(run.config), run.device)
    if src is None:
        return _LlamaCppLogits(c.path, run.windows, run.cache_type)
    model = next(m for m in models.models if m.source is src)
    return _TorchLogits(models, model, run.windows.first)


def _reference_log_probs(run: EvalRun, ref: _TorchLogits | None, w: int, j: int) -> torch.Tensor:
    """Window w's reference log-probs (the rank's j-th window): from the --ref-logits file, or log-softmax of
    the reference's logits."""
    if ref is None:
        return run.reader.logprobs(w)
    logits = ref(j)
    if not bool(torch.isfinite(logits).all()):
        raise FormatError(f"{run.ref_dir}: the reference gives non-finite logits in window {w}")
    with profile.stage("score", "head"):
        return log_probs(logits)


def _finalize(run: EvalRun, models: StreamedModels, progress: bool) -> dict | None:
    """Score every candidate window by window (one candidate head in memory at a time) and build the report.
    With --save-ref the first pass writes the reference log-probs; every pass scores exactly what the file holds."""
    writer = None
    if run.save_ref:
        writer = RefLogitsWriter(run.save_ref, run.windows.tokens, run.windows.first, _vocab(run.config),
                                 run.ref_dtype, meta={"reference": str(run.ref_dir), "text": run.text_name,
                                       "text_kind": "generated" if run.generated else "text"})
    ref = None if run.reader else _TorchLogits(models, models.models[0], run.windows.first)
    ref_seconds = None
    scored = []
    try:
        with ref if ref is not None else contextlib.nullcontext():
            for p, i in enumerate(range(len(run.candidates)) if run.candidates else [None]):
                cand = None if i is None else _candidate_logits(run, models, i)
                per_window = []
                desc = "reference log-probs" if cand is None else f"scoring {escape(run.candidates[i].path.name)}"
                # the bar as a context: its line ends before an error met while scoring is reported
                with cand if cand is not None else contextlib.nullcontext(), \
                        tqdm(run.mine, desc=desc, unit="win", disable=not progress) as bar:
                    for j, w in enumerate(bar):
                        lp = _reference_log_probs(run, ref, w, j)
                        if writer is not None:
                            if p == 0:
                                writer.add(lp)
                            lp = roundtrip(lp, run.ref_dtype, run.windows.targets(w))  # what --ref-logits reads back
                        if cand is None:
                            continue
                        logits = cand(j)
                        _check_logits(run.candidates[i].path, w, logits, lp)
                        with profile.stage("score", "head"):
                            per_window.append(token_quantities(lp.to(logits.device), logits,
                                                               run.windows.targets(w), rows=run.kl_rows))
                if p == 0 and ref is not None:
                    ref_seconds = (gather_in_order(run.ranks, [], [], ref.seconds) or (None, None))[1]
                if cand is not None and (got := gather_in_order(run.ranks, run.mine, per_window, cand.seconds)):
                    acc = KLAccumulator()
                    for q in got[0]:  # window order, whichever rank scored each
                        acc.add(q)
                    scored.append((acc, got[1]))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
    if not run.ranks.is_main:
        return None
    return _report(run, scored, ref_seconds, models.state_device)


def _check_logits(path: Path, w: int, logits: torch.Tensor, lp: torch.Tensor) -> None:
    if not bool(torch.isfinite(logits).all()):
        raise FormatError(f"{path}: non-finite logits in window {w}")
    if logits.shape[-1] != lp.shape[-1]:
        raise InputError(f"{path}: vocabulary {logits.shape[-1]} differs from the reference {lp.shape[-1]}")


def _report(run: EvalRun, scored: list, ref_seconds: float | None, state_device: torch.device) -> dict:
    window_tokens = run.windows.count * run.windows.ctx
    ref_params = run.ref.ckpt.params
    own = run.generated or (run.reader is not None and run.reader.meta.get("text_kind") == "generated")
    kind = "generated" if own else "text"
    report = {
        "reference": str(run.ref_dir),
        "text": run.text_name,
        "ctx": run.windows.ctx,
        "score": "continuation" if kind == "generated" else "all" if run.windows.first == 0 else "half",
        "windows": run.windows.count,
        "text_kind": kind,
        "engine": run.engine,
        "device": str(run.device),
        "ref_params": ref_params,
        "ref_tokens_per_s": (window_tokens / ref_seconds) if ref_seconds else None,
        "ref_logits": str(run.reader.path if run.reader else run.save_ref or "") or None,
        "state_dtype": run.state_dtype,
        "state_device": str(state_device),
        "memory": run.memory,
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "peak_gpu_mib": None if (g := peak_gpu_mib(run.device)) is None else round(g, 1),
        "candidates": [],
    }
    if run.generated:
        report["generated"] = run.generated
    for c, (acc, secs) in zip(run.candidates, scored):
        # bpw: mixq's one figure, file bytes x 8 / reference parameters (file_bpw in plan and convert JSONs too)
        entry = {"path": str(c.path), "format": c.format, "bytes": c.bytes, "bpw": c.bytes * 8 / ref_params}
        entry.update(acc.summary())
        entry["engine"] = run.engine if ENGINE_FORMATS.get(run.engine) == c.format else "torch"
        if entry["engine"] == "llamacpp":
            entry["cache_type"] = run.cache_type
        entry["tokens_per_s"] = window_tokens / secs if secs > 0 else None
        entry.update(file_bytes=c.bytes, file_bpw=entry["bpw"])  # the names plan and convert use (keys appended)
        report["candidates"].append(entry)
    return report


def _write_outputs(report: dict, json_out: str | Path | None, markdown_out: str | Path | None,
                   token_file: tuple[Path, str] | None = None) -> None:
    """--json (a file, or "-" for stdout), --markdown and a new token file, each written under a temporary name
    and renamed."""
    if token_file is not None:
        _write_atomic(*token_file)
    if json_out is not None and str(json_out) == "-":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    elif json_out:
        _write_atomic(Path(json_out), json.dumps(report, indent=2) + "\n")
    if markdown_out:
        _write_atomic(Path(markdown_out), render_markdown(report))


def _write_atomic(path: Path, text: str) -> None:
    try:
        write_text(path, text)
    except OSError as e:
        raise InputError(f"{path}: cannot write ({e.strerror or e})") from None
