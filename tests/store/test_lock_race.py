"""Runs that start together on an output whose lock is stale: exactly one takes it over (docs/guarantees.md).

Each round writes a lock holding the pid of a process that has exited, starts RACERS processes that wait on
one pipe, and closes it: they all wake at once and call OutputLock.acquire. The one admitted holds the lock for
a while (so that the others meet a live holder) and releases it. A takeover that is not atomic admits two (one
removes the lock the other has just created) or none (each takes the other's fresh lock for the stale one).
To meet those interleavings on a machine with few cores, each racer sleeps up to 20 ms (at random) right
after it has looked at the holder's pid, as a process preempted there would.
"""
import os
import subprocess
import sys
import time

RACERS = 6
ROUNDS = 16
BUDGET_S = 90.0   # the rounds stop here even if fewer ran (a loaded machine), after at least 4

RACER = r"""
import os, random, sys, time
from pathlib import Path
from harness.runtime.guard import LockError, OutputLock

_kill = os.kill
def kill(pid, sig):  # a racer preempted right after it looked at the holder's pid, for up to 20 ms
    try:
        return _kill(pid, sig)
    finally:
        if sig == 0:
            time.sleep(random.uniform(0.0, 0.02))
os.kill = kill

print("ready", flush=True)
os.read(int(sys.argv[2]), 1)             # returns when the parent closes the pipe: every racer at once
lock = OutputLock(Path(sys.argv[1]))
try:
    lock.acquire()
except LockError as e:
    print("refused", e, flush=True)
    sys.exit(0)
print("admitted", flush=True)
time.sleep(float(sys.argv[3]))
lock.release()
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _round(out, hold_s: float) -> list[str]:
    lock = out.with_name(out.name + ".lock")
    lock.write_text(f"{_dead_pid()}\n")
    read, write = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(out), str(read), str(hold_s)], pass_fds=(read,),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for _ in range(RACERS)]
    os.close(read)
    try:
        for r in racers:
            assert r.stdout.readline().strip() == "ready", r.stderr.read()
    finally:
        os.close(write)                       # go
    results = []
    for r in racers:
        stdout, stderr = r.communicate(timeout=60)
        assert r.returncode == 0, stderr
        results.append(stdout.split()[0])
    assert not lock.exists()
    return results


def test_exactly_one_of_several_runs_takes_over_a_stale_lock(tmp_path):
    out = tmp_path / "c.npz"
    start, rounds = time.monotonic(), 0
    while rounds < ROUNDS and (rounds < 4 or time.monotonic() - start < BUDGET_S):
        results = _round(out, hold_s=1.0)
        assert sorted(results) == ["admitted"] + ["refused"] * (RACERS - 1), (rounds, results)
        rounds += 1
