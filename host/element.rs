//! The storage types LayerNorm runs on: f32, f16 and bf16 (computed in f32 throughout).

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::slice::HalfFloatSliceExt;
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
    sealed::Sealed + Copy + Default + Send + Sync + DeviceRepr + ValidAsZeroBits + std::fmt::Debug + 'static
{
    /// Suffix of this type's kernels in the PTX (`layer_norm_fwd_block_f16`, ...).
    const NAME: &'static str;
    /// Index of this type in per-type tables.
    const INDEX: usize;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// `src` widened into `dst` (same lengths): a whole row at a time, so that f16 and bf16
    /// take `half`'s vector conversions rather than one element at a time.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `src` narrowed into `dst` (same lengths), rounding to nearest even.
    fn narrow(src: &[f32], dst: &mut [Self]);
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
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
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
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
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
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}
