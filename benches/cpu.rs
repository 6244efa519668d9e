//! Criterion benches (`cargo bench`): the CPU path's forward and backward at a few sizes and,
//! where a CUDA device opens, the GPU's cost per call at sizes too small to be limited by
//! bandwidth: launch and allocation overhead, each call followed by a synchronize. The
//! bandwidth sweep is `ln-bench`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use layernorm_cuda::{Context, Device, Gradients, LayerNorm, Tensor};
use ndarray::{Array1, Array2};

/// A forward and backward of one shape on one device, with every buffer allocated once.
struct Case {
    ln: LayerNorm<f32>,
    x: Tensor<f32>,
    dy: Tensor<f32>,
    y: Tensor<f32>,
    ctx: Context<f32>,
    grads: Gradients<f32>,
}

impl Case {
    fn new(device: &Device, rows: usize, n: usize) -> Case {
        // Non-zero, non-constant rows; the values themselves do not matter to the timing.
        let wave = |k: usize| {
            let a = Array2::from_shape_fn((rows, n), |(i, j)| {
                ((i * 31 + j * 17 + k) % 97) as f32 / 97.0 - 0.4
            });
            device.upload(a.view()).expect("upload")
        };
        let (x, dy) = (wave(0), wave(5));
        let ln = LayerNorm::from_arrays(
            device,
            Array1::from_elem(n, 1.1).view(),
            Array1::from_elem(n, 0.1).view(),
            1e-5,
        )
        .expect("a valid LayerNorm");
        let (y, ctx) = ln.forward(&x).expect("forward");
        let grads = ln.backward(&ctx, &dy).expect("backward");
        Case {
            ln,
            x,
            dy,
            y,
            ctx,
            grads,
        }
    }

    fn forward(&mut self) {
        self.ln.forward_into(&self.x, &mut self.y).expect("forward");
    }

    fn backward(&mut self) {
        self.ln
            .backward_into(&self.ctx, &self.dy, &mut self.grads)
            .expect("backward");
    }
}

fn cpu_path(c: &mut Criterion) {
    let device = Device::cpu();
    let mut group = c.benchmark_group("cpu");
    for (rows, n) in [(64, 1024), (256, 4096)] {
        let mut case = Case::new(&device, rows, n);
        let bytes = (rows * n * size_of::<f32>()) as u64;
        let id = format!("{rows}x{n}");
        group.throughput(Throughput::Bytes(2 * bytes));
        group.bench_function(BenchmarkId::new("forward", &id), |b| b.iter(|| case.forward()));
        group.throughput(Throughput::Bytes(3 * bytes));
        group.bench_function(BenchmarkId::new("backward", &id), |b| b.iter(|| case.backward()));
    }
    group.finish();
}

fn gpu_call_overhead(c: &mut Criterion) {
    let device = match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            println!("GPU benches skipped: {e}");
            return;
        }
    };
    let mut group = c.benchmark_group("gpu-call");
    for (rows, n) in [(1, 256), (64, 1024)] {
        let mut case = Case::new(&device, rows, n);
        let id = format!("{rows}x{n}");
        let sync = || device.synchronize().expect("synchronize");
        group.bench_function(BenchmarkId::new("forward", &id), |b| {
            b.iter(|| {
                case.forward();
                sync()
            })
        });
        group.bench_function(BenchmarkId::new("backward", &id), |b| {
            b.iter(|| {
                case.backward();
                sync()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, cpu_path, gpu_call_overhead);
criterion_main!(benches);
