"""Python-side pieces of the bindings that only Python can hold: the event loop Python
workflows run on, the walk over a dataloader, and traceback formatting."""

import asyncio
import logging
import threading
import traceback

log = logging.getLogger("troupe.rollout")


class LoopThread:
    """An asyncio event loop on its own daemon thread (as AReaL's workflow executor runs one):
    `arun_episode` coroutines run here while the training script blocks in `prepare_batch`."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="troupe-rollout-loop", daemon=True)
        self._thread.start()

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def cancel_all(self, timeout=10.0):
        """Cancels every coroutine on the loop and waits until they are done."""
        if not self._thread.is_alive():
            return

        async def cancel():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout)
        except Exception:  # noqa: BLE001 - a stuck episode must not stop the shutdown
            pass

    def close(self, timeout=10.0):
        """Stops the loop and joins its thread. The loop is left stopped, not closed: a Rust
        future that completes after this queues its callback on a stopped loop, which is
        harmless, where a closed loop would raise from the runtime's thread."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


def items(dataloader):
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


def format_exception(e):
    """The exception with its traceback, as Python prints it."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


def report_failure(text):
    """An episode failed: logged with its traceback (on stderr unless logging is configured)."""
    log.error("rollout episode failed:\n%s", text)
