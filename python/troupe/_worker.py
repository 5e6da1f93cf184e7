"""The Python side of a `troupe.python` actor: the process the host's actor starts with
`python -m troupe._worker`. It reads frames from the socket on fd `$TROUPE_WORKER_FD` (a
little-endian u32 length, then MessagePack), builds the object from the first frame, then runs
one method call per frame and answers each: `{"Ok": bytes}` or `{"Raised": {...}}`. It exits
when the actor closes the socket (and is killed with its process group when the actor stops).
"""

import asyncio
import importlib
import importlib.util
import inspect
import os
import socket
import struct
import sys
from typing import Any, Optional

import msgpack  # type: ignore[import-untyped]

from troupe import _codec
from troupe._support import format_exception

MAX_FRAME = 2 << 30


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
    (n,) = struct.unpack("<I", _read_exact(sock, 4))
    if n > MAX_FRAME:
        raise EOFError
    return msgpack.unpackb(_read_exact(sock, n), raw=False)


def write_frame(sock: socket.socket, value: Any) -> None:
    body: bytes = msgpack.packb(value, use_bin_type=True)
    sock.sendall(struct.pack("<I", len(body)) + body)


def raised(e: BaseException) -> dict[str, Any]:
    return {
        "Raised": {
            "kind": type(e).__name__,
            "message": str(e),
            "traceback": format_exception(e),
        }
    }


def load(target: str, main_file: Optional[str]) -> Any:
    module, _, qualname = target.partition(":")
    if main_file is not None and module == "__main__":
        spec = importlib.util.spec_from_file_location("__mp_main__", main_file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {main_file} as the controller script's module")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = mod
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> int:
    sock = socket.socket(fileno=int(os.environ["TROUPE_WORKER_FD"]))
    hello = read_frame(sock)
    try:
        for p in reversed(hello["sys_path"]):
            if p not in sys.path:
                sys.path.insert(0, p)
        cls = load(hello["target"], hello["main_file"])
        args, kwargs, opts = _codec.decode(hello["init"], allow_pickle=True)
        allow_pickle = bool(opts.get("pickle", False))
        obj = cls(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the import error is the spawn's answer
        write_frame(sock, raised(e))
        return 1
    write_frame(sock, {"Ok": b""})
    loop = asyncio.new_event_loop()
    while True:
        try:
            req = read_frame(sock)
        except (EOFError, ConnectionError):
            return 0
        try:
            name = req["method"]
            if name.startswith("__"):
                raise AttributeError(f"{name!r}: dunder methods cannot be called remotely")
            fn = getattr(obj, name)
            a, kw = _codec.decode(req["args"], allow_pickle)
            out = fn(*a, **kw)
            if inspect.isawaitable(out):
                out = loop.run_until_complete(out)
            reply = {"Ok": _codec.encode(out, allow_pickle)}
        except Exception as e:  # noqa: BLE001 - reported to the caller; the worker stays
            reply = raised(e)
        write_frame(sock, reply)


if __name__ == "__main__":
    sys.exit(main())
