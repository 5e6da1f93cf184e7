//! FP8 weight updates over the `tcp` transport: an engine started with `--quantization fp8`
//! dequantizes `float8_e4m3fn` weights with their block or per-tensor scales on load, and then
//! produces exactly what an engine loaded with `dequantize(quantize(w))` produces; malformed FP8
//! updates are refused and change nothing; BF16 updates keep working.

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use troupe_engine::{ModelConfig, Weights};
use troupe_weights::fp8::{self, BlockSize, Fp8Options, Granularity};
use troupe_weights::tcp::{TensorRef, WeightSender, WireDtype};

const BLOCK: usize = 32;

fn greedy() -> Value {
    json!({"text": "fp8 weights", "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "return_logprob": true})
}

/// One tensor as it goes on the wire.
struct Wire {
    name: String,
    dtype: WireDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// The seed-99 model as an FP8 trainer sends it: projections quantized (32x32 blocks, except
/// one with a per-tensor scale), everything else f32. Also returns the weights an engine
/// holding `dequantize(quantize(w))` has.
fn fp8_update(cfg: &ModelConfig) -> (Vec<Wire>, Weights) {
    let new = Weights::init(cfg, 99);
    let mut expected = Weights::init(cfg, 99);
    let mut wire = Vec::new();
    for name in new.names() {
        let t = new.get(&name).unwrap();
        if !fp8::should_quantize(&name, &t.shape) {
            wire.push(Wire {
                name,
                dtype: WireDtype::F32,
                shape: t.shape.clone(),
                bytes: f32_bytes(&t.data),
            });
            continue;
        }
        let granularity = if name.contains("layers.1.mlp.down_proj") {
            Granularity::PerTensor
        } else {
            Granularity::Block(BlockSize::new(BLOCK, BLOCK).unwrap())
        };
        let opts = Fp8Options {
            granularity,
            ..Fp8Options::default()
        };
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let q = fp8::quantize(&name, rows, cols, fp8::Weights::F32(&t.data), &opts).unwrap();
        expected
            .set(&name, q.dequantize_f32(&name).unwrap())
            .unwrap();
        wire.push(Wire {
            name: name.clone(),
            dtype: WireDtype::F8E4M3,
            shape: vec![rows, cols],
            bytes: q.data.clone(),
        });
        wire.push(Wire {
            name: fp8::scale_name(&name, granularity).unwrap(),
            dtype: WireDtype::F32,
            shape: q.scale_shape(),
            bytes: q.scales.to_le_bytes(),
        });
    }
    (wire, expected)
}

fn request(wire: &[Wire], version: &str) -> Value {
    json!({
        "names": wire.iter().map(|w| w.name.clone()).collect::<Vec<_>>(),
        "dtypes": wire.iter().map(|w| w.dtype.as_str()).collect::<Vec<_>>(),
        "shapes": wire.iter().map(|w| w.shape.clone()).collect::<Vec<_>>(),
        "group_name": "fp8", "flush_cache": true, "weight_version": version,
    })
}

fn refs(wire: &[Wire]) -> Vec<TensorRef<'_>> {
    wire.iter()
        .map(|w| TensorRef {
            name: &w.name,
            dtype: w.dtype,
            shape: &w.shape,
            bytes: &w.bytes,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fp8_update_equals_loading_dequantized_weights() {
    within(90, async {
        let cfg = ModelConfig::tiny();
        let (wire, expected) = fp8_update(&cfg);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        expected.save_safetensors(&path).unwrap();
        let mut reference = args("null");
        reference.model_path = Some(path);
        let reference = engine(reference).await;

        let override_args = json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}});
        let fp8_args = |mode: &str, tp: u32| {
            let mut a = args(mode);
            a.tp_size = tp;
            a.quantization = Some("fp8".into());
            a.json_model_override_args = Some(override_args.to_string());
            a
        };
        let a = engine(fp8_args("null", 1)).await;
        let b = engine(fp8_args("null", 2)).await;
        let (_, before) = post(&format!("{}/generate", a.url()), &greedy()).await;
        let (_, want) = post(&format!("{}/generate", reference.url()), &greedy()).await;
        assert_ne!(before["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]);

        let mut sender = WeightSender::bind("127.0.0.1:0", 4, "fp8").await.unwrap();
        let port = sender.local_addr().unwrap().port();
        let key = sender.secret();
        let init = |rank: u64| json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": rank, "world_size": 4, "group_name": "fp8", "backend": "tcp", "group_secret": key});
        let (au, bu) = (format!("{}/init_weights_update_group", a.url()), format!("{}/init_weights_update_group", b.url()));
        let (ia, ib) = (init(1), init(2));
        let (ra, rb, acc) = tokio::join!(post(&au, &ia), post(&bu, &ib), sender.accept_all(Duration::from_secs(30)));
        assert_eq!((ra.0, rb.0), (200, 200), "{} {}", ra.1, rb.1);
        acc.unwrap();

        let (au, bu) = (format!("{}/update_weights_from_distributed", a.url()), format!("{}/update_weights_from_distributed", b.url()));
        let up = request(&wire, "fp8-1");
        let wire_refs = refs(&wire);
        let (ra, rb, sent) = tokio::join!(post(&au, &up), post(&bu, &up), sender.send_bucket(&wire_refs));
        assert_eq!((ra.0, rb.0), (200, 200), "{} {}", ra.1, rb.1);
        sent.unwrap();
        for e in [&a, &b] {
            let (_, got) = post(&format!("{}/generate", e.url()), &greedy()).await;
            assert_eq!(got["output_ids"], want["output_ids"]);
            assert_eq!(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]);
            assert_eq!(got["meta_info"]["weight_version"], "fp8-1");
        }

        // Malformed FP8 updates are refused before anything is read; nothing changes.
        let w = "model.layers.0.self_attn.q_proj.weight";
        let s = "model.layers.0.self_attn.q_proj.weight_scale_inv";
        let h = cfg.hidden_size;
        let sb = h.div_ceil(BLOCK);
        let body = |names: Value, dtypes: Value, shapes: Value| json!({"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "fp8"});
        for (bad, says) in [
            (body(json!([w]), json!(["float8_e4m3fn"]), json!([[h, h]])), "without its scale"),
            (body(json!([s]), json!(["float32"]), json!([[sb, sb]])), "without its float8_e4m3fn weight"),
            (body(json!([w, s]), json!(["float8_e4m3fn", "float32"]), json!([[h, h], [1, 1]])), "needs"),
            (body(json!([w, s]), json!(["float8_e4m3fn", "float32"]), json!([[h, h + 1], [sb, sb]])), "has shape"),
            (body(json!([w, s]), json!(["bfloat16", "float32"]), json!([[h, h], [sb, sb]])), "without its float8_e4m3fn weight"),
        ] {
            let (status, err) = post(&au, &bad).await;
            assert_eq!(status, 400, "{bad} -> {err}");
            assert!(err.to_string().contains(says), "{bad} -> {err}");
        }
        // A NaN FP8 byte passes the transport but is refused on load: weights unchanged.
        let mut nan = vec![0x38u8; h * h];
        nan[5] = 0x7f;
        let scales = f32_bytes(&vec![0.01f32; sb * sb]);
        let shapes = [vec![h, h], vec![sb, sb]];
        let nan_refs = [
            TensorRef { name: w, dtype: WireDtype::F8E4M3, shape: &shapes[0], bytes: &nan },
            TensorRef { name: s, dtype: WireDtype::F32, shape: &shapes[1], bytes: &scales },
        ];
        let nan_req = json!({"names": [w, s], "dtypes": ["float8_e4m3fn", "float32"], "shapes": shapes, "group_name": "fp8", "weight_version": "nan"});
        let (ra, rb, sent) = tokio::join!(post(&au, &nan_req), post(&bu, &nan_req), sender.send_bucket(&nan_refs));
        assert_eq!((ra.0, rb.0), (400, 400), "{} {}", ra.1, rb.1);
        assert!(ra.1.to_string().contains("NaN") || ra.1.to_string().contains("nan"), "{}", ra.1);
        sent.unwrap();
        let (_, same) = post(&format!("{}/generate", a.url()), &greedy()).await;
        assert_eq!(same["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]);
        assert_eq!(same["meta_info"]["weight_version"], "fp8-1");

        // BF16 updates still work on an FP8 engine.
        let norm: Vec<u8> = vec![0.5f32; h].iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
        let shape = [h];
        let bf = [TensorRef { name: "model.norm.weight", dtype: WireDtype::Bf16, shape: &shape, bytes: &norm }];
        let up = json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[h]], "group_name": "fp8", "weight_version": "bf16-2"});
        let (ra, rb, sent) = tokio::join!(post(&au, &up), post(&bu, &up), sender.send_bucket(&bf));
        assert_eq!((ra.0, rb.0), (200, 200), "{} {}", ra.1, rb.1);
        sent.unwrap();
        let (_, after) = post(&format!("{}/generate", b.url()), &greedy()).await;
        assert_eq!(after["meta_info"]["weight_version"], "bf16-2");
        assert_ne!(after["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]);
        for e in [a, b, reference] {
            e.shutdown().await.unwrap();
        }
    })
    .await;
}
