//! The storage types LayerNorm runs on: f32, f16 and bf16 (computed in f32 throughout), and
//! which weight types go with which.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use crate::layout::registry::{stream_pair, type_pair};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}

    /// The weight types of `T`: itself, and f32 beside f16 and bf16.
    pub trait SealedWeight<T> {}
    impl<T: super::Element> SealedWeight<T> for T {}
    impl SealedWeight<half::f16> for f32 {}
    impl SealedWeight<half::bf16> for f32 {}

    /// The types whose residual stream may be kept in f32: f16 and bf16.
    pub trait SealedF32Stream {}
    impl SealedF32Stream for half::f16 {}
    impl SealedF32Stream for half::bf16 {}
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

/// A storage type of the weights (gamma, beta) and their gradients beside x of type `T`:
/// `T` itself, or f32 beside f16 and bf16 x (mixed-precision training keeps its parameters
/// and their gradients in f32, as PyTorch's autocast and Apex's MixedFusedLayerNorm do). The
/// weights are widened to f32 as they are read, and dgamma and dbeta, summed in f32, are
/// written in this type.
pub trait Weight<T: Element>: Element + sealed::SealedWeight<T> {
    /// The kernels' type pair (an index into `crate::layout::registry::TYPE_PAIRS`).
    const PAIR: usize;
}

impl<T: Element> Weight<T> for T {
    const PAIR: usize = match type_pair(T::INDEX, T::INDEX) {
        Some(pair) => pair,
        None => panic!("every type has kernels with weights of its own type"),
    };
}

impl Weight<f16> for f32 {
    const PAIR: usize = match type_pair(f16::INDEX, f32::INDEX) {
        Some(pair) => pair,
        None => panic!("the kernels have f16 rows with f32 weights"),
    };
}

impl Weight<bf16> for f32 {
    const PAIR: usize = match type_pair(bf16::INDEX, f32::INDEX) {
        Some(pair) => pair,
        None => panic!("the kernels have bf16 rows with f32 weights"),
    };
}

/// A type of x whose pre-norm residual stream may be kept in f32 beside it: f16 and bf16
/// (flash-attention's `residual_in_fp32`). The residual forward then reads the residual and
/// writes s = x + residual in f32 (x widened, the sum not rounded to x's type), normalizes
/// s, and writes y in x's type; the backward reads s and the stream's gradient in f32, and
/// writes dx in x's type and the residual's gradient, the same values unrounded, in f32
/// (`LayerNorm::forward_residual_f32`, `LayerNorm::backward_residual_f32`).
pub trait F32Stream: Element + sealed::SealedF32Stream {}

impl F32Stream for f16 {}
impl F32Stream for bf16 {}

/// The kernels' type pair (an index into `crate::layout::registry::TYPE_PAIRS`) of x of
/// `T`, weights of `W` and a residual stream (the rows the kernels normalize) of `R`: `T`,
/// or f32 beside [`F32Stream`] x.
pub(crate) const fn pair_of<T: Element, W: Element, R: Element>() -> usize {
    match stream_pair(T::INDEX, W::INDEX, R::INDEX) {
        Some(pair) => pair,
        None => panic!("the kernels have every x, weights and stream type the ops accept"),
    }
}
