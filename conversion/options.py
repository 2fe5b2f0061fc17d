"""Typed options of `mixq convert` (one frozen dataclass per output format) and `mixq imatrix`, checked when built.

`Exl3Options` and `GGUFOptions` hold every setting of a conversion; `mixq.convert(model, out, options)` runs one.
Building an options object checks each value on its own (a known type, a positive count, a parsable size) and
raises InputError naming the option as the command line spells it; checks that need the model or the file system
run in the converter's resolve/validate steps, before any output is written. `options_for(fmt, **kwargs)` builds
the options of a format from keyword arguments (the old `convert(model, out, "gguf", **kwargs)` form): an option
of the other format, or one neither has, is an InputError naming the option and the format.
`to_dict()` / `from_dict()` carry a version, for job files and reports. Each field carries its flag and help
(planning/option_fields.opt; CONVERT_FLAGS says how `mixq convert` reads a flag both formats share): the command
line builds its options from them. `ImatrixOptions`: the calibration forward of `mixq imatrix`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Mapping, Union

from mixq.errors import InputError, MixqError
from mixq.planning.sizes import parse_size_option
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS
from mixq.measurement.hessians import ROUNDINGS, check_rounding  # noqa: F401  (ROUNDINGS: the --rounding choices)
from mixq.measurement.options import GGUF_LADDERS
from mixq.quant.device import parse_device
from mixq.runtime.calibration import CALIBRATION_ROWS, CALIBRATION_SEQ_LEN
from mixq.runtime.distributed import parse_devices
from mixq.runtime.layer_stream import BATCH_ROWS
from mixq.formats.gguf_layout import FLOAT_TYPES
from mixq.formats.gguf_tokenizer import check_pre
from mixq.planning import gguf_mix
from mixq.planning.gguf_rules import RULE_FLAGS, encodable_type, tensor_type_rules
from mixq.planning.option_fields import as_tuple, default_of, flag_of, opt
from mixq.planning.pin import PIN_NAMES, parse_pin

OPTIONS_VERSION = 1
# GGUF --rounding hessian: descent steps per stage of the block-output tuning (conversion/gguf/tuning.py)
DEFAULT_TUNE_ITERS = 200
DEFAULT_EXL3_SHARD = 8192 * 2**20
MMPROJ_TYPES = ("F16", "Q8_0")
CODEBOOKS = ("mul1", "mcg")
PROFILE_HELP = ("Write where the run's time goes to FILE as JSON: seconds, bytes read and written, peak host and "
                "GPU memory, per stage and per layer (replaced only with --overwrite, where the command has it); a "
                "per-stage table ends the run on stderr.")


# how `mixq convert` reads each flag (one entry for a flag both formats have); defaults come from the fields and,
# where they depend on the format, are said here from the same constants
CONVERT_FLAGS: dict[str, dict[str, Any]] = {
    "--bpw": dict(help="Target bits per weight of the budgeted tensors; x,y,z (with --format gguf or exl3) makes a "
                  "family in the directory OUT (docs/family.md).", click_type="text"),
    "--size": dict(help="Target size instead of --bpw (e.g. 108G, 500MiB); A,B,C (with --format gguf or exl3) makes "
                   "a family in the directory OUT (docs/family.md).", click_type="text"),
    "--override": dict(help="PATTERN=BITS (EXL3) or PATTERN=TYPE (GGUF mixes) per-tensor override, as `mixq plan` "
                       "(repeatable).", multiple=True),
    "--calibration": dict(help="EXL3, GGUF --rounding hessian: calibration .txt/.jsonl file (repeatable) [default: "
                          "built-in sample].", multiple=True, click_type="path"),
    "--rows": dict(help=f"EXL3, GGUF --rounding hessian: calibration rows.  [default: {CALIBRATION_ROWS}]",
                   click_type="int"),
    "--seq-len": dict(help="EXL3, GGUF --rounding hessian: tokens per calibration row.  "
                      f"[default: {CALIBRATION_SEQ_LEN}]", click_type="int"),
    "--device": dict(help="cuda|cpu: EXL3 quantization, GGUF encoding [default: cuda when available; GGUF with "
                     "--threads: cpu].", click_type="text"),
    "--devices": dict(help="EXL3: several devices of one type, one rank each (0,1 or cpu,cpu; or run under "
                      "torchrun); the same output as one device.", click_type="text"),
    "--shard-size": dict(help=f"Max shard size (EXL3 default {DEFAULT_EXL3_SHARD // 2**30}GiB; GGUF default: one "
                         "file).", click_type="text"),
    "--resume": dict(help="EXL3: continue an interrupted conversion in OUT.", is_flag=True),
    "--overwrite": dict(help="GGUF: replace an existing OUT (and --mmproj file).", is_flag=True),
    "--head-bits": dict(help="lm_head bits (16 = unquantized; GGUF: with --bpw/--size).  "
                        f"[default: {DEFAULT_HEAD_BITS}]", click_type="float"),
    "--mtp-bits": dict(help=f"Bits of the NextN block (GGUF: with --bpw/--size).  [default: {DEFAULT_MTP_BITS}]",
                       click_type="float"),
    "--vision-bits": dict(help="Quantize the vision tower (EXL3) [default: source precision].", click_type="float"),
    "--no-mtp": dict(help="Leave the NextN block out.", negate=True),
    "--measure": dict(help="Plan --bpw/--size with these error curves (`mixq plan --measure --measure-out FILE`; "
                      "GGUF: measured with the same --rounding and --imatrix). An EXL3 family without it measures "
                      "them once into OUT/<model>.exl3-curves.json (--measure proxy: the cheap proxy instead); a GGUF "
                      "family with --measure kld measures them once into OUT/<model>.gguf-curves.json, every "
                      "member's encodes then served from that measurement's.", click_type="path"),
    "--pin": dict(help="With --measure: keep these groups at the role plan's bits / types, comma separated "
                  f"({', '.join(PIN_NAMES)}).", click_type="text"),
    "--rounding": dict(help="GGUF: exact = ggml's encoder, byte-identical to llama-quantize; hessian = the same "
                       "types and bytes, codes chosen for each layer's output error from a calibration pass "
                       f"(--calibration, --rows, --seq-len).  [default: {ROUNDINGS[0]}]", choices=ROUNDINGS),
    "--tune-iters": dict(help="GGUF --rounding hessian: descent steps per decoder layer that tune the codes (and the "
                         "one fp16 scale of Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL blocks) for the layer's output on the "
                         "quantized model's streams (0 = Hessian rounding alone).  "
                         f"[default: {DEFAULT_TUNE_ITERS}]", click_type="int"),
    "--tune-group-iters": dict(help="GGUF --rounding hessian: descent steps per group of routed experts, where a "
                               "layer's experts do not fit the tuning memory at once and are tuned a group at a "
                               "time (0 = those experts keep their Hessian rounding).  [default: --tune-iters / 8]",
                               click_type="int"),
    "--refine-passes": dict(help="GGUF --rounding hessian: descent passes over the codes and scales after the "
                            "rounding's feedback walk (0 = the walk alone).  [default: 0 for IQ2_S and 1 for Q2_K "
                            "and IQ2_XS where tuning follows, else 3]", click_type="int"),
    "--type": dict(help="GGUF: a llama-quantize type name (Q4_K_M, IQ2_XXS, Q4_0, BF16, ...).", click_type="text"),
    "--imatrix": dict(help="GGUF: llama.cpp imatrix file (GGUF or legacy .dat).", click_type="path"),
    "--gguf-ladder": dict(help="GGUF --bpw/--size: candidate types, K-quants or K-quants plus IQ2_XXS..IQ4_XS.  "
                          f"[default: {GGUF_LADDERS[0]}]", choices=GGUF_LADDERS),
    **RULE_FLAGS,  # --tensor-type, --output-tensor-type, --token-embedding-type: as `mixq plan` reads them
    "--tokenizer-pre": dict(help="GGUF: force tokenizer.ggml.pre (e.g. gpt-2, glm4).", click_type="text"),
    "--chat-template": dict(help="GGUF: embed this Jinja file as tokenizer.chat_template.", click_type="path"),
    "--fix-chat-template": dict(help="GGUF: rewrite template constructs llama.cpp's engine rejects (x.0 -> x[0]).",
                                is_flag=True),
    "--mmproj": dict(help="GGUF: also write the vision projector to this .gguf.", click_type="path"),
    "--mmproj-type": dict(help=f"GGUF: mmproj matrix type.  [default: {MMPROJ_TYPES[0]}]", choices=MMPROJ_TYPES,
                          case_sensitive=False),
    "--profile": dict(help=PROFILE_HELP, click_type="path"),
    "--gpu-memory": dict(help="Memory budget of the device (e.g. 24GB, 80GiB; on a CPU device, the host working "
                         "set): every stage works in pieces that fit it, and a budget its smallest piece cannot meet "
                         "is refused before any work (docs/memory-model.md) [default: what the device has free].",
                         click_type="text", metavar="SIZE"),
    "--threads": dict(help="GGUF: CPU encoder worker processes (1 = in this process; output bytes do not depend on "
                      "it) [default: all cores, or the GPU when present].", click_type="int"),
}


def _opt(default: Any = None, flag: str | None = None) -> Any:
    """A field of a convert options class: `flag`'s command-line reading (help, type) from CONVERT_FLAGS, shared by
    the two formats' classes."""
    return opt(default, flag, **CONVERT_FLAGS.get(flag, {}))


def _positive_int(cls, name: str, v, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{flag_of(cls, name)} {v!r}: expected a whole number >= {minimum}")


def _positive_float(cls, name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InputError(f"{flag_of(cls, name)} {v!r}: expected a positive number")


def _size(cls, name: str, v, *, zero_ok: bool = False) -> None:
    """A byte count or a size string ("8GiB", "108GB"), parsed with the planner's convention."""
    parse_size_option(flag_of(cls, name), v, zero_ok=zero_ok)




def _set_budget(options) -> None:
    """--gpu-memory as bytes (parsed once here; None: the device's free memory, runtime/memory_budget.py)."""
    if options.gpu_memory is not None:
        object.__setattr__(options, "gpu_memory", parse_size_option(flag_of(type(options), "gpu_memory"),
                                                                   options.gpu_memory))


def _device(cls, v) -> None:
    if v is None:
        return
    parse_device(v, flag_of(cls, "device"))


class _Options:
    """Shared behaviour of the per-format option classes."""

    format: ClassVar[str]

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen dataclass in __post_init__

    def _check_target(self, names: tuple[str, ...]) -> None:
        given = [n for n in names if getattr(self, n) is not None]
        if len(given) > 1:
            raise InputError(f"give one of {', '.join(flag_of(type(self), n) for n in names)}, not "
                             f"{' and '.join(flag_of(type(self), n) for n in given)}")
        if self.bpw is not None:
            _positive_float(type(self), "bpw", self.bpw)
        if self.size is not None:
            _size(type(self), "size", self.size)

    def given(self) -> dict[str, Any]:
        """The options that differ from their defaults (what a user set)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default}

    def to_dict(self) -> dict:
        """JSON-able settings with the format and the options version (paths as strings)."""
        def plain(v):
            if isinstance(v, Path):
                return str(v)
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            if isinstance(v, Mapping):
                return {str(k): plain(x) for k, x in v.items()}
            if v is None or isinstance(v, (str, int, float, bool, list)):
                return v
            return repr(v)  # an in-memory object (an IMatrix): recorded, not restorable
        return {"format": self.format, "version": OPTIONS_VERSION,
                **{f.name: plain(getattr(self, f.name)) for f in fields(self)}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "_Options":
        """Inverse of `to_dict` (InputError for another format, a newer version or an unknown key)."""
        d = dict(d)
        fmt = d.pop("format", cls.format)
        if fmt != cls.format:
            raise InputError(f"options for format {fmt!r} given where {cls.format} options are needed")
        version = d.pop("version", OPTIONS_VERSION)
        if not isinstance(version, int) or version > OPTIONS_VERSION:
            raise InputError(f"{cls.format} options version {version!r} is newer than this mixq ({OPTIONS_VERSION})")
        return options_for(cls.format, **d)


@dataclass(frozen=True)
class Exl3Options(_Options):
    """Settings of a glm5_next (or DFlash2 drafter) conversion to an EXL3 directory.

    Target: `bpw` or `size` (a drafter defaults to 6 bpw). `overrides`: PATTERN=BITS (role, glob or regex).
    `calibration`: text files (empty: the built-in sample), `rows` x `seq_len` tokens. `measure`: error curves
    (a mapping or the JSON `mixq plan --measure-out` wrote) for the sensitivity plan. `devices`: several devices
    of one type ("0,1", "cpu,cpu"): one rank each, the same output as one device of that type."""

    format: ClassVar[str] = "exl3"
    bpw: float | None = _opt(None, "--bpw")
    size: int | str | None = _opt(None, "--size")
    overrides: tuple[str, ...] = _opt((), "--override")
    calibration: tuple[Union[str, Path], ...] = _opt((), "--calibration")
    rows: int = _opt(CALIBRATION_ROWS, "--rows")
    seq_len: int = _opt(CALIBRATION_SEQ_LEN, "--seq-len")
    device: str | None = _opt(None, "--device")
    devices: tuple[str, ...] = _opt((), "--devices")
    shard_size: int | str = _opt(DEFAULT_EXL3_SHARD, "--shard-size")
    resume: bool = _opt(False, "--resume")
    head_bits: float = _opt(DEFAULT_HEAD_BITS, "--head-bits")
    mtp_bits: float = _opt(DEFAULT_MTP_BITS, "--mtp-bits")
    vision_bits: float | None = _opt(None, "--vision-bits")
    include_mtp: bool = _opt(True, "--no-mtp")
    measure: Union[str, Path, Mapping, None] = _opt(None, "--measure")
    pin: tuple[str, ...] = _opt((), "--pin")
    gpu_memory: int | str | None = _opt(None, "--gpu-memory")
    codebook: str = _opt("mul1", "codebook")
    batch_rows: int = _opt(BATCH_ROWS, "batch_rows")
    profile: Union[str, Path, None] = _opt(None, "--profile")
    progress: bool = _opt(True, "progress")

    def __post_init__(self) -> None:
        cls = type(self)
        self._set("overrides", as_tuple(self.overrides))
        self._set("pin", parse_pin(self.pin, flag_of(cls, "pin")))
        self._set("calibration", as_tuple(self.calibration))
        self._check_target(("bpw", "size"))
        _positive_int(cls, "rows", self.rows)
        _positive_int(cls, "seq_len", self.seq_len, 2)
        _positive_int(cls, "batch_rows", self.batch_rows)
        _size(cls, "shard_size", self.shard_size)
        for name in ("head_bits", "mtp_bits") + (("vision_bits",) if self.vision_bits is not None else ()):
            _positive_float(cls, name, getattr(self, name))
        if self.codebook not in CODEBOOKS:
            raise InputError(f"codebook {self.codebook!r}: expected one of {', '.join(CODEBOOKS)}")
        _device(cls, self.device)
        _set_budget(self)
        self._set_devices()

    def _set_devices(self) -> None:
        """--devices (several ranks, runtime/distributed.py) as normalised device names; not with --device."""
        self._set("devices", parse_devices(self.devices if self.devices else None, flag_of(type(self), "devices")))
        if self.devices and self.device is not None:
            raise InputError("give --device or --devices, not both")
        if len(self.devices) > 1 and self.profile is not None:
            raise InputError("--profile records one process: give one device, not --devices")


@dataclass(frozen=True)
class GGUFOptions(_Options):
    """Settings of a glm5_next conversion to a GGUF file (or split set).

    Target: exactly one of `qtype` (a llama-quantize mix such as Q4_K_M, or F32/F16/BF16/Q8_0), `bpw` or `size`.
    `overrides` (PATTERN=TYPE) steer the plan; `tensor_type` ((REGEX, TYPE) or "REGEX=TYPE"),
    `output_tensor_type` and `token_embedding_type` then replace types as llama-quantize's options do.
    `device`: where the quantized types are encoded (None: CUDA when present, unless `threads` asks for CPU worker
    processes); `threads`: CPU encoder processes (None: every core). The bytes depend on neither. `rounding`:
    "exact" (ggml's encoder: byte-identical to llama-quantize) or "hessian" (same types and bytes, codes chosen
    for the layer-output error from a calibration pass over `calibration` files, `rows` x `seq_len` tokens, then
    tuned for each decoder layer's output on the quantized model's streams: `tune_iters` steps, 0 = none; routed
    experts that do not fit the tuning memory with the rest are tuned a group at a time, `tune_group_iters` steps
    a group, None = `tune_iters` / 8); `refine_passes`: the rounding's descent passes over codes and scales after
    its feedback walk (None = per type: 0 for IQ2_S and 1 for Q2_K and IQ2_XS where tuning follows, else 3).
    `measure`: GGUF error curves (`mixq plan --format gguf --measure --measure-out FILE`) for a --bpw/--size
    plan. `overwrite`: replace an existing OUT (and --mmproj file) instead of refusing."""

    format: ClassVar[str] = "gguf"
    qtype: str | None = _opt(None, "--type")
    bpw: float | None = _opt(None, "--bpw")
    size: int | str | None = _opt(None, "--size")
    overrides: tuple[str, ...] = _opt((), "--override")
    head_bits: float | None = _opt(None, "--head-bits")
    mtp_bits: float | None = _opt(None, "--mtp-bits")
    gguf_ladder: str | None = _opt(None, "--gguf-ladder")
    imatrix: Any = _opt(None, "--imatrix")
    tensor_type: tuple = _opt((), "--tensor-type")
    output_tensor_type: str | None = _opt(None, "--output-tensor-type")
    token_embedding_type: str | None = _opt(None, "--token-embedding-type")
    include_mtp: bool = _opt(True, "--no-mtp")
    shard_size: int | str = _opt(0, "--shard-size")
    tokenizer_pre: str | None = _opt(None, "--tokenizer-pre")
    chat_template: Union[str, Path, None] = _opt(None, "--chat-template")
    fix_chat_template: bool = _opt(False, "--fix-chat-template")
    mmproj: Union[str, Path, None] = _opt(None, "--mmproj")
    mmproj_type: str = _opt(MMPROJ_TYPES[0], "--mmproj-type")
    threads: int | None = _opt(None, "--threads")
    device: str | None = _opt(None, "--device")
    gpu_memory: int | str | None = _opt(None, "--gpu-memory")
    rounding: str = _opt(ROUNDINGS[0], "--rounding")
    calibration: tuple[Union[str, Path], ...] = _opt((), "--calibration")
    rows: int = _opt(CALIBRATION_ROWS, "--rows")
    seq_len: int = _opt(CALIBRATION_SEQ_LEN, "--seq-len")
    tune_iters: int = _opt(DEFAULT_TUNE_ITERS, "--tune-iters")
    tune_group_iters: int | None = _opt(None, "--tune-group-iters")
    refine_passes: int | None = _opt(None, "--refine-passes")
    measure: Union[str, Path, Mapping, None] = _opt(None, "--measure")
    pin: tuple[str, ...] = _opt((), "--pin")
    overwrite: bool = _opt(False, "--overwrite")
    profile: Union[str, Path, None] = _opt(None, "--profile")
    progress: bool = _opt(True, "progress")

    def __post_init__(self) -> None:
        cls = type(self)
        self._set("overrides", as_tuple(self.overrides))
        self._set("pin", parse_pin(self.pin, flag_of(cls, "pin")))
        self._set("tensor_type", tensor_type_rules(self.tensor_type))
        if self.qtype is None and self.bpw is None and self.size is None:
            raise InputError("give a target: --type, --bpw or --size")
        self._check_target(("qtype", "bpw", "size"))
        if self.qtype is not None:
            self._set("qtype", _gguf_mix_name(self.qtype))
        for name in ("output_tensor_type", "token_embedding_type"):
            if getattr(self, name) is not None:
                self._set(name, encodable_type(getattr(self, name), flag_of(cls, name)))
        for name in ("head_bits", "mtp_bits"):
            if getattr(self, name) is not None:
                _positive_float(cls, name, getattr(self, name))
        if self.gguf_ladder is not None and self.gguf_ladder not in GGUF_LADDERS:
            raise InputError(f"--gguf-ladder {self.gguf_ladder!r}: expected one of {', '.join(GGUF_LADDERS)}")
        self._set("mmproj_type", str(self.mmproj_type).upper())
        if self.mmproj_type not in MMPROJ_TYPES:
            raise InputError(f"--mmproj-type {self.mmproj_type!r}: expected one of {', '.join(MMPROJ_TYPES)}")
        if self.threads is not None:
            _positive_int(cls, "threads", self.threads)
        if self.tokenizer_pre is not None:  # a name llama.cpp does not know verifies, then fails to load
            check_pre(self.tokenizer_pre, flag_of(cls, "tokenizer_pre"))
        _device(cls, self.device)
        _set_budget(self)
        _size(cls, "shard_size", self.shard_size, zero_ok=True)
        self._set("rounding", check_rounding(self.rounding))
        self._set("calibration", as_tuple(self.calibration))
        _positive_int(cls, "rows", self.rows)
        _positive_int(cls, "seq_len", self.seq_len, 2)
        _positive_int(cls, "tune_iters", self.tune_iters, 0)
        if self.tune_group_iters is not None:
            _positive_int(cls, "tune_group_iters", self.tune_group_iters, 0)
        if self.refine_passes is not None:
            _positive_int(cls, "refine_passes", self.refine_passes, 0)
        self._check_mode()

    def _check_mode(self) -> None:
        """Options that the chosen target does not use are errors, never silently dropped."""
        if self.qtype is not None:
            for name in ("head_bits", "mtp_bits", "gguf_ladder"):
                if getattr(self, name) is not None:
                    raise InputError(f"{flag_of(GGUFOptions, name)} applies to --bpw/--size, not to --type "
                                     f"{self.qtype} (the mix decides; --tensor-type / --output-tensor-type "
                                     "change single tensors)")
            if self.overrides and self.qtype in FLOAT_TYPES:
                raise InputError(f"--override applies to quantized mixes, not to --type {self.qtype}; "
                                 "use --tensor-type REGEX=TYPE")
        if self.mmproj is None and self.mmproj_type != default_of(GGUFOptions, "mmproj_type"):
            raise InputError("--mmproj-type applies with --mmproj only")
        if self.rounding != "hessian":
            for name in ("calibration", "rows", "seq_len", "tune_iters", "tune_group_iters", "refine_passes"):
                if getattr(self, name) != default_of(GGUFOptions, name):
                    raise InputError(f"{flag_of(GGUFOptions, name)} applies to GGUF with --rounding hessian "
                                     "(its calibration pass)")
        if self.measure is not None and self.qtype is not None:
            raise InputError(f"--measure plans a GGUF to --bpw or --size, not --type {self.qtype}")


def _gguf_mix_name(qtype: str) -> str:
    """--type: F32/F16/BF16, or a llama-quantize type name (Q4_K_M, IQ2_XXS, Q4_0, ...), upper-cased."""
    q = str(qtype).upper()
    if q in FLOAT_TYPES:
        return q
    try:
        gguf_mix.normalize_mix(q)
    except MixqError:
        raise InputError(f"--type {qtype!r}: unknown; use F32, F16, BF16 or a llama-quantize type "
                         f"({', '.join(gguf_mix.MIX_NAMES)})") from None
    return q


OPTION_CLASSES: dict[str, type] = {"exl3": Exl3Options, "gguf": GGUFOptions}
# keyword spellings of the old convert_gguf / convert_exl3 signatures, kept working
_ALIASES = {"no_mtp": ("include_mtp", lambda v: not v)}


def options_for(fmt: str, **kwargs) -> Exl3Options | GGUFOptions:
    """The options of format `fmt` ("exl3" | "gguf") from keyword arguments. An option of the other format, or an
    unknown one, is an InputError naming the option and the format."""
    f = str(fmt).lower()
    if f not in OPTION_CLASSES:
        raise InputError(f"unknown format {fmt!r}; expected one of {', '.join(OPTION_CLASSES)}")
    cls = OPTION_CLASSES[f]
    names = {x.name for x in fields(cls)}
    args = {}
    for k, v in kwargs.items():
        if k in _ALIASES:
            k, conv = _ALIASES[k]
            v = conv(v)
        if k == "bpw" and isinstance(v, str):  # the command line passes --bpw as text (it may be a family list)
            v = bpw_number(v)
        if k not in names:
            other = [o for o, c in OPTION_CLASSES.items() if o != f and k in {x.name for x in fields(c)}]
            if other:
                raise InputError(f"{flag_of(OPTION_CLASSES[other[0]], k)} applies to --format {other[0]} only")
            raise InputError(f"unknown convert option {k!r} for --format {f}")
        args[k] = v
    return cls(**args)


def replace(options: Exl3Options | GGUFOptions, **changes) -> Exl3Options | GGUFOptions:
    """A copy of `options` with `changes` (checked like new options)."""
    return options_for(options.format, **{**{f.name: getattr(options, f.name) for f in fields(options)},
                                          **changes})




# --- families: several targets of one conversion (`--size A,B,C`, `--bpw x,y,z`; conversion/gguf/family.py) ---------------
_LABEL_RE = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class FamilyTarget:
    """One member's target: `kind` "size" (bytes) or "bpw", and the `label` its file is named with
    (`<model>-<label>.gguf`: the size as the user wrote it, e.g. 108GB, or `<x>bpw`)."""
    kind: str
    value: int | float
    label: str


@dataclass(frozen=True)
class FamilyOptions:
    """A family (GGUF or EXL3, as `base` is): the options every member shares (`base`, whose target is the first
    member's) and the members' targets. GGUF only: `imatrix_calibration` / `imatrix_rows` / `imatrix_seq_len`, the
    calibration of the imatrix the family computes once when no --imatrix is given (with --rounding exact; with
    hessian rounding the same --calibration / --rows / --seq-len serve both)."""
    base: GGUFOptions | Exl3Options
    targets: tuple[FamilyTarget, ...]
    imatrix_calibration: tuple[Union[str, Path], ...] = ()
    imatrix_rows: int = CALIBRATION_ROWS
    imatrix_seq_len: int = CALIBRATION_SEQ_LEN

    def member(self, target: FamilyTarget, **changes) -> GGUFOptions | Exl3Options:
        """The options of one member: `base` with this target (and `changes`, e.g. the family's imatrix)."""
        size = target.value if target.kind == "size" else None
        bpw = target.value if target.kind == "bpw" else None
        return replace(self.base, size=size, bpw=bpw, **changes)


def _parts(v) -> list:
    """A list target as given: "A,B,C" or a sequence; a single value as a one-item list."""
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    if isinstance(v, str):
        return [p.strip() for p in v.split(",") if p.strip()] or [v]
    return [v]


def is_family(size=None, bpw=None) -> bool:
    """Whether --size / --bpw name several targets (a comma list or a sequence): a family conversion."""
    return len(_parts(size)) > 1 or len(_parts(bpw)) > 1 or isinstance(size, (list, tuple)) \
        or isinstance(bpw, (list, tuple))


def bpw_number(v, flag: str = "--bpw") -> float:
    """A --bpw value given as text ("3.5") or a number, as a float (InputError naming the flag otherwise)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise InputError(f"{flag} {v!r}: expected a number such as 3.5") from None
    return v


def _size_label(text, n: int) -> str:
    """The file-name part of a size target: the user's spelling ("108GB"), or the bytes in GB/MB/KB."""
    if isinstance(text, str) and not text.strip().isdigit():
        return text.strip().replace(" ", "")
    for unit, div in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= div:
            return f"{n / div:.4g}{unit}"
    return f"{n}B"


def family_targets(size=None, bpw=None) -> tuple[FamilyTarget, ...]:
    """The members' targets of `--size A,B,C` or `--bpw x,y,z` (not both), each parsed and checked once;
    InputError for a bad value, a repeated target or two labels that name the same file."""
    sizes, bpws = _parts(size), _parts(bpw)
    if sizes and bpws:
        raise InputError("give a family as --size A,B,C or as --bpw x,y,z, not both")
    out = []
    for s in sizes:
        n = parse_size_option("--size", s)
        out.append(FamilyTarget("size", n, _size_label(s, n)))
    for b in bpws:
        x = bpw_number(b)
        _positive_float(GGUFOptions, "bpw", x)
        out.append(FamilyTarget("bpw", float(x), f"{float(x):g}bpw"))
    if not out:
        raise InputError("a family needs --size A,B,C or --bpw x,y,z")
    seen: dict[str, FamilyTarget] = {}
    for t in out:
        if not _LABEL_RE.match(t.label):
            raise InputError(f"--{t.kind} {t.label!r}: not usable in a file name")
        if t.label.lower() in seen or any(u.kind == t.kind and u.value == t.value for u in seen.values()):
            raise InputError(f"--{t.kind} {t.label}: given twice in the family")
        seen[t.label.lower()] = t
    return tuple(out)


def family_options(fmt: str = "gguf", **kwargs) -> FamilyOptions:
    """FamilyOptions of format `fmt` from convert's keyword options (`size` / `bpw` as lists or "A,B,C"); every
    option is checked as one conversion checks it (the first member's options are built here)."""
    kw = dict(kwargs)
    fmt = str(kw.pop("format", None) or fmt).lower()
    if fmt not in OPTION_CLASSES:
        raise InputError(f"unknown format {fmt!r}; expected gguf or exl3")
    targets = family_targets(kw.pop("size", None), kw.pop("bpw", None))
    if fmt == "exl3":
        if kw.get("resume"):
            raise InputError("--resume with a family: run the same command again; it keeps the finished members "
                             "and continues an interrupted one")
        first = targets[0]
        return FamilyOptions(options_for("exl3", **kw, **{first.kind: first.value}), targets)
    if kw.get("qtype") is not None:
        raise InputError(f"--type {kw['qtype']}: a family is made of --size or --bpw targets")
    if kw.get("mmproj") is not None:
        raise InputError("--mmproj with a family: write the projector once, with a single conversion")
    cal = {}
    if str(kw.get("rounding", ROUNDINGS[0])).lower() == ROUNDINGS[0] and kw.get("imatrix") is None:
        # --rounding exact has no calibration pass of its own: the family's calibration makes its imatrix
        cal = {"imatrix_calibration": as_tuple(kw.pop("calibration", ())),
               "imatrix_rows": kw.pop("rows", CALIBRATION_ROWS), "imatrix_seq_len": kw.pop("seq_len", CALIBRATION_SEQ_LEN)}
        _positive_int(GGUFOptions, "rows", cal["imatrix_rows"])
        _positive_int(GGUFOptions, "seq_len", cal["imatrix_seq_len"], 2)
    first = targets[0]
    base = options_for("gguf", **kw, **{first.kind: first.value})
    return FamilyOptions(base, targets, **cal)


@dataclass(frozen=True)
class ImatrixOptions:
    """Settings of `mixq imatrix`: the calibration forward (`calibration` files, empty: the built-in sample;
    `rows` x `seq_len` tokens) on `device` (a torch.device; None: CUDA when present), and whether OUT may be
    replaced."""

    calibration: tuple[Union[str, Path], ...] = opt((), "--calibration", "Calibration .txt/.jsonl file "
                                                    "(repeatable) [default: built-in sample].", multiple=True,
                                                    click_type="path")
    rows: int = opt(CALIBRATION_ROWS, "--rows", "Calibration rows.", click_type="int", show_default=True)
    seq_len: int = opt(CALIBRATION_SEQ_LEN, "--seq-len", "Tokens per calibration row.", click_type="int",
                       show_default=True)
    device: Any = opt(None, "--device", "cuda|cpu [default: cuda when available].", click_type="text")
    gpu_memory: int | str | None = opt(None, "--gpu-memory", CONVERT_FLAGS["--gpu-memory"]["help"],
                                       click_type="text", metavar="SIZE")
    overwrite: bool = opt(False, "--overwrite", "Replace an existing OUT (and --profile file).", is_flag=True)
    profile: Union[str, Path, None] = opt(None, "--profile", PROFILE_HELP, click_type="path")
    progress: bool = opt(True, None, "Show the progress bar.", cli=False)

    def __post_init__(self) -> None:
        cls = type(self)
        object.__setattr__(self, "calibration", as_tuple(self.calibration))  # frozen: normalised once, here
        _positive_int(cls, "rows", self.rows)
        _positive_int(cls, "seq_len", self.seq_len, 2)
        if self.device is not None:
            object.__setattr__(self, "device", parse_device(self.device, flag_of(cls, "device")))
        _set_budget(self)
