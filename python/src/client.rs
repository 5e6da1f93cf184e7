//! `troupe.InferenceClient`: generation through a deployment's gateway with the same client
//! the Rust rollout controller uses (a request aborted by a weight update is resubmitted with
//! its tokens so far; every token keeps the weight version that produced it). `generate` is
//! blocking with the GIL released; `agenerate` is the same call as an asyncio awaitable, run on
//! the Rust runtime (no thread per request).

use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use troupe_controller::rollout::{Generation, InferenceClient as RustClient, SamplingSettings};

use crate::errors::ServingError;
use crate::runtime::{awaitable, wait};

/// A generation client for one gateway.
#[pyclass(module = "troupe", name = "InferenceClient")]
pub struct InferenceClient {
    pub(crate) inner: RustClient,
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
    /// "finish_reason", "resubmits"}`. Sampling arguments: `max_new_tokens` (16),
    /// `temperature` (1.0), `top_p` (1.0), `seed`, `stop_token_ids`, `ignore_eos`, as keywords
    /// or as SGLang's `sampling_params={...}` dict.
    #[pyo3(signature = (input_ids, **sampling))]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        input_ids: Vec<u32>,
        sampling: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = settings(&input_ids, sampling)?;
        let client = self.inner.clone();
        let g = wait(py, async move { client.generate(&input_ids, &s).await })?
            .map_err(|e| ServingError::new_err(e.to_string()))?;
        to_dict(py, g)
    }

    /// `generate` as an asyncio awaitable (same arguments and result): the request runs on the
    /// Rust runtime, so thousands can be in flight from one event loop; cancelling the awaiting
    /// task cancels the request.
    #[pyo3(signature = (input_ids, **sampling))]
    fn agenerate<'py>(
        &self,
        py: Python<'py>,
        input_ids: Vec<u32>,
        sampling: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let s = settings(&input_ids, sampling)?;
        let client = self.inner.clone();
        awaitable(py, async move {
            client
                .generate(&input_ids, &s)
                .await
                .map(Answer)
                .map_err(|e| ServingError::new_err(e.to_string()))
        })
    }

    fn __repr__(&self) -> String {
        format!("InferenceClient({:?})", self.inner.url())
    }
}

/// The sampling arguments `generate` and `agenerate` take.
const SAMPLING: &str = "max_new_tokens, temperature, top_p, seed (or sampling_seed), stop_token_ids, ignore_eos, or them in a sampling_params dict";

/// Checks the sampling arguments (one rule for `generate` and `agenerate`).
fn settings(input_ids: &[u32], kw: Option<&Bound<'_, PyDict>>) -> PyResult<SamplingSettings> {
    if input_ids.is_empty() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "input_ids is empty: give the prompt's token ids",
        ));
    }
    let mut s = SamplingSettings {
        max_new_tokens: 16,
        temperature: 1.0,
        top_p: 1.0,
        seed: None,
        stop_token_ids: Vec::new(),
        ignore_eos: false,
    };
    // SGLang's shape (`sampling_params={...}`, `sampling_seed`) and keyword arguments alike.
    let mut pairs: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)> = Vec::new();
    for (k, v) in kw.into_iter().flatten() {
        if k.extract::<String>().is_ok_and(|k| k == "sampling_params") {
            let d = v.downcast::<PyDict>().map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err("sampling_params must be a dict")
            })?;
            pairs.extend(d.iter());
        } else {
            pairs.push((k, v));
        }
    }
    for (k, v) in pairs {
        let key: String = k.extract()?;
        let key = if key == "sampling_seed" {
            "seed".to_string()
        } else {
            key
        };
        let bad = |e: PyErr| {
            pyo3::exceptions::PyTypeError::new_err(format!("{key}: {}", e.value(v.py())))
        };
        match key.as_str() {
            "max_new_tokens" => s.max_new_tokens = v.extract().map_err(bad)?,
            "temperature" => s.temperature = v.extract().map_err(bad)?,
            "top_p" => s.top_p = v.extract().map_err(bad)?,
            "seed" => s.seed = v.extract().map_err(bad)?,
            "stop_token_ids" => s.stop_token_ids = v.extract().map_err(bad)?,
            "ignore_eos" => s.ignore_eos = v.extract().map_err(bad)?,
            other => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "unknown sampling argument {other:?}; use {SAMPLING}"
                )));
            }
        }
    }
    if !(s.temperature.is_finite() && s.temperature >= 0.0 && s.top_p > 0.0 && s.top_p <= 1.0) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "temperature must be >= 0 and top_p in (0, 1]",
        ));
    }
    Ok(s)
}

/// A generation on its way to asyncio: converted to the dict where the bridge already holds
/// the GIL to complete the future (one GIL acquisition per answer, not two).
struct Answer(Generation);

impl<'py> IntoPyObject<'py> for Answer {
    type Target = PyDict;
    type Output = Bound<'py, PyDict>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        to_dict(py, self.0)
    }
}

/// One generation as the dict `generate` returns.
fn to_dict(py: Python<'_>, g: Generation) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("output_ids", g.output_ids.into_pyarray(py))?;
    d.set_item("logprobs", g.logprobs.into_pyarray(py))?;
    // As strings (empty where the answer named none), as engines report them.
    let versions: Vec<String> = g
        .versions
        .iter()
        .map(|v| v.as_ref().map_or_else(String::new, ToString::to_string))
        .collect();
    d.set_item("versions", versions)?;
    d.set_item("finish_reason", g.finish_reason)?;
    d.set_item("resubmits", g.resubmits)?;
    Ok(d)
}
