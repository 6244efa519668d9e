//! The residual add fused with the norm (`forward_residual`, `backward_residual`), both norms,
//! both backward modes, on the CPU and the GPU:
//! - s is x + residual summed in f32 and rounded once, to the bit;
//! - y against the float64 reference of the norm of s, and dx against the reference's
//!   gradient through s plus dsum (with and without a dsum), dgamma and dbeta as well;
//! - without a dsum, the residual backward is the plain backward of the same context, to the
//!   bit (the context holds s);
//! - the shapes and dtypes it is given are checked, with typed errors;
//! - with the residual stream kept in f32 beside f16/bf16 x (`forward_residual_f32`): s
//!   unrounded, y and the gradients against the reference, dx the f32 gradient rounded once.

mod common;

use common::{
    Problem, Rng, SHAPES, gpu_or_skip, random_matrix, rel_err, rel_err_at_least, to_f64, tolerance,
};
use layernorm_cuda::{
    BackwardMode, Device, Element, Error, F32Stream, Gradients, LayerNorm, RmsNorm, Weight, bf16, f16,
};
use layernorm_reference as reference;
use ndarray::{Array1, Array2, ArrayView2, Zip};

const EPS: f32 = 1e-5;
const MODES: [BackwardMode; 2] = [BackwardMode::Deterministic, BackwardMode::Locked { groups: None }];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Norm {
    Layer,
    Rms,
}

/// x, residual, dy and dsum of one problem, with its weights.
struct Case<T, W> {
    p: Problem<T, W>,
    residual: Array2<T>,
    dsum: Array2<T>,
}

impl<T: Element, W: Element> Case<T, W> {
    fn random(rows: usize, n: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x5eed);
        Case {
            p: Problem::random(rows, n, seed),
            residual: random_matrix(&mut rng, rows, n),
            dsum: random_matrix(&mut rng, rows, n),
        }
    }
}

/// What one forward and backward returned, as host arrays.
struct Run<T: Element, W: Element> {
    y: Array2<T>,
    sum: Array2<T>,
    grads: Gradients<T, W>,
    /// The plain backward of the same context (no dsum).
    plain: Gradients<T, W>,
}

fn run<T: Element, W: Weight<T>>(
    device: &Device,
    norm: Norm,
    mode: BackwardMode,
    c: &Case<T, W>,
    with_dsum: bool,
) -> Run<T, W> {
    let up = |a: &Array2<T>| device.upload(a.view()).unwrap();
    let (x, residual, dy, dsum) = (up(&c.p.x), up(&c.residual), up(&c.p.dy), up(&c.dsum));
    let dsum = with_dsum.then_some(&dsum);
    // The two ops have the same calls, but no trait in common.
    macro_rules! forward_backward {
        ($op:expr) => {{
            let op = $op.unwrap().with_backward_mode(mode).unwrap();
            let (y, sum, ctx) = op.forward_residual(&x, &residual).unwrap();
            let grads = op.backward_residual(&ctx, &dy, dsum).unwrap();
            (y, sum, grads, op.backward(&ctx, &dy).unwrap())
        }};
    }
    let (y, sum, grads, plain) = match norm {
        Norm::Layer => forward_backward!(LayerNorm::<T, W>::from_arrays(
            device,
            c.p.gamma.view(),
            c.p.beta.view(),
            EPS
        )),
        Norm::Rms => forward_backward!(RmsNorm::<T, W>::from_array(device, c.p.gamma.view(), EPS)),
    };
    Run {
        y: y.to_array2().unwrap(),
        sum: sum.to_array2().unwrap(),
        grads,
        plain,
    }
}

fn bits<E: Element>(v: &[E]) -> Vec<u32> {
    v.iter().map(|e| e.to_f32().to_bits()).collect()
}

/// Every check of the file's header for one case.
fn check<T: Element, W: Weight<T>>(
    device: &Device,
    norm: Norm,
    mode: BackwardMode,
    rows: usize,
    n: usize,
    seed: u64,
) {
    let c = Case::<T, W>::random(rows, n, seed);
    let with_dsum = seed.is_multiple_of(2);
    let what = format!("{norm:?} {} {mode:?} [{rows}, {n}] dsum {with_dsum}", T::NAME);
    let r = run(device, norm, mode, &c, with_dsum);

    let mut expected_sum = c.p.x.clone();
    Zip::from(&mut expected_sum)
        .and(&c.p.x)
        .and(&c.residual)
        .for_each(|s, &x, &r| *s = T::from_f32(x.to_f32() + r.to_f32()));
    assert_eq!(
        bits(r.sum.as_slice().unwrap()),
        bits(expected_sum.as_slice().unwrap()),
        "{what}: s = x + residual"
    );

    let expected = Expected::of(
        norm,
        to_f64(r.sum.view()),
        &c.p,
        with_dsum.then(|| to_f64(c.dsum.view())),
    );
    let tol = tolerance::<T>();
    let dx = r.grads.dx.to_array2().unwrap();
    expected.assert_y_and_params(&what, r.y.view(), &r.grads, tol);
    expected.assert_dx(&what, "dx", dx.view(), tol);

    if !with_dsum {
        let plain_dx = r.plain.dx.to_vec().unwrap();
        assert_eq!(
            bits(&dx.into_raw_vec_and_offset().0),
            bits(&plain_dx),
            "{what}: dx = plain dx"
        );
    }
}

/// The float64 reference of the norm of s (`[rows, n]`, as the op formed it) with the
/// problem's weights and dy, dsum added to dx where given.
struct Expected {
    norm: Norm,
    y: Array2<f64>,
    dx: Array2<f64>,
    dgamma: Array1<f64>,
    dbeta: Array1<f64>,
    /// ||dy||: dx of a row can be far smaller than dy (n = 1 gives 0), so gradients are
    /// measured against dy's size.
    floor: f64,
}

impl Expected {
    fn of<T: Element, W: Element>(
        norm: Norm,
        s: Array2<f64>,
        p: &Problem<T, W>,
        dsum: Option<Array2<f64>>,
    ) -> Self {
        let (gamma, beta, dy) = (to_f64(p.gamma.view()), to_f64(p.beta.view()), to_f64(p.dy.view()));
        let eps = EPS as f64;
        let (y, (mut dx, dgamma, dbeta)) = match norm {
            Norm::Layer => (
                reference::forward(s.view(), gamma.view(), beta.view(), eps).0,
                reference::backward(s.view(), dy.view(), gamma.view(), eps),
            ),
            Norm::Rms => {
                let (dx, dgamma) = reference::rms_backward(s.view(), dy.view(), gamma.view(), eps);
                let no_beta = Array1::zeros(s.ncols());
                (
                    reference::rms_forward(s.view(), gamma.view(), eps).0,
                    (dx, dgamma, no_beta),
                )
            }
        };
        if let Some(dsum) = dsum {
            dx += &dsum;
        }
        let floor = dy.iter().map(|v| v * v).sum::<f64>().sqrt();
        Expected {
            norm,
            y,
            dx,
            dgamma,
            dbeta,
            floor,
        }
    }

    /// y, dgamma and dbeta (none for RMSNorm) within `tol`.
    fn assert_y_and_params<T: Element, W: Element>(
        &self,
        what: &str,
        y: ArrayView2<'_, T>,
        grads: &Gradients<T, W>,
        tol: f64,
    ) {
        let e = rel_err(y, self.y.view());
        assert!(e < tol, "{what}: y rel err {e:e}");
        let dgamma = grads.dgamma.as_ref().unwrap().to_array1().unwrap();
        let e = rel_err_at_least(dgamma.view(), self.dgamma.view(), self.floor);
        assert!(e < tol, "{what}: dgamma rel err {e:e}");
        if self.norm == Norm::Layer {
            let dbeta = grads.dbeta.as_ref().unwrap().to_array1().unwrap();
            let e = rel_err_at_least(dbeta.view(), self.dbeta.view(), self.floor);
            assert!(e < tol, "{what}: dbeta rel err {e:e}");
        } else {
            assert!(grads.dbeta.is_none(), "{what}: RMSNorm has no dbeta");
        }
    }

    /// A gradient of s (`name`: dx, or the residual's in f32) within `tol`.
    fn assert_dx<E: Element>(&self, what: &str, name: &str, dx: ArrayView2<'_, E>, tol: f64) {
        let e = rel_err_at_least(dx, self.dx.view(), self.floor);
        assert!(e < tol, "{what}: {name} rel err {e:e}");
    }
}

/// `check(norm, mode, rows, n, seed)` for every norm, mode and shape, seeds from `first`.
fn each_case(first: u64, mut check: impl FnMut(Norm, BackwardMode, usize, usize, u64)) {
    let mut seed = first;
    for norm in [Norm::Layer, Norm::Rms] {
        for mode in MODES {
            for &(rows, n) in SHAPES {
                seed += 1;
                check(norm, mode, rows, n, seed);
            }
        }
    }
}

/// Every norm, mode and shape for x of `T` and weights of `W`.
fn check_all<T: Element, W: Weight<T>>(device: &Device) {
    each_case(0, |norm, mode, rows, n, seed| {
        check::<T, W>(device, norm, mode, rows, n, seed)
    });
}

/// A CPU and a GPU test per type pair, each running `$check` (every case) on its device:
/// one pair's GPU test is what a racecheck run finishes within a device call.
macro_rules! against_reference {
    ($check:ident; $($pair:ident: $t:ty, $w:ty;)*) => {$(
        mod $pair {
            use super::*;

            #[test]
            fn cpu_residual_matches_the_reference() {
                $check::<$t, $w>(&Device::cpu());
            }

            #[test]
            fn gpu_residual_matches_the_reference() {
                let Some(gpu) = gpu_or_skip() else { return };
                $check::<$t, $w>(&gpu);
            }
        }
    )*};
}

against_reference! { check_all;
    f32_f32: f32, f32;
    f16_f16: f16, f16;
    bf16_bf16: bf16, bf16;
    bf16_f32: bf16, f32;
}

/// Rows longer than the shapes above reach, on the GPU, every way the residual forward's
/// block kernels take a row (kernels-gpu/src/forward.rs): s held in registers (f32 n =
/// 12288 and bf16 24576 on 512 threads: 6 packs a rank), staged in shared memory (f32
/// 32768 and f16 65536: 16 packs a rank, 4 held), streamed (f32 65536: too long to stage),
/// and one row of odd length each held and staged, whose last elements follow one by one.
/// Their backward, with a dsum and without, reaches the cluster kernels on sm_90: with a
/// dsum, the held ones for f32 n >= 32768 and the general one for f16 65536 (the held
/// cluster kernels of f16 rows and weights take no dsum).
#[test]
fn gpu_residual_long_rows_match_the_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    // Odd seeds run without a dsum, even ones with (`check`).
    for (norm, seed) in [(Norm::Layer, 1000), (Norm::Rms, 1001)] {
        for (rows, n) in [(2, 12288), (1, 12289), (2, 32768), (1, 32771), (2, 65536)] {
            check::<f32, f32>(&gpu, norm, BackwardMode::Deterministic, rows, n, seed + n as u64);
        }
        check::<f16, f16>(&gpu, norm, BackwardMode::Locked { groups: None }, 2, 65536, seed);
        check::<bf16, bf16>(&gpu, norm, BackwardMode::Deterministic, 2, 24576, seed + 1);
    }
}

/// A block for every row (`plan::Grid::EveryRow`, sm_90): the residual forward's pipelined
/// teams of 256 ranks (f16 N = 8192, f32 4096, and bf16 4096 with the stream in f32) and
/// its f32 teams of 512 holding their row (pipelined at 8192, the general kernel at 12288),
/// each block one row, both norms, the backward after them.
#[test]
fn gpu_residual_grid_of_every_row() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mode = BackwardMode::Deterministic;
    for (norm, seed) in [(Norm::Layer, 1100), (Norm::Rms, 1110)] {
        check::<f16, f16>(&gpu, norm, mode, 300, 8192, seed);
        check::<f32, f32>(&gpu, norm, mode, 301, 4096, seed + 1);
        check::<f32, f32>(&gpu, norm, mode, 302, 8192, seed + 2);
        check::<f32, f32>(&gpu, norm, mode, 303, 12288, seed + 3);
        check_f32_stream::<bf16, bf16>(&gpu, norm, mode, 304, 4096, seed + 4);
    }
}

/// Residual rows of f32 of warp length with more packs than a warp holds at 4 a lane (f32 x,
/// or a stream in f32, N = 513-1024): pipelined block teams of 64 ranks, 3 packs a rank at
/// N = 768 and 4 at 1024, in launches of more rows than the resident teams (about 1000 on
/// an H100 or H200: they loop), both norms, the backward after them.
#[test]
fn gpu_residual_f32_rows_of_warp_length() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mode = BackwardMode::Deterministic;
    for (norm, seed) in [(Norm::Layer, 1120), (Norm::Rms, 1130)] {
        check::<f32, f32>(&gpu, norm, mode, 3000, 768, seed);
        check::<f32, f32>(&gpu, norm, mode, 2500, 1024, seed + 1);
        check_f32_stream::<f16, f16>(&gpu, norm, mode, 2501, 1024, seed + 2);
        check_f32_stream::<bf16, f32>(&gpu, norm, mode, 3001, 768, seed + 3);
    }
}

/// The streamed residual forward: launches of more rows than multiprocessors (140: an
/// H100's or H200's 132, an A100's 108) whose rows are all aligned packs too long for a
/// block of 512 to hold at 8 packs a rank (4097 packs: f32 N = 16388, f16 32776, and bf16
/// beside a stream in f32 at 16388), both norms, with a dsum and without, the backward after
/// them.
#[test]
fn gpu_residual_streamed_rows_match_the_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mode = BackwardMode::Deterministic;
    for (norm, seed) in [(Norm::Layer, 1200), (Norm::Rms, 1211)] {
        check::<f32, f32>(&gpu, norm, mode, 140, 16388, seed);
        check::<f16, f16>(&gpu, norm, mode, 140, 32776, seed + 1);
        check_f32_stream::<bf16, f32>(&gpu, norm, mode, 140, 16388, seed + 2);
    }
}

/// The held residual forward: launches of more rows than multiprocessors (140) whose
/// 16-bit rows are all aligned packs past what the pipelined block holds and within 4 packs
/// a rank of 1024 (f16 N = 32768: 4 packs every rank; bf16 20000: 2 or 3; f16 16392: 3 on
/// rank 0, 2 on the others; bf16 24576: 3), or that it holds on teams of 128, 256 or 512
/// ranks, both norms, with a dsum and without, the backward after them.
#[test]
fn gpu_residual_held_rows_match_the_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mode = BackwardMode::Deterministic;
    for (norm, seed) in [(Norm::Layer, 1300), (Norm::Rms, 1311)] {
        check::<f16, f16>(&gpu, norm, mode, 140, 32768, seed);
        check::<bf16, bf16>(&gpu, norm, mode, 140, 20000, seed + 1);
        check::<f16, f16>(&gpu, norm, mode, 140, 16392, seed + 2);
        check::<bf16, bf16>(&gpu, norm, mode, 140, 24576, seed + 3);
        // Rows the pipelined block would hold, on teams of 128, 256 and 512 ranks (all 4
        // packs a rank, 1023 packs on 256 ranks, 1921 on 512).
        check::<f16, f16>(&gpu, norm, mode, 140, 4096, seed + 4);
        check::<bf16, bf16>(&gpu, norm, mode, 140, 8184, seed + 5);
        check::<f16, f16>(&gpu, norm, mode, 140, 15368, seed + 6);
    }
}

/// Launches of more rows than multiprocessors (140) whose rows are not whole aligned packs,
/// past a warp's length: on sm_90 the streamed kernel takes them at 64 registers (on sm_80
/// the general kernel), in half packs where 8-byte aligned, 16-bit rows shifted off their
/// 16-byte boundaries in packs from the first one, else element by element: teams of 64 to
/// 512 ranks (bf16 N = 1030, half packs and two elements on rows 8-byte aligned, shifted or
/// elements on the others; f16 4100 and f16 with f32 weights 16388, half packs; f32 4097
/// and 12289, half packs and elements on alternate rows; f16 2051 and f16 with f32 weights
/// 4097, shifted or elements on every row; f16 4097 and 16383, shifted), and a stream in
/// f32 beside bf16 (N = 4099, elements), both norms, with a dsum and without, the backward
/// after them. On sm_90 rows of one type with weights of it (bf16 1030, f16 4100 in half
/// packs, 2051, 4097 and 16383; f32 1030, 4097 and 12289) take the held residual kernel's
/// shifted copy instead, in packs from their first boundary, 4 a rank of 64 to 1024 ranks
/// (bf16 20001 and f32 12289 on 1024).
#[test]
fn gpu_residual_unaligned_rows_of_many_match_the_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mode = BackwardMode::Deterministic;
    for (norm, seed) in [(Norm::Layer, 1400), (Norm::Rms, 1411)] {
        check::<bf16, bf16>(&gpu, norm, mode, 140, 1030, seed);
        check::<f16, f16>(&gpu, norm, mode, 140, 4100, seed + 1);
        check::<f32, f32>(&gpu, norm, mode, 140, 4097, seed + 2);
        check::<f16, f32>(&gpu, norm, mode, 140, 16388, seed + 3);
        check::<f32, f32>(&gpu, norm, mode, 140, 12289, seed + 4);
        check_f32_stream::<bf16, bf16>(&gpu, norm, mode, 140, 4099, seed + 5);
        check::<f16, f16>(&gpu, norm, mode, 140, 2051, seed + 6);
        check::<f16, f32>(&gpu, norm, mode, 140, 4097, seed + 7);
        check::<f16, f16>(&gpu, norm, mode, 140, 16383, seed + 8);
        check::<f16, f16>(&gpu, norm, mode, 140, 4097, seed + 9);
        check::<bf16, bf16>(&gpu, norm, mode, 140, 20001, seed + 10);
        check::<f32, f32>(&gpu, norm, mode, 140, 1030, seed + 11);
    }
}

/// CPU and GPU agree on s to the bit (the same f32 sum, rounded once), and the GPU's y is
/// the CPU's within the dtype's rounding.
#[test]
fn gpu_residual_sum_is_the_cpus() {
    let Some(gpu) = gpu_or_skip() else { return };
    for &(rows, n) in SHAPES {
        let c = Case::<bf16, bf16>::random(rows, n, n as u64);
        let on = |device: &Device| run(device, Norm::Rms, BackwardMode::Deterministic, &c, true);
        let (cpu, gpu) = (on(&Device::cpu()), on(&gpu));
        assert_eq!(
            bits(cpu.sum.as_slice().unwrap()),
            bits(gpu.sum.as_slice().unwrap()),
            "[{rows}, {n}]: s"
        );
        let e = rel_err(gpu.y.view(), to_f64(cpu.y.view()).view());
        assert!(
            e < tolerance::<bf16>(),
            "[{rows}, {n}]: y, GPU against CPU: {e:e}"
        );
    }
}

/// A residual or dsum of another shape, and a sum output that is shared, are typed errors
/// that leave the outputs as they were.
#[test]
fn bad_residual_arguments_are_refused() {
    let mut devices = vec![Device::cpu()];
    devices.extend(gpu_or_skip());
    for device in &devices {
        let op = LayerNorm::<f32>::from_arrays(device, Array1::ones(8).view(), Array1::zeros(8).view(), EPS)
            .unwrap();
        let x = device.upload(Array2::<f32>::ones((4, 8)).view()).unwrap();
        let short = device.upload(Array2::<f32>::ones((3, 8)).view()).unwrap();
        assert!(matches!(
            op.forward_residual(&x, &short),
            Err(Error::Shape { what: "residual", .. })
        ));
        let (mut y, mut sum) = (
            device.zeros::<f32>(&[4, 8]).unwrap(),
            device.zeros::<f32>(&[4, 8]).unwrap(),
        );
        let held = sum.clone();
        assert!(matches!(
            op.forward_residual_into(&x, &x, &mut y, &mut sum),
            Err(Error::SharedOutput { what: "sum" })
        ));
        drop(held);
        let mut wrong = device.zeros::<f32>(&[4, 9]).unwrap();
        assert!(matches!(
            op.forward_residual_into(&x, &x, &mut y, &mut wrong),
            Err(Error::Shape { what: "sum", .. })
        ));
        let (_, s, ctx) = op.forward_residual(&x, &x).unwrap();
        assert_eq!(s.to_vec().unwrap(), vec![2.0; 32]);
        assert!(matches!(
            op.backward_residual(&ctx, &x, Some(&short)),
            Err(Error::Shape { what: "dsum", .. })
        ));
    }
}

/// The residual stream kept in f32 beside f16/bf16 x (`forward_residual_f32`,
/// `backward_residual_f32`): s is x + residual in f32, to the bit (not rounded to x's
/// type); y, dgamma and dbeta against the reference of the norm of that s; the residual's
/// gradient (f32) against the reference's dx through s plus dsum, and dx (x's type) that
/// gradient rounded once, to the bit.
fn check_f32_stream<T: F32Stream, W: Weight<T>>(
    device: &Device,
    norm: Norm,
    mode: BackwardMode,
    rows: usize,
    n: usize,
    seed: u64,
) {
    let c = Case::<T, W>::random(rows, n, seed);
    let mut rng = Rng::new(seed ^ 0xf32);
    let (residual, dsum) = (
        random_matrix::<f32>(&mut rng, rows, n),
        random_matrix::<f32>(&mut rng, rows, n),
    );
    let with_dsum = seed.is_multiple_of(2);
    let what = format!(
        "{norm:?} {} f32 stream {mode:?} [{rows}, {n}] dsum {with_dsum}",
        T::NAME
    );
    let (x, dy) = (
        device.upload(c.p.x.view()).unwrap(),
        device.upload(c.p.dy.view()).unwrap(),
    );
    let (residual_d, dsum_d) = (
        device.upload(residual.view()).unwrap(),
        device.upload(dsum.view()).unwrap(),
    );
    let dsum_arg = with_dsum.then_some(&dsum_d);
    macro_rules! forward_backward {
        ($op:expr) => {{
            let op = $op.unwrap().with_backward_mode(mode).unwrap();
            let (y, sum, ctx) = op.forward_residual_f32(&x, &residual_d).unwrap();
            let (grads, d_residual) = op.backward_residual_f32(&ctx, &dy, dsum_arg).unwrap();
            (y, sum, grads, d_residual)
        }};
    }
    let (y, sum, grads, d_residual) = match norm {
        Norm::Layer => forward_backward!(LayerNorm::<T, W>::from_arrays(
            device,
            c.p.gamma.view(),
            c.p.beta.view(),
            EPS
        )),
        Norm::Rms => forward_backward!(RmsNorm::<T, W>::from_array(device, c.p.gamma.view(), EPS)),
    };
    let sum = sum.to_array2().unwrap();
    let mut expected_sum = residual.clone();
    Zip::from(&mut expected_sum)
        .and(&c.p.x)
        .for_each(|s, &x| *s += x.to_f32());
    assert_eq!(
        bits(sum.as_slice().unwrap()),
        bits(expected_sum.as_slice().unwrap()),
        "{what}: s = x + residual in f32"
    );

    let dsum = with_dsum.then(|| to_f64(dsum.view()));
    let expected = Expected::of(norm, to_f64(sum.view()), &c.p, dsum);
    expected.assert_y_and_params(&what, y.to_array2().unwrap().view(), &grads, tolerance::<T>());
    let d_residual = d_residual.to_array2().unwrap();
    expected.assert_dx(&what, "d_residual", d_residual.view(), tolerance::<f32>());
    let dx = grads.dx.to_array2().unwrap();
    let rounded: Vec<T> = d_residual.iter().map(|&v| T::from_f32(v)).collect();
    assert_eq!(
        bits(dx.as_slice().unwrap()),
        bits(&rounded),
        "{what}: dx = d_residual rounded once"
    );
}

/// Every norm, mode and shape of the f32 stream for x of `T` and weights of `W`.
fn check_all_f32_stream<T: F32Stream, W: Weight<T>>(device: &Device) {
    each_case(500, |norm, mode, rows, n, seed| {
        check_f32_stream::<T, W>(device, norm, mode, rows, n, seed)
    });
}

/// The CPU and GPU tests of the stream in f32, per type pair.
mod f32_stream {
    use super::*;

    against_reference! { check_all_f32_stream;
        f16_f16: f16, f16;
        bf16_bf16: bf16, bf16;
        f16_f32: f16, f32;
        bf16_f32: bf16, f32;
    }
}

/// Rows long enough for the f32-stream kernels' block teams to hold s in registers
/// (bf16 n = 12288), to stage it in shared memory in the forward where the device has room
/// (f16 n = 32768 on sm_90: x's 8-byte packs copied into 16-byte slots) and to stream it
/// (f16 n = 65536), one of odd length, with a dsum and without. On sm_90 their backward
/// takes every cluster kernel (tests/plan.rs, `f32_stream_plans`): slices of f32 rows held
/// over 2 blocks (12288), 4 (32768) and 8 (65536, locked), and the general one (12289).
/// Few rows: the test to run the sanitizers on for these kernels.
#[test]
fn gpu_f32_stream_long_rows_match_the_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (norm, seed) in [(Norm::Layer, 2000), (Norm::Rms, 2001)] {
        check_f32_stream::<bf16, bf16>(&gpu, norm, BackwardMode::Deterministic, 2, 12288, seed);
        check_f32_stream::<bf16, f32>(&gpu, norm, BackwardMode::Deterministic, 1, 12289, seed + 1);
        check_f32_stream::<f16, f32>(&gpu, norm, BackwardMode::Deterministic, 3, 32768, seed + 2);
        check_f32_stream::<f16, f16>(&gpu, norm, BackwardMode::Locked { groups: None }, 2, 65536, seed);
    }
}

/// One row on each path of the f32 stream's block residual forward (on sm_90; sm_80 stages
/// none of them): held (n = 16384: 4096 packs, 8 a rank at 512 threads), staged (n = 20000:
/// 5000 packs, 2048 held, the rest copied, x's 8 bytes a 16-byte slot), streamed in packs
/// (n = 65536: too long to stage) and element by element (n = 20001). Small enough for the
/// sanitizers, which this is the test to run them on for these kernels.
#[test]
fn gpu_f32_stream_forward_paths_match_the_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (i, n) in [16384, 20000, 20001, 65536].into_iter().enumerate() {
        let seed = 2100 + 2 * i as u64;
        check_f32_stream::<bf16, f32>(&gpu, Norm::Layer, BackwardMode::Deterministic, 1, n, seed);
        check_f32_stream::<f16, f16>(&gpu, Norm::Rms, BackwardMode::Deterministic, 1, n, seed + 1);
    }
}

/// The CPU path's f32-stream forward takes a long call's rows a chunk at a time (rows of 1024:
/// 256 rows a chunk where the machine has two threads, more where it has more); each row's
/// y and s must be the same bits whatever rows share its call: all 600 rows in one call,
/// and 7 rows a call.
#[test]
fn cpu_f32_stream_rows_do_not_depend_on_their_call() {
    let (rows, n, part) = (600, 1024, 7);
    let c = Case::<bf16, f32>::random(rows, n, 2200);
    let residual = random_matrix::<f32>(&mut Rng::new(2201), rows, n);
    let cpu = Device::cpu();
    let op = LayerNorm::<bf16, f32>::from_arrays(&cpu, c.p.gamma.view(), c.p.beta.view(), EPS).unwrap();
    let run = |from: usize, to: usize| {
        let x = cpu.upload(c.p.x.slice(ndarray::s![from..to, ..])).unwrap();
        let r = cpu.upload(residual.slice(ndarray::s![from..to, ..])).unwrap();
        let (y, sum, _) = op.forward_residual_f32(&x, &r).unwrap();
        (y.to_array2().unwrap(), sum.to_array2().unwrap())
    };
    let (y, sum) = run(0, rows);
    for from in (0..rows).step_by(part) {
        let to = (from + part).min(rows);
        let (y_part, sum_part) = run(from, to);
        let y_rows = y.slice(ndarray::s![from..to, ..]).to_owned();
        let sum_rows = sum.slice(ndarray::s![from..to, ..]).to_owned();
        assert_eq!(
            bits(y_part.as_slice().unwrap()),
            bits(y_rows.as_slice().unwrap()),
            "y, rows {from}..{to}"
        );
        assert_eq!(
            bits(sum_part.as_slice().unwrap()),
            bits(sum_rows.as_slice().unwrap()),
            "s, rows {from}..{to}"
        );
    }
}

/// The f32 stream's arguments are checked as the plain residual's are: a residual, dsum or
/// d_residual of another shape is a typed error.
#[test]
fn bad_f32_stream_arguments_are_refused() {
    let mut devices = vec![Device::cpu()];
    devices.extend(gpu_or_skip());
    for device in &devices {
        let op = LayerNorm::<bf16>::from_arrays(
            device,
            Array1::from_elem(8, bf16::ONE).view(),
            Array1::from_elem(8, bf16::ZERO).view(),
            EPS,
        )
        .unwrap();
        let x = device
            .upload(Array2::from_elem((4, 8), bf16::ONE).view())
            .unwrap();
        let residual = device
            .upload(Array2::<f32>::from_elem((4, 8), 0.5).view())
            .unwrap();
        let short = device.upload(Array2::<f32>::ones((3, 8)).view()).unwrap();
        assert!(matches!(
            op.forward_residual_f32(&x, &short),
            Err(Error::Shape { what: "residual", .. })
        ));
        let (_, s, ctx) = op.forward_residual_f32(&x, &residual).unwrap();
        assert_eq!(s.to_vec().unwrap(), vec![1.5f32; 32]);
        assert!(matches!(
            op.backward_residual_f32(&ctx, &x, Some(&short)),
            Err(Error::Shape { what: "dsum", .. })
        ));
        let mut grads = op
            .backward_residual(&op.forward(&x).unwrap().1, &x, None)
            .unwrap();
        let mut wrong = device.zeros::<f32>(&[4, 9]).unwrap();
        assert!(matches!(
            op.backward_residual_f32_into(&ctx, &x, None, &mut grads, &mut wrong),
            Err(Error::Shape {
                what: "d_residual",
                ..
            })
        ));
    }
}
