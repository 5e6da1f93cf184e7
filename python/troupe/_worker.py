"""The Python side of a `troupe.python` actor: the process the host's actor starts with
`python -m troupe._worker`. It reads frames from the socket on fd `$TROUPE_WORKER_FD` (the
format's constants are `troupe._frames`; their home is the Rust side's `python_wire.rs`), builds
the object from the first frame, then runs the method of each call frame and answers it with
the call's id: `{"id": n, "reply": {"Ok": bytes}}` or `{"id": n, "reply": {"Raised": {...}}}`.
It exits when the actor closes the socket (and is killed with its process group when the actor
stops).

How calls run (docs/python.md, "Python actors"): the actor writes calls as they reach it, without
waiting for earlier answers, and they start here in the order their frames arrive. A plain
method runs to its end before the next frame is read, with every coroutine paused (as if it were
the only call), so plain methods run one at a time, in arrival order. An `async def` method (any
method returning an awaitable) becomes a task on the worker's one event loop and starts running,
up to its first `await` that waits, before the next frame is read; while tasks are pending the
loop runs them until the next frame arrives, so async methods run concurrently with each other
and with the calls after them, and answer in the order they finish (the actor matches answers to
calls by id).
"""

import asyncio
import importlib
import importlib.util
import inspect
import os
import socket
import struct
import sys
from typing import Any, Awaitable, Optional

import msgpack  # type: ignore[import-untyped]

from troupe import _codec
from troupe._frames import (
    ARGS,
    FD_ENV,
    ID,
    INIT,
    KIND,
    LENGTH_FORMAT,
    MAIN_FILE,
    MAX_FRAME,
    MESSAGE,
    METHOD,
    OK,
    RAISED,
    REPLY,
    SYS_PATH,
    TARGET,
    TRACEBACK,
)
from troupe._support import format_exception, lookup, split_target

_LENGTH = struct.Struct(LENGTH_FORMAT)


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError
        got += k
    return buf


def read_frame(sock: socket.socket) -> Any:
    (n,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
    if n > MAX_FRAME:
        raise EOFError
    return msgpack.unpackb(_read_exact(sock, n), raw=False)


def write_frame(sock: socket.socket, value: Any) -> None:
    body: bytes = msgpack.packb(value, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def raised(e: BaseException) -> dict[str, Any]:
    return {RAISED: {KIND: type(e).__name__, MESSAGE: str(e), TRACEBACK: format_exception(e)}}


def load(target: str, main_file: Optional[str]) -> Any:
    module, qualname = split_target(target)
    if main_file is not None and module == "__main__":
        spec = importlib.util.spec_from_file_location("__mp_main__", main_file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {main_file} as the controller script's module")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = mod
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    return lookup(mod, qualname)


class Worker:
    """Runs the calls on `obj` that arrive on `sock` (see the module's docstring for how)."""

    def __init__(self, sock: socket.socket, obj: Any, allow_pickle: bool) -> None:
        self.sock = sock
        self.obj = obj
        self.allow_pickle = allow_pickle
        self.loop = asyncio.new_event_loop()
        self.tasks: set["asyncio.Task[None]"] = set()
        # Set once the actor closed the socket: no answer can reach it any more.
        self.closed = False

    def run(self) -> int:
        """Serves calls until the actor closes the socket."""
        try:
            while True:
                if self.tasks:
                    self._run_tasks_until_readable()
                try:
                    req = read_frame(self.sock)
                except (EOFError, ConnectionError):
                    return 0
                self._start(req)
        finally:
            self._cancel_tasks()

    def _start(self, req: dict[str, Any]) -> None:
        call_id = req[ID]
        try:
            name = req[METHOD]
            if name.startswith("__"):
                raise AttributeError(f"{name!r}: dunder methods cannot be called remotely")
            fn = getattr(self.obj, name)
            a, kw = _codec.decode(req[ARGS], self.allow_pickle)
            out = fn(*a, **kw)
            if inspect.isawaitable(out):
                task = self.loop.create_task(self._finish(call_id, out))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                return
            reply = {OK: _codec.encode(out, self.allow_pickle)}
        except Exception as e:  # noqa: BLE001 - reported to the caller; the worker stays
            reply = raised(e)
        write_frame(self.sock, {ID: call_id, REPLY: reply})

    async def _finish(self, call_id: int, pending: Awaitable[Any]) -> None:
        try:
            reply = {OK: _codec.encode(await pending, self.allow_pickle)}
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - the caller's answer
            reply = raised(e)
        if self.closed:
            # Cancelled at exit: the actor closed the socket and answered its callers itself.
            return
        try:
            write_frame(self.sock, {ID: call_id, REPLY: reply})
        except OSError as e:
            # The actor closed the socket: the read loop sees it and the worker exits.
            print(f"troupe worker: the answer to call {call_id} could not be sent: {e}", file=sys.stderr)

    def _run_tasks_until_readable(self) -> None:
        """Runs the loop (so the pending tasks go on) until a frame starts to arrive. A task
        created since the loop last ran takes its first step before anything else: ready
        callbacks run before the socket's readiness is looked at."""
        readable = self.loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        self.loop.add_reader(self.sock.fileno(), wake)
        try:
            self.loop.run_until_complete(readable)
        finally:
            self.loop.remove_reader(self.sock.fileno())

    def _cancel_tasks(self) -> None:
        """Cancels the calls still running (their callers are gone) and lets them unwind."""
        self.closed = True
        if not self.tasks:
            return
        for t in self.tasks:
            t.cancel()
        self.loop.run_until_complete(asyncio.wait(list(self.tasks), timeout=5.0))


def main() -> int:
    sock = socket.socket(fileno=int(os.environ[FD_ENV]))
    hello = read_frame(sock)
    try:
        for p in reversed(hello[SYS_PATH]):
            if p not in sys.path:
                sys.path.insert(0, p)
        cls = load(hello[TARGET], hello[MAIN_FILE])
        args, kwargs, opts = _codec.decode(hello[INIT], allow_pickle=True)
        allow_pickle = bool(opts.get("pickle", False))
        obj = cls(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the import error is the spawn's answer
        write_frame(sock, raised(e))
        return 1
    write_frame(sock, {OK: b""})
    return Worker(sock, obj, allow_pickle).run()


if __name__ == "__main__":
    sys.exit(main())
