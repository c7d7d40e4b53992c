"""One output file at a path the user names (``--json FILE``, ``--plot FILE``;
zeropp/output_files.py): refused before any work when it cannot be written, never written over a
file the command did not write, and replaced when it is the command's own earlier output. Checked
on the rule itself and on each command that writes such a file."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from zeropp import output_files
from zeropp.doctor import __main__ as doctor_cli
from zeropp.doctor.result import passed
from zeropp.experiments.bench import cluster as bench_cluster
from zeropp.experiments.bench import comm as bench_comm
from zeropp.experiments.bench import offload as bench_offload
from zeropp.experiments.launch.command import run_command
from zeropp.experiments.projection import speedup
from zeropp.experiments.studies import mixz
from zeropp.output_files import (
    OutputFileError,
    OutputWriteError,
    check_output_file,
    holds_tag,
    json_file_is,
    write_output_file,
)

NOTES = '{"mine": 1}\n'


def _ours(path: Path) -> bool:
    return json_file_is(path, lambda d: isinstance(d, dict) and d.get("tool") == "t")


def test_the_rule(tmp_path: Path) -> None:
    with pytest.raises(OutputFileError, match="is a directory; name a file, e.g."):
        check_output_file(tmp_path, "--json", ours=_ours)
    with pytest.raises(OutputFileError, match="does not exist; create it or name another file"):
        check_output_file(tmp_path / "missing" / "o.json", "--json", ours=_ours)
    check_output_file(tmp_path / "missing" / "deeper" / "o.json", "--plot", ours=_ours, create_parents=True)
    assert not (tmp_path / "missing").exists()  # the check creates nothing
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputFileError, match="f is not a directory"):
        check_output_file(tmp_path / "f" / "o.json", "--json", ours=_ours, create_parents=True)
    with pytest.raises(OutputFileError, match="cannot write in /proc"):  # refuses files even to root
        check_output_file(Path("/proc/o.json"), "--json", ours=_ours)
    notes = tmp_path / "notes.json"
    notes.write_text(NOTES)
    with pytest.raises(
        OutputFileError, match="exists and is not a file this command can tell it wrote .*; nothing was run"
    ):
        check_output_file(notes, "--json", ours=_ours)
    link = tmp_path / "link.json"
    link.symlink_to(notes)
    with pytest.raises(OutputFileError, match="exists and is not a file this command can tell it wrote"):
        check_output_file(link, "--json", ours=lambda p: True)
    ours = tmp_path / "ours.json"
    write_output_file(ours, json.dumps({"tool": "t"}))
    check_output_file(ours, "--json", ours=_ours)  # an earlier output of the command may be replaced
    assert notes.read_text() == NOTES and sorted(p.name for p in tmp_path.iterdir()) == [
        "f",
        "link.json",
        "notes.json",
        "ours.json",
    ]  # no probe left behind


def _bench_argvs(path: str) -> list[tuple[object, list[str]]]:
    """Each command's arguments with ``path`` as its output file (parse_args only: nothing runs)."""
    return [
        (bench_offload.parse_args, ["--sizes", "1k", "--swap-mib", "0", "--json", path]),
        (bench_comm.parse_args, ["--nodes", "1", "--ranks-per-node", "2", "--formats", "none", "--json", path]),
        (bench_comm.parse_args, ["--nodes", "1", "--ranks-per-node", "2", "--formats", "none", "--calibrate", path]),
        (bench_cluster.parse_args, ["--json", path]),
        (doctor_cli.parse_args, ["--json", path]),
    ]


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("kind", ["foreign file", "directory", "unwritable"])
def test_each_command_refuses_before_any_work(case: int, kind: str, tmp_path: Path, capsys) -> None:
    """Before: the benchmark ran, then died with a traceback at its end (directory, /proc), or
    silently replaced the user's file."""
    notes = tmp_path / "notes.json"
    notes.write_text(NOTES)
    path = {"foreign file": notes, "directory": tmp_path, "unwritable": Path("/proc/o.json")}[kind]
    parse, argv = _bench_argvs(str(path))[case]
    with pytest.raises(SystemExit) as e:
        parse(argv)  # type: ignore[operator]
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(path) in err and "Traceback" not in err
    assert notes.read_text() == NOTES


def test_bench_offload_refuses_a_swap_dir_that_takes_no_files(capsys) -> None:
    with pytest.raises(SystemExit) as e:  # before: a FileNotFoundError traceback from mkdtemp
        bench_offload.parse_args(["--sizes", "1k", "--swap-mib", "1", "--dir", "/proc"])
    assert e.value.code == 2 and "--dir /proc cannot take the swap test's files" in capsys.readouterr().err


def test_bench_offload_replaces_its_own_json_only(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    for _ in range(2):  # the second run replaces the first's file
        assert bench_offload.main(["--sizes", "1k", "--repeat", "1", "--swap-mib", "0", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())) == {"adam", "swap", "args"}
    assert [p.name for p in tmp_path.iterdir()] == ["o.json"]


def test_mixz_refuses_its_json_path_before_training(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(mixz, "run", lambda *a, **k: pytest.fail("trained for a --json it cannot write"))
    notes = tmp_path / "notes.json"
    notes.write_text(NOTES)
    for path in (notes, tmp_path, Path("/proc/rows.json")):
        with pytest.raises(SystemExit) as e:
            mixz.main(["--preset", "tiny", "--steps", "1", "--json", str(path)])
        assert e.value.code == 2 and str(path) in capsys.readouterr().err
    assert notes.read_text() == NOTES


def test_doctor_replaces_its_own_report(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"schema": 1, "checks": []}))
    assert doctor_cli.parse_args(["--json", str(path)]).json_path == path


def test_scaling_plot(tmp_path: Path, capsys) -> None:
    def run(plot: Path | str) -> int:
        try:
            speedup.main(["--max-gpus", "16", "--plot", str(plot)])
        except SystemExit as e:
            return int(e.code or 0)
        return 0

    mine = tmp_path / "mine.png"
    mine.write_bytes(b"\x89PNG not yours")
    for bad, msg in [
        (tmp_path, "is a directory"),  # before: written as <dir>.png, beside the directory
        (tmp_path / "plot", "name a .png, .pdf, .svg file"),  # before: written as plot.png
        (tmp_path / "plot.json", "name a .png, .pdf, .svg file"),  # before: a matplotlib traceback after the table
        (mine, "exists and is not a file this command can tell it wrote"),  # before: replaced
        (Path("/proc/s.png"), "cannot write in /proc"),  # before: a traceback after the table
    ]:
        assert run(bad) == 2 and msg in capsys.readouterr().err
    assert mine.read_bytes() == b"\x89PNG not yours" and not (tmp_path.parent / f"{tmp_path.name}.png").exists()
    for kind in ("png", "pdf", "svg"):
        out = tmp_path / "new" / f"s.{kind}"
        assert run(out) == 0 and run(out) == 0  # a new folder, then its own earlier plot replaced
        assert speedup.is_our_plot(out)


@pytest.mark.parametrize(
    "command,argv",
    [
        ("formats", ["--out", ""]),
        ("memory_study", ["--out", ""]),
        ("plan", ["model=tiny", "--out", ""]),
        ("plan", ["model=tiny", "plan.out="]),
        ("bench_offload", ["--json", ""]),
        ("bench_comm", ["--json", ""]),
        ("bench_peers", ["--out", ""]),
        ("bench_gpu", ["--out", ""]),
        ("export", ["", "out"]),
        ("report", [""]),
        ("scaling_check", [""]),
        ("mixz", ["--json", ""]),
    ],
)
def test_an_empty_path_is_a_usage_error(command: str, argv: list[str], tmp_path: Path, monkeypatch, capsys) -> None:
    """Before: ``--out ""`` (an unset shell variable) was the current directory: the study's files
    landed there, and bench_peers silently used a temporary directory instead."""
    import importlib

    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"zeropp.experiments.{command}").main
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "an empty path" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["png", "pdf", "svg"])
def test_a_tag_counts_only_in_the_plots_metadata_field(tmp_path: Path, kind: str) -> None:
    """A plot saved with the tag in its metadata field (PNG ``Software``, PDF / SVG ``Creator``) is
    ours; a user's file that merely mentions the tag (notes naming the tool) is not."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    buf = io.BytesIO()
    fig.savefig(buf, format=kind, metadata={"Software" if kind == "png" else "Creator": "zeropp TAG"})
    plt.close(fig)
    plot, notes = tmp_path / f"plot.{kind}", tmp_path / f"notes.{kind}"
    plot.write_bytes(buf.getvalue())
    notes.write_bytes(b"my own figure, drawn like zeropp TAG's\n" + bytes(200_000))
    assert holds_tag(plot, "zeropp TAG") and not holds_tag(notes, "zeropp TAG")
    assert not holds_tag(plot, "zeropp TA") and not holds_tag(tmp_path / "missing.png", "zeropp TAG")


def _disk_full(path: Path, data: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_write_the_system_refuses_is_one_line_naming_the_file(tmp_path: Path, monkeypatch, capsys) -> None:
    """A disk that filled during the run: the doctor's table was printed, then its --json write
    ended in write_atomic's OSError traceback (likewise plan --out, scaling --plot, the benchmarks'
    --json). Now one ``error:`` line naming the file and why, exit 1."""
    monkeypatch.setattr(output_files, "write_atomic", _disk_full)
    target = tmp_path / "out.json"
    with pytest.raises(OutputWriteError) as e:
        write_output_file(target, "{}")
    assert str(e.value).startswith(f"cannot write {target}: No space left on device; nothing was written there")
    with pytest.raises(SystemExit) as ended:
        run_command(lambda: write_output_file(target, "{}"))
    assert ended.value.code == 1
    assert capsys.readouterr().err == f"error: {e.value}\n"
    monkeypatch.setattr(doctor_cli, "CHECKS", [("ok", lambda o: passed("ok", "fine"))])
    assert doctor_cli.main(["--json", str(target)]) == 1
    out = capsys.readouterr()
    assert "zeropp doctor: ok: 1 passed" in out.out + out.err
    assert out.err.endswith(f"zeropp doctor: error: --json {e.value}\n") and not target.exists()
