//! The `troupe` binary: everything is in [`troupe::cli`].

/// mimalloc rather than glibc's malloc: the controller and the gateway allocate and free small
/// buffers on every call they forward, and glibc's malloc was about a sixth of the controller's
/// CPU in a fleet-wide fan-out (a quarter less with mimalloc) and a tenth of the gateway's.
/// Built with `no_thp`: with mimalloc's transparent-huge-page advice its memory came in 2 MiB
/// pages and every process's RSS grew by half or more (README, *How the controller scales*).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    troupe::cli::main()
}
