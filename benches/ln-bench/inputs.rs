//! Seeded random inputs, never zeros: zeros hide unwritten outputs and can run faster than
//! real data. Each row draws from its own generator, so the rows are filled in parallel
//! and the same seed gives the same inputs on any number of cores.

use layernorm_cuda::Element;
use ndarray::{Array1, Array2, Zip};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::parallel::map_ranges;

/// One configuration's host inputs: x and dy `[rows, n]`, gamma and beta `[n]`, and for the
/// residual add its own inputs, of the stream's type `R` (x's, or f32 beside f16/bf16).
pub struct Inputs<T, R = T> {
    pub x: Array2<T>,
    pub dy: Array2<T>,
    pub gamma: Array1<T>,
    pub beta: Array1<T>,
    pub residual: Option<Residual<R>>,
}

/// The residual add's inputs, `[rows, n]` each: the residual, dsum (the gradient reaching s
/// from the residual stream) and s = x + residual as the op must form it (summed in f32,
/// rounded once to `R`): the rows it normalizes.
pub struct Residual<R> {
    pub residual: Array2<R>,
    pub dsum: Array2<R>,
    pub sum: Array2<R>,
}

/// Stream numbers, so that x, dy and the weights never share a generator.
const X_STREAM: u64 = 0;
const DY_STREAM: u64 = 1;
const WEIGHT_STREAM: u64 = 2;
const RESIDUAL_STREAM: u64 = 3;
const DSUM_STREAM: u64 = 4;

impl<T: Element, R: Element> Inputs<T, R> {
    /// x rows each with their own offset and spread (so the mean matters), dy in [-1, 1),
    /// gamma in [0.5, 1.5), beta in [-0.5, 0.5); with `residual`, a residual in [-1, 1) and
    /// dsum in [-1, 1), of the stream's type.
    pub fn random(rows: usize, n: usize, seed: u64, residual: bool) -> Inputs<T, R> {
        let x = random_rows(rows, n, seed, X_STREAM, |rng, row| {
            let spread = 10f32.powf(rng.random_range(-1.0..1.0));
            let offset = spread * rng.random_range(-2.0..2.0);
            row.iter_mut()
                .for_each(|v| *v = T::from_f32(offset + spread * rng.random_range(-1.0..1.0)));
        });
        let dy = unit_rows(rows, n, seed, DY_STREAM);
        let mut rng = generator(seed, WEIGHT_STREAM, 0);
        let gamma = Array1::from_shape_fn(n, |_| T::from_f32(rng.random_range(0.5..1.5)));
        let beta = Array1::from_shape_fn(n, |_| T::from_f32(rng.random_range(-0.5..0.5)));
        let residual = residual.then(|| {
            let residual: Array2<R> = unit_rows(rows, n, seed, RESIDUAL_STREAM);
            let sum = Zip::from(&x)
                .and(&residual)
                .map_collect(|x, r| R::from_f32(x.to_f32() + r.to_f32()));
            Residual {
                residual,
                dsum: unit_rows(rows, n, seed, DSUM_STREAM),
                sum,
            }
        });
        Inputs {
            x,
            dy,
            gamma,
            beta,
            residual,
        }
    }

    /// Row `r` of the rows the norm normalizes, in f64: s with the residual add, else x.
    pub fn normalized_row(&self, r: usize) -> Vec<f64> {
        match &self.residual {
            Some(res) => res.sum.row(r).iter().map(|e| e.to_f32() as f64).collect(),
            None => self.x.row(r).iter().map(|e| e.to_f32() as f64).collect(),
        }
    }
}

/// A `[rows, n]` array of values in [-1, 1).
fn unit_rows<E: Element>(rows: usize, n: usize, seed: u64, stream: u64) -> Array2<E> {
    random_rows(rows, n, seed, stream, |rng, row: &mut [E]| {
        row.iter_mut()
            .for_each(|v| *v = E::from_f32(rng.random_range(-1.0..1.0)));
    })
}

fn generator(seed: u64, stream: u64, row: usize) -> SmallRng {
    // Distinct (stream, row) pairs give distinct seeds for any realistic row count.
    SmallRng::seed_from_u64(seed ^ (stream << 56) ^ row as u64)
}

/// A `[rows, n]` array whose row i is filled by `fill(generator for row i, row)`.
fn random_rows<T: Element>(
    rows: usize,
    n: usize,
    seed: u64,
    stream: u64,
    fill: impl Fn(&mut SmallRng, &mut [T]) + Sync,
) -> Array2<T> {
    let blocks = map_ranges(rows, |block| {
        let mut values = vec![T::from_f32(0.0); block.len() * n];
        for (row, values) in block.zip(values.chunks_exact_mut(n)) {
            fill(&mut generator(seed, stream, row), values);
        }
        values
    });
    Array2::from_shape_vec((rows, n), blocks.concat()).expect("one block per range of rows")
}
