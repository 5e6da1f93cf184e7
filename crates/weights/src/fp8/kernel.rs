//! The hot loops: block amax and quantization over bf16 / f32 rows, multi-threaded with rayon.
//!
//! Work is split into *units* of `block_rows` rows by a column group (usually all columns: a
//! whole band of blocks, one row of scales). A unit's scales need its amax before any element
//! can be quantized, so every unit is read twice; the second read comes from cache. The first
//! read is the one that waits for memory, so each rayon task walks a contiguous range of bands
//! and takes the amax of the *next* unit while it quantizes the current one, row by row in the
//! same loop: memory streams the next band while the core divides and encodes the current one.
//! (Measured on a 2-core Zen 3 VM: as a separate pass, the amax read cost about a third of the
//! time, during which the cores did no arithmetic.)
//!
//! On x86-64 the loops are hand-written intrinsics: [`avx512`] where the CPU has AVX-512 F/BW/VL,
//! else [`avx2`]; elsewhere they are plain loops that LLVM vectorizes. All give the bytes of
//! [`encode_saturating`]; [`isa`] picks one at run time (or as `TROUPE_FP8_KERNEL` says).

use half::bf16;
use rayon::prelude::*;

use super::e4m3::{E4M3_MAX, encode_saturating};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod isa;

pub(crate) use isa::Isa;
pub use isa::{KERNEL_ENV, Kernel, with_kernel};

/// Abs-value bit patterns at or above this are infinities or NaN.
pub(crate) const NON_FINITE_BITS: u32 = 0x7F80_0000;

/// Most input bytes of one unit: a 128-row band of a 14336-wide bf16 matrix (3.5 MiB) is one
/// unit; wider bands are cut into equal column groups, so that a unit and the next one (about
/// 2 x 4 MiB per thread) stay in the last-level cache between their two reads.
const GROUP_BYTES: usize = 4 * 1024 * 1024;

/// How far ahead of its loads the SIMD loops prefetch the next unit (read from memory) and the
/// current one (read back from the last-level cache), in bytes. Measured on a 2-core Intel VM
/// (Sapphire Rapids class): 0.65 of memcpy without prefetches, ~0.85 with 1 KiB, ~0.95 with
/// these; closer than 1 KiB loses, farther gains nothing.
#[cfg(target_arch = "x86_64")]
const PREFETCH_NEXT_BYTES: usize = 4096;
#[cfg(target_arch = "x86_64")]
const PREFETCH_SRC_BYTES: usize = 2048;

/// Elements per rayon task for whole-tensor passes (per-tensor scales).
const FLAT_CHUNK: usize = 1 << 16;

/// A weight element the kernels read: bf16 or f32, widened to f32 exactly as `x.float()` does.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    /// The largest `|x|` of `run` as f32 bits; `>= NON_FINITE_BITS` if any element is inf/NaN.
    ///
    /// For finite values the integer order of abs bit patterns is the order of magnitudes, so
    /// this is an integer max (SIMD friendly) that also detects non-finite values for free.
    fn abs_max_bits(run: &[Self]) -> u32;

    /// The element as f32 (exact for both bf16 and f32).
    fn widen(self) -> f32;

    /// `dst[i] = encode_saturating(src[i] / scale)`, and the `abs_max_bits` of `next` (0 for
    /// `None`), read in the same loop when it is as long as `src`.
    ///
    /// `scale` must come from the amax of a set holding `src` ([`ScaleRule::scale`]): the AVX2
    /// loops rely on `|src[i]| / scale <= 464` instead of clamping.
    fn quantize_run(
        isa: Isa,
        src: &[Self],
        dst: &mut [u8],
        scale: f32,
        next: Option<&[Self]>,
    ) -> u32;

    /// [`Element::quantize_run`] over a row segment of whole blocks: block `j` (`block_cols`
    /// wide, the last one may be shorter) with `scales[j]`, raising `amax[j]` to the
    /// `abs_max_bits` of `next` in block `j`. `next` is as long as `src` or `None`.
    #[inline(always)]
    fn quantize_row(
        isa: Isa,
        src: &[Self],
        dst: &mut [u8],
        scales: &[f32],
        block_cols: usize,
        next: Option<&[Self]>,
        amax: &mut [u32],
    ) {
        row_by_runs(isa, src, dst, scales, block_cols, next, amax);
    }
}

/// [`Element::quantize_row`] as one [`Element::quantize_run`] per block.
#[inline(always)]
fn row_by_runs<E: Element>(
    isa: Isa,
    src: &[E],
    dst: &mut [u8],
    scales: &[f32],
    block_cols: usize,
    next: Option<&[E]>,
    amax: &mut [u32],
) {
    let mut next_runs = next.map(|n| n.chunks(block_cols));
    for (((run, q), &scale), a) in src
        .chunks(block_cols)
        .zip(dst.chunks_mut(block_cols))
        .zip(scales)
        .zip(amax.iter_mut())
    {
        let next_run = next_runs.as_mut().and_then(Iterator::next);
        *a = (*a).max(E::quantize_run(isa, run, q, scale, next_run));
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn abs_max_bits(run: &[Self]) -> u32 {
        // 15-bit magnitudes fit a signed i16, whose max is a single SSE2 instruction.
        let key = run
            .iter()
            .fold(0i16, |m, x| m.max((x.to_bits() & 0x7FFF) as i16));
        (key as u32) << 16
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[inline(always)]
    fn quantize_run(
        isa: Isa,
        src: &[Self],
        dst: &mut [u8],
        scale: f32,
        next: Option<&[Self]>,
    ) -> u32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(cpu) => avx2::quantize_bf16(cpu, src, dst, scale, next),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(cpu) => avx512::quantize_bf16(cpu, src, dst, scale, next),
            Isa::Portable => portable_run(src, dst, scale, next),
        }
    }

    #[inline(always)]
    fn quantize_row(
        isa: Isa,
        src: &[Self],
        dst: &mut [u8],
        scales: &[f32],
        block_cols: usize,
        next: Option<&[Self]>,
        amax: &mut [u32],
    ) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(cpu) if block_cols.is_multiple_of(avx2::STEP) => {
                avx2::quantize_bf16_row(cpu, src, dst, scales, block_cols, next, amax);
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(cpu) if block_cols.is_multiple_of(avx512::STEP) => {
                avx512::quantize_bf16_row(cpu, src, dst, scales, block_cols, next, amax);
            }
            _ => row_by_runs(isa, src, dst, scales, block_cols, next, amax),
        }
    }
}

impl Element for f32 {
    #[inline(always)]
    fn abs_max_bits(run: &[Self]) -> u32 {
        let key = run
            .iter()
            .fold(0i32, |m, x| m.max((x.to_bits() & 0x7FFF_FFFF) as i32));
        key as u32
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[inline(always)]
    fn quantize_run(
        isa: Isa,
        src: &[Self],
        dst: &mut [u8],
        scale: f32,
        next: Option<&[Self]>,
    ) -> u32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(cpu) => avx2::quantize_f32(cpu, src, dst, scale, next),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(cpu) => avx512::quantize_f32(cpu, src, dst, scale, next),
            Isa::Portable => portable_run(src, dst, scale, next),
        }
    }
}

/// The portable [`Element::quantize_run`].
///
/// The division is a real f32 division (not a multiply by `1 / scale`), as in PyTorch, so the
/// rounding of `x / scale` and therefore every byte matches.
#[inline(always)]
fn portable_run<E: Element>(src: &[E], dst: &mut [u8], scale: f32, next: Option<&[E]>) -> u32 {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = encode_saturating(x.widen() / scale);
    }
    next.map_or(0, E::abs_max_bits)
}

/// A non-finite value was found; the caller locates it for the error message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FoundNonFinite;

/// How a scale is derived from a block's amax.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScaleRule {
    /// Lower bound on amax, so all-zero blocks get a usable (tiny) scale.
    pub eps: f32,
    /// Round the scale to bf16 before using it, so `q * stored_scale` is the exact inverse.
    pub round_to_bf16: bool,
}

impl ScaleRule {
    /// `max(amax, eps) / 448`, computed in f32 like PyTorch does, optionally rounded to bf16.
    ///
    /// Any `|x| <= amax` then has `|x| / scale <= 448 * (1 + 2^-8)`: at most 2^-24 below
    /// `amax / 448` from the f32 division and 2^-9 from the bf16 rounding.
    #[inline(always)]
    pub fn scale(self, amax_bits: u32) -> f32 {
        let amax = f32::from_bits(amax_bits);
        let scale = (if amax > self.eps { amax } else { self.eps }) / E4M3_MAX;
        if self.round_to_bf16 {
            bf16::from_f32(scale).to_f32()
        } else {
            scale
        }
    }
}

/// The shape of the matrix and of its blocks, shared by every unit.
#[derive(Debug, Clone, Copy)]
struct Layout {
    cols: usize,
    block_rows: usize,
    block_cols: usize,
    /// Blocks per unit (the last unit of a band may have fewer).
    group_blocks: usize,
    rule: ScaleRule,
}

impl Layout {
    fn new<E>(cols: usize, block: (usize, usize), rule: ScaleRule, group_bytes: usize) -> Self {
        let (block_rows, block_cols) = block;
        let scale_cols = cols.div_ceil(block_cols);
        let band_bytes = block_rows * cols * std::mem::size_of::<E>();
        let groups = band_bytes
            .div_ceil(group_bytes.max(1))
            .clamp(1, scale_cols.max(1));
        Self {
            cols,
            block_rows,
            block_cols,
            group_blocks: scale_cols.div_ceil(groups).max(1),
            rule,
        }
    }

    fn scale_cols(self) -> usize {
        self.cols.div_ceil(self.block_cols)
    }
}

/// One unit: rows `rows` of a band (the band's offset into the task's slice), block columns
/// `blocks` (scale indices within a row of scales).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Unit {
    band: usize,
    rows: usize,
    first_block: usize,
    blocks: usize,
}

impl Unit {
    /// The units of `len` elements of whole bands, in memory order (band by band).
    fn all(layout: Layout, len: usize) -> impl Iterator<Item = Unit> {
        let band_len = layout.block_rows * layout.cols;
        let scale_cols = layout.scale_cols();
        (0..len.div_ceil(band_len)).flat_map(move |band| {
            let rows = (len - band * band_len).min(band_len) / layout.cols;
            (0..scale_cols)
                .step_by(layout.group_blocks)
                .map(move |first_block| Unit {
                    band,
                    rows,
                    first_block,
                    blocks: layout.group_blocks.min(scale_cols - first_block),
                })
        })
    }

    /// Columns `c0..c1` of the unit.
    fn cols(self, layout: Layout) -> (usize, usize) {
        let c0 = self.first_block * layout.block_cols;
        (c0, (c0 + self.blocks * layout.block_cols).min(layout.cols))
    }

    /// Columns in the unit.
    fn width(self, layout: Layout) -> usize {
        let (c0, c1) = self.cols(layout);
        c1 - c0
    }

    /// Row `r` of the unit in `src` (the task's slice of whole bands).
    fn row<T>(self, layout: Layout, src: &[T], r: usize) -> &[T] {
        let (c0, c1) = self.cols(layout);
        let start = (self.band * layout.block_rows + r) * layout.cols;
        &src[start + c0..start + c1]
    }
}

/// The amax of every block of `unit`, read on its own (the first unit of a task).
#[inline(always)]
fn unit_amax<E: Element>(layout: Layout, src: &[E], unit: Unit, amax: &mut [u32]) {
    amax.fill(0);
    for r in 0..unit.rows {
        let row = unit.row(layout, src, r);
        for (a, run) in amax.iter_mut().zip(row.chunks(layout.block_cols)) {
            *a = (*a).max(E::abs_max_bits(run));
        }
    }
}

/// Quantizes a slice of whole bands, unit after unit, fusing each unit's quantization with the
/// amax of the next one whenever both have the same columns.
#[inline(always)]
fn quantize_range<E: Element>(
    isa: Isa,
    layout: Layout,
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
) -> Result<(), FoundNonFinite> {
    let scale_cols = layout.scale_cols();
    let mut amax = vec![0u32; layout.group_blocks];
    let mut next_amax = vec![0u32; layout.group_blocks];
    let mut units = Unit::all(layout, src.len()).peekable();
    if let Some(&first) = units.peek() {
        unit_amax(layout, src, first, &mut amax[..first.blocks]);
    }
    while let Some(unit) = units.next() {
        let next = units.peek().copied();
        let row_scales = &mut scales[unit.band * scale_cols..][..scale_cols];
        let unit_scales = &mut row_scales[unit.first_block..][..unit.blocks];
        for (a, s) in amax.iter().zip(unit_scales.iter_mut()) {
            if *a >= NON_FINITE_BITS {
                return Err(FoundNonFinite);
            }
            *s = layout.rule.scale(*a);
        }
        // Equal column ranges have equal block partitions, so runs pair up one to one; the next
        // band may only have fewer rows (the last band of the matrix).
        let fused = next.filter(|n| n.width(layout) == unit.width(layout));
        next_amax.fill(0);
        let (c0, c1) = unit.cols(layout);
        for r in 0..unit.rows {
            let start = (unit.band * layout.block_rows + r) * layout.cols;
            let row = &src[start + c0..start + c1];
            let out = &mut dst[start + c0..start + c1];
            let next_row = fused.filter(|n| r < n.rows).map(|n| n.row(layout, src, r));
            let slots = &mut next_amax[..unit.blocks];
            E::quantize_row(
                isa,
                row,
                out,
                unit_scales,
                layout.block_cols,
                next_row,
                slots,
            );
        }
        if let (Some(n), None) = (next, fused) {
            unit_amax(layout, src, n, &mut next_amax[..n.blocks]);
        }
        std::mem::swap(&mut amax, &mut next_amax);
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_range_avx2<E: Element>(
    cpu: avx2::Avx2,
    layout: Layout,
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
) -> Result<(), FoundNonFinite> {
    quantize_range(Isa::Avx2(cpu), layout, src, dst, scales)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
fn quantize_range_avx512<E: Element>(
    cpu: avx512::Avx512,
    layout: Layout,
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
) -> Result<(), FoundNonFinite> {
    quantize_range(Isa::Avx512(cpu), layout, src, dst, scales)
}

/// [`quantize_range`] compiled for the chosen instruction set (SIMD code inlines only into
/// functions with the same target features, so the range loop is instantiated per set).
fn range_dispatch<E: Element>(
    isa: Isa,
    layout: Layout,
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
) -> Result<(), FoundNonFinite> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx2` token exists only on CPUs with AVX2.
        Isa::Avx2(cpu) => unsafe { quantize_range_avx2(cpu, layout, src, dst, scales) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx512` token exists only on CPUs with AVX-512 F/BW/VL (and AVX2).
        Isa::Avx512(cpu) => unsafe { quantize_range_avx512(cpu, layout, src, dst, scales) },
        Isa::Portable => quantize_range(isa, layout, src, dst, scales),
    }
}

/// Block-wise quantization of a row-major `rows x cols` matrix (both non-zero).
///
/// `dst` holds `rows * cols` bytes, `scales` `ceil(rows / block_rows) * ceil(cols / block_cols)`.
pub(crate) fn quantize_blocks<E: Element>(
    isa: Isa,
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
    cols: usize,
    block: (usize, usize),
    rule: ScaleRule,
) -> Result<(), FoundNonFinite> {
    let tasks = rayon::current_num_threads();
    quantize_blocks_with(isa, src, dst, scales, cols, block, rule, tasks, GROUP_BYTES)
}

/// [`quantize_blocks`] with its tuning made explicit (for tests): the bands are cut into
/// `tasks` contiguous ranges, one rayon task each, so that each task can carry the next unit's
/// amax from band to band (one task per thread: more tasks only add unfused first units).
#[allow(clippy::too_many_arguments)]
fn quantize_blocks_with<E: Element>(
    isa: Isa,
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
    cols: usize,
    block: (usize, usize),
    rule: ScaleRule,
    tasks: usize,
    group_bytes: usize,
) -> Result<(), FoundNonFinite> {
    let layout = Layout::new::<E>(cols, block, rule, group_bytes);
    let band_len = block.0 * cols;
    let bands = src.len().div_ceil(band_len.max(1));
    let per_task = bands.div_ceil(tasks.clamp(1, bands.max(1))).max(1);
    src.par_chunks(per_task * band_len)
        .zip(dst.par_chunks_mut(per_task * band_len))
        .zip(scales.par_chunks_mut(per_task * layout.scale_cols()))
        .try_for_each(|((s, d), sc)| range_dispatch(isa, layout, s, d, sc))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn abs_max_bits_avx2<E: Element>(run: &[E]) -> u32 {
    E::abs_max_bits(run)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
fn abs_max_bits_avx512<E: Element>(run: &[E]) -> u32 {
    E::abs_max_bits(run)
}

fn abs_max_dispatch<E: Element>(isa: Isa, run: &[E]) -> u32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx2` token exists only on CPUs with AVX2.
        Isa::Avx2(_) => unsafe { abs_max_bits_avx2(run) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx512` token exists only on CPUs with AVX-512 F/BW/VL.
        Isa::Avx512(_) => unsafe { abs_max_bits_avx512(run) },
        Isa::Portable => E::abs_max_bits(run),
    }
}

/// Per-tensor quantization: one scale for the whole (non-empty) tensor, returned.
pub(crate) fn quantize_tensor<E: Element>(
    isa: Isa,
    src: &[E],
    dst: &mut [u8],
    rule: ScaleRule,
) -> Result<f32, FoundNonFinite> {
    let amax_bits = src
        .par_chunks(FLAT_CHUNK)
        .map(|run| abs_max_dispatch(isa, run))
        .max()
        .unwrap_or(0);
    if amax_bits >= NON_FINITE_BITS {
        return Err(FoundNonFinite);
    }
    let scale = rule.scale(amax_bits);
    src.par_chunks(FLAT_CHUNK)
        .zip(dst.par_chunks_mut(FLAT_CHUNK))
        .for_each(|(s, d)| {
            E::quantize_run(isa, s, d, scale, None);
        });
    Ok(scale)
}

/// Index of the first non-finite element (the slow path behind an error message).
pub(crate) fn first_non_finite<E: Element>(src: &[E]) -> Option<(usize, f32)> {
    src.iter()
        .position(|x| !x.widen().is_finite())
        .map(|i| (i, src[i].widen()))
}

#[cfg(test)]
mod tests;
