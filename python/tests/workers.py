"""Actor classes the Python-actor tests spawn (a module workers can import)."""

import asyncio
import os
import subprocess
import sys
import time

import troupe


@troupe.actor
class Counter:
    def __init__(self, start=0, step=1):
        self.n = start
        self.step = step
        self.seen = []

    def incr(self):
        self.n += self.step
        return self.n

    def append(self, x):
        self.seen.append(x)
        return len(self.seen)

    def items(self):
        return self.seen

    def echo(self, *args, **kwargs):
        return {"args": list(args), "kwargs": kwargs}

    def env(self):
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]
        return {k: os.environ.get(k) for k in keys}

    def env_of(self, key):
        return os.environ.get(key)

    def pid(self):
        return os.getpid()

    def fail(self, message):
        raise ValueError(message)

    def exit(self, code):
        os._exit(code)

    async def sleep(self, seconds):
        await asyncio.sleep(seconds)
        return seconds

    def spawn_child(self):
        """A grandchild process, to check the whole group dies with the actor."""
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid

    def rank_exits_or_sleeps(self, dying_rank):
        if os.environ.get("RANK") == str(dying_rank):
            time.sleep(0.2)
            os._exit(7)
        time.sleep(600)

    def allreduce(self):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return float(t.item())


class Broken:
    def __init__(self):
        raise RuntimeError("cannot build this one")


class Opaque:
    """Not MessagePack-able: needs pickle."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.v == self.v


class Keeper:
    def keep(self, x):
        return x


class Gate:
    """Async methods that can only finish when they run concurrently (each waits for a later
    call), beside sync methods that see how far they got."""

    def __init__(self):
        self.started = []
        self.events = {}

    def _event(self, name):
        if name not in self.events:
            self.events[name] = asyncio.Event()
        return self.events[name]

    async def enter(self, i):
        self.started.append(i)
        await self._event("open").wait()
        return i

    def open(self):
        self._event("open").set()
        return list(self.started)

    async def meet(self, mine, theirs):
        self.started.append(mine)
        self._event(mine).set()
        await self._event(theirs).wait()
        return mine

    def run_own_loop(self):
        return asyncio.run(asyncio.sleep(0, result="ran"))

    async def cancelled(self):
        raise asyncio.CancelledError("given up")
