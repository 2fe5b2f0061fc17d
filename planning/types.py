"""The plan contract: every tensor's bits (EXL3) or ggml type (GGUF) and bytes, and its JSON (docs/INTERNALS.md)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from mixq.errors import InputError
from mixq.formats.atomic import write_json
from mixq.formats.glm5next import ROLES
from mixq.formats.model_files import read_json

# bits of lm_head and of the NextN/MTP block when not given: exllamav3's defaults, which mixq's GGUF plans share
DEFAULT_HEAD_BITS = 6
DEFAULT_MTP_BITS = 4


@dataclass
class PlannedTensor:
    name: str               # EXL3: HF tensor name; GGUF: GGUF tensor name
    role: str
    hf_names: list[str]     # the source tensors (several for stacked GGUF experts / fused EXL3 keys)
    shape: tuple[int, ...]
    bits: float | None      # EXL3 trellis K; None when stored unquantized
    type: str               # GGUF: ggml type name; EXL3: "trellis" or the storage dtype ("fp16", "fp32", "bf16")
    bytes: int


@dataclass
class Plan:
    format: str             # "exl3" | "gguf"
    total_bytes: int
    bpw: float
    tensors: list[PlannedTensor]
    roles: dict[str, dict]  # role -> {"tensors", "params", "bytes", "bpw"}
    ref_params: int | None = None  # parameters of the source checkpoint (every tensor; plan_model sets it)

    @property
    def params(self) -> int:
        return sum(numel(t.shape) for t in self.tensors)

    @property
    def file_bpw(self) -> float:
        """mixq's one bits-per-weight figure: file bytes (total_bytes, headers included) x 8 / the source
        checkpoint's parameters (`ref_params`; the planned tensors' own count when unknown). `mixq convert` and
        `mixq eval` report the same figure of the written file."""
        p = self.ref_params or self.params
        return self.total_bytes * 8 / p if p else 0.0

    def to_dict(self) -> dict:
        """The JSON of ``mixq plan --json``, with ``file_bpw`` and ``params``."""
        tensors = []
        for t in self.tensors:
            d = {"name": t.name, "role": t.role}
            if self.format == "exl3":
                d["bits"] = t.bits
                d["storage"] = t.type
            else:
                d["type"] = t.type
            d.update(bytes=t.bytes, shape=list(t.shape), hf_names=list(t.hf_names))
            tensors.append(d)
        return {"format": self.format, "total_bytes": self.total_bytes, "bpw": round(self.bpw, 4),
                "file_bpw": round(self.file_bpw, 4), "params": self.params, "ref_params": self.ref_params,
                "tensors": tensors, "roles": self.roles}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        fmt = d["format"]
        tensors = [PlannedTensor(name=t["name"], role=t["role"], hf_names=list(t.get("hf_names") or [t["name"]]),
                                 shape=tuple(t.get("shape") or ()), bits=t.get("bits"),
                                 type=t.get("type") or t.get("storage") or ("trellis" if t.get("bits") else ""),
                                 bytes=int(t["bytes"])) for t in d["tensors"]]
        return cls(format=fmt, total_bytes=int(d["total_bytes"]), bpw=float(d["bpw"]), tensors=tensors,
                   roles=dict(d.get("roles") or {}), ref_params=d.get("ref_params"))


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def role_summary(tensors: Sequence[PlannedTensor]) -> dict[str, dict]:
    """role -> {"tensors", "params", "bytes", "bpw"} (bpw = bytes·8 / params of that role)."""
    roles: dict[str, dict] = {}
    for t in tensors:
        r = roles.setdefault(t.role, {"tensors": 0, "params": 0, "bytes": 0, "bpw": 0.0})
        r["tensors"] += 1
        r["params"] += numel(t.shape)
        r["bytes"] += t.bytes
    for r in roles.values():
        r["bpw"] = round(r["bytes"] * 8 / r["params"], 4) if r["params"] else 0.0
    order = {k: i for i, k in enumerate(ROLES)}
    return dict(sorted(roles.items(), key=lambda kv: order.get(kv[0], 99)))


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan JSON under a temporary name, then rename."""
    write_json(path, plan.to_dict(), indent=1, newline=False)


def load_plan(path: str | Path) -> Plan:
    """A plan JSON written by ``save_plan`` (or ``mixq plan --json``); anything else is an InputError."""
    d = read_json(path, "plan JSON")
    try:
        return Plan.from_dict(d)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{path}: not a mixq plan JSON ({e})") from None
