//! RMSNorm against the float64 reference (itself checked by finite differences), forward and
//! backward in both modes, on the CPU path and (where there is one) the GPU, over the shapes
//! LayerNorm is tested with; and the op without weight, on an N-D input.

mod common;

use common::{Rng, SHAPES, gpu_or_skip, mixed_matrix, random_matrix, random_vec, rel_err, to_f64, tolerance};
use layernorm_cuda::{BackwardMode, Device, Element, RmsNorm, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array1, Array2};

/// The reference's RMSNorm backward against central differences of its forward, for the
/// scalar loss L = sum(y * dy): dL/dx and dL/dgamma.
#[test]
fn finite_difference_matches_rms_reference() {
    let mut rng = Rng::new(11);
    let (rows, n, eps) = (3, 7, 1e-5);
    let x = Array2::from_shape_fn((rows, n), |_| rng.normal() * 2.0 + 0.5);
    let dy = Array2::from_shape_fn((rows, n), |_| rng.normal());
    let gamma = Array1::from_shape_fn(n, |_| 1.0 + 0.5 * rng.uniform());
    let loss =
        |x: &Array2<f64>, g: &Array1<f64>| (reference::rms_forward(x.view(), g.view(), eps).0 * &dy).sum();
    let (dx, dgamma) = reference::rms_backward(x.view(), dy.view(), gamma.view(), eps);
    let h = 1e-6;
    let central = |plus: f64, minus: f64| (plus - minus) / (2.0 * h);
    for i in 0..rows {
        for j in 0..n {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[[i, j]] += h;
            xm[[i, j]] -= h;
            let fd = central(loss(&xp, &gamma), loss(&xm, &gamma));
            assert!(
                (fd - dx[[i, j]]).abs() < 1e-6 * (1.0 + fd.abs()),
                "dx[{i},{j}]: {fd} vs {}",
                dx[[i, j]]
            );
        }
    }
    for j in 0..n {
        let (mut gp, mut gm) = (gamma.clone(), gamma.clone());
        gp[j] += h;
        gm[j] -= h;
        let fd = central(loss(&x, &gp), loss(&x, &gm));
        assert!(
            (fd - dgamma[j]).abs() < 1e-6 * (1.0 + fd.abs()),
            "dgamma[{j}]: {fd} vs {}",
            dgamma[j]
        );
    }
}

/// One forward and backward on `device` against the reference: y, rstd, a mean of 0, dx and
/// dgamma, and no dbeta.
fn check<T: Element>(device: &Device, mode: BackwardMode, rows: usize, n: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let x = mixed_matrix::<T>(&mut rng, rows, n);
    let dy = random_matrix::<T>(&mut rng, rows, n);
    let gamma = random_vec::<T>(&mut rng, n, 1.0, 0.5);
    let eps = 1e-5f32;
    let op = RmsNorm::from_array(device, gamma.view(), eps)
        .unwrap()
        .with_backward_mode(mode)
        .unwrap();
    let (y, ctx) = op.forward(&device.upload(x.view()).unwrap()).unwrap();
    let grads = op.backward(&ctx, &device.upload(dy.view()).unwrap()).unwrap();

    let (x64, dy64, g64) = (to_f64(x.view()), to_f64(dy.view()), to_f64(gamma.view()));
    let (ry, rrstd) = reference::rms_forward(x64.view(), g64.view(), eps as f64);
    let (rdx, rdgamma) = reference::rms_backward(x64.view(), dy64.view(), g64.view(), eps as f64);
    let what = format!(
        "{} rms {} {mode:?} [{rows}, {n}] seed {seed}",
        device.name(),
        T::NAME
    );
    let err_y = rel_err(y.to_array2().unwrap().view(), ry.view());
    let err_rstd = rel_err(ctx.rstd().to_array1().unwrap().view(), rrstd.view());
    // dx = rstd * (g - xhat * mean(g * xhat)) with g = gamma * dy cancels where a row is a
    // few large values (n = 1: dx = rstd * g * eps / (x^2 + eps), ~1e-5 of its terms), so
    // its error is measured against the terms' size, rstd * |g|, not against dx.
    let dx = to_f64(grads.dx.to_array2().unwrap().view());
    let terms = Array2::from_shape_fn((rows, n), |(i, j)| (rrstd[i] * g64[j] * dy64[[i, j]]).abs());
    let largest = terms.iter().fold(f64::MIN_POSITIVE, |m, &v| m.max(v));
    let err_dx = (&dx - &rdx).iter().fold(0.0f64, |m, &v| m.max(v.abs())) / largest;
    let dgamma = grads.dgamma.as_ref().expect("the op has a weight");
    let err_dgamma = rel_err(dgamma.to_array1().unwrap().view(), rdgamma.view());
    eprintln!("{what}: y {err_y:.2e} rstd {err_rstd:.2e} dx {err_dx:.2e} dgamma {err_dgamma:.2e}");
    assert!(err_y <= tolerance::<T>(), "{what}: y error {err_y:e}");
    assert!(err_rstd <= 1e-5, "{what}: rstd error {err_rstd:e}");
    assert!(err_dx <= 2.0 * tolerance::<T>(), "{what}: dx error {err_dx:e}");
    assert!(
        err_dgamma <= 2.0 * tolerance::<T>(),
        "{what}: dgamma error {err_dgamma:e}"
    );
    assert!(
        ctx.mean().to_vec().unwrap().iter().all(|&m| m == 0.0),
        "{what}: RMSNorm's mean is 0"
    );
    assert!(grads.dbeta.is_none(), "{what}: RMSNorm has no bias");
}

fn check_all<T: Element>(device: &Device, seed: u64) {
    for mode in [BackwardMode::Deterministic, BackwardMode::Locked { groups: None }] {
        for (i, &(rows, n)) in SHAPES.iter().enumerate() {
            check::<T>(device, mode, rows, n, seed + i as u64);
        }
    }
}

#[test]
fn cpu_rms_norm_matches_reference() {
    let cpu = Device::cpu();
    check_all::<f32>(&cpu, 4100);
    check_all::<f16>(&cpu, 4200);
    check_all::<bf16>(&cpu, 4300);
}

#[test]
fn gpu_rms_norm_matches_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all::<f32>(&gpu, 4100);
    check_all::<f16>(&gpu, 4200);
    check_all::<bf16>(&gpu, 4300);
    // Long rows: the block-team and (sm_90) cluster kernels.
    check::<f16>(&gpu, BackwardMode::Deterministic, 257, 32768, 4400);
    check::<f32>(&gpu, BackwardMode::Deterministic, 33, 65537, 4401);
    // A forward block for every row (`plan::Grid::EveryRow`): 256 and 512 ranks.
    check::<f16>(&gpu, BackwardMode::Deterministic, 200, 8192, 4402);
    check::<f32>(&gpu, BackwardMode::Deterministic, 201, 8192, 4403);
    // Rows of 2049-8192 packs: the general kernel at 8 packs a rank, a block for every row
    // (f16 32768 above too): 512, 320 and 1024 ranks.
    check::<f32>(&gpu, BackwardMode::Deterministic, 202, 16384, 4404);
    check::<bf16>(&gpu, BackwardMode::Deterministic, 203, 20480, 4405);
    check::<f32>(&gpu, BackwardMode::Deterministic, 204, 32768, 4406);
    // Rows 8-byte aligned but not 16 (half packs), over many rows and few.
    check::<f16>(&gpu, BackwardMode::Deterministic, 301, 4100, 4413);
    check::<bf16>(&gpu, BackwardMode::Deterministic, 5, 16388, 4414);
    check::<f32>(&gpu, BackwardMode::Deterministic, 400, 1030, 4415);
    // Rows shifted off their 16-byte boundaries, x and y alike (f16/bf16 N odd or 2 mod 4,
    // f32 N odd): the forward's block teams read and write them in packs from there, the
    // head and tail a column a rank; over many rows and few.
    check::<f16>(&gpu, BackwardMode::Deterministic, 300, 4097, 4416);
    check::<bf16>(&gpu, BackwardMode::Deterministic, 200, 1030, 4417);
    check::<f32>(&gpu, BackwardMode::Deterministic, 300, 4097, 4418);
    check::<f16>(&gpu, BackwardMode::Deterministic, 7, 2051, 4419);
}

/// The forward's row block (`plan::Variant::FwdRowBlock`), which sm_90 takes where its last
/// wave is nearly full (132 multiprocessors, one whole wave here): f32 rows of 384 ranks
/// (counted at 48 registers: 3 blocks a multiprocessor) and of 768 (2 at its 40), bf16 of
/// 384 at 40 (4), f16 of 192 (8).
#[test]
fn gpu_rms_norm_row_block() {
    let Some(gpu) = gpu_or_skip() else { return };
    check::<f32>(&gpu, BackwardMode::Deterministic, 396, 6144, 4407);
    check::<f32>(&gpu, BackwardMode::Deterministic, 264, 12288, 4412);
    check::<bf16>(&gpu, BackwardMode::Deterministic, 528, 12288, 4408);
    check::<f16>(&gpu, BackwardMode::Deterministic, 1056, 6144, 4411);
}

/// f32 rows of 4097-6144 packs on sm_90: the general kernel on 512 ranks, a block for every
/// row, 4 packs a rank held and the rest staged in shared memory (two blocks a
/// multiprocessor): 4097 packs (2049 staged, one past a whole rank's share) and 6144.
#[test]
fn gpu_rms_norm_staged_rows() {
    let Some(gpu) = gpu_or_skip() else { return };
    check::<f32>(&gpu, BackwardMode::Deterministic, 140, 16388, 4409);
    check::<f32>(&gpu, BackwardMode::Deterministic, 137, 24576, 4410);
}

/// Without weight, on a `[2, 3, n]` input: y = x * rstd row by row, the output keeps the
/// input's shape, and the backward gives dx alone.
fn check_without_affine(device: &Device) {
    let (n, eps) = (40, 1e-5f32);
    let mut rng = Rng::new(4500);
    let x = mixed_matrix::<f32>(&mut rng, 6, n);
    let op = RmsNorm::<f32>::without_affine(device, n, eps).unwrap();
    let x3 = device
        .upload(x.view().into_shape_with_order((2, 3, n)).unwrap())
        .unwrap();
    let (y, ctx) = op.forward(&x3).unwrap();
    assert_eq!(y.shape(), &[2, 3, n]);
    let ones = Array1::from_elem(n, 1.0);
    let (ry, _) = reference::rms_forward(to_f64(x.view()).view(), ones.view(), eps as f64);
    let y2 = Array2::from_shape_vec((6, n), y.to_vec().unwrap()).unwrap();
    let err = rel_err(y2.view(), ry.view());
    assert!(err <= tolerance::<f32>(), "{}: y error {err:e}", device.name());
    let dy = device.full(&[2, 3, n], 0.5f32).unwrap();
    let grads = op.backward(&ctx, &dy).unwrap();
    assert_eq!(grads.dx.shape(), &[2, 3, n]);
    assert!(grads.dgamma.is_none() && grads.dbeta.is_none());
}

#[test]
fn cpu_rms_norm_without_affine_on_nd_input() {
    check_without_affine(&Device::cpu());
}

#[test]
fn gpu_rms_norm_without_affine_on_nd_input() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_without_affine(&gpu);
}
