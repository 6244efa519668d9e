//! Allocations that cannot succeed are typed errors, never an abort or a panic, and leave the
//! device usable with all its memory. The one GPU test here measures the device's free memory,
//! so it keeps this test binary to itself: no other GPU test may run beside it.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::{Rng, gpu_or_skip, mixed_matrix, random_matrix, random_vec, rel_err, to_f64, tolerance};
use layernorm_cuda::{Device, Error, Gradients, LayerNorm, f16};
use layernorm_reference as reference;

/// The system allocator, except that on a thread inside [`refusing_allocations_from`] it
/// refuses every allocation of at least that many bytes, as a host out of memory would. Per
/// thread, so the other tests of this binary, running beside it, allocate as usual.
struct RefusingAllocator;

thread_local! {
    static REFUSE_FROM: Cell<usize> = const { Cell::new(usize::MAX) };
}

impl RefusingAllocator {
    fn refuses(size: usize) -> bool {
        // `try_with`: a thread may still allocate while its locals are being torn down.
        REFUSE_FROM.try_with(|from| size >= from.get()).unwrap_or(false)
    }
}

// SAFETY: every call is passed on to `System` unchanged, or answered with null, which the
// `GlobalAlloc` contract allows for any allocation that cannot be satisfied.
unsafe impl GlobalAlloc for RefusingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if Self::refuses(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `layout`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if Self::refuses(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `layout`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && Self::refuses(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `ptr`, `layout` and `new_size`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout` (this allocator hands out no other).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: RefusingAllocator = RefusingAllocator;

/// Runs `f` with every allocation of `bytes` or more on this thread refused.
fn refusing_allocations_from<R>(bytes: usize, f: impl FnOnce() -> R) -> R {
    REFUSE_FROM.set(bytes);
    let r = f();
    REFUSE_FROM.set(usize::MAX);
    r
}

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

/// The CPU backward's row scratch (a few vectors of n) comes from host memory like any
/// tensor: where it cannot be had, `backward_into` is `OutOfMemory` (not an abort), writes
/// nothing, and the same call succeeds once memory is there again.
#[test]
fn cpu_backward_scratch_out_of_memory_is_a_typed_error() {
    let cpu = Device::cpu();
    let mut rng = Rng::new(3100);
    let (rows, n) = (3, 4096);
    let ln = LayerNorm::from_arrays(
        &cpu,
        random_vec::<f32>(&mut rng, n, 1.0, 0.5).view(),
        random_vec::<f32>(&mut rng, n, 0.0, 0.5).view(),
        1e-5,
    )
    .unwrap();
    let x = cpu.upload(mixed_matrix::<f32>(&mut rng, rows, n).view()).unwrap();
    let dy = cpu
        .upload(random_matrix::<f32>(&mut rng, rows, n).view())
        .unwrap();
    let (_, ctx) = ln.forward(&x).unwrap();
    let mut grads = Gradients {
        dx: cpu.full(&[rows, n], 7.0f32).unwrap(),
        dgamma: Some(cpu.full(&[n], 7.0f32).unwrap()),
        dbeta: Some(cpu.full(&[n], 7.0f32).unwrap()),
    };
    // Every scratch vector holds n values of 4 bytes or more; the outputs exist already.
    let r = refusing_allocations_from(4 * n, || ln.backward_into(&ctx, &dy, &mut grads));
    assert!(
        matches!(r, Err(Error::OutOfMemory { bytes, .. }) if bytes >= 4 * n),
        "{r:?}"
    );
    for (name, t, len) in [
        ("dx", &grads.dx, rows * n),
        ("dgamma", grads.dgamma.as_ref().unwrap(), n),
        ("dbeta", grads.dbeta.as_ref().unwrap(), n),
    ] {
        assert_eq!(
            t.to_vec().unwrap(),
            vec![7.0; len],
            "the failed backward wrote {name}"
        );
    }

    ln.backward_into(&ctx, &dy, &mut grads).unwrap();
    let fresh = ln.backward(&ctx, &dy).unwrap();
    for (name, t, want) in [
        ("dx", &grads.dx, &fresh.dx),
        (
            "dgamma",
            grads.dgamma.as_ref().unwrap(),
            fresh.dgamma.as_ref().unwrap(),
        ),
        (
            "dbeta",
            grads.dbeta.as_ref().unwrap(),
            fresh.dbeta.as_ref().unwrap(),
        ),
    ] {
        assert_eq!(
            t.to_vec().unwrap(),
            want.to_vec().unwrap(),
            "{name} after the failure"
        );
    }
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
/// Afterwards the device computes correctly and, once the op is dropped, its free memory is
/// what it was before.
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

    // The op keeps its last contexts' mean and rstd for its next forward: they go with it.
    drop(ln);
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
