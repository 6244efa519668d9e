//! LayerNorm and RMSNorm forward over the rows of a row-major `[rows, n]` matrix.
//!
//! Per row, in f32 whatever the storage type:
//!   mean = sum_j x_j / n
//!   var  = sum_j (x_j - mean)^2 / n          (biased, as PyTorch)
//!   rstd = 1 / sqrt(var + eps)
//!   y_j  = (x_j - mean) * rstd * (gamma_j + gamma_offset) + beta_j
//! (`gamma_offset` 1 for zero-centred weights, else -0: see [`Affine`]). `mean` and `rstd`
//! are written per row for the backward. RMSNorm (`CENTERED` = false, the
//! `rms_norm_fwd_*` kernels) has no mean to take and no beta:
//!   rstd = 1 / sqrt(sum_j x_j^2 / n + eps)
//!   y_j  = x_j * rstd * gamma_j
//! and writes 0 as the mean, so the backward's xhat is x_j * rstd. Its held and staged
//! rows sum x_j^2 in one pass and one reduction (every term non-negative: nothing cancels),
//! where LayerNorm's take the mean first and then M2 about it; its xhat is one multiply,
//! and its y reads no beta. Each instruction an element counts: 16-bit rows of N = 2048 to
//! 16384 are bound by the instructions issued more than by the bytes (docs/PERF.md, v29).
//!
//! With a residual (a pre-norm block's stream, `Forward::residual`), the row normalized is
//!   s_j = x_j + residual_j   (in f32, rounded once to the storage type)
//! which the kernel also writes out (`sum`): the next block's residual, and the backward's x.
//!
//! A row whose sums overflow f32 (|x_j - mean| past about 1.8e19: M2 = inf, or a mean past
//! f32's range) takes its statistics again on x_j * 2^-81, with var and rstd in f64 (see
//! [`RowNorm`]); y is computed in halves so that x_j - mean cannot overflow. Where M2 is
//! finite, the results are the plain formulas' to the bit.
//!
//! The kernels, `<norm>_fwd_<kind>_<types>` for the type pairs of x and the weights (f32,
//! f16, bf16, and f16 or bf16 x with f32 weights: `f16_f32w`, `bf16_f32w`). Each team (a
//! warp, or a block) normalizes one row at a time, rows `id, id + teams, ...`; the host
//! (host/gpu/layer_norm.rs) picks per launch:
//! - the team: a warp per row for n <= 1024, a block per row beyond (about 4 packs a
//!   thread);
//! - `few_rows` ([`forward_few_rows`]) for launches of at most one row a multiprocessor
//!   over block-team rows of aligned packs that fit 16 elements a rank: x, gamma and beta
//!   loaded into registers together, one DRAM round trip a row;
//! - `residual_pipelined_warp`, `residual_pipelined_block`
//!   ([`forward_rows_residual_pipelined`]) for launches with a residual whose rows all fit
//!   as the pipelined ones (below) do: s = x + residual formed in registers as each row
//!   comes up, written out, and normalized from there;
//! - `residual_held` and `residual_streamed` ([`forward_rows_residual_lean`]) for
//!   launches of many rows with a residual whose rows are all aligned packs past what the
//!   pipelined block holds: 16-bit rows held 4 packs a rank by up to 1024 ranks, or, too
//!   long for that, s summed as it is formed and read back from L2 for y, both at 64
//!   registers; `residual_streamed` also for launches of many rows not all aligned, past
//!   a warp's length (sm_90), whose rows not of aligned whole packs it takes in half packs
//!   where 8-byte aligned, 16-bit ones in packs from their first 16-byte boundary where
//!   all four rows sit alike past one, else element by element;
//! - `residual_held_shifted` ([`forward_rows_residual_held_shifted`], sm_90) for
//!   those launches' rows of one type that sit alike past a 16-byte boundary (16-bit rows
//!   in half packs among them) and fit 4 packs a rank of 1024 from it: held as
//!   `residual_held` holds its rows;
//! - `residual_warp`, `residual_block` ([`forward_rows_residual`]) for the other launches
//!   with a residual: s formed as each row is loaded, then normalized as `warp` and `block`
//!   take rows (below), s held or staged where x would be;
//! - `pipelined_warp`, `pipelined_block` ([`forward_rows_pipelined`]) where every row is
//!   whole aligned 16-byte packs that fit 4 a rank: x held in registers, and the team's next
//!   row loaded right after this row's first sum, so that each team has two rows in flight
//!   (LayerNorm's 16-bit block teams, and its f32 ones over rows of more than 2048 packs,
//!   [`forward_rows_pipelined_block`], copy the next row into shared memory instead, and
//!   keep this one widened to f32: one widening an element rather than one a pass; f32
//!   rows 6 packs a rank);
//! - `held_shifted` ([`forward_rows_held_shifted`], sm_90) for launches of many rows
//!   without a residual, past a warp's length, whose x and y of one type sit alike past a
//!   16-byte boundary (16-bit rows in half packs among them) and fit 4 packs a rank of 1024
//!   from it: a block for every row, x held from the boundary, the edge columns read one
//!   by one;
//! - `widened_warp` ([`forward_rows_widened`], LayerNorm's, sm_90) where the pipelined
//!   warp would take 16-bit rows of 2 to 4 packs a lane: a warp for every row, x widened
//!   to f32 once and centred in place, no next row in flight;
//! - `warp`, `block` ([`forward_rows`]) for all other launches, which take each row as
//!   its pointers and length allow:
//!   - held: all four row pointers 16-byte aligned and the row fits 8 packs a rank
//!     (`FWD_HELD`): x read from memory once into registers, mean and M2 in two exact
//!     passes over them with plain sums (RMSNorm: the sum of squares in one);
//!   - staged (block teams only): aligned rows too long to hold, where the host gave the
//!     launch shared memory for the rest (f32 rows to about 74000 on 1024 threads): 4 packs
//!     a rank in registers, the rest copied into shared memory (`cp.async`, every copy in
//!     flight at once), then the held rows' arithmetic over both;
//!   - streamed: other aligned rows, in 16-byte packs: one pass for the statistics (each
//!     pack's exact mean and M2, Chan merges across packs, lanes and warps; RMSNorm's plain
//!     sum of squares), and y's pass reading x again (from L2 while the rows in flight fit
//!     there);
//!   - half packs: rows whose pointers are 8-byte aligned but not all 16 (f16/bf16 rows
//!     of a multiple of 4 columns, every other row), as streamed, 8 bytes a load, 8 loads
//!     a rank at once and merged into the statistics as one, read through L1 for y's pass,
//!     on block teams (`row::chunk_of`);
//!   - element by element: the other rows, as streamed, 8 elements a rank read at once
//!     and merged into the statistics as one.
//!
//! Any kernel takes a row whose f32 statistics overflowed through [`forward_row_huge`].
//! M2 is summed with `fma`, and f16/bf16 y narrowed two values at a time; y itself stays a
//! multiply and an add, since as one fma (gamma and beta live at once) the f32 held
//! kernels spill at their 64 registers. docs/PERF.md has each version's changes and
//! measurements.

use crate::device::{cp_async_wait_all, fma, opaque_ptr, sqrt_rn};
use crate::element::{
    Element, MAX_PACK, Pack, for_each_weight_pack, is_pack_aligned, is_pack_aligned_as, load_pack, read,
    read_cached, read_half_pack, read_weights, write, write_with,
};
use crate::layout::params::Forward;
use crate::layout::registry::{Norm, pipeline_stages};
use crate::row::{
    ELEMENTS, FWD_HELD, HALF_PACKS, Held, PACKS, SHIFTED_PACKS, Staged, Widened, chunk_of, each_held_slot,
    each_slot, fits, for_each_batched, for_each_chunk, for_each_edge_column, for_each_read,
    for_each_read_values, for_each_shifted_chunk, head_elements, values,
};
use crate::team::{Block, ResidualBlock, SCRATCH_BYTES, Stats, StatsTeam, Team, Warp};
use core::f64::math::sqrt as sqrt_f64;

/// Packs a rank of the held forward over shifted rows (`held_shifted`).
#[cfg(layernorm_sm90)]
const FWD_HELD_SHIFTED: usize = crate::layout::FWD_HELD_SHIFTED as usize;

/// Packs per rank a block team holds in registers of a row too long to hold whole; the
/// rest is [`Staged`] in shared memory. f32 N = 65536 on 1024 threads: 64 KB in registers,
/// 192 KB in shared memory (a block gets at most 227 KB).
const PART_HELD: usize = crate::layout::PART_HELD as usize;

/// Packs a rank of the held residual kernel (`residual_held`): x's and the residual's
/// loaded together fit its 64 registers.
const RESIDUAL_HELD: usize = crate::layout::RESIDUAL_HELD as usize;

/// Packs a rank of the held residual kernel over shifted rows (`residual_held_shifted`).
#[cfg(layernorm_sm90)]
const RESIDUAL_HELD_SHIFTED: usize = crate::layout::RESIDUAL_HELD_SHIFTED as usize;

/// Elements a rank of an unaligned residual row adds at once ([`add_residual_elements`]),
/// as many as it then reads back at once (`row::for_each_read`).
const READ_BATCH_ELEMENTS: usize = crate::layout::READ_BATCH_ELEMENTS as usize;

/// Half packs a rank of an unaligned residual row adds at once ([`add_residual_half_packs`]):
/// x's and the residual's, 64 bytes in flight a rank, within the streamed kernel's 64
/// registers.
const ADD_BATCH_HALF_PACKS: usize = 4;

/// The factor on x of rows whose f32 sums overflow: n <= 2^31 values up to 2^128 sum to at
/// most 2^159, and their squared deviations (each at most 2^258) to 2^289; times 2^-81 and
/// 2^-162 both stay below f32's 2^128, while the values that decide such a row's variance
/// stay far above f32's smallest normal.
const HUGE_ROW_SCALE: f32 = 1.0 / (1u128 << 81) as f32;

/// The (mean, M2) that [`RowNorm::of`] takes for a row of mean `mean` and M2 `m2` (Chan's
/// merges give both: the streamed residual rows'): themselves for LayerNorm (`CENTERED`);
/// for RMSNorm, a mean of 0 and the sum of squares
///   sum_j x_j^2 = M2 + n mean^2   (two non-negative terms: no cancellation)
/// so that rstd = 1 / sqrt(sum_j x_j^2 / n + eps), and a sum of squares past f32's range
/// takes the scaled path as an overflowed M2 does. ([`normalize_row`] sums x_j^2 directly:
/// see [`row_mean`].)
#[inline(always)]
fn uncentered<const CENTERED: bool>(mean: f32, m2: f32, n: u32) -> (f32, f32) {
    if CENTERED {
        (mean, m2)
    } else {
        (0.0, fma(mean * n as f32, mean, m2))
    }
}

/// The row's mean, for the sums of x_j that `rank_sum` gives each rank: LayerNorm's
/// (`CENTERED`) is their sum over the team / n; RMSNorm takes none (`rank_sum` is not run),
/// and 0 makes the M2 pass after it sum_j x_j^2 (x_j - 0 is x_j exactly).
#[inline(always)]
fn row_mean<S: StatsTeam, const CENTERED: bool>(rank_sum: impl FnOnce() -> f32, n: u32) -> f32 {
    if CENTERED {
        S::sum(rank_sum()) / n as f32
    } else {
        0.0
    }
}

/// How a row is normalized, from its mean and rstd:
///   xhat_j = fma(x_j, 1/2, -mean/2) * (2 rstd)
/// Halving is exact, so for every x_j - mean in f32's normal range this is (x_j - mean) *
/// rstd to the bit; but x_j - mean itself overflows where x_j and mean have opposite signs
/// near f32's limit, and its half cannot. (The backward's `Centering` computes the same.)
/// RMSNorm's (`CENTERED` = false, mean 0) is
///   xhat_j = x_j * rstd
/// one multiply, which overflows only where y would.
/// Only these two values are kept (`scale` is 2 rstd, or RMSNorm's rstd): the mean and rstd
/// written out are recovered from them, so that no more than the plain form's two values
/// stay live across y's pass (the 64-register kernels have no room for more).
#[derive(Clone, Copy)]
struct RowNorm<const CENTERED: bool> {
    neg_half_mean: f32,
    scale: f32,
}

impl<const CENTERED: bool> RowNorm<CENTERED> {
    /// From the row's mean and rstd (f64 where [`RowNorm::of_scaled`] takes it).
    #[inline(always)]
    fn new(mean: f32, rstd: f64) -> Self {
        RowNorm {
            neg_half_mean: -0.5 * mean,
            scale: if CENTERED {
                (2.0 * rstd) as f32
            } else {
                rstd as f32
            },
        }
    }

    /// From the row's mean and M2 (the sum of squared deviations; RMSNorm's: mean 0 and the
    /// sum of squares), or None where M2 is not finite: the sums overflowed, or the row
    /// holds a NaN or an infinity (whose rows the scaled statistics leave NaN, as they
    /// should be).
    #[inline(always)]
    fn of(mean: f32, m2: f32, n: u32, eps: f32) -> Option<Self> {
        if !m2.is_finite() {
            return None;
        }
        let rstd = 1.0 / sqrt_rn(m2 / n as f32 + eps);
        Some(Self::new(mean, rstd as f64))
    }

    /// From the mean and M2 of x_j * [`HUGE_ROW_SCALE`]. var = M2 / n / scale^2 can pass
    /// f32's range, so var + eps and its root are taken in f64; rstd may then be subnormal
    /// in f32, as in any f32 result of such a row. The mean of a row lies within its
    /// values; the clamp undoes a rounding past f32's largest.
    #[inline(always)]
    fn of_scaled(mean_s: f32, m2_s: f32, n: u32, eps: f32) -> Self {
        let scale = HUGE_ROW_SCALE as f64;
        let var = m2_s as f64 / n as f64 / (scale * scale);
        let rstd = 1.0 / sqrt_f64(var + eps as f64);
        Self::new((mean_s / HUGE_ROW_SCALE).clamp(f32::MIN, f32::MAX), rstd)
    }

    #[inline(always)]
    fn xhat(self, x: f32) -> f32 {
        if CENTERED {
            fma(x, 0.5, self.neg_half_mean) * self.scale
        } else {
            x * self.scale
        }
    }

    /// rstd (LayerNorm's `scale` is 2 rstd: halving is exact).
    #[inline(always)]
    fn rstd(self) -> f32 {
        if CENTERED { 0.5 * self.scale } else { self.scale }
    }

    /// The normalization of the row's centred values d_j = x_j - mean:
    ///   xhat_j = d_j * rstd
    /// RMSNorm's form, one multiply. For every d_j in f32's normal range this is
    /// [`RowNorm::xhat`] of x_j to the bit (fma(x_j, 1/2, -mean/2) is d_j / 2 exactly).
    #[inline(always)]
    fn centred(self) -> RowNorm<false> {
        RowNorm {
            neg_half_mean: -0.0,
            scale: self.rstd(),
        }
    }

    /// Writes the row's mean and rstd (rank 0 of the team), for the backward.
    ///
    /// # Safety
    /// `mean` and `rstd` point at the row's entries.
    #[inline(always)]
    unsafe fn publish<S: StatsTeam>(self, mean: *mut f32, rstd: *mut f32) {
        if S::rank() == 0 {
            // SAFETY: the caller's guarantee.
            unsafe {
                mean.write(-2.0 * self.neg_half_mean);
                rstd.write(self.rstd());
            }
        }
    }
}

/// A launch's gamma and beta, and the offset each gamma_j takes as it is read:
///   y_j = xhat_j * (gamma_j + gamma_offset) + beta_j
/// 1 for zero-centred weights (the stored gamma is the weight's distance from 1, as Gemma
/// and flash-attention's `zero_centered_weight` keep it), -0 otherwise: g + (-0) is g for
/// every g, -0 included, so plain weights lose no bit to the add. The offset stays a kernel
/// parameter, which the multiply reads from the constant bank, not a register. No launch
/// writes the weights it reads (the host passes the op's own gamma and beta, and every
/// output elsewhere), so they are read through the read-only path ([`read_cached`]).
#[derive(Clone, Copy)]
struct Affine<W> {
    gamma: *const W,
    beta: *const W,
    gamma_offset: f32,
}

impl<W: Copy> Affine<W> {
    #[inline(always)]
    fn of<T: Copy, R: Copy>(p: Forward<T, W, R>) -> Self {
        Affine {
            gamma: p.gamma.ptr(),
            beta: p.beta.ptr(),
            gamma_offset: p.gamma_offset,
        }
    }

    /// The same, with gamma and beta through [`opaque_ptr`]: addresses into them are formed
    /// where used.
    #[inline(always)]
    fn each_row(self) -> Self {
        Affine {
            gamma: opaque_ptr(self.gamma),
            beta: opaque_ptr(self.beta),
            ..self
        }
    }
}

/// True where the row pointers `rows` (of types of `T`'s size) all sit equally far past a
/// 16-byte boundary, at a whole element's offset: their packs from there line up
/// ([`SHIFTED_PACKS`]).
#[inline(always)]
fn shifted_alike<T>(rows: &[usize]) -> bool {
    rows.iter().all(|&p| p % 16 == rows[0] % 16) && rows[0].is_multiple_of(size_of::<T>())
}

/// Normalizes rows `S::id(), S::id() + S::count(), ...`, one team per row.
///
/// # Safety
/// `p.x`, `p.y` hold `rows * n` elements; `p.gamma`, `p.beta` hold `n`; `p.mean`, `p.rstd`
/// hold `rows`.
#[inline(always)]
unsafe fn forward_rows<T: Element, W: Element, S: StatsTeam, const CENTERED: bool>(p: Forward<T, W>) {
    let (x, y, affine) = (p.x.ptr(), p.y.ptr(), Affine::of(p));
    let (mean, rstd, rows, n, eps) = (p.mean.ptr(), p.rstd.ptr(), p.rows, p.n, p.eps);
    let staged = Staged::<PART_HELD>::after(SCRATCH_BYTES);
    let mut row = S::id();
    while row < rows {
        let offset = row as usize * n as usize;
        // SAFETY: the row lies inside x and y (row < rows); the caller sized gamma and beta.
        let (x_row, y_row) = unsafe { (x.add(offset), y.add(offset)) };
        // The weights' pack addresses, which LLVM would keep across rows, formed anew each
        // row: kept, they spilled at 64 registers in RMSNorm's f32 kernel and, with the short
        // read batches, LayerNorm's f32 block kernel (formed anew, LayerNorm's 16-bit warp
        // kernels with f32 weights spilled on sm_80).
        let affine = if CENTERED && !S::HOLDS_PART_OF_LONG_ROWS {
            affine
        } else {
            affine.each_row()
        };
        let chunk = chunk_of::<T, W>(
            &[x_row as usize, y_row as usize],
            &[affine.gamma as usize, affine.beta as usize],
        );
        // SAFETY: x's row, which no thread writes, holds n elements.
        let first = unsafe { first_value(x_row, n) };
        // SAFETY: as above; `chunk` was checked for every pointer the row's path reads.
        let norm = unsafe {
            if chunk == PACKS && fits::<T, S, FWD_HELD>(n) {
                forward_row::<T, T, W, S, CENTERED, PACKS, FWD_HELD>(x_row, affine, y_row, n, eps, first)
            } else if chunk == PACKS && S::HOLDS_PART_OF_LONG_ROWS && staged.holds::<T, S>(n) {
                forward_row_staged::<T, W, S, CENTERED>(x_row, affine, y_row, n, eps, staged)
            } else if chunk == PACKS {
                forward_row::<T, T, W, S, CENTERED, PACKS, 0>(x_row, affine, y_row, n, eps, first)
            } else if chunk == HALF_PACKS && S::HOLDS_PART_OF_LONG_ROWS {
                // Block teams only: the warp kernels, whose rows the host keeps short, lost
                // nothing by their elements and kept their code smaller (docs/PERF.md v60).
                forward_row::<T, T, W, S, CENTERED, HALF_PACKS, 0>(x_row, affine, y_row, n, eps, first)
            } else if !CENTERED
                && S::HOLDS_PART_OF_LONG_ROWS
                && shifted_alike::<T>(&[x_row as usize, y_row as usize])
            {
                // RMSNorm's block teams, where half packs do not fit: x and y sit equally far
                // past a 16-byte boundary (rows of one type always do), so they are read and
                // written in packs from there; element by element each 16 bytes of f16 took 8
                // loads and 8 stores. (LayerNorm's block kernels spilled 8-48 bytes with them.)
                forward_row::<T, T, W, S, CENTERED, SHIFTED_PACKS, 0>(x_row, affine, y_row, n, eps, first)
            } else {
                forward_row::<T, T, W, S, CENTERED, ELEMENTS, 0>(x_row, affine, y_row, n, eps, first)
            }
        };
        // SAFETY: as above; row < rows, so its statistics lie inside mean and rstd.
        unsafe {
            let norm = norm
                .unwrap_or_else(|| forward_row_huge::<T, T, W, S, CENTERED>(x_row, affine, y_row, n, eps));
            norm.publish::<S>(mean.add(row as usize), rstd.add(row as usize));
        }
        row += S::count();
    }
}

/// As [`forward_rows`], the row normalized being
///   s_j = x_j + residual_j   (in f32, rounded once to `T`)
/// which the kernel writes to `sum` as it forms it (the next block's residual, and the
/// backward's x). Each rank forms s in the packs it later reads, and keeps what it can:
/// - held: rows that fit `FWD_HELD` packs a rank. x's and the residual's packs are loaded
///   together, and s is formed, stored and normalized from registers ([`store_sum`]);
/// - staged (block teams): aligned rows too long to hold, where the host gave the launch
///   shared memory for two copies of the rest (`layout::staged_smem`). `PART_HELD` packs a
///   rank are held, x's and the residual's other packs copied into shared memory together
///   (x's 8 bytes a 16-byte slot beside a stream of f32), and s formed over x's copy
///   ([`Staged::sum_into`]);
/// - streamed: the rest. s is formed a few packs at a time ([`add_residual`]), then
///   normalized as [`forward_rows`] streams a row: read back from L2, only what this rank
///   wrote, so no barrier.
///
/// A loop and kernels of their own: the residual's two more row pointers do not fit beside
/// the plain loop in its 64 registers. The plain kernels spill even when this loop is only
/// compiled in beside theirs, behind a branch.
///
/// # Safety
/// As for [`forward_rows`]; `p.residual` and `p.sum` hold `rows * n` elements; a block
/// team's shared memory past the scratch is its own.
#[inline(always)]
unsafe fn forward_rows_residual<T: Element, Y: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    p: Forward<Y, W, T>,
) {
    let affine = Affine::of(p);
    let (n, eps) = (p.n, p.eps);
    let (x_staged, residual_staged) = Staged::<PART_HELD>::halves_after(SCRATCH_BYTES);
    let packs = n / T::PACK as u32;
    let normalize = |x_row: *const Y, residual_row: *const T, sum_row: *mut T, y_row: *mut Y| {
        let packed = is_pack_aligned_as::<T, _>(x_row)
            && is_pack_aligned_as::<T, _>(y_row)
            && is_pack_aligned(affine.gamma)
            && is_pack_aligned(affine.beta)
            && is_pack_aligned(residual_row)
            && is_pack_aligned(sum_row);
        // From the stores on, the row normalized is s: each path below reads back, from
        // registers, shared memory or L2, only what this rank itself wrote. So s's pivot
        // is x's and the residual's first values summed (which no thread writes), not s's.
        let s_row = sum_row.cast_const();
        // SAFETY: x's and the residual's rows hold n elements.
        let first = || unsafe { residual_pivot(x_row, residual_row, n) };
        // SAFETY: the rows are one row of x, y, the residual and sum (`residual_rows`);
        // `packed` was checked for every pointer the packed paths read or write, and `fits`
        // or `holds` for the held and staged.
        let norm = unsafe {
            if packed && fits::<T, S, FWD_HELD>(n) {
                residual_held_row::<T, Y, W, S, CENTERED, PACKS, FWD_HELD>(
                    x_row,
                    residual_row,
                    sum_row,
                    affine,
                    y_row,
                    n,
                    eps,
                )
            } else if packed && S::HOLDS_PART_OF_LONG_ROWS && x_staged.holds::<T, S>(n) {
                // Every load of the row in flight at once: the held packs' and both copies.
                let (xs, rs) = (
                    Held::<PART_HELD>::load_as::<T, Y, S>(x_row, packs),
                    Held::<PART_HELD>::load::<T, S>(residual_row, packs),
                );
                x_staged.fill_async::<T, Y, S>(x_row, n);
                residual_staged.fill_async::<T, T, S>(residual_row, n);
                let held = store_sum::<T, Y, S, PART_HELD>(xs, rs, sum_row, packs);
                crate::device::cp_async_wait_all();
                x_staged.sum_into::<T, Y, S>(residual_staged, sum_row, n);
                add_residual_elements::<T, Y, S, 1>(x_row, residual_row, sum_row, packs * T::PACK as u32, n);
                normalize_staged::<T, Y, W, S, CENTERED>(&held, s_row, affine, y_row, n, eps, x_staged)
            } else if packed {
                add_residual::<T, Y, S, true>(x_row, residual_row, sum_row, n);
                forward_row::<T, Y, W, S, CENTERED, PACKS, 0>(s_row, affine, y_row, n, eps, first)
            } else {
                add_residual::<T, Y, S, false>(x_row, residual_row, sum_row, n);
                forward_row::<T, Y, W, S, CENTERED, ELEMENTS, 0>(s_row, affine, y_row, n, eps, first)
            }
        };
        (norm, packed)
    };
    // SAFETY: the caller's guarantee; `normalize` writes s by packs exactly where `packed`.
    unsafe { residual_rows::<T, Y, W, S, CENTERED>(p, normalize) }
}

/// As [`forward_rows_residual`] at 64 registers (teams of up to 1024 ranks), without the
/// general kernel's held and staged paths:
/// - `HELD` > 0 (`residual_held`, 16-bit rows): rows that fit `HELD` packs a rank
///   (`layout::RESIDUAL_HELD`, 4: N <= 32768 on 1024 ranks), which the general kernel
///   would hold at 8 packs a rank of at most 512 ranks and 128 registers, one block a
///   multiprocessor. x's and the residual's packs are loaded together, s formed, stored
///   and normalized from registers ([`residual_held_row`]);
/// - `HELD` = 0 (`residual_streamed`): rows too long to hold (past `FWD_HELD` packs a rank
///   of 512), in two passes over memory: s formed `SUM_BATCH` packs a rank at a time,
///   written to `sum`, and taken into this rank's statistics as it goes
///   ([`add_residual_stats`]: each batch's exact mean and M2, Chan's merges), then merged
///   over the team; then y from s read back from L2 (the rows in flight fit there), only the
///   packs this rank wrote, so no barrier ([`write_y_streamed`]). Every access but s's
///   stores is cached evict-first, so that L2 keeps s for its read back. The general
///   kernel stages such rows in shared memory (a block a multiprocessor, the whole row's
///   loads at once) or, past what shared memory holds, streams them at its 128 registers
///   and reads s back twice; here two blocks of 512 share a multiprocessor, and each row's
///   tail overlaps another block's loads (docs/PERF.md, v39). Rows that are not whole
///   aligned packs (launches not all aligned) are added in half packs where every pointer
///   is 8-byte aligned ([`add_residual_half_packs`]), 16-bit ones in packs from
///   the first 16-byte boundary where x, y, the residual and s sit alike past one
///   ([`add_residual_shifted`]), else element by element ([`add_residual_elements`]), and
///   normalized as the plain forward streams them, s read back from L2 twice: the general
///   kernel took them at 128 registers and 16 warps a multiprocessor, element by element;
///   these run 32 (sm_90 only).
///
/// DRAM sees x, the residual, s and y once each, and shared memory only the reductions'
/// scratch.
///
/// # Safety
/// As for [`forward_rows_residual`]; with `HELD` > 0, or in the sm_80 module, every row is
/// whole packs, and x, y, the residual, s, gamma and beta are aligned to a pack of `T`'s
/// columns (the host launches it only on such rows); with `HELD` > 0 every row fits `HELD`
/// packs a rank.
#[inline(always)]
unsafe fn forward_rows_residual_lean<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const HELD: usize,
>(
    p: Forward<Y, W, T>,
) {
    let affine = Affine::of(p);
    let (n, eps) = (p.n, p.eps);
    let normalize = |x_row: *const Y, residual_row: *const T, sum_row: *mut T, y_row: *mut Y| {
        let s_row = sum_row.cast_const();
        // The sm_80 module takes aligned rows only (the host sends it no others): the element
        // path spilled 4-32 bytes there at 64 registers, and no sm_80 device measured it.
        let packed = HELD > 0
            || !cfg!(layernorm_sm90)
            || (n.is_multiple_of(T::PACK as u32)
                && is_pack_aligned_as::<T, _>(x_row)
                && is_pack_aligned_as::<T, _>(y_row)
                && is_pack_aligned(affine.gamma)
                && is_pack_aligned(affine.beta)
                && is_pack_aligned(residual_row)
                && is_pack_aligned(sum_row));
        // Rows not whole aligned packs: half packs where every pointer allows them, else
        // packs from the first 16-byte boundary where all four rows sit alike past one (s of
        // x's size: a stream in f32 beside 16-bit x goes element by element).
        let rows = [
            x_row as usize,
            y_row as usize,
            residual_row as usize,
            sum_row as usize,
        ];
        let chunk = if packed {
            PACKS
        } else if size_of::<Y>() == size_of::<T>() {
            match chunk_of::<T, W>(&rows, &[affine.gamma as usize, affine.beta as usize]).min(HALF_PACKS) {
                // 16-bit rows only: f32 rows ran 2-6% slower than by elements (docs/PERF.md
                // v78).
                ELEMENTS if size_of::<T>() == 2 && shifted_alike::<T>(&rows) => SHIFTED_PACKS,
                chunk => chunk,
            }
        } else {
            ELEMENTS
        };
        // SAFETY: the rows are one row of x, y, the residual and sum (`residual_rows`); held
        // rows are whole packs, aligned, and fit; `packed` and `chunk` were checked for the
        // others' pointers, half packs only where x is of s's type. Each pass after the add
        // reads back only this rank's packs, half packs or elements of s.
        let norm = unsafe {
            if !packed {
                // The pivot taken first, so that x's and the residual's pointers die with the add.
                let pivot = if CENTERED {
                    residual_pivot(x_row, residual_row, n)
                } else {
                    0.0
                };
                if chunk == HALF_PACKS {
                    add_residual_half_packs::<T, Y, S>(x_row, residual_row, sum_row, n);
                    forward_row::<T, Y, W, S, CENTERED, HALF_PACKS, 0>(s_row, affine, y_row, n, eps, || pivot)
                } else if chunk == SHIFTED_PACKS {
                    add_residual_shifted::<T, Y, S>(x_row, residual_row, sum_row, n);
                    forward_row::<T, Y, W, S, CENTERED, SHIFTED_PACKS, 0>(
                        s_row,
                        affine,
                        y_row,
                        n,
                        eps,
                        || pivot,
                    )
                } else {
                    add_residual::<T, Y, S, false>(x_row, residual_row, sum_row, n);
                    forward_row::<T, Y, W, S, CENTERED, ELEMENTS, 0>(s_row, affine, y_row, n, eps, || pivot)
                }
            } else if HELD > 0 {
                residual_held_row::<T, Y, W, S, CENTERED, PACKS, HELD>(
                    x_row,
                    residual_row,
                    sum_row,
                    affine,
                    y_row,
                    n,
                    eps,
                )
            } else {
                let pivot = residual_pivot(x_row, residual_row, n);
                let stats = S::reduce_stats(add_residual_stats::<T, Y, S>(
                    x_row,
                    residual_row,
                    sum_row,
                    n / T::PACK as u32,
                    pivot,
                ));
                let (row_mean, m2) = uncentered::<CENTERED>(pivot + stats.mean, stats.m2, n);
                RowNorm::of(row_mean, m2, n, eps)
                    .inspect(|&norm| write_y_streamed::<T, Y, W, S, CENTERED>(s_row, affine, y_row, n, norm))
            }
        };
        (norm, chunk != ELEMENTS)
    };
    // SAFETY: the caller's guarantee; `normalize` writes s by elements exactly where its
    // chunk is `ELEMENTS`.
    unsafe { residual_rows::<T, Y, W, S, CENTERED>(p, normalize) }
}

/// The held residual forward over rows of one type shifted alike (`residual_held_shifted`, sm_90,
/// teams of up to 1024 ranks at 64 registers): x, y, the residual and s all sit as
/// far past a 16-byte boundary. Each rank loads x's and the residual's packs from the row's
/// first boundary on, `RESIDUAL_HELD_SHIFTED` of each together, forms and stores s, and
/// normalizes it from registers
/// ([`residual_held_row`]); the columns before the boundary and after the last whole pack
/// go a column a rank. Streamed (the `residual_streamed` kernel), such rows' s is written
/// and read back from L2 twice. A kernel of its own: an arm for these rows in the aligned
/// held kernel cost that kernel 11% at N = 32768 (docs/PERF.md, v82), and spilled
/// LayerNorm's, which fits here (59-64 registers at 4 packs a rank, no spill).
///
/// # Safety
/// As for [`forward_rows_residual`]; x, y, the residual and s are of one type, every
/// row of each as far past a 16-byte boundary as x's, and every row fits
/// `RESIDUAL_HELD_SHIFTED` packs a rank from its first boundary (the host launches it only
/// on such rows).
#[cfg(layernorm_sm90)]
#[inline(always)]
unsafe fn forward_rows_residual_held_shifted<T: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    p: Forward<T, W, T>,
) {
    let affine = Affine::of(p);
    let (n, eps) = (p.n, p.eps);
    let normalize = |x_row: *const T, residual_row: *const T, sum_row: *mut T, y_row: *mut T| {
        // SAFETY: the rows are one row of x, y, the residual and sum (`residual_rows`), which
        // sit alike and fit (the caller's guarantee).
        let norm = unsafe {
            residual_held_row::<T, T, W, S, CENTERED, SHIFTED_PACKS, RESIDUAL_HELD_SHIFTED>(
                x_row,
                residual_row,
                sum_row,
                affine,
                y_row,
                n,
                eps,
            )
        };
        (norm, true)
    };
    // SAFETY: the caller's guarantee; `normalize` writes s in packs and edge columns, as
    // the walks that read it back hand them out.
    unsafe { residual_rows::<T, T, W, S, CENTERED>(p, normalize) }
}

/// The forward over rows of one type shifted alike (`held_shifted`, sm_90, a block for every
/// row, up to 1024 ranks at 64 registers): x and y sit as far past a 16-byte boundary.
/// Each rank loads its `FWD_HELD_SHIFTED` packs of x from the row's first boundary on, all
/// in flight at once, and normalizes them from registers ([`normalize_held_shifted`]); the
/// columns before the boundary and after the last whole pack go a column a rank, read from
/// x. The general block kernel streams such rows, x read from L2 again for each pass, in
/// packs from the boundary (RMSNorm), half packs (rows 8-byte aligned) or elements.
///
/// # Safety
/// As for [`forward_rows`]; x and y are of one type, every row of each as far past a
/// 16-byte boundary as x's, and every row fits `FWD_HELD_SHIFTED` packs a rank from its
/// first boundary (the host launches it only on such rows).
#[cfg(layernorm_sm90)]
#[inline(always)]
unsafe fn forward_rows_held_shifted<T: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    p: Forward<T, W>,
) {
    let (x, y, affine) = (p.x.ptr(), p.y.ptr(), Affine::of(p));
    let (mean, rstd, rows, n, eps) = (p.mean.ptr(), p.rstd.ptr(), p.rows, p.n, p.eps);
    let mut row = S::id();
    while row < rows {
        let offset = row as usize * n as usize;
        // SAFETY: the row lies inside x and y (row < rows); from its head on, x's packs are
        // aligned and fit (the caller's guarantee), and y's sit as x's do.
        unsafe {
            let (x_row, y_row) = (x.add(offset), y.add(offset));
            let head = head_elements(x_row, n);
            let held =
                Held::<FWD_HELD_SHIFTED>::load::<T, S>(x_row.add(head as usize), (n - head) / T::PACK as u32);
            let norm = normalize_held_shifted::<T, T, W, S, CENTERED, FWD_HELD_SHIFTED>(
                &held, x_row, affine, y_row, n, eps,
            )
            .unwrap_or_else(|| forward_row_huge::<T, T, W, S, CENTERED>(x_row, affine, y_row, n, eps));
            norm.publish::<S>(mean.add(row as usize), rstd.add(row as usize));
        }
        row += S::count();
    }
}

/// The residual forward's loop over the team's rows: `normalize(x, residual, sum, y)` (one
/// row of each) forms the row's s, writes it to `sum` and y from it, and returns the row's
/// normalization, or None where its statistics overflowed, and whether the team wrote s
/// in chunks wider than an element (packs or half packs); then this loop takes overflowed
/// rows on the huge path and publishes the row's statistics.
///
/// # Safety
/// As for [`forward_rows_residual`]; `normalize` is sound for one row of x, y, the
/// residual and sum, and where it returns `false` each rank wrote s's elements `rank,
/// rank + size, ...` (as the huge path walks them).
#[inline(always)]
unsafe fn residual_rows<T: Element, Y: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    p: Forward<Y, W, T>,
    normalize: impl Fn(*const Y, *const T, *mut T, *mut Y) -> (Option<RowNorm<CENTERED>>, bool),
) {
    let affine = Affine::of(p);
    let (mean, rstd, rows, n, eps) = (p.mean.ptr(), p.rstd.ptr(), p.rows, p.n, p.eps);
    let mut row = S::id();
    while row < rows {
        // SAFETY: row < rows.
        let (x_row, y_row, residual_row, sum_row) = unsafe { residual_row(&p, row) };
        let (norm, by_packs) = normalize(x_row, residual_row, sum_row, y_row);
        // SAFETY: as above; row < rows, so its statistics lie inside mean and rstd.
        unsafe {
            let norm = norm.unwrap_or_else(|| {
                // The huge path walks the row element by element, not in this rank's packs or
                // half packs: the s other ranks wrote must be visible first (the branch is
                // the team's).
                if by_packs {
                    S::sync();
                }
                forward_row_huge::<T, Y, W, S, CENTERED>(sum_row.cast_const(), affine, y_row, n, eps)
            });
            norm.publish::<S>(mean.add(row as usize), rstd.add(row as usize));
        }
        row += S::count();
    }
}

/// One residual row held in registers, `HELD` packs a rank: x's and the residual's packs
/// loaded together (every load in flight at once), s formed, written to `sum` and
/// normalized from registers ([`store_sum`]); the elements after the last whole pack one
/// by one. [`SHIFTED_PACKS`]: the packs from the row's first 16-byte boundary, where x's,
/// the residual's, s's and y's all start, and the columns before it with the tail's
/// ([`add_residual_edges`]), the weights read off their boundary; s is read back from
/// memory at those columns only, which this rank wrote. Returns the row's normalization,
/// or None where its statistics overflowed (as [`normalize_row`]).
///
/// # Safety
/// As for [`forward_row`] over x, residual, sum and y, all 16-byte aligned ([`PACKS`]) or
/// all of one 16-bit type and as far past a 16-byte boundary ([`SHIFTED_PACKS`]); the row
/// fits `HELD` packs a rank.
#[inline(always)]
unsafe fn residual_held_row<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const CHUNK: usize,
    const HELD: usize,
>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    eps: f32,
) -> Option<RowNorm<CENTERED>> {
    let head = if CHUNK == SHIFTED_PACKS {
        head_elements(sum, n)
    } else {
        0
    };
    let packs = (n - head) / T::PACK as u32;
    // SAFETY: the caller's guarantee: from column `head` on, every row's packs are aligned.
    unsafe {
        let held = store_sum::<T, Y, S, HELD>(
            Held::load_as::<T, Y, S>(x.add(head as usize), packs),
            Held::load::<T, S>(residual.add(head as usize), packs),
            sum.add(head as usize),
            packs,
        );
        if CHUNK == SHIFTED_PACKS {
            add_residual_edges::<T, Y, S>(x, residual, sum, n, head, head + packs * T::PACK as u32);
            return normalize_held_shifted::<T, Y, W, S, CENTERED, HELD>(
                &held,
                sum.cast_const(),
                affine,
                y,
                n,
                eps,
            );
        }
        add_residual_elements::<T, Y, S, 1>(x, residual, sum, packs * T::PACK as u32, n);
        // Held rows merge no chunks: no pivot.
        normalize_row::<T, Y, W, S, CENTERED, PACKS, HELD>(&held, sum.cast_const(), affine, y, n, eps, || 0.0)
    }
}

/// [`normalize_row`] over a held shifted row ([`residual_held_row`]): its statistics and y
/// from this rank's held packs, from the row's first 16-byte boundary on, and from the
/// columns before it and after the last whole pack read back at `x` (s: the ones this rank
/// wrote, as [`for_each_shifted_chunk`] hands them out), the weights off their boundaries.
/// A function of its own rather than a chunk of `normalize_row`'s: an arm for it there
/// changed the code of 60 other forward kernels (on sm_80 too, which never takes it).
///
/// # Safety
/// As for [`normalize_row`]; x and y sit as far past a 16-byte boundary, and `held` holds
/// this rank's packs of the row from there ([`Held::load`] at x + the head).
#[inline(always)]
unsafe fn normalize_held_shifted<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const HELD: usize,
>(
    held: &Held<HELD>,
    x: *const T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    eps: f32,
) -> Option<RowNorm<CENTERED>> {
    let head = head_elements(x, n);
    let mean = row_mean::<S, CENTERED>(
        || {
            let mut sum = 0.0;
            for_each_shifted_chunk::<T, S, HELD>(n, head, |j, len, slot| {
                // SAFETY: the walk yields in-bounds chunks, whole packs aligned in x from
                // the head on.
                let v = unsafe { values(held, x, j, len, slot) };
                sum += v[..len].iter().sum::<f32>();
            });
            sum
        },
        n,
    );
    let mut m2 = 0.0;
    for_each_shifted_chunk::<T, S, HELD>(n, head, |j, len, slot| {
        // SAFETY: as above.
        let v = unsafe { values(held, x, j, len, slot) };
        for &v in &v[..len] {
            m2 = fma(v - mean, v - mean, m2);
        }
    });
    let norm = RowNorm::of(mean, S::sum(m2), n, eps)?;
    for_each_shifted_chunk::<T, S, HELD>(n, head, |j, len, slot| {
        // SAFETY: as above, and y's packs sit as x's do.
        unsafe {
            let v = values(held, x, j, len, slot);
            write_y_chunk::<T, _, _, CENTERED, CENTERED, false, true, true>(affine, y, j, len, v, norm)
        }
    });
    Some(norm)
}

/// As [`add_residual`] over a row of `packs` whole packs, returning this rank's statistics
/// of the s it formed (its values as stored, rounded to `T`) less `pivot` ([`chunk_stats`]):
/// each batch's exact (mean, M2) over its `SUM_BATCH` packs together, merged by Chan's
/// formula. One merge a batch rather than one a pack: a merge divides (`div.rn.f32`, a
/// dozen instructions and a branch), and the stream in f32, which does the most per byte
/// here, gained 8-11% (docs/PERF.md v42).
/// x and the residual are loaded evict-first: L2 is to keep s, which y's pass reads back.
///
/// # Safety
/// x, residual and sum hold `packs` whole packs, aligned.
#[inline(always)]
unsafe fn add_residual_stats<T: Element, Y: Element, S: Team>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    packs: u32,
    pivot: f32,
) -> Stats {
    let mut stats = Stats::EMPTY;
    // SAFETY: the caller's guarantee.
    unsafe {
        each_sum_batch::<T, Y, S, true>(x, residual, sum, packs, |s, left| {
            if S::rank() + (SUM_BATCH as u32 - 1) * S::size() < left {
                // The whole batch is this rank's: its values side by side.
                let mut batch = [0.0; SUM_BATCH * MAX_PACK];
                for c in 0..SUM_BATCH {
                    batch[c * T::PACK..][..T::PACK].copy_from_slice(&s.pack::<T>(c)[..T::PACK]);
                }
                stats = stats.merge(chunk_stats::<T>(&batch[..SUM_BATCH * T::PACK], pivot));
            } else {
                each_held_slot::<S, SUM_BATCH>(left, |c, _| {
                    stats = stats.merge(chunk_stats::<T>(&s.pack::<T>(c)[..T::PACK], pivot))
                });
            }
        })
    };
    stats
}

/// Row `row`'s start in a residual forward's x, y, residual and sum.
///
/// # Safety
/// row < `p.rows`: the row lies inside x and y (and inside the residual and sum, which the
/// callers' safety sections size alike).
#[inline(always)]
unsafe fn residual_row<T: Element, Y: Element, W: Element>(
    p: &Forward<Y, W, T>,
    row: u32,
) -> (*const Y, *mut Y, *const T, *mut T) {
    let offset = row as usize * p.n as usize;
    // SAFETY: the caller's guarantee.
    let (x_row, y_row) = unsafe { (p.x.ptr().add(offset), p.y.ptr().add(offset)) };
    (
        x_row,
        y_row,
        p.residual.ptr().wrapping_add(offset),
        p.sum.ptr().wrapping_add(offset),
    )
}

/// The residual add of this rank's held packs of a row (`xs` and `rs`, x's and the
/// residual's, loaded together so that all their loads are in flight at once): s formed
/// ([`Held::sum`]), written to `sum` and returned, so that the row is normalized from
/// registers rather than read back.
///
/// # Safety
/// `sum` is 16-byte aligned and holds `packs` whole packs, the ones `xs` and `rs` hold
/// this rank's of.
#[inline(always)]
unsafe fn store_sum<T: Element, Y: Element, S: Team, const K: usize>(
    xs: Held<K>,
    rs: Held<K>,
    sum: *mut T,
    packs: u32,
) -> Held<K> {
    let s = xs.sum::<Y, T>(&rs);
    // SAFETY: the caller's guarantee.
    unsafe { s.store::<T, S>(sum, packs) };
    s
}

/// Packs of x and of the residual each rank has in flight at once as it forms s.
const SUM_BATCH: usize = 2;

/// The residual add of one streamed row, before its normalization:
///   s_j = x_j + residual_j   (in f32, rounded once to `T`)
/// written to `sum` in this rank's own chunks, the ones `for_each_chunk` gives it over
/// packs or elements: every later pass of this rank over s reads only what it wrote
/// itself, so the team needs no barrier (program order covers a thread's own stores), and
/// s comes back from L2, which keeps DRAM traffic to x, residual, s and y once each. Packed
/// rows go `SUM_BATCH` packs a rank at a time, every load of a batch issued before its
/// first store: a store orders the loads after it, so a load-add-store loop would wait out
/// a DRAM latency per pack.
///
/// # Safety
/// x, residual and sum hold the `n`-element row; with `PACKED`, all three 16-byte aligned.
#[inline(always)]
unsafe fn add_residual<T: Element, Y: Element, S: StatsTeam, const PACKED: bool>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    n: u32,
) {
    let packs = if PACKED { n / T::PACK as u32 } else { 0 };
    // SAFETY: the packs before `packs` are whole and aligned (PACKED).
    unsafe { each_sum_batch::<T, Y, S, false>(x, residual, sum, packs, |_, _| {}) };
    // SAFETY: the caller's guarantee.
    unsafe {
        if PACKED {
            add_residual_elements::<T, Y, S, 1>(x, residual, sum, packs * T::PACK as u32, n)
        } else {
            add_residual_elements::<T, Y, S, READ_BATCH_ELEMENTS>(x, residual, sum, 0, n)
        }
    };
}

/// The residual add of a row's first `packs` whole packs, `SUM_BATCH` packs a rank at a
/// time, every load of a batch issued before its first store: s formed and written, then
/// `f(s, left)` with the batch's held s (slot c: pack rank + c * size of the `left` packs
/// from the batch's first on, as for_each_chunk walks them).
/// `EVICT_FIRST`: x and the residual are loaded evict-first ([`load_pack`]), s stored as
/// usual, so that L2 keeps s for the row's read back.
///
/// # Safety
/// x, residual and sum hold `packs` whole packs, aligned.
#[inline(always)]
unsafe fn each_sum_batch<T: Element, Y: Element, S: Team, const EVICT_FIRST: bool>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    packs: u32,
    mut f: impl FnMut(&Held<SUM_BATCH>, u32),
) {
    let mut first = 0;
    while first < packs {
        // On sm_90 `first` goes through `opaque`: each batch's addresses are then the row's
        // start plus an offset (one IMAD.WIDE each), not six 64-bit pointers carried across
        // the loop, which ptxas rotated through moves (f32: 36 instructions a batch against
        // 10). The sm_80 module keeps the carried pointers: there ptxas gives the offset form
        // of RMSNorm's stream-in-f32 kernels 32 registers and a spill (not measured on sm_80).
        #[cfg(layernorm_sm90)]
        let batch_start = crate::device::opaque(first);
        #[cfg(not(layernorm_sm90))]
        let batch_start = first;
        let (left, at) = (packs - first, batch_start as usize * T::PACK);
        // SAFETY: the packs from `first` on are whole and aligned.
        let (xs, rs) = unsafe {
            (
                Held::<SUM_BATCH>::load_with::<T, Y, S, EVICT_FIRST>(x.add(at), left),
                Held::<SUM_BATCH>::load_with::<T, T, S, EVICT_FIRST>(residual.add(at), left),
            )
        };
        // SAFETY: as above: `left` whole packs from `at` on.
        let s = unsafe { store_sum::<T, Y, S, SUM_BATCH>(xs, rs, sum.add(at), left) };
        f(&s, left);
        first += SUM_BATCH as u32 * S::size();
    }
}

/// The residual add of elements `from..n` of a row, element `from + i` by rank `i mod size`:
/// as `for_each_chunk` hands out the elements after a row's whole packs (`from` the first of
/// them), or every element of an unaligned row (`from` 0), `BATCH` a rank at a time, every
/// load of a batch before its first store ([`for_each_batched`]). A row's tail
/// after its whole packs, less than a pack, is at most an element a rank: `BATCH` 1 there,
/// whose registers the held kernels lack.
///
/// # Safety
/// x, residual and sum hold the `n`-element row.
#[inline(always)]
unsafe fn add_residual_elements<T: Element, Y: Element, S: Team, const BATCH: usize>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    from: u32,
    n: u32,
) {
    for_each_batched::<S, _, BATCH, false>(
        from,
        n,
        // SAFETY: for_each_batched yields j < n.
        |j| unsafe { (read(x, j, 1)[0], read(residual, j, 1)[0]) },
        |j, (x, residual)| {
            let mut s: Pack = [0.0; MAX_PACK];
            s[0] = x + residual;
            // SAFETY: as above.
            unsafe { write(sum, j, 1, &s) };
        },
    );
}

/// The residual add of a row of x's type 8-byte aligned but not 16 (the streamed kernel's,
/// sm_90): half pack c by rank c mod size, as `for_each_read` walks them (`HALF_PACKS`),
/// `ADD_BATCH_HALF_PACKS` a rank at a time, every load of a batch before its first store,
/// then the elements after the last whole half pack ([`add_residual_elements`]).
///
/// # Safety
/// x, residual and sum hold the `n`-element row, each 8-byte aligned, and `Y` is `T`'s
/// size.
#[inline(always)]
unsafe fn add_residual_half_packs<T: Element, Y: Element, S: Team>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    n: u32,
) {
    let width = T::PACK / 2;
    let (chunks, size) = (n / width as u32, S::size());
    let mut c = S::rank();
    while c < chunks {
        let column = |u: usize| (c + u as u32 * size) * width as u32;
        let in_row = |u: usize| c + (u as u32) * size < chunks;
        let (mut xs, mut rs) = (
            [[0.0; MAX_PACK]; ADD_BATCH_HALF_PACKS],
            [[0.0; MAX_PACK]; ADD_BATCH_HALF_PACKS],
        );
        each_slot::<ADD_BATCH_HALF_PACKS>(|u| {
            if in_row(u) {
                // SAFETY: half pack c + u size lies inside the row, 8-byte aligned.
                xs[u] = unsafe { read_half_pack(x, column(u), width) };
            }
        });
        each_slot::<ADD_BATCH_HALF_PACKS>(|u| {
            if in_row(u) {
                // SAFETY: as above.
                rs[u] = unsafe { read_half_pack(residual, column(u), width) };
            }
        });
        each_slot::<ADD_BATCH_HALF_PACKS>(|u| {
            if in_row(u) {
                let mut s: Pack = [0.0; MAX_PACK];
                for k in 0..width {
                    s[k] = xs[u][k] + rs[u][k];
                }
                // SAFETY: as above.
                unsafe { write(sum, column(u), width, &s) };
            }
        });
        c += ADD_BATCH_HALF_PACKS as u32 * size;
    }
    // SAFETY: the caller's guarantee.
    unsafe { add_residual_elements::<T, Y, S, 1>(x, residual, sum, chunks * width as u32, n) };
}

/// The residual add of a row whose x, residual and sum (x of s's size) sit equally far past
/// a 16-byte boundary (the streamed kernel's, sm_90): the packs from the row's first
/// boundary on, pack c by rank c mod size as the shifted walks read them back
/// ([`SHIFTED_PACKS`]), `SUM_BATCH` a rank at a time, every load of a batch before its
/// first store, x and the residual evict-first; then the columns before the boundary and
/// after the last whole pack, as [`for_each_edge_column`] hands them out to every pass.
/// Element by element, each 16 bytes of f16 took 8 loads of x, 8 of the residual and 8
/// stores.
///
/// # Safety
/// x, residual and sum hold the `n`-element row, each as far past a 16-byte boundary, at a
/// whole element; `Y` is `T`'s size.
#[inline(always)]
unsafe fn add_residual_shifted<T: Element, Y: Element, S: Team>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    n: u32,
) {
    let head = head_elements(sum, n);
    let packs = (n - head) / T::PACK as u32;
    let column = |p: u32| head + p * T::PACK as u32;
    for_each_batched::<S, (Pack, Pack), SUM_BATCH, false>(
        0,
        packs,
        // SAFETY: pack p < packs lies inside the row, from its first 16-byte boundary, where
        // x's, the residual's and sum's packs all start.
        |p| unsafe {
            (
                Y::unpack(load_pack::<Y, Y, true>(x.add(column(p) as usize))),
                T::unpack(load_pack::<T, T, true>(residual.add(column(p) as usize))),
            )
        },
        |p, (xv, rv)| {
            let mut s: Pack = [0.0; MAX_PACK];
            for k in 0..T::PACK {
                s[k] = xv[k] + rv[k];
            }
            // SAFETY: as above.
            unsafe { write(sum, column(p), T::PACK, &s) };
        },
    );
    // SAFETY: the caller's guarantee.
    unsafe { add_residual_edges::<T, Y, S>(x, residual, sum, n, head, column(packs)) };
}

/// The residual add of a shifted row's columns before `head` and from `tail` on, as
/// [`for_each_edge_column`] hands them out to every pass that reads s back.
///
/// # Safety
/// x, residual and sum hold the `n`-element row.
#[inline(always)]
unsafe fn add_residual_edges<T: Element, Y: Element, S: Team>(
    x: *const Y,
    residual: *const T,
    sum: *mut T,
    n: u32,
    head: u32,
    tail: u32,
) {
    for_each_edge_column::<S>(S::rank(), n, head, tail, |j| {
        let mut s: Pack = [0.0; MAX_PACK];
        // SAFETY: j < n, inside the row.
        unsafe {
            s[0] = read(x, j, 1)[0] + read(residual, j, 1)[0];
            write(sum, j, 1, &s);
        }
    });
}

/// The pivot of a row no thread writes ([`chunk_stats`]): its first value, read when called
/// (by every rank of the team: one load a warp).
///
/// # Safety
/// `row` holds `n` elements.
#[inline(always)]
unsafe fn first_value<T: Element>(row: *const T, n: u32) -> impl FnOnce() -> f32 {
    // SAFETY: element 0 lies in the row where n > 0 (the caller's guarantee).
    move || if n > 0 { unsafe { read(row, 0, 1)[0] } } else { 0.0 }
}

/// The pivot of a residual forward's row of s, which the team writes: x's and the
/// residual's first values summed, which no thread writes ([`first_value`]).
///
/// # Safety
/// `x` and `residual` hold `n` elements.
#[inline(always)]
unsafe fn residual_pivot<T: Element, Y: Element>(x: *const Y, residual: *const T, n: u32) -> f32 {
    // SAFETY: the caller's guarantee.
    unsafe { first_value(x, n)() + first_value(residual, n)() }
}

/// The statistics of a chunk's values (a pack, a batch or an element of a streamed
/// LayerNorm row) less `pivot`, a value near the row's (its first): merged about it, the
/// means and their differences in Chan's merges are of the row's spread, not its values,
/// and a row whose mean is 1000 times its spread keeps its digits (merged about 0, single
/// elements' merges on a warp lost rstd to 1.9e-5 of the float64 reference at bf16 N =
/// 1000; docs/PERF.md v61). f32 values are taken less the pivot one by one, before their
/// sums round. A chunk of 16-bit values (a power of two of them, at most 32, each of 8 or
/// 11 significant bits) sums exactly in f32, and its mean is exact, where they lie near one
/// another, the one case where the pivot matters: its mean is taken less the pivot once,
/// the same number (one subtraction a value cost f16 N = 4100 3.8%).
#[inline(always)]
fn chunk_stats<T: Element>(v: &[f32], pivot: f32) -> Stats {
    if size_of::<T>() < size_of::<f32>() {
        Stats::of(v, 0.0).less(pivot)
    } else {
        Stats::of(v, pivot)
    }
}

/// One row, holding `HELD` packs per rank in registers: writes y and returns the row's
/// normalization, or writes nothing where its statistics overflowed (None: the caller
/// then takes [`forward_row_huge`], once per kernel rather than once per path).
///
/// # Safety
/// As for [`forward_rows`], for one row; all four pointers aligned to `CHUNK`'s bytes
/// ([`crate::row::chunk_of`]); with `HELD` > 0, whole packs, and the row [`fits`].
#[inline(always)]
unsafe fn forward_row<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const CHUNK: usize,
    const HELD: usize,
>(
    x: *const T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    eps: f32,
    pivot: impl FnOnce() -> f32,
) -> Option<RowNorm<CENTERED>> {
    // SAFETY: with HELD > 0 the row is packed and fits (the caller's guarantee).
    let held = unsafe { Held::<HELD>::load::<T, S>(x, if CHUNK == PACKS { n / T::PACK as u32 } else { 0 }) };
    // SAFETY: `held` holds the row's first packs; the rest as for this function.
    unsafe { normalize_row::<T, Y, W, S, CENTERED, CHUNK, HELD>(&held, x, affine, y, n, eps, pivot) }
}

/// [`forward_row`] past its loads: the statistics and y of the row at `x`, whose first
/// packs (this rank's) `held` holds. `pivot` gives the same value near the row's to every
/// rank, about which LayerNorm's streamed rows merge their statistics ([`chunk_stats`]);
/// called on those rows only.
///
/// # Safety
/// As for [`forward_row`]; `held` holds this rank's packs of the row at `x`, which this
/// rank reads where not held (the row this rank wrote, or one no thread writes).
#[inline(always)]
unsafe fn normalize_row<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const CHUNK: usize,
    const HELD: usize,
>(
    held: &Held<HELD>,
    x: *const T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    eps: f32,
    pivot: impl FnOnce() -> f32,
) -> Option<RowNorm<CENTERED>> {
    // Pass 1: statistics, with every subtraction between numbers of the row's own scale.
    let (mean, m2) = if HELD > 0 {
        // Held rows: passes over registers, plain sums (no divisions in the reductions):
        // M2 = sum (x - mean)^2 about the mean (LayerNorm) or 0 (RMSNorm).
        // SAFETY: held rows are packed and fit.
        let mean = row_mean::<S, CENTERED>(|| unsafe { rank_sum::<T, S, CHUNK, HELD>(held, x, n) }, n);
        // SAFETY: as above.
        (
            mean,
            S::sum(unsafe { rank_m2::<T, S, CHUNK, HELD>(held, x, n, mean) }),
        )
    } else if !CENTERED {
        // RMSNorm's other rows: the sum of x^2 as the held rows take it, in one pass over
        // memory, where Chan's merges took a division a pack, or an element (v56).
        let mut squares = 0.0;
        // SAFETY: as for this function: the row is x's, aligned to its chunks.
        unsafe {
            for_each_read_values::<T, S, CHUNK>(x, n, |v| {
                for &v in v {
                    squares = fma(v, v, squares);
                }
            })
        };
        (0.0, S::sum(squares))
    } else {
        // LayerNorm's other rows: one pass over memory. Each pack's (or batch of half packs'
        // or elements') own (mean, M2) is exact in registers, and Chan's merges combine them:
        // a division a merge, a batch one merge, each chunk's values taken less the pivot.
        let pivot = pivot();
        let mut stats = Stats::EMPTY;
        if CHUNK == PACKS {
            for_each_chunk::<T, S, PACKS, 0>(n, |j, len, _| {
                // SAFETY: for_each_chunk yields in-bounds chunks, whole packs aligned.
                let v = unsafe { read(x, j, len) };
                stats = stats.merge(chunk_stats::<T>(&v[..len], pivot));
            });
        } else {
            // SAFETY: as for this function.
            unsafe {
                for_each_read_values::<T, S, CHUNK>(x, n, |v| stats = stats.merge(chunk_stats::<T>(v, pivot)))
            };
        }
        let stats = S::reduce_stats(stats);
        (pivot + stats.mean, stats.m2)
    };
    let norm = RowNorm::of(mean, m2, n, eps)?;
    // SAFETY: as for this function.
    unsafe { write_y::<T, Y, W, S, CENTERED, CHUNK, HELD>(held, x, affine, y, n, norm) };
    Some(norm)
}

/// The forward of a row whose f32 statistics overflowed (M2 not finite: |x_j - mean| past
/// about 1.8e19, a mean past f32's range, or a NaN or an infinity in the row): the
/// statistics again, of x_j * [`HUGE_ROW_SCALE`] (see [`RowNorm::of_scaled`]), then y. The
/// row is read from memory again, element by element: the fast paths' registers are dead
/// on this branch, so it costs them none.
///
/// # Safety
/// As [`forward_row`] requires, without alignment.
#[inline(always)]
unsafe fn forward_row_huge<T: Element, Y: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    x: *const T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    eps: f32,
) -> RowNorm<CENTERED> {
    // Plain passes for the statistics (LayerNorm's mean, then M2), as the held rows take
    // them: no divisions, and fewer live values than Chan's merges.
    let scaled = |j: u32| {
        // SAFETY: for_each_chunk yields in-bounds elements.
        unsafe { read(x, j, 1)[0] * HUGE_ROW_SCALE }
    };
    let mean = row_mean::<S, CENTERED>(
        || {
            let mut sum = 0.0;
            for_each_chunk::<T, S, ELEMENTS, 0>(n, |j, _, _| sum += scaled(j));
            sum
        },
        n,
    );
    let mut m2 = 0.0;
    for_each_chunk::<T, S, ELEMENTS, 0>(n, |j, _, _| {
        let d = scaled(j) - mean;
        m2 = fma(d, d, m2);
    });
    let norm = RowNorm::of_scaled(mean, S::sum(m2), n, eps);
    for_each_chunk::<T, S, ELEMENTS, 0>(n, |j, len, _| {
        // SAFETY: as above; the caller's guarantee for y, gamma and beta.
        unsafe {
            write_y_chunk::<T, _, _, CENTERED, CENTERED, false, true, false>(
                affine,
                y,
                j,
                len,
                read(x, j, len),
                norm,
            )
        }
    });
    norm
}

/// One aligned row too long to hold whole: `PART_HELD` packs a rank in registers, the rest
/// [`Staged`] in shared memory, all of it read from DRAM once with every load in flight
/// together; then the held rows' arithmetic over both (mean, then M2, or RMSNorm's sum of
/// squares; then y). Returns
/// None, having written nothing, as [`forward_row`] does.
///
/// # Safety
/// As for [`forward_rows`], for one row; all four pointers 16-byte aligned; `staged`
/// [`Staged::holds`] the row, and its shared memory is this block's one team's.
#[inline(always)]
unsafe fn forward_row_staged<T: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    x: *const T,
    affine: Affine<W>,
    y: *mut T,
    n: u32,
    eps: f32,
    staged: Staged<PART_HELD>,
) -> Option<RowNorm<CENTERED>> {
    // SAFETY: the row is aligned whole packs (its tail elements are read one by one by the
    // passes below) and the staging holds the packs past the held ones. The previous row's
    // staged values were all in registers before its y stores, which precede this fill.
    let held = unsafe {
        let held = Held::<PART_HELD>::load::<T, S>(x, n / T::PACK as u32);
        staged.fill::<T, S>(x, n);
        held
    };
    // SAFETY: as above; this rank filled the staging with this row.
    unsafe { normalize_staged::<T, T, W, S, CENTERED>(&held, x, affine, y, n, eps, staged) }
}

/// [`forward_row_staged`] past its loads: the statistics and y of the row at `x`, whose
/// packs `held` holds (this rank's first `PART_HELD`) and `staged` the rest of this rank's.
///
/// # Safety
/// As for [`forward_row_staged`]; this rank filled `held` and `staged` with the row at `x`,
/// whose tail elements it reads there (the row this rank wrote, or one no thread writes).
#[inline(always)]
unsafe fn normalize_staged<T: Element, Y: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    held: &Held<PART_HELD>,
    x: *const T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    eps: f32,
    staged: Staged<PART_HELD>,
) -> Option<RowNorm<CENTERED>> {
    let mean = row_mean::<S, CENTERED>(
        || {
            // SAFETY: the caller's guarantee: `held`, the staging and x are this row's.
            let mut sum = unsafe { rank_sum::<T, S, PACKS, PART_HELD>(held, x, n) };
            // SAFETY: the staging holds this row's packs past the held ones, filled by
            // this rank.
            unsafe { staged.for_each::<T, S>(n, |_, v| sum += v[..T::PACK].iter().sum::<f32>()) };
            sum
        },
        n,
    );
    // SAFETY: as for the sum: `held` and x are this row's.
    let mut m2 = unsafe { rank_m2::<T, S, PACKS, PART_HELD>(held, x, n, mean) };
    // SAFETY: as for the sum: the staging is this rank's copy of this row.
    unsafe {
        staged.for_each::<T, S>(n, |_, v| {
            for &v in &v[..T::PACK] {
                m2 = fma(v - mean, v - mean, m2);
            }
        })
    };
    let norm = RowNorm::of(mean, S::sum(m2), n, eps)?;
    // SAFETY: y holds the row and gamma, beta its n columns (the caller's guarantee), all
    // 16-byte aligned; `held` and the staging hold this row's x.
    unsafe {
        write_y::<T, Y, W, S, CENTERED, PACKS, PART_HELD>(held, x, affine, y, n, norm);
        staged.for_each::<T, S>(n, |j, v| {
            write_y_chunk::<T, _, _, CENTERED, CENTERED, false, true, false>(affine, y, j, T::PACK, v, norm)
        });
    }
    Some(norm)
}

/// This rank's sum of the row's x.
///
/// # Safety
/// As [`forward_row`] requires of `x` and `n`; `held` holds the row's first packs.
#[inline(always)]
unsafe fn rank_sum<T: Element, S: StatsTeam, const CHUNK: usize, const HELD: usize>(
    held: &Held<HELD>,
    x: *const T,
    n: u32,
) -> f32 {
    let mut sum = 0.0;
    for_each_chunk::<T, S, CHUNK, HELD>(n, |j, len, slot| {
        // SAFETY: for_each_chunk yields in-bounds chunks, whole chunks aligned.
        let v = unsafe { values(held, x, j, len, slot) };
        sum += v[..len].iter().sum::<f32>();
    });
    sum
}

/// This rank's sum of (x - mean)^2 over the row.
///
/// # Safety
/// As for [`rank_sum`].
#[inline(always)]
unsafe fn rank_m2<T: Element, S: StatsTeam, const CHUNK: usize, const HELD: usize>(
    held: &Held<HELD>,
    x: *const T,
    n: u32,
    mean: f32,
) -> f32 {
    let mut m2 = 0.0;
    for_each_chunk::<T, S, CHUNK, HELD>(n, |j, len, slot| {
        // SAFETY: as for rank_sum.
        let v = unsafe { values(held, x, j, len, slot) };
        for &v in &v[..len] {
            m2 = fma(v - mean, v - mean, m2);
        }
    });
    m2
}

/// y = xhat * (gamma + offset) + beta over the row (RMSNorm: no beta; xhat as `norm` gives
/// it, the weights as [`Affine`] holds them), x from registers where held. A
/// streamed row is read again: from L2, not DRAM, while the rows in flight fit there.
///
/// # Safety
/// As [`forward_row`] requires; `held` holds the row's first packs.
#[inline(always)]
unsafe fn write_y<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const CHUNK: usize,
    const HELD: usize,
>(
    held: &Held<HELD>,
    x: *const T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    norm: RowNorm<CENTERED>,
) {
    if HELD == 0 && (CHUNK != PACKS || !CENTERED) {
        // Rows read again, RMSNorm's, those read element by element and shifted rows: a batch
        // of loads at once. (LayerNorm's packs go one at a time: 4 at once, with gamma's and
        // beta's, lost 6% at f32 N = 131072 and 24% at bf16 262144, after v54.) A shifted
        // row's batches are its packs from its first 16-byte boundary, where y's lie too,
        // each with its weights' columns off their boundaries; a pack at a time, each rank
        // had 16 bytes of x in flight for L2's whole latency (batches: RMSNorm's f32 N =
        // 2051 and 4097 +3.8%, docs/PERF.md v78).
        // SAFETY: as for this function: the row is x's, aligned to its chunks.
        unsafe {
            if CHUNK == SHIFTED_PACKS {
                for_each_read::<T, S, CHUNK>(x, n, |j, len, v| {
                    write_y_chunk::<T, _, _, CENTERED, CENTERED, false, true, true>(
                        affine, y, j, len, *v, norm,
                    )
                })
            } else {
                for_each_read::<T, S, CHUNK>(x, n, |j, len, v| {
                    write_y_chunk::<T, _, _, CENTERED, CENTERED, false, true, false>(
                        affine, y, j, len, *v, norm,
                    )
                })
            }
        };
        return;
    }
    for_each_chunk::<T, S, CHUNK, HELD>(n, |j, len, slot| {
        // SAFETY: for_each_chunk yields in-bounds chunks, whole chunks aligned.
        unsafe {
            write_y_chunk::<T, _, _, CENTERED, CENTERED, false, true, false>(
                affine,
                y,
                j,
                len,
                values(held, x, j, len, slot),
                norm,
            )
        }
    });
}

/// y of the streamed residual forward's row from s read back, only the packs this rank
/// wrote (from L2, the rows in flight fitting there), both s's read, its last, and y's
/// store evict-first, so that L2 keeps the other rows' s until they are read back. With
/// x's and the residual's loads evict-first too, DRAM reads fell from 1595 to 1080 MB (x
/// and the residual once) at f32 N = 32768, M = 4096 (ncu, docs/PERF.md v41). The weights
/// go through L1's coherent path: with the read-only one ptxas fits these kernels in 32
/// registers, and they lost 4-11% (docs/PERF.md, after v50).
///
/// # Safety
/// s, y, gamma and beta (LayerNorm's) hold the row, whole packs, aligned; this rank wrote
/// its packs of s.
#[inline(always)]
unsafe fn write_y_streamed<T: Element, Y: Element, W: Element, S: Team, const CENTERED: bool>(
    s: *const T,
    affine: Affine<W>,
    y: *mut Y,
    n: u32,
    norm: RowNorm<CENTERED>,
) {
    let mut p = S::rank();
    while p < n / T::PACK as u32 {
        let j = p * T::PACK as u32;
        // SAFETY: p is a whole pack of the row, aligned (the caller's guarantee).
        unsafe {
            let sv = T::unpack(load_pack::<T, T, true>(s.add(j as usize)));
            write_y_chunk::<T, Y, W, CENTERED, CENTERED, true, false, false>(affine, y, j, T::PACK, sv, norm);
        }
        p += S::size();
    }
}

/// y of chunk (`j`, `len`) of a row of type `T` from its values `xv`, whose xhat `norm`
/// gives (x's own, or for the pipelined block's centred d_j [`RowNorm::centred`]'s), y of
/// type `Y` (T's, or f16/bf16 beside a residual stream in f32), stored evict-first where
/// `EVICT_FIRST` ([`write_with`]), the weights read through the read-only path where
/// `WEIGHTS_READ_ONLY` ([`read_cached`]), and where `WEIGHTS_SHIFTED` from columns off
/// their vector boundaries (a shifted row's packs: `element::read_cached_shifted`).
/// RMSNorm's read no beta.
///
/// # Safety
/// The chunk lies inside the row; a whole pack of `T`'s columns is aligned to its size in
/// y, and in gamma and beta (LayerNorm's) unless `WEIGHTS_SHIFTED`.
#[inline(always)]
unsafe fn write_y_chunk<
    T: Element,
    Y: Element,
    W: Element,
    const CENTERED: bool,
    const X_CENTERED: bool,
    const EVICT_FIRST: bool,
    const WEIGHTS_READ_ONLY: bool,
    const WEIGHTS_SHIFTED: bool,
>(
    affine: Affine<W>,
    y: *mut Y,
    j: u32,
    len: usize,
    xv: Pack,
    norm: RowNorm<X_CENTERED>,
) {
    let mut out = xv;
    // SAFETY: the caller's guarantee.
    unsafe {
        for_each_weight_pack::<W, WEIGHTS_READ_ONLY, WEIGHTS_SHIFTED>(affine.gamma, j, len, |at, step, g| {
            if CENTERED {
                let b =
                    read_weights::<W, WEIGHTS_READ_ONLY, WEIGHTS_SHIFTED>(affine.beta, j + at as u32, step);
                for k in 0..step {
                    out[at + k] =
                        y_of::<CENTERED, X_CENTERED>(norm, xv[at + k], g[k] + affine.gamma_offset, b[k]);
                }
            } else {
                for k in 0..step {
                    out[at + k] =
                        y_of::<CENTERED, X_CENTERED>(norm, xv[at + k], g[k] + affine.gamma_offset, 0.0);
                }
            }
        })
    };
    // SAFETY: as above.
    unsafe { write_with::<Y, EVICT_FIRST>(y, j, len, &out) };
}

/// One element's y from its x (or the centred d_j that `norm` takes), its weight with the
/// offset added, and beta:
///   y_j = xhat_j * (gamma_j + gamma_offset) + beta_j
/// RMSNorm's (`CENTERED` = false) without beta. A multiply and an add, not one fma: see the
/// module's last paragraph.
#[inline(always)]
fn y_of<const CENTERED: bool, const X_CENTERED: bool>(
    norm: RowNorm<X_CENTERED>,
    x: f32,
    weight: f32,
    beta: f32,
) -> f32 {
    let scaled = norm.xhat(x) * weight;
    if CENTERED { scaled + beta } else { scaled }
}

/// Packs per rank the pipelined forward holds for each of its two rows in flight.
const PIPE_HELD: usize = crate::layout::PIPE_HELD as usize;
/// Packs per rank the pipelined block holds of f32 rows whose next row waits in shared memory.
const STAGED_F32_HELD: usize = crate::layout::STAGED_F32_HELD as usize;

/// The forward of launches whose rows are all whole aligned packs that fit `PIPE_HELD` a
/// rank (the host checks): the same arithmetic as [`forward_row`]'s held rows, but the
/// team's next row is loaded right after this row's first sum, before its reductions, so
/// its loads are in flight while this row is reduced and written (two rows in flight per
/// team).
///
/// # Safety
/// As for [`forward_rows`], without a residual (the host takes
/// [`forward_rows_residual_pipelined`] for those); x, y, gamma and beta 16-byte aligned,
/// `n` a whole number of packs that [`fits`] `PIPE_HELD` per rank.
#[inline(always)]
unsafe fn forward_rows_pipelined<T: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    p: Forward<T, W>,
) {
    // SAFETY: the caller's guarantee.
    unsafe { forward_rows_held::<T, W, S, CENTERED, true>(p) }
}

/// The forward of a team for every row (the host launches one a row), holding its row
/// only: [`forward_rows_pipelined`]'s arithmetic with no next row loaded ahead. A rank
/// then keeps 4 packs, not 8, and the kernel fits fewer registers, so that more blocks,
/// each with its row's loads in flight, fit a multiprocessor.
///
/// # Safety
/// As for [`forward_rows_pipelined`].
#[cfg(layernorm_sm90)]
#[inline(always)]
unsafe fn forward_rows_row_block<T: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    p: Forward<T, W>,
) {
    // SAFETY: the caller's guarantee.
    unsafe { forward_rows_held::<T, W, S, CENTERED, false>(p) }
}

/// [`forward_rows_pipelined`] (`PREFETCH`) and `forward_rows_row_block` (sm_90).
///
/// # Safety
/// As for [`forward_rows_pipelined`].
#[inline(always)]
unsafe fn forward_rows_held<
    T: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const PREFETCH: bool,
>(
    p: Forward<T, W>,
) {
    let x = p.x.ptr();
    let n = p.n as usize;
    // SAFETY: the caller's guarantee; `load` reads rows below `rows` only (`pipeline`'s).
    unsafe {
        pipeline::<T, T, W, S, CENTERED, false, PREFETCH, _>(
            p,
            x,
            |row, packs| Held::load::<T, S>(x.wrapping_add(row as usize * n), packs),
            |held, _| held,
        )
    }
}

/// [`forward_rows_pipelined`] for a block team. LayerNorm's rows of f16 and bf16, and its
/// f32 rows of more than 2048 packs (`layout::registry::pipeline_stages`; the host sizes
/// the launch by the same rule), keep the team's next row in shared memory rather than in
/// registers: each rank copies its packs of the next row into slots of its own (`cp.async`,
/// no registers held while they are in flight) once it has read this row's from them, and
/// reads them back when the row comes up. With one row in registers, that row is kept
/// widened to f32 ([`pipeline_widened`]), in the 64 registers of a 1024-thread block: 4
/// packs a rank of 16-bit rows, 6 of f32 rows (`layout::STAGED_F32_HELD`), whose teams then
/// have two thirds of the ranks. Beside f32 weights (whose y needs more registers) a 16-bit
/// row stays raw words, widened on each pass, and the kernel fits 56 registers (the
/// registry's bound).
///
/// # Safety
/// As for [`forward_rows_pipelined`], but that the rows fit
/// `layout::pipelined_block_held` packs a rank; the block's dynamic shared memory holds
/// `layout::pipelined_smem` bytes.
#[inline(always)]
unsafe fn forward_rows_pipelined_block<T: Element, W: Element, S: StatsTeam, const CENTERED: bool>(
    p: Forward<T, W>,
) {
    let norm = if CENTERED { Norm::Layer } else { Norm::Rms };
    let packs = p.n / T::PACK as u32;
    if !pipeline_stages(norm, size_of::<T>(), packs) {
        // SAFETY: the caller's guarantee.
        return unsafe { forward_rows_pipelined::<T, W, S, CENTERED>(p) };
    }
    // Slot p holds pack p of the row (a staging with no held packs before it).
    let next_row = Staged::<0>::after(SCRATCH_BYTES);
    if size_of::<W>() == size_of::<T>() {
        // SAFETY: the caller's guarantee, and the launch's shared memory holds the slots.
        return unsafe {
            match crate::layout::pipelined_block_held(norm, size_of::<T>(), packs) as usize {
                STAGED_F32_HELD => pipeline_widened::<T, W, S, CENTERED, STAGED_F32_HELD>(p, next_row),
                _ => pipeline_widened::<T, W, S, CENTERED, PIPE_HELD>(p, next_row),
            }
        };
    }
    let (x, n) = (p.x.ptr(), p.n as usize);
    // SAFETY: the caller's guarantee; `load` copies rows below `rows` only (`pipeline`'s),
    // each rank into the slots of the packs it holds, which the launch's shared memory has;
    // `hold` waits for this rank's copies before it reads them, and `pipeline` calls `load`
    // again only after the row's first sum has used every value `hold` read.
    unsafe {
        pipeline::<T, T, W, S, CENTERED, false, true, _>(
            p,
            x,
            |row, packs| {
                next_row.fill_held_async::<T, S, PIPE_HELD>(x.wrapping_add(row as usize * n), packs);
                packs
            },
            |packs, _| {
                cp_async_wait_all();
                next_row.held::<S, PIPE_HELD>(packs)
            },
        )
    }
}

/// The pipelined block's loop over its team's rows where the next row waits in shared
/// memory: each rank copies its packs of the next row into slots of its own (`cp.async`,
/// no registers held while they are in flight) as soon as it has read this row's, and reads
/// them back when the row comes up. With one row in registers, that row is kept widened
/// ([`Widened`]) and centred in place by the M2 pass ([`normalize_widened`]): about 10
/// instructions an element where widening x again for each pass took 23 (a `Held` row,
/// docs/PERF.md v31).
///
/// # Safety
/// As for [`forward_rows_pipelined`], but that the rows fit `H` packs a rank; `next_row`'s
/// slots are the block's dynamic shared memory past the scratch, `H` packs a rank
/// (`layout::pipelined_smem`).
#[inline(always)]
unsafe fn pipeline_widened<T: Element, W: Element, S: StatsTeam, const CENTERED: bool, const H: usize>(
    p: Forward<T, W>,
    next_row: Staged<0>,
) {
    let (x, y, affine) = (p.x.ptr(), p.y.ptr(), Affine::of(p));
    let (mean, rstd, rows, n, eps) = (p.mean.ptr(), p.rstd.ptr(), p.rows, p.n, p.eps);
    let packs = n / T::PACK as u32;
    let row_at = |row: u32| x.wrapping_add(row as usize * n as usize);
    let row_packs = |row: u32| if row < rows { packs } else { 0 };
    let mut row = S::id();
    // SAFETY: rows below `rows` are whole aligned packs with a slot each (the caller's
    // guarantee); past the last row nothing is copied.
    unsafe { next_row.fill_held_async::<T, S, H>(row_at(row), row_packs(row)) };
    while row < rows {
        let next = row + S::count();
        cp_async_wait_all();
        // SAFETY: this rank copied the row's packs into its slots and waited for them.
        let mut v = Widened::of::<T, S>(&unsafe { next_row.held::<S, H>(packs) }, packs);
        let mut sum = 0.0;
        v.for_each::<T, S>(|_, x| sum += x[..T::PACK].iter().sum::<f32>());
        // The slots are read (their values are in the sum): the next row's copies go out.
        // SAFETY: as before the loop.
        unsafe { next_row.fill_held_async::<T, S, H>(row_at(next), row_packs(next)) };
        // SAFETY: row < rows: the row lies inside x and y, its statistics inside mean and
        // rstd; its packs are whole and aligned in y, gamma and beta, and `v` holds this
        // rank's.
        unsafe {
            let (x_row, y_row) = (row_at(row), y.add(row as usize * n as usize));
            let norm = normalize_widened::<T, W, S, CENTERED, H>(v, sum, affine, x_row, y_row, n, eps);
            norm.publish::<S>(mean.add(row as usize), rstd.add(row as usize));
        }
        row = next;
    }
}

/// A row past its first pass, this rank's packs widened in `v` and their values' sum `sum`:
/// the mean, M2 over the values centred in place, and y written from those:
///   mean = sum_j x_j / n   (RMSNorm: 0)
///   d_j  = x_j - mean,   M2 = sum_j d_j^2
///   y_j  = (d_j * rstd) * (gamma_j + gamma_offset) + beta_j
/// d_j * rstd is [`RowNorm::xhat`] to the bit: where M2 is finite, so is every d_j. Returns
/// the row's normalization; a row whose M2 overflowed is taken on the huge path instead.
///
/// # Safety
/// `v` holds this rank's packs of the row at `x_row`, whose y is at `y_row`; its packs are
/// whole and aligned in y, gamma and beta.
#[inline(always)]
unsafe fn normalize_widened<T: Element, W: Element, S: StatsTeam, const CENTERED: bool, const K: usize>(
    mut v: Widened<K>,
    sum: f32,
    affine: Affine<W>,
    x_row: *const T,
    y_row: *mut T,
    n: u32,
    eps: f32,
) -> RowNorm<CENTERED> {
    let m = row_mean::<S, CENTERED>(|| sum, n);
    let mut m2 = 0.0;
    v.for_each::<T, S>(|_, x| {
        for d in &mut x[..T::PACK] {
            *d -= m;
            m2 = fma(*d, *d, m2);
        }
    });
    match RowNorm::of(m, S::sum(m2), n, eps) {
        Some(norm) => {
            let centred = norm.centred();
            v.for_each::<T, S>(|j, d| {
                // SAFETY: the pack at j is this rank's, whole and aligned in y, gamma and
                // beta (the caller's guarantee).
                unsafe {
                    write_y_chunk::<T, T, W, CENTERED, false, false, true, false>(
                        affine,
                        y_row,
                        j,
                        T::PACK,
                        *d,
                        centred,
                    )
                }
            });
            norm
        }
        // SAFETY: the row at x_row and y_row is whole (the caller's guarantee).
        None => unsafe { forward_row_huge::<T, T, W, S, CENTERED>(x_row, affine, y_row, n, eps) },
    }
}

/// LayerNorm's rows of f16 and bf16 on sm_90 that a warp holds at 2 to `PIPE_HELD` packs a
/// lane (N = 257-1024, aligned), a warp for every row (the host's grid; the loop takes any
/// other). Each lane loads its packs, widens them to f32 once and centres them in place, as
/// [`pipeline_widened`] takes a block team's row:
///   mean = sum_j x_j / n
///   d_j  = x_j - mean,   M2 = sum_j d_j^2
///   y_j  = (d_j * rstd) * (gamma_j + gamma_offset) + beta_j
/// No next row in flight: while a warp waits for its row, the multiprocessor's other warps
/// (32 at 64 registers) have theirs under way. The pipelined warp keeps two rows as raw
/// words and widens x on each of its three passes, 16-22% more instructions a row at N =
/// 768-1024 (ncu), which at these lengths outweighs its second row (H200, docs/PERF.md
/// v43: +0.3 to +7.6% at N = 264-1024 and M = 64 to 65536; beside f32 weights -1.4 to
/// +2.9%). RMSNorm's rows, one pass and no centring lighter, lost 5-8% at M = 16384 this
/// way, and 16-bit rows of one pack a lane 5% at M = 65536: those keep the pipeline.
///
/// # Safety
/// As for [`forward_rows`], without a residual; x, y, gamma and beta 16-byte aligned, `n`
/// a whole number of packs that [`fits`] `K` per rank.
#[cfg(layernorm_sm90)]
#[inline(always)]
unsafe fn forward_rows_widened<T: Element, W: Element, S: StatsTeam, const K: usize>(p: Forward<T, W>) {
    let (x, y, affine) = (p.x.ptr(), p.y.ptr(), Affine::of(p));
    let (mean, rstd, rows, n, eps) = (p.mean.ptr(), p.rstd.ptr(), p.rows, p.n, p.eps);
    let packs = n / T::PACK as u32;
    let mut row = S::id();
    while row < rows {
        let offset = row as usize * n as usize;
        // SAFETY: the row lies inside x and y (row < rows), aligned whole packs that fit K
        // a rank (the caller's guarantee).
        let (x_row, y_row, held) = unsafe {
            let x_row = x.add(offset);
            (x_row, y.add(offset), Held::<K>::load::<T, S>(x_row, packs))
        };
        let mut v = Widened::of::<T, S>(&held, packs);
        let mut sum = 0.0;
        v.for_each::<T, S>(|_, x| sum += x[..T::PACK].iter().sum::<f32>());
        // SAFETY: as above; row < rows, so its statistics lie inside mean and rstd, and its
        // packs are whole and aligned in gamma and beta.
        unsafe {
            let norm = normalize_widened::<T, W, S, true, K>(v, sum, affine, x_row, y_row, n, eps);
            norm.publish::<S>(mean.add(row as usize), rstd.add(row as usize));
        }
        row += S::count();
    }
}

/// As [`forward_rows_pipelined`], the rows normalized being s = x + residual, formed as
/// [`forward_rows_residual`]'s held rows form it: the next row's x and residual are loaded
/// after this row's first sum, and s is added, stored and kept in registers as the row
/// comes up.
///
/// # Safety
/// As for [`forward_rows_pipelined`], with a residual: x, the residual, s, y, gamma and
/// beta 16-byte aligned.
#[inline(always)]
unsafe fn forward_rows_residual_pipelined<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
>(
    p: Forward<Y, W, T>,
) {
    let (x, residual, sum) = (p.x.ptr(), p.residual.ptr(), p.sum.ptr());
    let n = p.n as usize;
    let at = |row: u32| row as usize * n;
    // SAFETY: the caller's guarantee; `load` reads rows below `rows` only, and `hold`
    // stores the row it is given, one below `rows`, into s (`pipeline`'s).
    unsafe {
        pipeline::<T, Y, W, S, CENTERED, true, true, _>(
            p,
            sum.cast_const(),
            |row, packs| {
                (
                    Held::load_as::<T, Y, S>(x.wrapping_add(at(row)), packs),
                    Held::load::<T, S>(residual.wrapping_add(at(row)), packs),
                )
            },
            |(xs, rs), row| {
                let packs = (n / T::PACK) as u32;
                store_sum::<T, Y, S, PIPE_HELD>(xs, rs, sum.wrapping_add(at(row)), packs)
            },
        )
    }
}

/// The pipelined forward's loop over the team's rows: `load(row, packs)` issues the loads
/// of a row's held packs (`packs` 0 past the last row: the pipeline's end, nothing
/// loaded), `hold(loaded, row)` turns them into the row's held values, which are then
/// normalized as the row at `rows_at + row * n`. Without `PREFETCH` (the row block) each
/// row is loaded when it comes up, and nothing ahead. `WRITES_ROWS`: `hold` stored the row it
/// holds (s), so that ranks reading each other's packs of it must synchronize first.
/// LayerNorm's next `load` follows this row's sum, which has used every value `hold` gave
/// (what a `load` into the slots `hold` read from relies on).
///
/// # Safety
/// As for [`forward_rows_pipelined`]; `load` and `hold` are sound for every row below
/// `rows` (and `load` for any row with `packs` 0), and the values `hold` gives are this
/// rank's packs of the row at `rows_at`.
#[inline(always)]
unsafe fn pipeline<
    T: Element,
    Y: Element,
    W: Element,
    S: StatsTeam,
    const CENTERED: bool,
    const WRITES_ROWS: bool,
    const PREFETCH: bool,
    L,
>(
    p: Forward<Y, W, T>,
    rows_at: *const T,
    load: impl Fn(u32, u32) -> L,
    hold: impl Fn(L, u32) -> Held<PIPE_HELD>,
) {
    let (y, affine) = (p.y.ptr(), Affine::of(p));
    let (mean, rstd, rows, n, eps) = (p.mean.ptr(), p.rstd.ptr(), p.rows, p.n, p.eps);
    let row_packs = |row: u32| if row < rows { n / T::PACK as u32 } else { 0 };
    // Without PREFETCH no row is loaded ahead: each is loaded when it comes up.
    let ahead = |row: u32| if PREFETCH { row_packs(row) } else { 0 };
    let mut row = S::id();
    let mut loaded = load(row, ahead(row));
    while row < rows {
        let next = row + S::count();
        let this = if PREFETCH {
            loaded
        } else {
            load(row, row_packs(row))
        };
        let held = hold(this, row);
        let x_row = rows_at.wrapping_add(row as usize * n as usize);
        // The row block's RMSNorm y reads gamma alone, whose pack addresses LLVM would keep
        // across rows: its f32 kernel spilled at 40 registers. Taken anew each row, as
        // `forward_rows` takes them.
        let affine = if !CENTERED && !PREFETCH {
            affine.each_row()
        } else {
            affine
        };
        // LayerNorm's first sum, before which the next row's loads go out (RMSNorm has
        // none: they go out at once, and this row's one pass sums x_j^2).
        let sum = if CENTERED {
            // SAFETY: the row is aligned whole packs that fit, held in `held`.
            unsafe { rank_sum::<T, S, PACKS, PIPE_HELD>(&held, x_row, n) }
        } else {
            0.0
        };
        loaded = load(next, ahead(next));
        let m = row_mean::<S, CENTERED>(|| sum, n);
        // SAFETY: as for the sum: `held` holds this row.
        let m2 = S::sum(unsafe { rank_m2::<T, S, PACKS, PIPE_HELD>(&held, x_row, n, m) });
        // SAFETY: row < rows: the row lies inside y, its statistics inside mean and rstd.
        unsafe {
            let y_row = y.add(row as usize * n as usize);
            let norm = match RowNorm::of(m, m2, n, eps) {
                Some(norm) => {
                    write_y::<T, Y, W, S, CENTERED, PACKS, PIPE_HELD>(&held, x_row, affine, y_row, n, norm);
                    norm
                }
                None => {
                    // The huge path reads the row element by element: with the row this
                    // team's own stores, other ranks' must be visible first (the branch is
                    // the team's).
                    if WRITES_ROWS {
                        S::sync();
                    }
                    forward_row_huge::<T, Y, W, S, CENTERED>(x_row, affine, y_row, n, eps)
                }
            };
            norm.publish::<S>(mean.add(row as usize), rstd.add(row as usize));
        }
        row = next;
    }
}

/// The forward of launches of at most one row a multiprocessor (a block a row; the host
/// checks): there the time is one DRAM round trip and one rank's chain of dependent
/// instructions, not the rows in flight. Each rank issues the loads of its `K` packs of x
/// and of their columns' gamma and beta together ([`HeldAffine`]): one round trip, where
/// the other kernels read the weights after the reductions (a second one, which for many
/// rows L1 serves). Then the held rows' arithmetic, from registers only:
///   mean = sum_j x_j / n,  M2 = sum_j (x_j - mean)^2   (RMSNorm: mean 0)
///   y_j  = xhat_j * (gamma_j + gamma_offset) + beta_j
/// No pipeline, no staging: a block's one row ends the row loop at once.
///
/// # Safety
/// As for [`forward_rows`], without a residual; x, y, gamma and beta 16-byte aligned, `n`
/// a whole number of packs that [`fits`] `K` per rank.
#[inline(always)]
unsafe fn forward_few_rows<T: Element, W: Element, S: StatsTeam, const CENTERED: bool, const K: usize>(
    p: Forward<T, W>,
) {
    let (x, y, affine) = (p.x.ptr(), p.y.ptr(), Affine::of(p));
    let (mean, rstd, rows, n, eps) = (p.mean.ptr(), p.rstd.ptr(), p.rows, p.n, p.eps);
    let packs = n / T::PACK as u32;
    let mut row = S::id();
    while row < rows {
        let offset = row as usize * n as usize;
        // SAFETY: the row lies inside x and y (row < rows), aligned whole packs that fit K
        // a rank; gamma and beta hold its n columns, aligned (the caller's guarantee).
        let (x_row, y_row, held, weights) = unsafe {
            let x_row = x.add(offset);
            let held = Held::<K>::load::<T, S>(x_row, packs);
            (
                x_row,
                y.add(offset),
                held,
                HeldAffine::<K>::load::<T, W, S, CENTERED>(affine, packs),
            )
        };
        // SAFETY: `held` holds the whole row (it fits).
        let m = row_mean::<S, CENTERED>(|| unsafe { rank_sum::<T, S, PACKS, K>(&held, x_row, n) }, n);
        // SAFETY: as above.
        let m2 = S::sum(unsafe { rank_m2::<T, S, PACKS, K>(&held, x_row, n, m) });
        // SAFETY: as above; row < rows, so its statistics lie inside mean and rstd.
        unsafe {
            let norm = match RowNorm::of(m, m2, n, eps) {
                Some(norm) => {
                    weights.write_y::<T, S, CENTERED>(&held, y_row, packs, norm, affine.gamma_offset);
                    norm
                }
                None => forward_row_huge::<T, T, W, S, CENTERED>(x_row, affine, y_row, n, eps),
            };
            norm.publish::<S>(mean.add(row as usize), rstd.add(row as usize));
        }
        row += S::count();
    }
}

/// The gamma and beta (LayerNorm's) of the columns of a rank's held packs of x, slot by
/// slot as [`Held`] holds x, widened to f32 as they are loaded: the few-rows forward's, read
/// together with x so that the row costs one DRAM round trip.
struct HeldAffine<const K: usize> {
    gamma: [Pack; K],
    beta: [Pack; K],
}

impl<const K: usize> HeldAffine<K> {
    /// Loads the weights of this rank's packs among the row's first `packs` packs of `T`
    /// (f32 weights beside 16-bit x: two 16-byte loads a pack).
    ///
    /// # Safety
    /// gamma and beta hold `packs` whole packs of `T`'s columns, aligned.
    #[inline(always)]
    unsafe fn load<T: Element, W: Element, S: Team, const CENTERED: bool>(
        affine: Affine<W>,
        packs: u32,
    ) -> Self {
        let mut weights = HeldAffine {
            gamma: [[0.0; MAX_PACK]; K],
            beta: [[0.0; MAX_PACK]; K],
        };
        each_held_slot::<S, K>(packs, |c, p| {
            let j = p * T::PACK as u32;
            // SAFETY: p < packs: the pack's columns lie inside gamma and beta, aligned.
            unsafe {
                weights.gamma[c] = read_cached::<W, true>(affine.gamma, j, T::PACK);
                if CENTERED {
                    weights.beta[c] = read_cached::<W, true>(affine.beta, j, T::PACK);
                }
            }
        });
        weights
    }

    /// Writes y of this rank's packs of the row (of its first `packs`) from `held`'s x and
    /// these weights.
    ///
    /// # Safety
    /// y holds `packs` whole packs, aligned; `held` and these weights are this rank's of
    /// the same packs.
    #[inline(always)]
    unsafe fn write_y<T: Element, S: Team, const CENTERED: bool>(
        &self,
        held: &Held<K>,
        y: *mut T,
        packs: u32,
        norm: RowNorm<CENTERED>,
        gamma_offset: f32,
    ) {
        each_held_slot::<S, K>(packs, |c, p| {
            let (xv, g, b) = (held.pack::<T>(c), &self.gamma[c], &self.beta[c]);
            let mut out = xv;
            for k in 0..T::PACK {
                out[k] = y_of::<CENTERED, CENTERED>(norm, xv[k], g[k] + gamma_offset, b[k]);
            }
            // SAFETY: p < packs: the pack lies inside y, aligned.
            unsafe { write::<T>(y, p * T::PACK as u32, T::PACK, &out) };
        });
    }
}

/// Exports the residual forward kernels of one norm for x and y of type `$y`, gamma and
/// beta of `$w`, and the residual and s of `$r` (x's own type, or f32 for a residual stream
/// kept in f32): `<norm>_fwd_residual_<kind>_<types>`.
macro_rules! residual_kernels {
    ($prefix:literal, $centered:literal, $types:literal, $y:ty, $w:ty, $r:ty) => {
        residual_kernels!(@one $prefix, $centered, $types, $y, $w, $r, residual_warp, forward_rows_residual, Warp,
            "Forward of x + residual, one warp per row (short rows).");
        residual_kernels!(@one $prefix, $centered, $types, $y, $w, $r, residual_block, forward_rows_residual, Block,
            "Forward of x + residual, one block per row (long rows).");
        residual_kernels!(@one $prefix, $centered, $types, $y, $w, $r, residual_pipelined_warp,
            forward_rows_residual_pipelined, Warp,
            "Forward of x + residual, one warp per row, two rows in flight (rows of aligned packs, 4 a rank).");
        residual_kernels!(@one $prefix, $centered, $types, $y, $w, $r, residual_pipelined_block,
            forward_rows_residual_pipelined, Block,
            "Forward of x + residual, one block per row, two rows in flight (rows of aligned packs, 4 a rank).");
        residual_kernels!(@lean $prefix, $types, $y, $w, $r, residual_streamed, $centered, 0,
            "Forward of x + residual, one block per row, streamed (rows too long to hold, or not aligned).");
    };
    (@lean $prefix:literal, $types:literal, $y:ty, $w:ty, $r:ty, $kind:ident, $centered:literal, $held:expr,
     $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows the kernel
        /// takes (`forward_rows_residual_lean`'s safety section).
        #[unsafe(export_name = concat!($prefix, "_fwd_", stringify!($kind), "_", $types))]
        pub unsafe extern "ptx-kernel" fn $kind(p: Forward<$y, $w, $r>) {
            // SAFETY: the host launches this kernel only as `forward_rows_residual_lean`
            // requires.
            unsafe { forward_rows_residual_lean::<$r, $y, $w, ResidualBlock, $centered, { $held }>(p) }
        }
    };
    (@one $prefix:literal, $centered:literal, $types:literal, $y:ty, $w:ty, $r:ty, $kind:ident, $rows:ident,
     $team:ty, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows the kernel
        /// takes (`$rows`'s safety section).
        #[unsafe(export_name = concat!($prefix, "_fwd_", stringify!($kind), "_", $types))]
        pub unsafe extern "ptx-kernel" fn $kind(p: Forward<$y, $w, $r>) {
            // SAFETY: the host launches this kernel only as `$rows` requires.
            unsafe { $rows::<$r, $y, $w, $team, $centered>(p) }
        }
    };
}

/// Exports the held residual forward kernels (`<norm>_fwd_residual_held_<type>`) of both
/// norms for 16-bit x with weights and a residual stream of its own type, the only pairs
/// the host plans them for (`layout::registry::Variant::has_pair`).
macro_rules! residual_held_kernels {
    ($module:ident, $types:literal, $t:ty) => {
        mod $module {
            use super::*;
            mod layer {
                use super::*;
                residual_held_kernels!(@one "layer_norm", true, $types, $t);
            }
            mod rms {
                use super::*;
                residual_held_kernels!(@one "rms_norm", false, $types, $t);
            }
        }
    };
    (@one $prefix:literal, $centered:literal, $types:literal, $t:ty) => {
        residual_kernels!(@lean $prefix, $types, $t, $t, $t, residual_held, $centered, RESIDUAL_HELD,
            "Forward of x + residual, one block per row, held at 64 registers (rows of aligned packs, 4 a rank).");
    };
}

/// Exports the forward kernels of one type pair (x of type `$t`, gamma and beta of `$w`),
/// `<norm>_fwd_<kind>_<types>`: for each norm (LayerNorm centers its rows, RMSNorm does
/// not), a warp and a block per row, each general, pipelined and with a residual. All take one [`Forward`]
/// (crate::layout::params); the registry (crate::layout::registry) lists the names.
macro_rules! forward_kernels {
    ($module:ident, $types:literal, $t:ty, $w:ty) => {
        mod $module {
            use super::*;
            forward_kernels!(@norm layer, "layer_norm", true, $types, $t, $w);
            forward_kernels!(@norm rms, "rms_norm", false, $types, $t, $w);
        }
    };
    (@norm $norm:ident, $prefix:literal, $centered:literal, $types:literal, $t:ty, $w:ty) => {
        mod $norm {
            use super::*;
            forward_kernels!(@one $prefix, $centered, $types, $t, $w, pipelined_warp, forward_rows_pipelined, Warp,
                "Forward, one warp per row, two rows in flight (rows of aligned packs, 4 a rank).");
            forward_kernels!(@one $prefix, $centered, $types, $t, $w, pipelined_block, forward_rows_pipelined_block, Block,
                "Forward, one block per row, two rows in flight (rows of aligned packs, 4 a rank, or 6 of long f32 rows).");
            /// Forward for launches of at most one row a multiprocessor, a block per row
            /// (rows of aligned packs, `layout::few_rows_held` a rank, with their weights).
            ///
            /// # Safety
            /// Launched by the host with buffers of the documented sizes, on rows the kernel
            /// takes (`forward_few_rows`'s safety section).
            #[unsafe(export_name = concat!($prefix, "_fwd_few_rows_", $types))]
            pub unsafe extern "ptx-kernel" fn few_rows(p: Forward<$t, $w>) {
                const K: usize = crate::layout::few_rows_held(size_of::<$t>() as u32) as usize;
                // SAFETY: the host launches this kernel only as `forward_few_rows` requires.
                unsafe { forward_few_rows::<$t, $w, Block, $centered, K>(p) }
            }
            forward_kernels!(@one $prefix, $centered, $types, $t, $w, warp, forward_rows, Warp,
                "Forward, one warp per row (short rows).");
            forward_kernels!(@one $prefix, $centered, $types, $t, $w, block, forward_rows, Block,
                "Forward, one block per row (long rows).");
            residual_kernels!($prefix, $centered, $types, $t, $w, $t);
        }
    };
    (@one $prefix:literal, $centered:literal, $types:literal, $t:ty, $w:ty, $kind:ident, $rows:ident,
     $team:ty, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows the kernel
        /// takes (`$rows`'s safety section).
        #[unsafe(export_name = concat!($prefix, "_fwd_", stringify!($kind), "_", $types))]
        pub unsafe extern "ptx-kernel" fn $kind(p: Forward<$t, $w>) {
            // SAFETY: the host launches this kernel only as `$rows` requires.
            unsafe { $rows::<$t, $w, $team, $centered>(p) }
        }
    };
}

forward_kernels!(f32_f32, "f32", f32, f32);
forward_kernels!(f16_f16, "f16", crate::element::F16, crate::element::F16);
forward_kernels!(bf16_bf16, "bf16", crate::element::Bf16, crate::element::Bf16);
forward_kernels!(f16_f32, "f16_f32w", crate::element::F16, f32);
forward_kernels!(bf16_f32, "bf16_f32w", crate::element::Bf16, f32);
residual_held_kernels!(f16_held, "f16", crate::element::F16);
residual_held_kernels!(bf16_held, "bf16", crate::element::Bf16);

/// Exports LayerNorm's widened warp forward (`layer_norm_fwd_widened_warp_<types>`) of 16-bit
/// x, in the sm_90 module: the norm, type pairs and architecture the host plans it for
/// (`layout::registry`: `Norm::has`, `Variant::has_pair`, `Variant::sm90_only`).
#[cfg(layernorm_sm90)]
macro_rules! widened_kernels {
    ($module:ident, $types:literal, $t:ty, $w:ty) => {
        mod $module {
            use super::*;
            /// Forward, a warp for every row, x widened once (LayerNorm's 16-bit rows of
            /// aligned packs, 2 to 4 a lane).
            ///
            /// # Safety
            /// Launched by the host with buffers of the documented sizes, on rows the kernel
            /// takes (`forward_rows_widened`'s safety section).
            #[unsafe(export_name = concat!("layer_norm_fwd_widened_warp_", $types))]
            pub unsafe extern "ptx-kernel" fn widened_warp(p: Forward<$t, $w>) {
                // SAFETY: the host launches this kernel only as `forward_rows_widened` requires.
                unsafe { forward_rows_widened::<$t, $w, Warp, PIPE_HELD>(p) }
            }
        }
    };
}

/// Exports the row block forward (`<norm>_fwd_row_block_<type>`) and the held forward over
/// shifted rows (`<norm>_fwd_held_shifted_<type>`) of both norms for x with weights of its
/// type, in the sm_90 module: the type pairs and architecture the host plans them for
/// (`layout::registry`: `Variant::has_pair`, `Variant::sm90_only`).
#[cfg(layernorm_sm90)]
macro_rules! own_type_block_kernels {
    ($module:ident, $types:literal, $t:ty) => {
        mod $module {
            use super::*;
            mod layer {
                use super::*;
                forward_kernels!(@one "layer_norm", true, $types, $t, $t, row_block, forward_rows_row_block, crate::team::NarrowBlock,
                    "Forward, a block for every row, holding its row only (rows of aligned packs, 4 a rank).");
                forward_kernels!(@one "layer_norm", true, $types, $t, $t, held_shifted, forward_rows_held_shifted, Block,
                    "Forward, a block for every row, holding its row from its first 16-byte boundary (rows shifted alike, 4 packs a rank).");
            }
            mod rms {
                use super::*;
                forward_kernels!(@one "rms_norm", false, $types, $t, $t, row_block, forward_rows_row_block, crate::team::NarrowBlock,
                    "Forward, a block for every row, holding its row only (rows of aligned packs, 4 a rank).");
                forward_kernels!(@one "rms_norm", false, $types, $t, $t, held_shifted, forward_rows_held_shifted, Block,
                    "Forward, a block for every row, holding its row from its first 16-byte boundary (rows shifted alike, 4 packs a rank).");
            }
        }
    };
}

#[cfg(layernorm_sm90)]
own_type_block_kernels!(f32_own_block, "f32", f32);
#[cfg(layernorm_sm90)]
own_type_block_kernels!(f16_own_block, "f16", crate::element::F16);
#[cfg(layernorm_sm90)]
own_type_block_kernels!(bf16_own_block, "bf16", crate::element::Bf16);

/// Exports the held residual forward over shifted rows
/// (`<norm>_fwd_residual_held_shifted_<type>`) of both norms for x with weights and a
/// residual stream of its type, in the sm_90 module: the type pairs and architecture the
/// host plans it for (`layout::registry`: `Variant::has_pair`, `Variant::sm90_only`).
#[cfg(layernorm_sm90)]
macro_rules! residual_held_shifted_kernels {
    ($module:ident, $types:literal, $t:ty) => {
        mod $module {
            use super::*;
            mod layer {
                use super::*;
                residual_held_shifted_kernels!(@one "layer_norm", true, $types, $t);
            }
            mod rms {
                use super::*;
                residual_held_shifted_kernels!(@one "rms_norm", false, $types, $t);
            }
        }
    };
    (@one $prefix:literal, $centered:literal, $types:literal, $t:ty) => {
        /// Forward of x + residual, one block per row, held at 64 registers from the
        /// rows' first 16-byte boundary (rows shifted alike, 4 packs a rank).
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows the kernel
        /// takes (`forward_rows_residual_held_shifted`'s safety section).
        #[unsafe(export_name = concat!($prefix, "_fwd_residual_held_shifted_", $types))]
        pub unsafe extern "ptx-kernel" fn residual_held_shifted(p: Forward<$t, $t, $t>) {
            // SAFETY: the host launches this kernel only as
            // `forward_rows_residual_held_shifted` requires.
            unsafe { forward_rows_residual_held_shifted::<$t, $t, ResidualBlock, $centered>(p) }
        }
    };
}

#[cfg(layernorm_sm90)]
residual_held_shifted_kernels!(f32_held_shifted, "f32", f32);
#[cfg(layernorm_sm90)]
residual_held_shifted_kernels!(f16_held_shifted, "f16", crate::element::F16);
#[cfg(layernorm_sm90)]
residual_held_shifted_kernels!(bf16_held_shifted, "bf16", crate::element::Bf16);

#[cfg(layernorm_sm90)]
widened_kernels!(f16_widened, "f16", crate::element::F16, crate::element::F16);
#[cfg(layernorm_sm90)]
widened_kernels!(bf16_widened, "bf16", crate::element::Bf16, crate::element::Bf16);
#[cfg(layernorm_sm90)]
widened_kernels!(f16_f32w_widened, "f16_f32w", crate::element::F16, f32);
#[cfg(layernorm_sm90)]
widened_kernels!(bf16_f32w_widened, "bf16_f32w", crate::element::Bf16, f32);

/// Exports the residual forward kernels of 16-bit x whose residual stream is kept in f32,
/// for both norms.
macro_rules! f32_stream_kernels {
    ($module:ident, $types:literal, $y:ty, $w:ty) => {
        mod $module {
            use super::*;
            mod layer {
                use super::*;
                residual_kernels!("layer_norm", true, $types, $y, $w, f32);
            }
            mod rms {
                use super::*;
                residual_kernels!("rms_norm", false, $types, $y, $w, f32);
            }
        }
    };
}

f32_stream_kernels!(f16_f32s, "f16_f32s", crate::element::F16, crate::element::F16);
f32_stream_kernels!(bf16_f32s, "bf16_f32s", crate::element::Bf16, crate::element::Bf16);
f32_stream_kernels!(f16_f32w_f32s, "f16_f32w_f32s", crate::element::F16, f32);
f32_stream_kernels!(bf16_f32w_f32s, "bf16_f32w_f32s", crate::element::Bf16, f32);
