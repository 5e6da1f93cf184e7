//! `cluster.spawn_trainer(...)`: the built-in reference trainer as a remote actor (AReaL-lite's
//! `TrainController` shape): `train_batch(samples)` runs one clipped policy-gradient step,
//! `get_weights()` returns the weights as numpy float32 arrays (Hugging Face names), ready for
//! `Service.update_weights`.

use numpy::{IntoPyArray, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};
use troupe_controller::ActorHandle;
use troupe_controller::run::trainer_actor::{GetWeights, TrainStep, TrainerActor, WireSample};

use troupe_serving::control_plane::HostTensor;

use crate::errors::call_error;
use crate::runtime::wait;
use crate::trajectory::Trajectory;

/// A trainer actor on one of the cluster's hosts.
#[pyclass(module = "troupe")]
pub struct Trainer {
    pub(crate) actor: ActorHandle<TrainerActor>,
}

/// One training sample: a dict with `prompt_ids`, `output_ids`, `logprobs` and `advantage`,
/// or a `Trajectory` (or a dict without `advantage`) when `advantage` is given separately.
fn sample(d: &Bound<'_, PyAny>, advantage: Option<f32>) -> PyResult<WireSample> {
    if let Ok(t) = d.downcast::<Trajectory>() {
        let s = &t.get().sample;
        let advantage = advantage.ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(
                "a Trajectory carries no advantage: pass train_batch(batch, advantages=[...])",
            )
        })?;
        return Ok(WireSample {
            prompt_ids: s.prompt_ids.clone(),
            output_ids: s.output_ids.clone(),
            logprobs: s.logprobs.clone(),
            advantage,
        });
    }
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
        advantage: match advantage {
            Some(a) => a,
            None => get("advantage")?.extract()?,
        },
    };
    if s.logprobs.len() != s.output_ids.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "a sample has {} output tokens but {} logprobs; give one logprob per output token",
            s.output_ids.len(),
            s.logprobs.len()
        )));
    }
    if !s.advantage.is_finite() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "advantage {} is not finite",
            s.advantage
        )));
    }
    Ok(s)
}

impl Trainer {
    /// The trainer's weights as update tensors (for `Service.update_weights_from`).
    pub(crate) fn host_tensors(&self, py: Python<'_>) -> PyResult<Vec<HostTensor>> {
        let actor = self.actor.clone();
        let ws = wait(py, async move { actor.call(GetWeights).await })?.map_err(call_error)?;
        Ok(ws.into_iter().map(HostTensor::from).collect())
    }
}

#[pymethods]
impl Trainer {
    /// One GRPO step on `samples`: dicts with `prompt_ids`, `output_ids`, `logprobs`,
    /// `advantage`, or `Trajectory` objects with `advantages` (one per sample) given apart.
    /// Returns the step's report.
    #[pyo3(signature = (samples, advantages = None))]
    fn train_batch<'py>(
        &self,
        py: Python<'py>,
        samples: Vec<Bound<'py, PyAny>>,
        advantages: Option<Vec<f32>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        if let Some(a) = &advantages
            && a.len() != samples.len()
        {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{} samples but {} advantages; give one advantage per sample",
                samples.len(),
                a.len()
            )));
        }
        let samples: Vec<WireSample> = samples
            .iter()
            .enumerate()
            .map(|(i, s)| sample(s, advantages.as_ref().map(|a| a[i])))
            .collect::<PyResult<_>>()?;
        let actor = self.actor.clone();
        let r = wait(py, async move { actor.call(TrainStep { samples }).await })?
            .map_err(call_error)?;
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
        let ws = wait(py, async move { actor.call(GetWeights).await })?.map_err(call_error)?;
        let d = PyDict::new(py);
        for w in ws {
            let arr = w.data.into_pyarray(py).reshape(w.shape.clone())?;
            d.set_item(w.name, arr)?;
        }
        Ok(d)
    }
}
