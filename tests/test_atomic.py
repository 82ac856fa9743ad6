"""The one atomic-write helper: whole file or none, planted names never followed, fsync where promised."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from hsextract import atomic
from hsextract.atomic import (
    atomic_dir,
    atomic_file,
    create_temp,
    remove_temps,
    write_atomic,
    write_bytes_atomic,
    write_json_atomic,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "hsextract"


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_writes_whole_file_with_umask_mode_and_leaves_no_temp(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_bytes_atomic(tmp_path / "a.bin", [b"ab", memoryview(b"cd"), bytearray(b"")])
        write_json_atomic(tmp_path / "sub" / "b.json", {"x": [1, 2]})
    finally:
        os.umask(old)
    assert (tmp_path / "a.bin").read_bytes() == b"abcd"
    assert (tmp_path / "sub" / "b.json").read_text() == '{\n "x": [\n  1,\n  2\n ]\n}\n'
    assert stat.S_IMODE((tmp_path / "a.bin").stat().st_mode) == 0o640
    assert listing(tmp_path) == ["a.bin", "sub"] and listing(tmp_path / "sub") == ["b.json"]


def test_a_failing_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("old")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_atomic(tmp_path / "a.json", boom)
    with pytest.raises(RuntimeError, match="half"), atomic_file(tmp_path / "a.json") as f:
        f.write(b"half")
        raise RuntimeError("half")
    assert (tmp_path / "a.json").read_text() == "old" and listing(tmp_path) == ["a.json"]


FULL_DISK = """
import os, resource, sys, torch
from hsextract.atomic import write_atomic, write_bytes_atomic
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # a file over 100 kB: EFBIG, as a full disk's ENOSPC
out = sys.argv[1]
for name, write in (("a.bin", lambda p: write_atomic(p, lambda f: [f.write(b"y" * 1000) for _ in range(300)])),
                    ("b.bin", lambda p: write_bytes_atomic(p, b"x" * 300_000)),
                    ("c.pt", lambda p: write_atomic(p, lambda f: torch.save(torch.zeros(100_000), f)))):
    try:
        write(os.path.join(out, name))
    except OSError as e:
        print(type(e).__name__, e.errno, e.filename, e.strerror, sep="|")
print(sorted(os.listdir(out)), len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1)
"""


def test_a_full_disk_is_an_oserror_naming_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    """A write that fails for space (here the file-size limit: EFBIG, without root for a small file system): the
    error names the file (write(2) names none), torch.save's "unexpected pos" is the OSError under it, and the
    temporary file goes (a buffered file's close flushes again and failed again, skipping the clean-up)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[:3] == [f"OSError|27|{tmp_path / n}|File too large" for n in ("a.bin", "b.bin", "c.pt")]
    assert out[3].startswith("[] ")


def test_an_error_of_the_writer_s_own_is_not_blamed_on_the_output(tmp_path: Path) -> None:
    """Only a space error is the output's: a read's error inside the callback (a shard's EIO while exporting), or a
    RuntimeError raised `from None` over an unrelated OSError, comes through as it was raised."""
    def reads(f):
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            os.pread(fd, 10, 0)
        finally:
            os.close(fd)

    def config(f):
        try:
            open(tmp_path / "missing.cfg")
        except OSError:
            raise RuntimeError("bad config value") from None

    with pytest.raises(IsADirectoryError) as e:
        write_atomic(tmp_path / "out.bin", reads)
    assert e.value.filename is None
    with pytest.raises(RuntimeError, match="^bad config value$"):
        write_atomic(tmp_path / "out.bin", config)
    assert listing(tmp_path) == []


def test_a_folder_that_refuses_the_clean_up_does_not_hide_the_first_error(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder made read-only mid-write (audit, `chattr +i`) refused the rename, then the temp's removal: the
    removal's PermissionError was raised, chained to the rename's, and the cause showed only as its context."""
    from conftest import make_sample, shard_metadata

    from hsextract.shard import ShardWriter

    def refused(*args, **kwargs):  # naming the files, as the system calls' errors do
        raise PermissionError(13, "Operation not permitted (folder made read-only)", *map(str, args[:1]), None,
                              *map(str, args[1:2]))

    real_unlink = Path.unlink
    monkeypatch.setattr(os, "replace", refused)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: refused() if self.name.endswith(".tmp")
                        else real_unlink(self, missing_ok=missing_ok))
    with pytest.raises(PermissionError) as e:
        write_bytes_atomic(tmp_path / "a.bin", b"data")
    assert e.value.__context__ is None  # the rename's refusal itself, nothing raised while handling it
    with pytest.raises(PermissionError) as e, ShardWriter(tmp_path / "s.hss", shard_metadata()) as w:
        w.add(*make_sample(5))
        raise PermissionError(13, "written half")
    assert str(e.value) == "[Errno 13] written half" and e.value.__context__ is None
    monkeypatch.undo()  # the folder writable again: the next writer of each path removes what was left
    assert len(remove_temps(tmp_path / "a.bin")) == 1 and len(remove_temps(tmp_path / "s.hss")) == 1
    assert listing(tmp_path) == []


def test_a_planted_symlink_at_the_temporary_name_is_never_followed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    names = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: next(names))
    (tmp_path / f".out.json.{'0' * 16}.tmp").symlink_to(victim)
    write_bytes_atomic(tmp_path / "out.json", b"new")  # the planted name is skipped, the next one used
    assert victim.read_text() == "precious" and (tmp_path / "out.json").read_bytes() == b"new"

    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: "0" * 16)  # every name planted
    with pytest.raises(FileExistsError, match="eight fresh temporary names for out.json all existed"):
        write_bytes_atomic(tmp_path / "out.json", b"newer")
    assert victim.read_text() == "precious" and (tmp_path / "out.json").read_bytes() == b"new"


def test_a_symlink_at_the_destination_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out.json").symlink_to(victim)
    write_bytes_atomic(tmp_path / "out.json", b"new")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out.json").is_symlink() and (tmp_path / "out.json").read_bytes() == b"new"


@pytest.mark.parametrize("durable", [True, False])
def test_fsyncs_the_file_and_the_folder_when_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     durable: bool) -> None:
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode)
                                                               else "file"), real(fd)))
    write_bytes_atomic(tmp_path / "a", b"x", durable=durable)
    assert synced == (["file", "dir"] if durable else [])


def test_create_temp_is_exclusive_and_remove_temps_cleans_only_temps(tmp_path: Path) -> None:
    fd, tmp = create_temp(tmp_path / "s.hss")
    os.close(fd)
    assert re.fullmatch(r"\.s\.hss\.[0-9a-f]{16}\.tmp", tmp.name)
    (tmp_path / "s.hss").write_text("shard")
    assert remove_temps(tmp_path / "s.hss") == [tmp]
    assert listing(tmp_path) == ["s.hss"]


def test_remove_temps_reads_a_name_with_glob_characters_as_a_name(tmp_path: Path) -> None:
    mine, others = tmp_path / ".k*.0123456789abcdef.tmp", [tmp_path / ".kf.0123456789abcdef.tmp",
                                                             tmp_path / ".k[1].0123456789abcdef.tmp"]
    for p in (mine, *others):
        p.mkdir()
    assert remove_temps(tmp_path / "k*") == [mine]
    assert listing(tmp_path) == sorted(p.name for p in others)


def test_atomic_dir_replaces_a_folder_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="half"), atomic_dir(out) as tmp:
        (tmp / "new.txt").write_text("half")
        raise RuntimeError("half")
    assert listing(tmp_path) == ["out"] and listing(out) == ["sub"] and listing(out / "sub") == ["old.txt"]
    with atomic_dir(out) as tmp:
        assert re.fullmatch(r"\.out\.[0-9a-f]{16}\.tmp", tmp.name) and tmp.parent == tmp_path
        (tmp / "new.txt").write_text("new")
        assert listing(out) == ["sub"]  # the old folder until the block ends
    assert listing(tmp_path) == ["out"] and listing(out) == ["new.txt"]


def test_atomic_dir_swaps_in_one_step_so_a_crash_after_it_leaves_the_new_folder(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.write_text("b")
    assert atomic.exchange(a, b) is True  # renameat2 on this kernel and file system
    assert b.is_dir() and a.read_text() == "b"
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real_fsync_dir = atomic.fsync_dir

    def killed_after_the_swap(folder: Path) -> None:
        if Path(folder) == tmp_path:  # the parent's fsync: the names are already swapped
            raise KeyboardInterrupt("killed")
        real_fsync_dir(folder)

    monkeypatch.setattr(atomic, "fsync_dir", killed_after_the_swap)
    with pytest.raises(KeyboardInterrupt), atomic_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert listing(out) == ["new.txt"] and listing(old) == ["old.txt"]  # never an absent `out`
    monkeypatch.undo()
    with atomic_dir(out) as tmp:  # the next build of `out` removes what the killed one left
        (tmp / "newer.txt").write_text("newer")
    assert listing(tmp_path) == ["a", "b", "out"] and listing(out) == ["newer.txt"]


def test_atomic_dir_falls_back_to_two_renames_where_the_swap_is_unsupported(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with atomic_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert listing(tmp_path) == ["out"] and listing(out) == ["new.txt"]


def test_atomic_dir_replaces_a_symlink_at_the_destination_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    (tmp_path / "out").symlink_to(victim)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "new.txt").write_text("new")
    assert listing(victim) == ["precious"] and not (tmp_path / "out").is_symlink()
    assert listing(tmp_path / "out") == ["new.txt"] and listing(tmp_path) == ["out", "victim"]


def test_no_other_rename_based_writer_in_the_package() -> None:
    """Every file and folder hsextract replaces whole goes through the helpers."""
    allowed = {"atomic.py"}
    found = []
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC).as_posix()
        if rel not in allowed and re.search(r"os\.replace\(|\.rename\(|tmp\.replace\(|mkstemp\(", p.read_text()):
            found.append(rel)
    assert found == []


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from conftest import make_sample, shard_metadata
from hsextract.atomic import atomic_dir, exit_on_sigterm
from hsextract.shard import ShardWriter
if sys.argv[1] == "on":
    exit_on_sigterm()
with atomic_dir({out!r}) as tmp, ShardWriter({shard!r}, shard_metadata()) as w:
    (tmp / "part").write_text("x")
    w.add(*make_sample(64, seed=0), sample_id="s0")
    print("ready", flush=True)
    sys.stdin.read()  # until the signal
"""


@pytest.mark.parametrize("handled", [True, False])
def test_sigterm_unwinds_the_writers_and_leaves_no_temporary_output(tmp_path: Path, handled: bool) -> None:
    """A job stopped with SIGTERM (Snakemake's stop, a scheduler's preemption) left its temporary shard, up to a
    whole shard's size: the default action ends the process at once. exit_on_sigterm (every workflow script that
    writes, and the hsextract command) makes it SystemExit(143): the shard writer and atomic_dir remove theirs.
    Without it (the control), the temporaries stay."""
    import signal
    import subprocess
    import sys

    out, shard = tmp_path / "export", tmp_path / "chunk-00000.hss"
    code = CHILD.format(tests=str(Path(__file__).parent), out=str(out), shard=str(shard))
    child = subprocess.Popen([sys.executable, "-c", code, "on" if handled else "off"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"  # the temporaries exist: waited on, not slept for
        assert sorted(p.name.endswith(".tmp") for p in tmp_path.iterdir()) == [True, True]
        child.send_signal(signal.SIGTERM)
        err = child.communicate(timeout=60)[1]
    finally:
        child.kill()
    left = sorted(p.name for p in tmp_path.iterdir())
    if handled:
        assert child.returncode == 143 and left == []
        assert err == ("hsextract: stopped by SIGTERM: removing this job's temporary output, nothing else is "
                       "changed\n")
    else:
        assert child.returncode == -signal.SIGTERM and len(left) == 2
