//! Named model weights: seeded initialisation, safetensors load/save, and by-name updates.
//!
//! Weights live in typed fields (so the forward pass never looks names up) but are addressed
//! from outside by their Hugging Face names, which is what trainers, weight buckets and the FP8
//! codec speak.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::config::ModelConfig;
use crate::error::EngineError;
use crate::rng::{SplitMix64, hash_str, mix};

/// A dense f32 tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Dimensions; linear weights are `[out_features, in_features]`.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor of this shape filled with `value`.
    pub fn filled(shape: Vec<usize>, value: f32) -> Self {
        let n = shape.iter().product();
        Self {
            shape,
            data: vec![value; n],
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// One decoder layer's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    /// RMSNorm gain before attention.
    pub input_layernorm: Tensor,
    /// Query projection `[q_dim, hidden]`.
    pub q_proj: Tensor,
    /// Key projection `[kv_dim, hidden]`.
    pub k_proj: Tensor,
    /// Value projection `[kv_dim, hidden]`.
    pub v_proj: Tensor,
    /// Output projection `[hidden, q_dim]`.
    pub o_proj: Tensor,
    /// RMSNorm gain before the MLP.
    pub post_attention_layernorm: Tensor,
    /// SwiGLU gate `[intermediate, hidden]`.
    pub gate_proj: Tensor,
    /// SwiGLU up `[intermediate, hidden]`.
    pub up_proj: Tensor,
    /// SwiGLU down `[hidden, intermediate]`.
    pub down_proj: Tensor,
}

/// All parameters of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    /// The architecture these tensors belong to.
    pub config: ModelConfig,
    /// `model.embed_tokens.weight` `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// `model.layers.{i}.*`.
    pub layers: Vec<LayerWeights>,
    /// `model.norm.weight` `[hidden]`.
    pub norm: Tensor,
    /// `lm_head.weight` `[vocab, hidden]`.
    pub lm_head: Tensor,
}

/// How a parameter is initialised from the seed.
fn init_std(name: &str, shape: &[usize]) -> Option<f64> {
    if name.ends_with("layernorm.weight") || name == "model.norm.weight" {
        return None; // ones
    }
    if name == "model.embed_tokens.weight" {
        return Some(1.0);
    }
    let fan_in = *shape.last().unwrap_or(&1) as f64;
    if name == "lm_head.weight" {
        // A wider head gives the random model a peaked next-token distribution.
        return Some(3.0 / fan_in.sqrt());
    }
    Some(1.0 / fan_in.sqrt())
}

impl Weights {
    /// Deterministic initialisation: every tensor gets its own generator seeded from
    /// `(seed, name)`, so the result does not depend on iteration order or thread count.
    /// Norm gains start at one; projections at N(0, 1/fan_in).
    pub fn init(config: &ModelConfig, seed: u64) -> Self {
        let mut map: HashMap<String, Tensor> = config
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let t = match init_std(&name, &shape) {
                    None => Tensor::filled(shape, 1.0),
                    Some(std) => {
                        let mut rng = SplitMix64::new(mix(seed, hash_str(&name)));
                        let n: usize = shape.iter().product();
                        let data = (0..n).map(|_| (rng.next_normal() * std) as f32).collect();
                        Tensor { shape, data }
                    }
                };
                (name, t)
            })
            .collect();
        Self::from_map(config, &mut map)
            .unwrap_or_else(|e| unreachable!("init covers every tensor: {e}"))
    }

    fn from_map(config: &ModelConfig, map: &mut HashMap<String, Tensor>) -> Result<Self, String> {
        let mut take = |name: String| -> Result<Tensor, String> {
            map.remove(&name)
                .ok_or_else(|| format!("missing tensor {name}"))
        };
        let embed_tokens = take("model.embed_tokens.weight".into())?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = format!("model.layers.{l}");
            layers.push(LayerWeights {
                input_layernorm: take(format!("{p}.input_layernorm.weight"))?,
                q_proj: take(format!("{p}.self_attn.q_proj.weight"))?,
                k_proj: take(format!("{p}.self_attn.k_proj.weight"))?,
                v_proj: take(format!("{p}.self_attn.v_proj.weight"))?,
                o_proj: take(format!("{p}.self_attn.o_proj.weight"))?,
                post_attention_layernorm: take(format!("{p}.post_attention_layernorm.weight"))?,
                gate_proj: take(format!("{p}.mlp.gate_proj.weight"))?,
                up_proj: take(format!("{p}.mlp.up_proj.weight"))?,
                down_proj: take(format!("{p}.mlp.down_proj.weight"))?,
            });
        }
        let norm = take("model.norm.weight".into())?;
        let lm_head = take("lm_head.weight".into())?;
        Ok(Self {
            config: config.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    /// Every parameter name, in the config's stable order.
    pub fn names(&self) -> Vec<String> {
        self.config
            .tensor_shapes()
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }

    /// The tensor with this Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        match name {
            "model.embed_tokens.weight" => return Some(&self.embed_tokens),
            "model.norm.weight" => return Some(&self.norm),
            "lm_head.weight" => return Some(&self.lm_head),
            _ => {}
        }
        let (l, field) = parse_layer_name(name)?;
        let layer = self.layers.get(l)?;
        Some(match field {
            "input_layernorm.weight" => &layer.input_layernorm,
            "self_attn.q_proj.weight" => &layer.q_proj,
            "self_attn.k_proj.weight" => &layer.k_proj,
            "self_attn.v_proj.weight" => &layer.v_proj,
            "self_attn.o_proj.weight" => &layer.o_proj,
            "post_attention_layernorm.weight" => &layer.post_attention_layernorm,
            "mlp.gate_proj.weight" => &layer.gate_proj,
            "mlp.up_proj.weight" => &layer.up_proj,
            "mlp.down_proj.weight" => &layer.down_proj,
            _ => return None,
        })
    }

    /// Mutable access by Hugging Face name.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        match name {
            "model.embed_tokens.weight" => return Some(&mut self.embed_tokens),
            "model.norm.weight" => return Some(&mut self.norm),
            "lm_head.weight" => return Some(&mut self.lm_head),
            _ => {}
        }
        let (l, field) = parse_layer_name(name)?;
        let layer = self.layers.get_mut(l)?;
        Some(match field {
            "input_layernorm.weight" => &mut layer.input_layernorm,
            "self_attn.q_proj.weight" => &mut layer.q_proj,
            "self_attn.k_proj.weight" => &mut layer.k_proj,
            "self_attn.v_proj.weight" => &mut layer.v_proj,
            "self_attn.o_proj.weight" => &mut layer.o_proj,
            "post_attention_layernorm.weight" => &mut layer.post_attention_layernorm,
            "mlp.gate_proj.weight" => &mut layer.gate_proj,
            "mlp.up_proj.weight" => &mut layer.up_proj,
            "mlp.down_proj.weight" => &mut layer.down_proj,
            _ => return None,
        })
    }

    /// Checks that `name` exists and has exactly `shape`, without changing anything. Used to
    /// validate a whole update before applying any of it.
    pub fn check_shape(&self, name: &str, shape: &[usize]) -> Result<(), String> {
        let t = self.get(name).ok_or_else(|| {
            format!(
                "unknown parameter {name:?}; names look like model.layers.0.self_attn.q_proj.weight"
            )
        })?;
        if t.shape != shape {
            return Err(format!(
                "parameter {name} has shape {:?}, update has {:?}",
                t.shape, shape
            ));
        }
        Ok(())
    }

    /// Replaces one tensor's values (shape-checked).
    pub fn set(&mut self, name: &str, data: Vec<f32>) -> Result<(), String> {
        let t = self
            .get_mut(name)
            .ok_or_else(|| format!("unknown parameter {name:?}"))?;
        if t.data.len() != data.len() {
            return Err(format!(
                "parameter {name} has {} elements, update has {}",
                t.data.len(),
                data.len()
            ));
        }
        t.data = data;
        Ok(())
    }

    /// Serialises all tensors to safetensors bytes (f32), with the config as metadata.
    pub fn to_safetensors_bytes(&self) -> Result<Vec<u8>, EngineError> {
        let names = self.names();
        let raw: Vec<(String, Vec<u8>, Vec<usize>)> = names
            .into_iter()
            .filter_map(|n| {
                let t = self.get(&n)?;
                let bytes: Vec<u8> = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                Some((n, bytes, t.shape.clone()))
            })
            .collect();
        let views = raw
            .iter()
            .map(|(n, b, s)| {
                TensorView::new(Dtype::F32, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| EngineError::Weights(format!("tensor {n}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        meta.insert("troupe_preset".to_string(), self.config.name.clone());
        safetensors::serialize(views, Some(meta)).map_err(|e| EngineError::Weights(e.to_string()))
    }

    /// Writes `model.safetensors`-style bytes to `path`.
    pub fn save_safetensors(&self, path: &Path) -> Result<(), EngineError> {
        let bytes = self.to_safetensors_bytes()?;
        std::fs::write(path, bytes)
            .map_err(|e| EngineError::Weights(format!("cannot write {}: {e}", path.display())))
    }

    /// Parses safetensors bytes for this architecture. Accepts F32, BF16 and F16 tensors; every
    /// parameter must be present with the right shape (extra tensors are an error too, since
    /// they usually mean the wrong `--model` preset).
    pub fn from_safetensors_bytes(config: &ModelConfig, bytes: &[u8]) -> Result<Self, EngineError> {
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| EngineError::Weights(format!("not a safetensors file: {e}")))?;
        let expected = config.tensor_shapes();
        let mut map = HashMap::with_capacity(expected.len());
        for (name, shape) in &expected {
            let view = st.tensor(name).map_err(|_| {
                EngineError::Weights(format!(
                    "tensor {name} missing: the file does not hold a `{}` model",
                    config.name
                ))
            })?;
            if view.shape() != shape.as_slice() {
                return Err(EngineError::Weights(format!(
                    "tensor {name} has shape {:?}, the `{}` model needs {:?}; pick the matching --model",
                    view.shape(),
                    config.name,
                    shape
                )));
            }
            let data = decode_floats(view.dtype(), view.data())
                .map_err(|e| EngineError::Weights(format!("tensor {name}: {e}")))?;
            map.insert(
                name.clone(),
                Tensor {
                    shape: shape.clone(),
                    data,
                },
            );
        }
        if st.len() != expected.len() {
            let known: std::collections::HashSet<&str> =
                expected.iter().map(|(n, _)| n.as_str()).collect();
            let extra: Vec<&str> = st
                .names()
                .into_iter()
                .filter(|n| !known.contains(n))
                .collect();
            return Err(EngineError::Weights(format!(
                "unexpected tensors {extra:?} for the `{}` model",
                config.name
            )));
        }
        Self::from_map(config, &mut map).map_err(EngineError::Weights)
    }

    /// Loads a safetensors file (or `model.safetensors` inside a directory).
    pub fn load_safetensors(config: &ModelConfig, path: &Path) -> Result<Self, EngineError> {
        let file = if path.is_dir() {
            path.join("model.safetensors")
        } else {
            path.to_path_buf()
        };
        let bytes = read_checkpoint(config, &file)?;
        Self::from_safetensors_bytes(config, &bytes)
    }
}

/// Largest safetensors header accepted: a model's tensor names and offsets are a few KiB.
const MAX_HEADER_BYTES: u64 = 1 << 20;

/// Reads a safetensors file for `config` with every size checked before the data is read:
/// only a regular file (a FIFO or `/dev/zero` would hang the loader or grow the engine without
/// bound), a header of bounded size, and a file exactly as long as its header says, holding at
/// most 4 bytes (f32) per parameter of the model plus its FP8 scales. Time and memory are then
/// bounded by the model's size, whatever the path names.
fn read_checkpoint(config: &ModelConfig, file: &Path) -> Result<Vec<u8>, EngineError> {
    use std::io::Read;
    let bad = |m: String| EngineError::Weights(format!("{}: {m}", file.display()));
    // stat, not open: opening a FIFO blocks until a writer comes.
    let meta = std::fs::metadata(file).map_err(|e| bad(format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(bad("not a regular file; give a .safetensors file".into()));
    }
    let size = meta.len();
    let mut f = std::fs::File::open(file).map_err(|e| bad(format!("cannot open it: {e}")))?;
    let mut len8 = [0u8; 8];
    f.read_exact(&mut len8)
        .map_err(|e| bad(format!("too short for a safetensors header: {e}")))?;
    let header_len = u64::from_le_bytes(len8);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > size {
        return Err(bad(format!(
            "safetensors header of {header_len} bytes does not fit (file is {size} bytes, at most {MAX_HEADER_BYTES} header bytes accepted)"
        )));
    }
    // At most f32 per parameter, plus per-block FP8 scales (far less than the weights).
    let max_data = 8 * config.num_parameters() as u64;
    let data_len = size - 8 - header_len;
    if data_len > max_data {
        return Err(bad(format!(
            "holds {data_len} bytes of tensors, more than a {} model can have ({max_data}); is it the checkpoint of another model?",
            config.name
        )));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    bytes.extend_from_slice(&len8);
    f.take(size - 8)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    if bytes.len() as u64 != size {
        return Err(bad("changed size while being read".into()));
    }
    Ok(bytes)
}

fn parse_layer_name(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (idx, field) = rest.split_once('.')?;
    Some((idx.parse().ok()?, field))
}

/// The one f32 decoder of float tensor bytes (in `troupe-weights`).
pub use troupe_weights::floats::decode_floats;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_deterministic_and_seed_dependent() {
        let c = ModelConfig::tiny();
        let a = Weights::init(&c, 1);
        assert_eq!(a, Weights::init(&c, 1));
        assert_ne!(a, Weights::init(&c, 2));
        assert_eq!(a.norm.data, vec![1.0; c.hidden_size]);
        for (name, shape) in c.tensor_shapes() {
            assert_eq!(a.get(&name).map(|t| t.shape.clone()), Some(shape), "{name}");
        }
        assert!(a.get("model.layers.9.mlp.up_proj.weight").is_none());
    }

    #[test]
    fn safetensors_round_trip_and_wrong_preset() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 3);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        w.save_safetensors(&path).unwrap();
        assert_eq!(Weights::load_safetensors(&c, dir.path()).unwrap(), w);
        let err = Weights::load_safetensors(&ModelConfig::small(), &path).unwrap_err();
        assert!(err.to_string().contains("--model"), "{err}");
        assert!(Weights::from_safetensors_bytes(&c, b"garbage").is_err());
    }

    #[test]
    fn set_checks_shapes() {
        let c = ModelConfig::tiny();
        let mut w = Weights::init(&c, 3);
        assert!(w.set("model.norm.weight", vec![0.0; 3]).is_err());
        assert!(w.check_shape("model.norm.weight", &[64]).is_ok());
        assert!(w.check_shape("model.norm.weight", &[65]).is_err());
        w.set("model.norm.weight", vec![2.0; 64]).unwrap();
        assert_eq!(w.norm.data[0], 2.0);
    }
}
