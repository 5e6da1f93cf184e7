//! The trainer's side of weight-sync tests: reference-model weights as trainer tensors, and a
//! regular engine holding exactly what engines hold after a BF16 sync (the ground truth).

use half::bf16;
use troupe_engine::model::{ModelConfig, Weights};
use troupe_serving::control_plane::HostTensor;

/// Tiny-model weights from `seed`, and the same as trainer tensors.
pub fn trainer_weights(seed: u64) -> (Weights, Vec<HostTensor>) {
    let w = Weights::init(&ModelConfig::tiny(), seed);
    let tensors = w
        .names()
        .into_iter()
        .map(|n| {
            let t = w.get(&n).unwrap();
            HostTensor {
                name: n.clone(),
                shape: t.shape.clone(),
                data: t.data.clone().into(),
            }
        })
        .collect();
    (w, tensors)
}

/// A regular engine holding `w` rounded to BF16, as the engines hold it after a BF16 sync.
pub async fn reference_engine(
    mut w: Weights,
    dir: &std::path::Path,
) -> troupe_engine::EngineHandle {
    for n in w.names() {
        let rounded: Vec<f32> = w
            .get(&n)
            .unwrap()
            .data
            .iter()
            .map(|v| bf16::from_f32(*v).to_f32())
            .collect();
        w.set(&n, rounded).unwrap();
    }
    let path = dir.join("ref.safetensors");
    w.save_safetensors(&path).unwrap();
    super::engine(troupe_engine::EngineArgs {
        model_path: Some(path),
        ..super::engine_args()
    })
    .await
}
