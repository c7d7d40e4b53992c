"""A cache of built shared libraries that is trusted only when it should be.

``cpu_native.py`` compiles its kernels once and keeps the library in a per-user cache directory,
so later processes skip the compiler. Loading a shared library runs its code, so a cached file is
loaded only when all of these hold:

- the cache directory and the file are owned by this user and not group- or other-writable
  (anyone else who can write there could plant code); the file is a regular file, not a link;
- the file is not empty and its sha256 equals the one recorded next to it (``<name>.sha256``)
  when it was built: a truncated, corrupt or replaced file is never loaded;
- the loaded bytes are the checked bytes: the file is opened once, checked through that
  descriptor, and ``dlopen``-ed as ``/proc/self/fd/N`` (the same inode, whatever the path names
  by then).

What happens otherwise:

- missing, empty, hash-mismatched, or checked but failing to load: rebuilt in place (these are
  files of our own, in our own directory), then loaded;
- an unsafe directory or file: left untouched; one warning names the path and why, and the
  library is built into a fresh private temporary directory for this process (removed once
  loaded), so it still works, only without the cache. The same for a cache directory that
  cannot be created or written (a read-only home, a path through a file).

A build writes a temporary file in the cache directory, fsyncs it, records its hash (written to
a temporary and fsynced too), renames both into place and fsyncs the directory, so a crash
leaves either the old pair, the new pair, or a pair whose hashes disagree (rebuilt next time).
Concurrent builders (several ranks starting at once) take an exclusive ``flock`` on
``<name>.lock``; a process that finds no valid file takes the lock, checks again (another may
have just built it), and only then builds. Readers of a valid file take no lock.

Why hand-written: neither the standard library nor torch offers a verified, race-free cache of
native libraries (``torch.utils.cpp_extension`` keys its builds by name and trusts whatever file
it finds there).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

__all__ = ["LOCK_TIMEOUT_S", "UnsafeCache", "UnusableCache", "cached_library", "load_library", "load_once"]

HASH_SUFFIX = ".sha256"
LOCK_SUFFIX = ".lock"
LOCK_TIMEOUT_S = 900.0
"""How long a process waits for another one's build of the same library before it gives up."""

_WARNED: set[str] = set()


class UnusableCache(RuntimeError):
    """A cache directory that cannot be used: it cannot be created or written."""


class UnsafeCache(UnusableCache):
    """A cache directory or file that others could have written: never loaded from."""


def _unwritable(cache: Path, err: OSError) -> UnusableCache:
    return UnusableCache(f"the cache directory {cache} cannot be created or written ({err.strerror or err})")


def _unsafe(st: os.stat_result, what: str) -> Optional[str]:
    """Why a file or directory with status ``st`` must not be trusted (None if it may be)."""
    me = os.geteuid()
    if st.st_uid != me:
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {me})"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable:
        return f"{what} is writable by {' and '.join(writable)} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _open_dir(cache: Path) -> int:
    """A descriptor of ``cache`` (created private if missing), checked safe."""
    try:
        os.makedirs(cache, mode=0o700, exist_ok=True)
        dfd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise _unwritable(cache, e) from None
    why = _unsafe(os.fstat(dfd), f"the cache directory {cache}")
    if why:
        os.close(dfd)
        raise UnsafeCache(why)
    return dfd


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    os.lseek(fd, 0, os.SEEK_SET)
    return h.hexdigest()


def _open_checked(dfd: int, name: str, what: str) -> int:
    """Open ``name`` in ``dfd`` read-only without following a link; raise UnsafeCache if it is
    not a regular file of ours that only we can write (FileNotFoundError if it is missing)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise UnsafeCache(f"{what} cannot be opened as a plain file ({e.strerror}; a symbolic link?)") from None
    st = os.fstat(fd)
    why = None if stat.S_ISREG(st.st_mode) else f"{what} is not a regular file"
    why = why or _unsafe(st, what)
    if why:
        os.close(fd)
        raise UnsafeCache(why)
    return fd


def _verified(dfd: int, cache: Path, name: str) -> tuple[Optional[int], str, Optional[str]]:
    """``(fd, "", digest)`` of the cached library when it passes every check, else
    ``(None, why, digest or None)``. Raises UnsafeCache when it must not even be replaced."""
    try:
        fd = _open_checked(dfd, name, f"the cached library {cache / name}")
    except FileNotFoundError:
        return None, "not built yet", None
    try:
        if os.fstat(fd).st_size == 0:
            os.close(fd)
            return None, "is empty", None
        digest = _sha256(fd)
        try:
            hfd = _open_checked(dfd, name + HASH_SUFFIX, f"the hash file {cache / (name + HASH_SUFFIX)}")
        except FileNotFoundError:
            os.close(fd)
            return None, "has no recorded sha256", digest
        with os.fdopen(hfd, "r") as f:
            recorded = f.read(200).strip()
    except BaseException:
        os.close(fd)
        raise
    if recorded != digest:
        os.close(fd)
        return None, "does not match its recorded sha256", digest
    return fd, "", digest


@contextlib.contextmanager
def _locked(dfd: int, cache: Path, name: str) -> Iterator[None]:
    """Exclusive ``flock`` on ``<name>.lock`` (released at exit, or by the kernel if we die)."""
    try:
        lfd = os.open(name + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    except OSError as e:
        raise _unwritable(cache, e) from None
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has been building {name} for {LOCK_TIMEOUT_S:.0f} s "
                        f"(it holds {name + LOCK_SUFFIX}); stop it or remove the cache entry"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(lfd)  # closing releases the lock


def _build_in(dfd: int, cache: Path, name: str, build: Callable[[Path], None]) -> tuple[int, str]:
    """Build ``name`` into the cache (see the module docstring); its fd and sha256."""
    try:
        tmp_fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=cache)
    except OSError as e:
        raise _unwritable(cache, e) from None
    os.close(tmp_fd)
    tmp_name, hash_tmp = os.path.basename(tmp), None
    try:
        build(Path(tmp))
        fd = _open_checked(dfd, tmp_name, f"the build output {tmp}")
        try:
            if os.fstat(fd).st_size == 0:
                raise RuntimeError(f"the build of {name} wrote an empty file")
            os.fchmod(fd, 0o555)  # whatever the umask: nobody else may write it
            os.fsync(fd)
            digest = _sha256(fd)
            hfd, hash_tmp = tempfile.mkstemp(prefix=f".{name}{HASH_SUFFIX}.", suffix=".tmp", dir=cache)
            with os.fdopen(hfd, "w") as f:
                f.write(digest + "\n")
                f.flush()
                os.fchmod(f.fileno(), 0o444)
                os.fsync(f.fileno())
            os.replace(tmp_name, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.replace(os.path.basename(hash_tmp), name + HASH_SUFFIX, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        except BaseException:
            os.close(fd)  # the caller gets no descriptor of a build that failed
            raise
        return fd, digest
    finally:
        for leftover in (tmp, hash_tmp):
            if leftover is not None and os.path.lexists(leftover):
                os.unlink(leftover)


def _dlopen(fd: int, path: Path, load: Optional[Callable[[str], ctypes.CDLL]]) -> Optional[ctypes.CDLL]:
    """Load the checked file behind ``fd`` (by its path only where /proc/self/fd does not exist);
    None without a loader. Once handed to the loader as ``/proc/self/fd/N``, ``fd`` stays open
    for the life of the process (one descriptor per load, loaded or not): the dynamic loader
    knows a library by that name and would hand it out again for any later file opened under a
    reused number N."""
    proc = f"/proc/self/fd/{fd}"
    if load is not None and os.path.exists(proc):
        return load(proc)
    try:
        return None if load is None else load(str(path))
    finally:
        os.close(fd)


def _warn_once(why: str, cache: Path) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(
            f"zeropp.kernels: not using the kernel cache: {why}; building a private copy for this process "
            f"instead (slower start). Fix: make it a directory of yours that only you can write (chmod "
            f"go-w), or remove it, or point ZEROPP_CACHE_DIR at one (now {cache})",
            RuntimeWarning,
            stacklevel=5,
        )


def _private(name: str, build: Callable[[Path], None], load: Callable[[str], ctypes.CDLL]) -> tuple[ctypes.CDLL, Path]:
    """Build into a fresh private temporary directory, load, and remove it (the mapping stays)."""
    d = Path(tempfile.mkdtemp(prefix="zeropp-native-"))
    try:
        path = d / name
        build(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        lib = _dlopen(fd, path, load)
        assert lib is not None
        return lib, path
    finally:
        shutil.rmtree(d, ignore_errors=True)


def cached_library(
    cache: Path, name: str, build: Callable[[Path], None], load: Optional[Callable[[str], ctypes.CDLL]] = None
) -> tuple[Optional[ctypes.CDLL], Path]:
    """The library ``name`` of the cache directory ``cache``, checked, or built there by
    ``build(path)`` when missing, empty, corrupt, hash-mismatched or (with ``load``) failing to
    load. With ``load`` (a ``dlopen``, e.g. ``ctypes.CDLL``), returns the loaded library and the
    file it came from; without, ``(None, path)`` of the checked cached file. An unsafe cache is
    never read, and one that cannot be created or written is not used: with ``load``, a private
    build is loaded instead (one warning); without, :class:`UnusableCache` is raised."""
    try:
        return _from_cache(cache, name, build, load)
    except UnusableCache as e:
        if load is None:
            raise
        _warn_once(str(e), cache)
        return _private(name, build, load)


def _from_cache(
    cache: Path, name: str, build: Callable[[Path], None], load: Optional[Callable[[str], ctypes.CDLL]]
) -> tuple[Optional[ctypes.CDLL], Path]:
    dfd = _open_dir(cache)
    path = cache / name
    try:
        fd, why, digest = _verified(dfd, cache, name)
        failed: Optional[str] = None  # the digest of a checked file that did not load
        if fd is not None:
            try:
                return _dlopen(fd, path, load), path
            except (OSError, AttributeError) as e:  # not a loadable library, or lacks a symbol
                failed, why = digest, f"failed to load ({e})"
        with _locked(dfd, cache, name):
            fd, _, digest = _verified(dfd, cache, name)  # another process may have built it meanwhile
            if fd is not None and digest == failed:
                os.close(fd)
                fd = None
            if fd is None:
                if why.startswith(("does not match", "failed to load")):  # not a crash mid-write: say so
                    warnings.warn(
                        f"zeropp.kernels: the cached library {path} {why}; rebuilding it", RuntimeWarning, stacklevel=4
                    )
                fd, digest = _build_in(dfd, cache, name, build)
            return _dlopen(fd, path, load), path
    finally:
        os.close(dfd)


def load_library(
    cache: Path, name: str, build: Callable[[Path], None], load: Callable[[str], ctypes.CDLL] = ctypes.CDLL
) -> tuple[ctypes.CDLL, Path]:
    """:func:`cached_library` with a loader: the loaded library and the file it came from."""
    lib, path = cached_library(cache, name, build, load)
    assert lib is not None
    return lib, path


def load_once(owner: Any, load: Callable[[], tuple[ctypes.CDLL, Path]]) -> Optional[ctypes.CDLL]:
    """The library a loader module keeps in its globals: ``owner._LIB`` once loaded, else loaded by
    ``load()`` at the first call, under ``owner._LOCK`` (a ``threading.Lock``: threads of one process
    load it once). A failure is recorded as ``owner.FAILED`` (``"<type>: <message>"``) and returns
    None, now and at every later call, without trying again: the caller falls back and says why.
    Module globals (not an object) so that tests can reset a loader with ``monkeypatch.setattr``;
    typed ``Any`` since a module's globals are not declared to the type checker."""
    if owner._LIB is not None or owner.FAILED is not None:
        return owner._LIB
    with owner._LOCK:
        if owner._LIB is None and owner.FAILED is None:
            try:
                owner._LIB = load()[0]
            except Exception as err:
                owner.FAILED = f"{type(err).__name__}: {err}"
    return owner._LIB
