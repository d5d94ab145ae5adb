"""The docs name only what the code has: commands, flags, paths, names, settings, metrics, variables.

"A doc that claims what the code does not do is a bug." This catches the mechanical kinds of drift
between README.md, docs/*.md, integrations/*/README.md and the code, reading their code spans and
fenced blocks (``GPUPOOL_*`` variables and links: every line):

* ``gpupool [command [sub]] --flag``: the command exists and has the flag (the click tree itself;
  ``gpupool demo`` from its file, without importing Lightning); ``python benchmarks/x.py --flag``:
  the script declares the flag; a span of bare flags (`--las-no-preempt`): some command has it;
  "`--checkpoint-s`, default 10 s": some command with the flag has that default;
* repository paths (``tests/...py::test_name`` included), bare file names (`ledger.py`), relative
  links, ``gpupool_*`` module and attribute names, names imported in examples, keyword arguments
  of the package's functions and classes in examples (read with ``ast``);
* docs/scheduler.md's *Settings* table against ``SchedulerConfig`` and ``DEFAULT_SCHEDULER`` (every
  field, both defaults), ``--set FIELD=`` names, the policy files the docs show (they load), and
  docs/operations.md's exit codes;
* ``gpupool_*`` metric names (in some code; and every metric the exporters declare is in
  docs/metrics.md) and ``GPUPOOL_*`` environment variables (read by some code);
* etcd keys (``jobs/{job}/spec``: ``Keyspace.parse`` knows the shape; keyspace.py's layout lists
  every key it builds), "section 5a" (docs/simulation.md has it) and ``docs/x.md`` *Heading*
  references, in the docs and in the code's comments.

No etcd, no process. A mention that is legitimately not checkable (an old name quoted as history)
goes into ``ALLOWED`` with its reason; keep that list short.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import click
import pytest

import gpupool_sdk.store.keyspace as keyspace_module
from gpupool_sdk.cli import common
from gpupool_sdk.cli.main import cli
from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.runtime.env import EX_TEMPFAIL
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER, load_policy_config
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store.keyspace import Keyspace

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "integrations").glob("*/README.md"))]

#: (doc, problem as the test reports it) -> why the mention stays although the code does not have it.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/memory.md", "`gpupool` has no command 'host'"):
        "a quoted error message (`gpupool host allocator (device 0): cannot allocate ...`), not a command",
    ("docs/operations.md", "deploy/gp-gpupool-coordinator does not exist"):
        "kubectl's deployment/NAME (`kubectl exec deploy/gp-gpupool-coordinator`), not a repository path",
    ("README.md", "gpupool_sdk.integrations does not exist"):
        "the 0.x import break: the old module names, quoted as history",
}


@dataclasses.dataclass(frozen=True)
class Code:
    """A code span, or one logical line of a fenced block (``\\`` continuations joined)."""

    doc: str
    line: int
    text: str
    block: bool

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def code_of(path: Path, doc: str | None = None) -> list[Code]:
    """The code spans and fenced-block lines of a Markdown file, with their line numbers."""
    doc = doc or path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Code] = []
    prose: list[str] = []
    fence: str | None = None
    pending: tuple[int, str] | None = None  # a block line continued with a backslash
    for no, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prose.append("")
            continue
        if fence is not None:
            prose.append("")
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(fence[0] + " "):
                fence, pending = None, None
                continue
            start, text = pending if pending else (no, "")
            text += line
            if text.endswith("\\"):
                pending = (start, text[:-1] + " ")
            else:
                pending = None
                out.append(Code(doc, start, text, True))
            continue
        prose.append(line)
    # Spans never cross a blank line (a paragraph break), so an unmatched backtick stays local.
    first = 0
    while first < len(prose):
        if not prose[first].strip():
            first += 1
            continue
        end = first
        while end < len(prose) and prose[end].strip():
            end += 1
        para = "\n".join(prose[first:end])
        for m in _SPAN.finditer(para):
            out.append(Code(doc, first + 1 + para.count("\n", 0, m.start()), m.group(2).replace("\n", " ").strip(), False))
        first = end
    return out


def fenced_blocks(path: Path) -> Iterator[tuple[int, str, str]]:
    """(first line, info string, text) of each fenced block of a Markdown file."""
    fence: str | None = None
    info, start, body = "", 0, list[str]()
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, info, start, body = m.group(1), line.strip()[len(m.group(1)):].strip(), no + 1, []
        elif fence is not None and m and m.group(1)[0] == fence[0] and not line.strip(fence[0] + " "):
            yield start, info, "\n".join(body)
            fence = None
        elif fence is not None:
            body.append(line)


@cache
def all_code() -> tuple[Code, ...]:
    return tuple(c for doc in DOCS for c in code_of(doc))


@dataclasses.dataclass(frozen=True)
class Finding:
    """A mention in a doc that the code does not back."""

    doc: str
    line: int
    problem: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.problem}"


def expect_none(title: str, findings: list[Finding]) -> None:
    """Fail with the findings ``ALLOWED`` does not excuse, one per line under ``title``."""
    left = [str(f) for f in findings if (f.doc, f.problem) not in ALLOWED]
    if left:
        pytest.fail(f"{title} (fix the doc, or the code):\n" + "\n".join(left), pytrace=False)


# --------------------------------------------------------------------------------------------
# 1. gpupool commands and flags


def _plugin_commands() -> dict[str, click.Command]:
    """``gpupool demo`` from its source file: importing the package would import Lightning."""
    path = ROOT / "integrations" / "lightning" / "gpupool_lightning" / "demo" / "cli.py"
    spec = importlib.util.spec_from_file_location("_doc_check_demo_cli", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {"demo": mod.demo}


@cache
def _root_commands() -> dict[str, click.Command]:
    return {**cli.commands, **_plugin_commands()}


def _subcommands(cmd: click.Command) -> dict[str, click.Command] | None:
    if cmd is cli:
        return _root_commands()
    return dict(cmd.commands) if isinstance(cmd, click.Group) else None


def _options(cmd: click.Command) -> dict[str, click.Option]:
    opts: dict[str, click.Option] = {}
    for p in cmd.params:
        if isinstance(p, click.Option):
            for name in (*p.opts, *p.secondary_opts):
                opts[name] = p
    return opts


_STOP = {"|", "||", "&&", ";", "&", ">", ">>", "<", "<<", "(", ")", "--", "2>", "2>&1"}
_PLACEHOLDER = re.compile(r"<[^<>]*>")
_VARIABLE = re.compile(r"""\b(\w+)=(["'])(gpupool\s[^"']*)\2""")


def _tokens(text: str) -> list[str]:
    text = _PLACEHOLDER.sub("PLACEHOLDER", text)
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote in a span: words are enough
        return text.split()


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _flag_names(token: str) -> list[str]:
    """``--gpus=2`` -> ``--gpus``; ``--min-gpus/--max-gpus`` (alternatives) -> both."""
    return [part.split("=", 1)[0] for part in re.split(r"/(?=-)", token)]


def check_command(args: list[str]) -> list[str]:
    """What is wrong with ``gpupool ARGS``: commands that do not exist, flags a command lacks."""
    cmd: click.Command = cli
    path = ["gpupool"]
    problems: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i].strip("[]")
        i += 1
        if tok in _STOP or tok.startswith((">", "#")) or not tok:
            break
        if tok in ("...", "…"):
            continue
        if tok.startswith("-") and len(tok) > 1 and not _is_number(tok):
            opts = _options(cmd)
            names = _flag_names(tok)
            for name in names:
                if name not in opts and name not in ("-h", "--help") and not (
                    not name.startswith("--") and name[:2] in opts  # -ojson
                ):
                    problems.append(f"`{' '.join(path)}` has no option {name}")
            opt = opts.get(names[0])
            if len(names) == 1 and opt is not None and not (opt.is_flag or opt.count) and "=" not in tok:
                i += max(opt.nargs, 1)  # its value
            continue
        subs = _subcommands(cmd)
        if subs is None:
            continue  # an argument of a command
        if tok in subs:
            cmd = subs[tok]
            path.append(tok)
            continue
        if re.fullmatch(r"[a-z][a-z0-9-]*", tok):
            problems.append(f"`{' '.join(path)}` has no command {tok!r}")
        break  # a placeholder (COMMAND, {cordon,drain}): nothing after it can be resolved
    return problems


def gpupool_invocations(codes: tuple[Code, ...]) -> Iterator[tuple[Code, list[str]]]:
    """Every ``gpupool ...`` in the docs' code, with the arguments after ``gpupool``.

    ``gpupool`` counts as the command when it does not follow an option (``--policy gpupool`` is
    the simulator's policy, ``helm -n gpupool`` a namespace). A shell variable set to a gpupool
    command line (``run="gpupool simulate ..."``) is expanded where ``$run`` starts a command.
    """
    variables: dict[tuple[str, str], str] = {}
    for code in codes:
        for m in _VARIABLE.finditer(code.text):
            variables[(code.doc, m.group(1))] = m.group(3)
            yield code, _tokens(m.group(3))[1:]
        text = _VARIABLE.sub(" ", code.text)
        for (doc, name), value in variables.items():
            if doc == code.doc:
                text = re.sub(rf"\${{?{name}\b}}?", value, text)
        toks = _tokens(text)
        for j, tok in enumerate(toks):
            if tok == "gpupool" and (j == 0 or not toks[j - 1].startswith("-")):
                yield code, toks[j + 1 :]


def command_findings() -> list[Finding]:
    return [Finding(c.doc, c.line, p) for c, args in gpupool_invocations(all_code()) for p in check_command(args)]


def test_gpupool_commands_and_flags_in_docs_exist() -> None:
    expect_none("docs name gpupool commands or flags that do not exist", command_findings())


_ARGS = re.compile(r"""(?:add_argument|\.option)\(\s*((?:["'][^"']*["']\s*,\s*)+)""")

#: Flags of other tools that the docs name bare (in a code span of their own): tool -> flags.
EXTERNAL_FLAGS = {"sbatch (Slurm)": {"--requeue", "--signal"}, "torchrun": {"--standalone"}}


def declared_flags(source: str) -> set[str]:
    """The flags an argparse or click program declares (``add_argument("--x", "-x", ...)``)."""
    return {f for m in _ARGS.finditer(source) for f in re.findall(r"""["'](--?[A-Za-z][\w-]*)["']""", m.group(1))}


def _script(args: list[str]) -> tuple[Path, list[str]] | None:
    """The repository script ``python [-m mod | path.py] ARGS`` runs, and its arguments."""
    if not args:
        return None
    if args[0] == "-m" and len(args) > 1:
        mod = ROOT / args[1].replace(".", "/")
        path = mod.with_suffix(".py") if mod.with_suffix(".py").exists() else mod / "__main__.py"
        rest = args[2:]
    else:
        path, rest = ROOT / args[0].removeprefix("./"), args[1:]
    return (path, rest) if path.suffix == ".py" and path.is_file() and ROOT in path.resolve().parents else None


def script_problems(code: Code) -> list[str]:
    """Flags a ``python benchmarks/x.py --flag`` line names that the script does not declare."""
    toks = _tokens(code.text)
    problems = []
    for j, tok in enumerate(toks):
        if not re.search(r"(^|/)python[0-9.]*$", tok):
            continue
        found = _script(toks[j + 1 :])
        if found is None:
            continue
        path, rest = found
        flags = declared_flags(path.read_text(encoding="utf-8"))
        if not flags:
            continue  # parses its arguments some other way
        for arg in rest:
            arg = arg.strip("[]")
            if arg in _STOP:
                break
            if not arg.startswith("-") or _is_number(arg):
                continue
            for name in _flag_names(arg):
                if name not in flags | {"-h", "--help"}:
                    problems.append(f"{path.relative_to(ROOT)} has no option {name}")
    return problems


def script_findings() -> list[Finding]:
    return [Finding(c.doc, c.line, p) for c in all_code() for p in script_problems(c)]


def test_script_flags_in_docs_exist() -> None:
    expect_none("docs run repository scripts with flags they do not have", script_findings())


@cache
def known_flags() -> frozenset[str]:
    """Every flag of every ``gpupool`` command, repository script, and the few other tools named."""
    flags: set[str] = set()

    def walk(cmd: click.Command) -> None:
        flags.update(_options(cmd))
        for sub in (_subcommands(cmd) or {}).values():
            walk(sub)

    walk(cli)
    for top in ("gpupool_sdk", "benchmarks", "scripts", "examples", "integrations", "deploy", "docs"):
        for path in (ROOT / top).rglob("*.py"):
            flags |= declared_flags(path.read_text(encoding="utf-8"))
    return frozenset(flags.union(*EXTERNAL_FLAGS.values(), {"--help"}))


def bare_flag_findings() -> list[Finding]:
    """A span that is only flags (`--las-no-preempt`) names a flag some program here has."""
    findings = []
    for code in all_code():
        if code.block or not code.text.startswith("--"):
            continue
        for name in (n for tok in _tokens(code.text) for n in _flag_names(tok)):
            if not re.fullmatch(r"--[a-z][a-z0-9-]*\*?", name):
                continue
            ok = any(f.startswith(name[:-1]) for f in known_flags()) if name.endswith("*") else name in known_flags()
            if not ok:
                findings.append(Finding(code.doc, code.line, f"{name} is a flag of no command or script"))
    return findings


def test_bare_flags_in_docs_exist_somewhere() -> None:
    expect_none("docs name flags that nothing here has", bare_flag_findings())


_FLAG_DEFAULT = re.compile(r"`(--[a-z][a-z0-9-]*)(?: [A-Z_]+)?`,? \(?default:? (-?\d+(?:,\d{3})*(?:\.\d+)?)")


@cache
def _all_options() -> dict[str, list[click.Option]]:
    found: dict[str, list[click.Option]] = {}

    def walk(cmd: click.Command) -> None:
        for name, opt in _options(cmd).items():
            found.setdefault(name, []).append(opt)
        for sub in (_subcommands(cmd) or {}).values():
            walk(sub)

    walk(cli)
    return found


def flag_default_problems(line: str) -> list[str]:
    """"`--checkpoint-s`, default 10 s": a command with that flag has that default (or its help says it)."""
    problems = []
    for m in _FLAG_DEFAULT.finditer(line):
        flag, said = m.group(1), float(m.group(2).replace(",", ""))
        opts = _all_options().get(flag)
        if not opts:
            continue  # the flag checks report it
        if not any((isinstance(o.default, (int, float)) and not isinstance(o.default, bool) and o.default == said)
                   or re.search(rf"\b{re.escape(m.group(2))}\b", o.help or "") for o in opts):
            defaults = ", ".join(sorted({str(o.default) for o in opts}))
            problems.append(f"{flag}: the docs say default {m.group(2)}, the CLI has {defaults}")
    return problems


def flag_default_findings() -> list[Finding]:
    return [Finding(doc, no, p) for doc, no, line in _doc_lines() for p in flag_default_problems(line)]


def test_flag_defaults_in_docs_are_the_clis() -> None:
    expect_none("docs state flag defaults the CLI does not have", flag_default_findings())


# --------------------------------------------------------------------------------------------
# 2. repository paths and Python names


_TOP = ("tests", "benchmarks", "scripts", "gpupool_sdk", "integrations", "docs", "deploy", "examples")
_PATH = re.compile(
    r"(?<![\w./~$-])((?:" + "|".join(_TOP) + r")/[\w.*/{}-]*[\w*/}])(::[\w\[\]-]+)?"
)


def repository_paths(code: Code) -> Iterator[tuple[str, str | None]]:
    for m in _PATH.finditer(code.text):
        yield m.group(1), (m.group(2) or "")[2:] or None


def path_problem(path: str, test: str | None) -> str | None:
    if "{" in path:  # a template (docs/img/{name}.png)
        return None
    matches = sorted(ROOT.glob(path.rstrip("/"))) if "*" in path else [ROOT / path]
    if not any(p.exists() for p in matches):
        return f"{path} does not exist"
    if test is not None:
        name = re.split(r"[\[]", test)[0]
        source = matches[0].read_text(encoding="utf-8")
        if not re.search(rf"^\s*(async\s+)?(def|class)\s+{re.escape(name)}\b", source, re.M):
            return f"{path} has no {name}"
    return None


def path_findings() -> list[Finding]:
    return [Finding(c.doc, c.line, p) for c in all_code() for path, test in repository_paths(c)
            if (p := path_problem(path, test))]


def test_repository_paths_in_docs_exist() -> None:
    expect_none("docs name repository paths that do not exist", path_findings())


#: Scripts the docs name that are the user's, not the repository's.
USER_FILES = {"train.py"}


@cache
def _file_names() -> frozenset[str]:
    return frozenset(p.name for top in _TOP for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)


def bare_file_findings() -> list[Finding]:
    """A module named by its file name alone (`ledger.py`) is a file somewhere in the repository."""
    findings = []
    for code in all_code():
        for m in re.finditer(r"(?<![\w./-])(\w+\.py)\b", code.text):
            if m.group(1) not in _file_names() and m.group(1) not in USER_FILES:
                findings.append(Finding(code.doc, code.line, f"no file is named {m.group(1)}"))
    return findings


def test_file_names_in_docs_exist() -> None:
    assert "ledger.py" in _file_names()
    expect_none("docs name files that no longer exist", bare_file_findings())


_PACKAGES = {
    "gpupool_sdk": ROOT / "gpupool_sdk",
    "gpupool_torch": ROOT / "integrations" / "torch" / "gpupool_torch",
    "gpupool_lightning": ROOT / "integrations" / "lightning" / "gpupool_lightning",
}
_DOTTED = re.compile(r"\b(gpupool_(?:sdk|torch|lightning)(?:\.[A-Za-z_]\w*)+)")


def _defines(source: str, name: str) -> bool:
    """A module's source defines, assigns, imports or exports (``__all__``, lazy table) ``name``."""
    n = re.escape(name)
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b|^\s*(?:self\.)?{n}\s*[:=]|\bimport\b[^\n]*\b{n}\b"
                     rf"|^\s+{n},?\s*$|[\"']{n}[\"']", source, re.M) is not None


def dotted_problem(dotted: str) -> str | None:
    """``gpupool_sdk.memory.empty_cache``: the modules exist, and the module has the name (and the
    class its attribute, one level down); read from the files, nothing imported."""
    parts = dotted.split(".")
    here = _PACKAGES[parts[0]]
    module = here / "__init__.py"
    for i, part in enumerate(parts[1:], 1):
        if here.is_dir() and (here / part / "__init__.py").exists():
            here = here / part
            module = here / "__init__.py"
        elif here.is_dir() and (here / f"{part}.py").exists():
            here = module = here / f"{part}.py"
        else:
            source = module.read_text(encoding="utf-8")
            for attr in parts[i : i + 2]:
                if not _defines(source, attr):
                    return f"{'.'.join(parts[: parts.index(attr, i) + 1])} does not exist"
            return None
    return None


_IMPORT = re.compile(r"^\s*from\s+(gpupool_(?:sdk|torch|lightning)[\w.]*)\s+import\s+([\w\s,]+?)\s*(?:#.*)?$")


def dotted_names(code: Code) -> Iterator[str]:
    """``gpupool_*.x.y`` in the text, and ``module.name`` for each name of ``from gpupool_* import ...``."""
    yield from (m.group(1) for m in _DOTTED.finditer(code.text))
    if (m := _IMPORT.match(code.text)) is not None:
        yield from (f"{m.group(1)}.{name.strip()}" for name in m.group(2).split(",") if name.strip())


def dotted_findings() -> list[Finding]:
    return [Finding(c.doc, c.line, p) for c in all_code() for name in dotted_names(c) if (p := dotted_problem(name))]


def test_module_names_in_docs_exist() -> None:
    expect_none("docs name modules or attributes that do not exist", dotted_findings())


@dataclasses.dataclass
class Signature:
    """The keyword names a public function or class of the packages takes."""

    names: set[str]
    open: bool  # takes **kwargs (and forwards them somewhere this test does not follow)
    bases: list[str]


#: Adapters whose ``**options`` go to ``RuntimeOptions.from_kwargs``: its fields and JobSpec's.
FORWARDED = {"GpuPoolCallback": ("RuntimeOptions", "JobSpec"), "PoolSession": ("RuntimeOptions", "JobSpec")}


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
    a = fn.args
    names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)} - {"self", "cls"}
    return Signature(names, a.kwarg is not None, [])


@cache
def signatures() -> dict[str, list[Signature]]:
    """Public top-level functions and classes of the three packages, read with ``ast`` (no import)."""
    index: dict[str, list[Signature]] = {}
    for package in _PACKAGES.values():
        for path in package.rglob("*.py"):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                    continue
                if not isinstance(node, ast.ClassDef):
                    index.setdefault(node.name, []).append(_signature(node))
                    continue
                init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                if init is not None:
                    sig = _signature(init)
                elif any("dataclass" in ast.unparse(d) for d in node.decorator_list) or "NamedTuple" in bases:
                    fields = {b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
                    sig = Signature(fields, False, bases)
                else:
                    sig = Signature(set(), True, [])  # a constructor this test does not guess
                index.setdefault(node.name, []).append(sig)
    return index


def _accepts(name: str, keyword: str, seen: frozenset[str] = frozenset()) -> bool:
    if any(_accepts(target, keyword, seen | {name}) for target in FORWARDED.get(name, ()) if target not in seen):
        return True
    for sig in signatures().get(name, []):
        if keyword in sig.names or (sig.open and name not in FORWARDED):
            return True
        if any(b not in seen and b in signatures() and _accepts(b, keyword, seen | {name}) for b in sig.bases):
            return True
    return False


def _calls(text: str) -> Iterator[tuple[str, list[str]]]:
    """(callee's last name, keyword names) of each call in a snippet; a regex where it is not Python."""
    try:
        tree = ast.parse(text)
    except SyntaxError:  # `PoolClient(node=)`, `JobSpec(gpus=N*k, ...)`
        for m in re.finditer(r"\b(\w+)\(([^()]*)\)", text):
            yield m.group(1), re.findall(r"(?:^|,)\s*(\w+)\s*=(?!=)", m.group(2))
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            yield callee, [k.arg for k in node.keywords if k.arg is not None]


def keyword_findings() -> list[Finding]:
    """``GpuPoolCallback(gpus=1, qos=...)`` in an example: the callable has those parameters."""
    snippets = [(c.doc, c.line, c.text) for c in all_code() if not c.block]
    snippets += [(doc.relative_to(ROOT).as_posix(), line, text) for doc in DOCS
                 for line, info, text in fenced_blocks(doc) if info in ("python", "py")]
    findings = []
    for doc, line, text in snippets:
        for callee, keywords in _calls(text):
            if callee not in signatures():
                continue
            findings += [Finding(doc, line, f"{callee}() has no parameter {k}") for k in keywords if not _accepts(callee, k)]
    return findings


def test_keyword_arguments_in_docs_exist() -> None:
    assert len(signatures()) > 100  # the packages were read
    expect_none("docs pass keyword arguments that the code does not take", keyword_findings())


# --------------------------------------------------------------------------------------------
# 3. references to sections, links, etcd keys


def _docs_and_code() -> list[Path]:
    """The docs and every Python file of the repository but this one (its examples are made up)."""
    here = Path(__file__).resolve()
    return [*DOCS, *(p for top in ("gpupool_sdk", "integrations", "benchmarks", "scripts", "tests", "examples")
                     for p in (ROOT / top).rglob("*.py") if p.resolve() != here)]


_SECTION_REF = re.compile(r"\bsections? (\d+[a-z]?)((?:(?:, | and | or |-|–)\d+[a-z]?\b)*)")


def simulation_sections() -> set[str]:
    """docs/simulation.md's numbered sections: ``### 5. ...`` headings and ``**5a. ...`` paragraphs."""
    text = (ROOT / "docs" / "simulation.md").read_text(encoding="utf-8")
    return set(re.findall(r"^(?:#+ |\*\*)(\d+[a-z]?)[.,]", text, re.M))


def section_findings() -> list[Finding]:
    """"section 5a" (docs and code: only docs/simulation.md numbers its sections) names one that exists."""
    sections = simulation_sections()
    findings = []
    for path in _docs_and_code():
        text = path.read_text(encoding="utf-8")
        for m in _SECTION_REF.finditer(text):
            for ref in re.findall(r"\d+[a-z]?", m.group(0)):
                if ref not in sections:
                    line = text.count("\n", 0, m.start()) + 1
                    findings.append(Finding(path.relative_to(ROOT).as_posix(), line,
                                            f"docs/simulation.md has no section {ref}"))
    return findings


def test_simulation_section_numbers_exist() -> None:
    assert {"1", "5", "5a", "8"} <= simulation_sections()
    expect_none("docs or code refer to sections of docs/simulation.md that do not exist", section_findings())


_HEADING_REF = re.compile(r"docs/(\w+\.md)`{0,2}\)?,? +\*([^*\n]+)\*")


def heading_findings() -> list[Finding]:
    """``docs/scheduler.md`` *Performance* (docs and code) names a heading of that page."""
    findings = []
    for path in _docs_and_code():
        text = path.read_text(encoding="utf-8")
        for m in _HEADING_REF.finditer(text):
            page = ROOT / "docs" / m.group(1)
            if not page.exists():
                continue  # the path check reports it
            headings = [h.lstrip("#").strip().lower() for h in page.read_text(encoding="utf-8").splitlines()
                        if h.startswith("#")]
            if not any(m.group(2).lower() in h for h in headings):
                findings.append(Finding(path.relative_to(ROOT).as_posix(), text.count("\n", 0, m.start()) + 1,
                                        f"docs/{m.group(1)} has no heading *{m.group(2)}*"))
    return findings


def test_named_sections_of_docs_exist() -> None:
    expect_none("docs or code refer to headings that do not exist", heading_findings())


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _doc_lines() -> Iterator[tuple[str, int, str]]:
    for doc in DOCS:
        for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            yield doc.relative_to(ROOT).as_posix(), no, line


def link_findings() -> list[Finding]:
    findings = []
    for doc, no, line in _doc_lines():
        for m in _LINK.finditer(line):
            target = (m.group(1) or m.group(2)).split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue  # an anchor in the page, or a URL
            if not (ROOT / doc).parent.joinpath(target).exists():
                findings.append(Finding(doc, no, f"link to {target}: no such file"))
    return findings


def test_relative_links_in_docs_resolve() -> None:
    expect_none("docs link to files that do not exist", link_findings())


@cache
def keyspace_keys() -> set[str]:
    """Every key shape ``Keyspace`` builds (``jobs/{}/spec``), from its builder methods."""
    ks = Keyspace()
    shapes = set()
    for name, method in inspect.getmembers(ks, inspect.ismethod):
        if name.startswith("_") or name.endswith("_prefix") or name in ("root", "parse", "from_env"):
            continue
        params = list(inspect.signature(method).parameters)
        key = method(*(f"ARG{i}" for i in range(len(params))))
        shapes.add(re.sub(r"ARG\d+", "{}", key[len(ks.prefix) + 1 :]))
    return shapes


@cache
def _key_pattern() -> re.Pattern[str]:
    heads = sorted({key.split("/", 1)[0] for key in keyspace_keys()})
    return re.compile(r"(?<![\w./-])(?:/gpupool/v1/|\{prefix\}/)?(?:" + "|".join(heads) + r")(?:/[\w{}.:*-]*)+")


def key_problem(key: str) -> str | None:
    """``jobs/{job}/spec``, ``{prefix}/prices``, ``/gpupool/v1/jobs/bert/spec``: a key the keyspace has."""
    rel = re.sub(r"^(?:/gpupool/v1|\{prefix\})/", "", key)
    rel = re.sub(r"\{[^}]*\}|\*", "x", rel)
    if rel.endswith("/") or "..." in rel:  # a prefix, or elided
        return None
    return None if Keyspace().parse("/gpupool/v1/" + rel) is not None else f"{key} is no key of the keyspace"


def key_findings() -> list[Finding]:
    return [Finding(c.doc, c.line, p) for c in all_code() for m in _key_pattern().finditer(c.text)
            if (p := key_problem(m.group(0)))]


def test_etcd_keys_in_docs_exist() -> None:
    assert key_problem("jobs/{job}/spec") is None and key_problem("jobs/{job}/spek") is not None
    expect_none("docs name etcd keys that gpupool_sdk/store/keyspace.py does not build", key_findings())


def test_keyspace_docstring_lists_every_key() -> None:
    """docs/architecture.md sends readers to keyspace.py's docstring for the layout: it is complete."""
    doc = keyspace_module.__doc__ or ""
    layout = doc.split("::", 1)[1].split("\n\n")[1] if "::" in doc else ""
    listed = {re.sub(r"\{[^}]*\}", "{}", line.split()[0]) for line in layout.splitlines() if line.strip()}
    assert len(keyspace_keys()) > 15
    assert not (missing := sorted(keyspace_keys() - listed)), f"keys not in keyspace.py's layout: {missing}"
    assert not (gone := sorted(listed - keyspace_keys())), f"keyspace.py's layout lists keys it does not build: {gone}"


# --------------------------------------------------------------------------------------------
# 4. the scheduler's settings table, policy files, exit codes


def settings_table() -> list[tuple[int, str, str]]:
    """(line, field, default cell) of each row under docs/scheduler.md's *Settings* heading."""
    lines = (ROOT / "docs" / "scheduler.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Settings (`SchedulerConfig`)")
    rows = []
    for no in range(start + 1, len(lines)):
        line = lines[no]
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and re.fullmatch(r"`\w+`", cells[0]):
            rows.append((no + 1, cells[0].strip("`"), cells[1]))
    return rows


def _literal(text: str) -> Any:
    text = text.strip().strip("`").strip()
    for candidate in (text, text.split(" (", 1)[0].strip("` ")):  # 268435456 (256 MiB)
        try:
            return ast.literal_eval(candidate)
        except (ValueError, SyntaxError):
            pass
    return text  # not a Python literal: it matches no default


def _same(doc: Any, code: Any) -> bool:
    if isinstance(code, bool) or isinstance(doc, bool):
        return type(doc) is type(code) and doc == code
    if isinstance(code, tuple):
        return isinstance(doc, tuple) and len(doc) == len(code) and all(_same(a, b) for a, b in zip(doc, code, strict=True))
    return bool(doc == code)


def default_cell_problems(field: str, cell: str) -> list[str]:
    """``X`` is both defaults; ``X (**Y**)``: X is SchedulerConfig's, Y DEFAULT_SCHEDULER's."""
    own = getattr(SchedulerConfig(), field)
    pool = getattr(DEFAULT_SCHEDULER, field)
    m = re.fullmatch(r"(.*?)\s*\(\*\*(.+)\*\*\)", cell)
    said_own = _literal(m.group(1) if m else cell)
    if m is None:
        if not _same(own, pool):
            return [f"`{field}`: SchedulerConfig's default is {own!r}, DEFAULT_SCHEDULER's {pool!r}: "
                    f"write `{own!r} (**{pool!r}**)`, the table says {cell}"]
        return [] if _same(said_own, own) else [f"`{field}`: the default is {own!r}, the table says {said_own!r}"]
    said_pool = _literal(m.group(2))
    problems = []
    if not _same(said_own, own):
        problems.append(f"`{field}`: SchedulerConfig's default is {own!r}, the table says {said_own!r}")
    if not _same(said_pool, pool):
        problems.append(f"`{field}`: DEFAULT_SCHEDULER has {pool!r}, the table says {said_pool!r} in bold")
    if _same(own, pool):
        problems.append(f"`{field}`: the pool's policy does not change it ({pool!r}), drop the bold")
    return problems


def settings_findings() -> list[Finding]:
    doc = "docs/scheduler.md"
    rows = settings_table()
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    findings = []
    for no, field, cell in rows:
        if field not in names:
            findings.append(Finding(doc, no, f"`{field}` is not a SchedulerConfig field"))
            continue
        findings += [Finding(doc, no, p) for p in default_cell_problems(field, cell)]
    documented = [field for _, field, _ in rows]
    end = rows[-1][0] if rows else 0
    findings += [Finding(doc, end, f"SchedulerConfig.{n} has no row") for n in sorted(names - set(documented))]
    findings += [Finding(doc, end, f"`{n}` has two rows") for n in sorted({n for n in documented if documented.count(n) > 1})]
    return findings


def test_scheduler_settings_table_matches_the_config() -> None:
    assert len(settings_table()) > 20  # the table was found
    expect_none("docs/scheduler.md's Settings table is not what the code has", settings_findings())


_SET = re.compile(r"--set[ =]([a-z_]\w*)=")  # FIELD=VALUE is the placeholder


def set_findings() -> list[Finding]:
    """``--set FIELD=VALUE`` names a SchedulerConfig field."""
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return [Finding(c.doc, c.line, f"--set {m.group(1)}: not a SchedulerConfig field")
            for c in all_code() for m in _SET.finditer(c.text) if m.group(1) not in names]


def test_set_flags_in_docs_name_scheduler_fields() -> None:
    expect_none("docs set scheduler fields that do not exist", set_findings())


def policy_file_findings(tmp: Path) -> list[Finding]:
    """A policy file the docs show (a block with a ``[scheduler]`` or ``[prices]`` table) loads."""
    findings = []
    for doc in DOCS:
        for line, _info, text in fenced_blocks(doc):
            if not re.search(r"^\[(scheduler|prices)\]", text, re.M):
                continue
            path = tmp / "policy.toml"
            path.write_text(text, encoding="utf-8")
            try:
                load_policy_config(path)
            except GpupoolError as exc:
                findings.append(Finding(doc.relative_to(ROOT).as_posix(), line, f"the policy file does not load: {exc}"))
    return findings


def test_policy_files_in_docs_load(tmp_path: Path) -> None:
    assert any(re.search(r"^\[scheduler\]", t, re.M) for _, _, t in fenced_blocks(ROOT / "docs" / "scheduler.md"))
    expect_none("docs show policy files that do not load", policy_file_findings(tmp_path))


def test_exit_code_table_matches_the_cli() -> None:
    """docs/operations.md's *Exit codes* table: each code is one the CLI uses, and each EXIT_* is there."""
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    table = text.split("### Exit codes", 1)[1].split("\n\n")[1]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    constants = {v for k, v in vars(common).items() if k.startswith("EXIT_")}
    main = (ROOT / "gpupool_sdk" / "cli" / "main.py").read_text(encoding="utf-8")
    literal = {int(m) for m in re.findall(r"sys\.exit\((\d+)\)", main)}  # 130 for Ctrl-C
    assert constants and EX_TEMPFAIL == 75
    assert not (missing := sorted(constants - documented)), f"exit codes of the CLI not in the table: {missing}"
    unknown = sorted(documented - constants - literal - {EX_TEMPFAIL})
    assert not unknown, f"exit codes in docs/operations.md that no code uses: {unknown}"


# --------------------------------------------------------------------------------------------
# 5. metric names and environment variables


@cache
def _source_words(tests: bool = False) -> frozenset[str]:
    """The ``gpupool_*`` and ``GPUPOOL_*`` words of the repository's code and deployment files."""
    return frozenset(re.findall(r"\b(?:gpupool|GPUPOOL)_\w+", _source_text(tests)))


def _source_text(tests: bool) -> str:
    """The repository's code and deployment files (with the tests': what they read counts too)."""
    tops = ("gpupool_sdk", "integrations", "scripts", "deploy", "benchmarks", "examples") + (("tests",) if tests else ())
    suffixes = {".py", ".sh", ".yaml", ".yml", ".json", ".toml", ".env", ".service", ".c", ""}
    files = [p for top in tops for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in suffixes]
    files += [ROOT / "conftest.py", ROOT / "pyproject.toml"] if tests else []
    here = Path(__file__).resolve().parent  # this module's made-up names must not count
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files
                     if here not in p.resolve().parents and (tests or "tests" not in p.relative_to(ROOT).parts))


_METRIC = re.compile(r"\bgpupool_[a-z0-9_]+")
_ENV = re.compile(r"\bGPUPOOL_[A-Z0-9_]*[A-Z0-9_*]")
_MODULES = re.compile(r"gpupool_(sdk|torch|lightning)\b")


def _known(name: str, words: frozenset[str]) -> bool:
    if name.endswith("_"):  # a family: gpupool_job_*, GPUPOOL_ETCD_*
        return any(w.startswith(name) for w in words)
    return name in words


def metric_known(name: str) -> bool:
    """In the code as it is, or without the suffix the client library adds (a counter's ``_total``)."""
    base = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
    return _known(name, _source_words()) or _known(base, _source_words())


def metric_findings() -> list[Finding]:
    return [Finding(c.doc, c.line, f"{m.group(0)} is in no code") for c in all_code() for m in _METRIC.finditer(c.text)
            if not _MODULES.match(m.group(0)) and not metric_known(m.group(0))]


def test_metric_names_in_docs_exist_in_code() -> None:
    expect_none("docs name gpupool_* metrics that no code has", metric_findings())


def exporter_metrics() -> set[str]:
    """The metric names the exporters in gpupool_sdk/telemetry declare (their string literals)."""
    names: set[str] = set()
    for path in (ROOT / "gpupool_sdk" / "telemetry").glob("*.py"):
        names.update(re.findall(r"""["'](gpupool_[a-z0-9_]+)["']""", path.read_text(encoding="utf-8")))
    return names


def test_every_exporter_metric_is_in_docs_metrics() -> None:
    """docs/metrics.md lists "every metric with its type and labels" (a counter as ``NAME_total``)."""
    doc = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    names = exporter_metrics()
    assert len(names) > 40, names  # the scan found the exporters
    missing = sorted(n for n in names if not re.search(rf"`{n}(_total)?`", doc))
    assert not missing, f"metrics the exporters serve that docs/metrics.md does not list: {missing}"


def env_findings() -> list[Finding]:
    """``GPUPOOL_*`` anywhere in the docs (prose too); ``GPUPOOL_ETCD_*`` is a family."""
    findings = []
    for doc, no, line in _doc_lines():
        for m in _ENV.finditer(line):
            name = m.group(0).rstrip("*")
            if not _known(name, _source_words(tests=True)):
                findings.append(Finding(doc, no, f"{name} is read by no code"))
    return findings


def test_environment_variables_in_docs_exist_in_code() -> None:
    expect_none("docs name GPUPOOL_* variables that no code reads", env_findings())


def test_every_allowed_mention_is_still_in_the_docs() -> None:
    """An ``ALLOWED`` entry whose mention is gone (or now checks out) goes too."""
    checks = (command_findings, script_findings, bare_flag_findings, path_findings, bare_file_findings,
              dotted_findings, keyword_findings, section_findings, heading_findings, link_findings, key_findings,
              settings_findings, set_findings, metric_findings, env_findings, flag_default_findings)
    found = {(f.doc, f.problem) for check in checks for f in check()}
    assert not (stale := sorted(set(ALLOWED) - found)), f"ALLOWED entries that match nothing: {stale}"


# --------------------------------------------------------------------------------------------
# The checks can fail (each on a made-up mention).


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("gpupool simulate --trace t.csv --no-such-flag", "`gpupool simulate` has no option --no-such-flag"),
        ("gpupool job frobnicate x", "`gpupool job` has no command 'frobnicate'"),
        ("gpupool frobnicate", "`gpupool` has no command 'frobnicate'"),
        ("gpupool demo --simulat x", "`gpupool demo` has no option --simulat"),
    ],
)
def test_check_command_finds_made_up_commands_and_flags(text: str, problem: str) -> None:
    assert check_command(_tokens(text)[1:]) == [problem]


def test_flag_default_check_can_fail() -> None:
    assert flag_default_problems("with `--checkpoint-s`, default 10 s: from") == []
    assert flag_default_problems("`--timeout` (default 5 s)") == []  # gpupool top's, among others
    assert flag_default_problems("with `--checkpoint-s`, default 15 s") == [
        "--checkpoint-s: the docs say default 15, the CLI has 10.0"]


@pytest.mark.parametrize(
    "text",
    [
        "gpupool simulate --policy gpupool -o json --set use_remaining=false --las=3600,36000",
        "gpupool run --gpus 1 -- python train.py --epochs 3",
        "gpupool job describe <job> -ojson | jq .",
        "gpupool metrics serve --port 9400 --help",
        "gpupool COMMAND --whatever",
    ],
)
def test_check_command_accepts_real_lines(text: str) -> None:
    assert check_command(_tokens(text)[1:]) == []


def test_variables_and_option_values_are_understood(tmp_path: Path) -> None:
    codes = (
        Code("x.md", 1, 'run="gpupool simulate --trace t.csv -o json"', True),
        Code("x.md", 2, "$run --policy gpupool --bogus", True),
        Code("x.md", 3, "helm install gp deploy/helm/gpupool -n gpupool --create-namespace", True),
    )
    found = [(c.line, check_command(a)) for c, a in gpupool_invocations(codes)]
    assert found == [(1, []), (2, ["`gpupool simulate` has no option --bogus"])]


def test_path_and_table_checks_can_fail() -> None:
    assert path_problem("tests/docs/no_such_test.py", None) == "tests/docs/no_such_test.py does not exist"
    assert path_problem("tests/docs/test_doc_references.py", "test_no_such_thing") is not None
    assert path_problem("tests/docs/test_doc_references.py", "test_path_and_table_checks_can_fail") is None
    assert default_cell_problems("overcommit_ratio", "1.0 (**1.5**)") == []
    assert default_cell_problems("overcommit_ratio", "1.0") != []
    assert default_cell_problems("peak_margin", "0.2") == ["`peak_margin`: the default is 0.1, the table says 0.2"]
    assert default_cell_problems("peak_margin", "0.1 (**0.2**)") != []
    assert default_cell_problems("las_threshold_gpu_s", "`()` (**`(1800, 18000, 180000)`**)") == []
    assert not metric_known("gpupool_no_such_metric_total")
    assert metric_known("gpupool_scheduler_grants_total")  # a counter's _total comes from the client library
    assert dotted_problem("gpupool_sdk.memory.empty_cache") == "gpupool_sdk.memory.empty_cache does not exist"
    assert dotted_problem("gpupool_torch.memory.empty_cache") is None
    assert dotted_problem("gpupool_sdk.scheduler.policy.Scheduler.no_such_method") is not None
    assert dotted_problem("gpupool_sdk.scheduler.policy.Scheduler.schedule") is None
    assert _accepts("GpuPoolCallback", "checkpoint_dir") and _accepts("GpuPoolCallback", "gpus")
    assert not _accepts("GpuPoolCallback", "checkpoint_directory")
    assert not _accepts("SchedulerConfig", "overcommit")
    imports = Code("x.md", 1, "from gpupool_torch.memory import empty_cache, no_such_name  # comment", True)
    assert [dotted_problem(n) for n in dotted_names(imports)] == [
        None, None, "gpupool_torch.memory.no_such_name does not exist"]


def test_code_of_reads_spans_and_blocks(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("text `one` and ``t`wo``\nspan `across\nlines` here\n\n```sh\ngpupool run \\\n  --gpus 1\n"
                   "echo `x`\n```\nan odd ` backtick\n\nthen `three`\n")
    assert [(c.line, c.text, c.block) for c in code_of(doc, "a.md")] == [
        (6, "gpupool run    --gpus 1", True),
        (8, "echo `x`", True),
        (1, "one", False),
        (1, "t`wo", False),
        (2, "across lines", False),
        (12, "three", False),
    ]
