//! Seeded random inputs, never zeros: zeros hide unwritten outputs and can run faster than
//! real data. Each row draws from its own generator, so the rows are filled in parallel
//! and the same seed gives the same inputs on any number of cores.

use layernorm_cuda::Element;
use ndarray::{Array1, Array2};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::parallel::map_ranges;

/// One configuration's host inputs: x and dy `[rows, n]`, gamma and beta `[n]`.
pub struct Inputs<T> {
    pub x: Array2<T>,
    pub dy: Array2<T>,
    pub gamma: Array1<T>,
    pub beta: Array1<T>,
}

/// Stream numbers, so that x, dy and the weights never share a generator.
const X_STREAM: u64 = 0;
const DY_STREAM: u64 = 1;
const WEIGHT_STREAM: u64 = 2;

impl<T: Element> Inputs<T> {
    /// x rows each with their own offset and spread (so the mean matters), dy in [-1, 1),
    /// gamma in [0.5, 1.5), beta in [-0.5, 0.5).
    pub fn random(rows: usize, n: usize, seed: u64) -> Inputs<T> {
        let x = random_rows(rows, n, seed, X_STREAM, |rng, row| {
            let spread = 10f32.powf(rng.random_range(-1.0..1.0));
            let offset = spread * rng.random_range(-2.0..2.0);
            row.iter_mut()
                .for_each(|v| *v = T::from_f32(offset + spread * rng.random_range(-1.0..1.0)));
        });
        let dy = random_rows(rows, n, seed, DY_STREAM, |rng, row| {
            row.iter_mut()
                .for_each(|v| *v = T::from_f32(rng.random_range(-1.0..1.0)));
        });
        let mut rng = generator(seed, WEIGHT_STREAM, 0);
        let gamma = Array1::from_shape_fn(n, |_| T::from_f32(rng.random_range(0.5..1.5)));
        let beta = Array1::from_shape_fn(n, |_| T::from_f32(rng.random_range(-0.5..0.5)));
        Inputs { x, dy, gamma, beta }
    }
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
