"""Atomic file writes: the one implementation hsextract uses for every file it replaces whole.

Guarantee: a reader of `path` sees the previous file or the complete new one, never a part, and no other
file is touched. How: a temporary file in the same directory, named `.<name>.<16 hex>.tmp` and created
with O_CREAT|O_EXCL|O_NOFOLLOW (a planted file or symlink under that name is an error, never followed or
overwritten); the data written and fsync'ed; renamed onto `path`; the directory fsync'ed, so after a crash
the name points to the whole new file or to the old one. On failure the temporary file is removed.

`atomic_dir` does the same for a whole folder: built under a temporary name beside it, put in place when
complete (a previous folder swapped out in one step where the kernel can, and deleted only then), removed if
building fails.

`durable=False` skips the two fsyncs and keeps the rest: for the SGLang plugin's dump files, which live
for seconds, are read by the client on the same host, and whose loss a crash makes moot (the request is
retried), while an fsync per piece would stall the server's writer threads.

Standard library only: the SGLang server process imports it (through the plugin's writer and dump files),
beside the plugin package and the other leaves listed in `hsextract.sglang.config.SERVER_MODULES`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import secrets
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")
TEMP_SUFFIX = ".tmp"
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def temp_name(path: Path) -> Path:
    """`.<name>.<16 hex>.tmp` beside `path`: hidden, unpredictable, recognisable as ours for clean-up."""
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")


def temp_target(name: str) -> str | None:
    """The file name a temp_name() was made for (`chunk-00003.hss` of `.chunk-00003.hss.<16 hex>.tmp`), else None."""
    m = re.fullmatch(rf"\.(.+)\.[0-9a-f]{{16}}{re.escape(TEMP_SUFFIX)}", name)
    return m[1] if m else None


def _fresh_temp(path: Path, make: Callable[[Path], T]) -> T:
    """make(name) for a fresh temp_name(path); `make` creates exclusively, raising FileExistsError if taken."""
    for _ in range(8):
        try:
            return make(temp_name(path))
        except FileExistsError:  # 64 random bits taken: someone planted it, or a 2^-64 chance
            continue
    raise FileExistsError(f"{path.parent}: eight fresh temporary names for {path.name} all existed")


def _make_dir(tmp: Path) -> Path:
    tmp.mkdir()  # exclusive; mode 0o777 masked by the umask, as for the folder it becomes
    return tmp


def create_temp(path: str | os.PathLike[str], mode: int = 0o666) -> tuple[int, Path]:
    """A new, empty temporary file beside `path` (O_EXCL|O_NOFOLLOW): (fd, its path). `mode` is
    masked by the umask, as for open()."""
    return _fresh_temp(Path(path), lambda tmp: (os.open(tmp, _FLAGS, mode), tmp))


def discard(tmp: Path) -> None:
    """Remove a failed write's temporary file. A folder that refuses it (made read-only mid-write) must not hide
    the error that failed the write behind this one. Left there, it is hidden and never read; the shard writer
    and atomic_dir remove their path's leftovers before writing (remove_temps), and the stale-chunk clean-up
    those of chunks a configuration no longer has."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # only a write gets these


def failed_write(e: BaseException, path: str | os.PathLike[str]) -> BaseException:
    """The error to raise for a failed write of `path`: a full disk's (or quota's, or file-size limit's) OSError,
    which names no file (write(2), fsync(2)), as the same error naming `path`, also where a writer made a
    RuntimeError of it (torch.save: "unexpected pos"); anything else as it is (an error of the caller's own, a read's
    EIO, is not the output's)."""
    cause: BaseException | None = e
    if type(e) is RuntimeError:  # what it was raised from, or during (not `from None`)
        cause = e.__cause__ if e.__cause__ is not None else None if e.__suppress_context__ else e.__context__
    if isinstance(cause, OSError) and cause.errno in NO_SPACE and cause.filename is None:
        return OSError(cause.errno, cause.strerror, os.fspath(path))
    return e


def fsync_path(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """fsync a file already written and closed (directory: a folder, its entries' names)."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    fsync_path(folder, directory=True)


def commit(fd: int, tmp: Path, path: str | os.PathLike[str], durable: bool = True) -> None:
    """Finish a file made by create_temp: fsync it (durable), close it, rename it onto `path`, fsync the
    directory (durable). Removes `tmp` if any step fails."""
    try:
        try:
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        discard(tmp)
        if failed_write(e, path) is e:
            raise
        raise failed_write(e, path) from e
    if durable:
        fsync_dir(Path(path).parent)


def _writev_all(fd: int, chunks: Sequence[Buffer]) -> None:
    views = [v for v in (memoryview(c).cast("B") for c in chunks) if len(v)]
    while views:
        n = os.writev(fd, views[:1024])  # IOV_MAX is 1024 on Linux
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def write_bytes_atomic(path: str | os.PathLike[str], data: Buffer | Sequence[Buffer], *, durable: bool = True,
                       mode: int = 0o666) -> None:
    """Write `data` (one buffer, or several written back to back with writev) to `path` atomically."""
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    fd, tmp = create_temp(path, mode)
    try:
        _writev_all(fd, chunks)
    except BaseException as e:
        os.close(fd)
        discard(tmp)
        if failed_write(e, path) is e:
            raise
        raise failed_write(e, path) from e
    commit(fd, tmp, path, durable)


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[IO[bytes]]:
    """`with atomic_file(p) as f: f.write(...)`: the file appears at `p` whole when the block ends, and
    not at all if it raises."""
    fd, tmp = create_temp(path)
    f = os.fdopen(fd, "wb", closefd=False)
    try:
        yield f
        f.flush()
    except BaseException as e:
        with contextlib.suppress(OSError):  # close flushes again, and fails again on a full disk: closed all the same
            f.close()
        os.close(fd)
        discard(tmp)
        if failed_write(e, path) is e:
            raise
        raise failed_write(e, path) from e
    f.close()
    commit(fd, tmp, path, durable)


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any], *, durable: bool = True) -> None:
    """Call write(f) on a binary file that becomes `path` atomically (parent folders are created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, durable=durable) as f:
        write(f)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 1, sort_keys: bool = False,
                      durable: bool = True) -> None:
    """JSON of `obj` (and a newline) written atomically; parent folders are created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, (json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n").encode(), durable=durable)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one step (Linux renameat2 RENAME_EXCHANGE): True if done, False where the
    C library, kernel or file system cannot (the caller then falls back to two renames)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28 (musl, macOS)
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextmanager
def atomic_dir(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[Path]:
    """`with atomic_dir(p) as tmp: <write into tmp>`: a new empty folder beside `p` (parents created) that
    becomes `p` when the block ends, replacing whatever `p` was (its old content is deleted only then); if
    the block raises, `tmp` is removed and `p` left as it was. A replacement swaps the two names in one step
    (`exchange`), so `p` is never absent; where the file system cannot, two renames, between which a crash
    leaves the old folder under a `.<name>.<16 hex>.tmp` name."""
    path = Path(os.path.abspath(path))  # "." or "out/..": a real last name, whose parent holds the temp
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_temps(path)  # what a killed build of `path` left (one writer of a path at a time)
    tmp = _fresh_temp(path, _make_dir)
    try:
        yield tmp
        if durable:
            fsync_dir(tmp)
        old = None
        if os.path.lexists(path):
            if exchange(tmp, path):
                old = tmp  # the old folder (or file, or symlink), now under the temporary name
            else:
                old = temp_name(path)
                os.rename(path, old)
        if old is not tmp:
            try:
                os.rename(tmp, path)
            except BaseException:
                if old is not None:
                    os.rename(old, path)
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing raises once an exchange is done
        raise
    if durable:
        fsync_dir(path.parent)
    if old is not None and old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old is not None:  # a file, or a symlink: removed, never followed
        old.unlink()


def blocked_parent(path: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """Why `path` cannot be created: (its nearest existing ancestor, "not a folder" or "not writable"), the folders
    between them being made on writing; None when it can."""
    folder = Path(path).parent
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return folder, "not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return folder, "not writable"
    return None


def exit_on_sigterm() -> None:
    """SIGTERM (Snakemake stopping its jobs, a scheduler's preemption, `kill`) as SystemExit(143) in the main
    thread: the `with` blocks of the writers unwind and remove their temporary files, which the default action
    (the process ends at once) left behind, up to a whole shard's size, until that chunk ran again."""
    def _exit(signum: int, frame: object) -> None:
        print(f"hsextract: stopped by {signal.Signals(signum).name}: removing this job's temporary output, nothing "
              "else is changed", file=sys.stderr, flush=True)  # the job's log says why it ends here
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def remove_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files (and atomic_dir's folders) that killed writers of `path` left behind (never
    `path` itself)."""
    path = Path(path)
    stale = list(path.parent.glob(f".{glob.escape(path.name)}.*{TEMP_SUFFIX}"))  # `k*` is a name, not a pattern
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)  # a symlink itself, never its target
    return stale
