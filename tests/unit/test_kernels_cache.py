"""The native kernels' build cache (``kernels/build_cache.py``) trusts a cached library only when it
should: the faults a user meets, provoked for real in a temporary cache directory.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_kernels_cache.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.kernel_helpers import failing_compiler
from zeropp.kernels import build_cache, cpu_native


def test_cpu_native_falls_back_loudly_when_the_cache_is_unsafe_and_nothing_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No usable cache and no compiler: library() is None with the reason, and cpu.py warns once."""
    from zeropp.kernels import cpu

    cache_root = tmp_path / "root"
    (cache_root / "cpu_native").mkdir(parents=True)
    (cache_root / "cpu_native").chmod(0o777)
    failing_compiler(tmp_path, monkeypatch)
    monkeypatch.setenv("ZEROPP_CACHE_DIR", str(cache_root))
    for attr, value in (("ENABLED", True), ("_LIB", None), ("FAILED", None)):
        monkeypatch.setattr(cpu_native, attr, value)
    monkeypatch.setattr(cpu, "_native_warned", False)
    build_cache._WARNED.clear()
    with pytest.warns(RuntimeWarning) as rec:
        assert not cpu.native_enabled()
    text = [str(w.message) for w in rec]
    assert any("not using the kernel cache" in t and "writable by group and others" in t for t in text), text
    assert any("native CPU quantization kernels are unavailable" in t and "failed" in t for t in text), text
    assert cpu_native.FAILED is not None and "no-such-compiler failed" in cpu_native.FAILED


# ------------------------------------------------------------------ how it is written
def test_build_fsyncs_file_and_directory_around_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        import stat as st

        events.append("fsync dir" if st.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst, **kw) -> None:
        events.append(f"replace {dst}")
        real_replace(src, dst, **kw)

    monkeypatch.setattr(build_cache.os, "fsync", fsync)
    monkeypatch.setattr(build_cache.os, "replace", replace)
    build_cache.cached_library(tmp_path / "c", "zq_x.so", lambda out: out.write_bytes(b"lib bytes"))
    assert events == ["fsync file", "fsync file", "replace zq_x.so", "replace zq_x.so.sha256", "fsync dir"]
    assert oct((tmp_path / "c" / "zq_x.so").stat().st_mode & 0o777) == oct(0o555)
    assert oct((tmp_path / "c").stat().st_mode & 0o777) == oct(0o700)  # created private


def test_both_libraries_cache_keys_cover_the_shared_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an edit of cpu_common.h alone must name (and so build) new int and format libraries: a
    # stale library compiled from the old header must never be loaded
    from zeropp.kernels import cpu_format_library, cpu_formats

    if cpu_native.FAILED is not None or shutil.which(cpu_native._compiler()) is None:
        pytest.skip("no C++ compiler here")
    before = cpu_native._name_and_builder()[0], cpu_format_library._name_and_builder()[0]
    edited = tmp_path / "cpu_common.h"
    edited.write_text(cpu_native.HEADER.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_native, "HEADER", edited)
    after = cpu_native._name_and_builder()[0], cpu_format_library._name_and_builder()[0]
    assert before[0] != after[0] and before[1] != after[1]
    assert '#include "cpu_common.h"' in cpu_native.SOURCE.read_text()
    assert '#include "cpu_common.h"' in cpu_formats.SOURCE.read_text()


@pytest.mark.parametrize("which", [0, 1])
def test_the_format_librarys_key_covers_its_own_headers(
    which: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cpu_formats.cpp includes cpu_formats_nvfp4.h (its AVX-512 nvfp4 tiles) and
    # cpu_formats_deq.h (its AVX-512 MXFP6 / NVFP4 dequantize): an edit of either header alone
    # must name a new format library, and leave the int library's name alone
    from zeropp.kernels import cpu_format_library, cpu_formats

    if cpu_native.FAILED is not None or shutil.which(cpu_native._compiler()) is None:
        pytest.skip("no C++ compiler here")
    before = cpu_native._name_and_builder()[0], cpu_format_library._name_and_builder()[0]
    headers = cpu_format_library.HEADERS
    assert [h.name for h in headers] == ["cpu_formats_nvfp4.h", "cpu_formats_deq.h"]
    header = headers[which]
    assert f'#include "{header.name}"' in cpu_formats.SOURCE.read_text()
    edited = tmp_path / header.name
    edited.write_text(header.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_format_library, "HEADERS", tuple(edited if h == header else h for h in headers))
    after = cpu_native._name_and_builder()[0], cpu_format_library._name_and_builder()[0]
    assert before[0] == after[0] and before[1] != after[1]
