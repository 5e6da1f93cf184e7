//! `troupe.InferenceClient`: generation through a deployment's gateway with the same client
//! the Rust rollout controller uses (a request aborted by a weight update is resubmitted with
//! its tokens so far; every token keeps the weight version that produced it). `generate` is
//! blocking with the GIL released; `troupe/__init__.py` adds the awaitable `agenerate`.

use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use troupe_controller::rollout::{InferenceClient as RustClient, SamplingSettings};

use crate::errors::ServingError;
use crate::runtime::wait;

/// A generation client for one gateway.
#[pyclass(module = "troupe", subclass, name = "InferenceClient")]
pub struct InferenceClient {
    inner: RustClient,
}

#[pymethods]
impl InferenceClient {
    /// A client for the gateway at `url` (`Service.gateway_url`).
    #[new]
    fn new(url: String) -> Self {
        InferenceClient {
            inner: RustClient::new(url),
        }
    }

    /// The gateway's URL.
    #[getter]
    fn url(&self) -> String {
        self.inner.url().to_string()
    }

    /// Generates from `input_ids`: `{"output_ids", "logprobs" (float32 arrays), "versions",
    /// "finish_reason", "resubmits"}`.
    #[pyo3(signature = (input_ids, max_new_tokens = 16, temperature = 1.0, top_p = 1.0, seed = None, stop_token_ids = Vec::new(), ignore_eos = false))]
    #[allow(clippy::too_many_arguments)]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        input_ids: Vec<u32>,
        max_new_tokens: usize,
        temperature: f32,
        top_p: f32,
        seed: Option<u64>,
        stop_token_ids: Vec<u32>,
        ignore_eos: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        if input_ids.is_empty() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "input_ids is empty: give the prompt's token ids",
            ));
        }
        if !(temperature.is_finite() && temperature >= 0.0 && top_p > 0.0 && top_p <= 1.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "temperature must be >= 0 and top_p in (0, 1]",
            ));
        }
        let s = SamplingSettings {
            max_new_tokens,
            temperature,
            top_p,
            seed,
            stop_token_ids,
            ignore_eos,
        };
        let client = self.inner.clone();
        let g = wait(py, async move { client.generate(&input_ids, &s).await })?
            .map_err(|e| ServingError::new_err(e.to_string()))?;
        let d = PyDict::new(py);
        d.set_item("output_ids", g.output_ids.into_pyarray(py))?;
        d.set_item("logprobs", g.logprobs.into_pyarray(py))?;
        d.set_item("versions", g.versions)?;
        d.set_item("finish_reason", g.finish_reason)?;
        d.set_item("resubmits", g.resubmits)?;
        Ok(d)
    }
}
