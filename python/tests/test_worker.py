"""The worker process of a Python actor (`python -m troupe._worker`), driven over its socket
the way the host's `troupe.python` actor drives it: frames as `troupe._frames` says, several
calls in flight at once; then the same through an `ActorRef`."""

import asyncio
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

import troupe
from troupe import _codec
from troupe._frames import ARGS, FD_ENV, ID, INIT, KIND, MAIN_FILE, MESSAGE, METHOD, OK, RAISED, REPLY, SYS_PATH, TARGET
from troupe._worker import read_frame, write_frame
from workers import Counter, Gate

HERE = str(pathlib.Path(__file__).resolve().parent)


class Worker:
    """One worker process building `target`, and the socket to it."""

    def __init__(self, target):
        self.sock, theirs = socket.socketpair()
        env = dict(os.environ, **{FD_ENV: str(theirs.fileno())})
        self.proc = subprocess.Popen([sys.executable, "-m", "troupe._worker"], env=env, pass_fds=(theirs.fileno(),))
        theirs.close()
        # A call that never comes back fails the test instead of hanging it.
        self.sock.settimeout(20)
        write_frame(self.sock, {TARGET: target, MAIN_FILE: None, SYS_PATH: [HERE], INIT: _codec.encode(([], {}, {}))})
        assert read_frame(self.sock) == {OK: b""}
        self.next_id = 0

    def send(self, method, *args):
        self.next_id += 1
        write_frame(self.sock, {ID: self.next_id, METHOD: method, ARGS: _codec.encode((list(args), {}))})
        return self.next_id

    def answers(self, n):
        """The next `n` answers, in the order they came: `[(id, value or (kind, message))]`."""
        out = []
        for _ in range(n):
            a = read_frame(self.sock)
            reply = a[REPLY]
            if OK in reply:
                out.append((a[ID], _codec.decode(reply[OK])))
            else:
                out.append((a[ID], (reply[RAISED][KIND], reply[RAISED][MESSAGE])))
        return out

    def close(self):
        """Closes the socket; the worker exits (and is killed if it does not, failing)."""
        self.sock.close()
        try:
            code = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        assert code == 0


@pytest.fixture
def gate():
    w = Worker(f"workers:{Gate.__name__}")
    yield w
    w.close()


@pytest.mark.timeout(60)
def test_async_methods_run_concurrently_and_start_in_arrival_order(gate):
    # Five calls that each wait for a later call to open the gate: served one at a time, the
    # first would wait forever.
    entered = [gate.send("enter", i) for i in range(5)]
    opener = gate.send("open")
    got = gate.answers(6)
    # The sync call ran after all five had started, in the order they were sent; it answered
    # first, since each of them was waiting for it.
    assert got[0] == (opener, [0, 1, 2, 3, 4])
    assert sorted(got[1:]) == [(i, i - 1) for i in entered]


@pytest.mark.timeout(60)
def test_two_async_calls_that_wait_for_each_other_both_finish(gate):
    a, b = gate.send("meet", "a", "b"), gate.send("meet", "b", "a")
    assert sorted(gate.answers(2)) == [(a, "a"), (b, "b")]


@pytest.mark.timeout(60)
def test_sync_methods_run_outside_the_loop_while_async_calls_wait(gate):
    waiting = gate.send("enter", 0)
    # A plain method may run its own event loop (asyncio.run), as before async calls ran
    # concurrently: the worker's loop is not running while it does.
    own = gate.send("run_own_loop")
    assert gate.answers(1) == [(own, "ran")]
    # An async method that raises CancelledError answers (it does not leave its caller waiting).
    cancelled = gate.send("cancelled")
    assert gate.answers(1) == [(cancelled, ("CancelledError", "given up"))]
    opener = gate.send("open")
    assert sorted(gate.answers(2)) == [(waiting, 0), (opener, [0])]


@pytest.fixture(params=["in_process", "local_processes"])
def cluster(request):
    """An in-process host, and a `troupe host` subprocess (calls travel as frames)."""
    with getattr(troupe.Cluster, request.param)(1, 1) as c:
        yield c


@pytest.mark.timeout(60)
def test_async_methods_run_concurrently_through_an_actor_ref(cluster):
    # The actor sends each call on without waiting for the answer before: served one at a time,
    # the first call would wait for the second forever.
    a = cluster.host(0).spawn(Gate)

    async def main():
        return await asyncio.wait_for(asyncio.gather(a.call("meet", "a", "b"), a.call("meet", "b", "a")), 10)

    try:
        assert asyncio.run(main()) == ["a", "b"]
        # Calls from one caller start in the order made: the plain call after five waiting ones
        # sees all five started, and opens the gate for them.
        async def gate():
            entered = [a.call("enter", i) for i in range(5)]
            opened = await asyncio.wait_for(a.call("open"), 10)
            return opened, await asyncio.wait_for(asyncio.gather(*entered), 10)

        opened, entered = asyncio.run(gate())
        assert opened == ["a", "b", 0, 1, 2, 3, 4] and entered == [0, 1, 2, 3, 4]
    finally:
        a.stop(grace=0.5)


@pytest.mark.timeout(60)
def test_every_call_in_flight_fails_at_once_when_the_worker_dies_and_it_restarts(cluster):
    a = cluster.host(0).spawn(Counter, restarts=1)
    first = a.call_sync("pid")

    async def main():
        calls = [a.call("sleep", 60), a.call("sleep", 60), a.call("exit", 3)]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)

    try:
        got = asyncio.run(main())
        assert all(isinstance(e, troupe.ActorDiedError) and "exit status: 3" in str(e) for e in got), got
        deadline = time.monotonic() + 30
        while True:
            try:
                if a.call_sync("pid") != first:
                    break
            except troupe.ActorError:
                pass  # restarting
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.02)
        assert a.call_sync("incr") == 1
    finally:
        a.stop(grace=0.5)


@pytest.mark.timeout(60)
def test_calls_in_flight_fail_at_once_when_the_actor_stops(cluster):
    a = cluster.host(0).spawn(Counter)

    async def main():
        sleeping = asyncio.gather(a.call("sleep", 60), a.call("sleep", 60), return_exceptions=True)
        await a.call("pid")  # both sleeps have started
        a.stop(grace=1.0)
        return await asyncio.wait_for(sleeping, 10)

    got = asyncio.run(main())
    assert all(isinstance(e, troupe.ActorDiedError) for e in got), got
