//! f32 weights beside f16 and bf16 rows (`LayerNorm<T, f32>`, `RmsNorm<T, f32>`), as
//! mixed-precision training keeps them:
//! - against the float64 reference over the shapes every other type is tested with, both
//!   norms and both backward modes, with weights that f16 and bf16 cannot hold, and dgamma
//!   and dbeta held to f32's tolerance (a kernel that rounded them to the rows' type fails);
//! - against the same op with weights of the rows' own type, where the weights are values
//!   of that type: the same y and dx bits, and dgamma and dbeta that round to the other's
//!   (both sum in f32; the f16 and bf16 op then rounds once more). On a GPU, where the two
//!   ops' plans differ (the f32-weight kernels of some kinds take fewer threads, so rows
//!   sum in another order), within tolerance instead;
//! - on `[..., n]` input, without bias, and without weights.

mod common;

use common::{
    Problem, Rng, SHAPES, gpu_or_skip, mixed_matrix, random_vec, rel_err, same_plans, to_f64, tolerance,
};
use layernorm_cuda::{BackwardMode, Device, Element, LayerNorm, RmsNorm, Weight, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array1, Array2};

const MODES: [BackwardMode; 2] = [BackwardMode::Deterministic, BackwardMode::Locked { groups: None }];

/// Which op a check runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Norm {
    Layer,
    Rms,
}

/// What one forward and backward gave, on the host.
struct Outputs<T, W> {
    y: Array2<T>,
    dx: Array2<T>,
    dgamma: Array1<W>,
    /// None for RMSNorm, which has no bias.
    dbeta: Option<Array1<W>>,
}

/// Forward and backward of `norm` with weights `gamma` and `beta` (beta unused by RMSNorm).
fn run<T: Element, W: Weight<T>>(
    device: &Device,
    norm: Norm,
    mode: BackwardMode,
    x: &Array2<T>,
    dy: &Array2<T>,
    gamma: &Array1<W>,
    beta: &Array1<W>,
) -> Outputs<T, W> {
    let (x, dy) = (
        device.upload(x.view()).unwrap(),
        device.upload(dy.view()).unwrap(),
    );
    let (y, grads) = match norm {
        Norm::Layer => {
            let op = LayerNorm::<T, W>::from_arrays(device, gamma.view(), beta.view(), 1e-5)
                .unwrap()
                .with_backward_mode(mode)
                .unwrap();
            let (y, ctx) = op.forward(&x).unwrap();
            (y, op.backward(&ctx, &dy).unwrap())
        }
        Norm::Rms => {
            let op = RmsNorm::<T, W>::from_array(device, gamma.view(), 1e-5)
                .unwrap()
                .with_backward_mode(mode)
                .unwrap();
            let (y, ctx) = op.forward(&x).unwrap();
            (y, op.backward(&ctx, &dy).unwrap())
        }
    };
    Outputs {
        y: y.to_array2().unwrap(),
        dx: grads.dx.to_array2().unwrap(),
        dgamma: grads.dgamma.unwrap().to_array1().unwrap(),
        dbeta: grads.dbeta.map(|d| d.to_array1().unwrap()),
    }
}

/// `LayerNorm<T, f32>` or `RmsNorm<T, f32>` against the float64 reference: y and dx to the
/// rows' type's tolerance, dgamma and dbeta to f32's.
fn check_reference<T: Element>(
    device: &Device,
    norm: Norm,
    mode: BackwardMode,
    p: &Problem<T, f32>,
    what: &str,
) where
    f32: Weight<T>,
{
    let out = run::<T, f32>(device, norm, mode, &p.x, &p.dy, &p.gamma, &p.beta);
    let (x, dy, g, b) = (
        to_f64(p.x.view()),
        to_f64(p.dy.view()),
        to_f64(p.gamma.view()),
        to_f64(p.beta.view()),
    );
    let eps = 1e-5f32 as f64;
    let (ry, rdx, rdgamma, rdbeta) = match norm {
        Norm::Layer => {
            let (ry, _, _) = reference::forward(x.view(), g.view(), b.view(), eps);
            let (rdx, rdgamma, rdbeta) = reference::backward(x.view(), dy.view(), g.view(), eps);
            (ry, rdx, rdgamma, Some(rdbeta))
        }
        Norm::Rms => {
            let (ry, _) = reference::rms_forward(x.view(), g.view(), eps);
            let (rdx, rdgamma) = reference::rms_backward(x.view(), dy.view(), g.view(), eps);
            (ry, rdx, rdgamma, None)
        }
    };
    let what = format!(
        "{} {norm:?} {} with f32 weights {mode:?} {:?} {what}",
        device.name(),
        T::NAME,
        p.x.dim()
    );
    let (tol, tol_weights) = (tolerance::<T>(), 2.0 * tolerance::<f32>());
    let err = rel_err(out.y.view(), ry.view());
    assert!(err <= tol, "{what}: y error {err:e}");
    // RMSNorm's dx cancels where a row is a few large values (tests/rms_norm.rs): measured
    // against its terms' size, rstd * |gamma * dy|, as there.
    let err = match norm {
        Norm::Layer => rel_err(out.dx.view(), rdx.view()),
        Norm::Rms => {
            let (_, rstd) = reference::rms_forward(x.view(), g.view(), eps);
            let terms = Array2::from_shape_fn(x.dim(), |(i, j)| (rstd[i] * g[j] * dy[[i, j]]).abs());
            let largest = terms.iter().fold(f64::MIN_POSITIVE, |m, &v| m.max(v));
            let dx = to_f64(out.dx.view());
            (&dx - &rdx).iter().fold(0.0f64, |m, &v| m.max(v.abs())) / largest
        }
    };
    assert!(err <= 2.0 * tol, "{what}: dx error {err:e}");
    let err = rel_err(out.dgamma.view(), rdgamma.view());
    assert!(
        err <= tol_weights,
        "{what}: dgamma error {err:e} > {tol_weights:e}"
    );
    match (out.dbeta, rdbeta) {
        (Some(dbeta), Some(rdbeta)) => {
            let err = rel_err(dbeta.view(), rdbeta.view());
            assert!(
                err <= tol_weights,
                "{what}: dbeta error {err:e} > {tol_weights:e}"
            );
        }
        (None, None) => {}
        (dbeta, _) => panic!(
            "{what}: dbeta {:?} where the op's bias is {norm:?}'s",
            dbeta.is_some()
        ),
    }
}

fn check_all_shapes<T: Element>(device: &Device, seed: u64)
where
    f32: Weight<T>,
{
    for norm in [Norm::Layer, Norm::Rms] {
        for mode in MODES {
            for (i, &(rows, n)) in SHAPES.iter().enumerate() {
                let seed = seed + i as u64;
                let p = Problem::<T, f32>::random(rows, n, seed);
                check_reference(device, norm, mode, &p, &format!("seed {seed}"));
            }
        }
    }
}

#[test]
fn cpu_f32_weights_match_reference() {
    let cpu = Device::cpu();
    check_all_shapes::<f16>(&cpu, 9100);
    check_all_shapes::<bf16>(&cpu, 9200);
}

#[test]
fn gpu_f32_weights_match_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all_shapes::<f16>(&gpu, 9100);
    check_all_shapes::<bf16>(&gpu, 9200);
    // Long rows: the block-team and (sm_90) cluster kernels, held and not.
    for norm in [Norm::Layer, Norm::Rms] {
        for (rows, n, seed) in [(257, 32768, 9300), (33, 65536, 9301), (9, 40000, 9302)] {
            let p = Problem::<bf16, f32>::random(rows, n, seed);
            check_reference(&gpu, norm, BackwardMode::Deterministic, &p, "long rows");
        }
        // Rows 8-byte aligned but not 16: half packs of f16 beside 16 bytes of f32 weights.
        for (rows, n, seed) in [(300, 4100, 9303), (7, 16388, 9304)] {
            let p = Problem::<f16, f32>::random(rows, n, seed);
            check_reference(&gpu, norm, BackwardMode::Deterministic, &p, "half packs");
        }
    }
}

/// With weights that are values of `T`, the f32-weight op against the op of `T` weights.
fn check_against_own_type<T: Element>(device: &Device, seed: u64)
where
    f32: Weight<T>,
{
    for norm in [Norm::Layer, Norm::Rms] {
        for (i, &(rows, n)) in SHAPES.iter().enumerate() {
            let seed = seed + i as u64;
            let p = Problem::<T, f32>::random(rows, n, seed);
            let narrow = |v: &Array1<f32>| v.mapv(T::from_f32);
            let (gamma, beta) = (narrow(&p.gamma), narrow(&p.beta));
            let widen = |v: &Array1<T>| v.mapv(|e| e.to_f32());
            let mode = BackwardMode::Deterministic;
            let own = run::<T, T>(device, norm, mode, &p.x, &p.dy, &gamma, &beta);
            let wide = run::<T, f32>(device, norm, mode, &p.x, &p.dy, &widen(&gamma), &widen(&beta));
            let what = format!("{} {norm:?} {} [{rows}, {n}] seed {seed}", device.name(), T::NAME);
            let bits = |a: &Array2<T>| a.iter().map(|e| e.to_f32().to_bits()).collect::<Vec<_>>();
            let rounded = |a: &Array1<f32>| {
                a.iter()
                    .map(|&e| T::from_f32(e).to_f32().to_bits())
                    .collect::<Vec<_>>()
            };
            let own_bits = |a: &Array1<T>| a.iter().map(|e| e.to_f32().to_bits()).collect::<Vec<_>>();
            if same_plans::<T>(device, rows, n) {
                assert_eq!(bits(&own.y), bits(&wide.y), "{what}: y");
                assert_eq!(bits(&own.dx), bits(&wide.dx), "{what}: dx");
                assert_eq!(own_bits(&own.dgamma), rounded(&wide.dgamma), "{what}: dgamma");
                if let (Some(own_dbeta), Some(wide_dbeta)) = (&own.dbeta, &wide.dbeta) {
                    assert_eq!(own_bits(own_dbeta), rounded(wide_dbeta), "{what}: dbeta");
                }
            } else {
                let tol = tolerance::<T>();
                let err = rel_err(wide.y.view(), to_f64(own.y.view()).view());
                assert!(err <= 2.0 * tol, "{what}: y differs by {err:e}");
                let err = rel_err(wide.dgamma.view(), to_f64(own.dgamma.view()).view());
                assert!(err <= 2.0 * tol, "{what}: dgamma differs by {err:e}");
            }
        }
    }
}

#[test]
fn cpu_f32_weights_of_half_values_match_half_weights() {
    let cpu = Device::cpu();
    check_against_own_type::<f16>(&cpu, 9400);
    check_against_own_type::<bf16>(&cpu, 9500);
}

#[test]
fn gpu_f32_weights_of_half_values_match_half_weights() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_against_own_type::<f16>(&gpu, 9400);
    check_against_own_type::<bf16>(&gpu, 9500);
}

/// `[2, 3, n]` input, LayerNorm without bias and RMSNorm without weights: shapes kept, y
/// against the reference, and only the gradients the op has.
fn check_nd_and_absent(device: &Device) {
    let (n, eps) = (40, 1e-5f32);
    let mut rng = Rng::new(9600);
    let x = mixed_matrix::<bf16>(&mut rng, 6, n);
    let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
    let x3 = device
        .upload(x.view().into_shape_with_order((2, 3, n)).unwrap())
        .unwrap();
    let dy = device.full(&[2, 3, n], bf16::from_f32(0.5)).unwrap();
    let (x64, g64) = (to_f64(x.view()), to_f64(gamma.view()));
    let tol = tolerance::<bf16>();

    let op = LayerNorm::<bf16, f32>::without_bias(device.upload(gamma.view()).unwrap(), eps).unwrap();
    let (y, ctx) = op.forward(&x3).unwrap();
    assert_eq!(y.shape(), &[2, 3, n]);
    let zeros = Array1::zeros(n);
    let (ry, _, _) = reference::forward(x64.view(), g64.view(), zeros.view(), eps as f64);
    let y2 = Array2::from_shape_vec((6, n), y.to_vec().unwrap()).unwrap();
    let err = rel_err(y2.view(), ry.view());
    assert!(
        err <= tol,
        "{}: LayerNorm without bias: y error {err:e}",
        device.name()
    );
    let grads = op.backward(&ctx, &dy).unwrap();
    assert_eq!(grads.dx.shape(), &[2, 3, n]);
    assert_eq!(grads.dgamma.as_ref().map(|d| d.shape().to_vec()), Some(vec![n]));
    assert!(grads.dbeta.is_none());

    let op = RmsNorm::<bf16, f32>::without_affine(device, n, eps).unwrap();
    let (y, ctx) = op.forward(&x3).unwrap();
    let ones = Array1::ones(n);
    let (ry, _) = reference::rms_forward(x64.view(), ones.view(), eps as f64);
    let y2 = Array2::from_shape_vec((6, n), y.to_vec().unwrap()).unwrap();
    let err = rel_err(y2.view(), ry.view());
    assert!(
        err <= tol,
        "{}: RMSNorm without weights: y error {err:e}",
        device.name()
    );
    let grads = op.backward(&ctx, &dy).unwrap();
    assert_eq!(grads.dx.shape(), &[2, 3, n]);
    assert!(grads.dgamma.is_none() && grads.dbeta.is_none());
}

#[test]
fn cpu_f32_weights_on_nd_input_and_absent() {
    check_nd_and_absent(&Device::cpu());
}

#[test]
fn gpu_f32_weights_on_nd_input_and_absent() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_nd_and_absent(&gpu);
}
