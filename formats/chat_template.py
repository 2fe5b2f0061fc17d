"""Chat templates for GGUF: check against llama.cpp's C++ Jinja engine, fix what can be fixed, prove the fix.

llama-server renders `tokenizer.chat_template` with llama.cpp's own Jinja engine (common/jinja/ in the llama.cpp
vendored by llama-cpp-python 0.3.36), which accepts less than Python's jinja2. Constructs checked, with their
source in that tree:

  numeric-attr  `x.0`, `m.tool_calls.0.function` (numeric attribute access). jinja2 reads `.0` as `[0]`. The
                C++ lexer reads digits-dot-digits as one float literal (lexer.cpp `consume_numeric`), so `x.0.1`
                becomes member `0.1`, and the runtime accepts a static member only as an identifier or an
                integer literal (runtime.cpp `member_expression::execute_impl`: "Static member property must be
                an identifier"). Tested with that engine compiled from the vendored sources: a single `x.0`
                renders, a chained `x.0.1` is refused. Every `.N` is flagged (plain `x.0` has been reported refused
                too; `[N]` is accepted by every engine). Fix: rewrite every `.N` member access to `[N]` (same meaning in jinja2).
  statement     `{% do %}`, `{% with %}`, `{% include %}`, `{% import %}`, `{% from %}`, `{% extends %}`,
                `{% block %}`, `{% raw %}`, `{% autoescape %}`, `{% trans %}`: the parser knows only set, if, for,
                macro, call, filter, break, continue, generation (parser.cpp `parse_jinja_statement`:
                "Unknown statement"). Not auto-fixable.

`fix_template` rewrites through jinja2's own lexer (string literals and text are never touched) and
`check_render_equal` renders sample conversations (plain chat, system prompt, tools, tool calls, tool results)
with jinja2 before and after: a fix that changes any rendering is an error.

`lint_template` first refuses what the jinja2 environment that renders templates rejects (the one transformers'
apply_chat_template builds: sandboxed, trim_blocks / lstrip_blocks, loop controls, `{% generation %}`,
`raise_exception`, `strftime_now`): a syntax or compile error, or a template that renders none of the sample
conversations. `prepare_template` runs it on every template it prepares; `model_template` finds the template a
model directory carries (the one the GGUF embeds when no other is given) and the file it comes from.
"""
from __future__ import annotations

import difflib
import json
import logging
import traceback
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import gguf
from jinja2 import nodes
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mixq.errors import FormatError
from mixq.formats.model_files import check_tokenizer_files, read_json

UNSUPPORTED_STATEMENTS = ("do", "with", "include", "import", "from", "extends", "block", "raw", "autoescape", "trans")
# the special tokens the sample conversations are rendered with (GLM's bos / eos)
SAMPLE_SPECIAL = {"bos_token": "[gMASK]", "eos_token": "<|endoftext|>"}


@dataclass
class TemplateIssue:
    kind: str      # "numeric-attr" | "statement"
    line: int
    text: str
    fixable: bool

    def __str__(self) -> str:
        return f"line {self.line}: {self.kind} {self.text!r}" + ("" if self.fixable else " (not auto-fixable)")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it (and llama.cpp's engine
    parses it); the body renders as it is."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _env() -> ImmutableSandboxedEnvironment:
    """The environment transformers' apply_chat_template renders with (sandbox, block trimming, loop controls,
    `{% generation %}`, raise_exception, strftime_now)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, **{k: v for k, v in kw.items() if k == "separators"})
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _raise(msg):
    raise TemplateError(msg)


def _render_line(e: BaseException) -> str:
    """", line N" of the innermost template frame of a render error (jinja2 rewrites tracebacks to template
    lines), or "" when none is known."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
    return f", line {lines[-1]}" if lines else ""


def lint_template(source: str, where: str = "chat template") -> None:
    """FormatError naming `where`, with jinja2's line and message, when `source` does not parse or compile in the
    rendering environment, or renders none of the sample conversations (a runtime error on each: a call of
    something undefined, an unconditional raise_exception)."""
    try:
        tmpl = _env().from_string(source)
    except TemplateSyntaxError as e:  # TemplateAssertionError too: an unknown filter or test
        raise FormatError(f"{where}: chat template does not parse (jinja2, line {e.lineno}: "
                          f"{_one_line(e.message)})") from None
    first: Exception | None = None
    for conv in sample_conversations():
        try:
            tmpl.render(**conv, **SAMPLE_SPECIAL)
            return
        except Exception as e:  # noqa: BLE001 - whatever a template raises while rendering
            first = first or e
    raise FormatError(f"{where}: chat template renders none of the sample conversations (jinja2{_render_line(first)}: "
                      f"{type(first).__name__}: {_one_line(str(first))})")


def _one_line(text: str | None) -> str:
    """A jinja2 message on one line (errors are reported as one line)."""
    return " ".join(str(text or "").splitlines())


def model_template(model_dir: str | Path) -> tuple[str | list | None, str]:
    """(template, where): the chat template gguf-py's SpecialVocab reads from `model_dir` (what the GGUF carries
    when no other is given; a list of {"name", "template"} for several) and the file it comes from, as SpecialVocab
    looks: tokenizer_config.json's chat_template, else chat_template.jinja (with additional_chat_templates/),
    else chat_template.json."""
    d = Path(model_dir)
    logging.getLogger("gguf.vocab").setLevel(logging.ERROR)  # its notes on special tokens are not about templates
    check_tokenizer_files(d)  # SpecialVocab's own reads would end a broken file in a traceback
    template = gguf.SpecialVocab(d, load_merges=False).chat_template
    tcfg = d / "tokenizer_config.json"
    cfg = read_json(tcfg, "tokenizer_config.json") if tcfg.is_file() else None
    in_config = isinstance(cfg, dict) and "chat_template" in cfg
    if in_config:
        where = d / "tokenizer_config.json"
    elif (d / "chat_template.jinja").is_file():
        where = d / "chat_template.jinja"
    else:
        where = d / "chat_template.json"
    return template, str(where)


def _tokens(source: str) -> list[tuple[int, str, str]]:
    try:
        return list(_env().lex(source))
    except Exception as e:  # noqa: BLE001 - jinja2 syntax errors of any kind
        raise FormatError(f"chat template does not parse in jinja2: {e}") from e


def check_template(source: str) -> list[TemplateIssue]:
    """Constructs of `source` that llama.cpp's C++ Jinja engine rejects (see the module docstring)."""
    toks = _tokens(source)
    sig = [i for i, t in enumerate(toks) if t[1] != "whitespace"]
    issues: list[TemplateIssue] = []
    for k, i in enumerate(sig):
        line, typ, val = toks[i]
        if typ == "operator" and val == "." and k + 1 < len(sig):
            nxt = toks[sig[k + 1]]
            if nxt[1] in ("integer", "float"):
                prev = toks[sig[k - 1]][2] if k else ""
                issues.append(TemplateIssue("numeric-attr", line, f"{prev}.{nxt[2]}", True))
        if typ == "block_begin" and k + 1 < len(sig):
            nxt = toks[sig[k + 1]]
            if nxt[1] == "name" and nxt[2] in UNSUPPORTED_STATEMENTS:
                issues.append(TemplateIssue("statement", nxt[0], "{% " + nxt[2] + " %}", False))
    return issues


def _code_spans(source: str):
    """(start, end) of the code inside every {{ }} / {% %} tag; comments and {% raw %} bodies are skipped."""
    i, n = 0, len(source)
    while i < n:
        j = source.find("{", i)
        if j < 0 or j + 1 >= n:
            return
        kind = source[j + 1]
        if kind == "#":
            k = source.find("#}", j + 2)
            i = n if k < 0 else k + 2
            continue
        if kind not in "{%":
            i = j + 1
            continue
        close = "}}" if kind == "{" else "%}"
        k, q = j + 2, None
        while k < n:  # find the closing delimiter outside string literals
            c = source[k]
            if q:
                if c == "\\":
                    k += 1
                elif c == q:
                    q = None
            elif c in "'\"":
                q = c
            elif source.startswith(close, k):
                break
            k += 1
        yield j + 2, k
        i = k + 2
        if kind == "%" and source[j + 2:k].strip(" -+").startswith("raw"):
            end = source.find("endraw", i)
            i = n if end < 0 else end


def _fix_code(code: str) -> str:
    out: list[str] = []
    i, q = 0, None
    while i < len(code):
        c = code[i]
        if q:
            out.append(c)
            if c == "\\" and i + 1 < len(code):
                out.append(code[i + 1])
                i += 1
            elif c == q:
                q = None
            i += 1
            continue
        if c in "'\"":
            q = c
        elif c == ".":
            prev = "".join(out).rstrip()
            word = prev[len(prev.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")):]
            j = i + 1
            while j < len(code) and code[j] == " ":
                j += 1
            k = j
            while k < len(code) and code[k].isdigit():
                k += 1
            after_name = prev.endswith(("]", ")")) or (word and not word[0].isdigit())
            if k > j and after_name:  # `.N` member access (not a float literal like 1.5)
                out[:] = [prev, f"[{int(code[j:k])}]"]
                i = k
                continue
        out.append(c)
        i += 1
    return "".join(out)


def fix_template(source: str) -> str:
    """Rewrite numeric attribute access `.N` (and chained `.N.M`) to `[N]` inside template code only."""
    out, last = [], 0
    for a, b in _code_spans(source):
        out += [source[last:a], _fix_code(source[a:b])]
        last = b
    out.append(source[last:])
    return "".join(out)


def sample_conversations() -> list[dict]:
    """Render inputs that exercise chat templates: plain, system, tools, tool calls (dict/str args), tool results."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    call_s = {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    return [
        {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
         "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": "18C sunny"}], "tools": tools, "add_generation_prompt": True},
        {"messages": [{"role": "user", "content": "And Oslo?"},
                      {"role": "assistant", "content": None, "tool_calls": [call_s, call]},
                      {"role": "tool", "content": "3C"}, {"role": "tool", "content": "18C"}],
         "tools": tools, "add_generation_prompt": True},
    ]


def render(source: str, conv: dict, **special) -> str:
    """Render one conversation with jinja2 the way transformers does (bos/eos tokens from `special`)."""
    return _env().from_string(source).render(**conv, **special)


def check_render_equal(original: str, fixed: str, special: dict | None = None) -> int:
    """Render every sample conversation with both templates; raise FormatError on any difference.
    Returns the number of conversations compared (those the original renders at all)."""
    special = special or SAMPLE_SPECIAL
    n = 0
    for k, conv in enumerate(sample_conversations()):
        try:
            a = render(original, conv, **special)
        except Exception:  # noqa: BLE001 - the original may not support every sample (e.g. no tools)
            continue
        try:
            b = render(fixed, conv, **special)
        except Exception as e:  # noqa: BLE001
            raise FormatError(f"fixed chat template fails on sample conversation {k}: {e}") from e
        if a != b:
            raise FormatError(f"fixed chat template renders sample conversation {k} differently")
        n += 1
    if n == 0:
        raise FormatError("chat template renders none of the sample conversations; cannot prove a fix")
    return n


def diff(original: str, fixed: str) -> str:
    return "".join(difflib.unified_diff(original.splitlines(True), fixed.splitlines(True),
                                        "chat_template (original)", "chat_template (fixed)"))


def prepare_template(source: str | list, fix: bool = False, where: str = "chat template") -> dict:
    """Lint (`lint_template`, errors naming `where`), check (and with `fix`, repair and prove) a template, or each
    of a list of {"name", "template"}. Returns {"template", "issues", "fixed", "diff"}: the template to embed, the
    issues found in the original, whether it was rewritten, and the diff."""
    if isinstance(source, list):
        return _prepare_named(source, fix, where)
    lint_template(source, where)
    issues = check_template(source)
    out = {"template": source, "issues": [str(i) for i in issues], "fixed": False, "diff": ""}
    if fix and any(i.fixable for i in issues):
        new = fix_template(source)
        check_render_equal(source, new)
        out.update(template=new, fixed=True, diff=diff(source, new))
        out["remaining"] = [str(i) for i in check_template(new)]
    return out


def _prepare_named(choices: list, fix: bool, where: str) -> dict:
    """`prepare_template` of each named template of a list (tokenizer_config.json's form for several)."""
    out: dict = {"template": [], "issues": [], "fixed": False, "diff": ""}
    for c in choices:
        name = c.get("name") if isinstance(c, dict) else None
        if not isinstance(c, dict) or not isinstance(c.get("template"), str):
            raise FormatError(f"{where}: chat template entry {name or c!r} is not a {{name, template}} text entry")
        rep = prepare_template(c["template"], fix, f"{where} (template {name!r})")
        out["template"].append({**c, "template": rep["template"]})
        out["issues"] += [f"{name}: {i}" for i in rep["issues"]]
        out["fixed"] = out["fixed"] or rep["fixed"]
        out["diff"] += rep["diff"]
        if "remaining" in rep:
            out.setdefault("remaining", []).extend(f"{name}: {i}" for i in rep["remaining"])
    return out
