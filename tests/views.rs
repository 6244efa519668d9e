//! Views (`Tensor::view`, `Tensor::slice_rows`): inputs taken at any element offset of a
//! larger buffer, so that rows, gamma and beta are not aligned for the kernels' 16-byte loads,
//! give results within the usual tolerances of the float64 reference; views read exactly their
//! own elements; views as outputs and views out of range are typed errors.

mod common;

use common::{
    Rng, gpu_or_skip, mixed_matrix, poisoned, random_matrix, random_vec, rel_err, to_f64, tolerance,
};
use layernorm_cuda::{BackwardMode, Device, Element, Error, Gradients, LayerNorm, Tensor, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array1, Array2, ArrayView, ArrayView1, Dimension};

/// Element offsets of (x, gamma, beta, dy) in their buffers: each of 1, 2, 3, 4 and 5 for
/// every input, and mixes where some inputs are aligned (0) and others not. 8-byte offsets
/// (f32 at 2, f16 and bf16 at 4) make rows the forward reads in half packs, or, with x
/// aligned and only the weights at 8 bytes, rows whose weights allow no more. x and dy at
/// one offset make rows the backward's block teams take in packs from x's first boundary,
/// gamma's columns then off its own (at 3: its first pack starts mid-word).
const OFFSETS: &[[usize; 4]] = &[
    [1, 1, 1, 1],
    [2, 2, 2, 2],
    [3, 3, 3, 3],
    [4, 4, 4, 4],
    [5, 5, 5, 5],
    [0, 3, 5, 1],
    [5, 0, 2, 3],
    [2, 5, 0, 0],
    [0, 4, 4, 0],
    [0, 4, 2, 0],
    [0, 3, 1, 0],
];

/// (rows, n): n a multiple of 8 (64, 1000, 4096) and not (77, 3001), for warp teams (n <= 1024)
/// and block teams.
const VIEW_SHAPES: &[(usize, usize)] = &[(7, 64), (5, 1000), (6, 77), (3, 4096), (4, 3001)];

fn devices() -> Vec<Device> {
    let mut d = vec![Device::cpu()];
    d.extend(gpu_or_skip());
    d
}

/// `a`'s elements at `offset` in a NaN-filled 1-D buffer on `device` that extends past them on
/// both sides (where `offset` > 0), and the view of them with `a`'s shape. An op that read
/// outside the view would see NaN, and its output would show it.
fn embedded<T: Element, D: Dimension>(device: &Device, a: ArrayView<'_, T, D>, offset: usize) -> Tensor<T> {
    let mut buffer = vec![T::from_f32(f32::NAN); offset + a.len() + 11];
    for (slot, &v) in buffer[offset..].iter_mut().zip(a.iter()) {
        *slot = v;
    }
    let storage = device.upload(ArrayView1::from(&buffer)).unwrap();
    let view = storage.view(offset, a.shape()).unwrap();
    assert!(view.is_view() && view.shape() == a.shape());
    view
}

/// Forward, then backward in each mode (on the CPU the mode changes nothing, so only one),
/// with x, gamma, beta and dy all views at `offsets`; every output against the reference.
fn check_views<T: Element>(device: &Device, rows: usize, n: usize, offsets: [usize; 4], seed: u64) {
    let [at_x, at_gamma, at_beta, at_dy] = offsets;
    let mut rng = Rng::new(seed);
    let x = mixed_matrix::<T>(&mut rng, rows, n);
    let dy = random_matrix::<T>(&mut rng, rows, n);
    let gamma = random_vec::<T>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<T>(&mut rng, n, 0.0, 0.5);
    let eps = 1e-5f32;
    let (x64, gamma64) = (to_f64(x.view()), to_f64(gamma.view()));
    let (ry, rmean, rrstd) =
        reference::forward(x64.view(), gamma64.view(), to_f64(beta.view()).view(), eps as f64);
    let (rdx, rdgamma, rdbeta) =
        reference::backward(x64.view(), to_f64(dy.view()).view(), gamma64.view(), eps as f64);

    let what = format!(
        "{} {} [{rows}, {n}] offsets (x, gamma, beta, dy) {offsets:?}",
        device.name(),
        T::NAME
    );
    let ln = LayerNorm::new(
        embedded(device, gamma.view(), at_gamma),
        embedded(device, beta.view(), at_beta),
        eps,
    )
    .unwrap();
    let mut y = poisoned::<T>(device, &[rows, n]);
    let ctx = ln
        .forward_into(&embedded(device, x.view(), at_x), &mut y)
        .unwrap();
    let tol = tolerance::<T>();
    for (name, err, tol) in [
        ("y", rel_err(y.to_array2().unwrap().view(), ry.view()), tol),
        (
            "mean",
            rel_err(ctx.mean().to_array1().unwrap().view(), rmean.view()),
            1e-5,
        ),
        (
            "rstd",
            rel_err(ctx.rstd().to_array1().unwrap().view(), rrstd.view()),
            1e-5,
        ),
    ] {
        assert!(err <= tol, "{what}: {name} error {err:e} > {tol:e}");
    }

    let dy = embedded(device, dy.view(), at_dy);
    let modes: &[BackwardMode] = if device.is_cuda() {
        &[BackwardMode::Deterministic, BackwardMode::Locked { groups: None }]
    } else {
        &[BackwardMode::Deterministic]
    };
    for &mode in modes {
        let ln = ln.clone().with_backward_mode(mode).unwrap();
        let mut grads = Gradients {
            dx: poisoned(device, &[rows, n]),
            dgamma: Some(poisoned(device, &[n])),
            dbeta: Some(poisoned(device, &[n])),
        };
        ln.backward_into(&ctx, &dy, &mut grads).unwrap();
        // dx subtracts two row means from gamma * dy; twice the forward's tolerance.
        let tol = 2.0 * tolerance::<T>();
        for (name, err) in [
            ("dx", rel_err(grads.dx.to_array2().unwrap().view(), rdx.view())),
            (
                "dgamma",
                rel_err(
                    grads.dgamma.as_ref().unwrap().to_array1().unwrap().view(),
                    rdgamma.view(),
                ),
            ),
            (
                "dbeta",
                rel_err(
                    grads.dbeta.as_ref().unwrap().to_array1().unwrap().view(),
                    rdbeta.view(),
                ),
            ),
        ] {
            assert!(err <= tol, "{what} {mode:?}: {name} error {err:e} > {tol:e}");
        }
    }
}

fn check_all<T: Element>(device: &Device, seed: u64) {
    for (i, &(rows, n)) in VIEW_SHAPES.iter().enumerate() {
        for (j, &offsets) in OFFSETS.iter().enumerate() {
            check_views::<T>(device, rows, n, offsets, seed + (i * OFFSETS.len() + j) as u64);
        }
    }
}

#[test]
fn cpu_views_at_odd_offsets_match_reference() {
    let cpu = Device::cpu();
    check_all::<f32>(&cpu, 2000);
    check_all::<f16>(&cpu, 2100);
    check_all::<bf16>(&cpu, 2200);
}

#[test]
fn gpu_views_at_odd_offsets_match_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all::<f32>(&gpu, 2000);
    check_all::<f16>(&gpu, 2100);
    check_all::<bf16>(&gpu, 2200);
}

/// x at an offset that y (a whole tensor) does not share, over more rows than
/// multiprocessors: the plain forward's general block kernel takes such rows in elements
/// (f32 at 1, bf16 at 3) or half packs (f16 at 4), where a whole x and y, whose rows sit
/// alike, go to the held kernel over shifted rows on sm_90; the backward with dy at x's
/// offset and a whole dx, the owned kernel's element path or the held one's half packs.
#[test]
fn gpu_views_of_many_rows_match_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_views::<f32>(&gpu, 300, 4097, [1, 0, 0, 1], 2300);
    check_views::<f16>(&gpu, 300, 4100, [4, 0, 0, 4], 2301);
    check_views::<bf16>(&gpu, 300, 2051, [3, 1, 2, 3], 2302);
}

/// A view, a view of a view, and rows of a matrix copy back exactly their own elements.
#[test]
fn views_read_their_own_elements() {
    for device in devices() {
        let a = Array2::from_shape_fn((4, 5), |(i, j)| (10 * i + j) as f32);
        let t = device.upload(a.view()).unwrap();
        let flat: Vec<f32> = a.iter().copied().collect();

        let v = t.view(3, &[2, 4]).unwrap();
        assert_eq!(v.to_vec().unwrap(), flat[3..11]);
        assert_eq!(
            v.to_array2().unwrap(),
            Array2::from_shape_vec((2, 4), flat[3..11].to_vec()).unwrap()
        );
        let inner = v.view(2, &[3]).unwrap();
        assert_eq!(inner.to_array1().unwrap(), Array1::from(flat[5..8].to_vec()));

        let rows = t.slice_rows(1..3).unwrap();
        assert_eq!(rows.shape(), &[2, 5]);
        assert_eq!(rows.to_array2().unwrap(), a.slice(ndarray::s![1..3, ..]));
        assert!(rows.is_view() && !t.is_view());
        assert_eq!(t.slice_rows(4..4).unwrap().shape(), &[0, 5]);
        // A view of all the elements, reshaped, is the whole tensor again.
        assert!(!t.view(0, &[20]).unwrap().is_view());
    }
}

#[test]
fn views_out_of_range_are_refused() {
    for device in devices() {
        let t = device.upload(Array1::<f32>::zeros(10).view()).unwrap();
        assert!(matches!(
            t.view(3, &[2, 4]),
            Err(Error::ViewOutOfRange {
                offset: 3,
                len: 8,
                available: 10
            })
        ));
        assert!(matches!(
            t.view(usize::MAX, &[1]),
            Err(Error::ViewOutOfRange { .. })
        ));
        assert!(matches!(
            t.view(0, &[usize::MAX, 2]),
            Err(Error::Shape { what: "view", .. })
        ));
        // A view is measured against its own length, not its storage's.
        let v = t.view(4, &[6]).unwrap();
        assert!(matches!(
            v.view(1, &[6]),
            Err(Error::ViewOutOfRange { available: 6, .. })
        ));

        let m = device.upload(Array2::<f32>::zeros((4, 3)).view()).unwrap();
        for (start, end) in [(2, 5), (3, 2), (5, 5)] {
            let r = m.slice_rows(start..end);
            assert!(
                matches!(r, Err(Error::RowsOutOfRange { rows: 4, .. })),
                "rows {start}..{end}: {r:?}"
            );
        }
    }
}

/// Empty outputs follow the same rule: a view as y or dx is refused where M = 0 or N = 0, by
/// the forward as by the backward, before anything runs.
#[test]
fn empty_views_as_outputs_are_refused() {
    for device in devices() {
        for (rows, n) in [(0, 8), (3, 0)] {
            let mut rng = Rng::new(2400);
            let ln = LayerNorm::from_arrays(
                &device,
                random_vec::<f32>(&mut rng, n, 1.0, 0.5).view(),
                random_vec::<f32>(&mut rng, n, 0.0, 0.5).view(),
                1e-5,
            )
            .unwrap();
            let x = device.full::<f32>(&[rows, n], 1.0).unwrap();
            let storage = device.full::<f32>(&[5], 7.0).unwrap();
            let mut y = storage.view(1, &[rows, n]).unwrap();
            let r = ln.forward_into(&x, &mut y);
            assert!(
                matches!(r, Err(Error::ViewOutput { what: "y" })),
                "[{rows}, {n}]: {r:?}"
            );

            let ctx = ln.forward(&x).unwrap().1;
            let mut grads = Gradients {
                dx: storage.view(2, &[rows, n]).unwrap(),
                dgamma: Some(device.full(&[n], 7.0).unwrap()),
                dbeta: Some(device.full(&[n], 7.0).unwrap()),
            };
            let r = ln.backward_into(&ctx, &x, &mut grads);
            assert!(
                matches!(r, Err(Error::ViewOutput { what: "dx" })),
                "[{rows}, {n}]: {r:?}"
            );
            // For M = 0 a backward that ran would have zeroed dgamma and dbeta.
            assert_eq!(grads.dgamma.as_ref().unwrap().to_vec().unwrap(), vec![7.0; n]);
            assert_eq!(storage.to_vec().unwrap(), vec![7.0; 5]);
        }
    }
}

/// Rows of a tensor with no rows, whose other dimensions multiply past `usize::MAX`: the
/// empty range is a view of the same shape, any other range `RowsOutOfRange`, never an
/// overflow.
#[test]
fn rows_of_an_empty_tensor_with_huge_rows() {
    for device in devices() {
        let shape = [0, 1 << 40, 1 << 40];
        let t = device.full::<f32>(&shape, 0.0).unwrap();
        let rows = t.slice_rows(0..0).unwrap();
        assert_eq!(rows.shape(), &shape);
        assert!(rows.is_empty());
        for (start, end) in [(0, 1), (1, 1), (1, 0)] {
            let r = t.slice_rows(start..end);
            assert!(
                matches!(r, Err(Error::RowsOutOfRange { rows: 0, .. })),
                "rows {start}..{end}: {r:?}"
            );
        }
    }
}

/// Outputs must be whole tensors: a view is refused as y or dx (even where it is its storage's
/// only handle), and nothing is written. A reshaped view of all of a storage is whole.
#[test]
fn views_as_outputs_are_refused() {
    for device in devices() {
        let n = 8;
        let mut rng = Rng::new(2300);
        let ln = LayerNorm::from_arrays(
            &device,
            random_vec::<f32>(&mut rng, n, 1.0, 0.5).view(),
            random_vec::<f32>(&mut rng, n, 0.0, 0.5).view(),
            1e-5,
        )
        .unwrap();
        let x = device
            .upload(random_matrix::<f32>(&mut rng, 2, n).view())
            .unwrap();

        let storage = device.full::<f32>(&[3 * n], 7.0).unwrap();
        let mut y = storage.view(n, &[2, n]).unwrap();
        assert!(matches!(
            ln.forward_into(&x, &mut y),
            Err(Error::ViewOutput { what: "y" })
        ));
        assert_eq!(
            storage.to_vec().unwrap(),
            vec![7.0; 3 * n],
            "a refused output was written"
        );
        drop(storage);
        assert!(matches!(
            ln.forward_into(&x, &mut y),
            Err(Error::ViewOutput { what: "y" })
        ));

        let ctx = ln.forward(&x).unwrap().1;
        let mut grads = Gradients {
            dx: device.zeros::<f32>(&[3, n]).unwrap().slice_rows(0..2).unwrap(),
            dgamma: Some(device.zeros(&[n]).unwrap()),
            dbeta: Some(device.zeros(&[n]).unwrap()),
        };
        assert!(matches!(
            ln.backward_into(&ctx, &x, &mut grads),
            Err(Error::ViewOutput { what: "dx" })
        ));

        let mut whole = device.zeros::<f32>(&[2 * n]).unwrap().view(0, &[2, n]).unwrap();
        ln.forward_into(&x, &mut whole).unwrap();
        let (y, _) = ln.forward(&x).unwrap();
        assert_eq!(whole.to_vec().unwrap(), y.to_vec().unwrap());
    }
}
