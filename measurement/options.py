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
from mixq.measurement.trellis import DEFAULT_SAMPLE, MEASURE_MODES, parse_sample
from mixq.planning.gguf_mix import LADDERS
from mixq.planning.gguf_rules import RULE_FLAGS, TypeRules, encodable_type, tensor_type_rules
from mixq.planning.option_fields import (as_tuple, check_choice, check_int, check_positive, flag_of, opt,
                                         set_field)
from mixq.planning.sizes import parse_context, parse_size_option
from mixq.planning.types import DEFAULT_HEAD_BITS, DEFAULT_MTP_BITS
from mixq.quant.device import parse_device

FORMATS = ("exl3", "gguf")
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
    qtype: str | None = opt(None, "--type", "GGUF: a llama-quantize mix (Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, Q8_0).",
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
        "EXL3 sensitivity mode. Alone (= 'kld'): a calibration pass measures each unit's loss at every "
        "rate with the trellis quantizer, scaled to the unit's end-to-end KLD (holds the model in "
        "memory); 'trellis' = the per-Linear loss alone (for models that do not fit; it mis-ranks "
        "units); 'proxy' = the cheap Hessian-trace proxy; or a JSON file of curves {unit: {bits: error}}.",
        click_type="text", flag_value=MEASURE_MODES[0])
    measure_out: Union[str, Path, None] = opt(None, "--measure-out",
                                              "--measure: save the measured curves as JSON for reuse.",
                                              click_type="path")
    overwrite: bool = opt(False, "--overwrite", "Replace an existing --measure-out file.", is_flag=True)
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
    imatrix: Any = opt(None, "--imatrix", "GGUF --measure: the imatrix the conversion will use.",
                       click_type="path", must_exist=True)
    fit: int | None = opt(None, "--fit", "Memory to fit (weights + cache + reserve), e.g. 121GB.", click_type="text")
    context: int | None = opt(None, "--context", "Context length for --fit, e.g. 262144 or 256K.",
                              click_type="text")
    cache: str | None = opt(None, "--cache", "Cache type: llama.cpp f16/q8_0/q4_0/...; exllamav3 fp16/q8/q6/q4.",
                            click_type="text")
    reserve: int | None = opt(None, "--reserve", "Compute/scratch reserve for --fit (default 4GB).",
                              click_type="text")
    mmproj: bool = opt(False, "--mmproj", "--fit: also hold the GGUF vision projector file.", is_flag=True)
    devices: tuple[int, ...] = opt((), "--devices", "--fit: split layers over cards, e.g. 64GB,64GB.",
                                   click_type="text")
    n_seq: int = opt(1, "--seqs", "--fit: parallel sequences (cache slots).", click_type="int", show_default=True)
    progress: bool = opt(True, None, "Show progress bars while measuring.", cli=False)

    def __post_init__(self) -> None:
        cls = type(self)
        set_field(self, "fmt", check_choice(cls, "fmt", str(self.fmt).lower(), FORMATS))
        set_field(self, "overrides", as_tuple(self.overrides))
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
        if self.fit is None:
            if self.context is not None or self.cache is not None or self.devices:
                raise InputError("--context/--cache/--devices only apply with --fit")
            return
        if self.type_rules():
            raise InputError("--fit plans by role; --tensor-type, --output-tensor-type and --token-embedding-type "
                             "apply to a --type, --bpw or --size plan")
        set_field(self, "fit", parse_size_option("--fit", self.fit))
        if self.context is None:
            raise InputError("--fit needs --context TOKENS")
        if self.bpw is not None or self.size is not None or self.qtype is not None:
            raise InputError("--fit plans to the memory left; do not combine it with --bpw, --size or --type")

    def _check_measure(self) -> None:
        """The measurement options that this format and mode use; the others are errors, never dropped."""
        if (self.rounding != ROUNDINGS[0] or self.imatrix is not None) and not (
                self.fmt == "gguf" and self.measure == "kld"):
            raise InputError("--rounding and --imatrix apply to `plan --format gguf --measure` (the curves measure "
                             "them)")
        if self.fmt == "gguf" and self.measure in ("trellis", "proxy"):
            raise InputError(f"--measure {self.measure} is EXL3's trellis measurement; GGUF measures with "
                             "--measure alone")


@dataclass(frozen=True)
class MeasureOptions:
    """Settings of `mixq.measure`: the error curves of every budgeted unit for `fmt`, measured by `method`
    ("kld": end to end, EXL3 or GGUF with the conversion's `rounding` and `imatrix`; "trellis" or "proxy": EXL3)
    on `calibration` text, and saved at `out` when given. `device` a torch.device; `sample` the parsed
    (strips, experts) pair."""

    fmt: str = opt("exl3", "--format", "The format the curves plan.", choices=FORMATS)
    method: str = opt(MEASURE_MODES[0], "--method", "kld: each unit's end-to-end KLD; trellis: the per-Linear "
                      "trellis loss (EXL3); proxy: the Hessian-trace proxy (EXL3).", choices=MEASURE_MODES)
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
        if self.fmt == "gguf" and self.method != "kld":
            raise InputError(f"--method {self.method} is EXL3's; GGUF measures with --method kld")
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
