"""Render the gpupool Helm chart without helm and without a cluster, for the offline manifest tests.

This is *not* a Helm implementation: it evaluates exactly the Go-template subset the chart in
``deploy/helm/gpupool`` uses, and raises :class:`TemplateError` on anything else, so a template
that grows past it fails the tests loudly instead of rendering wrongly. When ``helm`` is on PATH
the tests render with ``helm template`` as well and compare.

Supported: text with ``{{ }}`` actions and ``{{-``/``-}}`` whitespace trimming; comments
``/* */``; ``if``/``else if``/``else``/``end``; ``with``; ``range $i := PIPE``; pipelines
``a | f b``; values ``.Values.x.y``, ``.Release.Name``, ``.Release.Namespace``, ``.Chart.*``,
``.Files.Get "path"``, ``.`` (in ``with``), ``$``/``$.x``/``$var``; functions ``quote``,
``toYaml``, ``nindent``, ``indent``, ``int``, ``add``, ``div``, ``eq``, ``and``, ``or``, ``not``,
``until``, ``default``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml


class TemplateError(Exception):
    """A construct this renderer does not implement, or a template error."""


_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)
_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|\(|\)|\||:=|\$[A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*|\.[A-Za-z0-9_.]*|'
                    r"-?[0-9]+|[A-Za-z_][A-Za-z0-9_]*)")


def _truthy(v: Any) -> bool:
    return v not in (None, False, 0, "") and not (isinstance(v, (list, dict)) and not v)


def _to_yaml(v: Any) -> str:
    if v is None:
        return "null"
    return yaml.safe_dump(v, sort_keys=True, default_flow_style=False).rstrip("\n")


def _indent(n: int, s: str) -> str:
    pad = " " * int(n)
    return "\n".join(pad + line for line in str(s).split("\n"))


def _quote(*args: Any) -> str:
    return " ".join('"' + str("" if a is None else a).replace("\\", "\\\\").replace('"', '\\"') + '"' for a in args)


FUNCS: dict[str, Any] = {
    "quote": _quote,
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "indent": _indent,
    "int": lambda v: int(v),
    "add": lambda *a: sum(int(x) for x in a),
    "div": lambda a, b: int(a) // int(b),
    "eq": lambda a, b: a == b,
    "and": lambda *a: next((x for x in a if not _truthy(x)), a[-1]),
    "or": lambda *a: next((x for x in a if _truthy(x)), a[-1]),
    "not": lambda a: not _truthy(a),
    "until": lambda n: list(range(int(n))),
    "default": lambda d, v=None: v if _truthy(v) else d,
}


def _tokenize(src: str) -> list[tuple[str, str, bool, bool]]:
    """Text and actions, with Go's trimming applied: ``[("text", s, _, _) | ("action", body, _, _)]``."""
    out: list[tuple[str, str, bool, bool]] = []
    pos = 0
    for m in _ACTION.finditer(src):
        out.append(("text", src[pos : m.start()], False, False))
        out.append(("action", m.group(2).strip(), m.group(1) == "-", m.group(3) == "-"))
        pos = m.end()
    out.append(("text", src[pos:], False, False))
    for i, (kind, _body, left, right) in enumerate(out):
        if kind != "action":
            continue
        if left and i > 0:
            k, t, a, b = out[i - 1]
            out[i - 1] = (k, t.rstrip(" \t\r\n"), a, b)
        if right and i + 1 < len(out):
            k, t, a, b = out[i + 1]
            out[i + 1] = (k, t.lstrip(" \t\r\n"), a, b)
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str, bool, bool]]) -> None:
        self.tokens = tokens
        self.i = 0

    def block(self, stop: tuple[str, ...] = ()) -> tuple[list[Any], str]:
        nodes: list[Any] = []
        while self.i < len(self.tokens):
            kind, body, _, _ = self.tokens[self.i]
            self.i += 1
            if kind == "text":
                if body:
                    nodes.append(("text", body))
                continue
            if body.startswith("/*"):
                if not body.endswith("*/"):
                    raise TemplateError(f"unterminated comment: {body[:40]!r}")
                continue
            word = body.split(None, 1)[0] if body else ""
            if word in ("end", "else") and word in stop or (word == "else" and "else" in stop):
                return nodes, body
            if word == "if":
                nodes.append(self._if(body[2:].strip()))
            elif word == "with":
                inner, end = self.block(("end", "else"))
                if end != "end":
                    raise TemplateError("with ... else is not supported")
                nodes.append(("with", body[4:].strip(), inner))
            elif word == "range":
                m = re.fullmatch(r"range\s+(\$[A-Za-z0-9_]+)\s*:=\s*(.+)", body, re.S)
                if not m:
                    raise TemplateError(f"only `range $v := PIPE` is supported: {body!r}")
                inner, end = self.block(("end",))
                nodes.append(("range", m.group(1), m.group(2), inner))
            elif word in ("end", "else", "define", "template", "block", "include", "tpl", "required", "fail"):
                raise TemplateError(f"unsupported or unbalanced action {{{{ {body} }}}}")
            else:
                nodes.append(("expr", body))
        if stop:
            raise TemplateError(f"missing {{{{ end }}}} (wanted one of {stop})")
        return nodes, ""

    def _if(self, cond: str) -> Any:
        branches: list[tuple[str | None, list[Any]]] = []
        while True:
            inner, end = self.block(("end", "else"))
            branches.append((cond, inner))
            if end == "end":
                return ("if", branches)
            rest = end[4:].strip()
            if rest.startswith("if "):
                cond = rest[3:].strip()
                continue
            inner, end = self.block(("end",))
            branches.append((None, inner))
            return ("if", branches)


class _Eval:
    def __init__(self, root: dict[str, Any], chart_dir: Path) -> None:
        self.root = root
        self.chart_dir = chart_dir

    def render(self, nodes: list[Any], dot: Any, vars: dict[str, Any]) -> str:
        out: list[str] = []
        for n in nodes:
            kind = n[0]
            if kind == "text":
                out.append(n[1])
            elif kind == "expr":
                v = self.pipe(n[1], dot, vars)
                out.append("" if v is None else (str(v).lower() if isinstance(v, bool) else str(v)))
            elif kind == "if":
                for cond, inner in n[1]:
                    if cond is None or _truthy(self.pipe(cond, dot, vars)):
                        out.append(self.render(inner, dot, vars))
                        break
            elif kind == "with":
                v = self.pipe(n[1], dot, vars)
                if _truthy(v):
                    out.append(self.render(n[2], v, vars))
            elif kind == "range":
                for item in self.pipe(n[2], dot, vars):
                    out.append(self.render(n[3], dot, {**vars, n[1]: item}))
        return "".join(out)

    def pipe(self, src: str, dot: Any, vars: dict[str, Any]) -> Any:
        toks = [t for t in _TOKEN.findall(src)]
        if "".join(toks).replace(" ", "") != re.sub(r"\s+", "", src):
            raise TemplateError(f"cannot parse {src!r}")
        value, pos = self._pipeline(toks, 0, dot, vars)
        if pos != len(toks):
            raise TemplateError(f"trailing tokens in {src!r}")
        return value

    def _pipeline(self, toks: list[str], pos: int, dot: Any, vars: dict[str, Any]) -> tuple[Any, int]:
        value, pos = self._command(toks, pos, dot, vars, None, first=True)
        while pos < len(toks) and toks[pos] == "|":
            value, pos = self._command(toks, pos + 1, dot, vars, value, first=False)
        return value, pos

    def _command(self, toks: list[str], pos: int, dot: Any, vars: dict[str, Any], piped: Any, first: bool) -> tuple[Any, int]:
        args: list[Any] = []
        start = pos
        while pos < len(toks) and toks[pos] not in ("|", ")"):
            t = toks[pos]
            if t == "(":
                v, pos = self._pipeline(toks, pos + 1, dot, vars)
                if pos >= len(toks) or toks[pos] != ")":
                    raise TemplateError("unbalanced parentheses")
                args.append(("v", v))
                pos += 1
                continue
            args.append(("t", t))
            pos += 1
        if not args:
            raise TemplateError(f"empty command at token {start}")
        head_kind, head = args[0]
        rest = [self._operand(a, dot, vars) for a in args[1:]]
        if head_kind == "t" and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head) and head not in ("true", "false", "nil"):
            if head not in FUNCS:
                raise TemplateError(f"function {head!r} is not supported")
            call_args = rest + ([piped] if not first else [])
            return FUNCS[head](*call_args), pos
        if head_kind == "t" and head == ".Files.Get":
            if len(rest) != 1:
                raise TemplateError(".Files.Get takes one path")
            return (self.chart_dir / rest[0]).read_text(), pos
        if rest or not first:
            raise TemplateError(f"cannot call a value: {head!r}")
        return self._operand(args[0], dot, vars), pos

    def _operand(self, a: tuple[str, Any], dot: Any, vars: dict[str, Any]) -> Any:
        kind, t = a
        if kind == "v":
            return t
        if t.startswith('"'):
            return bytes(t[1:-1], "utf-8").decode("unicode_escape")
        if re.fullmatch(r"-?[0-9]+", t):
            return int(t)
        if t in ("true", "false"):
            return t == "true"
        if t == "nil":
            return None
        if t == ".":
            return dot
        if t.startswith("$"):
            name, _, path = t.partition(".")
            base = self.root if name == "$" else vars.get(name)
            if name != "$" and name not in vars:
                raise TemplateError(f"undefined variable {name}")
            return self._walk(base, path)
        if t.startswith("."):
            base = self.root if t.split(".")[1] in ("Values", "Release", "Chart", "Files") else dot
            return self._walk(base, t[1:])
        raise TemplateError(f"unknown operand {t!r}")

    @staticmethod
    def _walk(base: Any, path: str) -> Any:
        v = base
        for part in [p for p in path.split(".") if p]:
            if isinstance(v, dict):
                v = v.get(part)
            else:
                return None
        return v


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def render_chart(
    chart_dir: Path, values: dict[str, Any] | None = None, release: str = "gp", namespace: str = "gpupool"
) -> dict[str, str]:
    """Render every ``templates/*.yaml`` of the chart: ``{template name: rendered text}``.

    Args:
        chart_dir: the chart (``Chart.yaml``, ``values.yaml``, ``templates/``, ``files/``).
        values: overrides merged into ``values.yaml`` (as ``helm --set``/``-f`` would).
        release: the release name.
        namespace: the release namespace.
    """
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    vals = _merge(yaml.safe_load((chart_dir / "values.yaml").read_text()), values or {})
    root = {
        "Values": vals,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart.get("appVersion", "")},
    }
    ev = _Eval(root, chart_dir)
    out = {}
    for path in sorted((chart_dir / "templates").glob("*.yaml")):
        nodes, _ = _Parser(_tokenize(path.read_text())).block()
        out[path.name] = ev.render(nodes, root, {})
    return out


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects of a rendering (empty documents dropped)."""
    docs: list[dict[str, Any]] = []
    for name, text in rendered.items():
        try:
            docs.extend(d for d in yaml.safe_load_all(text) if d)
        except yaml.YAMLError as exc:
            raise TemplateError(f"{name} does not render to valid YAML: {exc}") from None
    return docs
