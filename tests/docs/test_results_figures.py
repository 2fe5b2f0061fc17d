"""docs/results.md: every figure equals the value in its result file.

Each figure on the page carries an HTML comment right after it, `FIGURE<!--SPEC-->`, where SPEC is
`[FILE#]KEY [OP OPERAND]`:

- FILE is a path under bench/results/; without it, the file of the last `<!-- source: bench/results/FILE -->` line;
- KEY is a `/`-separated path into the JSON (list indices as integers, a space as `%20`);
- OP OPERAND (optional) is `* N`, `/ N`, or `/ KEY2` (another key of the same file): the value shown is
  value OP operand (a percentage is `* 100`, M weights/s is `/ 1e6`, a ratio of two figures is `/ KEY2`).

A number is compared with the value rounded to the decimals shown; a string must equal the value. Every number in a
table's data cells (all but the first column) must carry a marker.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "results.md"
RESULTS = REPO / "bench" / "results"

SOURCE = re.compile(r"<!--\s*source:\s*bench/results/(\S+)\s*-->")
FIGURE = re.compile(r"(?<![\w.])(-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?|[A-Za-z][\w.+-]*)<!--(.*?)-->")
NUMBER = re.compile(r"(?<![\w.#/-])\d[\d,]*(?:\.\d+)?(?![\w])")
_loaded: dict[str, object] = {}


def _load(name: str):
    if name not in _loaded:
        _loaded[name] = json.loads((RESULTS / name).read_text())
    return _loaded[name]


def _lookup(name: str, key: str):
    x = _load(name)
    for part in key.split("/"):
        part = unquote(part)
        x = x[int(part)] if isinstance(x, list) else x[part]
    return x


def _expected(spec: str, current: str | None):
    head, *rest = spec.strip().split(None, 1)
    name, key = head.split("#", 1) if "#" in head else (current, head)
    assert name, f"no result file for {spec!r}"
    value = _lookup(name, key)
    if rest:
        op, operand = rest[0].split(None, 1)
        try:
            other = float(operand)
        except ValueError:
            other = _lookup(name, operand)
        value = value * other if op == "*" else value / other
    return name, key, value


def _matches(shown: str, value) -> bool:
    if isinstance(value, str):
        return shown == value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    text = shown.replace(",", "")
    try:
        number = float(text)
    except ValueError:
        return False
    decimals = len(text.split(".", 1)[1]) if "." in text and "e" not in text.lower() else 0
    return abs(value - number) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12


def figures(text: str):
    """(line number, shown, spec, file, key, value) for every marked figure of the page."""
    current = None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        m = SOURCE.search(line)
        if m:
            current = m.group(1)
            continue
        for fm in FIGURE.finditer(line):
            name, key, value = _expected(fm.group(2), current)
            out.append((n, fm.group(1), fm.group(2), name, key, value))
    return out


def mismatches(text: str):
    return [f"line {n}: {shown} but {name} {key} gives {value!r}"
            for n, shown, _, name, key, value in figures(text) if not _matches(shown, value)]


def unmarked(text: str):
    lines = text.splitlines()
    bad = []
    for n, line in enumerate(lines, 1):
        if not line.startswith("|") or re.fullmatch(r"\|[\s|:-]+\|?", line):
            continue
        if n < len(lines) and re.fullmatch(r"\|[\s|:-]+\|?", lines[n]):
            continue  # a header row
        cells = line.strip().strip("|").split("|")
        for cell in cells[1:]:
            cell = FIGURE.sub("", cell)
            cell = re.sub(r"`[^`]*`", "", cell)
            for m in NUMBER.finditer(cell):
                bad.append(f"line {n}: {m.group(0)} in {cell.strip()!r}")
    return bad


def test_every_figure_equals_its_result_file():
    text = PAGE.read_text()
    assert len(figures(text)) > 150
    assert mismatches(text) == []


def test_every_table_figure_names_its_source():
    assert unmarked(PAGE.read_text()) == []


def test_no_marker_line_splits_a_table():
    """A `<!-- source: -->` line between two rows would end the table where it stands."""
    lines = PAGE.read_text().splitlines()
    split = [n + 1 for n in range(1, len(lines) - 1)
             if lines[n - 1].startswith("|") and lines[n + 1].startswith("|") and not lines[n].startswith("|")]
    assert split == []


def test_result_files_named_on_the_page_exist():
    text = PAGE.read_text()
    for name in set(re.findall(r"bench/results/([\w.+-]+\.json)", text)):
        assert (RESULTS / name).is_file(), name


@pytest.mark.parametrize("index", [0, 7, -1])
def test_an_edited_figure_fails(index):
    text = PAGE.read_text()
    marks = list(FIGURE.finditer(text))
    numeric = [m for m in marks if m.group(1)[0].isdigit()]
    m = numeric[index]
    shown = m.group(1)
    edited = shown[:-1] + ("1" if shown[-1] != "1" else "2")
    assert mismatches(text[: m.start(1)] + edited + text[m.end(1):])
