//! Which weights are quantized, and what their scale tensors are called.
//!
//! FP8 serving (DeepSeek / Hugging Face convention, SGLang `--quantization fp8`) quantizes only
//! the big linear projections inside decoder layers. Everything else stays in its training dtype:
//! embeddings and `lm_head` (accuracy-critical, and looked up rather than multiplied), norms and
//! biases (1-D), and MoE router gates (tiny, and their logits decide routing).

use super::codec::Granularity;
use super::error::Fp8Error;

/// Linear projections of attention blocks (Llama / Qwen / Mistral names, fused variants,
/// DeepSeek MLA, GPT-NeoX / Falcon fused QKV).
const ATTENTION: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "query_key_value",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
];

/// Linear projections of dense MLPs, MoE experts and shared experts.
const MLP: &[&str] = &["gate_proj", "up_proj", "down_proj", "gate_up_proj"];

/// Mixtral-style expert projections; only accepted under an `experts` module, because these short
/// names are too generic to trust elsewhere.
const EXPERT_ONLY: &[&str] = &["w1", "w2", "w3"];

/// Whether the tensor `name` with `shape` is quantized to FP8.
///
/// True only for a 2-D `.weight` of an attention or MLP / expert projection inside a decoder
/// layer. A decoder layer is a `layers.<N>.` path directly under a `model` or `language_model`
/// module (`model.layers.3.`, `language_model.model.layers.3.`,
/// `model.language_model.layers.3.`), which keeps vision towers and MTP heads out. The
/// projection is the module right before `.weight`, e.g. `self_attn.q_proj`,
/// `mlp.experts.7.down_proj`, `mlp.shared_expert.up_proj`, `block_sparse_moe.experts.0.w1`.
/// Router gates (`mlp.gate.weight`, `shared_expert_gate`), norms, biases, embeddings and
/// `lm_head` never match.
pub fn should_quantize(name: &str, shape: &[usize]) -> bool {
    if shape.len() != 2 {
        return false;
    }
    let segments: Vec<&str> = name.split('.').collect();
    let Some((&"weight", path)) = segments.split_last() else {
        return false;
    };
    let Some(layer) = decoder_layer_index(path) else {
        return false;
    };
    // The module path inside the layer, e.g. ["mlp", "experts", "7", "down_proj"].
    let inside = &path[layer + 2..];
    let Some((&module, parents)) = inside.split_last() else {
        return false;
    };
    if ATTENTION.contains(&module) || MLP.contains(&module) {
        return true;
    }
    EXPERT_ONLY.contains(&module) && parents.contains(&"experts")
}

/// Position of `layers` in a `(model|language_model).layers.<N>` run of path segments.
fn decoder_layer_index(path: &[&str]) -> Option<usize> {
    path.windows(3)
        .position(|w| {
            matches!(w[0], "model" | "language_model")
                && w[1] == "layers"
                && !w[2].is_empty()
                && w[2].bytes().all(|b| b.is_ascii_digit())
        })
        .map(|i| i + 1)
}

/// Name of the scale tensor that travels with the FP8 weight `name`.
///
/// Block scales: `<module>.weight` -> `<module>.weight_scale_inv` (the stored value is the dequant
/// multiplier, the name is historical). Per-tensor scales: `<module>.weight_scale`.
pub fn scale_name(name: &str, granularity: Granularity) -> Result<String, Fp8Error> {
    let Some(module) = name.strip_suffix(".weight") else {
        return Err(Fp8Error::NotAWeight {
            tensor: name.to_string(),
        });
    };
    Ok(match granularity {
        Granularity::Block(_) => format!("{module}.weight_scale_inv"),
        Granularity::PerTensor => format!("{module}.weight_scale"),
    })
}

/// If `name` is a scale tensor (`.weight_scale_inv` / `.weight_scale`), the weight it scales.
pub fn scaled_weight_name(name: &str) -> Option<String> {
    name.strip_suffix(".weight_scale_inv")
        .or_else(|| name.strip_suffix(".weight_scale"))
        .map(|module| format!("{module}.weight"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: &[usize] = &[4096, 4096];

    #[test]
    fn decoder_projections_are_quantized() {
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.31.self_attn.o_proj.weight",
            "model.layers.2.self_attn.qkv_proj.weight",
            "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.2.self_attn.kv_b_proj.weight",
            "model.layers.2.self_attn.q_a_proj.weight",
            "model.layers.2.self_attn.q_b_proj.weight",
            "model.layers.1.mlp.gate_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.mlp.gate_up_proj.weight",
            "model.layers.5.mlp.experts.63.down_proj.weight",
            "model.layers.5.mlp.shared_expert.up_proj.weight",
            "model.layers.5.mlp.shared_experts.gate_proj.weight",
            "model.layers.5.block_sparse_moe.experts.7.w1.weight",
            "model.layers.5.block_sparse_moe.experts.7.w2.weight",
            "model.layers.5.block_sparse_moe.experts.7.w3.weight",
            "language_model.model.layers.4.self_attn.q_proj.weight",
            "model.language_model.layers.4.mlp.down_proj.weight",
        ] {
            assert!(should_quantize(name, M), "{name} should be quantized");
        }
    }

    #[test]
    fn everything_else_stays_in_training_dtype() {
        for name in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.3.mlp.gate.weight",
            "model.layers.3.block_sparse_moe.gate.weight",
            "model.layers.3.mlp.shared_expert_gate.weight",
            "model.layers.3.mlp.gate.e_score_correction_bias",
            "model.layers.3.mlp.w1.weight",
            "model.layers.0.self_attn.q_proj.weight_scale_inv",
            "model.layers.x.self_attn.q_proj.weight",
            "model.layers..self_attn.q_proj.weight",
            "vision_tower.encoder.layers.0.self_attn.q_proj.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "model.layers.0.self_attn.q_proj",
            "q_proj.weight",
            "layers.0.self_attn.q_proj.weight",
            "model.layers.0.weight",
            "",
        ] {
            assert!(!should_quantize(name, M), "{name} must not be quantized");
        }
    }

    #[test]
    fn only_matrices_are_quantized() {
        let name = "model.layers.0.mlp.down_proj.weight";
        assert!(!should_quantize(name, &[4096]));
        assert!(!should_quantize(name, &[8, 4096, 4096]));
        assert!(!should_quantize(name, &[]));
        assert!(should_quantize(name, &[1, 1]));
    }

    #[test]
    fn scale_names_follow_the_checkpoint_convention() {
        let block = Granularity::default();
        let name = "model.layers.0.self_attn.q_proj.weight";
        let inv = scale_name(name, block).expect("a .weight name");
        assert_eq!(inv, "model.layers.0.self_attn.q_proj.weight_scale_inv");
        assert_eq!(
            scale_name(name, Granularity::PerTensor).expect("a .weight name"),
            "model.layers.0.self_attn.q_proj.weight_scale"
        );
        assert_eq!(scaled_weight_name(&inv).as_deref(), Some(name));
        assert_eq!(
            scaled_weight_name("model.layers.0.self_attn.q_proj.weight_scale").as_deref(),
            Some(name)
        );
        assert_eq!(scaled_weight_name(name), None);
        let err = scale_name("model.layers.0.self_attn.q_proj.bias", block).unwrap_err();
        assert!(err.to_string().contains("q_proj.bias"), "{err}");
    }
}
