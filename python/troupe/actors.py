"""Python actors: classes that run in worker processes on the cluster's hosts, under the
host's supervision (`cluster.host(i).spawn(Cls, args)`, `cluster.spawn_group(Cls, n)`)."""

import os
import sys
from typing import Optional, TypeVar, Union

from ._support import split_target

T = TypeVar("T", bound=type)


def actor(cls: T) -> T:
    """Marks a class as a Troupe actor kind (documentation for readers; any importable class,
    or one defined in the controller script, can be spawned)."""
    setattr(cls, "__troupe_actor__", True)
    return cls


def _user_paths() -> list[str]:
    """The controller's own code directories (not its interpreter's), for workers' sys.path."""
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    out = []
    for p in [os.getcwd()] + sys.path:
        p = os.path.abspath(p or os.getcwd())
        if os.path.isdir(p) and not p.startswith(prefixes) and p not in out:
            out.append(p)
    return out


def _spec(cls: Union[type, str]) -> tuple[str, Optional[str], list[str]]:
    """`(target, main_file, sys_path)` for a class or an import path string."""
    if isinstance(cls, str):
        try:
            split_target(cls)
        except ValueError as e:
            raise ValueError(f"{e}: give a class or an import path like 'mypkg.workers:FSDPWorker'") from e
        return cls, None, _user_paths()
    if not isinstance(cls, type):
        raise TypeError(f"expected a class or 'module:Class', got {type(cls).__name__}")
    qual = cls.__qualname__
    if "<locals>" in qual:
        raise ValueError(f"{qual}: a class defined inside a function cannot be imported by a worker; define it at module level")
    main_file: Optional[str] = None
    if cls.__module__ == "__main__":
        found: Optional[str] = getattr(sys.modules["__main__"], "__file__", None)
        if found is None:
            raise ValueError(f"{qual} is defined in an interactive session; put it in a module (or a script) a worker can import")
        main_file = os.path.abspath(found)
    return f"{cls.__module__}:{qual}", main_file, _user_paths()
