"""Process and lock checks of the server lifecycle (psutil, filelock): alive, ours, group alive, locked.

Zombies are made deterministically: a child that exits is waited for with WNOWAIT (it stays a zombie
until reaped), so no test waits on a sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hsextract.sglang import server as hsrv

PY = sys.executable


def _exited_unreaped(proc: subprocess.Popen) -> None:
    """Wait until proc has exited, leaving it a zombie (not reaped)."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def _sleeper(**kw) -> subprocess.Popen:
    """A child that sleeps until killed (stdin read blocks; no timing involved)."""
    return subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, **kw)


def test_alive_is_false_for_none_gone_and_zombie_pids() -> None:
    assert hsrv._alive(os.getpid())
    assert not hsrv._alive(None) and not hsrv._alive(0)
    proc = _sleeper()
    try:
        assert hsrv._alive(proc.pid)
        proc.kill()
        _exited_unreaped(proc)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
        assert not hsrv._alive(proc.pid)  # the pid exists, as a zombie
    finally:
        proc.kill()
        proc.wait()
    assert not hsrv._alive(proc.pid)  # reaped: no such process


def test_alive_counts_a_process_it_may_not_inspect(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(pid: int) -> psutil.Process:
        raise psutil.AccessDenied(pid)

    monkeypatch.setattr(hsrv.psutil, "Process", denied)
    assert hsrv._alive(12345)


def test_is_ours_reads_the_dump_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dump = tmp_path / "hsx-run-abc"
    env = {k: v for k, v in os.environ.items() if k != "HSEXTRACT_DUMP_DIR"}
    ours = _sleeper(env=dict(env, HSEXTRACT_DUMP_DIR=str(dump)))
    plain = _sleeper(env=env)
    try:
        assert hsrv._is_ours(ours.pid, dump)
        assert not hsrv._is_ours(ours.pid, tmp_path / "hsx-run-other")
        assert not hsrv._is_ours(ours.pid, tmp_path)  # a prefix of the value is not the value
        assert not hsrv._is_ours(plain.pid, dump)
        ours.kill()
        _exited_unreaped(ours)
        assert not hsrv._is_ours(ours.pid, dump)  # a zombie has no environment left
    finally:
        for p in (ours, plain):
            p.kill()
            p.wait()
    assert not hsrv._is_ours(ours.pid, dump)  # gone

    class Denied:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def environ(self) -> dict[str, str]:
            raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(hsrv.psutil, "Process", Denied)
    assert not hsrv._is_ours(os.getpid(), dump)  # another user's process: never ours


def test_group_alive_ignores_zombies_and_sees_other_members() -> None:
    # leader + a grandchild in a new session; the leader dies, the grandchild keeps the group alive (it sleeps:
    # one that read a pipe from the leader would see EOF at the leader's death and could exit before the check)
    leader = subprocess.Popen([PY, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(3600)'], stdin=subprocess.DEVNULL); print(p.pid, flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        grandchild = int(leader.stdout.readline())
        assert os.getpgid(grandchild) == leader.pid
        assert hsrv._group_alive(leader.pid)
        os.kill(leader.pid, signal.SIGKILL)
        _exited_unreaped(leader)
        assert hsrv._group_alive(leader.pid)  # the zombie leader does not count, the grandchild does
        os.kill(grandchild, signal.SIGKILL)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
    # a group whose only member is a zombie is not alive
    lone = _sleeper(start_new_session=True)
    try:
        lone.kill()
        _exited_unreaped(lone)
        os.killpg(lone.pid, 0)  # the kernel still sees the group (its zombie)...
        assert not hsrv._group_alive(lone.pid)  # ...but nothing in it runs
    finally:
        lone.wait()
    assert not hsrv._group_alive(lone.pid)


def test_group_alive_tolerates_processes_that_vanish(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = subprocess.Popen([PY, "-c", "pass"])
    gone.wait()

    class Vanished:  # listed by process_iter, exited before we look at it
        pid = gone.pid

        def status(self) -> str:
            raise psutil.NoSuchProcess(gone.pid)

    class VanishedAfterPgid:  # in our group, gone when its status is read
        pid = os.getpid()

        def status(self) -> str:
            raise psutil.NoSuchProcess(os.getpid())

    monkeypatch.setattr(hsrv.psutil, "process_iter", lambda: iter([Vanished(), VanishedAfterPgid()]))
    assert not hsrv._group_alive(os.getpgid(0))
    monkeypatch.setattr(hsrv.psutil, "process_iter", lambda: iter([Vanished(), psutil.Process()]))
    assert hsrv._group_alive(os.getpgid(0))


TRY_LOCK = "import sys, filelock; filelock.FileLock(sys.argv[1]).acquire(timeout=0); print('got it')"


def test_locked_excludes_another_process_until_released(tmp_path: Path) -> None:
    lock = tmp_path / "replica-0.lock"

    def other_process_gets_it() -> bool:
        r = subprocess.run([PY, "-c", TRY_LOCK, str(lock)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 or "Timeout" in r.stderr, r.stderr
        return r.returncode == 0 and r.stdout == "got it\n"

    with hsrv._locked(lock):
        assert not other_process_gets_it()
    assert other_process_gets_it()
    with hsrv._locked(lock):  # taken again after release, by this process
        assert not other_process_gets_it()
