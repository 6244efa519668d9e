//! LayerNorm forward and backward for NVIDIA GPUs, with kernels written in `no_std` Rust
//! (`kernels-gpu/`) compiled to PTX by this crate's build, and an ndarray CPU path with the
//! same API where no GPU is.
//!
//! ```no_run
//! use layernorm_cuda::{Device, LayerNorm};
//! use ndarray::{Array1, Array2};
//!
//! # fn main() -> layernorm_cuda::Result<()> {
//! let (device, _why_not_cuda) = Device::cuda_or_cpu();
//! let (rows, n) = (4, 8);
//! let ln = LayerNorm::<f32>::from_arrays(&device, Array1::ones(n).view(), Array1::zeros(n).view(), 1e-5)?;
//! let x = device.upload(Array2::from_shape_fn((rows, n), |(i, j)| (i * n + j) as f32).view())?;
//! let (y, ctx) = ln.forward(&x)?;
//! let dy = device.upload(Array2::<f32>::ones((rows, n)).view())?;
//! let grads = ln.backward(&ctx, &dy)?;
//! println!("{:?} {:?}", y.to_array2()?, grads.dgamma.map(|d| d.to_array1()).transpose()?);
//! # Ok(())
//! # }
//! ```
//!
//! Layout: `device` (where data lives), `tensor` on it (tensors, their storage and the
//! `Device` methods that make them), `borrowed` (shaped borrows of CUDA memory that stays
//! the caller's), `layer_norm` (the op and its checks), `stats` (the mean and rstd tensors
//! a forward writes, reused once their context is gone),
//! `cpu` (the ndarray path), `plan` (which kernel and block a call takes, a pure function),
//! `gpu` (CUDA: context, kernel launches, grid sizing), and with the `candle` feature
//! `candle` (the op on candle tensors, with candle's autograd).

mod borrowed;
#[cfg(feature = "candle")]
pub mod candle;
mod cpu;
mod device;
mod element;
mod error;
mod gpu;
mod layer_norm;
// What the kernels and this crate must agree on (packs per thread, shared-memory layouts,
// cluster sizes, the kernel registry), the one file both compile. Some of it only the
// kernels use.
#[allow(dead_code)]
#[path = "../kernels-gpu/layout/mod.rs"]
mod layout;
pub mod plan;
mod rms_norm;
mod stats;
mod tensor;

pub use borrowed::{BorrowedTensor, BorrowedTensorMut};
/// The CUDA driver bindings this crate uses (for [`Device::cuda_stream`]).
pub use cudarc;
pub use device::Device;
pub use element::{Element, F32Stream, Weight};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use layer_norm::{
    BackwardMode, BorrowedGradients, Context, F32StreamContext, Gradients, LayerNorm, MAX_DIM,
};
pub use rms_norm::RmsNorm;
pub use tensor::Tensor;
