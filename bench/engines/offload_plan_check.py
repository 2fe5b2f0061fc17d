"""Does llama.cpp allocate what `mixq plan --fit --gpu --cpu` plans? The expert-offload plan of glm5next-k256
against the buffers llama.cpp (llama-cpp-python 0.3.36, a CPU build) reports when it loads the planned GGUF.

    python bench/engines/offload_plan_check.py            # -> bench/results/offload_plan_k256.json

Steps: plan the offload (routed experts in host RAM at Q4_K, the rest on two cards); convert k256 with exactly
the planned types (BF16 base + one --tensor-type rule per quantized tensor; the written types are read back with
gguf-py and must equal the plan's); load it in llama.cpp with the plan's override patterns and context and
parse the buffer sizes from its log.

What a CPU build can show: (1) the tensors llama.cpp's own regex engine selects with the plan's -ot patterns
(its "buffer type overridden" debug lines) are the plan's host-side experts, at the planned types; (2) their
bytes as llama.cpp allocates them, and the bytes of everything else: the overrides point at the CPU's repack
buffer type (a buffer of its own, "CPU_REPACK", which holds Q4_K without changing its size) while extra buffer
types are off for the rest (one "CPU" buffer; loaded with --load-mode none, as the plan's flags say, since a
mapped buffer spans the file from its first to its last tensor, experts included); (3) the cache buffers at the
planned context. What it cannot show: which card each layer lands on (-ts), the CUDA buffers, and token_embd
staying on the CPU beside GPU layers (everything is on the CPU here); those numbers need a CUDA build.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import REPO, SHARED, repo_relative  # noqa: E402

from mixq.formats.gguf_names import TOKEN_EMBD  # noqa: E402
from mixq.formats.gguf_layout import FLOAT_TYPES  # noqa: E402

MIB = 1024 * 1024
CONTEXT = 4096
N_SEQ = 4          # four recurrent-state rows: large enough that the log's 0.01 MiB rounding stays below 1%
CACHE = "f16"
# host budget: the experts at Q4_K and token_embd (BF16) fit, the next step of one expert tensor does not
GPU = "2x7MB"
RESERVE = 10**6
CPU_RESERVE = 10**6

PROBE = textwrap.dedent(r"""
    import ctypes, json, sys
    from pathlib import Path
    import llama_cpp as L
    gguf, n_ctx, n_seq, ktype, patterns, load_mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6])
    lib = Path(L.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"))
    ggml = ctypes.CDLL(str(lib / "libggml.so"))
    vp = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.restype = vp; ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    base.ggml_backend_dev_backend_reg.restype = vp; base.ggml_backend_dev_backend_reg.argtypes = [vp]
    base.ggml_backend_reg_get_proc_address.restype = vp
    base.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p; base.ggml_backend_buft_name.argtypes = [vp]
    L.llama_backend_init()
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    reg = base.ggml_backend_dev_backend_reg(cpu)
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(
        base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts"))
    extra, k = get_extra(cpu), 0
    repack = None
    while extra[k]:
        if base.ggml_backend_buft_name(extra[k]) == b"CPU_REPACK":
            repack = extra[k]
        k += 1
    cpu_lib = ctypes.CDLL(str(lib / "libggml-cpu.so"))
    if not repack or not (cpu_lib.ggml_cpu_has_avx2() or cpu_lib.ggml_cpu_has_neon()):
        print("no Q4_K repack buffer type on this CPU or build"); sys.exit(3)
    class Override(ctypes.Structure):
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", vp)]
    ov = (Override * (len(patterns) + 1))(*[Override(p.encode(), repack) for p in patterns], Override(None, None))
    mp = L.llama_model_default_params()
    mp.tensor_buft_overrides = ctypes.cast(ov, vp)
    mp.use_extra_bufts = False   # the tensors no override selects: one plain CPU buffer
    mp.load_mtp = True           # the NextN block too: the plan counts it
    mp.load_mode = load_mode
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    assert model, "model did not load"
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx; cp.n_seq_max = n_seq; cp.n_batch = 64; cp.n_ubatch = 64
    cp.type_k = cp.type_v = ktype
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "context was not created"
    L.llama_free(ctx); L.llama_model_free(model)
""")
GGML_CACHE_TYPES = {"f16": 1, "q8_0": 8}
LOAD_MODES = {False: 0, True: 1}  # llama_load_mode: NONE, MMAP


class NoRepack(RuntimeError):
    """llama.cpp here has no CPU buffer type that repacks Q4_K (an x86 CPU without AVX2, say): no separate buffer
    for the overridden tensors."""


def plan_k256(model: Path):
    """The offload plan of k256: experts in host RAM at Q4_K, everything else on two 7 MB cards."""
    from mixq.formats.checkpoint import open_checkpoint
    from mixq.planning import gguf_mix as gm
    from mixq.planning.offload import offload_plan

    ckpt = open_checkpoint(model)
    experts = [n for n in ckpt.names() if ckpt.info(n).role == "routed_expert"]
    q4k = sum(gm.tensor_nbytes("Q4_K", ckpt.shape(n)) for n in experts)
    embd = 2 * ckpt.text_config["vocab_size"] * ckpt.text_config["hidden_size"]  # token_embd stays BF16
    cpu = CPU_RESERVE + q4k + embd + 65536  # less than one expert tensor's step from Q4_K to Q5_K
    return offload_plan(ckpt, gpu=GPU, cpu=cpu, context=CONTEXT, cache=CACHE, reserve=RESERVE,
                        cpu_reserve=CPU_RESERVE, n_seq=N_SEQ)


def convert_as_planned(model: Path, plan, out: Path) -> dict[str, str]:
    """Write k256 with the plan's types (BF16 base, one exact-name rule per quantized tensor) and return the types
    gguf-py reads back from the file."""
    import gguf

    from mixq.conversion.gguf.pipeline import convert_gguf

    rules = [f"^{re.escape(t.name)}$={t.type}" for t in plan.tensors if t.type not in FLOAT_TYPES]
    convert_gguf(model, out, qtype="BF16", tensor_type=rules, progress=False)
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}


def llama_cpp_buffers(gguf_path: Path, patterns, n_ctx: int, n_seq: int, cache: str, mmap: bool = False) -> dict:
    """Load `gguf_path` in llama.cpp with `patterns` overridden to their own buffer (``--load-mode none``, as the
    plan's flags say, or ``mmap``); parse its log."""
    r = subprocess.run([sys.executable, "-c", PROBE, str(gguf_path), str(n_ctx), str(n_seq),
                        str(GGML_CACHE_TYPES[cache]), json.dumps(list(patterns)), str(LOAD_MODES[mmap])],
                       capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    if r.returncode == 3:
        raise NoRepack(log.strip().splitlines()[-1])
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp probe failed ({r.returncode}): {log[-3000:]}")
    buffers: dict[str, float] = {}
    for name, mib in re.findall(r"load_tensors:\s+(\S+) model buffer size =\s*([\d.]+) MiB", log):
        buffers[name] = buffers.get(name, 0.0) + float(mib) * MIB
    overridden = re.findall(r"tensor (\S+) \(\d+ MiB (\w+)\) buffer type overridden to (\S+)", log)
    kv = [float(m) * MIB for m in re.findall(r"llama_kv_cache: size =\s*([\d.]+) MiB", log)]
    rs = [float(m) * MIB for m in re.findall(r"llama_memory_recurrent: size =\s*([\d.]+) MiB", log)]
    compute = {n: float(m) * MIB for n, m in re.findall(r"(\S+) compute buffer size =\s*([\d.]+) MiB", log)}
    if not buffers or not kv or not rs:
        raise RuntimeError(f"llama.cpp's log lacks buffer sizes: {log[-3000:]}")
    return {"model_buffers": buffers, "overridden": [list(x) for x in overridden], "kv": sum(kv),
            "recurrent": sum(rs), "compute_buffers": compute}


def compare(res, file_types: dict[str, str], got: dict) -> dict:
    """The plan's bytes beside llama.cpp's, side by side (relative differences)."""
    from mixq.planning.offload import side_function

    side_of = side_function(res.patterns)
    plan_types = {t.name: t.type for t in res.plan.tensors}
    host_experts = sorted(t.name for t in res.plan.tensors if side_of(t.name) == "cpu" and t.name != TOKEN_EMBD)
    host_bytes = sum(t.bytes for t in res.plan.tensors if t.name in set(host_experts))
    rest_bytes = sum(t.bytes for t in res.plan.tensors) - host_bytes
    rel = lambda a, b: (a - b) / b  # noqa: E731
    return {
        "types_written_equal_planned": file_types == plan_types,
        "overridden_tensors": sorted(n for n, _, _ in got["overridden"]),
        "overridden_equal_plan_host_experts": sorted(n for n, _, _ in got["overridden"]) == host_experts,
        "overridden_types_equal_plan": all(plan_types[n] == t.upper() for n, t, _ in got["overridden"]),
        "host_experts": {"plan": host_bytes, "llama_cpp": got["model_buffers"].get("CPU_REPACK", 0.0),
                         "rel": rel(got["model_buffers"].get("CPU_REPACK", 0.0), host_bytes)},
        "rest_weights": {"plan": rest_bytes, "llama_cpp": got["model_buffers"].get("CPU", 0.0),
                         "rel": rel(got["model_buffers"].get("CPU", 0.0), rest_bytes),
                         "note": "the cards' weights + token_embd (all on the CPU in a CPU build)"},
        "kv": {"plan": res.cache.mla + res.cache.indexer, "llama_cpp": got["kv"],
               "rel": rel(got["kv"], res.cache.mla + res.cache.indexer)},
        "recurrent": {"plan": res.cache.fixed, "llama_cpp": got["recurrent"],
                      "rel": rel(got["recurrent"], res.cache.fixed)},
        "compute_buffers_logged": got["compute_buffers"],
    }


def run(model: Path, work: Path) -> dict:
    """Plan, convert, load, compare; the JSON the result file holds."""
    res = plan_k256(model)
    out = work / "k256-offload.gguf"
    file_types = convert_as_planned(model, res.plan, out)
    got = llama_cpp_buffers(out, res.patterns, res.context, N_SEQ, CACHE)
    mapped = llama_cpp_buffers(out, res.patterns, res.context, N_SEQ, CACHE, mmap=True)["model_buffers"]
    return {"model": model, "context": res.context, "n_seq": N_SEQ, "cache": CACHE, "gpu": GPU,
            "flags": res.flags(), "devices": [d.to_dict() for d in res.devices],
            "expert_types": sorted({t.type for t in res.plan.tensors if t.role == "routed_expert"}),
            "check": compare(res, file_types, got), "llama_cpp_log": got,
            "mmap_model_buffers": mapped, "tensor_data_bytes": sum(t.bytes for t in res.plan.tensors),
            "mmap_note": "with mmap the plain buffer maps the file from its first to its last tensor of that "
                         "buffer type: the experts between them are counted there too",
            "engine": "llama-cpp-python 0.3.36 (CPU build)",
            "gpu_only": "which card each layer lands on (-ts), the CUDA0/CUDA1 model, cache and compute buffers, "
                        "and token_embd on the CPU beside offloaded layers need a CUDA build"}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = run(SHARED / "models" / "glm5next-k256", Path(tmp))
    out = REPO / "bench" / "results" / "offload_plan_k256.json"
    out.write_text(json.dumps(repo_relative(result), indent=1, default=str) + "\n")
    c = result["check"]
    print(json.dumps({k: c[k] for k in ("host_experts", "rest_weights", "kv", "recurrent")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
