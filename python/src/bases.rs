//! `troupe.SenderBases` and `troupe.ReceiverBases`: what each end of a delta weight broadcast
//! holds between updates, as objects that outlive a group. A trainer re-creates its group when
//! the fleet changes (an engine joins, one is re-placed); handing the new `TcpWeightSender` and
//! each engine's new `TcpWeightReceiver` the bases the old ones used keeps the next update a
//! delta for the engines that kept theirs (an engine whose bases differ from the sender's gets
//! tensors whole until it holds them: the digests exchanged at join decide).

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use troupe_weights::delta;

/// The sender's copy of what it last sent (one BF16 copy of the weights), kept across groups.
#[pyclass(module = "troupe", frozen)]
pub struct SenderBases {
    pub(crate) inner: Arc<Mutex<delta::SenderBases>>,
}

#[pymethods]
impl SenderBases {
    /// Empty bases: the first bucket sent with them goes whole.
    #[new]
    fn new() -> Self {
        SenderBases {
            inner: Arc::new(Mutex::new(delta::SenderBases::new(false))),
        }
    }

    /// Bytes held (the memory cost of delta updates on the trainer).
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.lock().map_or(0, |b| b.bytes())
    }
}

/// An engine's received tensors, kept as the bases of the next deltas, across groups.
#[pyclass(module = "troupe", frozen)]
pub struct ReceiverBases {
    pub(crate) inner: delta::SharedReceiverBases,
}

#[pymethods]
impl ReceiverBases {
    /// Empty bases: this engine gets every tensor whole until it holds it.
    #[new]
    fn new() -> Self {
        ReceiverBases {
            inner: delta::ReceiverBases::shared(),
        }
    }

    /// Tensors held.
    fn __len__(&self) -> usize {
        self.inner.lock().map_or(0, |b| b.len())
    }

    /// Bytes held (tensors handed to the engine and not back yet excluded).
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.lock().map_or(0, |b| b.bytes())
    }
}

/// Adds the bases to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SenderBases>()?;
    m.add_class::<ReceiverBases>()?;
    Ok(())
}
