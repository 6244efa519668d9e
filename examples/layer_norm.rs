//! The README's example: forward and backward on the GPU where one is, else the CPU.
//! `cargo run --release --example layer_norm`

use layernorm_cuda::{BackwardMode, Device, LayerNorm};
use ndarray::{Array1, Array2};

fn main() -> layernorm_cuda::Result<()> {
    let (device, why_not_cuda) = Device::cuda_or_cpu();
    if let Some(e) = why_not_cuda {
        eprintln!("running on the CPU: {e}");
    }
    let (rows, n) = (4096, 1024);
    let gamma = Array1::<f32>::ones(n);
    let beta = Array1::<f32>::zeros(n);
    let ln = LayerNorm::from_arrays(&device, gamma.view(), beta.view(), 1e-5)?
        .with_backward_mode(BackwardMode::Deterministic)?;

    let x = device.upload(Array2::from_shape_fn((rows, n), |(i, j)| ((i * 31 + j) % 97) as f32).view())?;
    let (y, ctx) = ln.forward(&x)?; // ctx keeps x, mean and rstd for the backward
    let dy = device.upload(Array2::<f32>::ones((rows, n)).view())?;
    let grads = ln.backward(&ctx, &dy)?; // dx, dgamma, dbeta
    let dgamma = grads.dgamma.expect("an op with gamma returns dgamma");
    println!("{:?} {:?}", y.to_array2()?.dim(), dgamma.to_array1()?.len());
    Ok(())
}
