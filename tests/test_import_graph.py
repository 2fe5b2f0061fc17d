"""The rooms import downwards only and no module reaches into another's private names.

Every import statement of the package is read from the source (module level and inside functions alike):
formats <- quant <- runtime <- planning <- measurement <- conversion <- eval <- demo_run <- api <- cli. `mixq/__init__.py` and `__main__.py` sit on top.
Imports sit at the top of their module: a function-local one is an optional heavy dependency or a listed exception.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOMS = ["errors", "formats", "quant", "runtime", "planning", "measurement", "conversion", "eval", "demo_run", "api",
         "cli", "__main__", "__init__"]
PACKAGES = ("formats", "quant", "runtime", "planning", "measurement", "conversion", "eval")


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` names, relative levels resolved against `package`."""
    base = node.module or ""
    if node.level:
        pkg = package
        for _ in range(node.level - 1):
            pkg = pkg.rsplit(".", 1)[0]
        base = pkg + ("." + node.module if node.module else "")
    return base


def _module_files() -> dict[str, Path]:
    files = {p for d in PACKAGES for p in (REPO / d).rglob("*.py")} | set(REPO.glob("*.py"))
    out = {}
    for p in sorted(files):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out["mixq." + ".".join(parts)] = p
    return out


def _room(module: str) -> str:
    return module.split(".")[1]


def _imports(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of every mixq import in the file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "mixq"]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base.split(".")[0] == "mixq":
                found += [(base, a.name, node.lineno) for a in node.names]
    return found


def test_the_module_map_is_complete():
    mods = _module_files()
    assert {"mixq.api", "mixq.cli", "mixq.formats.checkpoint", "mixq.eval.api"} <= set(mods)
    assert all(_room(m) in ROOMS for m in mods if m != "mixq.__init__"), sorted(mods)


def test_no_room_imports_a_room_above_it():
    mods = _module_files()
    upward = []
    for m, p in mods.items():
        for target, name, line in _imports(m, p):
            full = f"{target}.{name}" if name and f"{target}.{name}" in mods else target
            if full == "mixq" or full not in mods:
                continue  # the package's own names (mixq.errors re-exported), or a name of a module
            if ROOMS.index(_room(full)) > ROOMS.index(_room(m)) and _room(m) != "__init__":
                upward.append(f"{p.relative_to(REPO)}:{line} imports {full}")
    assert upward == []


def test_no_private_name_is_imported_across_modules():
    mods = _module_files()
    private = [f"{p.relative_to(REPO)}:{line} imports {name} from {target}"
               for m, p in mods.items() for target, name, line in _imports(m, p)
               if name and name.startswith("_") and not name.startswith("__") and target != m]
    assert private == []


def test_the_command_line_imports_only_the_api():
    cli = REPO / "cli.py"
    targets = {t for t, _, _ in _imports("mixq.cli", cli)}
    assert targets == {"mixq"}, targets  # `from mixq import api`
    names = {n for t, n, _ in _imports("mixq.cli", cli)}
    assert names == {"api"}, names


def test_eval_imports_no_conversion_module():
    """Scoring reads files and runs the reference forward; it never needs the code that writes them."""
    mods = _module_files()
    found = [f"{p.relative_to(REPO)}:{line} imports {target}" for m, p in mods.items() if _room(m) == "eval"
             for target, _, line in _imports(m, p) if target.startswith("mixq.conversion")]
    assert found == []


def test_every_api_name_is_a_name_of_mixq_after_any_import():
    """`mixq.X` is the façade's X for every name of mixq.api.__all__, also once the rooms are imported (no room
    shares a name with a verb, so an imported package never shadows one)."""
    import subprocess
    import sys

    code = ("import mixq, sys\n"
            "light = not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)\n"
            "first = {n: getattr(mixq, n) for n in mixq.__all__}\n"
            "import mixq.api, mixq.measurement.trellis, mixq.conversion.api, mixq.demo_run, mixq.eval.api\n"
            "bad = [n for n in mixq.api.__all__ if getattr(mixq, n) is not getattr(mixq.api, n)]\n"
            "bad += [n for n, v in first.items() if n in mixq.api.__all__ and v is not getattr(mixq.api, n)]\n"
            "extra = sorted(set(mixq.__all__) - set(mixq.api.__all__) - {'__version__'})\n"
            "print(light, bad, extra)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "[]", "[]"], r.stdout
    import mixq

    for verb in ("inspect", "plan", "measure", "convert", "family", "verify", "evaluate", "compare", "imatrix",
                 "card", "demo"):
        assert callable(getattr(mixq, verb)), verb


KNOWN_CYCLES: list[set[str]] = []  # none left; a new one is a design question, not an entry here


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def test_no_import_cycle_between_files():
    """Function-level imports included: an import moved into a function to dodge a cycle still counts."""
    mods = _module_files()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for target, name, _ in _imports(m, p):
            full = f"{target}.{name}" if name and f"{target}.{name}" in mods else target
            if full in mods and full not in (m, "mixq"):
                edges[m].add(full)
    cycles = _cycles(edges)
    assert [c for c in cycles if c not in KNOWN_CYCLES] == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]  # the finder finds


# Function-local imports allowed in product code; every other import sits at the top of its module.
LOCAL_IMPORT_PREFIXES = ("triton", "llama_cpp", "exllamav3", "matplotlib",  # optional heavy dependencies
                         "transformers")  # a dependency, deferred: `import mixq.cli` does not load it (~0.6 s)
KEPT_LOCAL_IMPORTS = {
    # (file, imported module): why it stays inside its function
    ("__init__.py", "mixq.api"): "the lazy __getattr__ of the facade: `import mixq` stays light",
    ("eval/__init__.py", "mixq.eval.api"): "the package's lazy facade: `import mixq.eval.family` stays light",
    ("eval/__init__.py", "mixq.eval.report"): "the package's lazy facade: `import mixq.eval.family` stays light",
    ("formats/checkpoint.py", "huggingface_hub"): "its download stack (httpx, ~0.13 s at CLI start-up), for hub "
                                                  "repo ids only; a failed import reads as 'could not download'",
    ("quant/trellis/viterbi.py", "mixq.quant.trellis.viterbi_triton"): "imports triton (optional) at its top",
}
PENDING_LOCAL_IMPORTS: set[tuple[str, str]] = set()  # none left


def _local_imports(module: str, tree: ast.AST, mods, is_package: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) of every import statement inside a function body of `tree`."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.Import) and in_function:
                found.extend((a.name, ch.lineno) for a in ch.names)
            elif isinstance(ch, ast.ImportFrom) and in_function:
                base = _absolute(ch, package)
                found.extend((f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base, ch.lineno)
                             for a in ch.names)
            visit(ch, in_function or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _allowed(rel: str, target: str) -> bool:
    return (target.split(".")[0] in LOCAL_IMPORT_PREFIXES or (rel, target) in KEPT_LOCAL_IMPORTS
            or (rel, target) in PENDING_LOCAL_IMPORTS)


def test_imports_sit_at_the_top_of_their_module():
    """No function-local import in product code beyond the optional heavy dependencies and the listed ones."""
    mods = _module_files()
    local, seen = [], set()
    for m, p in mods.items():
        rel = p.relative_to(REPO).as_posix()
        for target, line in _local_imports(m, ast.parse(p.read_text(encoding="utf-8")), mods, p.name == "__init__.py"):
            seen.add((rel, target))
            if not _allowed(rel, target):
                local.append(f"{rel}:{line} imports {target} inside a function")
    assert local == [], "move these to the top of their module (or, for a real reason, list them above)"
    stale = sorted((set(KEPT_LOCAL_IMPORTS) | PENDING_LOCAL_IMPORTS) - seen)
    assert stale == [], f"no longer imported inside a function: drop these from the lists above: {stale}"


def test_the_local_import_finder_finds():
    mods = {"mixq.a": None, "mixq.a.b": None, "mixq.a.c": None}
    tree = ast.parse("import json\n"
                     "def f():\n    import gguf\n    from . import c\n    from .c import X\n"
                     "class K:\n    def g(self):\n        import matplotlib.pyplot as plt\n"
                     "        def h():\n            from mixq.a import b\n")
    assert _local_imports("mixq.a.b", tree, mods) == [("gguf", 3), ("mixq.a.c", 4), ("mixq.a.c", 5),
                                                     ("matplotlib.pyplot", 8), ("mixq.a.b", 10)]
    assert not _allowed("x.py", "gguf") and _allowed("x.py", "matplotlib.pyplot")
    assert not _allowed("x.py", "tritonish") and _allowed("eval/__init__.py", "mixq.eval.api")
