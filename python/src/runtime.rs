//! The extension's tokio runtime and the one way Python waits on it: the GIL is released while
//! the future runs, and every 100 ms the waiting thread checks for signals, so Ctrl-C raises
//! `KeyboardInterrupt` in Python and cancels the Rust work.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

fn runtime() -> PyResult<&'static Runtime> {
    static RT: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("troupe-rt")
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| {
        pyo3::exceptions::PyRuntimeError::new_err(format!("cannot start the tokio runtime: {e}"))
    })
}

/// Runs `fut` to completion on the runtime with the GIL released; Ctrl-C cancels it.
pub fn wait<F, T>(py: Python<'_>, fut: F) -> PyResult<T>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let rt = runtime()?;
    let mut task = rt.spawn(fut);
    loop {
        let done = py.detach(|| {
            rt.block_on(async { tokio::time::timeout(Duration::from_millis(100), &mut task).await })
        });
        match done {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => {
                return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "the operation panicked or was cancelled: {e}"
                )));
            }
            Err(_) => {
                if let Err(e) = py.check_signals() {
                    task.abort();
                    return Err(e);
                }
            }
        }
    }
}
