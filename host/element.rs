//! The storage types LayerNorm runs on: f32, f16 and bf16 (computed in f32 throughout).

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A storage type of x, y, gamma, beta and the gradients. Implemented for `f32`,
/// `half::f16` and `half::bf16` only.
pub trait Element:
    sealed::Sealed
    + crate::cpu::RowConvert
    + Copy
    + Default
    + Send
    + Sync
    + DeviceRepr
    + ValidAsZeroBits
    + std::fmt::Debug
    + 'static
{
    /// Suffix of this type's kernels in the PTX (`layer_norm_fwd_block_f16`, ...).
    const NAME: &'static str;
    /// Index of this type in per-type tables.
    const INDEX: usize;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    const INDEX: usize = 0;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const NAME: &'static str = "f16";
    const INDEX: usize = 1;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const NAME: &'static str = "bf16";
    const INDEX: usize = 2;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
