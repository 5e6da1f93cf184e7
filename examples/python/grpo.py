"""`troupe run`'s GRPO loop in one Python file: a Python workflow, the reference trainer as a
remote actor, and a weight sync to every engine (FP8 blocks per the config) after every step.

    bash scripts/python-env.sh                  # .venv with the bindings and the troupe binary
    .venv/bin/python examples/python/grpo.py    # examples/configs/grpo-local.yaml

Arguments: a config (default grpo-local.yaml) and `dotted.key=value` overrides, as `troupe run`
takes them; `--summary run.json` writes the rewards. The task: reward = fraction of generated
bytes equal to `train.target`; the tiny model starts near zero and learns it in a few dozen steps.
"""

import argparse
import json
import pathlib
import sys
import time

import numpy as np

import troupe

ROOT = pathlib.Path(__file__).resolve().parents[2]






def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [KEY=VALUE ...]",
        help="a config (default examples/configs/grpo-local.yaml), then overrides like train.steps=20",
    )
    ap.add_argument("--summary", help="write the per-step rewards as JSON here")
    a = ap.parse_args(argv)
    config = str(ROOT / "examples/configs/grpo-local.yaml")
    overrides = a.args
    if overrides and "=" not in overrides[0]:
        config, overrides = overrides[0], overrides[1:]

    try:
        cfg = troupe.load_config(config, overrides)
    except troupe.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tc, rc = cfg.train, cfg.rollout
    max_new = tc["max_new_tokens"]
    # troupe run's task (prompts asking for `train.target`; reward = the fraction of generated
    # bytes equal to it): the same definition the Rust loop uses.
    task = troupe.LetterTask(tc["target"], tc["seed"], max_new)
    workflow = troupe.RLVRWorkflow(
        task,
        n_samples=tc["group_size"],
        gconfig={"max_new_tokens": max_new, "temperature": tc["temperature"], "ignore_eos": True},
    )
    rewards, start = [], time.time()
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        trainer = cluster.spawn_trainer(model=cfg.model_path, lr=tc["lr"], temperature=tc["temperature"])
        with troupe.RolloutController(
            svc,
            batch_size=tc["batch_size"],
            max_concurrent=rc["max_concurrent_rollouts"],
            max_staleness=rc["max_head_offpolicyness"],
            stale_policy=rc["stale_policy"],
        ) as rollout:
            data = task.prompts()
            for step in range(tc["steps"]):
                batch = rollout.prepare_batch(data, workflow)
                # Staleness as AReaL defines it: how many versions the oldest token lags.
                stale = max(0, step - min(int(t.versions.min(initial=step)) for t in batch))
                report = trainer.train_batch(batch, advantages=troupe.grpo_advantages(batch).tolist())
                sync = svc.update_weights(trainer.get_weights(), version=step + 1)
                rollout.set_version(step + 1)
                rewards.append(float(np.mean([t.reward for t in batch])))
                print(
                    f"step {step + 1:>3}  reward {rewards[-1]:.3f}  train {report['seconds']:.2f}s  "
                    f"sync {sync['seconds']:.3f}s ({cfg.weight_format})  staleness {stale}",
                    flush=True,
                )
            stats = rollout.stats()
    k = min(3, len(rewards))
    summary = {
        "steps": len(rewards),
        "baseline_reward": rewards[0] if rewards else 0.0,
        "final_reward": float(np.mean(rewards[-k:])) if rewards else 0.0,
        "rewards": rewards,
        "stale_dropped": stats["stale_dropped"],
        "weight_format": cfg.weight_format,
        "total_seconds": time.time() - start,
    }
    print(
        f"reward {summary['baseline_reward']:.3f} -> {summary['final_reward']:.3f} in "
        f"{summary['steps']} steps, {summary['total_seconds']:.1f}s"
    )
    if a.summary:
        pathlib.Path(a.summary).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
