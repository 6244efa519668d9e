//! Allocations that cannot succeed are typed errors, never an abort or a panic, and leave the
//! device usable with all its memory. The one GPU test here measures the device's free memory,
//! so it keeps this test binary to itself: no other GPU test may run beside it.

mod common;

use common::{
    Rng, gpu_or_skip, mixed_matrix, random_matrix, random_vec, reference, rel_err, to_f64, tolerance,
};
use layernorm_cuda::{Device, Error, LayerNorm, f16};

/// Checks a small forward and backward on `device` against the reference: the device works.
fn small_problem_works(device: &Device) {
    let mut rng = Rng::new(3000);
    let (rows, n) = (9, 1500);
    let x = mixed_matrix::<f32>(&mut rng, rows, n);
    let dy = random_matrix::<f32>(&mut rng, rows, n);
    let (gamma, beta) = (
        random_vec::<f32>(&mut rng, n, 1.0, 0.5),
        random_vec::<f32>(&mut rng, n, 0.0, 0.5),
    );
    let ln = LayerNorm::from_arrays(device, gamma.view(), beta.view(), 1e-5).unwrap();
    let (y, ctx) = ln.forward(&device.upload(x.view()).unwrap()).unwrap();
    let grads = ln.backward(&ctx, &device.upload(dy.view()).unwrap()).unwrap();
    let x64 = to_f64(x.view());
    let (ry, _, _) = reference::forward(
        x64.view(),
        to_f64(gamma.view()).view(),
        to_f64(beta.view()).view(),
        1e-5f32 as f64,
    );
    let (rdx, _, _) = reference::backward(
        x64.view(),
        to_f64(dy.view()).view(),
        to_f64(gamma.view()).view(),
        1e-5f32 as f64,
    );
    let err_y = rel_err(y.to_array2().unwrap().view(), ry.view());
    let err_dx = rel_err(grads.dx.to_array2().unwrap().view(), rdx.view());
    assert!(
        err_y <= tolerance::<f32>() && err_dx <= 2.0 * tolerance::<f32>(),
        "y {err_y:e}, dx {err_dx:e}"
    );
}

/// Sizes no host can hold: shapes whose byte count overflows (or passes isize::MAX) are shape
/// errors; 2^62 bytes, a valid size, is `OutOfMemory` (from `try_reserve`, so no abort). The
/// CPU path works afterwards.
#[test]
fn cpu_absurd_sizes_are_typed_errors() {
    let cpu = Device::cpu();
    for shape in [&[usize::MAX, 2][..], &[1 << 32, 1 << 32], &[1 << 62]] {
        let r = cpu.zeros::<f32>(shape);
        assert!(
            matches!(r, Err(Error::Shape { what: "tensor", .. })),
            "{shape:?}: {r:?}"
        );
        let r = cpu.full::<f16>(shape, f16::ONE);
        assert!(
            matches!(r, Err(Error::Shape { what: "tensor", .. })),
            "{shape:?}: {r:?}"
        );
    }
    let r = cpu.zeros::<f32>(&[1 << 30, 1 << 30]);
    assert!(
        matches!(r, Err(Error::OutOfMemory { bytes, .. }) if bytes == 1 << 62),
        "{r:?}"
    );
    let r = cpu.full::<f16>(&[1 << 61], f16::ONE);
    assert!(
        matches!(r, Err(Error::OutOfMemory { bytes, .. }) if bytes == 1 << 62),
        "{r:?}"
    );
    small_problem_works(&cpu);
}

/// Free device memory after the stream's queued frees have run. (cudarc allocates from the
/// stream-ordered pool, which returns freed memory to the device at a synchronization.)
fn free_memory(device: &Device) -> (usize, usize) {
    device.synchronize().unwrap();
    let context = device.cuda_stream().unwrap().context();
    context.mem_get_info().unwrap()
}

/// On the GPU: tensors far larger than the device (`zeros`, `full`), a forward whose y cannot
/// be allocated and a backward whose dx cannot, are each `OutOfMemory` with the size asked for.
/// Afterwards the device computes correctly and its free memory is what it was before.
#[test]
fn gpu_out_of_memory_is_a_typed_error_and_leaks_nothing() {
    let Some(gpu) = gpu_or_skip() else { return };
    // The first forward and backward load what the driver keeps for good; measure after them.
    small_problem_works(&gpu);
    let (free_before, total) = free_memory(&gpu);
    eprintln!("device memory: {free_before} of {total} bytes free");

    let twice_the_device = 2 * total / 4;
    let r = gpu.zeros::<f32>(&[twice_the_device]);
    assert!(
        matches!(r, Err(Error::OutOfMemory { bytes, .. }) if bytes == 4 * twice_the_device),
        "zeros: {r:?}"
    );
    // `full` takes device memory before it stages the values on the host, so this fails
    // without touching host memory.
    let r = gpu.full::<f32>(&[twice_the_device], 1.0);
    assert!(
        matches!(r, Err(Error::OutOfMemory { bytes, .. }) if bytes == 4 * twice_the_device),
        "full: {r:?}"
    );

    // f16 rows of 4096 elements; `rows(share)` holds that share of the free memory.
    let n = 4096;
    let rows = |share: f64| (free_before as f64 * share / (2 * n) as f64) as usize;
    let ln = LayerNorm::new(
        gpu.zeros::<f16>(&[n]).unwrap(),
        gpu.zeros::<f16>(&[n]).unwrap(),
        1e-5,
    )
    .unwrap();
    {
        // x holds 60% of the memory; y would need as much again.
        let x = gpu.zeros::<f16>(&[rows(0.6), n]).unwrap();
        let r = ln.forward(&x);
        assert!(
            matches!(r, Err(Error::OutOfMemory { bytes, .. }) if bytes == x.len() * 2),
            "forward: {r:?}"
        );
    }
    {
        // x and y, then x and dy, each 40%: the forward fits, the backward's dx does not.
        let x = gpu.zeros::<f16>(&[rows(0.4), n]).unwrap();
        let (y, ctx) = ln.forward(&x).unwrap();
        drop(y);
        let dy = gpu.zeros::<f16>(x.shape()).unwrap();
        let r = ln.backward(&ctx, &dy);
        assert!(
            matches!(r, Err(Error::OutOfMemory { bytes, .. }) if bytes == x.len() * 2),
            "backward: {r:?}"
        );
    }

    small_problem_works(&gpu);
    let (free_after, _) = free_memory(&gpu);
    eprintln!("device memory: {free_after} bytes free after");
    // The pool hands memory back in whole pages; 64 MiB is far below any tensor above.
    let slack = 64 << 20;
    assert!(
        free_after + slack >= free_before,
        "device memory leaked: {free_before} bytes free before, {free_after} after"
    );
}
