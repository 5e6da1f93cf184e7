//! The `troupe` command inside the wheel: `pip install ./python` installs a `troupe` script
//! (`troupe._cli:main`) that runs the same CLI as the Rust binary, in the Python process, so a
//! fresh venv has everything the Python API starts (`troupe host`, `troupe engine`) after that
//! one command; and where the package finds that script for its clusters.

use std::path::PathBuf;
use std::process::ExitCode;

use pyo3::prelude::*;

/// Runs the `troupe` CLI with `argv` (its first item the program's name) and returns its exit
/// status. Holds no GIL while it runs (a server runs until it is signalled).
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    if let Some(me) = argv.first() {
        // Hosts and engines this command starts are the same script.
        troupe_actors::process::set_troupe_binary(PathBuf::from(me));
    }
    let code = py.detach(|| troupe::cli::main_from(argv));
    if code == ExitCode::SUCCESS {
        0
    } else if code == ExitCode::from(2) {
        2
    } else {
        1
    }
}

/// Tells the controller where the `troupe` executable is (the package finds the script its
/// wheel installed); `TROUPE_BIN` still wins.
#[pyfunction]
fn set_binary(path: PathBuf) {
    troupe_actors::process::set_troupe_binary(path);
}

/// Adds the functions.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(set_binary, m)?)?;
    Ok(())
}
