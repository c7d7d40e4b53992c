"""Every command and code block in README.md and docs/*.md works as written, checked without
running anything heavy: modules exist, arguments parse, runner overrides compose and validate,
scripts exist, Python blocks parse and import what exists (rules in ``tests/docs_commands.py``).
The checker itself is tested on crafted documents, so that a broken command really fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_commands import ROOT, Block, all_blocks, blocks, check_command, check_python, commands, module_exists
from zeropp.experiments.runner.config import ConfigError

SHELL = ("bash", "sh", "shell", "console")
TEST_COMMAND = ["python", "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup"]
"""README's second command, the one `.ci/run` runs."""


def _shell_cases() -> list[tuple[str, list[str]]]:
    return [(f"{b.where}: {' '.join(c)}", c) for b in all_blocks() if b.lang in SHELL for c in commands(b)]


def _python_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "python"]


def test_the_docs_hold_commands_to_check() -> None:
    cases = _shell_cases()
    readme = [c for label, c in cases if label.startswith("README.md")]
    assert len(cases) >= 40 and len(readme) >= 5, (len(cases), len(readme))
    assert TEST_COMMAND in readme
    assert any(b.lang == "" or b.lang in SHELL or b.lang == "python" for b in all_blocks())
    unknown = [b.where for b in all_blocks() if b.lang not in (*SHELL, "python", "text", "")]
    assert not unknown, f"fenced blocks of a language this check does not read: {unknown}"


@pytest.mark.parametrize("words", [c for _, c in _shell_cases()], ids=[label for label, _ in _shell_cases()])
def test_documented_command_works_as_written(words: list[str]) -> None:
    check_command(words)


@pytest.mark.parametrize("block", _python_blocks(), ids=[b.where for b in _python_blocks()])
def test_documented_python_parses_and_imports_what_exists(block: Block) -> None:
    check_python(block)


def test_readme_first_command_is_the_one_ci_runs() -> None:
    """README's two commands are what ``.ci/run`` does (it says to keep the two in step)."""
    first, second = [b for b in blocks(ROOT / "README.md") if b.lang in SHELL][:2]
    setup = commands(first)
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup[0] == ["python3", "-m", "venv", ".venv"] and "python3 -m venv .venv" in ci
    assert ["pip", "install", "torch==2.13.0"] in setup and "pip install --quiet torch==2.13.0" in ci
    assert ["pip", "install", "-e", ".[dev]"] in setup and 'pip install --quiet -e ".[dev]"' in ci
    assert setup[-1] == ["python", "-m", "experiments.run", "stage=3", "quant=int8"]
    assert commands(second) == [TEST_COMMAND] and " ".join(TEST_COMMAND) in ci


def test_readme_stays_short_and_docs_hold_no_issue_status() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
    for path in (ROOT / "docs").glob("*.md"):
        hits = re.findall(r"\bissues? \d+", path.read_text(), flags=re.I)
        assert not hits, (path.name, hits)


# --- the checker, on documents with known faults ----------------------------------------------


def _doc(tmp_path: Path, text: str) -> list[Block]:
    p = tmp_path / "doc.md"
    p.write_text(text)
    return blocks(p)


def test_marks_fences_and_continuations_are_read(tmp_path: Path) -> None:
    bs = _doc(
        tmp_path,
        "x\n<!-- docs-commands: gpu -->\n```bash\npython -m a.b x=1 \\\n    y=2  # note\n"
        "cd d && pip install e\n```\n\n```python\nimport torch\n```\n",
    )
    assert [(b.lang, b.mark, b.line) for b in bs] == [("bash", "gpu", 3), ("python", None, 9)]
    assert commands(bs[0]) == [["python", "-m", "a.b", "x=1", "y=2"], ["cd", "d"], ["pip", "install", "e"]]
    with pytest.raises(ValueError, match="unknown docs-commands mark 'gpus'"):
        _doc(tmp_path, "<!-- docs-commands: gpus -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        _doc(tmp_path, "```bash\npython -m experiments.run\n")


@pytest.mark.parametrize(
    "line, error",
    [
        ("python -m experiments.runn stage=3", ModuleNotFoundError),  # a misspelled module
        ("python -m zeropp.kernels.compile_chek", ModuleNotFoundError),
        ("python -m experiments.run stgae=3", ConfigError),  # an unknown key
        ("python -m experiments.run quant=int3", ConfigError),  # an unknown group option
        ("python -m experiments.run train.steps=abc", ConfigError),  # a value of the wrong type
        ("python -m experiments.run stage=1 quant=qwz", ConfigError),  # qwZ below stage 3: the library's check
        ("python -m experiments.run -m stage=0,5", ConfigError),  # a sweep value out of range
        ("python -m experiments.plan model=large --nodez 4", ValueError),  # argparse leaves --nodez over
        ("python -m experiments.bench_cluster --gbps 0.1 --round5 3", SystemExit),  # argparse refuses it
        ("python -m experiments.scaling --gbps fast", SystemExit),
        ("python -m experiments.cluster stats", SystemExit),  # a sub-command that does not exist
        ("python -m experiments.memory model=large --predict-all", ValueError),
        ("python -m experiments.converge schemes=zeropp seeds=0", ConfigError),
        ("torchrun --standalone --nproc-per-node 4 -m zeropp.experiments.run zero.stage=3", ConfigError),
        ("bash scripts/gpu_chek.sh", FileNotFoundError),
        ("make docs", ValueError),  # a command nobody checks
    ],
)
def test_a_broken_command_fails(line: str, error: type[BaseException], capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    with pytest.raises(error):
        check_command(shlex.split(line))


@pytest.mark.parametrize(
    "line",
    [
        "python -m experiments.run -m stage=0,1,2,3 zero.precision=fp32,bf16",
        "sudo python -m experiments.bench_cluster --check",
        "python -m experiments.plan model=tiny plan.nodes=4,8",
        "python -m experiments.cluster up --nodes 2 --gbps 1",
    ],
)
def test_a_good_command_passes(line: str) -> None:
    import shlex

    check_command(shlex.split(line))


def test_python_blocks_must_parse_and_import_what_exists(tmp_path: Path) -> None:
    good, typo, syntax, sig = _doc(
        tmp_path,
        (
            "```python\nfrom zeropp.comm import QuantSpec\nx = QuantSpec(bits=8)\n```\n"
            "```python\nfrom zeropp.comm import QuantSpek\n```\n"
            "```python\nquantize(x, *, rows=1)\n```\n"
            "<!-- docs-commands: signatures -->\n```python\nfrom zeropp.comm import (Topology,\n    Nope)\n"
            "quantize(x, *, rows=1)\n```\n"
        ),
    )
    check_python(good)
    with pytest.raises(ImportError, match="QuantSpek"):
        check_python(typo)
    with pytest.raises(SyntaxError):
        check_python(syntax)
    with pytest.raises(ImportError, match="Nope"):
        check_python(sig)


def test_module_lookup_follows_where_the_docs_run_it() -> None:
    assert module_exists("experiments.run") and module_exists("zeropp.experiments.run")
    assert module_exists("experiments.cluster")  # a package with __main__
    assert not module_exists("experiments.launcher_x")
    assert not module_exists("zeropp.comm")  # a package without __main__ cannot be run
