//! LayerNorm in a candle graph: the forward as a candle `Module`, gradients for x, gamma and
//! beta from candle's `backward()`. On candle's CPU device, or with `--features
//! candle-cuda` on its CUDA device 0 where one can be opened.
//! `cargo run --release --features candle --example candle`

use candle_core::{DType, Device, Module, Tensor, Var};
use layernorm_cuda::candle::LayerNorm;

fn main() -> candle_core::Result<()> {
    let device = Device::cuda_if_available(0)?;
    let (batch, seq, n) = (4, 128, 1024);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (batch, seq, n), &device)?)?;
    let gamma = Var::ones(n, DType::F32, &device)?;
    let beta = Var::zeros(n, DType::F32, &device)?;
    let ln = LayerNorm::new(gamma.as_tensor().clone(), beta.as_tensor().clone(), 1e-5)?;

    let y = ln.forward(&x)?;
    let target = Tensor::randn(0f32, 1.0, (batch, seq, n), &device)?;
    let loss = (&y - &target)?.sqr()?.mean_all()?;
    let grads = loss.backward()?; // runs this crate's backward for the LayerNorm
    let dgamma = grads.get(&gamma).expect("gamma takes part in the loss");
    println!(
        "{device:?}: loss {:.4}, dx {:?}, dgamma {:?}, |dbeta| {:.4}",
        loss.to_scalar::<f32>()?,
        grads.get(&x).expect("x takes part in the loss").dims(),
        dgamma.dims(),
        grads
            .get(&beta)
            .expect("beta takes part")
            .sqr()?
            .sum_all()?
            .sqrt()?
            .to_scalar::<f32>()?,
    );
    Ok(())
}
