//! cudarc interop: a `Device` on a caller's stream, tensors over a caller's `CudaSlice`
//! (and back), and forward/backward on borrowed memory, all bitwise equal to the upload
//! path, with cudarc's event tracking on and off in the caller's context; memory of another
//! context is a typed error. The CPU checks run everywhere, the rest where a GPU is.

mod common;

use std::sync::Arc;

use common::{Rng, gpu_or_skip, mixed_matrix, random_matrix, random_vec};
use layernorm_cuda::cudarc::driver::{CudaContext, CudaStream};
use layernorm_cuda::{
    BorrowedGradients, BorrowedTensor, BorrowedTensorMut, Device, Error, LayerNorm, Tensor,
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
