//! The check every configuration passes before it is timed: its outputs against the float64
//! reference (`layernorm-reference`, the tests' too) from the same inputs, by
//! ||out - ref|| / ||ref||. y and dx are compared on a sample of rows spread over M (every
//! element is still scanned for NaN, the poison the outputs start with); dgamma and dbeta,
//! which sum over every row, in full.

use layernorm_cuda::Element;
use layernorm_reference::Row;
use ndarray::{Array1, Array2, ArrayView1, Axis};

use crate::config::Norm;
use crate::inputs::Inputs;
use crate::parallel::map_ranges;

/// Rows of y and dx compared with the reference.
const SAMPLE_ROWS: usize = 32;

/// The float64 results the outputs are compared with.
pub struct Reference {
    /// Indices of the sampled rows, ascending.
    rows: Vec<usize>,
    /// y and dx of the sampled rows, `[rows.len(), n]`, and with the residual add their s.
    y: Array2<f64>,
    dx: Array2<f64>,
    sum: Option<Array2<f64>>,
    dgamma: Array1<f64>,
    dbeta: Array1<f64>,
}

/// One thread's share of the reference: its rows' contributions to dgamma and dbeta, and
/// y, dx and (residual add) s of the sampled rows among them.
struct Partial {
    dgamma: Vec<f64>,
    dbeta: Vec<f64>,
    sampled: Vec<[Vec<f64>; 3]>,
}

impl Reference {
    /// y, dx, dgamma and dbeta of `norm` with `eps`, in float64 throughout. RMSNorm has no
    /// beta: its y is taken with beta = 0, and its dbeta is never compared. With the
    /// residual add the rows normalized are the inputs' s (as the op must round it), and dx
    /// includes dsum.
    pub fn compute<T: Element, R: Element>(inputs: &Inputs<T, R>, eps: f64, norm: Norm) -> Reference {
        let (rows, n) = inputs.x.dim();
        let sample: Vec<usize> = if rows <= SAMPLE_ROWS {
            (0..rows).collect()
        } else {
            (0..SAMPLE_ROWS)
                .map(|i| i * (rows - 1) / (SAMPLE_ROWS - 1))
                .collect()
        };
        let gamma = f64s(inputs.gamma.view());
        let beta = match norm {
            Norm::Layer => f64s(inputs.beta.view()),
            Norm::Rms => vec![0.0; n],
        };
        let partials = map_ranges(rows, |block| {
            let mut part = Partial {
                dgamma: vec![0.0; n],
                dbeta: vec![0.0; n],
                sampled: Vec::new(),
            };
            for r in block {
                let dy = f64s(inputs.dy.row(r));
                let x = inputs.normalized_row(r);
                let row = match norm {
                    Norm::Layer => Row::new(&x, eps),
                    Norm::Rms => Row::rms(&x, eps),
                };
                row.add_param_grads(&dy, &mut part.dgamma, &mut part.dbeta);
                if sample.binary_search(&r).is_ok() {
                    let mut dx = row.dx(&dy, &gamma);
                    if let Some(residual) = &inputs.residual {
                        dx.iter_mut()
                            .zip(residual.dsum.row(r))
                            .for_each(|(d, s)| *d += s.to_f32() as f64);
                    }
                    part.sampled.push([row.y(&gamma, &beta), dx, x]);
                }
            }
            part
        });
        let (mut dgamma, mut dbeta) = (Array1::zeros(n), Array1::zeros(n));
        let (mut y, mut dx, mut sum) = (Vec::new(), Vec::new(), Vec::new());
        for part in partials {
            dgamma += &ArrayView1::from(&part.dgamma);
            dbeta += &ArrayView1::from(&part.dbeta);
            for [y_row, dx_row, sum_row] in part.sampled {
                y.extend(y_row);
                dx.extend(dx_row);
                sum.extend(sum_row);
            }
        }
        let shape = (sample.len(), n);
        Reference {
            y: Array2::from_shape_vec(shape, y).expect("one y row per sampled row"),
            dx: Array2::from_shape_vec(shape, dx).expect("one dx row per sampled row"),
            sum: inputs
                .residual
                .is_some()
                .then(|| Array2::from_shape_vec(shape, sum).expect("one s row per sampled row")),
            rows: sample,
            dgamma,
            dbeta,
        }
    }

    /// The forward's y (`[rows, n]`, row-major, copied from the device), and with the
    /// residual add its s (of the stream's type `R`).
    pub fn check_forward<T: Element, R: Element>(&self, y: &[T], sum: Option<&[R]>) -> Check {
        let sum = match (sum, &self.sum) {
            (Some(out), Some(reference)) => self.sampled("s", out, reference),
            _ => Check::from_sums("s", 0.0, 0.0),
        };
        Check::worst([self.sampled("y", y, &self.y), sum])
    }

    /// The backward's dx (`[rows, n]`), dgamma and dbeta (`[n]`; RMSNorm has none).
    pub fn check_backward<T: Element, W: Element>(
        &self,
        dx: &[T],
        dgamma: &[W],
        dbeta: Option<&[W]>,
    ) -> Check {
        Check::worst([
            self.sampled("dx", dx, &self.dx),
            whole("dgamma", dgamma, self.dgamma.view()),
            match dbeta {
                Some(dbeta) => whole("dbeta", dbeta, self.dbeta.view()),
                None => Check::from_sums("dbeta", 0.0, 0.0),
            },
        ])
    }

    /// The sampled rows of `out` against `reference`, after a scan of all of `out`.
    fn sampled<T: Element>(&self, what: &'static str, out: &[T], reference: &Array2<f64>) -> Check {
        let n = reference.ncols();
        if let Some(i) = first_non_finite(out) {
            return Check::non_finite(what, i / n, i % n);
        }
        let (mut diff, mut norm) = (0.0, 0.0);
        for (&r, expected) in self.rows.iter().zip(reference.axis_iter(Axis(0))) {
            let (d, m) = squared_error(&out[r * n..(r + 1) * n], expected);
            diff += d;
            norm += m;
        }
        Check::from_sums(what, diff, norm)
    }
}

/// All of `out` against `reference` (a 1-D output).
fn whole<T: Element>(what: &'static str, out: &[T], reference: ArrayView1<'_, f64>) -> Check {
    if let Some(i) = first_non_finite(out) {
        return Check::non_finite(what, 0, i);
    }
    let (diff, norm) = squared_error(out, reference);
    Check::from_sums(what, diff, norm)
}

/// The outcome of one check: the largest relative error over the outputs compared, and
/// which output it was.
#[derive(Clone, Debug)]
pub struct Check {
    pub error: f64,
    pub what: &'static str,
    /// Set when an output held NaN or infinity (`error` is then infinite).
    pub non_finite_at: Option<(usize, usize)>,
}

impl Check {
    fn from_sums(what: &'static str, diff: f64, norm: f64) -> Check {
        let error = if norm > 0.0 {
            (diff / norm).sqrt()
        } else {
            diff.sqrt()
        };
        Check {
            error,
            what,
            non_finite_at: None,
        }
    }

    fn non_finite(what: &'static str, row: usize, col: usize) -> Check {
        Check {
            error: f64::INFINITY,
            what,
            non_finite_at: Some((row, col)),
        }
    }

    pub fn worst<const K: usize>(checks: [Check; K]) -> Check {
        checks
            .into_iter()
            .max_by(|a, b| a.error.total_cmp(&b.error))
            .expect("at least one output is checked")
    }

    /// Why the check fails at `tolerance`, or None when it passes.
    pub fn failure(&self, tolerance: f64) -> Option<String> {
        if let Some((row, col)) = self.non_finite_at {
            Some(format!(
                "{}[{row}, {col}] is NaN or infinite (left unwritten, or overflowed)",
                self.what
            ))
        } else if self.error <= tolerance {
            None
        } else {
            Some(format!(
                "{} differs from the float64 reference by {:.2e} (tolerance {tolerance:.1e})",
                self.what, self.error
            ))
        }
    }
}

fn f64s<T: Element>(v: ArrayView1<'_, T>) -> Vec<f64> {
    v.iter().map(|e| e.to_f32() as f64).collect()
}

/// (sum of (out - ref)^2, sum of ref^2).
fn squared_error<T: Element>(out: &[T], reference: ArrayView1<'_, f64>) -> (f64, f64) {
    out.iter().zip(reference).fold((0.0, 0.0), |(d, m), (&o, &r)| {
        let o = o.to_f32() as f64;
        (d + (o - r) * (o - r), m + r * r)
    })
}

/// The index of the first NaN or infinity in `out`, scanned in parallel.
fn first_non_finite<T: Element>(out: &[T]) -> Option<usize> {
    map_ranges(out.len(), |range| {
        let start = range.start;
        out[range]
            .iter()
            .position(|v| !v.to_f32().is_finite())
            .map(|i| start + i)
    })
    .into_iter()
    .flatten()
    .next()
}
