"""Rollouts with Python workflows: the Rust rollout controller driving `arun_episode`
coroutines, the built-in RLVR workflow, trajectories as numpy arrays, pad_batch, staleness,
failures that are reported rather than stalling, and bad input."""

import asyncio
import time

import numpy as np
import pytest

import troupe


@pytest.fixture(scope="module")
def svc(served):
    return served[1]


def until(pred, timeout=30.0):
    """Polls `pred` until it holds, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def count_a(prompt, completion, prompt_ids, completion_ids, **data):
    return sum(1 for t in completion_ids if t == ord("a")) / 8


class Fixed:
    """A workflow returning one trajectory whose tokens carry `version[0]` (set by the test)."""

    def __init__(self):
        self.version = [0]
        self.runs = 0

    async def arun_episode(self, client, data):
        self.runs += 1
        await asyncio.sleep(0)
        return [troupe.Trajectory([1, 2], [3, 4], [-0.5, -0.5], reward=float(data), versions=[self.version[0]] * 2)]


class Raising:
    async def arun_episode(self, client, data):
        if data == "bad":
            raise ValueError("the reward server is down")
        return [troupe.Trajectory([1], [2], [-1.0], reward=1.0)]


def test_prepare_batch_runs_the_rlvr_workflow_in_groups(svc):
    wf = troupe.RLVRWorkflow(count_a, n_samples=4, gconfig={"max_new_tokens": 8, "ignore_eos": True})
    data = [{"input_ids": [83, 97, 121], "seed": i} for i in range(3)]
    with troupe.RolloutController(svc, batch_size=2, max_concurrent=8) as rc:
        batch = rc.prepare_batch(data, wf, timeout=120)
        assert len(batch) == 8
        assert sorted(t.group for t in batch) == [0, 0, 0, 0, 1, 1, 1, 1]
        for t in batch:
            assert t.prompt_ids.tolist() == [83, 97, 121]
            assert t.output_ids.dtype == np.int64 and len(t.output_ids) == 8
            assert t.logprobs.dtype == np.float32 and np.all(t.logprobs <= 0)
            assert t.versions.tolist() == [0] * 8
            assert t.reward == pytest.approx(count_a(None, None, None, t.output_ids.tolist()))
        # The next call takes the batch generated meanwhile (a list is cycled, as AReaL does).
        assert len(rc.prepare_batch(data, wf, timeout=120)) == 8


def test_seeded_items_sample_the_same_tokens(svc):
    wf = troupe.RLVRWorkflow(count_a, gconfig={"max_new_tokens": 6, "n_samples": 2})
    with troupe.RolloutController(svc, batch_size=1) as rc:
        a = rc.rollout_batch([{"input_ids": [5, 6], "seed": 3}], wf, timeout=60)
        b = rc.rollout_batch([{"input_ids": [5, 6], "seed": 3}], wf, timeout=60)
        assert len(a) == 2
        assert [t.output_ids.tolist() for t in a] == [t.output_ids.tolist() for t in b]
        assert a[0].output_ids.tolist() != a[1].output_ids.tolist() or len(a[0].output_ids) == 0


def test_pad_batch_gives_padded_arrays_and_masks():
    ts = [
        troupe.Trajectory([1, 2, 3], [4, 5], [-0.1, -0.2], reward=1.0, versions=[2, 3]),
        troupe.Trajectory([7], [8, 9, 10], np.array([-1, -2, -3], np.float32), reward=0.5, versions=["4", "4", "5"]),
        {"prompt_ids": [6], "output_ids": [7], "logprobs": [-0.3], "reward": 0.25},
    ]
    b = troupe.pad_batch(ts, pad_token_id=-7)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, -7], [6, 7, -7, -7, -7]]
    assert b["attention_mask"].tolist() == [[True] * 5, [True] * 4 + [False], [True] * 2 + [False] * 3]
    assert b["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert b["versions"].tolist() == [[-1, -1, -1, 2, 3], [-1, 4, 4, 5, -1], [-1, -1, -1, -1, -1]]
    np.testing.assert_allclose(b["logprobs"][0], [0, 0, 0, -0.1, -0.2], rtol=1e-6)
    assert b["rewards"].tolist() == [1.0, 0.5, 0.25]
    assert b["prompt_lens"].tolist() == [3, 1, 1] and b["seq_lens"].tolist() == [5, 4, 2]
    assert b["group"].tolist() == [-1, -1, -1]
    assert troupe.pad_batch([])["input_ids"].shape == (0, 0)


def test_bad_trajectories_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="logprob"):
        troupe.Trajectory([1], [2, 3], [-1.0])
    with pytest.raises(ValueError, match="versions"):
        troupe.Trajectory([1], [2], [-1.0], versions=[1, 2])
    with pytest.raises(ValueError, match="out of range"):
        troupe.Trajectory([-1], [2], [-1.0])
    with pytest.raises(ValueError, match="finite"):
        troupe.Trajectory([1], [2], [-1.0], reward=float("nan"))
    with pytest.raises(ValueError, match="trajectory 1"):
        troupe.pad_batch([troupe.Trajectory([1], [2], [-1.0]), {"prompt_ids": [1]}])


def test_a_raising_workflow_is_reported_with_its_traceback_and_does_not_stall(svc, caplog):
    with troupe.RolloutController(svc, batch_size=2) as rc:
        with caplog.at_level("ERROR", logger="troupe.rollout"):
            with pytest.raises(troupe.RolloutError, match="reward server is down"):
                rc.rollout_batch(["bad", "bad"], Raising(), timeout=60)
        s = rc.stats()
        assert s["failed"] == 2 and "Traceback" in s["last_error"] and "ValueError" in s["last_error"]
        assert "arun_episode" in s["last_error"]
        assert any("reward server is down" in r.getMessage() for r in caplog.records)
        # Good items still come through, failures counted beside them.
        batch = rc.prepare_batch(["ok", "bad", "ok", "ok"], Raising(), timeout=60)
        assert len(batch) == 2 and all(t.reward == 1.0 for t in batch)
        until(lambda: rc.stats()["failed"] >= 3)  # the "bad" item fails beside them


def test_a_workflow_returning_the_wrong_thing_fails_its_episode(svc):
    class Wrong:
        async def arun_episode(self, client, data):
            return 42

    with troupe.RolloutController(svc, batch_size=1) as rc:
        with pytest.raises(troupe.RolloutError, match="list of troupe.Trajectory"):
            rc.rollout_batch([0], Wrong(), timeout=60)


def test_should_accept_rejects_and_none_drops(svc):
    class Dropping:
        async def arun_episode(self, client, data):
            return None if data == "drop" else [troupe.Trajectory([1], [2], [-1.0], reward=float(len(data)))]

    with troupe.RolloutController(svc, batch_size=1) as rc:
        batch = rc.prepare_batch(["drop", "no", "yes!"], Dropping(), should_accept=lambda ts: ts[0].reward > 3, timeout=60)
        assert [t.reward for t in batch] == [4.0]
        # "drop" and "no" are rejected (perhaps after "yes!" came back; the list is cycled, so
        # more may run meanwhile).
        until(lambda: rc.stats()["rejected"] >= 2)


def test_trajectories_over_the_staleness_bound_are_regenerated(svc):
    wf = Fixed()
    with troupe.RolloutController(svc, batch_size=1, max_staleness=0) as rc:
        rc.submit(1, wf)
        until(lambda: rc.stats()["ready"] == 1)
        wf.version[0] = 2
        rc.set_version(2)  # the finished trajectory (version 0) is now 2 versions old
        (t,) = rc.wait(1, timeout=60)
        assert t.versions.tolist() == [2, 2]
        s = rc.stats()
        assert s["stale_dropped"] == 1 and wf.runs == 2 and rc.get_version() == 2


def test_stale_trajectories_are_dropped_under_the_drop_policy(svc):
    wf = Fixed()
    with troupe.RolloutController(svc, batch_size=1, max_staleness=0, stale_policy="drop") as rc:
        rc.submit(1, wf)
        until(lambda: rc.stats()["ready"] == 1)
        rc.set_version(1)
        with pytest.raises(troupe.RolloutError, match="nothing is running"):
            rc.wait(1, timeout=60)
        assert rc.stats()["stale_dropped"] == 1 and wf.runs == 1


def test_pause_holds_admission_and_wait_times_out(svc):
    with troupe.RolloutController(svc, batch_size=1) as rc:
        rc.pause()
        rc.submit(1, Fixed())
        with pytest.raises(TimeoutError):
            rc.wait(1, timeout=0.2)
        assert rc.stats()["waiting"] == 1
        rc.resume()
        assert len(rc.wait(1, timeout=60)) == 1


def test_bad_controller_arguments_are_refused(svc):
    with pytest.raises(ValueError, match="stale_policy"):
        troupe.RolloutController(svc, batch_size=1, stale_policy="later")
    with pytest.raises(ValueError, match="batch_size"):
        troupe.RolloutController(svc, batch_size=0)
    with pytest.raises(TypeError, match="gateway URL"):
        troupe.RolloutController(42, batch_size=1)
    with troupe.RolloutController(svc.gateway_url, batch_size=1) as rc:
        with pytest.raises(TypeError, match="arun_episode"):
            rc.submit(1, object())
        with pytest.raises(ValueError, match="timeout"):
            rc.wait(1, timeout=-1)
    with pytest.raises(ValueError, match="unknown keys"):
        troupe.RLVRWorkflow(count_a, gconfig={"max_tokens": 3})
    with pytest.raises(ValueError, match="n_samples"):
        troupe.RLVRWorkflow(count_a, n_samples=0)


def test_agenerate_is_native_asyncio_and_cancellable(svc):
    client = svc.client()

    async def main():
        many = await asyncio.gather(*(client.agenerate([5, 6], max_new_tokens=3, seed=i) for i in range(32)))
        assert all(len(g["output_ids"]) == 3 for g in many)
        # Cancelling the asyncio task drops the Rust request; the client stays usable.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.agenerate([5, 6], max_new_tokens=100000, ignore_eos=True), 0.05)
        g = await client.agenerate([5, 6], max_new_tokens=2, ignore_eos=True)
        assert len(g["output_ids"]) == 2
        # SGLang's shape works too, and is the same request.
        a = await client.agenerate(input_ids=[5, 6], sampling_params={"max_new_tokens": 4, "sampling_seed": 9})
        b = await client.agenerate([5, 6], max_new_tokens=4, seed=9)
        assert a["output_ids"].tolist() == b["output_ids"].tolist() and len(a["output_ids"]) == 4
        with pytest.raises(TypeError, match="max_tokens"):
            await client.agenerate([5, 6], max_tokens=3)
        with pytest.raises(TypeError, match="max_new_tokens"):
            await client.agenerate([5, 6], max_new_tokens="many")
        with pytest.raises(ValueError, match="input_ids"):
            await client.agenerate([])

    asyncio.run(main())


def test_config_sections_are_dicts_with_defaults():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    cfg = troupe.load_config(str(root / "examples/configs/grpo-local.yaml"), ["train.steps=3"])
    assert cfg.train["steps"] == 3 and cfg.train["target"] == "a"
    assert cfg.rollout["stale_policy"] == "regenerate"
    assert cfg.weight_format == "fp8" and cfg.model_path == "tiny"


def test_the_letter_task_and_grpo_advantages_are_troupe_runs(svc):
    task = troupe.LetterTask("a", seed=7, max_new_tokens=4)
    it = task.prompts()
    first = [next(it) for _ in range(5)]
    assert bytes(first[0]["input_ids"]).decode() == "Say a: " and first[4]["input_ids"] == first[0]["input_ids"]
    assert len({p["seed"] for p in first}) == 5
    assert task(None, None, [1], [97, 97, 98, 97]) == 0.75
    with pytest.raises(ValueError, match="one ASCII character"):
        troupe.LetterTask("ab")

    wf = troupe.RLVRWorkflow(task, n_samples=4, gconfig={"max_new_tokens": 4, "ignore_eos": True})
    with troupe.RolloutController(svc, batch_size=2) as rc:
        batch = rc.prepare_batch(it, wf, timeout=60)
    adv = troupe.grpo_advantages(batch)
    assert adv.dtype == np.float32 and adv.shape == (8,)
    for g in {t.group for t in batch}:
        r = np.array([t.reward for t in batch if t.group == g], dtype=np.float64)
        want = (r - r.mean()) / (r.std() + 1e-6)
        np.testing.assert_allclose(adv[[t.group == g for t in batch]], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no group"):
        troupe.grpo_advantages([troupe.Trajectory([1], [2], [-1.0])])


def test_shutdown_cancels_running_episodes_and_waits_for_them(svc):
    class Slow:
        async def arun_episode(self, client, data):
            await asyncio.sleep(600)

    rc = troupe.RolloutController(svc, batch_size=4, max_concurrent=4)
    for i in range(4):
        rc.submit(i, Slow())
    until(lambda: rc.stats()["running"] == 4)
    rc.shutdown()
    assert rc.stats()["running"] == 0
    rc.shutdown()  # idempotent
