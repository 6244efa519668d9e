//! LayerNorm and RMSNorm in a candle graph: both as candle `Module`s, one after the other,
//! and the gradients of x and of every weight from candle's `backward()`. On candle's CPU
//! device, or with `--features candle-cuda` on its CUDA device 0 where one can be opened.
//! `cargo run --release --features candle --example candle`

use candle_core::{DType, Device, Module, Tensor, Var};
use layernorm_cuda::candle::{LayerNorm, RmsNorm};

fn main() -> candle_core::Result<()> {
    let device = Device::cuda_if_available(0)?;
    let (batch, seq, n) = (4, 128, 1024);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (batch, seq, n), &device)?)?;
    let gamma = Var::ones(n, DType::F32, &device)?;
    let beta = Var::zeros(n, DType::F32, &device)?;
    let weight = Var::ones(n, DType::F32, &device)?;
    let ln = LayerNorm::new(gamma.as_tensor().clone(), beta.as_tensor().clone(), 1e-5)?;
    let rms = RmsNorm::new(weight.as_tensor().clone(), 1e-6)?;

    let y = rms.forward(&ln.forward(&x)?)?;
    let target = Tensor::randn(0f32, 1.0, (batch, seq, n), &device)?;
    let loss = (&y - &target)?.sqr()?.mean_all()?;
    let grads = loss.backward()?; // runs this crate's backward for both norms
    let norm = |v: &Var| -> candle_core::Result<f32> {
        let grad = grads.get(v).expect("every variable takes part in the loss");
        grad.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()
    };
    println!(
        "{device:?}: loss {:.4}, |dx| {:.4}, |dgamma| {:.4}, |dbeta| {:.4}, |d rms weight| {:.4}",
        loss.to_scalar::<f32>()?,
        norm(&x)?,
        norm(&gamma)?,
        norm(&beta)?,
        norm(&weight)?,
    );
    Ok(())
}
