//! A forward that writes into an earlier call's context (`forward_into_context`), and the
//! use it exists for: forward plus backward captured in a CUDA graph and replayed. The
//! context checks run on the CPU and the GPU; the graph where a GPU is.

mod common;

use common::{Rng, gpu_or_skip, mixed_matrix, random_matrix, random_vec};
use layernorm_cuda::cudarc::driver::sys::{
    self, CUgraphInstantiate_flags, CUgraphNodeType, CUresult, CUstreamCaptureMode,
};
use layernorm_cuda::cudarc::driver::{CudaGraph, DevicePtr};
use layernorm_cuda::{Device, Error, Gradients, LayerNorm, RmsNorm, Tensor};

fn devices() -> Vec<Device> {
    let mut devices = vec![Device::cpu()];
    devices.extend(gpu_or_skip());
    devices
}

/// An op, two inputs x1 and x2 of `[rows, n]` and an upstream gradient, on `device`.
struct Problem {
    ln: LayerNorm<f32>,
    x1: Tensor<f32>,
    x2: Tensor<f32>,
    dy: Tensor<f32>,
}

impl Problem {
    fn new(device: &Device, rows: usize, n: usize, seed: u64) -> Problem {
        let mut rng = Rng::new(seed);
        let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
        let beta = random_vec::<f32>(&mut rng, n, 0.0, 0.5);
        let ln = LayerNorm::new(
            device.upload(gamma.view()).unwrap(),
            device.upload(beta.view()).unwrap(),
            1e-5,
        )
        .unwrap();
        let up = |a: ndarray::Array2<f32>| device.upload(a.view()).unwrap();
        Problem {
            ln,
            x1: up(mixed_matrix(&mut rng, rows, n)),
            x2: up(mixed_matrix(&mut rng, rows, n)),
            dy: up(random_matrix(&mut rng, rows, n)),
        }
    }

    fn gradients(&self) -> Gradients<f32> {
        let device = self.ln.device();
        let n = self.ln.n();
        Gradients {
            dx: device.zeros(self.dy.shape()).unwrap(),
            dgamma: Some(device.zeros(&[n]).unwrap()),
            dbeta: Some(device.zeros(&[n]).unwrap()),
        }
    }
}

fn host(t: &Tensor<f32>) -> Vec<f32> {
    t.to_vec().unwrap()
}

fn host_grads(g: &Gradients<f32>) -> [Vec<f32>; 3] {
    [
        host(&g.dx),
        host(g.dgamma.as_ref().unwrap()),
        host(g.dbeta.as_ref().unwrap()),
    ]
}

/// The device address of a tensor's elements on a GPU (storage does not move); None on the
/// CPU, whose tensors do not show theirs.
fn address(t: &Tensor<f32>) -> Option<u64> {
    let stream = t.device().cuda_stream()?;
    let view = t.cuda_view().unwrap();
    let (ptr, _sync) = view.device_ptr(stream);
    Some(ptr)
}

/// The statistics of a dropped context go to the op's next forward (no allocation: on a
/// GPU the same device memory), while those of a live context, of its clone, or of a
/// tensor taken from it, are never written again.
#[test]
fn statistics_of_a_dropped_context_are_reused_and_of_a_live_one_never() {
    for device in devices() {
        let p = Problem::new(&device, 6, 40, 7100);
        let mut y = device.zeros(p.x1.shape()).unwrap();
        let fresh = |x: &Tensor<f32>| {
            let (_, ctx) = p.ln.forward(x).unwrap();
            (host(ctx.mean()), host(ctx.rstd()))
        };
        let (mean1, rstd1) = fresh(&p.x1);
        let (mean2, rstd2) = fresh(&p.x2);
        assert_ne!(mean1, mean2, "{}: the two inputs differ", device.name());

        // Dropped: the next forward writes the same memory, with its own statistics.
        let ctx = p.ln.forward_into(&p.x1, &mut y).unwrap();
        let at = (address(ctx.mean()), address(ctx.rstd()));
        drop(ctx);
        let ctx = p.ln.forward_into(&p.x2, &mut y).unwrap();
        assert_eq!(
            (address(ctx.mean()), address(ctx.rstd())),
            at,
            "{}: reused",
            device.name()
        );
        assert_eq!(
            (host(ctx.mean()), host(ctx.rstd())),
            (mean2.clone(), rstd2.clone())
        );

        // Live, cloned or taken from: every later forward gets other memory.
        let clone = ctx.clone();
        let taken = ctx.mean().clone();
        drop(ctx);
        let live = p.ln.forward_into(&p.x1, &mut y).unwrap();
        for _ in 0..3 {
            let later = p.ln.forward_into(&p.x1, &mut y).unwrap();
            if let Some(at) = address(later.mean()) {
                assert_ne!(
                    Some(at),
                    address(live.mean()),
                    "{}: a live context",
                    device.name()
                );
                assert_ne!(Some(at), address(&taken), "{}: a taken mean", device.name());
            }
        }
        assert_eq!(host(&taken), mean2, "{}: a taken mean", device.name());
        assert_eq!(
            (host(clone.mean()), host(clone.rstd())),
            (mean2, rstd2),
            "{}: a clone",
            device.name()
        );
        assert_eq!(
            (host(live.mean()), host(live.rstd())),
            (mean1, rstd1),
            "{}: a live context",
            device.name()
        );
    }
}

/// The statistics and y of x2 written through x1's context equal a fresh forward of x2
/// bitwise, and the backward from that context equals the fresh one's. A clone of the old
/// context still holds x1's statistics: a context whose tensors are shared gets new ones.
#[test]
fn forward_into_context_equals_a_fresh_forward() {
    for device in devices() {
        for (rows, n) in [(7, 3), (33, 769), (9, 4096)] {
            let p = Problem::new(&device, rows, n, 7 + n as u64);
            let (y2_fresh, ctx2_fresh) = p.ln.forward(&p.x2).unwrap();
            let (_, ctx1) = p.ln.forward(&p.x1).unwrap();
            let mean1 = host(ctx1.mean());

            for shared in [false, true] {
                let (_, mut ctx) = p.ln.forward(&p.x1).unwrap();
                let kept = shared.then(|| ctx.clone());
                let mut y2 = device.zeros::<f32>(&[rows, n]).unwrap();
                p.ln.forward_into_context(&p.x2, &mut y2, &mut ctx).unwrap();
                let what = format!("{device:?} [{rows}, {n}] shared {shared}");
                assert_eq!(host(&y2), host(&y2_fresh), "{what}: y");
                assert_eq!(host(ctx.mean()), host(ctx2_fresh.mean()), "{what}: mean");
                assert_eq!(host(ctx.rstd()), host(ctx2_fresh.rstd()), "{what}: rstd");
                if let Some(kept) = kept {
                    assert_eq!(
                        host(kept.mean()),
                        mean1,
                        "{what}: the clone's mean was overwritten"
                    );
                }
                let grads = p.ln.backward(&ctx, &p.dy).unwrap();
                let fresh = p.ln.backward(&ctx2_fresh, &p.dy).unwrap();
                assert_eq!(host_grads(&grads), host_grads(&fresh), "{what}: gradients");
            }
        }
    }
}

/// A context of another op, or an x of another width, is a typed error that leaves the
/// context as it was.
#[test]
fn forward_into_context_refuses_bad_arguments() {
    for device in devices() {
        let p = Problem::new(&device, 5, 64, 3);
        let other = Problem::new(&device, 5, 64, 4);
        let (_, mut ctx) = p.ln.forward(&p.x1).unwrap();
        let mean = host(ctx.mean());
        let mut y = device.zeros::<f32>(&[5, 64]).unwrap();
        let r = other.ln.forward_into_context(&other.x1, &mut y, &mut ctx);
        assert!(matches!(r, Err(Error::ForeignContext)), "{r:?}");
        let narrow = device.zeros::<f32>(&[5, 32]).unwrap();
        let r = p.ln.forward_into_context(&narrow, &mut y, &mut ctx);
        assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
        assert_eq!(
            host(ctx.mean()),
            mean,
            "{device:?}: ctx changed by a refused call"
        );
        assert_eq!(
            host(&y),
            vec![0.0; 5 * 64],
            "{device:?}: y written by a refused call"
        );
    }
}

/// Forward plus backward captured in a CUDA graph: each replay writes y, dx, dgamma and
/// dbeta for the captured x exactly as the calls did (deterministic mode: bitwise), also
/// after other calls have overwritten every output in between. Shapes reach the warp and
/// block kernels and, on Hopper, the cluster ones.
#[test]
fn a_captured_forward_and_backward_replay_exactly() {
    let Some(gpu) = gpu_or_skip() else { return };
    let stream = gpu.cuda_stream().unwrap().clone();
    for (rows, n) in [(64, 1024), (16, 8192), (4, 65536)] {
        let p = Problem::new(&gpu, rows, n, 11 + n as u64);
        let what = format!("[{rows}, {n}]");
        // Outside the capture: the outputs, the context and the backward's workspace
        // exist, and the kernels' attributes are cached.
        let mut y = gpu.zeros::<f32>(&[rows, n]).unwrap();
        let mut ctx = p.ln.forward_into(&p.x1, &mut y).unwrap();
        let mut grads = p.gradients();
        p.ln.backward_into(&ctx, &p.dy, &mut grads).unwrap();
        let (y_ref, grads_ref) = (host(&y), host_grads(&grads));

        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let captured =
            p.ln.forward_into_context(&p.x1, &mut y, &mut ctx)
                .and_then(|()| p.ln.backward_into(&ctx, &p.dy, &mut grads));
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured.unwrap();
        let graph = graph.unwrap().expect("the capture recorded work");

        for replay in 0..2 {
            // Every output now holds x2's results.
            p.ln.forward_into_context(&p.x2, &mut y, &mut ctx).unwrap();
            p.ln.backward_into(&ctx, &p.dy, &mut grads).unwrap();
            assert_ne!(host(&y), y_ref, "{what}: x2's y equals x1's");
            graph.launch().unwrap();
            assert_eq!(host(&y), y_ref, "{what} replay {replay}: y");
            assert_eq!(host_grads(&grads), grads_ref, "{what} replay {replay}: gradients");
        }
    }
}

/// The type of every node of a captured graph.
fn node_types(graph: &CudaGraph) -> Vec<CUgraphNodeType> {
    let g = graph.cu_graph();
    let mut count = 0usize;
    // SAFETY: `g` is the live graph of `graph`; a null array asks for the count alone.
    let r = unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut count) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: the array holds `count` nodes.
    let r = unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut count) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    nodes
        .iter()
        .map(|&node| {
            let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` is a node of the live graph.
            let r = unsafe { sys::cuGraphNodeGetType(node, &mut kind) };
            assert_eq!(r, CUresult::CUDA_SUCCESS);
            kind
        })
        .collect()
}

/// The backward of an op that lacks beta (RMSNorm, LayerNorm without bias) or weights
/// altogether allocates nothing on the device once the stream's workspace holds its shape:
/// captured in a graph, `backward_into` records kernels and no memory node (a
/// stream-ordered allocation or free would be one), and the replay gives the call's dx
/// again after another call has overwritten it. The kernels sum dgamma and dbeta either
/// way; an absent one's sums go to the workspace.
#[test]
fn a_backward_without_beta_or_weights_allocates_nothing() {
    let Some(gpu) = gpu_or_skip() else { return };
    let stream = gpu.cuda_stream().unwrap().clone();
    let (rows, n) = (64, 1024);
    let mut rng = Rng::new(7300);
    let x = gpu.upload(mixed_matrix::<f32>(&mut rng, rows, n).view()).unwrap();
    let dy = gpu
        .upload(random_matrix::<f32>(&mut rng, rows, n).view())
        .unwrap();
    let dy2 = gpu
        .upload(random_matrix::<f32>(&mut rng, rows, n).view())
        .unwrap();
    let gamma = gpu
        .upload(random_vec::<f32>(&mut rng, n, 1.0, 0.5).view())
        .unwrap();
    let gradients = |weighted: bool| Gradients {
        dx: gpu.zeros(&[rows, n]).unwrap(),
        dgamma: weighted.then(|| gpu.zeros(&[n]).unwrap()),
        dbeta: None,
    };
    type Call<'a> = &'a dyn Fn(&Tensor<f32>, &mut Gradients<f32>) -> Result<(), Error>;
    let captured = |what: &str, mut grads: Gradients<f32>, backward_into: Call<'_>| {
        // Outside the capture: the workspace for this shape.
        backward_into(&dy, &mut grads).unwrap();
        let dx = host(&grads.dx);
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let call = backward_into(&dy, &mut grads);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        call.unwrap();
        let graph = graph.unwrap().expect("the capture recorded work");
        let types = node_types(&graph);
        assert!(
            types.contains(&CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL),
            "{what}: {types:?}"
        );
        assert!(
            !types.iter().any(|t| matches!(
                t,
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC | CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE
            )),
            "{what}: the backward allocates: {types:?}"
        );
        backward_into(&dy2, &mut grads).unwrap();
        assert_ne!(host(&grads.dx), dx, "{what}: dy2's dx equals dy's");
        graph.launch().unwrap();
        assert_eq!(host(&grads.dx), dx, "{what}: the replay's dx");
    };

    let rms = RmsNorm::new(gamma.clone(), 1e-5).unwrap();
    let (_, ctx) = rms.forward(&x).unwrap();
    captured("RMSNorm", gradients(true), &|dy, g| {
        rms.backward_into(&ctx, dy, g)
    });
    let unweighted = RmsNorm::<f32>::without_affine(&gpu, n, 1e-5).unwrap();
    let (_, ctx) = unweighted.forward(&x).unwrap();
    captured("RMSNorm without weights", gradients(false), &|dy, g| {
        unweighted.backward_into(&ctx, dy, g)
    });
    let no_bias = LayerNorm::without_bias(gamma, 1e-5).unwrap();
    let (_, ctx) = no_bias.forward(&x).unwrap();
    captured("LayerNorm without bias", gradients(true), &|dy, g| {
        no_bias.backward_into(&ctx, dy, g)
    });
}
