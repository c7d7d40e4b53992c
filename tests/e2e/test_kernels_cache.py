"""The native kernels' build cache (``kernels/build_cache.py``) trusts a cached library only when
it should: the faults a user meets, provoked for real in a temporary cache directory.

A "planted" library is a real shared object whose constructor writes a marker file when it is
``dlopen``-ed, so "not loaded" is proven by the marker's absence, not assumed. One real build of
the kernels (the compiler, ~5 s) serves the whole file; the other rebuilds copy its bytes.

Here: the end-to-end checks of this topic; its other tiers' checks are in
``tests/unit/test_kernels_cache.py``.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from zeropp.kernels import build_cache, cpu_native
from zeropp.kernels.reference import quantize_ref

PLANTED_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("ZQ_PLANTED_MARKER");
    if (p) { int fd = open(p, O_WRONLY | O_CREAT | O_APPEND, 0644); if (fd >= 0) { write(fd, "x", 1); close(fd); } }
}
"""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _plant(cache: Path, name: str, data: bytes, recorded: str | None) -> None:
    """Write ``data`` as the cached library ``name`` (and ``recorded`` as its hash file)."""
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    (cache / name).write_bytes(data)
    if recorded is not None:
        (cache / (name + build_cache.HASH_SUFFIX)).write_text(recorded + "\n")


def _works(lib, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether ``lib`` quantizes bit for bit like the reference (through cpu_native's call)."""
    monkeypatch.setattr(cpu_native, "_LIB", lib)
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    ref = quantize_ref(x, 8, 100, rows=4)
    codes, scales = torch.empty_like(ref.codes), torch.empty_like(ref.scales)
    cpu_native.quantize_into(x, 8, 100, False, 0, codes, scales)
    return torch.equal(codes, ref.codes) and torch.equal(scales, ref.scales)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of a shared object that writes ``$ZQ_PLANTED_MARKER`` when loaded."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the planted library")
    d = tmp_path_factory.mktemp("planted")
    (d / "planted.c").write_text(PLANTED_C)
    subprocess.run([cc, "-shared", "-fPIC", str(d / "planted.c"), "-o", str(d / "planted.so")], check=True, timeout=120)
    return (d / "planted.so").read_bytes()


@pytest.fixture(scope="module")
def real_build(tmp_path_factory: pytest.TempPathFactory, planted: bytes) -> dict:
    """The kernels loaded through ``cpu_native.load()`` from a cache where a planted library sits
    under the expected name with a hash file that does not match it (the one real build)."""
    if shutil.which(os.environ.get("CXX") or "g++") is None:
        pytest.skip("no C++ compiler for the native kernels")
    cache_root = tmp_path_factory.mktemp("cache")
    marker = cache_root / "marker"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZEROPP_CACHE_DIR", str(cache_root))
        mp.setenv("ZQ_PLANTED_MARKER", str(marker))
        name = cpu_native._name_and_builder()[0]
        cache = cpu_native.cache_dir()
        _plant(cache, name, planted, _sha(b"something else"))
        with pytest.warns(RuntimeWarning, match="does not match its recorded sha256; rebuilding") as rec:
            lib, path = cpu_native.load()
    return {
        "lib": lib,
        "path": path,
        "cache": cache,
        "name": name,
        "marker": marker,
        "bytes": (cache / name).read_bytes(),
        "warnings": [str(w.message) for w in rec],
    }


def _copying_build(data: bytes, calls: list[Path]):
    def build(out: Path) -> None:
        calls.append(out)
        out.write_bytes(data)

    return build


# ------------------------------------------------------------------ what is (not) loaded
def test_planted_library_with_a_wrong_hash_is_rebuilt_not_loaded(
    real_build: dict, planted: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not real_build["marker"].exists(), "the planted library was dlopened"
    data = real_build["bytes"]
    assert data != planted and data[:4] == b"\x7fELF"
    assert (real_build["cache"] / (real_build["name"] + ".sha256")).read_text().strip() == _sha(data)
    assert real_build["path"] == real_build["cache"] / real_build["name"]
    assert _works(real_build["lib"], monkeypatch)
    assert not [p for p in real_build["cache"].iterdir() if p.name.endswith(".tmp")]  # no temporaries left


def test_empty_cached_library_is_rebuilt(tmp_path: Path, real_build: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, calls = tmp_path / "c", []
    _plant(cache, "zq_x.so", b"", _sha(b""))  # the hash file even agrees: empty is never a library
    lib, path = build_cache.load_library(cache, "zq_x.so", _copying_build(real_build["bytes"], calls), cpu_native._load)
    assert len(calls) == 1 and path.read_bytes() == real_build["bytes"]
    assert _works(lib, monkeypatch)
    # the next process finds it valid: no build
    build_cache.load_library(cache, "zq_x.so", _copying_build(b"", calls), cpu_native._load)
    assert len(calls) == 1


def test_unloadable_cached_library_with_a_matching_hash_is_rebuilt(
    tmp_path: Path, real_build: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, calls = tmp_path / "c", []
    junk = b"\x7fELF" + b"\0" * 100  # truncated: its hash was recorded, but dlopen refuses it
    _plant(cache, "zq_x.so", junk, _sha(junk))
    with pytest.warns(RuntimeWarning, match="failed to load"):
        lib, _ = build_cache.load_library(
            cache, "zq_x.so", _copying_build(real_build["bytes"], calls), cpu_native._load
        )
    assert len(calls) == 1 and _works(lib, monkeypatch)


def test_library_without_a_recorded_hash_is_rebuilt(
    tmp_path: Path, planted: bytes, real_build: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, calls = tmp_path / "c", []
    _plant(cache, "zq_x.so", planted, None)  # e.g. a cache written before hashes were recorded
    monkeypatch.setenv("ZQ_PLANTED_MARKER", str(tmp_path / "marker"))
    lib, _ = build_cache.load_library(cache, "zq_x.so", _copying_build(real_build["bytes"], calls), cpu_native._load)
    assert len(calls) == 1 and not (tmp_path / "marker").exists() and _works(lib, monkeypatch)


@pytest.mark.parametrize(
    "fault",
    [
        "group-writable dir",
        "other-writable file",
        "group-writable file",
        "dir of another user",
        "file of another user",
        "symlinked file",
    ],
)
def test_unsafe_cache_is_refused_untouched_and_built_privately(
    fault: str, tmp_path: Path, planted: bytes, real_build: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted library whose hash file agrees (so only the ownership / mode check stands
    between it and dlopen) is not loaded; the warning names the path and why; nothing in the
    cache is changed; the kernels still load, from a private build."""
    if "another user" in fault and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    cache, calls = tmp_path / "c", []
    marker = tmp_path / "marker"
    monkeypatch.setenv("ZQ_PLANTED_MARKER", str(marker))
    if fault == "symlinked file":
        _plant(tmp_path / "elsewhere", "zq_x.so", planted, _sha(planted))
        cache.mkdir(mode=0o700)
        (cache / "zq_x.so").symlink_to(tmp_path / "elsewhere" / "zq_x.so")
        (cache / "zq_x.so.sha256").write_text(_sha(planted))
    else:
        _plant(cache, "zq_x.so", planted, _sha(planted))
    target = cache if "dir" in fault else cache / "zq_x.so"
    if "writable" in fault:
        target.chmod(0o775 if "group" in fault else 0o757 if "dir" in fault else 0o646)
    elif "another user" in fault:
        os.chown(target, 12345, -1)
    why = {
        "group-writable": "writable by group",
        "other-writable": "writable by others",
        "another user": "owned by uid 12345",
        "symlinked": "cannot be opened as a plain file",
    }
    expect = next(v for k, v in why.items() if k in fault)
    before = sorted((p.name, p.lstat().st_mtime_ns, p.lstat().st_mode) for p in cache.iterdir())
    build_cache._WARNED.clear()
    with pytest.warns(RuntimeWarning, match=f"not using the kernel cache: .*{expect}") as rec:
        lib, _path = build_cache.load_library(
            cache, "zq_x.so", _copying_build(real_build["bytes"], calls), cpu_native._load
        )
    msg = str(rec[0].message)
    assert str(cache) in msg and "ZEROPP_CACHE_DIR" in msg
    assert not marker.exists(), "the planted library was dlopened"
    assert len(calls) == 1 and cache not in calls[0].parents and not calls[0].exists()  # private, removed
    assert sorted((p.name, p.lstat().st_mtime_ns, p.lstat().st_mode) for p in cache.iterdir()) == before
    assert _works(lib, monkeypatch)


@pytest.mark.parametrize("fault", ["path through a file", "read-only directory"])
def test_unwritable_cache_builds_privately(
    fault: str, tmp_path: Path, real_build: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fault == "read-only directory":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        cache = tmp_path / "c"
        cache.mkdir(mode=0o500)
    else:
        (tmp_path / "file").write_text("not a directory")
        cache = tmp_path / "file" / "c"  # e.g. ZEROPP_CACHE_DIR set to a file by mistake
    calls: list[Path] = []
    build_cache._WARNED.clear()
    with pytest.warns(
        RuntimeWarning, match=f"not using the kernel cache: the cache directory {cache} cannot be created or written"
    ):
        lib, _ = build_cache.load_library(
            cache, "zq_x.so", _copying_build(real_build["bytes"], calls), cpu_native._load
        )
    assert len(calls) == 1 and cache not in calls[0].parents and _works(lib, monkeypatch)


def _build_in_process(cache: str, log: str) -> str:
    def build(out: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # long enough for every process to arrive while it builds
        out.write_bytes(b"one build " * 100)

    return str(build_cache.cached_library(Path(cache), "zq_x.so", build)[1])


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    """Four processes starting at once on an empty cache: one builds, all get the same file.
    Spawned, not forked: a fork of the test process (which by now has threads of its own, gloo's
    and torch's) can copy a lock some other thread holds, and the child then waits forever; the
    result's timeout turns any other hang into a failure."""
    log = tmp_path / "builds"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        paths = pool.starmap_async(_build_in_process, [(str(tmp_path / "c"), str(log))] * 4).get(timeout=120)
    assert len(set(paths)) == 1 and len(log.read_text().split()) == 1
    data = Path(paths[0]).read_bytes()
    assert (tmp_path / "c" / "zq_x.so.sha256").read_text().strip() == _sha(data)
