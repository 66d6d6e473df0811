"""Point leases: exclusive, releasable, expiring, and race-free across processes."""

import multiprocessing
import os
import time

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.studies.leases import Heartbeat, _create, _read, current_generation, leases_dir, try_lease

HASH = "abc123"


def _write_lease(out_dir, generation: int, owner: str, heartbeat_age_s: float, released: bool = False) -> None:
    """A lease left by another runner, whose last heartbeat was ``heartbeat_age_s`` ago."""
    now = time.time()
    content = {"owner": owner, "leased_at": now - 1000, "heartbeat_at": now - heartbeat_age_s, "released": released}
    atomic_write_json(leases_dir(out_dir, HASH) / f"{generation:06d}.json", content)


def _owner_of_current(out_dir) -> str:
    directory = leases_dir(out_dir, HASH)
    return _read(directory / f"{current_generation(directory):06d}.json")["owner"]


def test_second_leaser_gets_none_until_released(tmp_path):
    first = try_lease(tmp_path, HASH, ttl_s=60)
    assert first is not None and first.owned() and first.generation == 0
    assert first.owner.split(":")[1] == str(os.getpid()) and _owner_of_current(tmp_path) == first.owner
    assert try_lease(tmp_path, HASH, ttl_s=60) is None
    assert try_lease(tmp_path, "other", ttl_s=60) is not None  # leases are per point
    assert first.release() and not first.owned() and _read(first.path)["released"]
    again = try_lease(tmp_path, HASH, ttl_s=60)
    assert again is not None and again.generation == 1 and again.owner != first.owner
    assert try_lease(tmp_path, HASH, ttl_s=60) is None


def test_expired_lease_taken_over_live_one_not(tmp_path):
    _write_lease(tmp_path, 0, "deadhost:1:x", heartbeat_age_s=30)  # leased long ago, beat 30 s ago
    assert try_lease(tmp_path, HASH, ttl_s=60) is None
    _write_lease(tmp_path, 0, "deadhost:1:x", heartbeat_age_s=90)
    taken = try_lease(tmp_path, HASH, ttl_s=60)
    assert taken is not None and taken.generation == 1 and _owner_of_current(tmp_path) == taken.owner


def test_released_lease_is_free_at_once(tmp_path):
    _write_lease(tmp_path, 0, "donehost:1:x", heartbeat_age_s=0, released=True)
    lease = try_lease(tmp_path, HASH, ttl_s=60)
    assert lease is not None and lease.generation == 1


def test_lost_lease_neither_heartbeats_nor_releases(tmp_path):
    old = try_lease(tmp_path, HASH, ttl_s=60)
    _write_lease(tmp_path, 0, old.owner, heartbeat_age_s=90)  # as if the owner had hung for 90 s
    new = try_lease(tmp_path, HASH, ttl_s=60)
    assert new is not None
    assert not old.owned() and not old.heartbeat() and not old.release()
    assert new.owned() and _owner_of_current(tmp_path) == new.owner


def test_runner_with_an_old_view_cannot_lease(tmp_path):
    # Saw generation 0 stale, then generation 1 was created by a faster runner: its create fails.
    _write_lease(tmp_path, 0, "deadhost:1:x", heartbeat_age_s=90)
    _write_lease(tmp_path, 1, "fast:2:y", heartbeat_age_s=0)
    assert _create(leases_dir(tmp_path, HASH), 1, ttl_s=60) is None
    assert _owner_of_current(tmp_path) == "fast:2:y"


def test_unparseable_lease_judged_by_mtime(tmp_path):
    path = leases_dir(tmp_path, HASH) / "000000.json"
    path.parent.mkdir(parents=True)
    path.write_text("")  # a writer that died between the exclusive create and the write
    assert try_lease(tmp_path, HASH, ttl_s=60) is None
    old = time.time() - 120
    os.utime(path, (old, old))
    assert try_lease(tmp_path, HASH, ttl_s=60) is not None


def test_heartbeat_keeps_lease_alive_past_ttl(tmp_path):
    ttl = 1.0
    lease = try_lease(tmp_path, HASH, ttl_s=ttl)
    with lease:
        first_beat = _read(lease.path)["heartbeat_at"]
        time.sleep(2.5 * ttl)
        assert try_lease(tmp_path, HASH, ttl_s=ttl) is None
        assert _read(lease.path)["heartbeat_at"] > first_beat + ttl
    assert _read(lease.path)["released"] and lease._heartbeat is None  # released on exit, thread stopped


def test_heartbeat_thread_notices_a_lost_lease(tmp_path):
    lease = try_lease(tmp_path, HASH, ttl_s=60)
    beat = Heartbeat(lease, interval_s=0.05).start()
    _write_lease(tmp_path, 1, "thief:3:z", heartbeat_age_s=0)
    beat._thread.join(timeout=5)
    assert beat.lost and not beat._thread.is_alive()


def test_bad_ttl_refused(tmp_path):
    with pytest.raises(MoeLitError, match="ttl_s"):
        try_lease(tmp_path, HASH, ttl_s=0)


ROUNDS = 20


def _race(out_dir, barrier, results) -> None:
    """Every process leases the same ROUNDS points in the same order, so they contend at each one."""
    hashes = [f"{HASH}-{i}" for i in range(ROUNDS)]
    barrier.wait()
    results.put([h for h in hashes if try_lease(out_dir, h, ttl_s=60) is not None])


@pytest.mark.parametrize("stale_lease", [False, True], ids=["fresh", "takeover"])
def test_race_of_processes_has_exactly_one_winner(tmp_path, stale_lease):
    if stale_lease:
        for i in range(ROUNDS):
            atomic_write_json(
                leases_dir(tmp_path, f"{HASH}-{i}") / "000000.json",
                {"owner": "deadhost:1:x", "leased_at": 0.0, "heartbeat_at": 0.0, "released": False},
            )
    ctx = multiprocessing.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), barrier, results)) for _ in range(n)]
    for proc in procs:
        proc.start()
    won = [h for _ in procs for h in results.get(timeout=60)]
    for proc in procs:
        proc.join(timeout=10)
    assert sorted(won) == sorted(f"{HASH}-{i}" for i in range(ROUNDS))  # each point exactly once


def test_a_lease_of_a_dead_process_on_this_host_is_free_at_once(tmp_path):
    import json
    import subprocess
    import sys

    from moe_lit.studies.leases import current_generation, leases_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    held = try_lease(tmp_path, "h", ttl_s=600)
    directory = leases_dir(tmp_path, "h")
    path = directory / f"{current_generation(directory):06d}.json"
    content = json.loads(path.read_text())
    host = content["owner"].split(":")[0]
    path.write_text(json.dumps({**content, "owner": f"{host}:{dead.stdout.strip()}:x"}))  # as if kill -9'd
    assert try_lease(tmp_path, "h", ttl_s=600) is not None
    assert held is not None and not held.owned()
