//! Forward against the float64 reference, on the CPU path and (where there is one) the GPU.

mod common;

use common::{Rng, SHAPES, gpu_or_skip, mixed_matrix, poisoned, random_vec, rel_err, to_f64, tolerance};
use layernorm_cuda::{Device, Element, LayerNorm, bf16, f16};
use layernorm_reference as reference;

/// Runs one forward on `device`, with y and the statistics compared to the reference.
fn check_forward<T: Element>(device: &Device, rows: usize, n: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let x = mixed_matrix::<T>(&mut rng, rows, n);
    let gamma = random_vec::<T>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<T>(&mut rng, n, 0.0, 0.5);
    let eps = 1e-5f32;
    let ln = LayerNorm::from_arrays(device, gamma.view(), beta.view(), eps).unwrap();
    let mut y = poisoned::<T>(device, &[rows, n]);
    let ctx = ln
        .forward_into(&device.upload(x.view()).unwrap(), &mut y)
        .unwrap();

    let (ry, rmean, rrstd) = reference::forward(
        to_f64(x.view()).view(),
        to_f64(gamma.view()).view(),
        to_f64(beta.view()).view(),
        eps as f64,
    );
    let err_y = rel_err(y.to_array2().unwrap().view(), ry.view());
    let err_mean = rel_err(ctx.mean().to_array1().unwrap().view(), rmean.view());
    let err_rstd = rel_err(ctx.rstd().to_array1().unwrap().view(), rrstd.view());
    let what = format!("{} forward {} [{rows}, {n}] seed {seed}", device.name(), T::NAME);
    eprintln!("{what}: y {err_y:.2e} mean {err_mean:.2e} rstd {err_rstd:.2e}");
    assert!(
        err_y <= tolerance::<T>(),
        "{what}: y error {err_y:e} > {:e}",
        tolerance::<T>()
    );
    // Statistics are f32 whatever the storage type.
    assert!(err_mean <= 1e-5, "{what}: mean error {err_mean:e}");
    assert!(err_rstd <= 1e-5, "{what}: rstd error {err_rstd:e}");
}

fn check_all_shapes<T: Element>(device: &Device, seed: u64) {
    for (i, &(rows, n)) in SHAPES.iter().enumerate() {
        check_forward::<T>(device, rows, n, seed + i as u64);
    }
}

#[test]
fn cpu_forward_matches_reference() {
    let cpu = Device::cpu();
    check_all_shapes::<f32>(&cpu, 100);
    check_all_shapes::<f16>(&cpu, 200);
    check_all_shapes::<bf16>(&cpu, 300);
}

#[test]
fn gpu_forward_matches_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all_shapes::<f32>(&gpu, 100);
    check_all_shapes::<f16>(&gpu, 200);
    check_all_shapes::<bf16>(&gpu, 300);
}

/// Many rows per team: the grid is smaller than the row count, so teams loop.
#[test]
fn gpu_forward_many_rows() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (i, &(rows, n)) in [(20000, 64), (4096, 1024), (3000, 2048), (1500, 8200)]
        .iter()
        .enumerate()
    {
        check_forward::<f16>(&gpu, rows, n, 400 + i as u64);
        check_forward::<f32>(&gpu, rows, n, 500 + i as u64);
    }
}

/// Aligned rows longer than one block holds in registers (more than 8 packs a thread of
/// 1024: f32 rows past 32768, f16/bf16 past 65536), which hold 4 packs a thread and stage
/// the rest in shared memory; past the staging's room (227 KB on an H100: f32 rows past
/// about 74000, f16 past 148000) they stream. Many rows and few.
#[test]
fn gpu_forward_long_aligned_rows() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (i, &(rows, n)) in [(300, 65536), (3, 40000), (50, 40000), (20, 100000)]
        .iter()
        .enumerate()
    {
        check_forward::<f32>(&gpu, rows, n, 600 + i as u64);
    }
    check_forward::<f16>(&gpu, 40, 131072, 610);
    check_forward::<f16>(&gpu, 5, 262144, 612);
    check_forward::<bf16>(&gpu, 9, 98304, 611);
}

/// The GPU and the CPU path agree with each other, not only each with the reference.
#[test]
fn gpu_forward_agrees_with_cpu_path() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mut rng = Rng::new(600);
    let (rows, n) = (37, 5000);
    let x = mixed_matrix::<f32>(&mut rng, rows, n);
    let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<f32>(&mut rng, n, 0.0, 0.5);
    let run = |d: &Device| {
        let ln = LayerNorm::from_arrays(d, gamma.view(), beta.view(), 1e-5).unwrap();
        ln.forward(&d.upload(x.view()).unwrap())
            .unwrap()
            .0
            .to_array2()
            .unwrap()
    };
    let (on_gpu, on_cpu) = (run(&gpu), run(&Device::cpu()));
    // Both are f32 computations, each within the f32 tolerance of the reference.
    let err = rel_err(on_gpu.view(), to_f64(on_cpu.view()).view());
    assert!(err <= tolerance::<f32>(), "GPU vs CPU path: {err:e}");
}
