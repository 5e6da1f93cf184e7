"""Python-side pieces of the bindings that only Python can hold: the event loop Python
workflows run on, the walk over a dataloader, traceback formatting, and the reading of import
paths."""

import asyncio
import concurrent.futures
import logging
import threading
import traceback
from typing import Any, Iterable, Iterator

log = logging.getLogger("troupe.rollout")


class LoopThread:
    """An asyncio event loop on its own daemon thread (as AReaL's workflow executor runs one):
    `arun_episode` coroutines run here while the training script blocks in `prepare_batch`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="troupe-rollout-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def cancel_all(self, timeout: float = 10.0) -> None:
        """Cancels every coroutine on the loop and waits until they are done."""
        if not self._thread.is_alive():
            return

        async def cancel() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                # Cancelled is what was asked; anything else an episode raised on its way out
                # would otherwise be lost here.
                if isinstance(r, Exception):
                    log.warning("a rollout episode raised while being cancelled", exc_info=r)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout)
        except concurrent.futures.TimeoutError:
            # A stuck episode must not stop the shutdown; say so rather than hide it.
            log.warning("rollout episodes did not finish within %.0f s of being cancelled; shutting down anyway", timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the loop and joins its thread. The loop is left stopped, not closed: a Rust
        future that completes after this queues its callback on a stopped loop, which is
        harmless, where a closed loop would raise from the runtime's thread."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


def items(dataloader: Iterable[Any]) -> Iterator[Any]:
    """Data items from `dataloader`, cycling as AReaL's `cycle_dataloader` does. A loader with a
    `batch_size` (a torch DataLoader) yields batches, whose items are submitted one by one; a
    re-iterable (a list) starts over when exhausted; a one-shot iterator ends."""
    batched = getattr(dataloader, "batch_size", None) is not None
    one_shot = iter(dataloader) is dataloader
    while True:
        n = 0
        for x in dataloader:
            n += 1
            if batched:
                yield from x
            else:
                yield x
        if one_shot or n == 0:
            return


def format_exception(e: BaseException) -> str:
    """The exception with its traceback, as Python prints it."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


def report_failure(text: str) -> None:
    """An episode failed: logged with its traceback (on stderr unless logging is configured)."""
    log.error("rollout episode failed:\n%s", text)


def split_target(path: str, dotted: bool = False) -> tuple[str, str]:
    """`"package.module:Qual.Name"` as `("package.module", "Qual.Name")`: the one reading of an
    import path on the Python side (Rust's is `python_wire::split_target`, which reads it the
    same way). With `dotted`, `package.module.name` is read too, split at its last dot. A path
    without both parts is a ValueError."""
    module, sep, qualname = path.partition(":")
    if not sep and dotted:
        module, _, qualname = path.rpartition(".")
    if not module or not qualname:
        raise ValueError(f"{path!r} is not an import path like 'package.module:Name'")
    return module, qualname


def lookup(module: Any, qualname: str) -> Any:
    """`Qual.Name` (from `split_target`) in `module`, one attribute at a time."""
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
