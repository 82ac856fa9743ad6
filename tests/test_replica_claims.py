"""hsextract.sglang.server.claim_replica: extract jobs running at once (a GPU pool of tp x replicas) each drive a
replica of their own, the lowest free one, held for the job's lifetime and freed when its process ends (kill -9
included). The workflow with two local (fake) replicas: tests/test_workflow_sglang.py."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from hsextract.sglang import server as hsrv

HOLDER = """
import sys
from hsextract.sglang.server import claim_replica
c = claim_replica(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
print(f"claimed {c.replica}", flush=True)
sys.stdin.read()  # hold the claim until the test closes stdin (or kills this process)
"""


def holder(state: Path, replicas: int, chunk: int) -> tuple[subprocess.Popen, str]:
    """Another extract job: a process that claims a replica and holds it."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(state), str(replicas), str(chunk)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def test_one_replica_needs_no_claim(tmp_path: Path) -> None:
    c = hsrv.claim_replica(tmp_path / "server", 1, chunk=7)
    assert c.replica == 0 and c.lock is None and not (tmp_path / "server").exists()


def test_jobs_at_once_get_distinct_replicas_lowest_first_wait_for_the_first_free_and_a_killed_job_frees_its_own(
        tmp_path: Path) -> None:
    state = tmp_path / "server"
    other, said = holder(state, 3, chunk=7)
    try:
        assert said == "claimed 0"  # the lowest free one, whatever the chunk
        a = hsrv.claim_replica(state, 3, chunk=0)  # 0 is the other job's
        b = hsrv.claim_replica(state, 3, chunk=1)  # 1 is held by `a`, a job of this very process
        assert (a.replica, b.replica) == (1, 2)
        # all three held: chunk 5 says so and takes the first to come free
        waiting, got = threading.Event(), []
        messages: list[str] = []

        def job() -> None:
            got.append(hsrv.claim_replica(state, 3, chunk=5, say=lambda m: (messages.append(m), waiting.set()),
                                          poll_s=0.05))

        t = threading.Thread(target=job)
        t.start()
        assert waiting.wait(60)
        assert messages == ["chunk 5: all 3 replicas are in use by other extract jobs; waiting for one"]
        b.release()
        t.join(60)
        assert not t.is_alive() and got[0].replica == 2
        # the other job is killed: its replica is free at once
        other.kill()
        other.wait()
        d = hsrv.claim_replica(state, 3, chunk=6)
        assert d.replica == 0
        for c in (a, got[0], d):
            c.release()
        held = [hsrv.claim_replica(state, 3, chunk=k) for k in (4, 5, 6)]  # kept: a dropped claim is released
        assert [c.replica for c in held] == [0, 1, 2]
    finally:
        other.kill()
        other.wait()
