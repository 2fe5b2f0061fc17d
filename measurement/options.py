"""Typed options of `mixq plan` and `mixq.measure`: frozen dataclasses, every value parsed and checked once when
built.

`PlanOptions` holds every setting of a plan (the target, the role bits, the GGUF type rules, the measurement, the
memory fit); sizes are bytes, the context is tokens, the device a torch.device by the time it exists. Checks that
need the model (its vision tower, its config) run in `measurement/kld.run_plan` and the planner.
`MeasureOptions` holds the settings of a measurement of error curves on its own (`mixq.measure`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Union

import torch

from mixq.errors import InputError
from mixq.measurement.hessians import ROUNDINGS, check_rounding
from mixq.measurement.trellis import DEFAULT_SAMPLE, END_TO_END, MEASURE_MODES, parse_sample
from mixq.planning.gguf_mix import LADDERS
from mixq.planning.gguf_rules import RULE_FLAGS, TypeRules, encodable_type, tensor_type_rules
from mixq.planning.pin import PIN_NAMES, parse_pin
from mixq.planning.option_fields import (as_tuple, check_choice, check_int, check_positive, flag_of, opt,
                                         set_field)
from mixq.planning.sizes import parse_card_sizes, parse_context, parse_size_option
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS
from mixq.quant.device import parse_device

FORMATS = ("exl3", "gguf")
FIT_OFFLOAD = "offload"  # --fit given bare: the --gpu/--cpu machine
GGUF_LADDERS = tuple(LADDERS)  # the custom GGUF candidate ladders; the first is the default


@dataclass(frozen=True)
class PlanOptions:
    """Settings of `mixq plan` / `mixq.plan`: a target (`bpw`, `size` or `qtype`, or `fit` at a `context`), role
    bits, and an optional sensitivity measurement (`measure`: a mode, a curves file or curves). `size`, `fit`,
    `reserve` and the `devices` capacities are bytes; `context` tokens; `device` a torch.device; `measure_sample`
    the parsed (strips, experts) pair."""

    from_config: Union[str, Path, None] = opt(None, "--from-config",
                                              "Plan from a config.json alone (shapes, no weights).",
                                              click_type="path")
    fmt: str = opt("gguf", "--format", "Output format.", choices=FORMATS, required=True)
    bpw: float | None = opt(None, "--bpw", "Target bits per weight (EXL3: exllamav3's bits convention).",
                            click_type="float")
    size: int | None = opt(None, "--size", "Target total bytes of the model files: 108GB (10^9) or 100GiB (2^30).",
                           click_type="text")
    qtype: str | None = opt(None, "--type", "GGUF: a llama-quantize type name (Q4_K_M, IQ2_XXS, Q4_0, ...).",
                            click_type="text")
    overrides: tuple[str, ...] = opt((), "--override",
                                     "PATTERN=BITS (EXL3) or PATTERN=TYPE (GGUF); role, glob or regex.",
                                     multiple=True)
    head_bits: float = opt(DEFAULT_HEAD_BITS, "--head-bits", "lm_head bits (16 = unquantized).",
                           click_type="float", show_default=True)
    mtp_bits: float = opt(DEFAULT_MTP_BITS, "--mtp-bits", "NextN block bits.", click_type="float",
                          show_default=True)
    vision_bits: float | None = opt(None, "--vision-bits", "EXL3 vision tower bits (default: source precision).",
                                    click_type="float")
    include_mtp: bool = opt(True, "--no-mtp", "Leave the NextN block out.", negate=True)
    tensor_type: tuple[tuple[str, str], ...] = opt((), "--tensor-type", **RULE_FLAGS["--tensor-type"])
    output_tensor_type: str | None = opt(None, "--output-tensor-type", **RULE_FLAGS["--output-tensor-type"])
    token_embedding_type: str | None = opt(None, "--token-embedding-type", **RULE_FLAGS["--token-embedding-type"])
    gguf_ladder: str = opt(GGUF_LADDERS[0], "--gguf-ladder", "Custom GGUF candidate types: K-quants, or K-quants plus "
                           "IQ2_XXS..IQ4_XS.", choices=GGUF_LADDERS, show_default=True)
    measure: Union[str, Path, Mapping, None] = opt(
        None, "--measure",
        "Sensitivity mode. Alone (= 'kld'): each unit perturbed and the whole model run end to end (holds the "
        "model in memory); 'stream' = each unit's error at every rate or type, weighted by the end-to-end KLD's "
        "curvature from one streamed backward (one layer in memory); EXL3 only: 'trellis' = the per-Linear loss "
        "alone (it mis-ranks units), 'proxy' = the cheap Hessian-trace proxy; or a JSON file of curves "
        "{unit: {bits: error}}.",
        click_type="text", flag_value=MEASURE_MODES[0])
    pin: tuple[str, ...] = opt((), "--pin", "--measure: keep these groups at the role plan's bits / types, comma "
                               f"separated ({', '.join(PIN_NAMES)}).", click_type="text")
    measure_out: Union[str, Path, None] = opt(None, "--measure-out",
                                              "--measure: save the measured curves as JSON for reuse.",
                                              click_type="path")
    overwrite: bool = opt(False, "--overwrite", "Replace an existing --measure-out (or --profile) file.",
                          is_flag=True)
    profile: Union[str, Path, None] = opt(None, "--profile", "--measure: write where the measurement's time goes to "
                                          "FILE as JSON (seconds, bytes read and written, peak host and GPU memory, "
                                          "per stage and per layer); a per-stage table ends the run on stderr.",
                                          click_type="path")
    measure_sample: Any = opt(
        DEFAULT_SAMPLE, "--measure-sample",
        "--measure: STRIPS,EXPERTS sampled per matrix / per layer (e.g. 4,8), 'all', or 'auto' "
        "(1,2 on CPU; on CUDA all, or 8,16 beyond 2e9 budgeted weights).", click_type="text", show_default=True)
    device: torch.device | None = opt(None, "--device", "--measure: cuda|cpu [default: cuda when available].",
                                      click_type="text")
    calibration: tuple[Union[str, Path], ...] = opt((), "--calibration", "--measure: calibration text.",
                                                    multiple=True, click_type="path", must_exist=True)
    rounding: str = opt(ROUNDINGS[0], "--rounding", "GGUF --measure: the rounding the conversion will use (the curves "
                        "measure it).", choices=ROUNDINGS, show_default=True)
    imatrix: Any = opt(None, "--imatrix", "GGUF --measure or --type: the imatrix the conversion will use.",
                       click_type="path", must_exist=True)
    fit: int | str | None = opt(None, "--fit", "Memory to fit (weights + cache + reserve), e.g. 121GB; bare, with "
                                "--gpu and --cpu: llama.cpp's expert offload.", click_type="text",
                                flag_value=FIT_OFFLOAD)
    context: int | None = opt(None, "--context", "Context length for --fit, e.g. 262144 or 256K.",
                              click_type="text")
    cache: str | None = opt(None, "--cache", "Cache type: llama.cpp f16/q8_0/q4_0/...; exllamav3 fp16/q8/q6/q4.",
                            click_type="text")
    reserve: int | None = opt(None, "--reserve", "Compute/scratch reserve for --fit (default 4GB).",
                              click_type="text")
    mmproj: bool = opt(False, "--mmproj", "--fit: also hold the GGUF vision projector file.", is_flag=True)
    devices: tuple[int, ...] = opt((), "--devices", "--fit: split layers over cards, e.g. 64GB,64GB.",
                                   click_type="text")
    gpu: tuple[int, ...] = opt((), "--gpu", "--fit with --cpu (GGUF): the cards, e.g. 2x24GB or 24GB,16GB; "
                               "they hold all but the offloaded experts, the cache and --reserve.", click_type="text")
    cpu: int | None = opt(None, "--cpu", "--fit with --gpu (GGUF): host RAM for the routed experts llama.cpp keeps "
                          "on the CPU, token_embd and --cpu-reserve, e.g. 128GB.", click_type="text")
    cpu_reserve: int | None = opt(None, "--cpu-reserve", "Host reserve with --cpu (default 4GB).", click_type="text")
    n_cpu_moe: int | str | None = opt(None, "--n-cpu-moe", "With --cpu: whose experts stay in host RAM: all "
                                      "(default, -ot), N = the first N layers' (llama.cpp --n-cpu-moe N), or auto "
                                      "(the N with the least predicted error).", click_type="text")
    n_seq: int = opt(1, "--seqs", "--fit: parallel sequences (cache slots).", click_type="int", show_default=True)
    progress: bool = opt(True, None, "Show progress bars while measuring.", cli=False)

    def __post_init__(self) -> None:
        cls = type(self)
        set_field(self, "fmt", check_choice(cls, "fmt", str(self.fmt).lower(), FORMATS))
        set_field(self, "overrides", as_tuple(self.overrides))
        set_field(self, "pin", parse_pin(self.pin, flag_of(cls, "pin")))
        targets = [n for n in ("bpw", "size", "qtype") if getattr(self, n) is not None]
        if len(targets) > 1:
            raise InputError("give at most one of --bpw, --size, --type")
        for name in ("bpw", "head_bits", "mtp_bits", "vision_bits"):  # bits as floats, as the command line reads them
            if getattr(self, name) is not None:
                set_field(self, name, float(check_positive(cls, name, getattr(self, name))))
        if self.size is not None:
            set_field(self, "size", parse_size_option("--size", self.size))
        parse_measurement(self, "measure_sample")
        self._check_rules()
        self._check_fit()
        self._check_measure()

    def _check_rules(self) -> None:
        """--tensor-type, --output-tensor-type, --token-embedding-type: parsed as convert parses them, GGUF only."""
        cls = type(self)
        set_field(self, "tensor_type", tensor_type_rules(self.tensor_type))
        for name in ("output_tensor_type", "token_embedding_type"):
            if getattr(self, name) is not None:
                set_field(self, name, encodable_type(getattr(self, name), flag_of(cls, name)))
        if self.type_rules() and self.fmt != "gguf":
            raise InputError("--tensor-type, --output-tensor-type and --token-embedding-type apply to --format gguf")

    def type_rules(self) -> TypeRules:
        """The GGUF type rules of this plan (planning/gguf_rules), as convert applies them."""
        return TypeRules(self.tensor_type, self.output_tensor_type, self.token_embedding_type)

    def _check_fit(self) -> None:
        """--fit and its companions as bytes and tokens; each only where it applies."""
        cls = type(self)
        check_int(cls, "n_seq", self.n_seq)
        if self.context is not None:
            set_field(self, "context", parse_context(self.context))
        if self.reserve is not None:
            set_field(self, "reserve", parse_size_option("--reserve", self.reserve, zero_ok=True))
        devs = self.devices
        if isinstance(devs, str):  # "64GB,64GB" as the command line gives it
            devs = devs.split(",") if devs else ()
        set_field(self, "devices", tuple(parse_size_option(f"--devices {self.devices!r}", d)
                                         for d in as_tuple(devs)))
        self._check_offload()
        if self.fit is None:
            if self.context is not None or self.cache is not None or self.devices:
                raise InputError("--context/--cache/--devices only apply with --fit")
            return
        if self.type_rules():
            raise InputError("--fit plans by role; --tensor-type, --output-tensor-type and --token-embedding-type "
                             "apply to a --type, --bpw or --size plan")
        if self.fit != FIT_OFFLOAD:
            set_field(self, "fit", parse_size_option("--fit", self.fit))
        if self.context is None:
            raise InputError("--fit needs --context TOKENS")
        if self.bpw is not None or self.size is not None or self.qtype is not None:
            raise InputError("--fit plans to the memory left; do not combine it with --bpw, --size or --type")

    def _check_offload(self) -> None:
        """--gpu/--cpu (llama.cpp's expert offload): both or neither, GGUF only, bare --fit or none at all."""
        if self.gpu:
            set_field(self, "gpu", parse_card_sizes("--gpu", self.gpu))
        if self.cpu is not None:
            set_field(self, "cpu", parse_size_option("--cpu", self.cpu))
        if self.cpu_reserve is not None:
            set_field(self, "cpu_reserve", parse_size_option("--cpu-reserve", self.cpu_reserve, zero_ok=True))
        if self.n_cpu_moe is not None and self.n_cpu_moe != "auto":
            n = self.n_cpu_moe
            if str(n).strip().lower() == "all":
                n = None
            elif isinstance(n, str) and n.strip().isdigit():
                n = int(n)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise InputError(f"--n-cpu-moe {self.n_cpu_moe!r}: all, auto or a layer count N >= 0")
            set_field(self, "n_cpu_moe", n)
        offload = bool(self.gpu) or self.cpu is not None
        if not offload:
            if self.fit == FIT_OFFLOAD:
                raise InputError("--fit without a size fits a machine of --gpu cards and --cpu host RAM")
            if self.cpu_reserve is not None or self.n_cpu_moe is not None:
                raise InputError("--cpu-reserve and --n-cpu-moe only apply with --gpu and --cpu")
            return
        if self.fmt == "exl3":
            raise InputError("--cpu: exllamav3 has no expert offload (EXL3 runs on the cards alone); use --fit "
                             "SIZE --devices")
        if not self.gpu or self.cpu is None:
            raise InputError("--gpu and --cpu go together (the cards and the host RAM of llama.cpp's expert offload)")
        if self.fit not in (None, FIT_OFFLOAD):
            raise InputError("--fit SIZE and --gpu/--cpu are two machines: give --fit alone with --gpu and --cpu")
        if self.devices:
            raise InputError("--devices and --gpu both split the cards: give --gpu")
        if self.measure is not None:
            raise InputError("--gpu/--cpu plan each side by the role model; --measure curves are not used there yet")
        set_field(self, "fit", FIT_OFFLOAD)

    def _check_measure(self) -> None:
        """The measurement options that this format and mode use; the others are errors, never dropped."""
        if self.profile is not None and self.measure is None:
            raise InputError("--profile applies to `plan --measure` (a plan alone runs no model)")
        gguf_measured = self.fmt == "gguf" and self.measure in END_TO_END
        if self.rounding != ROUNDINGS[0] and not gguf_measured:
            raise InputError("--rounding applies to `plan --format gguf --measure` (the curves measure it)")
        if self.imatrix is not None and not (gguf_measured or (self.fmt == "gguf" and self.qtype is not None)):
            raise InputError("--imatrix applies to `plan --format gguf --measure` (the curves measure it) and to "
                             "`plan --format gguf --type` (a named mix may choose otherwise with one)")
        if self.fmt == "gguf" and self.measure in ("trellis", "proxy"):
            raise InputError(f"--measure {self.measure} is EXL3's trellis measurement; GGUF measures with "
                             "--measure alone")


@dataclass(frozen=True)
class MeasureOptions:
    """Settings of `mixq.measure`: the error curves of every budgeted unit for `fmt`, measured by `method`
    ("kld" or "stream": end to end, EXL3 or GGUF with the conversion's `rounding` and `imatrix`; "trellis" or
    "proxy": EXL3)
    on `calibration` text, and saved at `out` when given. `device` a torch.device; `sample` the parsed
    (strips, experts) pair."""

    fmt: str = opt("exl3", "--format", "The format the curves plan.", choices=FORMATS)
    method: str = opt(MEASURE_MODES[0], "--method", "kld: each unit's end-to-end KLD, the whole model in memory; "
                      "stream: the same units weighted by one streamed backward, one layer in memory; trellis: the "
                      "per-Linear trellis loss (EXL3); proxy: the Hessian-trace proxy (EXL3).", choices=MEASURE_MODES)
    calibration: tuple[Union[str, Path], ...] = opt((), "--calibration", "Calibration text (repeatable) "
                                                    "[default: built-in sample].", multiple=True,
                                                    click_type="path", must_exist=True)
    out: Union[str, Path, None] = opt(None, "--measure-out", "Save the curves as the JSON --measure FILE reads.",
                                      click_type="path")
    overwrite: bool = opt(False, "--overwrite", "Replace an existing --measure-out file.", is_flag=True)
    sample: Any = opt(DEFAULT_SAMPLE, "--measure-sample", "EXL3: STRIPS,EXPERTS sampled per matrix / per layer, "
                      "'all', or 'auto'.", click_type="text", show_default=True)
    device: torch.device | None = opt(None, "--device", "cuda|cpu [default: cuda when available].",
                                      click_type="text")
    rounding: str = opt(ROUNDINGS[0], "--rounding", "GGUF: the rounding the conversion will use.",
                        choices=ROUNDINGS, show_default=True)
    imatrix: Any = opt(None, "--imatrix", "GGUF: the imatrix the conversion will use (a file, an IMatrix or means).",
                       click_type="path", must_exist=True)
    gguf_ladder: str = opt(GGUF_LADDERS[0], "--gguf-ladder", "GGUF: the candidate types measured.",
                           choices=GGUF_LADDERS, show_default=True)
    progress: bool = opt(True, None, "Show progress bars while measuring.", cli=False)

    def __post_init__(self) -> None:
        cls = type(self)
        set_field(self, "fmt", check_choice(cls, "fmt", str(self.fmt).lower(), FORMATS))
        check_choice(cls, "method", self.method, MEASURE_MODES)
        parse_measurement(self, "sample")
        if self.fmt == "gguf" and self.method not in END_TO_END:
            raise InputError(f"--method {self.method} is EXL3's; GGUF measures with --method "
                             f"{' or '.join(END_TO_END)}")
        if (self.rounding != ROUNDINGS[0] or self.imatrix is not None) and self.fmt != "gguf":
            raise InputError("--rounding and --imatrix apply to a GGUF measurement (the curves measure them)")


def parse_measurement(options, sample: str) -> None:
    """The settings every measurement reads, parsed in place on a frozen options object: the calibration files as a
    tuple, the GGUF ladder and rounding checked, field `sample` as its (strips, experts) pair, the device as a
    torch.device."""
    cls = type(options)
    set_field(options, "calibration", as_tuple(options.calibration))
    check_choice(cls, "gguf_ladder", options.gguf_ladder, GGUF_LADDERS)
    set_field(options, "rounding", check_rounding(options.rounding))
    set_field(options, sample, parse_sample(getattr(options, sample)))
    if options.device is not None:
        set_field(options, "device", parse_device(options.device, flag_of(cls, "device")))
