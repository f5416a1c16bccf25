"""The daemon's watch of process ends: a watched process's end runs the sweep at once (the
watched set is read only once an hour here, so nothing else could run it); a PID already gone,
or reused by another process, runs it as soon as it is watched; processes no longer watched are
let go."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from harness.waiting import wait_for
from service.memory.devices import process_alive
from service.registry.exit_watch import ExitWatch
from tests.service.registry.processes import start_of

pytestmark = pytest.mark.skipif(not ExitWatch.available(), reason="no pidfds here")


class Watched:
    def __init__(self) -> None:
        self.processes: set[tuple[int, int]] = set()
        self.sweeps = 0
        self.lock = threading.Lock()

    def current(self) -> set[tuple[int, int]]:
        with self.lock:
            return set(self.processes)

    def sweep(self) -> None:
        """As the daemon's sweep: what ended is no longer watched."""
        with self.lock:
            self.sweeps += 1
            self.processes = {(p, s) for p, s in self.processes if process_alive(p, s)}


@pytest.fixture
def watched() -> Iterator[tuple[Watched, ExitWatch]]:
    state = Watched()
    watch = ExitWatch(state.current, state.sweep, refresh_s=3600)
    assert watch.start()
    yield state, watch
    watch.stop()


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_watched_process_ending_runs_the_sweep_at_once(watched) -> None:
    state, watch = watched
    process = sleeper()
    start = start_of(process.pid)
    assert start is not None
    with state.lock:
        state.processes.add((process.pid, start))
    watch.poke()
    wait_for(lambda: (process.pid, start) in watch._fds, 10, what="the process watched")
    assert state.sweeps == 0
    process.kill()
    process.wait(10)
    wait_for(lambda: state.sweeps == 1, 10, what="the sweep after the kill")


def test_a_process_gone_or_reused_before_it_is_watched_runs_the_sweep(watched) -> None:
    state, watch = watched
    with state.lock:
        state.processes.add((os.getpid(), 1))  # this PID, but not the process that started then
    watch.poke()
    wait_for(lambda: state.sweeps == 1 and not state.current(), 10, what="the sweep, once")


def test_processes_no_longer_watched_are_let_go(watched) -> None:
    state, watch = watched
    process = sleeper()
    key = (process.pid, start_of(process.pid) or 0)
    with state.lock:
        state.processes.add(key)
    watch.poke()
    wait_for(lambda: key in watch._fds, 10, what="the process watched")
    with state.lock:
        state.processes.clear()
    watch.poke()
    wait_for(lambda: not watch._fds, 10, what="the process let go")
    process.kill()
    process.wait(10)
    assert state.sweeps == 0


def test_it_holds_no_more_descriptors_than_its_cap() -> None:
    """A neighbour's many processes cannot take the daemon's descriptors: past the cap, a
    process is left to the periodic sweep (its end runs no sweep here)."""
    state = Watched()
    watch = ExitWatch(state.current, state.sweep, refresh_s=3600, max_pidfds=1)
    assert watch.start()
    processes = [sleeper(), sleeper()]
    try:
        keys = sorted((p.pid, start_of(p.pid) or 0) for p in processes)
        with state.lock:
            state.processes.update(keys)
        watch.poke()
        wait_for(lambda: set(watch._fds) == {keys[0]}, 10, what="one process watched")
        unwatched = next(p for p in processes if p.pid == keys[1][0])
        unwatched.kill()
        unwatched.wait(10)
        watch.poke()
        wait_for(lambda: set(watch._fds) == {keys[0]}, 10, what="the same one still watched")
        assert state.sweeps == 0
    finally:
        watch.stop()
        for p in processes:
            p.kill()
            p.wait(10)
