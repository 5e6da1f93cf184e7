"""Delta weight updates across re-created groups, from Python: a sender and engines that keep
their bases (`troupe.SenderBases`, `troupe.ReceiverBases`) get deltas in the next group; an
engine that did not keep them gets every tensor whole; every engine ends each update with
exactly the bytes sent."""

import functools

import ml_dtypes
import numpy as np
import pytest

import troupe
from background import in_thread


def model(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "norm.weight": (rng.standard_normal(70_000) * 0.1).astype(ml_dtypes.bfloat16),
        "proj.weight": (rng.standard_normal((256, 384)) * 0.02).astype(ml_dtypes.bfloat16),
    }


def step(w: dict[str, np.ndarray], frac: float, seed: int) -> dict[str, np.ndarray]:
    """Moves a fraction `frac` of the values by one BF16 ulp, as a small optimizer step does."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, a in w.items():
        bits = a.view(np.uint16).copy()
        hit = rng.random(bits.shape) < frac
        bits[hit] += 1
        out[name] = bits.view(ml_dtypes.bfloat16)
    return out


def receiver(sender):
    """`TcpWeightReceiver` holding `sender`'s group secret (every join must prove it)."""
    return functools.partial(troupe.TcpWeightReceiver, secret=sender.secret)


def group(sender_bases, engine_bases, name):
    sender = troupe.TcpWeightSender(len(engine_bases) + 1, name, host="127.0.0.1", bases=sender_bases)
    joins = [
        in_thread(receiver(sender), "127.0.0.1", sender.port, i + 1, 1, name, 60.0, b)
        for i, b in enumerate(engine_bases)
    ]
    sender.accept_all(60)
    return sender, [j() for j in joins]


def sync(sender, engines, w):
    names = list(w)
    got = [
        in_thread(e.recv_bucket, names, ["bfloat16"] * len(names), [list(w[n].shape) for n in names], 60.0)
        for e in engines
    ]
    sender.send_bucket(w)
    for g in got:
        tensors = g()
        assert [t[0] for t in tensors] == names
        for name, dtype, shape, raw in tensors:
            assert dtype == "bfloat16" and shape == list(w[name].shape)
            assert raw.tobytes() == w[name].tobytes(), f"{name} differs from what was sent"
    return sender.take_stats()


def close(sender, engines):
    for e in engines:
        e.close()
    sender.close()


def test_bases_kept_across_groups_keep_updates_deltas():
    sb = troupe.SenderBases()
    a, b = troupe.ReceiverBases(), troupe.ReceiverBases()
    w = model()

    sender, engines = group(sb, [a, b], "g1")
    st = sync(sender, engines, w)
    assert (st["whole_tensors"], st["delta_tensors"]) == (2, 0), st
    close(sender, engines)
    assert len(a) == 2 and a.bytes == sb.bytes > 0

    # A new group (the fleet changed): both ends kept their bases, so the update is a delta.
    w = step(w, 0.02, 1)
    sender, engines = group(sb, [a, b], "g2")
    st = sync(sender, engines, w)
    assert (st["whole_tensors"], st["delta_tensors"], st["repaired_tensors"]) == (0, 2, 0), st
    assert st["sent_bytes"] * 5 < st["full_bytes"], st
    assert 0.0 < st["changed_fraction"] < 0.1, st
    close(sender, engines)

    # An engine that did not keep them (restarted: fresh bases) makes the next group send
    # whole; both engines still end exact, and the group after that is a delta again.
    fresh = troupe.ReceiverBases()
    w = step(w, 0.02, 2)
    sender, engines = group(sb, [a, fresh], "g3")
    st = sync(sender, engines, w)
    assert (st["whole_tensors"], st["delta_tensors"]) == (2, 0), st
    w = step(w, 0.02, 3)
    st = sync(sender, engines, w)
    assert st["delta_tensors"] == 2, st
    close(sender, engines)


def test_without_bases_each_group_starts_whole():
    a = troupe.ReceiverBases()
    w = model(5)
    for name in ("h1", "h2"):
        # A sender given no bases keeps its own, for this group only.
        sender = troupe.TcpWeightSender(2, name, host="127.0.0.1")
        join = in_thread(receiver(sender), "127.0.0.1", sender.port, 1, 1, name, 60.0, a)
        sender.accept_all(60)
        engines = [join()]
        st = sync(sender, engines, w)
        assert (st["whole_tensors"], st["delta_tensors"]) == (2, 0), st
        close(sender, engines)
        w = step(w, 0.02, 9)


def test_bases_without_delta_are_refused():
    with pytest.raises(ValueError, match="delta=False"):
        troupe.TcpWeightSender(2, "x", host="127.0.0.1", delta=False, bases=troupe.SenderBases())
