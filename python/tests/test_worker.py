"""The worker process of a Python actor (`python -m troupe._worker`), driven over its socket
the way the host's `troupe.python` actor drives it: frames as `troupe._frames` says, several
calls in flight at once."""

import asyncio
import os
import pathlib
import socket
import subprocess
import sys

import pytest

import troupe
from troupe import _codec
from troupe._frames import ARGS, FD_ENV, ID, INIT, KIND, MAIN_FILE, MESSAGE, METHOD, OK, RAISED, REPLY, SYS_PATH, TARGET
from troupe._worker import read_frame, write_frame
from workers import Gate

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


@pytest.mark.timeout(60)
@pytest.mark.xfail(
    strict=True,
    reason="the troupe.python actor has one call in flight to its worker (the host handles an "
    "actor's messages one at a time, and a handler cannot reply after it returns), so through "
    "an ActorRef async methods still run one at a time",
)
def test_async_methods_run_concurrently_through_an_actor_ref():
    with troupe.Cluster.in_process(1, 1) as c:
        a = c.host(0).spawn(Gate)

        async def main():
            return await asyncio.wait_for(asyncio.gather(a.call("meet", "a", "b"), a.call("meet", "b", "a")), 5)

        try:
            assert asyncio.run(main()) == ["a", "b"]
        finally:
            a.stop(grace=0.5)
