//! The extension's tokio runtime and the two ways Python waits on it: [`wait`] blocks with the
//! GIL released, and every 100 ms the waiting thread checks for signals, so Ctrl-C raises
//! `KeyboardInterrupt` in Python and cancels the Rust work; [`awaitable`] hands asyncio a
//! future (pyo3-async-runtimes on this same runtime), so coroutines await Rust work natively and
//! cancelling the asyncio task cancels it.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

fn runtime() -> PyResult<&'static Runtime> {
    static RT: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("troupe-rt")
            .build()
            .map_err(|e| e.to_string())?;
        Ok(rt)
    })
    .as_ref()
    .inspect(|rt| {
        static BRIDGED: OnceLock<()> = OnceLock::new();
        BRIDGED.get_or_init(|| {
            // The asyncio bridge runs its futures on this runtime (one runtime per process).
            let _ = pyo3_async_runtimes::tokio::init_with_runtime(rt);
        });
    })
    .map_err(|e| {
        pyo3::exceptions::PyRuntimeError::new_err(format!("cannot start the tokio runtime: {e}"))
    })
}

/// Runs `f` inside the runtime's context (what spawns tasks from a Python thread need).
pub fn enter<T>(f: impl FnOnce() -> T) -> PyResult<T> {
    let _guard = runtime()?.enter();
    Ok(f())
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

/// `fut` as an asyncio awaitable on the running event loop; the result is built with the GIL
/// held. Cancelling the asyncio task drops `fut`.
pub fn awaitable<'py, F, T>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    runtime()?;
    pyo3_async_runtimes::tokio::future_into_py(py, fut)
}
