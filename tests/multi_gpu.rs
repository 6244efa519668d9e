//! Several GPUs: each GPU, opened with `Device::cuda(ordinal)` from a thread of its own,
//! runs forward and backward at the same time as the other and gets correct results; a
//! tensor of one GPU handed to the other's op is a typed error.
//!
//! Needs two GPUs. With fewer it skips, saying why, unless LAYERNORM_REQUIRE_GPUS=2 is
//! set, which makes it fail instead (LAYERNORM_REQUIRE_GPU=1 alone asks for one GPU, which
//! this test cannot use, so it does not turn a skip here into a pass or a failure).

mod common;

use std::sync::Barrier;

use common::{Rng, mixed_matrix, random_matrix, random_vec, rel_err, to_f64, tolerance};
use layernorm_cuda::{Device, Error, LayerNorm};
use layernorm_reference as reference;

/// CUDA devices 0 and 1, or None with the reason printed; a failure where
/// LAYERNORM_REQUIRE_GPUS=2 asks for them.
fn two_gpus_or_skip() -> Option<()> {
    let required = std::env::var("LAYERNORM_REQUIRE_GPUS").as_deref() == Ok("2");
    let why = match (Device::cuda(0), Device::cuda(1)) {
        (Ok(_), Ok(_)) => return Some(()),
        (Err(e), _) | (_, Err(e)) => e,
    };
    if required {
        panic!("LAYERNORM_REQUIRE_GPUS=2 but two CUDA devices cannot be opened: {why}");
    }
    eprintln!("skipping the two-GPU test (set LAYERNORM_REQUIRE_GPUS=2 to make this a failure): {why}");
    None
}

/// Forward and backward of a `[rows, n]` problem of its own on GPU `ordinal`, several
/// rounds, each against the float64 reference.
fn run_on(ordinal: usize, start: &Barrier) {
    let device = Device::cuda(ordinal).unwrap();
    let (rows, n) = (257, 1000 + 24 * ordinal);
    let mut rng = Rng::new(7000 + ordinal as u64);
    let x = mixed_matrix::<f32>(&mut rng, rows, n);
    let dy = random_matrix::<f32>(&mut rng, rows, n);
    let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<f32>(&mut rng, n, 0.0, 0.5);
    let (x64, gamma64) = (to_f64(x.view()), to_f64(gamma.view()));
    let (ry, _, _) = reference::forward(x64.view(), gamma64.view(), to_f64(beta.view()).view(), 1e-5);
    let (rdx, rdgamma, _) = reference::backward(x64.view(), to_f64(dy.view()).view(), gamma64.view(), 1e-5);
    let ln = LayerNorm::from_arrays(&device, gamma.view(), beta.view(), 1e-5).unwrap();
    let (xt, dyt) = (
        device.upload(x.view()).unwrap(),
        device.upload(dy.view()).unwrap(),
    );
    start.wait();
    for round in 0..20 {
        let (y, ctx) = ln.forward(&xt).unwrap();
        let g = ln.backward(&ctx, &dyt).unwrap();
        let tol = tolerance::<f32>();
        let what = format!("cuda:{ordinal} round {round}");
        let err = rel_err(y.to_array2().unwrap().view(), ry.view());
        assert!(err <= tol, "{what}: y error {err:e}");
        let err = rel_err(g.dx.to_array2().unwrap().view(), rdx.view());
        assert!(err <= 2.0 * tol, "{what}: dx error {err:e}");
        let err = rel_err(g.dgamma.unwrap().to_array1().unwrap().view(), rdgamma.view());
        assert!(err <= 2.0 * tol, "{what}: dgamma error {err:e}");
    }
}

#[test]
fn two_gpus_from_two_threads_at_once_are_correct() {
    if two_gpus_or_skip().is_none() {
        return;
    }
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        for ordinal in 0..2 {
            let start = &start;
            s.spawn(move || run_on(ordinal, start));
        }
    });
}

#[test]
fn tensors_of_one_gpu_are_refused_by_the_others_op() {
    if two_gpus_or_skip().is_none() {
        return;
    }
    let (gpu0, gpu1) = (Device::cuda(0).unwrap(), Device::cuda(1).unwrap());
    let n = 16;
    let ln1 = LayerNorm::<f32>::without_affine(&gpu1, n, 1e-5).unwrap();
    let x0 = gpu0.full(&[3, n], 1.0f32).unwrap();
    let r = ln1.forward(&x0);
    assert!(matches!(r, Err(Error::DeviceMismatch { what: "x", .. })), "{r:?}");
    let gamma0 = gpu0.full(&[n], 1.0f32).unwrap();
    let beta1 = gpu1.full(&[n], 0.0f32).unwrap();
    let r = LayerNorm::<f32>::new(gamma0, beta1, 1e-5);
    assert!(
        matches!(r, Err(Error::DeviceMismatch { what: "beta", .. })),
        "{r:?}"
    );
}
