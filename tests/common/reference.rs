//! The float64 reference: LayerNorm written from its definition, independently of the
//! library's CPU path, on inputs already rounded to the storage type (so only the
//! computation is compared, not the input rounding).

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};

/// Per row: mean = sum x / n, var = sum (x - mean)^2 / n, rstd = 1 / sqrt(var + eps);
/// returns (mean, rstd, xhat = (x - mean) * rstd).
fn normalized(x: ArrayView2<f64>, eps: f64) -> (Array1<f64>, Array1<f64>, Array2<f64>) {
    let n = x.ncols() as f64;
    let mean = x.sum_axis(Axis(1)) / n;
    let centered = &x - &mean.view().insert_axis(Axis(1));
    let var = centered.mapv(|c| c * c).sum_axis(Axis(1)) / n;
    let rstd = var.mapv(|v| 1.0 / (v + eps).sqrt());
    let xhat = centered * rstd.view().insert_axis(Axis(1));
    (mean, rstd, xhat)
}

/// (y, mean, rstd) of each row, y = xhat * gamma + beta.
pub fn forward(
    x: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    beta: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, Array1<f64>, Array1<f64>) {
    let (mean, rstd, xhat) = normalized(x, eps);
    (xhat * gamma + beta, mean, rstd)
}

/// (dx, dgamma, dbeta) for upstream gradient dy, from the closed form
/// dx = rstd * (gamma*dy - mean_j(gamma*dy) - xhat * mean_j(gamma*dy*xhat)),
/// dgamma = sum_i dy * xhat, dbeta = sum_i dy. `finite_difference_matches_reference`
/// checks this formula against numerical derivatives of `forward`.
pub fn backward(
    x: ArrayView2<f64>,
    dy: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, Array1<f64>, Array1<f64>) {
    let n = x.ncols() as f64;
    let (_, rstd, xhat) = normalized(x, eps);
    let rstd = rstd.insert_axis(Axis(1));
    let g = &dy * &gamma;
    let mean_g = (g.sum_axis(Axis(1)) / n).insert_axis(Axis(1));
    let mean_gx = ((&g * &xhat).sum_axis(Axis(1)) / n).insert_axis(Axis(1));
    let dx = &rstd * &(&g - &mean_g - &xhat * &mean_gx);
    let dgamma = (&dy * &xhat).sum_axis(Axis(0));
    let dbeta = dy.sum_axis(Axis(0));
    (dx, dgamma, dbeta)
}
