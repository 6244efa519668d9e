//! LayerNorm forward over the rows of a row-major `[rows, n]` matrix.
//!
//! Per row, in f32 whatever the storage type:
//!   mean = sum_j x_j / n
//!   var  = sum_j (x_j - mean)^2 / n          (biased, as PyTorch)
//!   rstd = 1 / sqrt(var + eps)
//!   y_j  = (x_j - mean) * rstd * gamma_j + beta_j
//! `mean` and `rstd` are written per row for the backward.
//!
//! Versions (docs/PERF.md has the measurements):
//!   v1  one pass for the statistics (per-pack exact stats, Chan merges across packs, lanes
//!       and warps), a second pass that re-reads x (from L2 for rows that fit there) to
//!       normalize; 16-byte packs when every pointer of the row allows, else element-wise.
//!   v2  rows of up to 8 packs per rank are held in registers between the passes: x is read
//!       from memory once, all 8 loads in flight together; longer rows stream as in v1.
//!   v5  held rows take their statistics in two exact passes over registers with plain
//!       sums: no division per pack nor in the reduction tree, and two cheap reductions.
//!   v9  M2 summed by `fma`, f16/bf16 narrowed two at a time (`cvt.rn.f16x2.f32`): fewer
//!       instructions per element. (y itself stays a multiply and an add: as one fma, with
//!       gamma and beta live at once, the f32 held kernels spill at 64 registers.)

use crate::device::{fma, sqrt_rn};
use crate::element::{Element, is_pack_aligned, read_cached, write};
use crate::row::{FWD_HELD, Held, fits, for_each_chunk, values};
use crate::team::{Block, Stats, StatsTeam, Warp};

/// Normalizes rows `S::id(), S::id() + S::count(), ...`, one team per row.
///
/// # Safety
/// `x`, `y` hold `rows * n` elements; `gamma`, `beta` hold `n`; `mean`, `rstd` hold `rows`.
#[inline(always)]
unsafe fn forward_rows<T: Element, S: StatsTeam>(
    x: *const T,
    gamma: *const T,
    beta: *const T,
    y: *mut T,
    mean: *mut f32,
    rstd: *mut f32,
    rows: u32,
    n: u32,
    eps: f32,
) {
    let mut row = S::id();
    while row < rows {
        let offset = row as usize * n as usize;
        // SAFETY: the row lies inside x and y (row < rows); the caller sized gamma and beta.
        let (x_row, y_row) = unsafe { (x.add(offset), y.add(offset)) };
        let packed = is_pack_aligned(x_row)
            && is_pack_aligned(y_row)
            && is_pack_aligned(gamma)
            && is_pack_aligned(beta);
        // SAFETY: as above; `packed` was checked for every pointer the packed path reads.
        let (m, r) = unsafe {
            if packed && fits::<T, S, FWD_HELD>(n) {
                forward_row::<T, S, true, FWD_HELD>(x_row, gamma, beta, y_row, n, eps)
            } else if packed {
                forward_row::<T, S, true, 0>(x_row, gamma, beta, y_row, n, eps)
            } else {
                forward_row::<T, S, false, 0>(x_row, gamma, beta, y_row, n, eps)
            }
        };
        if S::rank() == 0 {
            // SAFETY: row < rows.
            unsafe {
                mean.add(row as usize).write(m);
                rstd.add(row as usize).write(r);
            }
        }
        row += S::count();
    }
}

/// One row, holding `HELD` packs per rank in registers; returns its (mean, rstd).
///
/// # Safety
/// As for [`forward_rows`], for one row; with `PACKED`, all four pointers 16-byte aligned;
/// with `HELD` > 0, the row [`fits`].
#[inline(always)]
unsafe fn forward_row<T: Element, S: StatsTeam, const PACKED: bool, const HELD: usize>(
    x: *const T,
    gamma: *const T,
    beta: *const T,
    y: *mut T,
    n: u32,
    eps: f32,
) -> (f32, f32) {
    // SAFETY: with HELD > 0 the row is packed and fits (the caller's guarantee).
    let held = unsafe { Held::<HELD>::load::<T, S>(x, if PACKED { n / T::PACK as u32 } else { 0 }) };

    // Pass 1: statistics, with every subtraction between numbers of the row's own scale.
    let (mean, m2) = if HELD > 0 {
        // Held rows: exactly two passes over registers, plain sums (no divisions in the
        // reductions): mean = sum x / n, then M2 = sum (x - mean)^2.
        let mut sum = 0.0;
        for_each_chunk::<T, S, PACKED, HELD>(n, |j, len, slot| {
            // SAFETY: for_each_chunk yields in-bounds chunks, whole packs only when PACKED.
            let v = unsafe { values(&held, x, j, len, slot) };
            sum += v[..len].iter().sum::<f32>();
        });
        let mean = S::sum2(sum, 0.0).0 / n as f32;
        let mut m2 = 0.0;
        for_each_chunk::<T, S, PACKED, HELD>(n, |j, len, slot| {
            // SAFETY: as above.
            let v = unsafe { values(&held, x, j, len, slot) };
            for &v in &v[..len] {
                m2 = fma(v - mean, v - mean, m2);
            }
        });
        (mean, S::sum2(m2, 0.0).0)
    } else {
        // Streamed rows: one pass over memory. Each pack's own (mean, M2) is exact in
        // registers, and Chan's merges combine them.
        let mut stats = Stats::EMPTY;
        for_each_chunk::<T, S, PACKED, HELD>(n, |j, len, slot| {
            // SAFETY: as above.
            let v = unsafe { values(&held, x, j, len, slot) };
            stats = stats.merge(Stats::of(&v[..len]));
        });
        let stats = S::reduce_stats(stats);
        (stats.mean, stats.m2)
    };
    let rstd = 1.0 / sqrt_rn(m2 / n as f32 + eps);

    // Pass 2: y = (x - mean) * rstd * gamma + beta, x from registers where held. A
    // streamed row is read again: from L2, not DRAM, while the rows in flight fit there.
    for_each_chunk::<T, S, PACKED, HELD>(n, |j, len, slot| {
        // SAFETY: as above.
        let (xv, g, b) = unsafe {
            (
                values(&held, x, j, len, slot),
                read_cached(gamma, j, len),
                read_cached(beta, j, len),
            )
        };
        let mut out = xv;
        for k in 0..len {
            out[k] = (xv[k] - mean) * rstd * g[k] + b[k];
        }
        // SAFETY: as above.
        unsafe { write(y, j, len, &out) };
    });
    (mean, rstd)
}

/// Exports the warp-per-row and block-per-row forward kernels of one storage type.
/// Both take (x, gamma, beta, y, mean, rstd, rows, n, eps).
macro_rules! forward_kernels {
    ($t:ty, $warp:ident, $block:ident) => {
        /// Forward, one warp per row (short rows).
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $warp(
            x: *const $t,
            gamma: *const $t,
            beta: *const $t,
            y: *mut $t,
            mean: *mut f32,
            rstd: *mut f32,
            rows: u32,
            n: u32,
            eps: f32,
        ) {
            // SAFETY: the host sizes every buffer as `forward_rows` requires.
            unsafe { forward_rows::<$t, Warp>(x, gamma, beta, y, mean, rstd, rows, n, eps) }
        }

        /// Forward, one block per row (long rows).
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $block(
            x: *const $t,
            gamma: *const $t,
            beta: *const $t,
            y: *mut $t,
            mean: *mut f32,
            rstd: *mut f32,
            rows: u32,
            n: u32,
            eps: f32,
        ) {
            // SAFETY: the host sizes every buffer as `forward_rows` requires.
            unsafe { forward_rows::<$t, Block>(x, gamma, beta, y, mean, rstd, rows, n, eps) }
        }
    };
}

forward_kernels!(f32, layer_norm_fwd_warp_f32, layer_norm_fwd_block_f32);
forward_kernels!(
    crate::element::F16,
    layer_norm_fwd_warp_f16,
    layer_norm_fwd_block_f16
);
forward_kernels!(
    crate::element::Bf16,
    layer_norm_fwd_warp_bf16,
    layer_norm_fwd_block_bf16
);
