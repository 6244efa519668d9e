//! Property tests: random shapes (1 to 16 rows of 1 to 3000 elements; on the GPU also 1 to
//! 40 rows of 3001 to 120000), values of random scale (1e-3 to 1e2) and offset (up to 100
//! times the scale), random eps (1e-7 to 1e-1), every storage type and backward mode, forward and backward against the float64 reference with the
//! tolerances of `common::tolerance`. On the CPU path and on the GPU, each with a fixed seed so
//! that a failure replays; proptest then prints the smallest failing case it found.
//!
//! Two outputs are measured against the size of what they are made from rather than their own
//! size, where these can differ by any factor: a row's mean against the row's spread
//! sqrt(var + eps) (a mean near 0 is the difference of large sums, and only its error relative
//! to the spread reaches y), and dx against rstd * gamma * dy (dx is a difference of such
//! terms; with n = 2 they cancel to within eps, as every 2-element row normalizes to +-1).

mod common;

use common::{
    Rng, gpu_or_skip, poisoned, random_matrix, random_vec, rel_err, rel_err_at_least, to_f64, tolerance,
};
use layernorm_cuda::{BackwardMode, Device, Element, Gradients, LayerNorm, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array, Array2, Axis, Dimension};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};

#[derive(Clone, Copy, Debug)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

/// One random problem. The values are drawn from `seed`; everything that shapes them is a
/// field of its own, so that proptest can shrink it.
#[derive(Clone, Debug)]
struct Case {
    dtype: Dtype,
    rows: usize,
    n: usize,
    /// x = offset + scale * N(0, 1) with scale = 10^scale_exp, offset = offset_ratio * scale.
    scale_exp: f64,
    offset_ratio: f64,
    eps: f32,
    mode: BackwardMode,
    seed: u64,
}

/// Cases of `rows` x `n` (ranges), everything else drawn as documented above.
fn cases(
    rows: std::ops::RangeInclusive<usize>,
    n: std::ops::RangeInclusive<usize>,
) -> impl Strategy<Value = Case> {
    let dtype = prop_oneof![Just(Dtype::F32), Just(Dtype::F16), Just(Dtype::Bf16)];
    let mode = prop_oneof![
        Just(BackwardMode::Deterministic),
        Just(BackwardMode::Locked { groups: None }),
        (1..=300u32).prop_map(|g| BackwardMode::Locked { groups: Some(g) }),
    ];
    (
        dtype,
        rows,
        n,
        -3.0..2.0f64,
        -100.0..100.0f64,
        -7.0..-1.0f64,
        mode,
        any::<u64>(),
    )
        .prop_map(
            |(dtype, rows, n, scale_exp, offset_ratio, eps_exp, mode, seed)| Case {
                dtype,
                rows,
                n,
                scale_exp,
                offset_ratio,
                eps: 10f64.powf(eps_exp) as f32,
                mode,
                seed,
            },
        )
}

/// A fixed seed and no failure files: the same cases on every run and machine.
fn config(cases: u32, seed: u64) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    }
}

fn norm<D: Dimension>(a: &Array<f64, D>) -> f64 {
    a.iter().map(|v| v * v).sum::<f64>().sqrt()
}

fn check<T: Element>(device: &Device, case: &Case) -> Result<(), TestCaseError> {
    let (rows, n) = (case.rows, case.n);
    let mut rng = Rng::new(case.seed);
    let scale = 10f64.powf(case.scale_exp);
    let offset = case.offset_ratio * scale;
    let x = Array2::from_shape_fn((rows, n), |_| T::from_f32((offset + scale * rng.normal()) as f32));
    let dy = random_matrix::<T>(&mut rng, rows, n);
    let gamma = random_vec::<T>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<T>(&mut rng, n, 0.0, 0.5);

    let ln = LayerNorm::from_arrays(device, gamma.view(), beta.view(), case.eps)
        .unwrap()
        .with_backward_mode(case.mode)
        .unwrap();
    let mut y = poisoned::<T>(device, &[rows, n]);
    let ctx = ln
        .forward_into(&device.upload(x.view()).unwrap(), &mut y)
        .unwrap();
    let mut grads = Gradients {
        dx: poisoned(device, &[rows, n]),
        dgamma: Some(poisoned(device, &[n])),
        dbeta: Some(poisoned(device, &[n])),
    };
    ln.backward_into(&ctx, &device.upload(dy.view()).unwrap(), &mut grads)
        .unwrap();

    let eps = case.eps as f64;
    let (x64, dy64, gamma64) = (to_f64(x.view()), to_f64(dy.view()), to_f64(gamma.view()));
    let (ry, rmean, rrstd) = reference::forward(x64.view(), gamma64.view(), to_f64(beta.view()).view(), eps);
    let (rdx, rdgamma, rdbeta) = reference::backward(x64.view(), dy64.view(), gamma64.view(), eps);
    let spread = norm(&rrstd.mapv(|r| 1.0 / r));
    let dx_terms = norm(&(&dy64 * &gamma64 * rrstd.view().insert_axis(Axis(1))));

    let tol = tolerance::<T>();
    let errors = [
        ("y", rel_err(y.to_array2().unwrap().view(), ry.view()), tol),
        (
            "mean",
            rel_err_at_least(ctx.mean().to_array1().unwrap().view(), rmean.view(), spread),
            1e-5,
        ),
        (
            "rstd",
            rel_err(ctx.rstd().to_array1().unwrap().view(), rrstd.view()),
            1e-5,
        ),
        // The backward's outputs: twice the forward's tolerance, as in tests/backward.rs.
        (
            "dx",
            rel_err_at_least(grads.dx.to_array2().unwrap().view(), rdx.view(), dx_terms),
            2.0 * tol,
        ),
        (
            "dgamma",
            rel_err(
                grads.dgamma.as_ref().unwrap().to_array1().unwrap().view(),
                rdgamma.view(),
            ),
            2.0 * tol,
        ),
        (
            "dbeta",
            rel_err(
                grads.dbeta.as_ref().unwrap().to_array1().unwrap().view(),
                rdbeta.view(),
            ),
            2.0 * tol,
        ),
    ];
    for (name, err, tol) in errors {
        prop_assert!(
            err <= tol,
            "{} {}: {name} error {err:e} > {tol:e}",
            device.name(),
            T::NAME
        );
    }
    Ok(())
}

fn check_case(device: &Device, case: &Case) -> Result<(), TestCaseError> {
    match case.dtype {
        Dtype::F32 => check::<f32>(device, case),
        Dtype::F16 => check::<f16>(device, case),
        Dtype::Bf16 => check::<bf16>(device, case),
    }
}

fn run(device: &Device, config: Config, cases: impl Strategy<Value = Case>) {
    if let Err(e) = TestRunner::new(config).run(&cases, |case| check_case(device, &case)) {
        panic!("{e}");
    }
}

#[test]
fn cpu_random_problems_match_reference() {
    run(
        &Device::cpu(),
        config(128, 0x5eed_c0de_0001),
        cases(1..=16, 1..=3000),
    );
}

#[test]
fn gpu_random_problems_match_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    run(&gpu, config(48, 0x5eed_c0de_0002), cases(1..=16, 1..=3000));
}

/// Long rows: block-per-row teams, rows streamed or held, and on Hopper rows split over
/// clusters (past 8192 f32 or 16384 f16/bf16 elements).
#[test]
fn gpu_random_long_rows_match_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    run(&gpu, config(24, 0x5eed_c0de_0003), cases(1..=40, 3001..=120_000));
}
