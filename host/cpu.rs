//! LayerNorm on the CPU with ndarray: the same math as the kernels, in f32 values with f64
//! sums, so code written against this crate runs (and agrees) where no GPU is.

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis, Zip};

mod convert;

pub use convert::RowConvert;

use crate::element::Element;
use crate::error::Result;
use crate::tensor::host_vec;

/// Elements a thread of the CPU forward takes at the least: below that, starting a thread
/// costs more than the rows it would take.
const FORWARD_ELEMENTS_PER_THREAD: usize = 1 << 16;

/// Per row: y = (x - mean) * rstd * gamma + beta, with mean and rstd = 1/sqrt(var + eps)
/// (var biased) written out. Two passes over the row for the statistics (mean, then squared
/// deviations), sums in f64, then y. Rows are split over the machine's threads, each row is
/// widened to f32 in one go (vector conversions for f16 and bf16), and the sums keep
/// [`LANES`] partial sums, so that the loops vectorize. Its scratch (gamma, beta and two row
/// buffers a thread) is taken before anything is written, so where host memory cannot hold
/// it the outputs are left as they were.
pub(crate) fn forward<T: Element>(
    x: ArrayView2<'_, T>,
    gamma: ArrayView1<'_, T>,
    beta: ArrayView1<'_, T>,
    norm: Normalization,
    mut y: ArrayViewMut2<'_, T>,
    mut mean: ArrayViewMut1<'_, f32>,
    mut rstd: ArrayViewMut1<'_, f32>,
) -> Result<()> {
    let (rows, n) = x.dim();
    let during = "allocating the CPU forward's scratch";
    let widened = |v: ArrayView1<'_, T>| -> Result<Vec<f32>> {
        let mut out = host_vec(n, during)?;
        out.extend(v.iter().map(|e| e.to_f32()));
        Ok(out)
    };
    let (gamma, beta) = (widened(gamma)?, widened(beta)?);
    let available = std::thread::available_parallelism().map_or(1, |t| t.get());
    let threads = available
        .min(rows)
        .min((rows * n / FORWARD_ELEMENTS_PER_THREAD).max(1));
    let chunk = rows.div_ceil(threads.max(1)).max(1);
    let mut scratch = Vec::new();
    for _ in 0..threads {
        scratch.push((zeroed_with::<f32>(n, during)?, zeroed_with::<f32>(n, during)?));
    }
    let (gamma, beta) = (&gamma[..], &beta[..]);
    let runs = x
        .axis_chunks_iter(Axis(0), chunk)
        .zip(y.axis_chunks_iter_mut(Axis(0), chunk))
        .zip(mean.axis_chunks_iter_mut(Axis(0), chunk))
        .zip(rstd.axis_chunks_iter_mut(Axis(0), chunk))
        .zip(scratch.iter_mut())
        .map(|((((x, y), mean), rstd), (xs, ys))| RowRun {
            x,
            y,
            mean,
            rstd,
            gamma,
            beta,
            norm,
            xs,
            ys,
        });
    if threads == 1 {
        // Small problems: no thread to start, the rows run here.
        runs.for_each(forward_rows);
        return Ok(());
    }
    std::thread::scope(|s| {
        for run in runs {
            s.spawn(move || forward_rows(run));
        }
    });
    Ok(())
}

/// A run of rows of [`forward`] for one thread, with its scratch `xs` and `ys` (a row each)
/// and gamma and beta widened.
struct RowRun<'a, T> {
    x: ArrayView2<'a, T>,
    y: ArrayViewMut2<'a, T>,
    mean: ArrayViewMut1<'a, f32>,
    rstd: ArrayViewMut1<'a, f32>,
    gamma: &'a [f32],
    beta: &'a [f32],
    norm: Normalization,
    xs: &'a mut [f32],
    ys: &'a mut [f32],
}

/// [`forward`] over a run of rows. On x86-64 CPUs with AVX2, FMA and F16C (every x86 server
/// since 2013) the same loops are compiled a second time for them: twice the lanes of the
/// SSE2 baseline that a portable build targets.
fn forward_rows<T: Element>(run: RowRun<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the CPU has AVX2, FMA and F16C, checked just above.
        return unsafe { forward_rows_avx2(run) };
    }
    forward_rows_with(run, T::widen, T::narrow)
}

/// [`forward_rows_with`] compiled for AVX2, FMA and F16C, with the conversions built for them.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn forward_rows_avx2<T: Element>(run: RowRun<'_, T>) {
    let widen = |src: &[T], dst: &mut [f32]| {
        // SAFETY: this function's own contract: the CPU has AVX2, FMA and F16C.
        unsafe { T::widen_avx2(src, dst) }
    };
    let narrow = |src: &[f32], dst: &mut [T]| {
        // SAFETY: as for `widen`.
        unsafe { T::narrow_avx2(src, dst) }
    };
    forward_rows_with(run, widen, narrow)
}

/// The rows of [`forward_rows`], with the row conversions of one instruction set; inlined
/// into each of its instruction-set variants.
#[inline(always)]
fn forward_rows_with<T: Element>(
    run: RowRun<'_, T>,
    widen: impl Fn(&[T], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [T]),
) {
    let RowRun {
        x,
        mut y,
        mut mean,
        mut rstd,
        gamma,
        beta,
        norm,
        xs,
        ys,
    } = run;
    let n = xs.len() as f64;
    for i in 0..x.nrows() {
        let (x, mut y) = (x.row(i), y.row_mut(i));
        match x.as_slice() {
            Some(row) => widen(row, xs),
            None => xs.iter_mut().zip(&x).for_each(|(d, v)| *d = v.to_f32()),
        }
        // LayerNorm: mean, then the squared deviations from it. RMSNorm: the mean square,
        // with the mean taken as 0 (what `mu` is then written as, too).
        let (mu, var) = if norm.centered {
            let mu = sum_f64(xs, |v| v as f64) / n;
            (mu, sum_f64(xs, |v| (v as f64 - mu) * (v as f64 - mu)) / n)
        } else {
            (0.0, sum_f64(xs, |v| v as f64 * v as f64) / n)
        };
        let rs = 1.0 / (var + norm.eps as f64).sqrt();
        // Every |x - mean| is at most sqrt(n var): where that fits f32, xhat in f32 (half
        // the work of f64, the GPU's arithmetic); else in f64, for rows that span f32's
        // range, where x - mean itself would overflow.
        if var * n < f32::MAX as f64 {
            let (mu, rs) = (mu as f32, rs as f32);
            for (((o, &v), &g), &b) in ys.iter_mut().zip(xs.iter()).zip(gamma).zip(beta) {
                *o = (v - mu) * rs * g + b;
            }
        } else {
            for (((o, &v), &g), &b) in ys.iter_mut().zip(xs.iter()).zip(gamma).zip(beta) {
                *o = ((v as f64 - mu) * rs) as f32 * g + b;
            }
        }
        match y.as_slice_mut() {
            Some(row) => narrow(ys, row),
            None => y
                .iter_mut()
                .zip(ys.iter())
                .for_each(|(d, &v)| *d = T::from_f32(v)),
        }
        (mean[i], rstd[i]) = (mu as f32, rs as f32);
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

/// The sum in f64 of `f` over `v`, in [`LANES`] partial sums.
#[inline(always)]
fn sum_f64(v: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            lanes[k] += f(c[k]);
        }
    }
    lanes.iter().sum::<f64>() + tail.iter().map(|&x| f(x)).sum::<f64>()
}

/// dx per row, dgamma and dbeta summed over rows (see `kernels-gpu/src/backward/mod.rs` for the
/// formulas). Column sums run in f64 in row order. The row scratch is taken before anything
/// is written, so where host memory cannot hold it the outputs are left as they were.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: Element>(
    x: ArrayView2<'_, T>,
    dy: ArrayView2<'_, T>,
    gamma: ArrayView1<'_, T>,
    mean: ArrayView1<'_, f32>,
    rstd: ArrayView1<'_, f32>,
    mut dx: ArrayViewMut2<'_, T>,
    mut dgamma: ArrayViewMut1<'_, T>,
    mut dbeta: ArrayViewMut1<'_, T>,
    centered: bool,
) -> Result<()> {
    let n = x.ncols();
    let (mut sum_dgamma, mut sum_dbeta) = (zeroed::<f64>(n)?, zeroed::<f64>(n)?);
    let (mut xhat, mut wdy) = (zeroed::<f32>(n)?, zeroed::<f32>(n)?);
    Zip::from(x.rows())
        .and(dy.rows())
        .and(dx.rows_mut())
        .and(&mean)
        .and(&rstd)
        .for_each(|x, dy, mut dx, &mu, &rs| {
            let (mut c1, mut c2) = (0.0f64, 0.0f64);
            for j in 0..n {
                // In f64: x - mean overflows f32 for rows that span its range.
                xhat[j] = ((x[j].to_f32() as f64 - mu as f64) * rs as f64) as f32;
                wdy[j] = gamma[j].to_f32() * dy[j].to_f32();
                c1 += (xhat[j] * wdy[j]) as f64;
                c2 += wdy[j] as f64;
                sum_dgamma[j] += (dy[j].to_f32() * xhat[j]) as f64;
                sum_dbeta[j] += dy[j].to_f32() as f64;
            }
            // RMSNorm's y does not depend on x through a mean: no c2 term.
            let c2 = if centered { c2 } else { 0.0 };
            let (c1, c2) = ((c1 / n as f64) as f32, (c2 / n as f64) as f32);
            for j in 0..n {
                dx[j] = T::from_f32(rs * (wdy[j] - (xhat[j] * c1 + c2)));
            }
        });
    Zip::from(&mut dgamma)
        .and(&sum_dgamma)
        .for_each(|d, &s| *d = T::from_f32(s as f32));
    Zip::from(&mut dbeta)
        .and(&sum_dbeta)
        .for_each(|d, &s| *d = T::from_f32(s as f32));
    Ok(())
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
