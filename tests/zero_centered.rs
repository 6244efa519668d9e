//! Zero-centred weights (`with_zero_centered_weight`: y = xhat * (1 + gamma) + beta), for
//! both norms, both backward modes, every type pair:
//! - gamma = g - 1 with the offset gives the plain op's bits with gamma = g, y, dx, dgamma
//!   and dbeta, where 1 + (g - 1) = g exactly (g in [0.5, 1.5], so g - 1 is exact);
//! - small weights (|gamma| about 1e-3, where 1 + gamma is not a value of f16 or bf16)
//!   against the float64 reference with weight 1 + gamma, and half weights against f32
//!   weights of the same values: the same bits, so the kernels form 1 + gamma in f32, not
//!   in the weights' type;
//! - plain weights keep their sign of zero (their offset, -0, changes no bit);
//! - an op without a weight refuses, with a typed error.

mod common;

use common::{Problem, SHAPES, gpu_or_skip, rel_err, same_plans, to_f64, tolerance};
use layernorm_cuda::{BackwardMode, Device, Element, Error, LayerNorm, RmsNorm, Weight, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array1, Array2};

const EPS: f32 = 1e-5;
const MODES: [BackwardMode; 2] = [BackwardMode::Deterministic, BackwardMode::Locked { groups: None }];

#[derive(Clone, Copy, Debug)]
enum Norm {
    Layer,
    Rms,
}

/// y, dx, dgamma and (LayerNorm's) dbeta of one forward and backward, widened to f32.
type Outputs = Vec<Vec<f32>>;

fn widened<E: Element>(v: impl IntoIterator<Item = E>) -> Vec<f32> {
    v.into_iter().map(|e| e.to_f32()).collect()
}

/// Forward and backward of `norm` over `p` on `device`, zero-centred or not.
fn run<T: Element, W: Weight<T>>(
    device: &Device,
    norm: Norm,
    mode: BackwardMode,
    p: &Problem<T, W>,
    zero_centered: bool,
) -> Outputs {
    let (x, dy) = (
        device.upload(p.x.view()).unwrap(),
        device.upload(p.dy.view()).unwrap(),
    );
    // The two ops have the same calls, but no trait in common.
    macro_rules! forward_backward {
        ($op:expr) => {{
            let mut op = $op.unwrap().with_backward_mode(mode).unwrap();
            if zero_centered {
                op = op.with_zero_centered_weight().unwrap();
            }
            assert_eq!(op.zero_centered_weight(), zero_centered);
            let (y, ctx) = op.forward(&x).unwrap();
            (y, op.backward(&ctx, &dy).unwrap())
        }};
    }
    let (y, grads) = match norm {
        Norm::Layer => forward_backward!(LayerNorm::<T, W>::from_arrays(
            device,
            p.gamma.view(),
            p.beta.view(),
            EPS
        )),
        Norm::Rms => forward_backward!(RmsNorm::<T, W>::from_array(device, p.gamma.view(), EPS)),
    };
    let mut out = vec![widened(y.to_vec().unwrap()), widened(grads.dx.to_vec().unwrap())];
    out.push(widened(grads.dgamma.unwrap().to_vec().unwrap()));
    if let Some(dbeta) = grads.dbeta {
        out.push(widened(dbeta.to_vec().unwrap()));
    }
    out
}

fn assert_bitwise(got: &Outputs, expected: &Outputs, what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: outputs");
    for (i, name) in ["y", "dx", "dgamma", "dbeta"].iter().take(got.len()).enumerate() {
        let bits = |v: &[f32]| v.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[i]), bits(&expected[i]), "{what}: {name}");
    }
}

/// Zero-centred gamma - 1 against plain gamma, every shape, norm and mode.
fn check_against_plain<T: Element, W: Weight<T>>(device: &Device, seed: u64) {
    for norm in [Norm::Layer, Norm::Rms] {
        for mode in MODES {
            for (i, &(rows, n)) in SHAPES.iter().enumerate() {
                let seed = seed + i as u64;
                let mut p = Problem::<T, W>::random(rows, n, seed);
                let plain = run(device, norm, mode, &p, false);
                p.gamma.mapv_inplace(|g| W::from_f32(g.to_f32() - 1.0));
                let centered = run(device, norm, mode, &p, true);
                let what = format!(
                    "{} {norm:?} {} with {} weights {mode:?} [{rows}, {n}] seed {seed}",
                    device.name(),
                    T::NAME,
                    W::NAME
                );
                assert_bitwise(&centered, &plain, &what);
            }
        }
    }
}

/// A CPU and a GPU test per type pair (each every shape, norm and mode): one pair's GPU test
/// is what a racecheck run finishes within a device call.
macro_rules! against_plain {
    ($($pair:ident: $t:ty, $w:ty, $seed:literal;)*) => {$(
        mod $pair {
            use super::*;

            #[test]
            fn cpu_zero_centered_is_plain_weights_plus_one() {
                check_against_plain::<$t, $w>(&Device::cpu(), $seed);
            }

            #[test]
            fn gpu_zero_centered_is_plain_weights_plus_one() {
                let Some(gpu) = gpu_or_skip() else { return };
                check_against_plain::<$t, $w>(&gpu, $seed);
            }
        }
    )*};
}

against_plain! {
    f32_f32: f32, f32, 9700;
    f16_f16: f16, f16, 9720;
    bf16_bf16: bf16, bf16, 9740;
    f16_f32: f16, f32, 9760;
    bf16_f32: bf16, f32, 9780;
}

/// A problem whose gamma is small (about 1e-3, of either sign): 1 + gamma then needs more
/// bits than f16 and bf16 have.
fn small_weights<T: Element, W: Element>(rows: usize, n: usize, seed: u64) -> Problem<T, W> {
    let mut p = Problem::<T, W>::random(rows, n, seed);
    p.gamma.mapv_inplace(|g| W::from_f32((g.to_f32() - 1.0) * 4e-3));
    p
}

/// Zero-centred small weights against the float64 reference with weight 1 + gamma.
fn check_reference<T: Element, W: Weight<T>>(device: &Device, norm: Norm, p: &Problem<T, W>, what: &str) {
    let out = run(device, norm, BackwardMode::Deterministic, p, true);
    let (x, dy, b) = (to_f64(p.x.view()), to_f64(p.dy.view()), to_f64(p.beta.view()));
    let g = to_f64(p.gamma.view()).mapv(|g| 1.0 + g);
    let eps = EPS as f64;
    let mut expected = match norm {
        Norm::Layer => {
            let (ry, _, _) = reference::forward(x.view(), g.view(), b.view(), eps);
            let (rdx, rdgamma, rdbeta) = reference::backward(x.view(), dy.view(), g.view(), eps);
            vec![
                ry.into_raw_vec_and_offset().0,
                rdx.into_raw_vec_and_offset().0,
                rdgamma.to_vec(),
                rdbeta.to_vec(),
            ]
        }
        Norm::Rms => {
            let (ry, _) = reference::rms_forward(x.view(), g.view(), eps);
            let (rdx, rdgamma) = reference::rms_backward(x.view(), dy.view(), g.view(), eps);
            vec![
                ry.into_raw_vec_and_offset().0,
                rdx.into_raw_vec_and_offset().0,
                rdgamma.to_vec(),
            ]
        }
    };
    // RMSNorm's dx cancels where a row is a few large values (tests/rms_norm.rs): measured
    // against its terms' size, rstd * |(1 + gamma) * dy|, as there.
    let rms_dx_scale = match norm {
        Norm::Layer => None,
        Norm::Rms => {
            let (_, rstd) = reference::rms_forward(x.view(), g.view(), eps);
            let terms = Array2::from_shape_fn(x.dim(), |(i, j)| (rstd[i] * g[j] * dy[[i, j]]).abs());
            Some(terms.iter().fold(f64::MIN_POSITIVE, |m, &v| m.max(v)))
        }
    };
    let what = format!(
        "{} {norm:?} {} with {} weights {what}",
        device.name(),
        T::NAME,
        W::NAME
    );
    assert_eq!(out.len(), expected.len(), "{what}: outputs");
    for (i, name) in ["y", "dx", "dgamma", "dbeta"].iter().take(out.len()).enumerate() {
        let tol = match i {
            0 => tolerance::<T>(),
            1 => 2.0 * tolerance::<T>(),
            _ => 2.0 * tolerance::<W>(),
        };
        let reference = std::mem::take(&mut expected[i]);
        let err = match (i, rms_dx_scale) {
            (1, Some(scale)) => {
                out[i]
                    .iter()
                    .zip(&reference)
                    .fold(0.0f64, |m, (&o, r)| m.max((o as f64 - r).abs()))
                    / scale
            }
            _ => rel_err(
                Array1::from(out[i].clone()).view(),
                Array1::from(reference).view(),
            ),
        };
        assert!(err <= tol, "{what}: {name} error {err:e} > {tol:e}");
    }
}

/// Small zero-centred half weights: near the reference, and y and dx the bits that f32
/// weights of the same values give (the same f32 weight 1 + gamma) where both ops take the
/// same plan. A kernel that rounded 1 + gamma to f16 or bf16 moves y by up to half an ulp
/// of 1 in that type, within the tolerance but not the bits.
fn check_small_weights<T: Element>(device: &Device, seed: u64)
where
    f32: Weight<T>,
{
    for norm in [Norm::Layer, Norm::Rms] {
        for (i, &(rows, n)) in SHAPES.iter().enumerate() {
            let seed = seed + i as u64;
            let own = small_weights::<T, T>(rows, n, seed);
            let what = format!("[{rows}, {n}] seed {seed}");
            check_reference(device, norm, &own, &what);
            let wide = Problem::<T, f32> {
                x: own.x.clone(),
                dy: own.dy.clone(),
                gamma: own.gamma.mapv(|g| g.to_f32()),
                beta: own.beta.mapv(|b| b.to_f32()),
            };
            check_reference(device, norm, &wide, &what);
            if same_plans::<T>(device, rows, n) {
                let mode = BackwardMode::Deterministic;
                let (a, b) = (
                    run(device, norm, mode, &own, true),
                    run(device, norm, mode, &wide, true),
                );
                assert_bitwise(
                    &a[..2].to_vec(),
                    &b[..2].to_vec(),
                    &format!("{norm:?} {} {what}", T::NAME),
                );
            }
        }
    }
}

#[test]
fn cpu_small_weights_are_centred_in_f32() {
    let cpu = Device::cpu();
    check_small_weights::<f16>(&cpu, 9800);
    check_small_weights::<bf16>(&cpu, 9820);
}

#[test]
fn gpu_small_weights_are_centred_in_f32() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_small_weights::<f16>(&gpu, 9800);
    check_small_weights::<bf16>(&gpu, 9820);
    // Long rows: the block-team and (sm_90) cluster kernels.
    for norm in [Norm::Layer, Norm::Rms] {
        for (rows, n, seed) in [(257, 32768, 9840), (33, 65536, 9841)] {
            check_reference(&gpu, norm, &small_weights::<f32, f32>(rows, n, seed), "long rows");
            check_reference(
                &gpu,
                norm,
                &small_weights::<bf16, f32>(rows, n, seed),
                "long rows",
            );
        }
    }
}

/// Plain weights of -0 with a bias of -0: y = xhat * (-0) + (-0), which is -0 where xhat > 0
/// and +0 where xhat < 0. An offset of +0 in place of -0 would make every y +0. Row r is
/// j - r for j < 96: its mean is 47.5 - r, which no value equals.
fn check_negative_zero(device: &Device) {
    let (rows, n) = (5, 96);
    let mut p = Problem::<f32>::random(rows, n, 9900);
    p.x = Array2::from_shape_fn((rows, n), |(r, j)| j as f32 - r as f32);
    p.gamma.fill(-0.0);
    p.beta.fill(-0.0);
    let out = run(device, Norm::Layer, BackwardMode::Deterministic, &p, false);
    for r in 0..rows {
        for j in 0..n {
            let expected: f32 = if j >= n / 2 { -0.0 } else { 0.0 };
            let got = out[0][r * n + j];
            assert_eq!(
                got.to_bits(),
                expected.to_bits(),
                "{}: y[{r}, {j}] = {got:?}",
                device.name()
            );
        }
    }
}

#[test]
fn cpu_plain_weights_keep_the_sign_of_zero() {
    check_negative_zero(&Device::cpu());
}

#[test]
fn gpu_plain_weights_keep_the_sign_of_zero() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_negative_zero(&gpu);
}

#[test]
fn an_op_without_a_weight_has_none_to_centre() {
    let cpu = Device::cpu();
    let e = LayerNorm::<f32>::without_affine(&cpu, 8, EPS)
        .unwrap()
        .with_zero_centered_weight()
        .unwrap_err();
    assert!(matches!(e, Error::NoWeight), "{e}");
    let e = RmsNorm::<bf16>::without_affine(&cpu, 8, EPS)
        .unwrap()
        .with_zero_centered_weight()
        .unwrap_err();
    assert!(matches!(e, Error::NoWeight), "{e}");
    // Without a bias, the weight is there to centre.
    let gamma = cpu.upload(Array1::<f32>::zeros(8).view()).unwrap();
    let op = LayerNorm::<f32>::without_bias(gamma, EPS)
        .unwrap()
        .with_zero_centered_weight()
        .unwrap();
    assert!(op.zero_centered_weight());
}
