"""A call run on a thread while the test does the other side of it (an engine's receive while
rank 0 sends), joined with a bound."""

import threading


def in_thread(fn, *args):
    """Runs `fn(*args)` on a thread; the returned function joins it (120 s at most) and gives
    the result, or raises what the call raised."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()

    def join():
        t.join(120)
        assert not t.is_alive(), "the call on the other thread did not finish"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return join
