"""The rooms import downwards only and no module reaches into another's private names.

Every import statement of the package is read from the source (module level and inside functions alike):
formats <- quant <- runtime <- planning <- convert <- eval <- demo <- api <- cli. `mixq/__init__.py` and `__main__.py` sit on top.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOMS = ["errors", "formats", "quant", "runtime", "planning", "convert", "eval", "demo", "api", "cli", "__main__", "__init__"]
PACKAGES = ("formats", "quant", "runtime", "planning", "convert", "eval")


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
            base = node.module or ""
            if node.level:
                pkg = package
                for _ in range(node.level - 1):
                    pkg = pkg.rsplit(".", 1)[0]
                base = pkg + ("." + node.module if node.module else "")
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


def test_the_facade_verbs_are_names_of_mixq():
    import mixq

    for verb in ("inspect", "plan", "measure", "convert", "verify", "evaluate", "compare", "imatrix"):
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
