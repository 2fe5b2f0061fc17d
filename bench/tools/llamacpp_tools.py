"""Build llama.cpp's command-line tools (llama-quantize, llama-imatrix, optionally llama-server) from the
llama.cpp vendored in the llama-cpp-python 0.3.36 sdist, and record their paths.

Why: llama.cpp's C API takes an importance matrix only as a C++ map that ctypes cannot build, so the
"llama.cpp quantizer with an imatrix" rows of bench/quality/kld_vs_size.py need the `llama-quantize` tool.

    python bench/tools/llamacpp_tools.py                   # build (or reuse) and print the paths
    python bench/tools/llamacpp_tools.py --server          # also llama-server (slow: the HTTP server and its UI)
    python bench/tools/llamacpp_tools.py --print           # only print what TOOLS.txt records

Defaults (VENDOR = $MIXQ_VENDOR, else ../vendor next to the repo): sources
VENDOR/llama_cpp_python-0.3.36/vendor/llama.cpp (unpacked from the sdist when only
VENDOR/llama_cpp_python-0.3.36.tar.gz exists), build dir VENDOR/llama-build, paths written to
VENDOR/TOOLS.txt as NAME=PATH lines. Portable build: -DGGML_NATIVE=OFF (a native build on an AMX CPU
crashes on Q8_0/Q4_0 weights of glm5-next, reference/gguf-glm5-next.md §6.4), static libraries, no curl/SSL.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from paths import VENDOR  # noqa: E402

from mixq.formats.atomic import write_text  # noqa: E402

SDIST_NAME = "llama_cpp_python-0.3.36"
BUILD = VENDOR / "llama-build"
TOOLS_TXT = VENDOR / "TOOLS.txt"
TARGETS = ("llama-quantize", "llama-imatrix")


def source_dir(vendor: Path = VENDOR) -> Path:
    """The vendored llama.cpp tree, unpacking the sdist next to it if needed."""
    src = vendor / SDIST_NAME / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    tgz = vendor / f"{SDIST_NAME}.tar.gz"
    if not tgz.is_file():
        raise SystemExit(f"neither {src} nor {tgz} exists: `pip download --no-deps --no-binary :all: "
                         f"llama-cpp-python==0.3.36 -d {vendor}` first")
    with tarfile.open(tgz) as t:
        t.extractall(vendor, filter="data")
    return src


def build(targets=TARGETS, *, src: Path | None = None, build_dir: Path = BUILD, jobs: int = 2) -> dict[str, Path]:
    """Configure (once) and build `targets`; returns {target: binary path}."""
    src = src or source_dir()
    if not (build_dir / "CMakeCache.txt").is_file():
        cfg = ["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
               "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF"]
        subprocess.run(cfg, check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs)], check=True)
    out = {}
    for t in targets:
        p = build_dir / "bin" / t
        if not p.is_file():
            raise SystemExit(f"build finished but {p} is missing")
        out[t] = p
    return out


def read_tools(path: Path = TOOLS_TXT) -> dict[str, Path]:
    """{name: path} from TOOLS.txt (empty when absent); only existing binaries."""
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                if Path(v.strip()).is_file():
                    out[k.strip()] = Path(v.strip())
    return out


def find_tool(name: str) -> Path | None:
    """Path of a built llama.cpp tool: TOOLS.txt, the default build dir, then ~/.cache/mixq/NAME (the quick build
    linked against llama-cpp-python's libllama that tests/conversion/test_gguf_llamacpp.py makes)."""
    p = read_tools().get(name)
    if p:
        return p
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mixq" / name
    for q in (BUILD / "bin" / name, cache):
        if q.is_file():
            return q
    return None


def write_tools(paths: dict[str, Path], path: Path = TOOLS_TXT) -> None:
    have = read_tools(path)
    have.update(paths)
    lines = ["# llama.cpp tools built by bench/tools/llamacpp_tools.py from llama-cpp-python 0.3.36's vendored llama.cpp "
             "(-DGGML_NATIVE=OFF, static)"] + [f"{k}={v}" for k, v in sorted(have.items())]
    write_text(path, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="store_true", help="also build llama-server")
    ap.add_argument("--perplexity", action="store_true", help="also build llama-perplexity")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--build-dir", type=Path, default=BUILD)
    ap.add_argument("--print", dest="only_print", action="store_true", help="print TOOLS.txt's paths, build nothing")
    a = ap.parse_args(argv)
    if not a.only_print:
        targets = list(TARGETS) + (["llama-server"] if a.server else []) + (["llama-perplexity"] if a.perplexity else [])
        write_tools(build(targets, build_dir=a.build_dir, jobs=a.jobs))
    tools = read_tools()
    if not tools:
        print(f"no tools recorded in {TOOLS_TXT}", file=sys.stderr)
        return 1
    for k, v in sorted(tools.items()):
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
