"""`ConvertResult`: what one conversion wrote, the same type for EXL3 and GGUF (`mixq convert --json` prints it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

COMMON_KEYS = ("format", "out", "files", "bytes", "bpw", "tensors", "seconds", "peak_rss_mib")
EXL3_KEYS = ("bits", "head_bits", "shards", "quantized", "fallbacks", "resumed_stages", "device")
GGUF_KEYS = ("types", "tokenizer_pre", "mtp", "chat_template", "mmproj", "threads", "device")


@dataclass
class ConvertResult:
    """One conversion's output. Common: `out` (EXL3 directory / first .gguf), `files` (every file written),
    `bytes` (EXL3: shard bytes; GGUF: tensor data), `bpw`, `tensors`, `seconds`, `peak_rss_mib`.
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

    def __post_init__(self) -> None:
        if self.format == "exl3":
            if self.bpw is None:
                self.bpw = self.bits
            if not self.files:
                self.files = [f"{self.out.rstrip('/')}/{s}" for s in self.shards]

    def to_dict(self) -> dict:
        """The JSON of `mixq convert --json`: the common keys and those of this result's format."""
        keys = COMMON_KEYS + (EXL3_KEYS if self.format == "exl3" else GGUF_KEYS)
        d = asdict(self)
        return {k: d[k] for k in keys}

    def summary(self) -> str:
        """A few lines for the terminal."""
        return self._exl3_summary() if self.format == "exl3" else self._gguf_summary()

    def _exl3_summary(self) -> str:
        fb = self.fallbacks
        lines = [
            f"EXL3 written to {self.out}",
            f"  size      {self.bytes / 2**20:.2f} MiB in {len(self.shards)} shard(s)",
            f"  bits      {self.bits:.2f} bpw (budgeted Linears), head {self.head_bits}",
            f"  tensors   {self.tensors} ({self.quantized} quantized Linears)",
            f"  time      {self.seconds:.1f} s on {self.device}" + (f", resumed after {self.resumed_stages} stages"
                                                                  if self.resumed_stages else ""),
            f"  peak RSS  {self.peak_rss_mib:.0f} MiB",
            f"  fallbacks {len(fb)}" + (f" (no Hessian: {', '.join(fb[:4])}" + (", ..." if len(fb) > 4 else "")
                                        + ")" if fb else ""),
        ]
        return "\n".join(lines)

    def _gguf_summary(self) -> str:
        types = ", ".join(f"{t} x{n}" for t, n in sorted(self.types.items(), key=lambda kv: -kv[1]))
        lines = [
            f"GGUF written to {self.out}" + (f" ({len(self.files)} files)" if len(self.files) > 1 else ""),
            f"  size      {self.bytes / 2**20:.2f} MiB of tensor data, {self.bpw:.3f} bpw",
            f"  tensors   {self.tensors}: {types}",
            f"  time      {self.seconds:.1f} s, " + (f"encoded on {self.device}" if self.device != "cpu"
                                                  else f"{self.threads} encoder process(es)"),
        ]
        if self.mmproj:
            lines.append(f"  mmproj    {self.mmproj.get('file', self.mmproj)}")
        return "\n".join(lines)
