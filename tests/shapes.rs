//! `[..., n]` inputs, normalized over the last dimension as PyTorch does, and LayerNorms
//! without bias (`bias=False`) or without gamma and beta (`elementwise_affine=False`):
//! against the float64 reference, and bitwise against the `[rows, n]` path with the absent
//! parameters given as ones and zeros (what they stand for).

mod common;

use common::{Rng, gpu_or_skip, mixed_matrix, random_matrix, random_vec, rel_err, to_f64, tolerance};
use layernorm_cuda::{Device, Element, Error, Gradients, LayerNorm, Tensor, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array1, Array2, ArrayView1};

/// Which parameters the op has.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Affine {
    /// gamma and beta (`LayerNorm::new`).
    Both,
    /// gamma only (`LayerNorm::without_bias`).
    GammaOnly,
    /// neither (`LayerNorm::without_affine`).
    Neither,
}

const AFFINES: [Affine; 3] = [Affine::Both, Affine::GammaOnly, Affine::Neither];

/// Leading dimensions of x (n is appended): 1-D, 3-D and 4-D inputs, and an empty one.
const LEADING: &[&[usize]] = &[&[], &[2, 3], &[2, 1, 3], &[3, 0, 2]];

/// Row lengths: whole 16-byte packs for every type (64) and not (77).
const NS: &[usize] = &[64, 77];

fn devices() -> Vec<Device> {
    let mut d = vec![Device::cpu()];
    d.extend(gpu_or_skip());
    d
}

/// The op with the parameters `affine` names, gamma and beta from the given arrays.
fn op<T: Element>(
    device: &Device,
    affine: Affine,
    gamma: ArrayView1<'_, T>,
    beta: ArrayView1<'_, T>,
) -> LayerNorm<T> {
    let eps = 1e-5;
    match affine {
        Affine::Both => LayerNorm::from_arrays(device, gamma, beta, eps),
        Affine::GammaOnly => LayerNorm::without_bias(device.upload(gamma).unwrap(), eps),
        Affine::Neither => LayerNorm::without_affine(device, gamma.len(), eps),
    }
    .unwrap()
}

/// x of shape `leading + [n]` through the op with `affine`'s parameters: y and dx have x's
/// shape, dgamma and dbeta exist exactly for the op's parameters, all within tolerance of
/// the reference, and every output is bitwise that of the `[rows, n]` path with gamma and
/// beta given (ones and zeros standing for absent ones).
fn check<T: Element>(device: &Device, leading: &[usize], n: usize, affine: Affine, seed: u64) {
    let rows: usize = leading.iter().product();
    let shape: Vec<usize> = leading.iter().copied().chain([n]).collect();
    let what = format!("{} {} {shape:?} {affine:?}", device.name(), T::NAME);
    let mut rng = Rng::new(seed);
    let x = mixed_matrix::<T>(&mut rng, rows, n);
    let dy = random_matrix::<T>(&mut rng, rows, n);
    let (gamma, beta) = match affine {
        Affine::Both => (
            random_vec::<T>(&mut rng, n, 1.0, 0.5),
            random_vec::<T>(&mut rng, n, 0.0, 0.5),
        ),
        Affine::GammaOnly => (
            random_vec::<T>(&mut rng, n, 1.0, 0.5),
            Array1::from_elem(n, T::from_f32(0.0)),
        ),
        Affine::Neither => (
            Array1::from_elem(n, T::from_f32(1.0)),
            Array1::from_elem(n, T::from_f32(0.0)),
        ),
    };

    let ln = op(device, affine, gamma.view(), beta.view());
    assert_eq!(ln.gamma().is_some(), affine != Affine::Neither, "{what}");
    assert_eq!(ln.beta().is_some(), affine == Affine::Both, "{what}");
    let as_shape = |a: &Array2<T>| device.upload(a.view()).unwrap().view(0, &shape).unwrap();
    let (xt, dyt) = (as_shape(&x), as_shape(&dy));
    let (y, ctx) = ln.forward(&xt).unwrap();
    let grads = ln.backward(&ctx, &dyt).unwrap();
    assert_eq!(y.shape(), &shape[..], "{what}: y");
    assert_eq!(grads.dx.shape(), &shape[..], "{what}: dx");
    assert_eq!(ctx.mean().shape(), &[rows], "{what}: mean");
    assert_eq!(
        grads.dgamma.is_some(),
        affine != Affine::Neither,
        "{what}: dgamma"
    );
    assert_eq!(grads.dbeta.is_some(), affine == Affine::Both, "{what}: dbeta");

    let eps = f64::from(ln.eps());
    let (x64, gamma64) = (to_f64(x.view()), to_f64(gamma.view()));
    let (ry, _, _) = reference::forward(x64.view(), gamma64.view(), to_f64(beta.view()).view(), eps);
    let (rdx, rdgamma, rdbeta) =
        reference::backward(x64.view(), to_f64(dy.view()).view(), gamma64.view(), eps);
    let flat = |t: &Tensor<T>| Array2::from_shape_vec((rows, n), t.to_vec().unwrap()).unwrap();
    let tol = tolerance::<T>();
    let mut errors = vec![
        ("y", rel_err(flat(&y).view(), ry.view()), tol),
        ("dx", rel_err(flat(&grads.dx).view(), rdx.view()), 2.0 * tol),
    ];
    if let Some(dgamma) = &grads.dgamma {
        errors.push((
            "dgamma",
            rel_err(dgamma.to_array1().unwrap().view(), rdgamma.view()),
            2.0 * tol,
        ));
    }
    if let Some(dbeta) = &grads.dbeta {
        errors.push((
            "dbeta",
            rel_err(dbeta.to_array1().unwrap().view(), rdbeta.view()),
            2.0 * tol,
        ));
    }
    for (name, err, tol) in errors {
        assert!(err <= tol, "{what}: {name} error {err:e} > {tol:e}");
    }

    // The same rows as [rows, n], with gamma and beta given: the same bits.
    let full = op(device, Affine::Both, gamma.view(), beta.view());
    let (x2, dy2) = (
        device.upload(x.view()).unwrap(),
        device.upload(dy.view()).unwrap(),
    );
    let (y2, ctx2) = full.forward(&x2).unwrap();
    let grads2 = full.backward(&ctx2, &dy2).unwrap();
    let bits = |t: &Tensor<T>| {
        t.to_vec()
            .unwrap()
            .iter()
            .map(|v| v.to_f32().to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&y), bits(&y2), "{what}: y differs from the [rows, n] path");
    assert_eq!(
        bits(&grads.dx),
        bits(&grads2.dx),
        "{what}: dx differs from the [rows, n] path"
    );
    for (name, mine, given) in [
        ("dgamma", &grads.dgamma, &grads2.dgamma),
        ("dbeta", &grads.dbeta, &grads2.dbeta),
    ] {
        if let (Some(mine), Some(given)) = (mine, given) {
            assert_eq!(
                bits(mine),
                bits(given),
                "{what}: {name} differs from the [rows, n] path"
            );
        }
    }
}

fn check_all<T: Element>(device: &Device, seed: u64) {
    let mut case = 0;
    for leading in LEADING {
        for &n in NS {
            for affine in AFFINES {
                check::<T>(device, leading, n, affine, seed + case);
                case += 1;
            }
        }
    }
}

#[test]
fn cpu_inputs_of_any_rank_and_absent_parameters_match_reference() {
    let cpu = Device::cpu();
    check_all::<f32>(&cpu, 5000);
    check_all::<f16>(&cpu, 5100);
    check_all::<bf16>(&cpu, 5200);
}

#[test]
fn gpu_inputs_of_any_rank_and_absent_parameters_match_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all::<f32>(&gpu, 5000);
    check_all::<f16>(&gpu, 5100);
    check_all::<bf16>(&gpu, 5200);
}

/// A gradient for a parameter the op lacks, or none for one it has, is refused before
/// anything is written.
#[test]
fn gradients_must_match_the_parameters() {
    for device in devices() {
        let n = 8;
        let ones = Array1::<f32>::ones(n);
        let x = device.upload(Array2::<f32>::ones((2, n)).view()).unwrap();
        for affine in AFFINES {
            let ln = op(&device, affine, ones.view(), ones.view());
            let ctx = ln.forward(&x).unwrap().1;
            let has = [affine != Affine::Neither, affine == Affine::Both];
            for (which, what) in [(0, "dgamma"), (1, "dbeta")] {
                let mut present = has;
                present[which] = !present[which];
                let slot = |p: bool| p.then(|| device.full(&[n], 7.0f32).unwrap());
                let mut grads = Gradients {
                    dx: device.full(&[2, n], 7.0f32).unwrap(),
                    dgamma: slot(present[0]),
                    dbeta: slot(present[1]),
                };
                let r = ln.backward_into(&ctx, &x, &mut grads);
                assert!(
                    matches!(r, Err(Error::ParameterGradient { what: w, op_has_parameter })
                        if w == what && op_has_parameter == has[which]),
                    "{} {affine:?} {what}: {r:?}",
                    device.name()
                );
                assert_eq!(
                    grads.dx.to_vec().unwrap(),
                    vec![7.0; 2 * n],
                    "a refused call wrote dx"
                );
            }
        }
    }
}

/// Bad eps and n are refused by the constructors without parameters too.
#[test]
fn constructors_without_parameters_check_eps_and_n() {
    let cpu = Device::cpu();
    assert!(matches!(
        LayerNorm::<f32>::without_affine(&cpu, 4, 0.0),
        Err(Error::BadEps(_))
    ));
    assert!(matches!(
        LayerNorm::<f32>::without_affine(&cpu, layernorm_cuda::MAX_DIM + 1, 1e-5),
        Err(Error::TooLarge { what: "n", .. })
    ));
    let gamma = cpu.full(&[4], 1.0f32).unwrap();
    assert!(matches!(
        LayerNorm::<f32>::without_bias(gamma, f32::NAN),
        Err(Error::BadEps(_))
    ));
    let gamma2 = cpu.full(&[2, 2], 1.0f32).unwrap();
    assert!(matches!(
        LayerNorm::<f32>::without_bias(gamma2, 1e-5),
        Err(Error::Shape { what: "gamma", .. })
    ));
}
