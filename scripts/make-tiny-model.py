#!/usr/bin/env python3
"""Makes a tiny Qwen2 model and its tokenizer in OUT_DIR, with no download.

    python scripts/make-tiny-model.py OUT_DIR [--seed N] [--dtype bfloat16|float32] [--size tiny|100mb]

Why: tests and examples that run real vLLM need a model that starts in seconds on a 2-core CPU
and is the same on every machine. This one is a 2-layer Qwen2 (hidden 128, 4 query / 2 KV heads
of size 32, 1024 token ids) with random weights from `--seed` (another seed gives other weights:
a weight update that changes tokens), and a byte-level BPE tokenizer trained here on a fixed text
with the `tokenizers` package (484 tokens: the text's merges run out before 1024; the ids above
decode to nothing), with a ChatML chat template. Deterministic: the same seed gives
the same bytes. `--size 100mb` makes a wider, deeper one with the same tokenizer (16 layers,
hidden 512, 8 query / 4 KV heads of size 64: 52M parameters, 104 MB in bf16), for measuring weight
transfers at a size where bytes, not calls, dominate. Needs `torch`, `safetensors` and `tokenizers` (all in the vLLM venv that
`scripts/vllm-cpu.sh` makes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 1024
#: The shapes each `--size` makes: hidden, intermediate, layers, query heads, KV heads.
SIZES = {
    "tiny": (128, 256, 2, 4, 2),
    "100mb": (512, 1536, 16, 8, 4),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The tokenizer's training text: fixed, so the vocabulary is the same everywhere.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Say a: aaaa. Write the letter b many times: bbbbbbbb. Repeat after me, c: c c c c.",
    "You are a helpful assistant. What is the capital of France? Paris is the capital.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
    "system user assistant tool function arguments name content role",
    "Reinforcement learning from rewards trains the policy on its own samples.",
]


def tokenizer_files(out: Path) -> tuple[int, int]:
    """Trains the byte-level BPE tokenizer and writes tokenizer.json and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 8, trainer=trainer)
    if tok.get_vocab_size() > VOCAB:
        sys.exit(f"error: the tokenizer has {tok.get_vocab_size()} tokens, over {VOCAB}")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(s)): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s in SPECIALS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    return eos, pad


def model_files(out: Path, seed: int, dtype: str, size: str, eos: int, pad: int) -> None:
    """Writes config.json, generation_config.json and model.safetensors (random weights)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv_heads = SIZES[size]
    head_dim = hidden // heads

    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    g = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(tdtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=tdtype)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB, hidden)}
    kv = kv_heads * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = normal(hidden, hidden)
        t[p + "self_attn.q_proj.bias"] = normal(hidden)
        t[p + "self_attn.k_proj.weight"] = normal(kv, hidden)
        t[p + "self_attn.k_proj.bias"] = normal(kv)
        t[p + "self_attn.v_proj.weight"] = normal(kv, hidden)
        t[p + "self_attn.v_proj.bias"] = normal(kv)
        t[p + "self_attn.o_proj.weight"] = normal(hidden, hidden)
        t[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        t[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        t[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        t[p + "input_layernorm.weight"] = ones(hidden)
        t[p + "post_attention_layernorm.weight"] = ones(hidden)
    t["model.norm.weight"] = ones(hidden)
    t["lm_head.weight"] = normal(VOCAB, hidden)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="tiny (default) or 100mb")
    args = ap.parse_args()
    out: Path = args.out_dir
    if out.exists() and not out.is_dir():
        sys.exit(f"error: {out} exists and is not a directory; name a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    eos, pad = tokenizer_files(out)
    model_files(out, args.seed, args.dtype, args.size, eos, pad)
    print(f"{args.size} Qwen2 (seed {args.seed}, {args.dtype}) written to {out}")


if __name__ == "__main__":
    main()
