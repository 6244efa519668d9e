//! cudarc interop: a `Device` on a caller's stream, tensors over a caller's `CudaSlice`
//! (and back), and forward/backward on borrowed memory, all bitwise equal to the upload
//! path, with cudarc's event tracking on and off in the caller's context; memory of another
//! context is a typed error. The CPU checks run everywhere, the rest where a GPU is.

mod common;

use std::sync::Arc;

use common::{Rng, gpu_or_skip, mixed_matrix, random_matrix, random_vec};
use layernorm_cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use layernorm_cuda::{
    BorrowedGradients, BorrowedTensor, BorrowedTensorMut, Device, Error, LayerNorm, RmsNorm, Tensor, bf16,
};
use ndarray::{Array1, Array2};

/// x `[2, 3, n]`, dy, gamma and beta as host vectors.
struct Problem {
    shape: Vec<usize>,
    x: Vec<f32>,
    dy: Vec<f32>,
    gamma: Array1<f32>,
    beta: Array1<f32>,
}

impl Problem {
    fn new(n: usize, seed: u64) -> Problem {
        let mut rng = Rng::new(seed);
        let rows = 6;
        let x: Array2<f32> = mixed_matrix(&mut rng, rows, n);
        let dy: Array2<f32> = random_matrix(&mut rng, rows, n);
        Problem {
            shape: vec![2, 3, n],
            x: x.into_iter().collect(),
            dy: dy.into_iter().collect(),
            gamma: random_vec(&mut rng, n, 1.0, 0.5),
            beta: random_vec(&mut rng, n, 0.0, 0.5),
        }
    }

    fn op(&self, device: &Device) -> LayerNorm<f32> {
        LayerNorm::from_arrays(device, self.gamma.view(), self.beta.view(), 1e-5).unwrap()
    }

    /// y, dx, dgamma, dbeta by the upload path on `device`.
    fn by_upload(&self, device: &Device) -> [Vec<f32>; 4] {
        let ln = self.op(device);
        let up = |v: &[f32]| {
            device
                .upload(ndarray::ArrayView1::from(v))
                .unwrap()
                .view(0, &self.shape)
                .unwrap()
        };
        let (y, ctx) = ln.forward(&up(&self.x)).unwrap();
        let g = ln.backward(&ctx, &up(&self.dy)).unwrap();
        [
            y.to_vec().unwrap(),
            g.dx.to_vec().unwrap(),
            g.dgamma.unwrap().to_vec().unwrap(),
            g.dbeta.unwrap().to_vec().unwrap(),
        ]
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// A stream of a context of this test's own, as a program using cudarc would have, with
/// cudarc's event tracking on (its default) or off.
fn callers_stream(tracking: bool) -> Arc<CudaStream> {
    let ctx = CudaContext::new(0).unwrap();
    if !tracking {
        // SAFETY: every slice of this context is used on its one stream, or handed to
        // layernorm-cuda, whose storage orders its uses across streams.
        unsafe { ctx.disable_event_tracking() };
    }
    ctx.new_stream().unwrap()
}

/// Row lengths: whole packs (the packed kernels) and not.
const NS: [usize; 2] = [64, 77];

/// Tensors over the caller's slices (taken without a copy, given back as slices) give the
/// upload path's bits, and the slices given back hold them.
#[test]
fn gpu_tensors_over_callers_slices_match_upload_path_bitwise() {
    let Some(ours) = gpu_or_skip() else { return };
    for tracking in [true, false] {
        for (i, n) in NS.into_iter().enumerate() {
            let p = Problem::new(n, 6000 + i as u64);
            let expected = p.by_upload(&ours);
            let stream = callers_stream(tracking);
            let device = Device::from_cuda_stream(stream.clone()).unwrap();
            let what = format!("n = {n}, tracking {tracking}");
            let ln = p.op(&device);
            let x = Tensor::from_cuda_slice(&device, stream.clone_htod(&p.x).unwrap(), &p.shape).unwrap();
            let dy = Tensor::from_cuda_slice(&device, stream.clone_htod(&p.dy).unwrap(), &p.shape).unwrap();
            let (y, ctx) = ln.forward(&x).unwrap();
            let g = ln.backward(&ctx, &dy).unwrap();
            drop(ctx);
            let mut back = Vec::new();
            for t in [y, g.dx, g.dgamma.unwrap(), g.dbeta.unwrap()] {
                let slice = t.into_cuda_slice().unwrap();
                back.push(stream.clone_dtoh(&slice).unwrap());
            }
            for (name, (got, want)) in ["y", "dx", "dgamma", "dbeta"]
                .iter()
                .zip(back.iter().zip(&expected))
            {
                assert_eq!(bits(got), bits(want), "{what}: {name}");
            }
            // x went in without a copy and comes back as it was.
            let x_back = x.into_cuda_slice().unwrap();
            assert_eq!(
                bits(&stream.clone_dtoh(&x_back).unwrap()),
                bits(&p.x),
                "{what}: x"
            );
        }
    }
}

/// Forward and backward on borrowed views of the caller's slices, which the caller keeps,
/// give the upload path's bits.
#[test]
fn gpu_borrowed_inputs_and_outputs_match_upload_path_bitwise() {
    let Some(ours) = gpu_or_skip() else { return };
    for tracking in [true, false] {
        for (i, n) in NS.into_iter().enumerate() {
            let p = Problem::new(n, 6100 + i as u64);
            let expected = p.by_upload(&ours);
            let stream = callers_stream(tracking);
            let device = Device::from_cuda_stream(stream.clone()).unwrap();
            let what = format!("n = {n}, tracking {tracking}");
            let ln = p.op(&device);
            let len = p.x.len();
            let (x, dy) = (
                stream.clone_htod(&p.x).unwrap(),
                stream.clone_htod(&p.dy).unwrap(),
            );
            let mut y = stream.alloc_zeros::<f32>(len).unwrap();
            let mut dx = stream.alloc_zeros::<f32>(len).unwrap();
            let mut dgamma = stream.alloc_zeros::<f32>(n).unwrap();
            let mut dbeta = stream.alloc_zeros::<f32>(n).unwrap();
            {
                let xb = BorrowedTensor::new(x.as_view(), &p.shape).unwrap();
                let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &p.shape).unwrap();
                let ctx = ln.forward_borrowed(&xb, &mut yb).unwrap();
                let mut grads = BorrowedGradients {
                    dx: BorrowedTensorMut::new(dx.as_view_mut(), &p.shape).unwrap(),
                    dgamma: Some(BorrowedTensorMut::new(dgamma.as_view_mut(), &[n]).unwrap()),
                    dbeta: Some(BorrowedTensorMut::new(dbeta.as_view_mut(), &[n]).unwrap()),
                };
                let dyb = BorrowedTensor::new(dy.as_view(), &p.shape).unwrap();
                ln.backward_borrowed(&ctx, &dyb, &mut grads).unwrap();
            }
            let outputs = [("y", &y), ("dx", &dx), ("dgamma", &dgamma), ("dbeta", &dbeta)];
            for ((name, slice), want) in outputs.into_iter().zip(&expected) {
                assert_eq!(
                    bits(&stream.clone_dtoh(slice).unwrap()),
                    bits(want),
                    "{what}: {name}"
                );
            }
        }
    }
}

/// The residual forward and backward on borrowed memory (s kept by the context, lent back
/// through `Context::normalized`) give the tensor path's bits, LayerNorm's and RMSNorm's,
/// with dsum and without.
#[test]
fn gpu_borrowed_residual_matches_the_tensor_path_bitwise() {
    let Some(ours) = gpu_or_skip() else { return };
    for tracking in [true, false] {
        for (i, n) in NS.into_iter().enumerate() {
            let p = Problem::new(n, 6200 + i as u64);
            let mut rng = Rng::new(6300 + i as u64);
            let rows = p.x.len() / n;
            let residual: Vec<f32> = random_matrix(&mut rng, rows, n).into_iter().collect();
            let dsum: Vec<f32> = random_matrix(&mut rng, rows, n).into_iter().collect();
            let stream = callers_stream(tracking);
            let device = Device::from_cuda_stream(stream.clone()).unwrap();
            for rms in [false, true] {
                for with_dsum in [false, true] {
                    let what = format!("n = {n}, tracking {tracking}, rms {rms}, dsum {with_dsum}");
                    // The tensor path, on this crate's own device: y, s, dx, dgamma, dbeta.
                    let up = |v: &[f32]| {
                        ours.upload(ndarray::ArrayView1::from(v))
                            .unwrap()
                            .view(0, &p.shape)
                            .unwrap()
                    };
                    let (x_t, r_t, dy_t, dsum_t) = (up(&p.x), up(&residual), up(&p.dy), up(&dsum));
                    let dsum_t = with_dsum.then_some(&dsum_t);
                    let expected: Vec<Vec<f32>> = if rms {
                        let op = RmsNorm::from_array(&ours, p.gamma.view(), 1e-5).unwrap();
                        let (y, s, ctx) = op.forward_residual(&x_t, &r_t).unwrap();
                        let g = op.backward_residual(&ctx, &dy_t, dsum_t).unwrap();
                        vec![y, s, g.dx, g.dgamma.unwrap()]
                    } else {
                        let op = p.op(&ours);
                        let (y, s, ctx) = op.forward_residual(&x_t, &r_t).unwrap();
                        let g = op.backward_residual(&ctx, &dy_t, dsum_t).unwrap();
                        vec![y, s, g.dx, g.dgamma.unwrap(), g.dbeta.unwrap()]
                    }
                    .iter()
                    .map(|t| t.to_vec().unwrap())
                    .collect();
                    // The same on the caller's slices, through borrows.
                    let len = p.x.len();
                    let htod = |v: &[f32]| stream.clone_htod(v).unwrap();
                    let (x, r, dy, ds) = (htod(&p.x), htod(&residual), htod(&p.dy), htod(&dsum));
                    let zeros = |len| stream.alloc_zeros::<f32>(len).unwrap();
                    let (mut y, mut s, mut dx) = (zeros(len), zeros(len), zeros(len));
                    let (mut dgamma, mut dbeta) = (zeros(n), zeros(n));
                    let s_read;
                    {
                        fn view<'a>(v: &'a CudaSlice<f32>, shape: &[usize]) -> BorrowedTensor<'a, f32> {
                            BorrowedTensor::new(v.as_view(), shape).unwrap()
                        }
                        let sh = &p.shape;
                        let (xb, rb, dyb, dsb) = (view(&x, sh), view(&r, sh), view(&dy, sh), view(&ds, sh));
                        let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &p.shape).unwrap();
                        let sb = BorrowedTensorMut::new(s.as_view_mut(), &p.shape).unwrap();
                        let mut grads = BorrowedGradients {
                            dx: BorrowedTensorMut::new(dx.as_view_mut(), &p.shape).unwrap(),
                            dgamma: Some(BorrowedTensorMut::new(dgamma.as_view_mut(), &[n]).unwrap()),
                            dbeta: (!rms).then(|| BorrowedTensorMut::new(dbeta.as_view_mut(), &[n]).unwrap()),
                        };
                        let dsb = with_dsum.then_some(&dsb);
                        if rms {
                            let op = RmsNorm::from_array(&device, p.gamma.view(), 1e-5).unwrap();
                            let ctx = op.forward_residual_borrowed(&xb, &rb, &mut yb, sb).unwrap();
                            s_read = stream.clone_dtoh(&ctx.normalized().cuda_view()).unwrap();
                            op.backward_residual_borrowed(&ctx, &dyb, dsb, &mut grads)
                                .unwrap();
                        } else {
                            let op = p.op(&device);
                            let ctx = op.forward_residual_borrowed(&xb, &rb, &mut yb, sb).unwrap();
                            s_read = stream.clone_dtoh(&ctx.normalized().cuda_view()).unwrap();
                            op.backward_residual_borrowed(&ctx, &dyb, dsb, &mut grads)
                                .unwrap();
                        }
                    }
                    let mut got = vec![y, s, dx, dgamma];
                    if !rms {
                        got.push(dbeta);
                    }
                    let names = ["y", "s", "dx", "dgamma", "dbeta"];
                    for ((name, slice), want) in names.iter().zip(&got).zip(&expected) {
                        assert_eq!(
                            bits(&stream.clone_dtoh(slice).unwrap()),
                            bits(want),
                            "{what}: {name}"
                        );
                    }
                    assert_eq!(bits(&s_read), bits(&expected[1]), "{what}: s through the context");
                }
            }
        }
    }
}

/// Borrowed residual arguments of another shape or context are typed errors, before
/// anything runs: the outputs keep what they held.
#[test]
fn gpu_bad_borrowed_residual_arguments_are_refused() {
    let Some(ours) = gpu_or_skip() else { return };
    let n = 4;
    let ln = LayerNorm::<f32>::without_affine(&ours, n, 1e-5).unwrap();
    let stream = ours.cuda_stream().unwrap();
    let other = CudaContext::new_non_primary(0, 0).unwrap().new_stream().unwrap();
    let x = stream.clone_htod(&[1.0f32; 8]).unwrap();
    let short = stream.clone_htod(&[1.0f32; 4]).unwrap();
    let theirs = other.clone_htod(&[1.0f32; 8]).unwrap();
    let mut y = stream.clone_htod(&[7.0f32; 8]).unwrap();
    let mut s = stream.clone_htod(&[7.0f32; 8]).unwrap();
    let mut s_theirs = other.clone_htod(&[7.0f32; 8]).unwrap();
    let xb = BorrowedTensor::new(x.as_view(), &[2, n]).unwrap();
    {
        let rb = BorrowedTensor::new(short.as_view(), &[1, n]).unwrap();
        let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &[2, n]).unwrap();
        let sb = BorrowedTensorMut::new(s.as_view_mut(), &[2, n]).unwrap();
        let r = ln.forward_residual_borrowed(&xb, &rb, &mut yb, sb);
        assert!(matches!(r, Err(Error::Shape { what: "residual", .. })), "{r:?}");
    }
    {
        let rb = BorrowedTensor::new(x.as_view(), &[2, n]).unwrap();
        let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &[2, n]).unwrap();
        let sb = BorrowedTensorMut::new(s_theirs.as_view_mut(), &[2, n]).unwrap();
        let r = ln.forward_residual_borrowed(&xb, &rb, &mut yb, sb);
        assert!(
            matches!(r, Err(Error::ContextMismatch { what: "sum", .. })),
            "{r:?}"
        );
    }
    {
        let rb = BorrowedTensor::new(theirs.as_view(), &[2, n]).unwrap();
        let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &[2, n]).unwrap();
        let sb = BorrowedTensorMut::new(s.as_view_mut(), &[2, n]).unwrap();
        let r = ln.forward_residual_borrowed(&xb, &rb, &mut yb, sb);
        assert!(
            matches!(r, Err(Error::ContextMismatch { what: "residual", .. })),
            "{r:?}"
        );
    }
    assert_eq!(stream.clone_dtoh(&y).unwrap(), [7.0; 8], "y");
    assert_eq!(stream.clone_dtoh(&s).unwrap(), [7.0; 8], "s");
    // A dsum of another shape, against a context that ran.
    let rb = BorrowedTensor::new(x.as_view(), &[2, n]).unwrap();
    let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &[2, n]).unwrap();
    let sb = BorrowedTensorMut::new(s.as_view_mut(), &[2, n]).unwrap();
    let ctx = ln.forward_residual_borrowed(&xb, &rb, &mut yb, sb).unwrap();
    let mut dx = stream.clone_htod(&[7.0f32; 8]).unwrap();
    let mut grads = BorrowedGradients {
        dx: BorrowedTensorMut::new(dx.as_view_mut(), &[2, n]).unwrap(),
        dgamma: None,
        dbeta: None,
    };
    let dsb = BorrowedTensor::new(short.as_view(), &[1, n]).unwrap();
    let r = ln.backward_residual_borrowed(&ctx, &xb, Some(&dsb), &mut grads);
    assert!(matches!(r, Err(Error::Shape { what: "dsum", .. })), "{r:?}");
    drop(grads);
    assert_eq!(stream.clone_dtoh(&dx).unwrap(), [7.0; 8], "dx");
}

/// A tensor read through `cuda_view` on the device's stream holds the tensor's elements
/// (a view's included).
#[test]
fn gpu_cuda_view_reads_the_tensors_elements() {
    let Some(gpu) = gpu_or_skip() else { return };
    let a: Vec<f32> = (0..20).map(|i| i as f32).collect();
    let t = gpu.upload(ndarray::ArrayView1::from(&a)).unwrap();
    let v = t.view(3, &[2, 4]).unwrap();
    let stream = gpu.cuda_stream().unwrap();
    assert_eq!(stream.clone_dtoh(&t.cuda_view().unwrap()).unwrap(), a);
    assert_eq!(stream.clone_dtoh(&v.cuda_view().unwrap()).unwrap(), a[3..11]);
}

/// Memory of another context of the same GPU, or of the wrong length, is a typed error,
/// before anything runs.
#[test]
fn gpu_foreign_contexts_and_lengths_are_refused() {
    let Some(ours) = gpu_or_skip() else { return };
    let other_ctx = CudaContext::new_non_primary(0, 0).unwrap();
    let other = other_ctx.new_stream().unwrap();
    let theirs = Device::from_cuda_stream(other.clone()).unwrap();
    let slice = other.clone_htod(&[1.0f32; 8]).unwrap();
    let r = Tensor::from_cuda_slice(&ours, slice, &[8]);
    assert!(
        matches!(r, Err(Error::ContextMismatch { ordinal: 0, .. })),
        "{r:?}"
    );

    let n = 4;
    let ln = LayerNorm::<f32>::without_affine(&ours, n, 1e-5).unwrap();
    let x_theirs = theirs.full(&[2, n], 1.0f32).unwrap();
    let r = ln.forward(&x_theirs);
    assert!(
        matches!(r, Err(Error::ContextMismatch { what: "x", .. })),
        "{r:?}"
    );

    let x = other.clone_htod(&[1.0f32; 8]).unwrap();
    let mut y = other.alloc_zeros::<f32>(8).unwrap();
    let xb = BorrowedTensor::new(x.as_view(), &[2, n]).unwrap();
    let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &[2, n]).unwrap();
    let r = ln.forward_borrowed(&xb, &mut yb);
    assert!(
        matches!(r, Err(Error::ContextMismatch { what: "x", .. })),
        "{r:?}"
    );

    let stream = ours.cuda_stream().unwrap();
    let r = Tensor::from_cuda_slice(&ours, stream.clone_htod(&[0.0f32; 7]).unwrap(), &[2, n]);
    assert!(matches!(r, Err(Error::Length { len: 7, .. })), "{r:?}");
    let r = BorrowedTensor::new(x.as_view(), &[3, n]);
    assert!(matches!(r, Err(Error::Length { len: 8, .. })), "{r:?}");

    // A view, or a shared tensor, cannot give its memory up.
    let t = ours.full(&[8], 1.0f32).unwrap();
    let r = t.view(1, &[4]).unwrap().into_cuda_slice();
    assert!(matches!(r, Err(Error::ViewOutput { .. })), "{r:?}");
    let r = t.clone().into_cuda_slice();
    assert!(matches!(r, Err(Error::SharedOutput { .. })), "{r:?}");
}

/// On the CPU there is no CUDA memory to give or view.
#[test]
fn cpu_tensors_have_no_cuda_memory() {
    let cpu = Device::cpu();
    let t = cpu.full(&[4], 1.0f32).unwrap();
    assert!(matches!(t.cuda_view(), Err(Error::NotCuda { .. })));
    assert!(matches!(t.into_cuda_slice(), Err(Error::NotCuda { .. })));
}

/// The residual stream kept in f32 beside bf16 x, on borrowed memory: y, s, dx, the
/// residual's gradient and dgamma are the tensor path's bits, LayerNorm's and RMSNorm's.
#[test]
fn gpu_borrowed_f32_stream_matches_the_tensor_path_bitwise() {
    let Some(ours) = gpu_or_skip() else { return };
    let stream = callers_stream(true);
    let device = Device::from_cuda_stream(stream.clone()).unwrap();
    for (i, n) in NS.into_iter().enumerate() {
        let mut rng = Rng::new(6400 + i as u64);
        let (rows, shape) = (6, [2, 3, n]);
        let x: Vec<bf16> = mixed_matrix(&mut rng, rows, n).into_iter().collect();
        let dy: Vec<bf16> = random_matrix(&mut rng, rows, n).into_iter().collect();
        let residual: Vec<f32> = random_matrix(&mut rng, rows, n).into_iter().collect();
        let dsum: Vec<f32> = random_matrix(&mut rng, rows, n).into_iter().collect();
        let gamma: Array1<bf16> = random_vec(&mut rng, n, 1.0, 0.5);
        for rms in [false, true] {
            let what = format!("n = {n}, rms {rms}");
            let layer =
                |d: &Device| LayerNorm::<bf16>::without_bias(d.upload(gamma.view()).unwrap(), 1e-5).unwrap();
            let rms_op = |d: &Device| RmsNorm::<bf16>::from_array(d, gamma.view(), 1e-5).unwrap();
            // The tensor path on this crate's own device.
            let up_h = |v: &[bf16]| {
                ours.upload(ndarray::ArrayView1::from(v))
                    .unwrap()
                    .view(0, &shape)
                    .unwrap()
            };
            let up_f = |v: &[f32]| {
                ours.upload(ndarray::ArrayView1::from(v))
                    .unwrap()
                    .view(0, &shape)
                    .unwrap()
            };
            let (x_t, dy_t, r_t, ds_t) = (up_h(&x), up_h(&dy), up_f(&residual), up_f(&dsum));
            let ((y_e, s_e), (g_e, dr_e)) = if rms {
                let op = rms_op(&ours);
                let (y, s, ctx) = op.forward_residual_f32(&x_t, &r_t).unwrap();
                (
                    (y, s),
                    op.backward_residual_f32(&ctx, &dy_t, Some(&ds_t)).unwrap(),
                )
            } else {
                let op = layer(&ours);
                let (y, s, ctx) = op.forward_residual_f32(&x_t, &r_t).unwrap();
                (
                    (y, s),
                    op.backward_residual_f32(&ctx, &dy_t, Some(&ds_t)).unwrap(),
                )
            };
            // The same through borrows of the caller's slices.
            let len = x.len();
            let (xd, dyd) = (stream.clone_htod(&x).unwrap(), stream.clone_htod(&dy).unwrap());
            let (rd, dsd) = (
                stream.clone_htod(&residual).unwrap(),
                stream.clone_htod(&dsum).unwrap(),
            );
            let (mut y, mut dx, mut dgamma) = (
                stream.alloc_zeros::<bf16>(len).unwrap(),
                stream.alloc_zeros::<bf16>(len).unwrap(),
                stream.alloc_zeros::<bf16>(n).unwrap(),
            );
            let (mut s, mut dres) = (
                stream.alloc_zeros::<f32>(len).unwrap(),
                stream.alloc_zeros::<f32>(len).unwrap(),
            );
            {
                let xb = BorrowedTensor::new(xd.as_view(), &shape).unwrap();
                let dyb = BorrowedTensor::new(dyd.as_view(), &shape).unwrap();
                let rb = BorrowedTensor::new(rd.as_view(), &shape).unwrap();
                let dsb = BorrowedTensor::new(dsd.as_view(), &shape).unwrap();
                let mut yb = BorrowedTensorMut::new(y.as_view_mut(), &shape).unwrap();
                let sb = BorrowedTensorMut::new(s.as_view_mut(), &shape).unwrap();
                let mut drb = BorrowedTensorMut::new(dres.as_view_mut(), &shape).unwrap();
                let mut grads = BorrowedGradients {
                    dx: BorrowedTensorMut::new(dx.as_view_mut(), &shape).unwrap(),
                    dgamma: Some(BorrowedTensorMut::new(dgamma.as_view_mut(), &[n]).unwrap()),
                    dbeta: None,
                };
                if rms {
                    let op = rms_op(&device);
                    let ctx = op.forward_residual_f32_borrowed(&xb, &rb, &mut yb, sb).unwrap();
                    op.backward_residual_f32_borrowed(&ctx, &dyb, Some(&dsb), &mut grads, &mut drb)
                        .unwrap();
                } else {
                    let op = layer(&device);
                    let ctx = op.forward_residual_f32_borrowed(&xb, &rb, &mut yb, sb).unwrap();
                    op.backward_residual_f32_borrowed(&ctx, &dyb, Some(&dsb), &mut grads, &mut drb)
                        .unwrap();
                }
            }
            let half_bits = |v: Vec<bf16>| v.iter().map(|e| e.to_bits() as u32).collect::<Vec<_>>();
            let h = |t: &Tensor<bf16>| half_bits(t.to_vec().unwrap());
            let f = |t: &Tensor<f32>| bits(&t.to_vec().unwrap());
            assert_eq!(half_bits(stream.clone_dtoh(&y).unwrap()), h(&y_e), "{what}: y");
            assert_eq!(bits(&stream.clone_dtoh(&s).unwrap()), f(&s_e), "{what}: s");
            assert_eq!(
                half_bits(stream.clone_dtoh(&dx).unwrap()),
                h(&g_e.dx),
                "{what}: dx"
            );
            assert_eq!(
                bits(&stream.clone_dtoh(&dres).unwrap()),
                f(&dr_e),
                "{what}: d_residual"
            );
            assert_eq!(
                half_bits(stream.clone_dtoh(&dgamma).unwrap()),
                h(g_e.dgamma.as_ref().unwrap()),
                "{what}: dgamma"
            );
        }
    }
}
