"""Snakemake's lock left by a killed run: removed only when its run is surely gone (hsextract.config.stale_lock).
The whole workflow killed and rerun without `--unlock`: tests/test_faults.py."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsextract.config.stale_lock import LOCKS, OWNERS, claim, clear_owner, record_owner, remove_stale_lock

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times from /proc")


def locks(wd: Path) -> list[Path]:
    """Lock files taken 5 s ago (a check compares them with the moment it reads the records)."""
    (wd / LOCKS).mkdir(parents=True, exist_ok=True)
    paths = [wd / LOCKS / "0.input.lock", wd / LOCKS / "0.output.lock"]
    t = time.time_ns() - 5 * 10**9
    for p in paths:
        p.write_text("results/x/shards/chunk-00000.hss\n")
        os.utime(p, ns=(t, t))
    return paths


def dead_pid_owner(wd: Path) -> int:
    """The record of a process that ran (recorded at its parse, while it was alive) and is gone."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    record_owner(wd, child.pid)
    child.communicate(b"")
    return child.pid


def record(wd: Path, pid: int) -> Path:
    return wd / OWNERS / f"{pid}.json"


def test_the_lock_of_a_run_that_is_gone_is_removed_with_a_message(tmp_path: Path) -> None:
    paths = locks(tmp_path)
    pid = dead_pid_owner(tmp_path)
    assert remove_stale_lock(tmp_path) == (
        f"hsextract: removed Snakemake's lock (2 files in {LOCKS}) left by a run that no longer exists (pid {pid} on "
        "this host, killed before it could release it); carrying on: what that run finished is kept, the rest reruns")
    assert not any(p.exists() for p in paths) and not record(tmp_path, pid).exists()
    assert remove_stale_lock(tmp_path) is None  # nothing left to do


def test_the_lock_of_a_live_run_is_kept(tmp_path: Path) -> None:
    paths = locks(tmp_path)
    record_owner(tmp_path)  # this process: alive
    rec = json.loads(record(tmp_path, os.getpid()).read_text())
    assert (rec["pid"], rec["host"]) == (os.getpid(), socket.gethostname()) and rec["start"]
    assert remove_stale_lock(tmp_path) is None
    assert all(p.exists() for p in paths) and record(tmp_path, os.getpid()).exists()


def test_a_live_run_beside_a_killed_one_keeps_the_lock(tmp_path: Path) -> None:
    """Two runs on disjoint targets hold locks side by side; the later one killed: the earlier still runs."""
    paths = locks(tmp_path)
    record_owner(tmp_path)  # alive
    dead_pid_owner(tmp_path)  # the later run, killed
    assert remove_stale_lock(tmp_path) is None and all(p.exists() for p in paths)
    clear_owner(tmp_path)  # the live run ended (Snakemake would remove its lock files too)
    assert remove_stale_lock(tmp_path) is not None and not any(p.exists() for p in paths)


def test_a_pid_taken_again_by_another_process_is_a_run_that_is_gone(tmp_path: Path) -> None:
    locks(tmp_path)
    record_owner(tmp_path)
    own = record(tmp_path, os.getpid())
    rec = json.loads(own.read_text())
    own.write_text(json.dumps({**rec, "start": str(int(rec["start"]) - 1)}))
    assert remove_stale_lock(tmp_path) is not None and not (tmp_path / LOCKS / "0.input.lock").exists()


def test_a_reboot_since_the_record_means_the_run_is_gone(tmp_path: Path) -> None:
    locks(tmp_path)
    record_owner(tmp_path)
    own = record(tmp_path, os.getpid())
    rec = json.loads(own.read_text())
    if not rec["boot"]:
        pytest.skip("no boot id on this system")
    own.write_text(json.dumps({**rec, "boot": "another-boot"}))
    assert remove_stale_lock(tmp_path) is not None


def test_a_run_killed_after_its_parse_before_onstart_is_recognized(tmp_path: Path) -> None:
    """The record comes first (the parse), the lock after it: a kill anywhere in between (conda environments
    being created) leaves a lock newer than the record, and it is still removed."""
    pid = dead_pid_owner(tmp_path)
    t = time.time_ns() - 60 * 10**9  # parsed a minute ago
    os.utime(record(tmp_path, pid), ns=(t, t))
    paths = locks(tmp_path)  # taken 5 s ago: newer than the record, older than the check
    assert remove_stale_lock(tmp_path) is not None and not any(p.exists() for p in paths)


def test_claim_removes_a_stale_lock_then_records_this_run(tmp_path: Path) -> None:
    paths = locks(tmp_path)
    dead = dead_pid_owner(tmp_path)
    said = claim(tmp_path)
    assert said is not None and f"(pid {dead} on this host" in said and not any(p.exists() for p in paths)
    assert [p.name for p in (tmp_path / OWNERS).iterdir()] == [f"{os.getpid()}.json"]
    locks(tmp_path)  # this run takes the lock; a second parse (another run) keeps it
    assert claim(tmp_path) is None and (tmp_path / LOCKS / "0.input.lock").exists()


def test_without_a_lock_the_records_of_runs_that_are_gone_are_tidied(tmp_path: Path) -> None:
    """Dry runs and reports parse (and record) but never reach onsuccess."""
    record_owner(tmp_path)
    dead = dead_pid_owner(tmp_path)
    assert remove_stale_lock(tmp_path) is None
    assert not record(tmp_path, dead).exists() and record(tmp_path, os.getpid()).exists()


@pytest.mark.parametrize("case", ["other host", "no record", "damaged record", "lock taken after the check began",
                                  "record cleared"])
def test_the_lock_is_left_to_snakemake_when_its_run_cannot_be_told_gone(tmp_path: Path, case: str) -> None:
    paths = locks(tmp_path)
    pid = dead_pid_owner(tmp_path)
    owner = record(tmp_path, pid)
    if case == "other host":  # a shared file system seen from another login node: that run may be alive
        owner.write_text(json.dumps({**json.loads(owner.read_text()), "host": "another-node"}))
    elif case == "no record":  # a run of another Snakefile in this directory, or one that never parsed ours
        owner.unlink()
    elif case == "damaged record":
        owner.write_text("{")
    elif case == "lock taken after the check began":  # by a run whose record the check did not read
        t = time.time_ns() + 10 * 10**9
        os.utime(paths[1], ns=(t, t))
    elif case == "record cleared":  # the run ended (onsuccess / onerror)
        clear_owner(tmp_path, pid)
    assert remove_stale_lock(tmp_path) is None
    assert all(p.exists() for p in paths)


def test_a_run_whose_jobs_outlive_its_main_process_keeps_the_lock(tmp_path: Path) -> None:
    """`kill -9` of Snakemake's process alone (the OOM killer picks one process) leaves its jobs running: the rerun
    removed the lock and ran the same chunk a second time beside the orphan, which then lost its temporary shard.
    The lock is kept, and the line names the orphans; once they have ended it is removed as before."""
    paths = locks(tmp_path)
    pid = dead_pid_owner(tmp_path)
    script = tmp_path / ".snakemake/scripts/tmpk3x9.extract.py"
    script.parent.mkdir(parents=True)
    script.write_text("import sys\nsys.stdin.read()\n")
    job = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdin=subprocess.PIPE)
    try:
        said = remove_stale_lock(tmp_path)
        assert said == (
            "hsextract: Snakemake's lock was left by a run whose main process is gone, but its jobs still run "
            f"(pid {job.pid}: {sys.executable} {script}); the lock is kept, so that no job runs twice. Wait for them "
            f"to end, or stop them (`kill {job.pid}`), then run the same command again")
        assert all(p.exists() for p in paths) and record(tmp_path, pid).exists()
    finally:
        job.communicate(b"")
    assert remove_stale_lock(tmp_path).startswith("hsextract: removed Snakemake's lock (2 files")
    assert not any(p.exists() for p in paths)
