//! LayerNorm on the CPU with ndarray: the same math as the kernels, in f32 values with f64
//! sums, so code written against this crate runs (and agrees) where no GPU is.

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Zip};

use crate::element::Element;
use crate::error::Result;
use crate::tensor::host_vec;

/// Per row: y = (x - mean) * rstd * gamma + beta, with mean and rstd = 1/sqrt(var + eps)
/// (var biased) written out. Two passes over the row: mean, then squared deviations.
pub(crate) fn forward<T: Element>(
    x: ArrayView2<'_, T>,
    gamma: ArrayView1<'_, T>,
    beta: ArrayView1<'_, T>,
    eps: f32,
    mut y: ArrayViewMut2<'_, T>,
    mut mean: ArrayViewMut1<'_, f32>,
    mut rstd: ArrayViewMut1<'_, f32>,
) {
    let n = x.ncols() as f64;
    Zip::from(x.rows())
        .and(y.rows_mut())
        .and(&mut mean)
        .and(&mut rstd)
        .for_each(|x, mut y, m, r| {
            let mu = x.iter().map(|v| v.to_f32() as f64).sum::<f64>() / n;
            let var = x.iter().map(|v| (v.to_f32() as f64 - mu).powi(2)).sum::<f64>() / n;
            let rs = 1.0 / (var + eps as f64).sqrt();
            // xhat in f64: x - mean overflows f32 for rows that span its range.
            Zip::from(&mut y)
                .and(&x)
                .and(&gamma)
                .and(&beta)
                .for_each(|y, &x, &g, &b| {
                    let xhat = ((x.to_f32() as f64 - mu) * rs) as f32;
                    *y = T::from_f32(xhat * g.to_f32() + b.to_f32());
                });
            (*m, *r) = (mu as f32, rs as f32);
        });
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
    let mut v = host_vec(n, "allocating the CPU backward's scratch")?;
    v.resize(n, F::default());
    Ok(v)
}
