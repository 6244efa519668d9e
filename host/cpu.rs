//! LayerNorm on the CPU with ndarray: the same math as the kernels, in f32 values with f64
//! sums, so code written against this crate runs (and agrees) where no GPU is.

use std::ops::Range;

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis, s};

mod convert;

pub use convert::RowConvert;

use crate::element::{Element, F32Stream};
use crate::error::Result;
use crate::tensor::host_vec;

/// Elements a thread of the CPU forward or backward takes at the least: below that, starting
/// a thread costs more than the rows it would take.
const ELEMENTS_PER_THREAD: usize = 1 << 16;

/// Per row: y = (x - mean) * rstd * (gamma + gamma_offset) + beta (the offset as the
/// kernels' `Affine` takes it: 1 for zero-centred weights, else -0), with mean and rstd = 1/sqrt(var + eps)
/// (var biased) written out. Two passes over the row for the statistics (mean, then squared
/// deviations), sums in f64, then y. Rows are split over the machine's threads; each thread
/// keeps three rows in flight (see [`forward_rows`]), widened to f32 a [`BLOCK`] at a time
/// (vector conversions for f16 and bf16) and narrowed back the same way, and the sums keep
/// [`LANES`] partial sums, so that the loops vectorize. Its scratch (gamma, beta and, a
/// thread, three widened rows and a block or two) is taken before anything is written, so
/// where host memory cannot hold it the outputs are left as they were.
///
/// With a `residual` (its rows, and s's to write), the rows normalized are
/// s = x + residual, each element summed in f32 and rounded once to `T`, as the kernels form
/// it: in the same row loop, widened and narrowed a block at a time.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: Element, W: Element>(
    x: ArrayView2<'_, T>,
    residual: Option<(ArrayView2<'_, T>, ArrayViewMut2<'_, T>)>,
    gamma: ArrayView1<'_, W>,
    gamma_offset: f32,
    beta: ArrayView1<'_, W>,
    norm: Normalization,
    mut y: ArrayViewMut2<'_, T>,
    mut mean: ArrayViewMut1<'_, f32>,
    mut rstd: ArrayViewMut1<'_, f32>,
) -> Result<()> {
    let (rows, n) = x.dim();
    let during = "allocating the CPU forward's scratch";
    let widened = |v: ArrayView1<'_, W>, offset: f32| -> Result<Vec<f32>> {
        let mut out = host_vec(n, during)?;
        out.extend(v.iter().map(|e| e.to_f32() + offset));
        Ok(out)
    };
    // Beta's offset is -0, which leaves every value's bits (as gamma's does for plain weights).
    let (gamma, beta) = (widened(gamma, gamma_offset)?, widened(beta, -0.0)?);
    let available = std::thread::available_parallelism().map_or(1, |t| t.get());
    let threads = available.min(rows).min((rows * n / ELEMENTS_PER_THREAD).max(1));
    let chunk = rows.div_ceil(threads.max(1)).max(1);
    let block = n.min(BLOCK);
    let mut scratch = Vec::new();
    for _ in 0..threads {
        scratch.push(ForwardScratch {
            xs: zeroed_with(3 * n, during)?,
            ys: zeroed_with(block, during)?,
            rs: if residual.is_some() {
                zeroed_with(block, during)?
            } else {
                Vec::new()
            },
        });
    }
    let (gamma, beta) = (&gamma[..], &beta[..]);
    // Each thread's rows of the residual and of s, where there is one.
    let (residual, mut sum) = residual.unzip();
    let mut residual_runs: Vec<_> = match (&residual, &mut sum) {
        (Some(r), Some(s)) => r
            .axis_chunks_iter(Axis(0), chunk)
            .zip(s.axis_chunks_iter_mut(Axis(0), chunk))
            .map(Some)
            .collect(),
        _ => Vec::new(),
    };
    residual_runs.resize_with(threads, || None);
    let runs = x
        .axis_chunks_iter(Axis(0), chunk)
        .zip(y.axis_chunks_iter_mut(Axis(0), chunk))
        .zip(mean.axis_chunks_iter_mut(Axis(0), chunk))
        .zip(rstd.axis_chunks_iter_mut(Axis(0), chunk))
        .zip(scratch.iter_mut())
        .zip(residual_runs)
        .map(|(((((x, y), mean), rstd), scratch), residual)| RowRun {
            x,
            residual,
            y,
            mean,
            rstd,
            gamma,
            beta,
            norm,
            scratch,
        });
    if threads == 1 {
        // Small problems: no thread to start, the rows run here.
        runs.for_each(run_rows);
        return Ok(());
    }
    std::thread::scope(|s| {
        for run in runs {
            s.spawn(move || run_rows(run));
        }
    });
    Ok(())
}

/// Elements of a row that [`forward_rows`] takes per step of each of its stages: 1 KiB of
/// f32, so that the stages' blocks (and gamma's, beta's and y's) sit in L1 together and each
/// stage's loop is short enough for the core to overlap it with the next stage's (two
/// threads, f16: 256 ran faster than 128 at N = 1024 and 4096, and than 512 at every N). A
/// multiple of [`LANES`], so that the lanes' sums run on across blocks as over a whole row.
const BLOCK: usize = 256;
const _: () = assert!(BLOCK.is_multiple_of(LANES));

/// A thread's scratch in [`forward`]: three widened rows `xs` (one for each stage of
/// [`forward_rows`]), a block of y `ys` and, with a residual, a block of it `rs`.
struct ForwardScratch {
    xs: Vec<f32>,
    ys: Vec<f32>,
    rs: Vec<f32>,
}

/// A run of rows of [`forward`] for one thread, with its scratch and gamma and beta widened.
struct RowRun<'a, T> {
    x: ArrayView2<'a, T>,
    /// The residual's rows and s's.
    residual: Option<(ArrayView2<'a, T>, ArrayViewMut2<'a, T>)>,
    y: ArrayViewMut2<'a, T>,
    mean: ArrayViewMut1<'a, f32>,
    rstd: ArrayViewMut1<'a, f32>,
    gamma: &'a [f32],
    beta: &'a [f32],
    norm: Normalization,
    scratch: &'a mut ForwardScratch,
}

/// A loop over rows that widens them to f32 and narrows its results back, compiled once per
/// instruction set by [`run_rows`] (each `run` is `#[inline(always)]`, so that its loops
/// land inside the variant that calls it).
trait RowLoop<T: Element> {
    fn run(self, widen: impl Fn(&[T], &mut [f32]), narrow: impl Fn(&[f32], &mut [T]));
}

/// Runs `rows`. On x86-64 CPUs with AVX2, FMA and F16C (every x86 server since 2013) its
/// loops are compiled a second time for them: twice the lanes of the SSE2 baseline that a
/// portable build targets, and f16 converted 8 an instruction.
fn run_rows<T: Element>(rows: impl RowLoop<T>) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma_f16c() {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return unsafe { run_rows_avx2(rows) };
    }
    rows.run(T::widen, T::narrow)
}

/// Whether this CPU has AVX2, FMA and F16C (detected once, then cached by std).
#[cfg(target_arch = "x86_64")]
fn avx2_fma_f16c() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// [`run_rows`] compiled for AVX2, FMA and F16C, with the conversions built for them.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_rows_avx2<T: Element>(rows: impl RowLoop<T>) {
    let widen = |src: &[T], dst: &mut [f32]| {
        // SAFETY: this function's own contract: the CPU has AVX2, FMA and F16C.
        unsafe { T::widen_avx2(src, dst) }
    };
    let narrow = |src: &[f32], dst: &mut [T]| {
        // SAFETY: as for `widen`.
        unsafe { T::narrow_avx2(src, dst) }
    };
    rows.run(widen, narrow)
}

/// Columns `cols` of `row` widened into `dst`: one call of `widen` where the row is
/// contiguous.
#[inline(always)]
fn widen_cols<T: Element>(
    row: &ArrayView1<'_, T>,
    cols: Range<usize>,
    dst: &mut [f32],
    widen: &impl Fn(&[T], &mut [f32]),
) {
    match row.as_slice() {
        Some(row) => widen(&row[cols], dst),
        None => dst
            .iter_mut()
            .zip(row.slice(s![cols]))
            .for_each(|(d, v)| *d = v.to_f32()),
    }
}

/// `src` narrowed into columns `cols` of `row`: one call of `narrow` where the row is
/// contiguous.
#[inline(always)]
fn narrow_cols<T: Element>(
    src: &[f32],
    row: &mut ArrayViewMut1<'_, T>,
    cols: Range<usize>,
    narrow: &impl Fn(&[f32], &mut [T]),
) {
    match row.as_slice_mut() {
        Some(row) => narrow(src, &mut row[cols]),
        None => row
            .slice_mut(s![cols])
            .iter_mut()
            .zip(src)
            .for_each(|(d, &v)| *d = T::from_f32(v)),
    }
}

/// The rows of [`forward`]'s run.
impl<T: Element> RowLoop<T> for RowRun<'_, T> {
    #[inline(always)]
    fn run(self, widen: impl Fn(&[T], &mut [f32]), narrow: impl Fn(&[f32], &mut [T])) {
        forward_rows(self, widen, narrow)
    }
}

/// The rows of a [`RowRun`], with the row conversions of one instruction set. Three rows
/// are in flight, one in each stage, and each step runs a block of every stage:
/// 1. a row is read: widened (with a residual, s formed and written) and its first sum
///    taken, of x (LayerNorm) or of x² (RMSNorm);
/// 2. the row before it: its squared deviations from its mean summed (LayerNorm only);
/// 3. the row before that: y formed and narrowed into its row.
///
/// Stage 1 waits on loads from memory, stage 3 on stores to it, and stage 2 on neither.
/// With the passes over a row one after another, the core sat idle while a pass streamed
/// and the memory while a pass summed (one thread, f16, N = 4096: 0.77 ns an element, of
/// which widening and narrowing alone took 0.5); in one loop the core overlaps them
/// (0.6 ns). Each row's sums are the same additions in the same order as a row alone.
#[inline(always)]
fn forward_rows<T: Element>(
    run: RowRun<'_, T>,
    widen: impl Fn(&[T], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [T]),
) {
    let RowRun {
        x,
        mut residual,
        mut y,
        mut mean,
        mut rstd,
        gamma,
        beta,
        norm,
        scratch,
    } = run;
    let ForwardScratch { xs, ys, rs } = scratch;
    let n = gamma.len();
    let (whole, count) = (n - n % LANES, n as f64);
    let (read_xs, rest) = xs.split_at_mut(n);
    let (summed_xs, normalized_xs) = rest.split_at_mut(n);
    // The widened rows of stages 1, 2 and 3; each moves on a stage after every row.
    let mut slots = [read_xs, summed_xs, normalized_xs];
    // LayerNorm: the mean, then the squared deviations from it. RMSNorm: the mean square,
    // with the mean taken as 0 (what `mu` is then written as, too).
    let first_term = |v: f32| {
        if norm.centered {
            v as f64
        } else {
            v as f64 * v as f64
        }
    };
    // Stage 2's row, with its first sum over n: its mean, or its mean square.
    let mut summed: Option<(usize, f64)> = None;
    let mut normalized: Option<RowStats> = None;
    for i in 0..x.nrows() + 2 {
        let read = (i < x.nrows()).then_some(i);
        let [read_xs, summed_xs, normalized_xs] = &mut slots;
        let mu = match summed {
            Some((_, first_mean)) if norm.centered => first_mean,
            _ => 0.0,
        };
        let deviation = |v: f32| (v as f64 - mu) * (v as f64 - mu);
        let (mut first, mut second) = (Lanes::default(), Lanes::default());
        for cols in blocks(n) {
            if let Some(i) = read {
                let xs = &mut read_xs[cols.clone()];
                widen_cols(&x.row(i), cols.clone(), xs, &widen);
                if let Some((res, sum)) = &mut residual {
                    // s = x + residual in f32, rounded once to T (written out), and that
                    // rounded s is the row normalized.
                    let rs = &mut rs[..cols.len()];
                    widen_cols(&res.row(i), cols.clone(), rs, &widen);
                    xs.iter_mut().zip(rs.iter()).for_each(|(v, r)| *v += r);
                    narrow_cols(xs, &mut sum.row_mut(i), cols.clone(), &narrow);
                    widen_cols(&sum.row(i), cols.clone(), xs, &widen);
                }
                // The branch outside the loop, so that each loop is plain vector code.
                if norm.centered {
                    first.add(xs, |v| v as f64);
                } else {
                    first.add(xs, |v| v as f64 * v as f64);
                }
            }
            if summed.is_some() && norm.centered {
                second.add(&summed_xs[cols.clone()], deviation);
            }
            if let Some(stats) = &normalized {
                let ys = &mut ys[..cols.len()];
                stats.normalize(
                    &normalized_xs[cols.clone()],
                    &gamma[cols.clone()],
                    &beta[cols.clone()],
                    ys,
                );
                narrow_cols(ys, &mut y.row_mut(stats.row), cols, &narrow);
            }
        }
        normalized = summed.map(|(row, first_mean)| {
            let var = if norm.centered {
                second.total(&summed_xs[whole..], deviation) / count
            } else {
                first_mean
            };
            let stats = RowStats::new(row, mu, var, norm.eps, count);
            (mean[row], rstd[row]) = (mu as f32, stats.rstd as f32);
            stats
        });
        summed = read.map(|row| (row, first.total(&read_xs[whole..], first_term) / count));
        slots.rotate_right(1);
    }
}

/// The columns of a row of `n` in blocks of [`BLOCK`].
#[inline(always)]
fn blocks(n: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n).step_by(BLOCK).map(move |j| j..(j + BLOCK).min(n))
}

/// A row's statistics, as its y is formed from them.
struct RowStats {
    row: usize,
    mu: f64,
    rstd: f64,
    /// Every |x - mean| is at most sqrt(n var): where that fits f32, xhat in f32 (half the
    /// work of f64, the GPU's arithmetic); else in f64, for rows that span f32's range, where
    /// x - mean itself would overflow.
    in_f32: bool,
}

impl RowStats {
    #[inline(always)]
    fn new(row: usize, mu: f64, var: f64, eps: f32, count: f64) -> RowStats {
        RowStats {
            row,
            mu,
            rstd: 1.0 / (var + eps as f64).sqrt(),
            in_f32: var * count < f32::MAX as f64,
        }
    }

    /// y of a block of the row, `xs`, into `ys`, with that block's gamma and beta.
    #[inline(always)]
    fn normalize(&self, xs: &[f32], gamma: &[f32], beta: &[f32], ys: &mut [f32]) {
        if self.in_f32 {
            let (mu, rs) = (self.mu as f32, self.rstd as f32);
            for (((o, &v), &g), &b) in ys.iter_mut().zip(xs).zip(gamma).zip(beta) {
                *o = (v - mu) * rs * g + b;
            }
        } else {
            let (mu, rs) = (self.mu, self.rstd);
            for (((o, &v), &g), &b) in ys.iter_mut().zip(xs).zip(gamma).zip(beta) {
                *o = ((v as f64 - mu) * rs) as f32 * g + b;
            }
        }
    }
}

/// What a row is divided by: the root of its variance plus eps (LayerNorm, `centered`), or
/// of its mean square plus eps (RMSNorm).
#[derive(Clone, Copy)]
pub(crate) struct Normalization {
    pub(crate) eps: f32,
    pub(crate) centered: bool,
}

/// Partial sums the CPU path keeps apart: independent additions, which the compiler turns into
/// vector instructions (a single running sum would be one long dependency chain).
const LANES: usize = 8;

/// [`LANES`] partial f64 sums over a row, lane k taking the elements at k modulo [`LANES`]
/// in order.
#[derive(Default)]
struct Lanes([f64; LANES]);

impl Lanes {
    /// Adds `f` of the elements of `v`'s whole chunks of [`LANES`] (`v` starting at a
    /// multiple of [`LANES`] in the row).
    #[inline(always)]
    fn add(&mut self, v: &[f32], f: impl Fn(f32) -> f64) {
        let mut lanes = self.0;
        for c in v.as_chunks::<LANES>().0 {
            for k in 0..LANES {
                lanes[k] += f(c[k]);
            }
        }
        self.0 = lanes;
    }

    /// The lanes' sum, plus `f` over `tail` (the row's elements after its last whole chunk).
    #[inline(always)]
    fn total(&self, tail: &[f32], f: impl Fn(f32) -> f64) -> f64 {
        self.0.iter().sum::<f64>() + tail.iter().map(|&x| f(x)).sum::<f64>()
    }
}

/// The most parts the CPU backward splits its rows into. Each part sums its rows' dgamma and
/// dbeta terms apart (f64), and the parts' sums are added in part order: the split depends
/// only on the shape and type, never on the machine's threads, so that the result is the
/// same bits on any machine.
const BACKWARD_PARTS: usize = 16;

/// dx per row, dgamma and dbeta summed over rows (see `kernels-gpu/src/backward/mod.rs` for
/// the formulas), gamma taken with its offset as [`forward`] takes it. As the forward: rows split over the machine's threads, each row widened
/// to f32 in one go and dx narrowed the same way, sums kept in [`LANES`] partial sums. The
/// column sums of dgamma and dbeta run in f64, in row order within each of at most
/// [`BACKWARD_PARTS`] parts of consecutive rows, then over the parts in order. All scratch
/// is taken before anything is written, so where host memory cannot hold it the outputs are
/// left as they were.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: Element, W: Element>(
    x: ArrayView2<'_, T>,
    dy: ArrayView2<'_, T>,
    dsum: Option<ArrayView2<'_, T>>,
    gamma: ArrayView1<'_, W>,
    gamma_offset: f32,
    mean: ArrayView1<'_, f32>,
    rstd: ArrayView1<'_, f32>,
    mut dx: ArrayViewMut2<'_, T>,
    mut dgamma: ArrayViewMut1<'_, W>,
    mut dbeta: ArrayViewMut1<'_, W>,
    centered: bool,
) -> Result<()> {
    let (rows, n) = x.dim();
    // Parts hold 2n f64 sums each: no more of them than x's own size pays for.
    let parts = BACKWARD_PARTS
        .min(rows * size_of::<T>() / (2 * size_of::<f64>()))
        .max(1);
    let rows_per_part = rows.div_ceil(parts).max(1);
    let mut gamma_f32 = zeroed::<f32>(n)?;
    gamma_f32
        .iter_mut()
        .zip(&gamma)
        .for_each(|(d, g)| *d = g.to_f32() + gamma_offset);
    let mut sums = Vec::new();
    for _ in 0..rows.div_ceil(rows_per_part) {
        sums.push((zeroed::<f64>(n)?, zeroed::<f64>(n)?));
    }
    let available = std::thread::available_parallelism().map_or(1, |t| t.get());
    let threads = available
        .min(sums.len())
        .min((rows * n / ELEMENTS_PER_THREAD).max(1))
        .max(1);
    let mut scratch = Vec::new();
    for _ in 0..threads {
        scratch.push(RowScratch {
            xs: zeroed(n)?,
            dys: zeroed(n)?,
            xhat: zeroed(n)?,
            dxs: zeroed(n)?,
        });
    }
    let gamma = &gamma_f32[..];
    // Each part's rows of dsum, where there is one.
    let dsum_parts: Vec<Option<ArrayView2<'_, T>>> = match &dsum {
        Some(d) => d.axis_chunks_iter(Axis(0), rows_per_part).map(Some).collect(),
        None => vec![None; sums.len()],
    };
    let mut runs: Vec<BackwardRun<'_, T>> = x
        .axis_chunks_iter(Axis(0), rows_per_part)
        .zip(dy.axis_chunks_iter(Axis(0), rows_per_part))
        .zip(dsum_parts)
        .zip(dx.axis_chunks_iter_mut(Axis(0), rows_per_part))
        .zip(mean.axis_chunks_iter(Axis(0), rows_per_part))
        .zip(rstd.axis_chunks_iter(Axis(0), rows_per_part))
        .zip(sums.iter_mut())
        .map(
            |((((((x, dy), dsum), dx), mean), rstd), (dgamma, dbeta))| BackwardRun {
                x,
                dy,
                dsum,
                dx,
                mean,
                rstd,
                gamma,
                centered,
                dgamma,
                dbeta,
            },
        )
        .collect();
    // Each thread takes consecutive parts with a row scratch of its own.
    let per_thread = runs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let mut work = runs.chunks_mut(per_thread).zip(scratch.iter_mut());
        let here = work.next();
        for (parts, rows) in work {
            s.spawn(move || parts.iter_mut().for_each(|run| run_rows((run, &mut *rows))));
        }
        // The first share runs on this thread (all of it for small problems).
        if let Some((parts, rows)) = here {
            parts.iter_mut().for_each(|run| run_rows((run, &mut *rows)));
        }
    });
    for (j, (dg, db)) in dgamma.iter_mut().zip(dbeta.iter_mut()).enumerate() {
        let (g, b) = sums
            .iter()
            .fold((0.0f64, 0.0f64), |(g, b), (sg, sb)| (g + sg[j], b + sb[j]));
        // Rounded to f32 first, as the GPU's stage 2 rounds its f32 sums: f16 and bf16
        // weights' gradients are then those of f32 weights rounded once more.
        (*dg, *db) = (W::from_f32(g as f32), W::from_f32(b as f32));
    }
    Ok(())
}

/// One thread's rows of f32 scratch in [`backward`].
struct RowScratch {
    xs: Vec<f32>,
    dys: Vec<f32>,
    xhat: Vec<f32>,
    dxs: Vec<f32>,
}

/// A part of [`backward`]'s rows, with that part's dgamma and dbeta sums and gamma widened.
struct BackwardRun<'a, T> {
    x: ArrayView2<'a, T>,
    dy: ArrayView2<'a, T>,
    dsum: Option<ArrayView2<'a, T>>,
    dx: ArrayViewMut2<'a, T>,
    mean: ArrayView1<'a, f32>,
    rstd: ArrayView1<'a, f32>,
    gamma: &'a [f32],
    centered: bool,
    dgamma: &'a mut [f64],
    dbeta: &'a mut [f64],
}

/// A part of [`backward`]'s rows with a thread's row scratch.
impl<T: Element> RowLoop<T> for (&mut BackwardRun<'_, T>, &mut RowScratch) {
    #[inline(always)]
    fn run(self, widen: impl Fn(&[T], &mut [f32]), narrow: impl Fn(&[f32], &mut [T])) {
        backward_rows(self.0, self.1, widen, narrow)
    }
}

/// A part of [`backward`]'s rows, with the row conversions of one instruction set. Per
/// row, with g = gamma * dy:
///   xhat = (x - mean) * rstd            (in f64: x - mean overflows f32 for rows that span
///                                        its range)
///   c1 = mean(xhat * g), c2 = mean(g)   (c2 = 0 for RMSNorm: no mean in its y)
///   dx = rstd * (g - (xhat * c1 + c2))   (+ dsum, in f32, where given)
/// and the part's sums dgamma += dy * xhat, dbeta += dy.
#[inline(always)]
fn backward_rows<T: Element>(
    run: &mut BackwardRun<'_, T>,
    rows: &mut RowScratch,
    widen: impl Fn(&[T], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [T]),
) {
    let RowScratch { xs, dys, xhat, dxs } = rows;
    let n = xs.len();
    for i in 0..run.x.nrows() {
        widen_cols(&run.x.row(i), 0..n, xs, &widen);
        widen_cols(&run.dy.row(i), 0..n, dys, &widen);
        let (mu, rs) = (run.mean[i] as f64, run.rstd[i]);
        xhat.iter_mut()
            .zip(xs.iter())
            .for_each(|(h, &v)| *h = ((v as f64 - mu) * rs as f64) as f32);
        // g = gamma * dy is formed again where it is used: cheaper than a fifth row.
        let g = |j: usize| run.gamma[j] * dys[j];
        let c1 = sum_f64_indexed(n, |j| (xhat[j] * g(j)) as f64);
        let c2 = if run.centered {
            sum_f64_indexed(n, |j| g(j) as f64)
        } else {
            0.0
        };
        let (c1, c2) = ((c1 / n as f64) as f32, (c2 / n as f64) as f32);
        for (j, d) in dxs.iter_mut().enumerate() {
            *d = rs * (g(j) - (xhat[j] * c1 + c2));
        }
        for ((sg, sb), (&d, &h)) in run
            .dgamma
            .iter_mut()
            .zip(run.dbeta.iter_mut())
            .zip(dys.iter().zip(xhat.iter()))
        {
            *sg += (d * h) as f64;
            *sb += d as f64;
        }
        if let Some(dsum) = &run.dsum {
            // x's row is done with: it takes dsum's.
            widen_cols(&dsum.row(i), 0..n, xs, &widen);
            dxs.iter_mut().zip(xs.iter()).for_each(|(d, &s)| *d += s);
        }
        narrow_cols(dxs, &mut run.dx.row_mut(i), 0..n, &narrow);
    }
}

/// The sum in f64 of `f(j)` for j in 0..n, in [`LANES`] partial sums.
#[inline(always)]
fn sum_f64_indexed(n: usize, f: impl Fn(usize) -> f64) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let whole = n - n % LANES;
    for base in (0..whole).step_by(LANES) {
        for (k, lane) in lanes.iter_mut().enumerate() {
            *lane += f(base + k);
        }
    }
    lanes.iter().sum::<f64>() + (whole..n).map(f).sum::<f64>()
}

/// `n` zeros of backward scratch, or [`crate::Error::OutOfMemory`].
fn zeroed<F: Copy + Default>(n: usize) -> Result<Vec<F>> {
    zeroed_with(n, "allocating the CPU backward's scratch")
}

/// `n` zeros, or [`crate::Error::OutOfMemory`] naming `during`.
pub(crate) fn zeroed_with<F: Copy + Default>(n: usize, during: &'static str) -> Result<Vec<F>> {
    let mut v = host_vec(n, during)?;
    v.resize(n, F::default());
    Ok(v)
}

/// The type of the rows a residual forward writes (s) and the backward reads (s, and the
/// stream's gradient dsum) beside x of `T`: `T` itself, or f32 beside f16 and bf16 (a
/// residual stream kept in f32, `crate::element::F32Stream`), whose CPU path runs the f32
/// one on x and dy widened.
pub(crate) trait Stream<T: Element>: Element {
    /// [`forward`] with s of this type: s = x + residual in f32, rounded once to this type.
    #[allow(clippy::too_many_arguments)]
    fn forward<W: Element>(
        x: ArrayView2<'_, T>,
        residual: Option<(ArrayView2<'_, Self>, ArrayViewMut2<'_, Self>)>,
        gamma: ArrayView1<'_, W>,
        gamma_offset: f32,
        beta: ArrayView1<'_, W>,
        norm: Normalization,
        y: ArrayViewMut2<'_, T>,
        mean: ArrayViewMut1<'_, f32>,
        rstd: ArrayViewMut1<'_, f32>,
    ) -> Result<()>;

    /// [`backward`] over rows of this type, with dx also written unrounded into `dres` where
    /// this type is wider than `T` (where it is `T`, dx is the residual's gradient and
    /// `dres` is None).
    #[allow(clippy::too_many_arguments)]
    fn backward<W: Element>(
        x: ArrayView2<'_, Self>,
        dy: ArrayView2<'_, T>,
        dsum: Option<ArrayView2<'_, Self>>,
        gamma: ArrayView1<'_, W>,
        gamma_offset: f32,
        mean: ArrayView1<'_, f32>,
        rstd: ArrayView1<'_, f32>,
        dx: ArrayViewMut2<'_, T>,
        dres: Option<ArrayViewMut2<'_, Self>>,
        dgamma: ArrayViewMut1<'_, W>,
        dbeta: ArrayViewMut1<'_, W>,
        centered: bool,
    ) -> Result<()>;
}

impl<T: Element> Stream<T> for T {
    fn forward<W: Element>(
        x: ArrayView2<'_, T>,
        residual: Option<(ArrayView2<'_, T>, ArrayViewMut2<'_, T>)>,
        gamma: ArrayView1<'_, W>,
        gamma_offset: f32,
        beta: ArrayView1<'_, W>,
        norm: Normalization,
        y: ArrayViewMut2<'_, T>,
        mean: ArrayViewMut1<'_, f32>,
        rstd: ArrayViewMut1<'_, f32>,
    ) -> Result<()> {
        forward(x, residual, gamma, gamma_offset, beta, norm, y, mean, rstd)
    }

    fn backward<W: Element>(
        x: ArrayView2<'_, T>,
        dy: ArrayView2<'_, T>,
        dsum: Option<ArrayView2<'_, T>>,
        gamma: ArrayView1<'_, W>,
        gamma_offset: f32,
        mean: ArrayView1<'_, f32>,
        rstd: ArrayView1<'_, f32>,
        dx: ArrayViewMut2<'_, T>,
        _dres: Option<ArrayViewMut2<'_, T>>,
        dgamma: ArrayViewMut1<'_, W>,
        dbeta: ArrayViewMut1<'_, W>,
        centered: bool,
    ) -> Result<()> {
        backward(
            x,
            dy,
            dsum,
            gamma,
            gamma_offset,
            mean,
            rstd,
            dx,
            dgamma,
            dbeta,
            centered,
        )
    }
}

/// f32 rows beside x of `T` (f16, bf16): x and dy widened to f32 (exactly), the f32 path
/// run on them, and y and dx rounded once to `T`, as the kernels round them. The backward's
/// widened dy is taken whole before anything is written (its weight sums run over every
/// row); the forward's rows are independent, and go a chunk of rows at a time
/// ([`stream_chunk_rows`]) through one widened x and y taken before the first chunk. The
/// f32 path takes its own scratch (weights, a few rows a thread) each chunk, so where host
/// memory fails it at a later chunk, the earlier chunks' y, s, mean and rstd are written
/// (x and the residual are untouched either way).
impl<T: F32Stream> Stream<T> for f32 {
    fn forward<W: Element>(
        x: ArrayView2<'_, T>,
        residual: Option<(ArrayView2<'_, f32>, ArrayViewMut2<'_, f32>)>,
        gamma: ArrayView1<'_, W>,
        gamma_offset: f32,
        beta: ArrayView1<'_, W>,
        norm: Normalization,
        mut y: ArrayViewMut2<'_, T>,
        mut mean: ArrayViewMut1<'_, f32>,
        mut rstd: ArrayViewMut1<'_, f32>,
    ) -> Result<()> {
        let (rows, n) = x.dim();
        let chunk = stream_chunk_rows(rows, n);
        let during = "allocating the CPU forward's widened rows";
        let mut wide_x = zeroed_with::<f32>(chunk * n, during)?;
        let mut wide_y = zeroed_with::<f32>(chunk * n, during)?;
        let (residual, mut sum) = residual.unzip();
        for start in (0..rows).step_by(chunk) {
            let part = start..(start + chunk).min(rows);
            let dim = (part.len(), n);
            let (wide_x, wide_y) = (&mut wide_x[..dim.0 * n], &mut wide_y[..dim.0 * n]);
            widen_into(x.slice(s![part.clone(), ..]), wide_x);
            let residual = residual
                .map(|r| r.slice_move(s![part.clone(), ..]))
                .zip(sum.as_mut().map(|v| v.slice_mut(s![part.clone(), ..])));
            forward(
                ArrayView2::from_shape(dim, &*wide_x).expect("the chunk's shape"),
                residual,
                gamma,
                gamma_offset,
                beta,
                norm,
                ArrayViewMut2::from_shape(dim, &mut *wide_y).expect("the chunk's shape"),
                mean.slice_mut(s![part.clone()]),
                rstd.slice_mut(s![part.clone()]),
            )?;
            narrow_into(
                ArrayView2::from_shape(dim, &*wide_y).expect("the chunk's shape"),
                &mut y.slice_mut(s![part, ..]),
            );
        }
        Ok(())
    }

    fn backward<W: Element>(
        x: ArrayView2<'_, f32>,
        dy: ArrayView2<'_, T>,
        dsum: Option<ArrayView2<'_, f32>>,
        gamma: ArrayView1<'_, W>,
        gamma_offset: f32,
        mean: ArrayView1<'_, f32>,
        rstd: ArrayView1<'_, f32>,
        mut dx: ArrayViewMut2<'_, T>,
        dres: Option<ArrayViewMut2<'_, f32>>,
        dgamma: ArrayViewMut1<'_, W>,
        dbeta: ArrayViewMut1<'_, W>,
        centered: bool,
    ) -> Result<()> {
        let Some(mut dres) = dres else {
            unreachable!("checked: a stream wider than x has its gradient's output")
        };
        let wide_dy = widened(dy, "allocating the CPU backward's widened rows")?;
        let dy = ArrayView2::from_shape(dy.dim(), &wide_dy[..]).expect("dy's shape");
        backward(
            x,
            dy,
            dsum,
            gamma,
            gamma_offset,
            mean,
            rstd,
            dres.view_mut(),
            dgamma,
            dbeta,
            centered,
        )?;
        narrow_into(dres.view(), &mut dx);
        Ok(())
    }
}

/// Rows of x the f32 stream's CPU forward widens at a time: about two threads' worth of
/// elements ([`ELEMENTS_PER_THREAD`]) for each of the machine's threads, at least a row.
/// The widened x and y of a chunk then stay in the caches between their conversion and
/// their use, and are taken once a call at that size: widened whole, a call's two fresh
/// rows * n buffers faulted their pages in on every call (at M = 256, N = 4096, about 1,650
/// minor faults a call more than the f32 residual forward's).
fn stream_chunk_rows(rows: usize, n: usize) -> usize {
    let available = std::thread::available_parallelism().map_or(1, |t| t.get());
    (2 * available * ELEMENTS_PER_THREAD / n.max(1)).clamp(1, rows.max(1))
}

/// `rows` widened to f32, row-major, in memory taken fallibly (see [`widen_into`]).
fn widened<T: Element>(rows: ArrayView2<'_, T>, during: &'static str) -> Result<Vec<f32>> {
    let mut out = zeroed_with::<f32>(rows.len(), during)?;
    widen_into(rows, &mut out);
    Ok(out)
}

/// `rows` widened to f32 into `out` (row-major, `rows.len()` elements): contiguous rows in
/// one slice conversion ([`widen_slice`]), else element by element.
fn widen_into<T: Element>(rows: ArrayView2<'_, T>, out: &mut [f32]) {
    match rows.as_slice() {
        Some(src) => widen_slice(src, out),
        None => out.iter_mut().zip(rows.iter()).for_each(|(o, v)| *o = v.to_f32()),
    }
}

/// Rounds `wide` once (to nearest even, as the kernels round) into `out`, of its shape: one
/// slice conversion ([`narrow_slice`]) where both are contiguous, else element by element.
fn narrow_into<T: Element>(wide: ArrayView2<'_, f32>, out: &mut ArrayViewMut2<'_, T>) {
    match (wide.as_slice(), out.as_slice_mut()) {
        (Some(src), Some(dst)) => narrow_slice(src, dst),
        _ => out.zip_mut_with(&wide, |o, &v| *o = T::from_f32(v)),
    }
}

/// `src` widened into `dst` by [`RowConvert::widen_avx2`] where the CPU has AVX2, FMA and
/// F16C (as [`run_rows`] picks its loops), else [`RowConvert::widen`], whose f16 conversion
/// (`half`'s) runs a scalar loop where F16C is not enabled at build time.
fn widen_slice<T: Element>(src: &[T], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma_f16c() {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return unsafe { T::widen_avx2(src, dst) };
    }
    T::widen(src, dst)
}

/// `src` narrowed into `dst`, as [`widen_slice`] widens.
fn narrow_slice<T: Element>(src: &[f32], dst: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma_f16c() {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return unsafe { T::narrow_avx2(src, dst) };
    }
    T::narrow(src, dst)
}
