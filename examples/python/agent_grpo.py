"""A multi-turn, tool-using agent written with the `openai` SDK, trained with GRPO as it is.

    bash scripts/python-env.sh && .venv/bin/pip install openai
    .venv/bin/python examples/python/agent_grpo.py           # examples/configs/grpo-local.yaml

The agent (`run_agent` below) is plain OpenAI client code: it asks the model a sum with a
`calculator` tool it must call (a named `tool_choice`), runs the tool on the call's argument,
sends the result back and takes the model's final answer. It never sees a token id. The gateway
(`gateway.tokenizer: auto`, here the reference engine's) renders the chat template, sends token ids to the engines and
records each turn's exact tokens, logprobs and weight versions in the episode's session;
`troupe.AgentWorkflow` turns the recorded turns into trajectories for the trainer.

Reward (the tiny reference model starts from random weights, so it must be learnable by a
byte-level model): ½ · the share of the calculator argument's characters that are digits +
½ · the share of the final answer's characters that are digits; 1.0 is all digits in both turns.
Arguments as `troupe run` takes them (a config, then `dotted.key=value` overrides), plus
`--summary run.json` (rewards per step).
"""

import argparse
import json
import pathlib
import sys
import time

import numpy as np

import troupe

ROOT = pathlib.Path(__file__).resolve().parents[2]

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression of digits, + and -.",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
    },
}


def digits(text: str) -> float:
    """The share of `text`'s characters that are digits (0 for no text)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def calculator(expression: str) -> str:
    """The tool: sums and differences of whole numbers, else an error message for the model."""
    total, sign, num = 0, 1, ""
    for c in expression.replace(" ", "") + "+":
        if c.isdigit():
            num += c
        elif c in "+-" and num:
            total, num, sign = total + sign * int(num), "", 1 if c == "+" else -1
        else:
            return f"error: cannot evaluate {expression!r}"
    return str(total)


def make_agent(max_tokens: int, temperature: float):
    async def run_agent(base_url: str, api_key: str, data: dict) -> float:
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": f"What is {data['a']}+{data['b']}? Use the calculator."}]
        forced = {"type": "function", "function": {"name": "calculator"}}
        first = await client.chat.completions.create(
            model="tiny", messages=messages, tools=[CALCULATOR], tool_choice=forced,
            max_tokens=max_tokens, temperature=temperature,
        )
        msg = first.choices[0].message
        call = msg.tool_calls[0]
        argument = json.loads(call.function.arguments).get("input", "")
        messages.append(msg.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(argument)})
        final = await client.chat.completions.create(
            model="tiny", messages=messages, tools=[CALCULATOR], tool_choice="none",
            max_tokens=max_tokens, temperature=temperature,
        )
        answer = final.choices[0].message.content or ""
        return 0.5 * digits(argument) + 0.5 * digits(answer)

    return run_agent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
    ap.add_argument("--summary", help="write the per-step rewards as JSON here")
    a = ap.parse_args(argv)
    config = str(ROOT / "examples/configs/grpo-local.yaml")
    overrides = a.args
    if overrides and "=" not in overrides[0]:
        config, overrides = overrides[0], overrides[1:]
    try:
        cfg = troupe.load_config(config, ["gateway.tokenizer=auto", *overrides])
    except troupe.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tc, rc = cfg.train, cfg.rollout
    agent = make_agent(tc["max_new_tokens"], tc["temperature"])
    rng = np.random.default_rng(tc["seed"])
    rewards, start = [], time.time()
    with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
        workflow = troupe.AgentWorkflow(agent, n_samples=tc["group_size"], admin_key=svc.admin_key)
        trainer = cluster.spawn_trainer(model=cfg.model_path, lr=tc["lr"], temperature=tc["temperature"])
        with troupe.RolloutController(
            svc,
            batch_size=tc["batch_size"],
            max_concurrent=rc["max_concurrent_rollouts"],
            max_staleness=rc["max_head_offpolicyness"],
            stale_policy=rc["stale_policy"],
        ) as rollout:
            data = [{"a": int(x), "b": int(y)} for x, y in rng.integers(0, 50, size=(1000, 2))]
            for step in range(tc["steps"]):
                batch = rollout.prepare_batch(data, workflow)
                report = trainer.train_batch(batch, advantages=troupe.grpo_advantages(batch).tolist())
                sync = svc.update_weights(trainer.get_weights(), version=step + 1)
                rollout.set_version(step + 1)
                # Every episode has two turns, each carrying the episode's reward.
                rewards.append(float(np.mean([t.reward for t in batch])))
                print(
                    f"step {step + 1:>3}  reward {rewards[-1]:.3f}  turns {len(batch)}  "
                    f"train {report['seconds']:.2f}s  sync {sync['seconds']:.3f}s",
                    flush=True,
                )
    k = min(3, len(rewards))
    summary = {
        "steps": len(rewards),
        "baseline_reward": rewards[0] if rewards else 0.0,
        "final_reward": float(np.mean(rewards[-k:])) if rewards else 0.0,
        "rewards": rewards,
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
