"""sha256 of a fixed set of mixq outputs (GGUF + imatrix, EXL3 on a tiny model, plan JSONs).

Run it before and after a change that must not alter any output; the two JSON files must be equal:

    python bench/tools/output_digests.py --out ../bench-work/digests-before --json before.json
    python bench/tools/output_digests.py --out ../bench-work/digests-after --json after.json
    python bench/tools/output_digests.py --diff before.json after.json
    python bench/tools/output_digests.py --tensor-diff before/x.gguf after/x.gguf     # which tensors changed

Uses the trained fixtures (``../shared/models`` or ``$MIXQ_SHARED/models``) and the CLI, as a user would.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gguf import GGUFReader

REPO = Path(__file__).resolve().parents[2]


def shared_dir() -> Path:
    env = os.environ.get("MIXQ_SHARED")
    return Path(env) if env else REPO.parent / "shared"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_digest(path: Path) -> str:
    """sha256 of a GGUF's tensors alone (name, type, shape and data of each, in file order): equal when two files
    differ only in their metadata keys."""
    h = hashlib.sha256()
    for t in GGUFReader(path).tensors:
        h.update(f"{t.name}:{t.tensor_type.name}:{list(t.shape)}".encode())
        h.update(t.data.tobytes())
    return h.hexdigest()


def tensor_changes(before: Path, after: Path) -> list[str]:
    """The tensors of two GGUF files that differ (type, shape or data), and those only one of them holds."""
    def table(path: Path) -> dict[str, tuple]:
        return {t.name: (t.tensor_type.name, list(t.shape), hashlib.sha256(t.data.tobytes()).hexdigest())
                for t in GGUFReader(path).tensors}
    b, a = table(before), table(after)
    return [n for n in sorted(set(b) | set(a)) if b.get(n) != a.get(n)]


def manifest_digest(path: Path) -> str:
    """sha256 of an EXL3 manifest without its job fingerprint and seal, which follow from the source's absolute
    path: equal for two work directories."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("fingerprint", "manifest_sha256")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return hashlib.sha256(json.dumps(strip(json.loads(path.read_text())), sort_keys=True).encode()).hexdigest()


def mixq(*args: str, cwd: Path | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "mixq", *args], capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        raise SystemExit(f"mixq {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def digest_dir(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): sha256(p) for p in sorted(d.rglob("*")) if p.is_file()}


def run(out: Path, models: list[str], exl3_tiny: bool) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    shared = shared_dir()
    calib = str(shared / "data" / "calibration.txt")
    res: dict[str, str] = {}
    for name in models:
        m = str(shared / "models" / name)
        t = time.time()
        imat = out / f"{name}.imatrix.gguf"
        mixq("imatrix", m, str(imat), "--calibration", calib, "--rows", "8", "--seq-len", "128", "--device", "cpu",
             "--overwrite")
        res[f"{name}.imatrix.gguf"] = sha256(imat)
        gg = out / f"{name}-Q4_K_M.gguf"
        # the imatrix by its name inside OUT: the file records it (quantize.imatrix.file), so two work directories
        # give the same bytes
        mixq("convert", m, gg.name, "--format", "gguf", "--type", "Q4_K_M", "--imatrix", imat.name, "--threads", "1",
             "--overwrite", cwd=out)
        res[f"{name}-Q4_K_M-imatrix.gguf"] = sha256(gg)
        res[f"{name}-Q4_K_M-imatrix.gguf#tensors"] = tensor_digest(gg)
        for label, args in {
            "plan-exl3-3.05": ["--format", "exl3", "--bpw", "3.05"],
            "plan-gguf-Q4_K_M": ["--format", "gguf", "--type", "Q4_K_M"],
            "plan-gguf-bpw5": ["--format", "gguf", "--bpw", "5.0"],
            **({"plan-gguf-bpw3-iq": ["--format", "gguf", "--bpw", "3.0", "--gguf-ladder", "iq"]}
               if name.endswith("k256") else {}),
        }.items():
            res[f"{name}.{label}.json"] = hashlib.sha256(mixq("plan", m, *args, "--json").encode()).hexdigest()
        print(f"{name}: {time.time() - t:.0f} s", file=sys.stderr)
    flash = str(shared / "models" / "glm-5.3-flash-shape" / "config.json")
    for label, args in {
        "plan-exl3-108GB": ["--format", "exl3", "--size", "108GB"],
        "plan-gguf-108GB-iq": ["--format", "gguf", "--size", "108GB", "--gguf-ladder", "iq"],
    }.items():
        res[f"glm-5.3-flash.{label}.json"] = hashlib.sha256(
            mixq("plan", "--from-config", flash, *args, "--json").encode()).hexdigest()
    if exl3_tiny:
        t = time.time()
        tiny = out / "tiny-src"
        if not tiny.exists():
            subprocess.run([sys.executable, "-c",
                            "import sys; from mixq.formats.tiny import write_tiny_checkpoint as w; "
                            "w(sys.argv[1], layer_types=('linear_attention','deepseek_sparse_attention'), "
                            "vision=False, vocab=512)", str(tiny)], check=True)
        for p, h in digest_dir(tiny).items():
            res[f"tiny-src/{p}"] = h
        ex = out / "tiny-exl3-3.05"
        mixq("convert", str(tiny), str(ex), "--format", "exl3", "--bpw", "3.05", "--rows", "4", "--seq-len", "32",
             "--device", "cpu")
        for p, h in digest_dir(ex).items():
            if p == "mixq_manifest.json":  # its job fingerprint records the source's absolute path (under --out)
                p, h = f"{p}#without-fingerprint", manifest_digest(ex / p)
            res[f"tiny-exl3-3.05/{p}"] = h
        print(f"tiny exl3: {time.time() - t:.0f} s", file=sys.stderr)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="Work directory for the outputs.")
    ap.add_argument("--json", type=Path, help="Write the {output: sha256} table here.")
    ap.add_argument("--models", default="glm5next-mini,glm5next-k256")
    ap.add_argument("--no-exl3", action="store_true", help="Skip the tiny-model EXL3 conversion (~2-5 min on CPU).")
    ap.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="Compare two tables.")
    ap.add_argument("--tensor-diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="Compare two GGUF files tensor by tensor: the names whose type, shape or data differ.")
    a = ap.parse_args()
    if a.tensor_diff:
        changed = tensor_changes(*a.tensor_diff)
        print("\n".join(changed) + ("\n" if changed else "") + f"{len(changed)} tensors differ")
        sys.exit(1 if changed else 0)
    if a.diff:
        b, c = (json.loads(p.read_text()) for p in a.diff)
        bad = 0
        for k in sorted(set(b) | set(c)):
            same = b.get(k) == c.get(k)
            bad += not same
            print(f"| {k} | {(b.get(k) or '-')[:16]} | {(c.get(k) or '-')[:16]} | {'same' if same else 'DIFFERENT'} |")
        print(f"{len(set(b) | set(c)) - bad} identical, {bad} different")
        sys.exit(1 if bad else 0)
    if a.out is None:
        ap.error("--out is required")
    res = run(a.out, [m for m in a.models.split(",") if m], not a.no_exl3)
    text = json.dumps(res, indent=2, sort_keys=True) + "\n"
    if a.json:
        a.json.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
