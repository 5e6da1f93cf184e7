//! `cluster.spawn_trainer(...)`: the built-in reference trainer as a remote actor (AReaL-lite's
//! `TrainController` shape): `train_batch(samples)` runs one clipped policy-gradient step,
//! `get_weights()` returns the weights as numpy float32 arrays (Hugging Face names), ready for
//! `Service.update_weights`.

use numpy::{IntoPyArray, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};
use troupe_controller::ActorHandle;
use troupe_controller::run::trainer_actor::{GetWeights, TrainStep, TrainerActor, WireSample};

use crate::errors::TroupeError;
use crate::runtime::wait;

/// A trainer actor on one of the cluster's hosts.
#[pyclass(module = "troupe")]
pub struct Trainer {
    pub(crate) actor: ActorHandle<TrainerActor>,
}

fn sample(d: &Bound<'_, PyAny>) -> PyResult<WireSample> {
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(k).map_err(|_| {
            pyo3::exceptions::PyKeyError::new_err(format!(
                "a sample needs `{k}` (prompt_ids, output_ids, logprobs, advantage)"
            ))
        })
    };
    let s = WireSample {
        prompt_ids: get("prompt_ids")?.extract()?,
        output_ids: get("output_ids")?.extract()?,
        logprobs: get("logprobs")?.extract()?,
        advantage: get("advantage")?.extract()?,
    };
    if s.logprobs.len() != s.output_ids.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "a sample has {} output tokens but {} logprobs; give one logprob per output token",
            s.output_ids.len(),
            s.logprobs.len()
        )));
    }
    Ok(s)
}

#[pymethods]
impl Trainer {
    /// One GRPO step on `samples` (dicts with `prompt_ids`, `output_ids`, `logprobs`,
    /// `advantage`); returns the step's report.
    fn train_batch<'py>(
        &self,
        py: Python<'py>,
        samples: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let samples: Vec<WireSample> = samples.iter().map(sample).collect::<PyResult<_>>()?;
        let actor = self.actor.clone();
        let r = wait(py, async move { actor.call(TrainStep { samples }).await })?
            .map_err(|e| TroupeError::new_err(e.to_string()))?;
        let d = PyDict::new(py);
        d.set_item("step", r.step)?;
        d.set_item("loss", r.loss)?;
        d.set_item("mean_ratio", r.mean_ratio)?;
        d.set_item("clip_fraction", r.clip_fraction)?;
        d.set_item("tokens", r.tokens)?;
        d.set_item("seconds", r.seconds)?;
        Ok(d)
    }

    /// The current weights: `{name: float32 array}`.
    fn get_weights<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let actor = self.actor.clone();
        let ws = wait(py, async move { actor.call(GetWeights).await })?
            .map_err(|e| TroupeError::new_err(e.to_string()))?;
        let d = PyDict::new(py);
        for w in ws {
            let arr = w.data.into_pyarray(py).reshape(w.shape.clone())?;
            d.set_item(w.name, arr)?;
        }
        Ok(d)
    }
}
