"""How arguments and results of Python actor calls travel: MessagePack, with numpy arrays as
raw buffers (dtype, shape, bytes; bit-exact, no pickle) and pickle only when the actor was
spawned with `pickle=True`."""

import pickle as _pickle
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

_NDARRAY = 1
_PICKLE = 2


def _dtype_name(d: np.dtype[Any]) -> str:
    # Standard dtypes by their array-protocol string (byte order included); extension dtypes
    # (ml_dtypes' bfloat16, ...) by name.
    return d.name if d.kind == "V" else d.str


def _dtype(name: str) -> np.dtype[Any]:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # type: ignore[import-not-found,unused-ignore]

        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return found


def encode(obj: Any, allow_pickle: bool = False) -> bytes:
    """`obj` as bytes."""

    def default(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            if o.dtype.hasobject:
                if allow_pickle:
                    return msgpack.ExtType(_PICKLE, _pickle.dumps(o))
                raise TypeError("numpy arrays of Python objects cannot travel as MessagePack; spawn with pickle=True")
            a = np.ascontiguousarray(o)
            return msgpack.ExtType(_NDARRAY, msgpack.packb([_dtype_name(a.dtype), list(a.shape), a.reshape(-1).view(np.uint8).data]))
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, (tuple, set, frozenset)):
            return list(o)
        if allow_pickle:
            return msgpack.ExtType(_PICKLE, _pickle.dumps(o))
        raise TypeError(
            f"cannot send a {type(o).__name__} as MessagePack: use None, bool, int, float, str, bytes, "
            "lists, dicts and numpy arrays, or spawn the actor with pickle=True"
        )

    packed: bytes = msgpack.packb(obj, default=default, use_bin_type=True)
    return packed


def decode(data: bytes, allow_pickle: bool = False) -> Any:
    """Bytes from `encode` back to objects (numpy arrays are writable copies)."""

    def ext(code: int, payload: bytes) -> Any:
        if code == _NDARRAY:
            dtype, shape, raw = msgpack.unpackb(payload, raw=False)
            return np.frombuffer(raw, dtype=_dtype(dtype)).reshape(shape).copy()
        if code == _PICKLE:
            if not allow_pickle:
                raise TypeError("a pickled value arrived but this actor was not spawned with pickle=True")
            return _pickle.loads(payload)
        return msgpack.ExtType(code, payload)

    return msgpack.unpackb(data, ext_hook=ext, raw=False, strict_map_key=False)
