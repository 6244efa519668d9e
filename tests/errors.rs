//! Bad input gets a typed error before anything runs; empty inputs have defined results.

mod common;

use common::{Rng, gpu_or_skip, random_matrix, random_vec};
use layernorm_cuda::{BackwardMode, Device, Error, Gradients, LayerNorm, MAX_DIM};
use ndarray::{Array1, Array2, Array3};

fn op(device: &Device, n: usize) -> LayerNorm<f32> {
    let mut rng = Rng::new(7);
    LayerNorm::from_arrays(
        device,
        random_vec(&mut rng, n, 1.0, 0.5).view(),
        random_vec(&mut rng, n, 0.0, 0.5).view(),
        1e-5,
    )
    .unwrap()
}

/// Every device this machine has: the CPU, and the GPU where there is one.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::cpu()];
    d.extend(gpu_or_skip());
    d
}

#[test]
fn bad_eps_is_refused() {
    for device in devices() {
        let v = device.upload(Array1::<f32>::ones(4).view()).unwrap();
        for eps in [0.0, -1e-5, f32::NAN, f32::INFINITY] {
            let r = LayerNorm::<f32>::new(v.clone(), v.clone(), eps);
            assert!(
                matches!(r, Err(Error::BadEps(e)) if e.to_bits() == eps.to_bits()),
                "eps {eps}: {r:?}"
            );
        }
    }
}

#[test]
fn shape_mismatches_are_refused() {
    for device in devices() {
        let ln = op(&device, 8);
        let up = |a: Array2<f32>| device.upload(a.view()).unwrap();
        // x with the wrong row length, x of the wrong rank.
        assert!(matches!(
            ln.forward(&up(Array2::ones((3, 9)))),
            Err(Error::Shape { what: "x", .. })
        ));
        // Any rank from 1 on, with n last (tests/shapes.rs runs them); a 0-dimensional
        // tensor has no n.
        let x3 = device.upload(Array3::<f32>::ones((2, 3, 9)).view()).unwrap();
        assert!(matches!(ln.forward(&x3), Err(Error::Shape { what: "x", .. })));
        let x0 = device.full::<f32>(&[], 1.0).unwrap();
        assert!(matches!(ln.forward(&x0), Err(Error::Shape { what: "x", .. })));
        // gamma and beta of different lengths.
        let (g, b) = (
            device.upload(Array1::<f32>::ones(8).view()).unwrap(),
            device.upload(Array1::<f32>::ones(7).view()).unwrap(),
        );
        assert!(matches!(
            LayerNorm::<f32>::new(g, b, 1e-5),
            Err(Error::Shape { what: "beta", .. })
        ));
        // y of the wrong shape; dy of another shape than the forward's x.
        let x = up(Array2::ones((3, 8)));
        let mut y = up(Array2::ones((4, 8)));
        assert!(matches!(
            ln.forward_into(&x, &mut y),
            Err(Error::Shape { what: "y", .. })
        ));
        let (_, ctx) = ln.forward(&x).unwrap();
        assert!(matches!(
            ln.backward(&ctx, &up(Array2::ones((2, 8)))),
            Err(Error::Shape { what: "dy", .. })
        ));
    }
}

#[test]
fn a_context_from_another_op_is_refused() {
    for device in devices() {
        let (a, b) = (op(&device, 8), op(&device, 8));
        let x = device.upload(Array2::<f32>::ones((2, 8)).view()).unwrap();
        let (_, ctx) = a.forward(&x).unwrap();
        assert!(matches!(b.backward(&ctx, &x), Err(Error::ForeignContext)));
    }
}

/// An output shared with another handle is refused whatever the shape, empty ones included,
/// by the forward and the backward alike, and nothing is written through it.
#[test]
fn a_shared_output_is_refused() {
    for device in devices() {
        for (rows, n) in [(2, 8), (0, 8), (3, 0)] {
            let ln = op(&device, n);
            let x = device.upload(Array2::<f32>::ones((rows, n)).view()).unwrap();
            let mut y = device.full::<f32>(&[rows, n], 7.0).unwrap();
            let other_handle = y.clone();
            let r = ln.forward_into(&x, &mut y);
            assert!(
                matches!(r, Err(Error::SharedOutput { what: "y" })),
                "[{rows}, {n}]: {r:?}"
            );
            assert_eq!(other_handle.to_vec().unwrap(), vec![7.0; rows * n]);

            let (_, ctx) = ln.forward(&x).unwrap();
            let fresh = || Gradients {
                dx: device.full(&[rows, n], 7.0).unwrap(),
                dgamma: Some(device.full(&[n], 7.0).unwrap()),
                dbeta: Some(device.full(&[n], 7.0).unwrap()),
            };
            let mut grads = fresh();
            let other_handle = grads.dx.clone();
            let r = ln.backward_into(&ctx, &x, &mut grads);
            assert!(
                matches!(r, Err(Error::SharedOutput { what: "dx" })),
                "[{rows}, {n}]: {r:?}"
            );
            drop(other_handle);
            let other_handle = grads.dgamma.clone().unwrap();
            let r = ln.backward_into(&ctx, &x, &mut grads);
            assert!(
                matches!(r, Err(Error::SharedOutput { what: "dgamma" })),
                "[{rows}, {n}]: {r:?}"
            );
            assert_eq!(other_handle.to_vec().unwrap(), vec![7.0; n]);
        }
    }
}

#[test]
fn zero_groups_are_refused() {
    let r = op(&Device::cpu(), 4).with_backward_mode(BackwardMode::Locked { groups: Some(0) });
    assert!(matches!(r, Err(Error::BadGroups(0))));
}

#[test]
fn rows_past_the_index_limit_are_refused() {
    // A [MAX_DIM + 1, 0] tensor holds no elements, so this needs no memory.
    for device in devices() {
        let ln = op(&device, 0);
        let x = device.full::<f32>(&[MAX_DIM + 1, 0], 0.0).unwrap();
        assert!(matches!(
            ln.forward(&x),
            Err(Error::TooLarge { what: "rows", .. })
        ));
    }
}

/// M = 0: empty y, mean, rstd, dx, and zero dgamma, dbeta (sums over no rows), as PyTorch.
/// N = 0: empty y, dx, dgamma, dbeta; mean and rstd of an empty row are NaN.
#[test]
fn empty_inputs_have_defined_results() {
    for device in devices() {
        let ln = op(&device, 5);
        let x = device.upload(Array2::<f32>::zeros((0, 5)).view()).unwrap();
        let (y, ctx) = ln.forward(&x).unwrap();
        assert_eq!((y.shape(), ctx.mean().shape()), (&[0, 5][..], &[0][..]));
        let g = ln.backward(&ctx, &x).unwrap();
        assert_eq!(g.dx.shape(), &[0, 5]);
        assert_eq!(g.dgamma.as_ref().unwrap().to_vec().unwrap(), vec![0.0; 5]);
        assert_eq!(g.dbeta.as_ref().unwrap().to_vec().unwrap(), vec![0.0; 5]);

        let ln = op(&device, 0);
        let x = device.upload(Array2::<f32>::zeros((3, 0)).view()).unwrap();
        let (y, ctx) = ln.forward(&x).unwrap();
        assert_eq!(y.shape(), &[3, 0]);
        assert!(ctx.mean().to_vec().unwrap().iter().all(|m| m.is_nan()));
        assert!(ctx.rstd().to_vec().unwrap().iter().all(|r| r.is_nan()));
        let g = ln.backward(&ctx, &x).unwrap();
        assert_eq!(
            (g.dx.shape(), g.dgamma.as_ref().unwrap().shape()),
            (&[3, 0][..], &[0][..])
        );
    }
}

/// A tensor with no elements may have other dimensions whose product passes `isize::MAX`;
/// ndarray cannot hold that shape, so copying it into an array is `Shape`, not a panic. Its
/// elements (none) still copy out as a vector.
#[test]
fn empty_tensors_that_ndarray_cannot_shape_are_refused_by_to_array() {
    for device in devices() {
        for shape in [&[0, usize::MAX][..], &[0, 1 << 40, 1 << 40]] {
            let t = device.full::<f32>(shape, 0.0).unwrap();
            assert_eq!(t.to_vec().unwrap(), Vec::<f32>::new());
            let r = t.to_array();
            assert!(
                matches!(&r, Err(Error::Shape { what: "tensor", got, .. }) if got == shape),
                "{shape:?}: {r:?}"
            );
        }
        let t = device.full::<f32>(&[0, usize::MAX], 0.0).unwrap();
        let r = t.to_array2();
        assert!(
            matches!(&r, Err(Error::Shape { what: "tensor", got, .. }) if got == &[0, usize::MAX]),
            "{r:?}"
        );
        // Shapes ndarray can hold still copy out.
        let t = device.full::<f32>(&[0, 1 << 40], 0.0).unwrap();
        assert_eq!(t.to_array2().unwrap().dim(), (0, 1 << 40));
        assert_eq!(t.to_array().unwrap().shape(), &[0, 1 << 40]);
    }
}

/// Without a driver, opening a device is `NoDriver`; with one, a missing ordinal is
/// `NoDevice`. Never a panic.
#[test]
fn missing_devices_are_typed_errors() {
    match Device::cuda(999) {
        Err(Error::NoDriver) | Err(Error::NoDevice { ordinal: 999, .. }) => {}
        other => panic!("expected NoDriver or NoDevice, got {other:?}"),
    }
}

#[test]
fn tensors_from_another_device_are_refused() {
    let Some(gpu) = gpu_or_skip() else { return };
    let ln = op(&gpu, 8);
    let x_on_cpu = Device::cpu()
        .upload(random_matrix::<f32>(&mut Rng::new(3), 2, 8).view())
        .unwrap();
    assert!(matches!(
        ln.forward(&x_on_cpu),
        Err(Error::DeviceMismatch { what: "x", .. })
    ));
}

/// Strided and transposed views upload in row-major order, so results match a copy.
#[test]
fn strided_views_upload_in_logical_order() {
    let a = Array2::from_shape_fn((6, 4), |(i, j)| (i * 4 + j) as f32);
    let t = a.t();
    let uploaded = Device::cpu().upload(t).unwrap().to_array2().unwrap();
    assert_eq!(uploaded, t.to_owned());
}
