//! Model sizes. Two presets: `tiny` (fast enough for every test) and `small` (dimensions that
//! are multiples of 128 so FP8 128×128 blocks are meaningful).

use serde::Serialize;

use crate::tokenizer::VOCAB_SIZE;

/// Architecture hyper-parameters, named like a Hugging Face `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    /// Preset name (`tiny` or `small`).
    pub name: String,
    /// Vocabulary size (bytes + special tokens).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// SwiGLU inner width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Longest sequence (prompt + output) the engine accepts.
    pub max_position_embeddings: usize,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
}

impl ModelConfig {
    /// 2 layers, width 64: microseconds per token, used by tests and the laptop default.
    pub fn tiny() -> Self {
        Self {
            name: "tiny".into(),
            vocab_size: VOCAB_SIZE,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            max_position_embeddings: 4096,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
        }
    }

    /// 4 layers, width 256: about a millisecond per token, with 128-aligned projections.
    pub fn small() -> Self {
        Self {
            name: "small".into(),
            vocab_size: VOCAB_SIZE,
            hidden_size: 256,
            intermediate_size: 768,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            head_dim: 32,
            max_position_embeddings: 8192,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
        }
    }

    /// Looks a preset up by name.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny()),
            "small" => Some(Self::small()),
            _ => None,
        }
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of all key (or value) heads together: one KV cache row per token and layer.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Every parameter name with its shape, in a stable order (embeddings, layers, norm, head).
    /// Linear weights are `[out_features, in_features]`, as in PyTorch.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, q, kv) = (
            self.hidden_size,
            self.intermediate_size,
            self.q_dim(),
            self.kv_dim(),
        );
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
        )];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        out.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        out
    }

    /// Total number of parameters.
    pub fn num_parameters(&self) -> usize {
        self.tensor_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// A Hugging Face-style `config.json` for this model (written next to saved weights).
    pub fn hf_config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": false,
            "troupe_preset": self.name,
        })
    }
}
