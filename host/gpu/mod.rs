//! The CUDA side, in layers: `module` loads the PTX and looks up the registry's kernels,
//! `context` opens a device (the only place the driver is set up) with them, `storage` holds
//! tensors' device memory and orders its uses across streams, `launch` queues the kernels
//! (the only `unsafe` launches), `layer_norm` takes the plan and sizes the grids for the op,
//! `workspace` keeps the backward's scratch between calls.

pub(crate) mod context;
pub(crate) mod launch;
pub(crate) mod layer_norm;
pub(crate) mod module;
pub(crate) mod storage;
pub(crate) mod workspace;

pub(crate) use context::Gpu;
