//! The float64 LayerNorm and RMSNorm that layernorm-cuda's outputs are compared with, written from its
//! definition and independently of the library's CPU path. Its inputs are values already
//! rounded to the storage type, so that only the computation is compared, not the input
//! rounding.
//!
//! The math is in [`Row`], once; the tests take whole matrices ([`forward`], [`backward`]),
//! ln-bench's check takes rows (its own threads, y and dx only on sampled rows).
//! `finite_difference_matches_reference` in the library's tests/backward.rs checks the
//! backward against numerical derivatives of the forward.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2};

/// One row normalized: mean = sum x / n, var = sum (x - mean)^2 / n (biased, as
/// LayerNorm's), rstd = 1 / sqrt(var + eps), xhat = (x - mean) * rstd. A row of n = 0 has
/// NaN mean and rstd.
pub struct Row {
    pub mean: f64,
    pub var: f64,
    pub rstd: f64,
    pub xhat: Vec<f64>,
    /// LayerNorm's row (centered on its mean), or RMSNorm's ([`Row::rms`]).
    pub centered: bool,
}

impl Row {
    /// The row `x` normalized with `eps`.
    pub fn new(x: &[f64], eps: f64) -> Row {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat = x.iter().map(|v| (v - mean) * rstd).collect();
        Row {
            mean,
            var,
            rstd,
            xhat,
            centered: true,
        }
    }

    /// The row `x` as RMSNorm normalizes it: not centered (mean 0), var the mean square
    /// sum x^2 / n, rstd = 1 / sqrt(var + eps), xhat = x * rstd.
    pub fn rms(x: &[f64], eps: f64) -> Row {
        let n = x.len() as f64;
        let var = x.iter().map(|v| v * v).sum::<f64>() / n;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat = x.iter().map(|v| v * rstd).collect();
        Row {
            mean: 0.0,
            var,
            rstd,
            xhat,
            centered: false,
        }
    }

    /// y = xhat * gamma + beta.
    pub fn y(&self, gamma: &[f64], beta: &[f64]) -> Vec<f64> {
        self.xhat
            .iter()
            .zip(gamma.iter().zip(beta))
            .map(|(xh, (g, b))| xh * g + b)
            .collect()
    }

    /// dx for the upstream gradient `dy`, from the closed form with g = gamma * dy:
    /// dx = rstd * ((g - mean_j g) - xhat * mean_j (g * xhat)). Subtracting mean_j g first
    /// gives exactly 0 where it should (n = 1: g equals its own mean, and xhat is 0).
    /// RMSNorm's rows have no mean_j g term (y does not depend on x through a mean).
    pub fn dx(&self, dy: &[f64], gamma: &[f64]) -> Vec<f64> {
        let n = self.xhat.len() as f64;
        let g: Vec<f64> = dy.iter().zip(gamma).map(|(d, w)| w * d).collect();
        let mean_g = if self.centered {
            g.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let mean_gx = g.iter().zip(&self.xhat).map(|(g, xh)| g * xh).sum::<f64>() / n;
        g.iter()
            .zip(&self.xhat)
            .map(|(g, xh)| self.rstd * ((g - mean_g) - xh * mean_gx))
            .collect()
    }

    /// Adds this row's terms of dgamma = sum over rows of dy * xhat and dbeta = sum over
    /// rows of dy.
    pub fn add_param_grads(&self, dy: &[f64], dgamma: &mut [f64], dbeta: &mut [f64]) {
        for (j, (d, xh)) in dy.iter().zip(&self.xhat).enumerate() {
            dgamma[j] += d * xh;
            dbeta[j] += d;
        }
    }
}

/// (y, mean, rstd) of each row of `x` (see [`Row`]).
pub fn forward(
    x: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    beta: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, Array1<f64>, Array1<f64>) {
    rows_forward(x, gamma, beta, eps, Row::new)
}

/// (dx, dgamma, dbeta) for the upstream gradient `dy` (see [`Row::dx`] and
/// [`Row::add_param_grads`]).
pub fn backward(
    x: ArrayView2<f64>,
    dy: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, Array1<f64>, Array1<f64>) {
    rows_backward(x, dy, gamma, eps, Row::new)
}

/// RMSNorm's (y, rstd) of each row of `x` (see [`Row::rms`]): y = xhat * gamma.
pub fn rms_forward(x: ArrayView2<f64>, gamma: ArrayView1<f64>, eps: f64) -> (Array2<f64>, Array1<f64>) {
    let zeros = Array1::zeros(gamma.len());
    let (y, _, rstd) = rows_forward(x, gamma, zeros.view(), eps, Row::rms);
    (y, rstd)
}

/// RMSNorm's (dx, dgamma) for upstream gradient `dy`.
pub fn rms_backward(
    x: ArrayView2<f64>,
    dy: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    eps: f64,
) -> (Array2<f64>, Array1<f64>) {
    let (dx, dgamma, _) = rows_backward(x, dy, gamma, eps, Row::rms);
    (dx, dgamma)
}

/// (y, mean, rstd) of each row of `x`, normalized by `norm` ([`Row::new`] or [`Row::rms`]).
fn rows_forward(
    x: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    beta: ArrayView1<f64>,
    eps: f64,
    norm: fn(&[f64], f64) -> Row,
) -> (Array2<f64>, Array1<f64>, Array1<f64>) {
    let (gamma, beta) = (gamma.to_vec(), beta.to_vec());
    let (mut y, mut mean, mut rstd) = (Vec::with_capacity(x.len()), Vec::new(), Vec::new());
    for x_row in x.rows() {
        let row = norm(&x_row.to_vec(), eps);
        y.extend(row.y(&gamma, &beta));
        mean.push(row.mean);
        rstd.push(row.rstd);
    }
    let y = Array2::from_shape_vec(x.dim(), y).expect("one y row per x row");
    (y, mean.into(), rstd.into())
}

/// (dx, dgamma, dbeta) of rows normalized by `norm`, for the upstream gradient `dy`.
fn rows_backward(
    x: ArrayView2<f64>,
    dy: ArrayView2<f64>,
    gamma: ArrayView1<f64>,
    eps: f64,
    norm: fn(&[f64], f64) -> Row,
) -> (Array2<f64>, Array1<f64>, Array1<f64>) {
    assert_eq!(x.dim(), dy.dim(), "x and dy have the same shape");
    let gamma = gamma.to_vec();
    let n = x.ncols();
    let (mut dx, mut dgamma, mut dbeta) = (Vec::with_capacity(x.len()), vec![0.0; n], vec![0.0; n]);
    for (x_row, dy_row) in x.rows().into_iter().zip(dy.rows()) {
        let (row, dy_row) = (norm(&x_row.to_vec(), eps), dy_row.to_vec());
        dx.extend(row.dx(&dy_row, &gamma));
        row.add_param_grads(&dy_row, &mut dgamma, &mut dbeta);
    }
    let dx = Array2::from_shape_vec(x.dim(), dx).expect("one dx row per x row");
    (dx, dgamma.into(), dbeta.into())
}
