//! `troupe.Trajectory` (one sampled sequence with what training needs, as numpy arrays) and
//! `troupe.pad_batch` (a list of them as the padded arrays plus masks a trainer consumes, with
//! AReaL's key names).
//!
//! A workflow's `arun_episode` returns a list of these (the samples of one prompt: a GRPO
//! group); the rollout controller keeps them together as one Rust `Trajectory` for the
//! staleness bound and hands them back with `group` set to the episode's index in the batch.

use numpy::IntoPyArray;
use numpy::ndarray::Array2;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};
use troupe_controller::rollout::Sample;
use troupe_controller::rollout::workflow::version_number;

fn value_error(msg: String) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(msg)
}

/// Token ids from a sequence or an integer array.
fn ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    let v: Vec<i64> = obj
        .extract()
        .map_err(|_| value_error(format!("{what} must be a sequence of token ids (ints)")))?;
    v.into_iter()
        .map(|t| {
            u32::try_from(t)
                .map_err(|_| value_error(format!("{what}: token id {t} is out of range")))
        })
        .collect()
}

/// Per-token weight versions: ints, or version strings as engines report them (`"3"`).
fn versions(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(v) = obj.extract::<Vec<u64>>() {
        return Ok(v);
    }
    if let Ok(v) = obj.extract::<Vec<String>>() {
        return Ok(v.iter().map(|s| version_number(s)).collect());
    }
    Err(value_error(
        "versions must be a sequence of non-negative ints or version strings".into(),
    ))
}

/// One sampled sequence: prompt, generated tokens, their rollout log-probabilities and weight
/// versions, and its reward.
#[pyclass(module = "troupe", frozen)]
#[derive(Clone)]
pub struct Trajectory {
    pub(crate) sample: Sample,
    pub(crate) group: Option<usize>,
}

impl Trajectory {
    /// A checked trajectory.
    pub fn checked(sample: Sample) -> PyResult<Self> {
        let s = &sample;
        if s.logprobs.len() != s.output_ids.len() {
            return Err(value_error(format!(
                "{} output tokens but {} logprobs: give one logprob per output token",
                s.output_ids.len(),
                s.logprobs.len()
            )));
        }
        if !(s.versions.is_empty() || s.versions.len() == s.output_ids.len()) {
            return Err(value_error(format!(
                "{} output tokens but {} versions: give one version per output token, or none",
                s.output_ids.len(),
                s.versions.len()
            )));
        }
        if !s.reward.is_finite() {
            return Err(value_error(format!("reward {} is not finite", s.reward)));
        }
        Ok(Trajectory {
            sample,
            group: None,
        })
    }

    /// A workflow's result item: a `Trajectory`, or a dict with the constructor's keys
    /// (`prompt_ids` or `input_ids`, `output_ids`, `logprobs`, `reward`, `versions`).
    pub fn from_py(obj: &Bound<'_, PyAny>) -> PyResult<Sample> {
        if let Ok(t) = obj.downcast::<Trajectory>() {
            return Ok(t.get().sample.clone());
        }
        let d = obj.downcast::<PyDict>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "expected a troupe.Trajectory or a dict, got {}",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        let get = |k: &str| d.get_item(k).ok().flatten();
        let prompt = get("prompt_ids")
            .or_else(|| get("input_ids"))
            .ok_or_else(|| value_error("a trajectory dict needs prompt_ids".into()))?;
        let need =
            |k: &str| get(k).ok_or_else(|| value_error(format!("a trajectory dict needs {k}")));
        let t = Trajectory::new(
            &prompt,
            &need("output_ids")?,
            &need("logprobs")?,
            get("reward")
                .map(|r| r.extract())
                .transpose()?
                .unwrap_or(0.0),
            get("versions").as_ref(),
        )?;
        Ok(t.sample)
    }
}

#[pymethods]
impl Trajectory {
    /// A trajectory; `versions` (one per output token) may be left out, and the rollout
    /// controller then stamps the version the episode was admitted at (a lower bound).
    #[new]
    #[pyo3(signature = (prompt_ids, output_ids, logprobs, reward = 0.0, versions = None))]
    fn new(
        prompt_ids: &Bound<'_, PyAny>,
        output_ids: &Bound<'_, PyAny>,
        logprobs: &Bound<'_, PyAny>,
        reward: f32,
        versions: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let logprobs: Vec<f32> = logprobs
            .extract()
            .map_err(|_| value_error("logprobs must be a sequence of floats".into()))?;
        Trajectory::checked(Sample {
            prompt_ids: ids(prompt_ids, "prompt_ids")?,
            output_ids: ids(output_ids, "output_ids")?,
            logprobs,
            versions: versions
                .map(self::versions)
                .transpose()?
                .unwrap_or_default(),
            reward,
        })
    }

    /// Prompt token ids (int64).
    #[getter]
    fn prompt_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        let v: Vec<i64> = self.sample.prompt_ids.iter().map(|&t| t.into()).collect();
        v.into_pyarray(py).into_any()
    }

    /// Generated token ids (int64).
    #[getter]
    fn output_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        let v: Vec<i64> = self.sample.output_ids.iter().map(|&t| t.into()).collect();
        v.into_pyarray(py).into_any()
    }

    /// Rollout log-probabilities of the generated tokens (float32).
    #[getter]
    fn logprobs<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.sample.logprobs.clone().into_pyarray(py).into_any()
    }

    /// Weight version of each generated token (int64).
    #[getter]
    fn versions<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        let v: Vec<i64> = self.sample.versions.iter().map(|&t| t as i64).collect();
        v.into_pyarray(py).into_any()
    }

    /// The reward.
    #[getter]
    fn reward(&self) -> f32 {
        self.sample.reward
    }

    /// Index of the episode (prompt) this sample belongs to within its batch: samples with the
    /// same `group` form one GRPO group. None until a rollout controller hands it out.
    #[getter]
    fn group(&self) -> Option<usize> {
        self.group
    }

    fn __len__(&self) -> usize {
        self.sample.prompt_ids.len() + self.sample.output_ids.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Trajectory(prompt={} tokens, output={} tokens, reward={}, group={})",
            self.sample.prompt_ids.len(),
            self.sample.output_ids.len(),
            self.sample.reward,
            self.group.map_or("None".to_string(), |g| g.to_string())
        )
    }
}

/// `trajectories` as right-padded arrays (AReaL's names), each row prompt then output:
/// `input_ids` int64 [B, L], `attention_mask` bool [B, L], `loss_mask` int32 [B, L] (1 on
/// generated tokens), `logprobs` float32 [B, L] (0 off the loss mask), `versions` int64 [B, L]
/// (-1 off the loss mask), `rewards` float32 [B], `prompt_lens` / `seq_lens` int64 [B], and
/// `group` int64 [B] (-1 when unset).
#[pyfunction]
#[pyo3(signature = (trajectories, pad_token_id = 0))]
fn pad_batch<'py>(
    py: Python<'py>,
    trajectories: Vec<Bound<'py, PyAny>>,
    pad_token_id: i64,
) -> PyResult<Bound<'py, PyDict>> {
    let mut rows = Vec::with_capacity(trajectories.len());
    for (i, t) in trajectories.iter().enumerate() {
        let group = t.downcast::<Trajectory>().ok().and_then(|t| t.get().group);
        let s = Trajectory::from_py(t)
            .map_err(|e| value_error(format!("trajectory {i}: {}", e.value(py))))?;
        rows.push((s, group));
    }
    let b = rows.len();
    let l = rows
        .iter()
        .map(|(s, _)| s.prompt_ids.len() + s.output_ids.len())
        .max()
        .unwrap_or(0);
    let mut input_ids = Array2::<i64>::from_elem((b, l), pad_token_id);
    let mut attention = Array2::<bool>::from_elem((b, l), false);
    let mut loss = Array2::<i32>::zeros((b, l));
    let mut logprobs = Array2::<f32>::zeros((b, l));
    let mut vers = Array2::<i64>::from_elem((b, l), -1);
    let (mut rewards, mut plens, mut slens, mut groups) = (vec![], vec![], vec![], vec![]);
    for (r, (s, g)) in rows.iter().enumerate() {
        let p = s.prompt_ids.len();
        for (j, &t) in s.prompt_ids.iter().chain(&s.output_ids).enumerate() {
            input_ids[[r, j]] = t.into();
            attention[[r, j]] = true;
        }
        for j in 0..s.output_ids.len() {
            loss[[r, p + j]] = 1;
            logprobs[[r, p + j]] = s.logprobs[j];
            vers[[r, p + j]] = s.versions.get(j).map_or(-1, |&v| v as i64);
        }
        rewards.push(s.reward);
        plens.push(p as i64);
        slens.push((p + s.output_ids.len()) as i64);
        groups.push(g.map_or(-1, |g| g as i64));
    }
    let d = PyDict::new(py);
    d.set_item("input_ids", input_ids.into_pyarray(py))?;
    d.set_item("attention_mask", attention.into_pyarray(py))?;
    d.set_item("loss_mask", loss.into_pyarray(py))?;
    d.set_item("logprobs", logprobs.into_pyarray(py))?;
    d.set_item("versions", vers.into_pyarray(py))?;
    d.set_item("rewards", rewards.into_pyarray(py))?;
    d.set_item("prompt_lens", plens.into_pyarray(py))?;
    d.set_item("seq_lens", slens.into_pyarray(py))?;
    d.set_item("group", groups.into_pyarray(py))?;
    Ok(d)
}

/// Adds `Trajectory` and `pad_batch` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Trajectory>()?;
    m.add_function(wrap_pyfunction!(pad_batch, m)?)?;
    Ok(())
}
