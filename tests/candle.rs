//! The candle integration (feature `candle`): `layer_norm` and `rms_norm` on candle tensors,
//! their gradients through candle's autograd (`loss.backward()`), against the same math built
//! from candle ops in f64 within the dtype's tolerance, and bitwise against this crate's own
//! API on the same device (the same path runs underneath). Strided and offset inputs, the
//! `Module` layers, empty inputs and every refusal as a typed candle error. The same for the
//! residual add fused with the norm (`layer_norm_residual`, `rms_norm_residual`, the layers'
//! `forward_residual`), with losses on y, on s and on both, the residual stream in x's dtype
//! and in f32 beside f16 and bf16 x. The CPU tests run
//! everywhere; with `candle-cuda`, the same checks run on candle's CUDA tensors where a GPU
//! is (`LAYERNORM_REQUIRE_GPU=1` makes a missing GPU a failure).

mod common;

use candle_core::{D, DType, Error, Module, Tensor, Var, WithDType};
use common::{Rng, mixed_matrix, random_matrix, random_vec, rel_err, tolerance};
use layernorm_cuda::candle::{
    LayerNorm, RmsNorm, as_layernorm_error, layer_norm, layer_norm_residual, rms_norm, rms_norm_residual,
};
use layernorm_cuda::{Element, F32Stream, Weight, bf16, f16};
use ndarray::ArrayView1;

const EPS: f32 = 1e-5;

/// Shapes `[..., n]`: 1-D, 3-D, n = 1, odd n (no 16-byte packs), whole packs, a long row.
const SHAPES: &[&[usize]] = &[&[7], &[2, 3, 64], &[5, 1], &[7, 3], &[9, 1024], &[3, 4097]];

/// x and w (dy: the loss is sum(y * w)) in T, gamma and beta in W, for `shape`.
struct Problem<T, W = T> {
    shape: Vec<usize>,
    x: Vec<T>,
    gamma: Vec<W>,
    beta: Vec<W>,
    w: Vec<T>,
}

impl<T: Element + WithDType, W: Element + WithDType> Problem<T, W> {
    fn new(shape: &[usize], seed: u64) -> Problem<T, W> {
        let mut rng = Rng::new(seed);
        let (&n, leading) = shape.split_last().expect("a shape [..., n]");
        let rows = leading.iter().product();
        Problem {
            shape: shape.to_vec(),
            x: mixed_matrix(&mut rng, rows, n).into_iter().collect(),
            w: random_matrix(&mut rng, rows, n).into_iter().collect(),
            gamma: random_vec(&mut rng, n, 1.0, 0.5).to_vec(),
            beta: random_vec(&mut rng, n, 0.0, 0.5).to_vec(),
        }
    }

    fn n(&self) -> usize {
        *self.shape.last().unwrap()
    }

    /// x, gamma and beta as variables, and w, on `device`.
    fn tensors(&self, device: &candle_core::Device) -> (Var, Var, Var, Tensor) {
        let n = self.n();
        let x = Var::from_slice(&self.x, self.shape.as_slice(), device).unwrap();
        let gamma = Var::from_slice(&self.gamma, n, device).unwrap();
        let beta = Var::from_slice(&self.beta, n, device).unwrap();
        let w = Tensor::from_slice(&self.w, self.shape.as_slice(), device).unwrap();
        (x, gamma, beta, w)
    }
}

/// The norms, with what each returns: y, then the gradients of its variables.
#[derive(Clone, Copy, Debug)]
enum Norm {
    Layer,
    Rms,
}

impl Norm {
    fn outputs(self) -> &'static [&'static str] {
        match self {
            Norm::Layer => &["y", "dx", "dgamma", "dbeta"],
            Norm::Rms => &["y", "dx", "dgamma"],
        }
    }
}

/// A tensor's elements widened to f32 (exact for all three dtypes), after checking that its
/// dtype is `dtype`.
fn host(t: &Tensor, dtype: DType, what: &str) -> Vec<f32> {
    assert_eq!(t.dtype(), dtype, "{what}: dtype");
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// y, dx, dgamma, dbeta of `layer_norm` and candle's backward of sum(y * w), on the host;
/// y and dx of x's dtype, the weights' gradients of theirs.
fn by_layer_norm(x: &Var, gamma: &Var, beta: &Var, w: &Tensor) -> Vec<Vec<f32>> {
    let y = layer_norm(x.as_tensor(), gamma.as_tensor(), beta.as_tensor(), EPS).unwrap();
    let grads = (&y * w).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).expect("a gradient for every variable");
    let (t, weights) = (x.dtype(), gamma.dtype());
    vec![
        host(&y, t, "y"),
        host(grad(x), t, "dx"),
        host(grad(gamma), weights, "dgamma"),
        host(grad(beta), weights, "dbeta"),
    ]
}

/// The outputs of `norm` (see [`Norm::outputs`]) by this crate's candle op, on the host.
fn by_candle_op(norm: Norm, x: &Var, gamma: &Var, beta: &Var, w: &Tensor) -> Vec<Vec<f32>> {
    match norm {
        Norm::Layer => by_layer_norm(x, gamma, beta, w),
        Norm::Rms => {
            let y = rms_norm(x.as_tensor(), gamma.as_tensor(), EPS).unwrap();
            let grads = (&y * w).unwrap().sum_all().unwrap().backward().unwrap();
            let grad = |v: &Var| grads.get(v.as_tensor()).expect("a gradient for every variable");
            assert!(grads.get(beta.as_tensor()).is_none(), "RMSNorm has no beta");
            let t = x.dtype();
            vec![
                host(&y, t, "y"),
                host(grad(x), t, "dx"),
                host(grad(gamma), gamma.dtype(), "dgamma"),
            ]
        }
    }
}

/// The same as [`by_candle_op`] by candle's own ops and autograd, in f64 on the CPU from
/// the problem's (rounded) T values: the reference. RMSNorm is LayerNorm without the mean
/// and the bias: x / sqrt(mean(x^2) + eps) * gamma. With `dsum`, the loss also has
/// sum(x * dsum), so that dx has dsum added (x being s of a residual forward).
fn by_candle_ops<T: Element + WithDType, W: Element + WithDType>(
    norm: Norm,
    p: &Problem<T, W>,
    dsum: Option<&[T]>,
) -> Vec<Vec<f64>> {
    let cpu = candle_core::Device::Cpu;
    let f64s = |v: Vec<f64>, shape: &[usize]| Var::from_vec(v, shape, &cpu).unwrap();
    let (t, weights) = (
        |v: &[T]| v.iter().map(|e| e.to_f32() as f64).collect(),
        |v: &[W]| v.iter().map(|e| e.to_f32() as f64).collect(),
    );
    let n = p.n();
    let (x, gamma, beta) = (
        f64s(t(&p.x), &p.shape),
        f64s(weights(&p.gamma), &[n]),
        f64s(weights(&p.beta), &[n]),
    );
    let w = f64s(t(&p.w), &p.shape).into_inner();
    let centered = match norm {
        Norm::Layer => x.broadcast_sub(&x.mean_keepdim(D::Minus1).unwrap()).unwrap(),
        Norm::Rms => x.as_tensor().clone(),
    };
    let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let std = (var + EPS as f64).unwrap().sqrt().unwrap();
    let scaled = centered
        .broadcast_div(&std)
        .unwrap()
        .broadcast_mul(&gamma)
        .unwrap();
    let y = match norm {
        Norm::Layer => scaled.broadcast_add(&beta).unwrap(),
        Norm::Rms => scaled,
    };
    let mut loss = (&y * &w).unwrap().sum_all().unwrap();
    if let Some(dsum) = dsum {
        let dsum = f64s(t(dsum), &p.shape).into_inner();
        loss = (loss + (x.as_tensor() * dsum).unwrap().sum_all().unwrap()).unwrap();
    }
    let grads = loss.backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
    let mut outputs = vec![y, grad(&x), grad(&gamma)];
    if let Norm::Layer = norm {
        outputs.push(grad(&beta));
    }
    outputs
        .iter()
        .map(|t| t.flatten_all().unwrap().to_vec1().unwrap())
        .collect()
}

/// Each output of `p` within its dtype's tolerance of the reference (T's for y and dx, W's
/// for the weights' gradients; twice that for the gradients, as tests/backward.rs allows).
/// RMSNorm's dx error is measured against the size of its
/// terms, the largest rstd * |gamma * dy| (and the largest |dsum| where dx has a dsum
/// added), as tests/rms_norm.rs does: at n = 1 they cancel
/// to about eps / x^2 of that size, below what f32 resolves.
fn assert_near<T: Element + WithDType, W: Element + WithDType>(
    norm: Norm,
    p: &Problem<T, W>,
    dsum: Option<&[T]>,
    got: &[Vec<f32>],
    reference: &[Vec<f64>],
    what: &str,
) {
    assert_eq!(got.len(), norm.outputs().len(), "{what}: outputs");
    for (i, &name) in norm.outputs().iter().enumerate() {
        let tol = match i {
            0 => tolerance::<T>(),
            1 => 2.0 * tolerance::<T>(),
            _ => 2.0 * tolerance::<W>(),
        };
        let err = match (norm, name) {
            (Norm::Rms, "dx") => {
                let largest_diff = got[i]
                    .iter()
                    .zip(&reference[i])
                    .fold(0.0f64, |m, (&g, r)| m.max((g as f64 - r).abs()));
                let largest_dsum = dsum
                    .unwrap_or_default()
                    .iter()
                    .fold(0.0f64, |m, d| m.max(d.to_f32().abs() as f64));
                largest_diff / largest_rms_dx_term(p).max(largest_dsum)
            }
            _ => rel_err(ArrayView1::from(&got[i]), ArrayView1::from(&reference[i])),
        };
        assert!(err <= tol, "{what}: {name} relative error {err:e} > {tol:e}");
    }
}

/// The largest rstd * |gamma * dy| of `p` (dy = w), rstd of each row in f64.
fn largest_rms_dx_term<T: Element + WithDType, W: Element + WithDType>(p: &Problem<T, W>) -> f64 {
    let n = p.n();
    let f = |v: &T| v.to_f32() as f64;
    let mut largest = f64::MIN_POSITIVE;
    for (x, w) in p.x.chunks(n).zip(p.w.chunks(n)) {
        let rstd = 1.0 / (x.iter().map(|v| f(v) * f(v)).sum::<f64>() / n as f64 + EPS as f64).sqrt();
        for (g, d) in p.gamma.iter().zip(w) {
            largest = largest.max(rstd * (g.to_f32() as f64 * f(d)).abs());
        }
    }
    largest
}

/// The outputs of `norm` by this crate's own `LayerNorm` or `RmsNorm` on `device`, dy = w,
/// widened to f32.
fn by_this_crate<T: Element, W: Weight<T>>(
    norm: Norm,
    p: &Problem<T, W>,
    device: &layernorm_cuda::Device,
) -> Vec<Vec<f32>> {
    let up = |v: &[T]| device.upload(ArrayView1::from(v)).unwrap();
    let up_w = |v: &[W]| device.upload(ArrayView1::from(v)).unwrap();
    let (x, dy) = (
        up(&p.x).view(0, &p.shape).unwrap(),
        up(&p.w).view(0, &p.shape).unwrap(),
    );
    let (y, dx, weight_grads) = match norm {
        Norm::Layer => {
            let ln = layernorm_cuda::LayerNorm::<T, W>::new(up_w(&p.gamma), up_w(&p.beta), EPS).unwrap();
            let (y, ctx) = ln.forward(&x).unwrap();
            let g = ln.backward(&ctx, &dy).unwrap();
            (y, g.dx, vec![g.dgamma.unwrap(), g.dbeta.unwrap()])
        }
        Norm::Rms => {
            let rms = layernorm_cuda::RmsNorm::<T, W>::new(up_w(&p.gamma), EPS).unwrap();
            let (y, ctx) = rms.forward(&x).unwrap();
            let g = rms.backward(&ctx, &dy).unwrap();
            (y, g.dx, vec![g.dgamma.unwrap()])
        }
    };
    let widen = |v: Vec<_>| v.into_iter().map(|e: T| e.to_f32()).collect::<Vec<f32>>();
    let widen_w = |v: Vec<_>| v.into_iter().map(|e: W| e.to_f32()).collect::<Vec<f32>>();
    let mut outputs = vec![widen(y.to_vec().unwrap()), widen(dx.to_vec().unwrap())];
    outputs.extend(weight_grads.iter().map(|g| widen_w(g.to_vec().unwrap())));
    outputs
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|e| e.to_bits()).collect()
}

fn assert_bitwise(norm: Norm, got: &[Vec<f32>], expected: &[Vec<f32>], what: &str) {
    for (i, name) in norm.outputs().iter().enumerate() {
        assert_eq!(bits(&got[i]), bits(&expected[i]), "{what}: {name}");
    }
}

/// For each norm and shape, x of type T and weights of W: gradients near the candle-ops
/// reference, of the weights' dtype, and this crate's bits.
fn check_device<T: Element + WithDType, W: Weight<T> + WithDType>(
    candle: &candle_core::Device,
    ours: &layernorm_cuda::Device,
) {
    for norm in [Norm::Layer, Norm::Rms] {
        for (i, shape) in SHAPES.iter().enumerate() {
            let p = Problem::<T, W>::new(shape, 9000 + i as u64);
            let (x, gamma, beta, w) = p.tensors(candle);
            let got = by_candle_op(norm, &x, &gamma, &beta, &w);
            let what = format!(
                "{norm:?} {} with {} weights {shape:?} on {candle:?}",
                T::NAME,
                W::NAME
            );
            assert_near(norm, &p, None, &got, &by_candle_ops(norm, &p, None), &what);
            assert_bitwise(norm, &got, &by_this_crate(norm, &p, ours), &what);
        }
    }
}

/// Every dtype with weights of its own, and f16 and bf16 with f32 weights.
fn check_all_types(candle: &candle_core::Device, ours: &layernorm_cuda::Device) {
    check_device::<f32, f32>(candle, ours);
    check_device::<f16, f16>(candle, ours);
    check_device::<bf16, bf16>(candle, ours);
    check_device::<f16, f32>(candle, ours);
    check_device::<bf16, f32>(candle, ours);
}

#[test]
fn cpu_gradients_match_candle_ops_and_this_crates_cpu_path() {
    let (candle, ours) = (candle_core::Device::Cpu, layernorm_cuda::Device::cpu());
    check_all_types(&candle, &ours);
}

/// A strided x (a transpose, made contiguous by a copy) and an x at an offset in its
/// storage (rows of a larger variable, read where they lie) give the results of a
/// contiguous copy, and their gradients reach the variables they were taken from.
fn check_views(device: &candle_core::Device) {
    let p = Problem::<f32>::new(&[6, 77], 9100);
    let (x, gamma, beta, w) = p.tensors(device);
    let expected = by_layer_norm(&x, &gamma, &beta, &w);
    let what = format!("on {device:?}");

    // x^T as a variable [77, 6]; its transpose is p's x, strided.
    let xt = Var::from_tensor(&x.as_tensor().t().unwrap().contiguous().unwrap()).unwrap();
    let y = layer_norm(&xt.t().unwrap(), gamma.as_tensor(), beta.as_tensor(), EPS).unwrap();
    let grads = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let dxt = grads.get(xt.as_tensor()).unwrap();
    assert_eq!(dxt.dims(), &[77, 6], "{what}");
    assert_eq!(
        bits(&host(&y, DType::F32, &what)),
        bits(&expected[0]),
        "{what}: strided y"
    );
    assert_eq!(
        bits(&host(&dxt.t().unwrap(), DType::F32, &what)),
        bits(&expected[1]),
        "{what}: strided dx"
    );

    // Rows 4..10 of a variable [11, 77]: a contiguous x at an offset of 4 * 77 elements. The
    // kernels take a row in 16-byte packs where its address allows and element by element
    // where not, which sums in another order: an offset of 4 rows of 77 f32 keeps every
    // row's address modulo 16 that of the contiguous copy, so the bits must agree.
    let n = p.n();
    let (before, after) = (4, 1);
    let mut padded = vec![1000.0f32; before * n];
    padded.extend(&p.x);
    padded.extend(vec![-1000.0f32; after * n]);
    let big = Var::from_vec(padded, (before + 6 + after, n), device).unwrap();
    let y = layer_norm(
        &big.narrow(0, before, 6).unwrap(),
        gamma.as_tensor(),
        beta.as_tensor(),
        EPS,
    )
    .unwrap();
    let grads = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let dbig = host(grads.get(big.as_tensor()).unwrap(), DType::F32, &what);
    let view = before * n..(before + 6) * n;
    assert_eq!(
        bits(&host(&y, DType::F32, &what)),
        bits(&expected[0]),
        "{what}: offset y"
    );
    assert_eq!(bits(&dbig[view.clone()]), bits(&expected[1]), "{what}: offset dx");
    assert!(
        dbig[..view.start]
            .iter()
            .chain(&dbig[view.end..])
            .all(|&d| d == 0.0),
        "{what}: rows outside the view get no gradient"
    );
}

#[test]
fn cpu_strided_and_offset_inputs() {
    check_views(&candle_core::Device::Cpu);
}

/// The layers give the functions' bits, without variables (no graph) too, for bf16 x with
/// weights of `W`.
fn check_layers<W: Element + WithDType>() {
    let p = Problem::<bf16, W>::new(&[4, 96], 9200);
    let (x, gamma, beta, _) = p.tensors(&candle_core::Device::Cpu);
    let what = format!("bf16 x, {} weights", W::NAME);
    let layer = LayerNorm::new(gamma.as_detached_tensor(), beta.as_detached_tensor(), EPS).unwrap();
    assert_eq!(layer.eps(), EPS);
    assert_eq!(layer.weight().dims(), &[96]);
    let y = layer.forward(&x.as_detached_tensor()).unwrap();
    let direct = layer_norm(x.as_tensor(), layer.weight(), layer.bias(), EPS).unwrap();
    assert_eq!(
        bits(&host(&y, DType::BF16, &what)),
        bits(&host(&direct, DType::BF16, &what)),
        "{what}"
    );

    let layer = RmsNorm::new(gamma.as_detached_tensor(), EPS).unwrap();
    assert_eq!(layer.eps(), EPS);
    assert_eq!(layer.weight().dims(), &[96]);
    let y = layer.forward(&x.as_detached_tensor()).unwrap();
    let direct = rms_norm(x.as_tensor(), layer.weight(), EPS).unwrap();
    assert_eq!(
        bits(&host(&y, DType::BF16, &what)),
        bits(&host(&direct, DType::BF16, &what)),
        "{what}"
    );
}

#[test]
fn module_forward_is_the_function() {
    check_layers::<bf16>();
    check_layers::<f32>();
}

/// This crate's candle layer of a norm: LayerNorm and RmsNorm have the same calls, but no
/// trait in common but `Module`.
enum NormLayer {
    LayerNorm(LayerNorm),
    RmsNorm(RmsNorm),
}

impl NormLayer {
    /// `norm`'s layer over `weight` (LayerNorm's with `beta`), zero-centred or not.
    fn new(norm: Norm, weight: &Var, beta: &Var, zero_centered: bool) -> NormLayer {
        let weight = weight.as_tensor().clone();
        let layer = match norm {
            Norm::Layer => {
                let layer = LayerNorm::new(weight, beta.as_tensor().clone(), EPS).unwrap();
                NormLayer::LayerNorm(if zero_centered {
                    layer.with_zero_centered_weight()
                } else {
                    layer
                })
            }
            Norm::Rms => {
                let layer = RmsNorm::new(weight, EPS).unwrap();
                NormLayer::RmsNorm(if zero_centered {
                    layer.with_zero_centered_weight()
                } else {
                    layer
                })
            }
        };
        let zero_centered_weight = match &layer {
            NormLayer::LayerNorm(layer) => layer.zero_centered_weight(),
            NormLayer::RmsNorm(layer) => layer.zero_centered_weight(),
        };
        assert_eq!(zero_centered_weight, zero_centered);
        layer
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            NormLayer::LayerNorm(layer) => layer.forward(x),
            NormLayer::RmsNorm(layer) => layer.forward(x),
        }
        .unwrap()
    }

    fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> (Tensor, Tensor) {
        match self {
            NormLayer::LayerNorm(layer) => layer.forward_residual(x, residual),
            NormLayer::RmsNorm(layer) => layer.forward_residual(x, residual),
        }
        .unwrap()
    }
}

/// The `outputs` of `norm`'s layer with a zero-centred weight gamma - 1 have the bits of
/// the plain layer's with gamma, each of `names` (gamma in [0.5, 1.5], so gamma - 1 and
/// 1 + (gamma - 1) are exact). `outputs` gets the layer and its weight, and returns tensors
/// of any dtype; the plain layer's outputs are returned, on the host.
fn assert_zero_centered_as_plain<const K: usize>(
    norm: Norm,
    gamma: &Var,
    beta: &Var,
    names: [&str; K],
    what: &str,
    outputs: impl Fn(&NormLayer, &Var) -> [Tensor; K],
) -> [Vec<f32>; K] {
    let centered = Var::from_tensor(&(gamma.as_tensor() - 1.0).unwrap()).unwrap();
    let run = |weight: &Var, zero_centered: bool| {
        let layer = NormLayer::new(norm, weight, beta, zero_centered);
        outputs(&layer, weight).map(|t| host(&t, t.dtype(), what))
    };
    let (plain, zero_centered) = (run(gamma, false), run(&centered, true));
    for (i, name) in names.iter().enumerate() {
        assert_eq!(
            bits(&zero_centered[i]),
            bits(&plain[i]),
            "{norm:?} {what}: zero-centred {name}"
        );
    }
    plain
}

/// The layers with a zero-centred weight w - 1 give the bits of the plain layers with w,
/// forward and backward, and the gradient of the zero-centred weight is the plain weight's.
fn check_zero_centered<T: Element + WithDType, W: Element + WithDType>(device: &candle_core::Device) {
    let p = Problem::<T, W>::new(&[5, 96], 9300);
    let (x, gamma, beta, w) = p.tensors(device);
    let what = format!("{} x, {} weights on {device:?}", T::NAME, W::NAME);
    for norm in [Norm::Layer, Norm::Rms] {
        assert_zero_centered_as_plain(
            norm,
            &gamma,
            &beta,
            ["y", "dx", "dweight"],
            &what,
            |layer, weight| {
                let y = layer.forward(x.as_tensor());
                let grads = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let grad = |v: &Var| grads.get(v.as_tensor()).expect("a gradient").clone();
                [y, grad(&x), grad(weight)]
            },
        );
    }
}

fn check_zero_centered_all(device: &candle_core::Device) {
    check_zero_centered::<f32, f32>(device);
    check_zero_centered::<bf16, bf16>(device);
    check_zero_centered::<f16, f32>(device);
}

#[test]
fn cpu_zero_centered_layers() {
    check_zero_centered_all(&candle_core::Device::Cpu);
}

/// An empty problem: its shape, x of zeros, and gamma, beta and the loss's weights w of ones.
type EmptyProblem = ((usize, usize), Var, Var, Var, Tensor);

/// The empty problems: M = 0, and N = 0.
fn empty_problems(device: &candle_core::Device) -> [EmptyProblem; 2] {
    [(0, 5), (3, 0)].map(|shape| {
        // candle 0.11.1's `ones` launches its fill kernel with an empty grid for an empty
        // shape on CUDA, which the driver refuses; `zeros + 1` (no launch when empty) does not.
        let ones = |shape: &[usize]| (Tensor::zeros(shape, DType::F32, device).unwrap() + 1.0).unwrap();
        let x = Var::zeros(shape, DType::F32, device).unwrap();
        let gamma = Var::from_tensor(&ones(&[shape.1])).unwrap();
        let beta = Var::from_tensor(&ones(&[shape.1])).unwrap();
        (shape, x, gamma, beta, ones(&[shape.0, shape.1]))
    })
}

/// M = 0: empty y and dx, zero dgamma and dbeta (sums over no rows). N = 0: all empty.
fn check_empty(device: &candle_core::Device) {
    for (shape, x, gamma, beta, w) in empty_problems(device) {
        let n = shape.1;
        for norm in [Norm::Layer, Norm::Rms] {
            let outputs = by_candle_op(norm, &x, &gamma, &beta, &w);
            let what = format!("{norm:?} {shape:?} on {device:?}");
            assert!(outputs[0].is_empty() && outputs[1].is_empty(), "{what}");
            // dgamma and (LayerNorm's) dbeta: sums over no rows.
            for sums in &outputs[2..] {
                assert_eq!(sums, &vec![0.0; n], "{what}");
            }
        }
    }
}

#[test]
fn cpu_empty_inputs() {
    check_empty(&candle_core::Device::Cpu);
}

/// Which of y and s the loss after a residual forward uses: sum(y * w), sum(s * v) or their
/// sum. y's gradient is then w or zeros, and s's (dsum) v or none.
#[derive(Clone, Copy, Debug)]
enum Loss {
    Y,
    S,
    Both,
}

const LOSSES: [Loss; 3] = [Loss::Y, Loss::S, Loss::Both];

impl Norm {
    /// What a residual run returns: y, s, then the gradients of its variables.
    fn residual_outputs(self) -> &'static [&'static str] {
        match self {
            Norm::Layer => &["y", "s", "dx", "dresidual", "dgamma", "dbeta"],
            Norm::Rms => &["y", "s", "dx", "dresidual", "dgamma"],
        }
    }
}

/// A residual problem: p's x, weights and w (y's weight in the loss), a residual of x's
/// shape, and v (s's weight in the loss), the two of the stream's type R.
struct ResidualProblem<T, W = T, R = T> {
    p: Problem<T, W>,
    residual: Vec<R>,
    v: Vec<R>,
}

impl<T: Element + WithDType, W: Element + WithDType, R: Element + WithDType> ResidualProblem<T, W, R> {
    fn new(shape: &[usize], seed: u64) -> ResidualProblem<T, W, R> {
        let p = Problem::new(shape, seed);
        let mut rng = Rng::new(seed ^ 0x5eed);
        let (rows, n) = (p.x.len() / p.n(), p.n());
        ResidualProblem {
            residual: mixed_matrix(&mut rng, rows, n).into_iter().collect(),
            v: random_matrix(&mut rng, rows, n).into_iter().collect(),
            p,
        }
    }

    /// y's gradient and s's (dsum) under `loss`.
    fn dy_dsum(&self, loss: Loss) -> (Vec<T>, Option<&[R]>) {
        let dy = match loss {
            Loss::S => vec![T::from_f32(0.0); self.p.w.len()],
            Loss::Y | Loss::Both => self.p.w.clone(),
        };
        let dsum = match loss {
            Loss::Y => None,
            Loss::S | Loss::Both => Some(self.v.as_slice()),
        };
        (dy, dsum)
    }

    /// s as this crate forms it: each x + residual summed in f32 and rounded once to R.
    fn sum(&self) -> Vec<R> {
        let x = self.p.x.iter().zip(&self.residual);
        x.map(|(x, r)| R::from_f32(x.to_f32() + r.to_f32())).collect()
    }
}

impl<T: Element + WithDType, W: Element + WithDType> ResidualProblem<T, W> {
    /// The plain problem of normalizing s with y's gradient `dy`: the float64 reference's.
    fn at_sum(&self, dy: Vec<T>) -> Problem<T, W> {
        Problem {
            shape: self.p.shape.clone(),
            x: self.sum(),
            gamma: self.p.gamma.clone(),
            beta: self.p.beta.clone(),
            w: dy,
        }
    }
}

/// y, s and their loss's gradients, by the residual op of `norm` on candle tensors on
/// `device` and candle's backward of `loss`, on the host (see [`Norm::residual_outputs`]),
/// after checking that the residual's gradient is dx (rounded to x's dtype, where the stream
/// is wider), that y and s have x's shape, and that RMSNorm gives beta none.
fn by_candle_residual_op<T: Element + WithDType, W: Element + WithDType, R: Element + WithDType>(
    norm: Norm,
    rp: &ResidualProblem<T, W, R>,
    loss: Loss,
    device: &candle_core::Device,
) -> Vec<Vec<f32>> {
    let p = &rp.p;
    let (x, gamma, beta, w) = p.tensors(device);
    let residual = Var::from_slice(&rp.residual, p.shape.as_slice(), device).unwrap();
    let v = Tensor::from_slice(&rp.v, p.shape.as_slice(), device).unwrap();
    let (y, s) = match norm {
        Norm::Layer => layer_norm_residual(
            x.as_tensor(),
            residual.as_tensor(),
            gamma.as_tensor(),
            beta.as_tensor(),
            EPS,
        ),
        Norm::Rms => rms_norm_residual(x.as_tensor(), residual.as_tensor(), gamma.as_tensor(), EPS),
    }
    .unwrap();
    assert_eq!((y.dims(), s.dims()), (p.shape.as_slice(), p.shape.as_slice()));
    // Each term in f32: with the stream in f32, y's and s's dtypes differ.
    let term = |t: &Tensor, weight: &Tensor| {
        let sum = (t * weight).unwrap().sum_all().unwrap();
        sum.to_dtype(DType::F32).unwrap()
    };
    let loss = match loss {
        Loss::Y => term(&y, &w),
        Loss::S => term(&s, &v),
        Loss::Both => (term(&y, &w) + term(&s, &v)).unwrap(),
    };
    let grads = loss.backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).expect("a gradient for every variable");
    let (t, weights, stream) = (x.dtype(), gamma.dtype(), residual.dtype());
    let dx = host(grad(&x), t, "dx");
    let dresidual = host(grad(&residual), stream, "dresidual");
    let rounded: Vec<f32> = dresidual.iter().map(|&d| T::from_f32(d).to_f32()).collect();
    assert_eq!(dx, rounded, "x's gradient is the residual's in x's dtype");
    let mut outputs = vec![
        host(&y, t, "y"),
        host(&s, stream, "s"),
        dx,
        dresidual,
        host(grad(&gamma), weights, "dgamma"),
    ];
    match norm {
        Norm::Layer => outputs.push(host(grad(&beta), weights, "dbeta")),
        Norm::Rms => assert!(grads.get(beta.as_tensor()).is_none(), "RMSNorm has no beta"),
    }
    outputs
}

/// The same outputs by this crate's own `forward_residual` and `backward_residual` on
/// `device`, with y's gradient and dsum as `loss` makes them, widened to f32.
fn by_this_crate_residual<T: Element + WithDType, W: Weight<T> + WithDType>(
    norm: Norm,
    rp: &ResidualProblem<T, W>,
    loss: Loss,
    device: &layernorm_cuda::Device,
) -> Vec<Vec<f32>> {
    let p = &rp.p;
    let up = |v: &[T]| {
        let t = device.upload(ArrayView1::from(v)).unwrap();
        t.view(0, &p.shape).unwrap()
    };
    let up_w = |v: &[W]| device.upload(ArrayView1::from(v)).unwrap();
    let (dy, dsum) = rp.dy_dsum(loss);
    let (x, residual, dy, dsum) = (up(&p.x), up(&rp.residual), up(&dy), dsum.map(up));
    let (y, s, dx, weight_grads) = match norm {
        Norm::Layer => {
            let ln = layernorm_cuda::LayerNorm::<T, W>::new(up_w(&p.gamma), up_w(&p.beta), EPS).unwrap();
            let (y, s, ctx) = ln.forward_residual(&x, &residual).unwrap();
            let g = ln.backward_residual(&ctx, &dy, dsum.as_ref()).unwrap();
            (y, s, g.dx, vec![g.dgamma.unwrap(), g.dbeta.unwrap()])
        }
        Norm::Rms => {
            let rms = layernorm_cuda::RmsNorm::<T, W>::new(up_w(&p.gamma), EPS).unwrap();
            let (y, s, ctx) = rms.forward_residual(&x, &residual).unwrap();
            let g = rms.backward_residual(&ctx, &dy, dsum.as_ref()).unwrap();
            (y, s, g.dx, vec![g.dgamma.unwrap()])
        }
    };
    let widen = |t: layernorm_cuda::Tensor<T>| t.to_vec().unwrap().into_iter().map(T::to_f32).collect();
    let widen_w = |t: &layernorm_cuda::Tensor<W>| t.to_vec().unwrap().into_iter().map(W::to_f32).collect();
    let dx: Vec<f32> = widen(dx);
    let mut outputs: Vec<Vec<f32>> = vec![widen(y), widen(s), dx.clone(), dx];
    outputs.extend(weight_grads.iter().map(widen_w));
    outputs
}

/// The same outputs by this crate's own `forward_residual_f32` and `backward_residual_f32`
/// on `device` (the stream in f32), widened to f32.
fn by_this_crate_f32_stream<T: F32Stream + WithDType, W: Weight<T> + WithDType>(
    norm: Norm,
    rp: &ResidualProblem<T, W, f32>,
    loss: Loss,
    device: &layernorm_cuda::Device,
) -> Vec<Vec<f32>> {
    let p = &rp.p;
    let up = |v: &[T]| {
        device
            .upload(ArrayView1::from(v))
            .unwrap()
            .view(0, &p.shape)
            .unwrap()
    };
    let up_f32 = |v: &[f32]| {
        device
            .upload(ArrayView1::from(v))
            .unwrap()
            .view(0, &p.shape)
            .unwrap()
    };
    let up_w = |v: &[W]| device.upload(ArrayView1::from(v)).unwrap();
    let (dy, dsum) = rp.dy_dsum(loss);
    let (x, residual, dy, dsum) = (up(&p.x), up_f32(&rp.residual), up(&dy), dsum.map(up_f32));
    let (y, s, (g, d_residual)) = match norm {
        Norm::Layer => {
            let ln = layernorm_cuda::LayerNorm::<T, W>::new(up_w(&p.gamma), up_w(&p.beta), EPS).unwrap();
            let (y, s, ctx) = ln.forward_residual_f32(&x, &residual).unwrap();
            (y, s, ln.backward_residual_f32(&ctx, &dy, dsum.as_ref()).unwrap())
        }
        Norm::Rms => {
            let rms = layernorm_cuda::RmsNorm::<T, W>::new(up_w(&p.gamma), EPS).unwrap();
            let (y, s, ctx) = rms.forward_residual_f32(&x, &residual).unwrap();
            (y, s, rms.backward_residual_f32(&ctx, &dy, dsum.as_ref()).unwrap())
        }
    };
    let widen = |t: layernorm_cuda::Tensor<T>| t.to_vec().unwrap().into_iter().map(T::to_f32).collect();
    let widen_w = |t: layernorm_cuda::Tensor<W>| t.to_vec().unwrap().into_iter().map(W::to_f32).collect();
    let mut outputs: Vec<Vec<f32>> = vec![
        widen(y),
        s.to_vec().unwrap(),
        widen(g.dx),
        d_residual.to_vec().unwrap(),
    ];
    outputs.extend(g.dgamma.into_iter().chain(g.dbeta).map(widen_w));
    outputs
}

/// Asserts the candle op's residual outputs are this crate's own (run on `ours`): to the
/// bit, gradients to the value (candle adds each gradient to zeros, which makes a -0 a +0).
/// One exception, on the GPU: the op's LayerNorm takes beta n elements past gamma in one
/// `[2, n]` tensor, which is not 16-byte aligned where n weights are not a multiple of 16
/// bytes; the kernels then take a row's unaligned path, whose sums round in another order.
/// There y, dx, the residual's gradient and the weights' are held to the dtypes' tolerance
/// (as against the reference), and s, formed before any sum, to the bit.
fn assert_same_residual_outputs<T: Element, W: Element>(
    norm: Norm,
    n: usize,
    ours: &layernorm_cuda::Device,
    got: &[Vec<f32>],
    expected: &[Vec<f32>],
    what: &str,
) {
    let unaligned_beta = matches!(norm, Norm::Layer) && !(n * size_of::<W>()).is_multiple_of(16);
    let tolerant = unaligned_beta && ours.cuda_stream().is_some();
    for (k, &name) in norm.residual_outputs().iter().enumerate() {
        match name {
            "s" => assert_eq!(bits(&got[k]), bits(&expected[k]), "{what}: s"),
            _ if tolerant => {
                let bound = match name {
                    "dgamma" | "dbeta" => tolerance::<W>(),
                    _ => tolerance::<T>(),
                };
                for (j, (&a, &b)) in got[k].iter().zip(&expected[k]).enumerate() {
                    let diff = (a as f64 - b as f64).abs();
                    assert!(
                        diff <= bound * (b as f64).abs().max(1.0),
                        "{what}: {name}[{j}] {a} against {b}"
                    );
                }
            }
            "y" => assert_eq!(bits(&got[k]), bits(&expected[k]), "{what}: y"),
            _ => assert_eq!(got[k], expected[k], "{what}: {name}"),
        }
    }
}

/// Runs `check(norm, problem, loss, what)` for each norm, shape (of [`SHAPES`]) and loss, on
/// residual problems of x of T, weights of W and the stream of R, seeded from `seed`.
fn each_residual_case<T: Element + WithDType, W: Element + WithDType, R: Element + WithDType>(
    seed: u64,
    candle: &candle_core::Device,
    mut check: impl FnMut(Norm, &ResidualProblem<T, W, R>, Loss, &str),
) {
    for norm in [Norm::Layer, Norm::Rms] {
        for (i, shape) in SHAPES.iter().enumerate() {
            let rp = ResidualProblem::<T, W, R>::new(shape, seed + i as u64);
            for loss in LOSSES {
                let what = format!(
                    "{norm:?}, stream of {}, loss of {loss:?}, {} with {} weights {shape:?} on {candle:?}",
                    R::NAME,
                    T::NAME,
                    W::NAME
                );
                check(norm, &rp, loss, &what);
            }
        }
    }
}

/// For each norm, shape and loss, x of type T and weights of W: s is x + residual rounded
/// once, to the bit; y, dx and the weights' gradients are near the float64 reference of the
/// norm at s (dx with dsum added where the loss has s); and every output is this crate's
/// own residual op's (see [`assert_same_residual_outputs`]). Where the loss has only y,
/// neither backward is given a dsum.
fn check_residual_device<T: Element + WithDType, W: Weight<T> + WithDType>(
    candle: &candle_core::Device,
    ours: &layernorm_cuda::Device,
) {
    each_residual_case::<T, W, T>(9400, candle, |norm, rp, loss, what| {
        let got = by_candle_residual_op(norm, rp, loss, candle);
        let sum: Vec<f32> = rp.sum().into_iter().map(T::to_f32).collect();
        assert_eq!(bits(&got[1]), bits(&sum), "{what}: s");

        let (dy, dsum) = rp.dy_dsum(loss);
        let at_sum = rp.at_sum(dy);
        // The plain op's outputs: all but s and the residual's gradient (dx).
        let names = norm.residual_outputs().iter();
        let plain: Vec<Vec<f32>> = (names.zip(&got))
            .filter(|(name, _)| !matches!(**name, "s" | "dresidual"))
            .map(|(_, output)| output.clone())
            .collect();
        let reference = by_candle_ops(norm, &at_sum, dsum);
        assert_near(norm, &at_sum, dsum, &plain, &reference, what);

        let expected = by_this_crate_residual(norm, rp, loss, ours);
        assert_same_residual_outputs::<T, W>(norm, rp.p.n(), ours, &got, &expected, what);
    });
}

/// Every dtype with weights of its own, and f16 and bf16 with f32 weights.
fn check_residual_all_types(candle: &candle_core::Device, ours: &layernorm_cuda::Device) {
    check_residual_device::<f32, f32>(candle, ours);
    check_residual_device::<f16, f16>(candle, ours);
    check_residual_device::<bf16, bf16>(candle, ours);
    check_residual_device::<f16, f32>(candle, ours);
    check_residual_device::<bf16, f32>(candle, ours);
}

/// For each norm, shape and loss, f16 or bf16 x with weights of W and the residual stream
/// in f32: s is x + residual in f32 (not rounded), to the bit; and y, s, dx, the residual's
/// gradient (dx unrounded, in f32) and the weights' gradients are this crate's own
/// `forward_residual_f32` and `backward_residual_f32`'s on the same device (see
/// [`assert_same_residual_outputs`]), which tests/residual.rs holds to the float64
/// reference.
fn check_f32_stream_device<T: F32Stream + WithDType, W: Weight<T> + WithDType>(
    candle: &candle_core::Device,
    ours: &layernorm_cuda::Device,
) {
    each_residual_case::<T, W, f32>(9450, candle, |norm, rp, loss, what| {
        let got = by_candle_residual_op(norm, rp, loss, candle);
        assert_eq!(bits(&got[1]), bits(&rp.sum()), "{what}: s");
        let expected = by_this_crate_f32_stream(norm, rp, loss, ours);
        assert_same_residual_outputs::<T, W>(norm, rp.p.n(), ours, &got, &expected, what);
    });
}

/// f16 and bf16 x, with weights of their own dtype and with f32 weights.
fn check_f32_stream_all_types(candle: &candle_core::Device, ours: &layernorm_cuda::Device) {
    check_f32_stream_device::<f16, f16>(candle, ours);
    check_f32_stream_device::<bf16, bf16>(candle, ours);
    check_f32_stream_device::<f16, f32>(candle, ours);
    check_f32_stream_device::<bf16, f32>(candle, ours);
}

#[test]
fn cpu_f32_stream_matches_this_crates_cpu_path() {
    let (candle, ours) = (candle_core::Device::Cpu, layernorm_cuda::Device::cpu());
    check_f32_stream_all_types(&candle, &ours);
}

#[test]
fn cpu_residual_matches_candle_ops_and_this_crates_cpu_path() {
    let (candle, ours) = (candle_core::Device::Cpu, layernorm_cuda::Device::cpu());
    check_residual_all_types(&candle, &ours);
}

/// A strided residual (a transpose) and an x at an offset in its storage give the results
/// of contiguous ones, and their gradients reach the variables they were taken from.
fn check_residual_views(device: &candle_core::Device) {
    let rp = ResidualProblem::<f32>::new(&[6, 77], 9500);
    let expected = by_candle_residual_op(Norm::Layer, &rp, Loss::Both, device);
    let what = format!("on {device:?}");
    let (_, gamma, beta, w) = rp.p.tensors(device);
    let v = Tensor::from_slice(&rp.v, (6, 77), device).unwrap();

    // The residual^T as a variable [77, 6]; x as rows 4..10 of a variable [11, 77].
    let residual = Tensor::from_slice(&rp.residual, (6, 77), device).unwrap();
    let residual_t = Var::from_tensor(&residual.t().unwrap().contiguous().unwrap()).unwrap();
    let n = rp.p.n();
    let mut padded = vec![1000.0f32; 4 * n];
    padded.extend(&rp.p.x);
    padded.extend(vec![-1000.0f32; n]);
    let big = Var::from_vec(padded, (11, n), device).unwrap();
    let (y, s) = layer_norm_residual(
        &big.narrow(0, 4, 6).unwrap(),
        &residual_t.t().unwrap(),
        gamma.as_tensor(),
        beta.as_tensor(),
        EPS,
    )
    .unwrap();
    let loss = ((&y * &w).unwrap().sum_all().unwrap() + (&s * &v).unwrap().sum_all().unwrap()).unwrap();
    let grads = loss.backward().unwrap();
    let dbig = host(grads.get(big.as_tensor()).unwrap(), DType::F32, &what);
    let dresidual_t = grads.get(residual_t.as_tensor()).unwrap().t().unwrap();
    let rows = 4 * n..10 * n;
    for (name, got, expected) in [
        ("y", host(&y, DType::F32, &what), &expected[0]),
        ("s", host(&s, DType::F32, &what), &expected[1]),
        ("dx", dbig[rows.clone()].to_vec(), &expected[2]),
        ("dresidual", host(&dresidual_t, DType::F32, &what), &expected[2]),
    ] {
        assert_eq!(bits(&got), bits(expected), "{what}: {name}");
    }
    assert!(
        dbig[..rows.start]
            .iter()
            .chain(&dbig[rows.end..])
            .all(|&d| d == 0.0),
        "{what}: rows outside the view get no gradient"
    );
}

#[test]
fn cpu_residual_strided_and_offset_inputs() {
    check_residual_views(&candle_core::Device::Cpu);
}

/// The layers' `forward_residual` gives the functions' bits; with a zero-centred weight
/// w - 1, the plain layers' bits with w (y, s and the gradients of x, the residual and the
/// weight, the loss on y and s), as [`check_zero_centered`] checks the plain forward.
fn check_residual_layers<T: Element + WithDType, W: Element + WithDType>(device: &candle_core::Device) {
    let rp = ResidualProblem::<T, W>::new(&[5, 96], 9600);
    let (x, gamma, beta, w) = rp.p.tensors(device);
    let residual = Var::from_slice(&rp.residual, (5, 96), device).unwrap();
    let v = Tensor::from_slice(&rp.v, (5, 96), device).unwrap();
    let what = format!("{} x, {} weights on {device:?}", T::NAME, W::NAME);
    let to_host = |t: &Tensor| host(t, t.dtype(), &what);
    let (x, r) = (x.as_tensor(), residual.as_tensor());
    for norm in [Norm::Layer, Norm::Rms] {
        let names = ["y", "s", "dx", "dresidual", "dweight"];
        let plain = assert_zero_centered_as_plain(norm, &gamma, &beta, names, &what, |layer, weight| {
            let (y, s) = layer.forward_residual(x, r);
            let loss =
                ((&y * &w).unwrap().sum_all().unwrap() + (&s * &v).unwrap().sum_all().unwrap()).unwrap();
            let grads = loss.backward().unwrap();
            let grad = |t: &Tensor| grads.get(t).expect("a gradient").clone();
            [y, s, grad(x), grad(r), grad(weight.as_tensor())]
        });
        let (y, s) = match norm {
            Norm::Layer => layer_norm_residual(x, r, gamma.as_tensor(), beta.as_tensor(), EPS),
            Norm::Rms => rms_norm_residual(x, r, gamma.as_tensor(), EPS),
        }
        .unwrap();
        assert_eq!(bits(&plain[0]), bits(&to_host(&y)), "{norm:?} {what}: layer y");
        assert_eq!(bits(&plain[1]), bits(&to_host(&s)), "{norm:?} {what}: layer s");
    }
}

fn check_residual_layers_all(device: &candle_core::Device) {
    check_residual_layers::<f32, f32>(device);
    check_residual_layers::<bf16, bf16>(device);
    check_residual_layers::<f16, f32>(device);
}

#[test]
fn cpu_residual_layers() {
    check_residual_layers_all(&candle_core::Device::Cpu);
}

/// M = 0: empty y, s, dx and dresidual, zero dgamma and dbeta. N = 0: all empty.
fn check_residual_empty(device: &candle_core::Device) {
    for (shape, x, gamma, beta, w) in empty_problems(device) {
        let n = shape.1;
        let residual = Var::zeros(shape, DType::F32, device).unwrap();
        for norm in [Norm::Layer, Norm::Rms] {
            let what = format!("{norm:?} residual {shape:?} on {device:?}");
            let (x, r, g) = (x.as_tensor(), residual.as_tensor(), gamma.as_tensor());
            let (y, s) = match norm {
                Norm::Layer => layer_norm_residual(x, r, g, beta.as_tensor(), EPS),
                Norm::Rms => rms_norm_residual(x, r, g, EPS),
            }
            .unwrap();
            let loss =
                ((&y * &w).unwrap().sum_all().unwrap() + (&s * &w).unwrap().sum_all().unwrap()).unwrap();
            let grads = loss.backward().unwrap();
            let grad = |t: &Tensor| host(grads.get(t).expect("a gradient"), DType::F32, &what);
            assert_eq!(y.dims(), &[shape.0, shape.1], "{what}");
            assert_eq!(s.dims(), &[shape.0, shape.1], "{what}");
            assert!(grad(x).is_empty() && grad(r).is_empty(), "{what}");
            assert_eq!(grad(g), vec![0.0; n], "{what}: dgamma");
            if let Norm::Layer = norm {
                assert_eq!(grad(beta.as_tensor()), vec![0.0; n], "{what}: dbeta");
            }
        }
    }
}

#[test]
fn cpu_residual_empty_inputs() {
    check_residual_empty(&candle_core::Device::Cpu);
}

/// candle's error inside any backtrace wrapper.
fn bare(e: &Error) -> &Error {
    match e {
        Error::WithBacktrace { inner, .. } => bare(inner),
        e => e,
    }
}

#[test]
fn refusals_are_typed_candle_errors() {
    let cpu = candle_core::Device::Cpu;
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &cpu).unwrap();
    let (x, w) = (t(&[2, 4], DType::F32), t(&[4], DType::F32));

    let e = layer_norm(&t(&[2, 4], DType::F64), &w, &w, EPS).unwrap_err();
    assert!(
        matches!(bare(&e), Error::UnsupportedDTypeForOp(DType::F64, _)),
        "{e}"
    );

    let e = layer_norm(&x, &t(&[4], DType::F16), &w, EPS).unwrap_err();
    assert!(
        matches!(
            bare(&e),
            Error::DTypeMismatchBinaryOp {
                lhs: DType::F32,
                rhs: DType::F16,
                ..
            }
        ),
        "{e}"
    );

    // f32 weights go with f16 and bf16 x, but not f16 weights with bf16 x, nor gamma and
    // beta of different dtypes.
    let (xh, wh) = (t(&[2, 4], DType::BF16), t(&[4], DType::F16));
    let e = layer_norm(&xh, &wh, &wh, EPS).unwrap_err();
    assert!(
        matches!(
            bare(&e),
            Error::DTypeMismatchBinaryOp {
                lhs: DType::BF16,
                rhs: DType::F16,
                ..
            }
        ),
        "{e}"
    );
    let e = layer_norm(&xh, &w, &t(&[4], DType::BF16), EPS).unwrap_err();
    assert!(
        matches!(
            bare(&e),
            Error::DTypeMismatchBinaryOp {
                lhs: DType::F32,
                rhs: DType::BF16,
                ..
            }
        ),
        "{e}"
    );

    let e = layer_norm(&x, &w, &t(&[5], DType::F32), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::UnexpectedShape { .. }), "{e}");
    assert!(e.to_string().contains("beta"), "{e}");

    let scalar = Tensor::new(1.0f32, &cpu).unwrap();
    let e = layer_norm(&scalar, &w, &w, EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DimOutOfRange { .. }), "{e}");

    for eps in [0.0, -1e-5, f32::NAN, f32::INFINITY] {
        let e = layer_norm(&x, &w, &w, eps).unwrap_err();
        assert!(
            matches!(as_layernorm_error(&e), Some(layernorm_cuda::Error::BadEps(_))),
            "eps {eps}: {e}"
        );
        let e = LayerNorm::new(w.clone(), w.clone(), eps).unwrap_err();
        assert!(
            matches!(as_layernorm_error(&e), Some(layernorm_cuda::Error::BadEps(_))),
            "eps {eps}: {e}"
        );
    }
    // candle's own errors hold none of this crate's.
    assert!(as_layernorm_error(&layer_norm(&scalar, &w, &w, EPS).unwrap_err()).is_none());

    let e = LayerNorm::new(t(&[2, 4], DType::F32), w.clone(), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::UnexpectedNumberOfDims { .. }), "{e}");
    let e = LayerNorm::new(w.clone(), t(&[4], DType::BF16), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DTypeMismatchBinaryOp { .. }), "{e}");
}

/// rms_norm and its layer refuse what layer_norm refuses, naming themselves.
#[test]
fn rms_norm_refusals_are_typed_candle_errors() {
    let cpu = candle_core::Device::Cpu;
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &cpu).unwrap();
    let (x, w) = (t(&[2, 4], DType::F32), t(&[4], DType::F32));

    let e = rms_norm(&t(&[2, 4], DType::F64), &w, EPS).unwrap_err();
    assert!(
        matches!(bare(&e), Error::UnsupportedDTypeForOp(DType::F64, op) if op.contains("rms_norm")),
        "{e}"
    );
    let e = rms_norm(&x, &t(&[4], DType::BF16), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DTypeMismatchBinaryOp { .. }), "{e}");
    let e = rms_norm(&t(&[2, 4], DType::F16), &t(&[4], DType::BF16), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DTypeMismatchBinaryOp { .. }), "{e}");
    let e = rms_norm(&x, &t(&[5], DType::F32), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::UnexpectedShape { .. }), "{e}");
    assert!(e.to_string().contains("gamma"), "{e}");
    let e = rms_norm(&Tensor::new(1.0f32, &cpu).unwrap(), &w, EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DimOutOfRange { .. }), "{e}");
    for eps in [0.0, f32::NAN] {
        for e in [
            rms_norm(&x, &w, eps).unwrap_err(),
            RmsNorm::new(w.clone(), eps).unwrap_err(),
        ] {
            assert!(
                matches!(as_layernorm_error(&e), Some(layernorm_cuda::Error::BadEps(_))),
                "eps {eps}: {e}"
            );
        }
    }
    let e = RmsNorm::new(t(&[2, 4], DType::F32), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::UnexpectedNumberOfDims { .. }), "{e}");
}

/// The residual functions and the layers' `forward_residual` refuse a residual of another
/// shape or dtype than x's, and what the plain functions refuse.
#[test]
fn residual_refusals_are_typed_candle_errors() {
    let cpu = candle_core::Device::Cpu;
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &cpu).unwrap();
    let (x, w) = (t(&[2, 4], DType::F32), t(&[4], DType::F32));
    let layer = LayerNorm::new(w.clone(), w.clone(), EPS).unwrap();
    let rms_layer = RmsNorm::new(w.clone(), EPS).unwrap();
    // All four forms with x and a residual; the functions with gamma, beta and eps too.
    let all = |x: &Tensor, residual: &Tensor| {
        [
            layer_norm_residual(x, residual, &w, &w, EPS).map(|_| ()),
            rms_norm_residual(x, residual, &w, EPS).map(|_| ()),
            layer.forward_residual(x, residual).map(|_| ()),
            rms_layer.forward_residual(x, residual).map(|_| ()),
        ]
    };

    for shape in [&[2, 5][..], &[4, 2], &[8], &[1, 2, 4]] {
        for result in all(&x, &t(shape, DType::F32)) {
            let e = result.unwrap_err();
            assert!(
                matches!(bare(&e), Error::ShapeMismatchBinaryOp { lhs, rhs, op }
                    if lhs.dims() == [2, 4] && rhs.dims() == shape && op.contains("residual")),
                "{shape:?}: {e}"
            );
        }
    }
    for dtype in [DType::F16, DType::BF16, DType::F64] {
        for result in all(&x, &t(&[2, 4], dtype)) {
            let e = result.unwrap_err();
            assert!(
                matches!(bare(&e), Error::DTypeMismatchBinaryOp { lhs: DType::F32, rhs, .. } if *rhs == dtype),
                "{dtype:?}: {e}"
            );
        }
    }
    // f32 weights beside bf16 x and residual are taken, and so is an f32 residual beside
    // bf16 x (the stream in f32); a residual of another 16-bit dtype than x's is refused.
    let (xh, rh) = (t(&[2, 4], DType::BF16), t(&[2, 4], DType::BF16));
    assert!(all(&xh, &rh).iter().all(Result::is_ok));
    assert!(all(&xh, &x).iter().all(Result::is_ok));
    for result in all(&xh, &t(&[2, 4], DType::F16)) {
        let e = result.unwrap_err();
        assert!(
            matches!(
                bare(&e),
                Error::DTypeMismatchBinaryOp {
                    lhs: DType::BF16,
                    rhs: DType::F16,
                    ..
                }
            ),
            "{e}"
        );
    }

    // The plain functions' refusals.
    let e = layer_norm_residual(&x, &x, &w, &t(&[5], DType::F32), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::UnexpectedShape { .. }), "{e}");
    assert!(e.to_string().contains("beta"), "{e}");
    let e = rms_norm_residual(&x, &x, &t(&[4], DType::F16), EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DTypeMismatchBinaryOp { .. }), "{e}");
    let (x64, r64) = (t(&[2, 4], DType::F64), t(&[2, 4], DType::F64));
    let e = layer_norm_residual(&x64, &r64, &w, &w, EPS).unwrap_err();
    assert!(
        matches!(bare(&e), Error::UnsupportedDTypeForOp(DType::F64, _)),
        "{e}"
    );
    let scalar = Tensor::new(1.0f32, &cpu).unwrap();
    let e = rms_norm_residual(&scalar, &scalar, &w, EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DimOutOfRange { .. }), "{e}");
    for eps in [0.0, f32::NAN] {
        for e in [
            layer_norm_residual(&x, &x, &w, &w, eps).unwrap_err(),
            rms_norm_residual(&x, &x, &w, eps).unwrap_err(),
        ] {
            assert!(
                matches!(as_layernorm_error(&e), Some(layernorm_cuda::Error::BadEps(_))),
                "eps {eps}: {e}"
            );
        }
    }
}

/// candle's CUDA device 0 where a GPU is (the rule of `common::gpu_or_skip`), with this
/// crate's device on it for the bitwise comparison.
#[cfg(feature = "candle-cuda")]
fn candle_gpu_or_skip() -> Option<(candle_core::Device, layernorm_cuda::Device)> {
    let ours = common::gpu_or_skip()?;
    Some((
        candle_core::Device::new_cuda(0).expect("candle's CUDA device 0"),
        ours,
    ))
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_gradients_match_candle_ops_and_this_crates_kernels() {
    let Some((candle, ours)) = candle_gpu_or_skip() else {
        return;
    };
    check_all_types(&candle, &ours);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_strided_and_offset_inputs() {
    let Some((candle, _)) = candle_gpu_or_skip() else {
        return;
    };
    check_views(&candle);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_empty_inputs() {
    let Some((candle, _)) = candle_gpu_or_skip() else {
        return;
    };
    check_empty(&candle);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_zero_centered_layers() {
    let Some((candle, _)) = candle_gpu_or_skip() else {
        return;
    };
    check_zero_centered_all(&candle);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_residual_matches_candle_ops_and_this_crates_kernels() {
    let Some((candle, ours)) = candle_gpu_or_skip() else {
        return;
    };
    check_residual_all_types(&candle, &ours);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_f32_stream_matches_this_crates_kernels() {
    let Some((candle, ours)) = candle_gpu_or_skip() else {
        return;
    };
    check_f32_stream_all_types(&candle, &ours);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_residual_strided_and_offset_inputs() {
    let Some((candle, _)) = candle_gpu_or_skip() else {
        return;
    };
    check_residual_views(&candle);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_residual_layers() {
    let Some((candle, _)) = candle_gpu_or_skip() else {
        return;
    };
    check_residual_layers_all(&candle);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_residual_empty_inputs() {
    let Some((candle, _)) = candle_gpu_or_skip() else {
        return;
    };
    check_residual_empty(&candle);
}

/// A CPU tensor beside a CUDA one is candle's device mismatch, not a panic.
#[cfg(feature = "candle-cuda")]
#[test]
fn gpu_mixed_devices_are_refused() {
    let Some((candle, _)) = candle_gpu_or_skip() else {
        return;
    };
    let x = Tensor::zeros((2, 4), DType::F32, &candle).unwrap();
    let w = Tensor::ones(4, DType::F32, &candle_core::Device::Cpu).unwrap();
    let e = layer_norm(&x, &w, &w, EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DeviceMismatchBinaryOp { .. }), "{e}");
    let e = rms_norm(&x, &w, EPS).unwrap_err();
    assert!(matches!(bare(&e), Error::DeviceMismatchBinaryOp { .. }), "{e}");
    let cpu_x = Tensor::zeros((2, 4), DType::F32, &candle_core::Device::Cpu).unwrap();
    for (x, residual) in [(&x, &cpu_x), (&cpu_x, &x)] {
        let e = layer_norm_residual(x, residual, &w, &w, EPS).unwrap_err();
        assert!(matches!(bare(&e), Error::DeviceMismatchBinaryOp { .. }), "{e}");
        let e = rms_norm_residual(x, residual, &w, EPS).unwrap_err();
        assert!(matches!(bare(&e), Error::DeviceMismatchBinaryOp { .. }), "{e}");
    }
}
