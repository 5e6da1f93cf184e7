//! The `troupe` binary: everything is in [`troupe::cli`].

fn main() -> std::process::ExitCode {
    troupe::cli::main()
}
