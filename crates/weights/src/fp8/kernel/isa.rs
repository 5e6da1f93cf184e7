//! Which quantizer loops run: the fastest this CPU has, unless an override names another.
//!
//! Every kernel gives the same bytes (the tests hold each one to the scalar encoder), so the
//! choice is only about speed; the overrides exist to measure and test each path on one machine:
//! `TROUPE_FP8_KERNEL=scalar|avx2|avx512` for a process, [`with_kernel`] for a closure.

use std::cell::Cell;
use std::str::FromStr;
use std::sync::OnceLock;

use super::super::error::Fp8Error;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};

/// The environment variable that picks a kernel for the whole process.
pub const KERNEL_ENV: &str = "TROUPE_FP8_KERNEL";

/// One implementation of the quantizer's loops.
///
/// Public so that benchmarks can say which one they measured and tests can force each one; the
/// output never depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Plain Rust loops, vectorized by the compiler for the build target: every CPU.
    Scalar,
    /// Hand-written AVX2 loops, 256-bit (x86-64 CPUs with AVX2).
    Avx2,
    /// Hand-written AVX-512 loops, 512-bit (x86-64 CPUs with AVX-512 F, BW and VL).
    Avx512,
}

impl Kernel {
    /// Every kernel, slowest first.
    pub const ALL: [Kernel; 3] = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512];

    /// The name `TROUPE_FP8_KERNEL` and the benchmark's `fp8.kernel` line use.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
        }
    }

    /// Whether this CPU runs the kernel (the scalar one runs everywhere).
    pub fn is_supported(self) -> bool {
        Isa::of(self).is_some()
    }

    /// The kernels this CPU runs, slowest first: what a test should cover on this machine.
    pub fn supported() -> Vec<Kernel> {
        Kernel::ALL
            .into_iter()
            .filter(|k| k.is_supported())
            .collect()
    }

    /// The fastest kernel this CPU runs.
    pub fn best() -> Kernel {
        Isa::best().kernel()
    }

    /// The kernel a quantization started now on this thread uses: the one [`with_kernel`] set,
    /// else the one `TROUPE_FP8_KERNEL` names, else [`Kernel::best`]. An override that names no
    /// kernel, or one this CPU lacks, is an error rather than a silent fallback.
    pub fn active() -> Result<Kernel, Fp8Error> {
        Isa::active().map(Isa::kernel)
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Kernel {
    type Err = Fp8Error;

    /// Parses a [`Kernel::name`] (ASCII case-insensitive, surrounding spaces ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim();
        Kernel::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(wanted))
            .ok_or_else(|| Fp8Error::UnknownKernel {
                requested: s.to_owned(),
            })
    }
}

thread_local! {
    /// The kernel [`with_kernel`] forces on this thread while its closure runs.
    static FORCED: Cell<Option<Kernel>> = const { Cell::new(None) };
}

/// Runs `f` with every quantization it starts on this thread using `kernel`, so a test can hold
/// each kernel this CPU has to the same expectations. Errors (without running `f`) when the CPU
/// lacks `kernel`.
pub fn with_kernel<R>(kernel: Kernel, f: impl FnOnce() -> R) -> Result<R, Fp8Error> {
    if !kernel.is_supported() {
        return Err(unsupported(kernel));
    }
    /// Restores the previous choice even if `f` panics.
    struct Restore(Option<Kernel>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|c| c.replace(Some(kernel))));
    Ok(f())
}

fn unsupported(kernel: Kernel) -> Fp8Error {
    Fp8Error::KernelUnsupported {
        kernel: kernel.name(),
        supported: Kernel::supported()
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// `TROUPE_FP8_KERNEL` as read once per process (`None` when unset or empty).
fn env_choice() -> Result<Option<Kernel>, Fp8Error> {
    static CHOICE: OnceLock<Option<String>> = OnceLock::new();
    let raw = CHOICE.get_or_init(|| std::env::var(KERNEL_ENV).ok());
    match raw.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(name) => name.parse().map(Some),
    }
}

/// How runs are quantized, with the proof that the CPU has the instructions they use.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Isa {
    /// Plain Rust loops, vectorized by LLVM for the build target.
    Portable,
    /// Hand-written AVX2 loops (x86-64 CPUs that have AVX2).
    #[cfg(target_arch = "x86_64")]
    Avx2(avx2::Avx2),
    /// Hand-written AVX-512 loops (x86-64 CPUs with AVX-512 F, BW and VL).
    #[cfg(target_arch = "x86_64")]
    Avx512(avx512::Avx512),
}

impl Isa {
    /// The loops of `kernel`, if this CPU runs them.
    pub(crate) fn of(kernel: Kernel) -> Option<Self> {
        match kernel {
            Kernel::Scalar => Some(Self::Portable),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::Avx2::detect().map(Self::Avx2),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => avx512::Avx512::detect().map(Self::Avx512),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx2 | Kernel::Avx512 => None,
        }
    }

    /// The fastest loops this CPU runs.
    pub(crate) fn best() -> Self {
        Kernel::ALL
            .into_iter()
            .rev()
            .find_map(Self::of)
            .unwrap_or(Self::Portable)
    }

    /// The loops [`Kernel::active`] names.
    pub(crate) fn active() -> Result<Self, Fp8Error> {
        let chosen = match FORCED.with(Cell::get) {
            Some(k) => Some(k),
            None => env_choice()?,
        };
        match chosen {
            None => Ok(Self::best()),
            Some(k) => Self::of(k).ok_or_else(|| unsupported(k)),
        }
    }

    /// Every set of loops this CPU runs (for tests).
    #[cfg(test)]
    pub(crate) fn all_supported() -> Vec<Self> {
        Kernel::ALL.into_iter().filter_map(Self::of).collect()
    }

    /// The public name of these loops.
    pub(crate) fn kernel(self) -> Kernel {
        match self {
            Self::Portable => Kernel::Scalar,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2(_) => Kernel::Avx2,
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(_) => Kernel::Avx512,
        }
    }
}
