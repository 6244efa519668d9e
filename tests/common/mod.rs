//! Shared by the integration tests: seeded random inputs, error measures, tolerances, and
//! the GPU-or-skip rule. The float64 reference is the `layernorm-reference` crate
//! (reference/), which ln-bench's check uses too.
#![allow(dead_code)] // each test binary uses its own subset

use layernorm_cuda::plan::{Norm, Pass, plan};
use layernorm_cuda::{Device, Element, Error, Tensor, Weight};
use ndarray::{Array, Array1, Array2, ArrayView, Dimension};

/// (rows, n): single elements and rows; n odd (every row misaligned for 16-byte packs) or
/// one past a pack multiple; warp-per-row and block-per-row sizes; rows past 64 KB.
pub const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (5, 1),
    (7, 3),
    (1, 1024),
    (100, 96),
    (33, 769),
    (64, 1024),
    (9, 4096),
    (3, 4097),
    (5, 8192),
    (3, 65537),
    (2, 262144),
];

/// One forward-and-backward problem: `[rows, n]` x (rows of mixed scales) and dy of `T`,
/// gamma (about 1) and beta (about 0) of `W`.
pub struct Problem<T, W = T> {
    pub x: Array2<T>,
    pub dy: Array2<T>,
    pub gamma: Array1<W>,
    pub beta: Array1<W>,
}

impl<T: Element, W: Element> Problem<T, W> {
    /// The same values for a seed whatever `W` is (drawn in f64, then rounded).
    pub fn random(rows: usize, n: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        Problem {
            x: mixed_matrix(&mut rng, rows, n),
            dy: random_matrix(&mut rng, rows, n),
            gamma: random_vec(&mut rng, n, 1.0, 0.5),
            beta: random_vec(&mut rng, n, 0.0, 0.5),
        }
    }
}

/// SplitMix64: small, seedable and the same on every platform, so a failing seed replays.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// Rows of mixed signs and magnitudes: each row its own scale (0.1 to 10) and offset, and
/// every seventh row offset by 1000 times its spread (where E[x^2] - E[x]^2 in f32 would
/// lose every digit). The largest values (about 1e4) stay inside f16's range.
pub fn mixed_matrix<T: Element>(rng: &mut Rng, rows: usize, n: usize) -> Array2<T> {
    let mut x = Array2::from_elem((rows, n), T::from_f32(0.0));
    for (i, mut row) in x.rows_mut().into_iter().enumerate() {
        let scale = 10f64.powf(rng.uniform());
        let offset = if i % 7 == 3 {
            1000.0 * scale
        } else {
            rng.uniform() * scale
        };
        for v in row.iter_mut() {
            *v = T::from_f32((offset + scale * rng.normal()) as f32);
        }
    }
    x
}

pub fn random_vec<T: Element>(rng: &mut Rng, n: usize, center: f64, spread: f64) -> Array1<T> {
    Array1::from_shape_fn(n, |_| T::from_f32((center + spread * rng.uniform()) as f32))
}

pub fn random_matrix<T: Element>(rng: &mut Rng, rows: usize, n: usize) -> Array2<T> {
    Array2::from_shape_fn((rows, n), |_| T::from_f32(rng.normal() as f32))
}

pub fn to_f64<T: Element, D: Dimension>(a: ArrayView<T, D>) -> Array<f64, D> {
    a.mapv(|v| v.to_f32() as f64)
}

/// ||out - ref|| / ||ref|| (ref = 0 gives ||out||); any NaN or inf in `out` gives inf,
/// so unwritten (NaN-poisoned) outputs always fail.
pub fn rel_err<T: Element, D: Dimension>(out: ArrayView<T, D>, reference: ArrayView<f64, D>) -> f64 {
    rel_err_at_least(out, reference, 0.0)
}

/// [`rel_err`], but measured against `floor` where that is larger than ||ref||: for outputs
/// whose own size can be far below that of what they are made from.
pub fn rel_err_at_least<T: Element, D: Dimension>(
    out: ArrayView<T, D>,
    reference: ArrayView<f64, D>,
    floor: f64,
) -> f64 {
    let (mut diff, mut norm) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference.iter()) {
        let o = o.to_f32() as f64;
        if !o.is_finite() {
            return f64::INFINITY;
        }
        diff += (o - r) * (o - r);
        norm += r * r;
    }
    let scale = norm.sqrt().max(floor);
    if scale == 0.0 {
        diff.sqrt()
    } else {
        diff.sqrt() / scale
    }
}

/// Tolerances on `rel_err`, by storage type. Outputs are rounded to the storage type, so
/// its unit roundoff sets the scale (f32 2^-24, f16 2^-11, bf16 2^-8); the margins cover
/// f32 accumulation over long rows and the 1000x-offset rows, whose mean carries an
/// absolute error of about 1000 * spread * 2^-24 in f32.
pub fn tolerance<T: Element>() -> f64 {
    match T::NAME {
        "f32" => 5e-5,
        "f16" => 1e-3,
        "bf16" => 8e-3,
        other => unreachable!("no tolerance for {other}"),
    }
}

/// CUDA device 0, or None (with the reason printed) where no NVIDIA driver is installed
/// and LAYERNORM_REQUIRE_GPU is not 1. Any other failure to open the device fails the test:
/// a driver without a usable device is a broken setup, not a reason to skip.
pub fn gpu_or_skip() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("LAYERNORM_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("LAYERNORM_REQUIRE_GPU=1 but CUDA device 0 cannot be opened: {e}")
        }
        Err(e @ Error::NoDriver) => {
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("CUDA driver present but device 0 failed to open: {e}"),
    }
}

/// Whether this process runs under compute-sanitizer, which instruments every memory access
/// and so makes each kernel hundreds of times slower. (The tool puts its collection library
/// in `NVTX_INJECTION64_PATH` of the process it starts; checked with CUDA 13.0's tool.)
pub fn under_compute_sanitizer() -> bool {
    std::env::var_os("NVTX_INJECTION64_PATH").is_some_and(|path| path.to_string_lossy().contains("sanitizer"))
}

/// A tensor of `shape` full of NaN, to catch outputs a kernel never wrote.
pub fn poisoned<T: Element>(device: &Device, shape: &[usize]) -> Tensor<T> {
    device
        .full(shape, T::from_f32(f32::NAN))
        .expect("allocate a poisoned tensor")
}

/// Whether the ops of weights `T` and of f32 weights take the same kernels with the same
/// blocks for `rows` rows of `n` on `device`, forward and backward (always on the CPU,
/// which has one path): where they do, the two sum in the same order.
pub fn same_plans<T: Element>(device: &Device, rows: usize, n: usize) -> bool
where
    f32: Weight<T>,
{
    let Some(limits) = device.plan_limits() else {
        return true;
    };
    let aligned = (n * size_of::<T>()).is_multiple_of(16);
    [Pass::Forward, Pass::Backward].into_iter().all(|pass| {
        plan::<T, T>(Norm::Layer, rows as u32, n as u32, pass, aligned, limits).ok()
            == plan::<T, f32>(Norm::Layer, rows as u32, n as u32, pass, aligned, limits).ok()
    })
}
