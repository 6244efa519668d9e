//! LayerNorm kernels for NVIDIA GPUs, in `no_std` Rust compiled to PTX by rustc's
//! `nvptx64-nvidia-cuda` target. The host crate's `build.rs` builds this crate and embeds
//! the PTX; kernel names are the contract with `host/gpu/module.rs`, and each kernel takes the
//! parameter structs of `crate::layout::params`, which the host fills.
//!
//! - `device`: the GPU primitives `core` lacks (indices, barriers, shuffles, conversions).
//! - `element`: f32 / f16 / bf16 storage, read and written in 16-byte packs.
//! - `team`: a warp or a block sharing one row, and its reductions.
//! - `row`: how a team walks a row, and the packs it holds in registers.
//! - `forward`: y, mean and rstd.
//! - `backward`: dx and the partial dgamma/dbeta (stage 1), and their reduction (stage 2).
//! - `cluster` (sm_90 module only): thread-block clusters sharing a row through DSMEM.
//!
//! build.rs builds two modules: sm_80 (A100 and later) and sm_90 (Hopper, with
//! `--cfg layernorm_sm90`: the cluster kernels); the host loads the one its device runs.
#![no_std]
#![feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, core_float_math)]

mod backward;
#[cfg(layernorm_sm90)]
mod cluster;
mod device;
mod element;
mod forward;
/// What the kernels and the host must agree on, the one file both compile. Some of it only
/// the host uses.
#[allow(dead_code)]
#[path = "../layout/mod.rs"]
mod layout;
mod row;
mod team;

/// Any panic (an out-of-range slice index, say) stops the kernel: the host sees the launch fail.
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; there is nothing to unwind.
    unsafe { core::arch::nvptx::trap() }
}
