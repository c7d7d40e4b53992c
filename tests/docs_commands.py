"""Extract the commands and code of README.md and docs/*.md, and check each without running it.

What a documented command must satisfy, cheaply (no rank starts, nothing is trained):

- ``python -m <module> ...`` (also ``torchrun ... -m <module> ...`` and ``sudo python -m ...``)
  names a module that exists where the docs say to run it (``experiments.*`` and ``kernels.*``
  from the repository root, anything else importable);
- its arguments parse: Hydra overrides of the runner go through the runner's own pre-check
  (``check_overrides``) and then Hydra's compose and the library's validation, exactly as the
  runner starts; a module with an argparse parser parses its arguments with it (the parser's own
  ``parse_args`` where the module has one, else its ``main`` stopped right after parsing), and
  what argparse leaves over is checked as runner overrides;
- ``bash <script>`` and ``sbatch [options] <script>`` name a file in the repository.

Python blocks must be valid Python whose ``zeropp`` / ``torch`` imports name things that exist.

A block is marked by an HTML comment on the line before its fence, ``<!-- docs-commands: KIND -->``:
``gpu`` (needs a CUDA machine), ``root`` (needs root: the emulated cluster), ``cluster`` (needs
several hosts). Marked blocks are checked the same way (parsing needs none of these); the mark
tells a reader, and any script that runs the commands, what they need. ``signatures`` marks a
Python block that lists API signatures rather than runnable code: only its import lines are
checked.

Written by hand because no library extracts fenced blocks with the comment that precedes them;
the parsing itself is the standard library's (``shlex``, ``ast``, ``argparse``) and Hydra's.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKS = ("gpu", "root", "cluster", "signatures")
SHELL_LANGS = ("bash", "sh", "shell", "console")
SETUP_COMMANDS = ("pip", "git", "cd", ".", "source", "wandb", "export")
"""Commands the docs may show that need no check here: installing, moving about, syncing wandb."""

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*docs-commands:\s*(\S+)\s*-->\s*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One fenced block of a markdown file."""

    path: Path
    """The markdown file."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    """The fence's language tag (``bash``, ``python``, ...; empty when none)."""
    text: str
    """The block's contents."""
    mark: str | None
    """The ``docs-commands`` mark on the line before the fence, if any."""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with its language and mark. An unknown mark or an unclosed
    fence is a ``ValueError`` naming the line."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mm = _MARK.match(prev)
        mark = mm.group(1) if mm else None
        if mark is not None and mark not in MARKS:
            raise ValueError(f"{path.name}:{i}: unknown docs-commands mark {mark!r}; use one of {MARKS}")
        end = next((k for k in range(i + 1, len(lines)) if lines[k].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path.name}:{i + 1}: the fence opened here is never closed")
        out.append(Block(path=path, line=i + 1, lang=m.group(2), text="\n".join(lines[i + 1 : end]), mark=mark))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for p in DOC_FILES for b in blocks(p)]


def commands(block: Block) -> list[list[str]]:
    """The shell commands of a block, each as its words: continuation lines joined, comments
    dropped, ``a && b`` and ``a; b`` split."""
    joined = re.sub(r"\\\n", " ", block.text)
    out: list[list[str]] = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words:
            if w in ("&&", ";", "||"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
        if cmd:
            out.append(cmd)
    return out


# --- modules -------------------------------------------------------------------------------------


def module_exists(name: str) -> bool:
    """Whether ``python -m name`` finds a module: ``experiments.*`` / ``kernels.*`` as files under
    the repository root (where the docs run them), anything else through the import system."""
    head = name.split(".")[0]
    if head in ("experiments", "kernels"):
        base = ROOT.joinpath(*name.split("."))
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        return importlib.util.find_spec(f"{name}.__main__") is not None
    return True


def import_name(name: str) -> str:
    """The installed name of a documented module (``experiments.run`` -> ``zeropp.experiments.run``),
    so that the check imports each module once, under the name the library uses."""
    return f"zeropp.{name}" if name.split(".")[0] in ("experiments", "kernels") else name


class _Parsed(Exception):
    """Raised by the patched argparse right after a module's outermost parse succeeded."""

    def __init__(self, extras: list[str]) -> None:
        super().__init__("parsed")
        self.extras = extras


@contextlib.contextmanager
def stop_after_parsing() -> Iterator[None]:
    """While active, the outermost ``ArgumentParser.parse_args`` / ``parse_known_args`` call parses
    as usual (errors exit 2 as usual) and then raises :class:`_Parsed` with what was left over,
    so a module's ``main(argv)`` stops before doing any work. Nested parses (sub-commands) run
    normally."""
    original = argparse.ArgumentParser.parse_known_args
    original_parse = argparse.ArgumentParser.parse_args
    depth = 0

    def known(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        nonlocal depth
        depth += 1
        try:
            ns, extras = original(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0:
            raise _Parsed(list(extras))
        return ns, extras

    def parse(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        nonlocal depth
        depth += 1
        try:
            ns, extras = original(self, args, namespace)
        finally:
            depth -= 1
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        if depth == 0:
            raise _Parsed([])
        return ns

    argparse.ArgumentParser.parse_known_args = known  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_args = parse  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
        argparse.ArgumentParser.parse_args = original_parse  # type: ignore[method-assign]


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Jobs that together use every value of every sweep override (``stage=0,1,2,3
    zero.precision=fp32,bf16``: each stage with fp32, then stage 0 with bf16), parsed by Hydra's
    own override parser; without sweeps, the one job."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.input_line] for o in parsed]
    keys = [o.get_key_element() if o.is_sweep_override() else None for o in parsed]

    def job(at: int, value: str) -> list[str]:
        out = []
        for i, (k, vs) in enumerate(zip(keys, values)):
            v = value if i == at else vs[0]
            out.append(v if k is None else f"{k}={v}")
        return out

    jobs = [job(-1, "")]
    for i, vs in enumerate(values):
        jobs += [job(i, v) for v in vs[1:]]
    return jobs


def check_runner_overrides(overrides: list[str]) -> None:
    """What the runner does before any rank starts: its pre-check, Hydra's compose, the
    library's validation. Output directories (``hydra.run.dir``, ``hydra.sweep.dir``) name the
    reader's own paths and are composed but not checked for writability here."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from zeropp.experiments.runner.overrides import check_overrides
    from zeropp.experiments.runner.run import validated

    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        raise ValueError(f"options {bad} where the runner takes key=value overrides")
    check_overrides([o for o in overrides if not o.startswith(("hydra.run.dir=", "hydra.sweep.dir="))])
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        for job in sweep_jobs(overrides):
            cfg = compose("config", overrides=job)
            validated(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), job)


def _check_run(args: list[str]) -> None:
    if args in (["--help"], ["-h"]):
        return
    check_runner_overrides([a for a in args if a not in ("-m", "--multirun")])


def _check_converge(args: list[str]) -> None:
    from zeropp.experiments.studies.converge_suite import SuiteConfig

    cfg = SuiteConfig.from_args(args)
    check_runner_overrides(list(cfg.overrides))


def _check_argparse(module: str, args: list[str]) -> None:
    """Parse with the module's own parser: its ``parse_args(argv)`` where it has one, else its
    ``main(argv)`` stopped after parsing; leftovers are runner overrides (``plan.*`` are the
    plan's own)."""
    mod = importlib.import_module(import_name(module))
    if mod.__spec__ is not None and mod.__spec__.submodule_search_locations is not None:
        mod = importlib.import_module(import_name(module) + ".__main__")
    if hasattr(mod, "parse_args"):
        mod.parse_args(args)
        return
    main: Callable[[list[str]], Any] = mod.main
    with stop_after_parsing():
        try:
            main(args)
        except _Parsed as p:
            extras = [e for e in p.extras if not e.startswith("plan.")]
            if extras:
                check_runner_overrides(extras)
            return
    raise AssertionError(
        f"python -m {module}: main() returned without parsing its arguments with argparse; "
        "give tests/docs_commands.py a checker for it"
    )


def check_module_args(module: str, args: list[str]) -> None:
    """Raise (``SystemExit`` from argparse, ``ConfigError``, Hydra's errors) unless ``args`` are
    arguments ``python -m module`` accepts."""
    base = module.removeprefix("zeropp.")
    if module in ("pytest", "venv"):
        return
    if base == "experiments.run":
        _check_run(args)
    elif base == "experiments.converge":
        _check_converge(args)
    else:
        _check_argparse(module, args)


def check_command(words: list[str]) -> None:
    """One documented shell command; raises with the reason when it would not work as written."""
    while words and (words[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0])):
        words = words[1:]
    if not words:
        return
    prog = words[0]
    if prog in SETUP_COMMANDS:
        return
    if prog in ("bash", "sbatch"):
        script = next((w for w in words[1:] if not w.startswith("-")), None)
        if script is None or not (ROOT / script).is_file():
            raise FileNotFoundError(f"{prog} {script}: no such script in the repository")
        return
    if prog in ("python", "python3", "torchrun"):
        if "-m" not in words:
            raise ValueError(f"{prog} without -m: the docs run modules, not files ({' '.join(words)})")
        i = words.index("-m")
        module, args = words[i + 1], words[i + 2 :]
        if not module_exists(module):
            raise ModuleNotFoundError(f"python -m {module}: no such module")
        check_module_args(module, args)
        return
    raise ValueError(f"{prog!r}: a kind of command tests/docs_commands.py does not know; teach it a check")


# --- python blocks ----------------------------------------------------------------------------


def check_imports(tree: ast.AST) -> None:
    """Every ``zeropp`` / ``torch`` import of ``tree`` names a module and attributes that exist."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("zeropp", "torch"):
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name != "*" and not hasattr(mod, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ModuleNotFoundError:
                            raise ImportError(f"cannot import name {alias.name!r} from {node.module}") from None
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("zeropp", "torch"):
                    importlib.import_module(alias.name)


def import_statements(text: str) -> str:
    """The import statements of a listing that is not valid Python as a whole: each line starting
    with ``from`` / ``import``, with the lines that continue its parentheses, comments dropped."""
    out: list[str] = []
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    i = 0
    while i < len(lines):
        if lines[i].startswith(("from ", "import ")):
            stmt = lines[i]
            while stmt.count("(") > stmt.count(")") and i + 1 < len(lines):
                i += 1
                stmt += " " + lines[i]
            out.append(stmt)
        i += 1
    return "\n".join(out)


def check_python(block: Block) -> None:
    """A Python block parses and its imports exist; a ``signatures`` block: its import statements."""
    check_imports(ast.parse(import_statements(block.text) if block.mark == "signatures" else block.text))
