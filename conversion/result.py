"""`ConvertResult`: what one conversion wrote, the same type for EXL3 and GGUF (`mixq convert --json` prints it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

COMMON_KEYS = ("format", "out", "files", "bytes", "bpw", "tensors", "seconds", "peak_rss_mib", "file_bytes",
               "ref_params", "file_bpw", "memory")
EXL3_KEYS = ("bits", "head_bits", "shards", "quantized", "fallbacks", "resumed_stages", "device")
GGUF_KEYS = ("types", "tokenizer_pre", "mtp", "chat_template", "mmproj", "threads", "device")


@dataclass
class ConvertResult:
    """One conversion's output. Common: `out` (EXL3 directory / first .gguf), `files` (every weight file written),
    `bytes` (EXL3: shard bytes; GGUF: tensor data), `bpw` (EXL3: `bits`; GGUF: tensor data x 8 / its elements),
    `tensors`, `seconds`, `peak_rss_mib`, and mixq's one size figure: `file_bytes` (the bytes of `files` on
    disk), `ref_params` (parameters of the source checkpoint) and `file_bpw` = file_bytes x 8 / ref_params, the
    number `mixq plan` predicts and `mixq eval` reports for the same file.
    EXL3 only: `bits` (quantization_config.bits: budgeted Linears, padded numel, head excluded), `head_bits`,
    `shards` (names in `out`), `quantized` Linears, `fallbacks` (units quantized without a Hessian),
    `resumed_stages`, `device`. GGUF only: `types` ({ggml type: tensors}), `tokenizer_pre`, `mtp`,
    `chat_template` (the template report), `mmproj` (the projector's summary), `threads` (CPU encoder
    processes; 1 when `device` encodes)."""

    out: str
    bytes: int
    tensors: int
    seconds: float
    format: str = "exl3"
    files: list[str] = field(default_factory=list)
    bpw: float | None = None
    peak_rss_mib: float = 0.0
    bits: float | None = None
    head_bits: float | None = None
    shards: list[str] = field(default_factory=list)
    quantized: int = 0
    fallbacks: list[str] = field(default_factory=list)
    resumed_stages: int = 0
    device: str = "cpu"
    types: dict[str, int] = field(default_factory=dict)
    tokenizer_pre: str | None = None
    mtp: bool | None = None
    chat_template: dict | None = None
    mmproj: dict | None = None
    threads: int | None = None
    file_bytes: int = 0
    ref_params: int | None = None
    memory: dict | None = None  # the up-front memory estimate and the pieces (runtime/memory_budget.py)

    def __post_init__(self) -> None:
        if self.format == "exl3":
            if self.bpw is None:
                self.bpw = self.bits
            if not self.files:
                self.files = [f"{self.out.rstrip('/')}/{s}" for s in self.shards]
        if not self.file_bytes:
            self.file_bytes = sum(Path(f).stat().st_size for f in self.files if Path(f).is_file())

    @property
    def file_bpw(self) -> float | None:
        """file_bytes x 8 / ref_params: mixq's one bits-per-weight figure (None without the parameter count)."""
        return self.file_bytes * 8 / self.ref_params if self.ref_params else None

    def to_dict(self) -> dict:
        """The JSON of `mixq convert --json`: the common keys and those of this result's format."""
        keys = COMMON_KEYS + (EXL3_KEYS if self.format == "exl3" else GGUF_KEYS)
        d = {**asdict(self), "file_bpw": self.file_bpw}
        return {k: d[k] for k in keys}

    def summary(self) -> str:
        """The readable report of `mixq convert`: the same lines for both formats, then the commands to try next."""
        what = "EXL3 directory" if self.format == "exl3" else "GGUF"
        n = len(self.files)
        lines = [f"{what} written to {self.out}",
                 f"  size       {self.file_bytes / 2**20:.2f} MiB in {n} file{'s' if n != 1 else ''}"]
        if self.file_bpw is not None:
            lines.append(f"  bpw        {self.file_bpw:.3f} = file bytes x 8 / {self.ref_params:,} model parameters")
        lines += self._exl3_lines() if self.format == "exl3" else self._gguf_lines()
        lines.append(f"  peak RSS   {self.peak_rss_mib:.0f} MiB")
        lines.append(f"next: mixq verify {self.out}   |   mixq eval MODEL {self.out} --text HELD_OUT.txt")
        return "\n".join(lines)

    def _exl3_lines(self) -> list[str]:
        fb = self.fallbacks
        head = "unquantized" if self.head_bits in (None, 16) else f"{self.head_bits:g} bits"
        return [
            f"  trellis    {self.bits:.2f} exllamav3 bits over the budgeted Linears (what --bpw counts), head {head}",
            f"  tensors    {self.tensors} ({self.quantized} quantized Linears)",
            f"  time       {self.seconds:.1f} s on {self.device}" + (f", resumed after {self.resumed_stages} stages"
                                                                   if self.resumed_stages else ""),
            f"  fallbacks  {len(fb)}" + (f" (no Hessian: {', '.join(fb[:4])}" + (", ..." if len(fb) > 4 else "")
                                         + ")" if fb else ""),
        ]

    def _gguf_lines(self) -> list[str]:
        types = ", ".join(f"{t} x{n}" for t, n in sorted(self.types.items(), key=lambda kv: -kv[1]))
        lines = [
            f"  tensors    {self.tensors}: {types}",
            f"  time       {self.seconds:.1f} s, " + (f"encoded on {self.device}" if self.device != "cpu"
                                                   else f"{self.threads} encoder process(es)"),
        ]
        if self.mmproj:
            files = self.mmproj.get("files") or ["?"]
            lines.append(f"  mmproj     {files[0]} ({self.mmproj.get('tensors', '?')} vision tensors)")
        return lines
