//! The CUDA side, in layers: `context` opens a device and loads the PTX (the only place the
//! driver is set up), `storage` holds tensors' device memory and orders its uses across
//! streams, `kernels` names the kernels and launches them (the only `unsafe` launches),
//! `layer_norm` sizes the launches for the op.

pub(crate) mod context;
pub(crate) mod kernels;
pub(crate) mod layer_norm;
pub(crate) mod storage;

pub(crate) use context::Gpu;
