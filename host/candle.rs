//! LayerNorm and RMSNorm on candle tensors (feature `candle`): [`layer_norm`] and the
//! [`LayerNorm`] layer, [`rms_norm`] and the [`RmsNorm`] layer, whose backward candle's
//! autograd runs (`loss.backward()` gives dx, dgamma and, for LayerNorm, dbeta). CPU storage
//! runs this crate's CPU path on candle's memory; with the `candle-cuda` feature, CUDA
//! storage runs this crate's kernels on candle's stream, reading and writing candle's memory
//! without a copy.
//!
//! The weights (gamma, beta) have x's dtype, or f32 beside f16 and bf16 x, as mixed-precision
//! training keeps them; their gradients come in the weights' dtype.
//!
//! [`layer_norm_residual`] and [`rms_norm_residual`] (and the layers' `forward_residual`)
//! fuse the residual add of a pre-norm block with the norm: s = x + residual, y = norm(s),
//! both from one pass over x and the residual, and a backward that adds the gradient reaching
//! s to dx in the same pass. The residual stream (the residual and s) has x's dtype, or is
//! kept in f32 beside f16 and bf16 x (flash-attention's `residual_in_fp32`).
//!
//! candle's custom ops return one tensor, and their backward is handed only the inputs, the
//! output and its gradient. So the forward op keeps its per-row mean and rstd itself (each
//! call applies an op of its own, and candle's graph holds it until the backward). The
//! backward is a second op, over (x, gamma, dy), whose output is dx; it leaves dgamma and
//! (LayerNorm's) dbeta, end to end in one buffer of the weights' dtype, for a third op
//! applied to gamma, which hands that buffer over as its output, and candle views it as the
//! two gradients (`narrow`, no copy). Both run when they are applied, one after the other
//! (candle runs ops eagerly), and neither has a backward of its own (a second derivative is
//! candle's `BackwardNotSupported`). LayerNorm's forward is a `CustomOp3` over (x, gamma,
//! beta), RMSNorm's the same op as a `CustomOp2` over (x, gamma).
//!
//! A custom op also takes at most three operands. The residual forward is a `CustomOp3` over
//! (x, residual, weights), the weights being gamma for RMSNorm and, for LayerNorm, gamma and
//! beta stacked into one `[2, n]` tensor (a copy of 2n elements; candle's autograd splits
//! its gradient back between the two). Its output is y; the same pass writes s, which a
//! second op, applied to y, hands over as its own output (no copy). In candle's graph s thus
//! comes after y, and candle's backward reaches s first: s's op leaves s's gradient (dsum)
//! for y's op, whose backward then runs the one pass with dy and dsum (no dsum where the
//! loss does not use s). It returns dx to x and to the residual; where the stream is f32,
//! the residual's is dx unrounded, in f32, which the pass writes beside dx and an op
//! applied to s hands over as the weights' gradients are.

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::shape::Dim;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, D, DType, Error, Layout, Module, Result, Shape, Storage,
    Tensor, WithDType,
};
#[cfg(feature = "candle-cuda")]
use candle_core::{CudaDevice, CudaStorage, cuda::CudaDType, cuda::DeviceId};
#[cfg(feature = "candle-cuda")]
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use crate::cpu::{Stream, zeroed_with};
use crate::device::Device;
use crate::element::{Element, Weight};
use crate::layer_norm::{
    BackwardMode, BackwardOperands, ForwardOperands, In, Out, PLAIN_WEIGHT, ZERO_CENTERED_WEIGHT,
    backward_rows, check_config, check_dim, forward_rows,
};
use crate::plan::Norm;

/// The forward op's name in candle's errors.
fn op_name(norm: Norm) -> &'static str {
    match norm {
        Norm::Layer => "layernorm-cuda layer_norm",
        Norm::Rms => "layernorm-cuda rms_norm",
    }
}

/// The residual forward op's name.
fn residual_name(norm: Norm) -> &'static str {
    match norm {
        Norm::Layer => "layernorm-cuda layer_norm_residual",
        Norm::Rms => "layernorm-cuda rms_norm_residual",
    }
}

/// The backward op's name.
fn backward_name(norm: Norm) -> &'static str {
    match norm {
        Norm::Layer => "layernorm-cuda layer_norm backward",
        Norm::Rms => "layernorm-cuda rms_norm backward",
    }
}

/// y = LayerNorm(x) over the last dimension of x `[..., n]`, with weight `gamma` and bias
/// `beta` (`[n]`, both x's dtype, or both f32 beside f16 or bf16 x) and `eps` (finite and
/// positive); x f32, f16 or bf16. Where x, gamma or beta are variables of candle's graph,
/// `backward()` of a loss built on y gives their gradients (as this crate's deterministic
/// backward computes them), the weights' in the weights' dtype.
///
/// Strided inputs are made contiguous first (candle's `contiguous`, a copy); contiguous
/// ones, at any offset in their storage, are read where they lie.
///
/// Errors (candle's `Error`, before anything runs): `DimOutOfRange` for a 0-dimensional x,
/// `UnsupportedDTypeForOp` for dtypes other than f32, f16 and bf16, `DTypeMismatchBinaryOp`
/// where gamma or beta has a dtype that does not go with x's (neither x's nor, beside f16
/// or bf16 x, f32) or beta's is not gamma's, `UnexpectedShape` where either is not
/// `[n]`, `DeviceMismatchBinaryOp` for tensors on different devices. This crate's own
/// errors (eps not finite and > 0, sizes past [`crate::MAX_DIM`], memory that cannot be
/// had, driver failures) come inside `Error::WrappedContext`: [`as_layernorm_error`] finds
/// them. CUDA tensors need the `candle-cuda` feature: candle's `cuda` links cudarc in a
/// way this crate compiles with only when that feature is on (README, "From candle").
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
    layer_norm_with(x, gamma, beta, eps, PLAIN_WEIGHT)
}

/// [`layer_norm`] with each gamma_j taken as gamma_j + `gamma_offset` (the op's
/// `gamma_offset`: 1 for zero-centred weights, else -0).
fn layer_norm_with(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32, gamma_offset: f32) -> Result<Tensor> {
    let norm = Norm::Layer;
    let [_, n] = rows_and_n(norm, x.shape())?;
    check_params(norm, x.dtype(), n, &[("gamma", gamma), ("beta", beta)], eps)?;
    let op = Forward::new(norm, eps, gamma_offset);
    x.contiguous()?
        .apply_op3(&gamma.contiguous()?, &beta.contiguous()?, op)
}

/// y = RMSNorm(x) over the last dimension of x `[..., n]`: y = x * rstd * gamma with
/// rstd = 1 / sqrt(mean(x^2) + eps), weight `gamma` (`[n]`, x's dtype, or f32 beside f16 or
/// bf16 x); x f32, f16 or bf16.
/// Where x or gamma are variables of candle's graph, `backward()` of a loss built on y gives
/// their gradients. Inputs and errors as [`layer_norm`]'s.
pub fn rms_norm(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    rms_norm_with(x, gamma, eps, PLAIN_WEIGHT)
}

/// [`rms_norm`] with gamma's offset as [`layer_norm_with`] takes it.
fn rms_norm_with(x: &Tensor, gamma: &Tensor, eps: f32, gamma_offset: f32) -> Result<Tensor> {
    let norm = Norm::Rms;
    let [_, n] = rows_and_n(norm, x.shape())?;
    check_params(norm, x.dtype(), n, &[("gamma", gamma)], eps)?;
    x.contiguous()?
        .apply_op2(&gamma.contiguous()?, Forward::new(norm, eps, gamma_offset))
}

/// The residual add of a pre-norm block fused with LayerNorm: s = x + residual and
/// y = LayerNorm(s) as [`layer_norm`] computes it, in one pass over x and the residual.
/// Returns (y, s), both of x's shape; y of x's dtype, s of the residual's.
///
/// The residual has x's dtype (s is then each x + residual summed in f32 and rounded once,
/// as `crate::LayerNorm::forward_residual` forms it) or, beside f16 and bf16 x, f32: the
/// stream kept in f32, s = x + residual in f32, not rounded
/// (`crate::LayerNorm::forward_residual_f32`).
///
/// Where x, the residual, gamma or beta are variables of candle's graph, `backward()` of a
/// loss built on y, s or both gives their gradients. x's and the residual's are the same
/// values, dx = (the gradient through the norm at s) + (the gradient reaching s from the
/// loss), formed by one backward pass that adds the second as it writes dx: x's rounded
/// once to x's dtype, the residual's in the residual's dtype (with an f32 stream, written by
/// the same pass, unrounded). dgamma and dbeta are [`layer_norm`]'s at s.
///
/// Errors as [`layer_norm`]'s, and `DTypeMismatchBinaryOp` for a residual of another dtype
/// than x's (or f32 beside f16 and bf16 x), `ShapeMismatchBinaryOp` for one of another
/// shape.
pub fn layer_norm_residual(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    layer_norm_residual_with(x, residual, gamma, beta, eps, PLAIN_WEIGHT)
}

/// [`layer_norm_residual`] with gamma's offset as [`layer_norm_with`] takes it.
fn layer_norm_residual_with(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
    gamma_offset: f32,
) -> Result<(Tensor, Tensor)> {
    let norm = Norm::Layer;
    let [_, n] = rows_and_n(norm, x.shape())?;
    check_params(norm, x.dtype(), n, &[("gamma", gamma), ("beta", beta)], eps)?;
    check_residual(norm, x, residual)?;
    let weights = Tensor::stack(&[gamma, beta], 0)?;
    residual_forward(norm, x, residual, &weights, eps, gamma_offset)
}

/// The residual add fused with RMSNorm: s = x + residual as [`layer_norm_residual`] forms
/// it (the residual of x's dtype, or f32 beside f16 and bf16 x) and y = RMSNorm(s) as
/// [`rms_norm`] computes it, returned as (y, s); gradients of x, the residual and gamma as
/// [`layer_norm_residual`] gives them. Errors as [`layer_norm_residual`]'s.
pub fn rms_norm_residual(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    rms_norm_residual_with(x, residual, gamma, eps, PLAIN_WEIGHT)
}

/// [`rms_norm_residual`] with gamma's offset as [`layer_norm_with`] takes it.
fn rms_norm_residual_with(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    eps: f32,
    gamma_offset: f32,
) -> Result<(Tensor, Tensor)> {
    let norm = Norm::Rms;
    let [_, n] = rows_and_n(norm, x.shape())?;
    check_params(norm, x.dtype(), n, &[("gamma", gamma)], eps)?;
    check_residual(norm, x, residual)?;
    residual_forward(norm, x, residual, gamma, eps, gamma_offset)
}

/// Refuses a residual whose shape is not x's, or whose dtype is neither x's nor, beside f16
/// and bf16 x, f32.
fn check_residual(norm: Norm, x: &Tensor, residual: &Tensor) -> Result<()> {
    let op = residual_name(norm);
    let f32_stream = residual.dtype() == DType::F32 && matches!(x.dtype(), DType::F16 | DType::BF16);
    if residual.dtype() != x.dtype() && !f32_stream {
        return Err(Error::DTypeMismatchBinaryOp {
            lhs: x.dtype(),
            rhs: residual.dtype(),
            op,
        }
        .bt());
    }
    if residual.shape() != x.shape() {
        return Err(Error::ShapeMismatchBinaryOp {
            lhs: x.shape().clone(),
            rhs: residual.shape().clone(),
            op,
        }
        .bt());
    }
    Ok(())
}

/// Applies the [`ResidualForward`] op to checked operands (`weights`: gamma, or LayerNorm's
/// `[2, n]` gamma and beta), which gives y, and [`ResidualSum`] to y, which gives s.
fn residual_forward(
    norm: Norm,
    x: &Tensor,
    residual: &Tensor,
    weights: &Tensor,
    eps: f32,
    gamma_offset: f32,
) -> Result<(Tensor, Tensor)> {
    let shared = Arc::new(ResidualShared::default());
    let op = ResidualForward {
        forward: Forward::new(norm, eps, gamma_offset),
        shared: shared.clone(),
    };
    let y = x
        .contiguous()?
        .apply_op3(&residual.contiguous()?, &weights.contiguous()?, op)?;
    let sum = y.apply_op1(ResidualSum {
        norm,
        shared: shared.clone(),
    })?;
    // Detached: the graph's s holds y, whose op holds `shared`; s's storage alone does not.
    shared.sum.set(sum.detach()).map_err(|_| applied_twice(norm))?;
    Ok((y, sum))
}

/// LayerNorm as a candle layer: weight and bias `[n]`, applied by [`layer_norm`] to the
/// last dimension of its input.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
    /// PLAIN_WEIGHT, or ZERO_CENTERED_WEIGHT ([`LayerNorm::with_zero_centered_weight`]).
    gamma_offset: f32,
}

impl LayerNorm {
    /// A layer with `weight` `[n]` (f32, f16 or bf16), `bias` of its shape and dtype, and
    /// `eps` (finite, > 0); refused as [`layer_norm`] would refuse them, here rather than
    /// at the first forward. candle-nn's `LayerNorm::new(weight, bias, eps)`, that is. f32
    /// weights take f32, f16 and bf16 inputs; f16 and bf16 weights, inputs of their dtype.
    pub fn new(weight: Tensor, bias: Tensor, eps: f32) -> Result<LayerNorm> {
        let n = weight.dims1()?;
        let params = [("gamma", &weight), ("beta", &bias)];
        check_params(Norm::Layer, weight.dtype(), n, &params, eps)?;
        Ok(LayerNorm {
            weight,
            bias,
            eps,
            gamma_offset: PLAIN_WEIGHT,
        })
    }

    /// The same layer with a zero-centred weight: y = xhat * (1 + weight) + bias, 1 +
    /// weight formed in f32 as the kernels read it (as `crate::LayerNorm`'s
    /// `with_zero_centered_weight`). The weight's gradient is the same sum as without.
    pub fn with_zero_centered_weight(self) -> LayerNorm {
        LayerNorm {
            gamma_offset: ZERO_CENTERED_WEIGHT,
            ..self
        }
    }

    /// Whether the weight is zero-centred.
    pub fn zero_centered_weight(&self) -> bool {
        self.gamma_offset == ZERO_CENTERED_WEIGHT
    }

    /// (y, s) of [`layer_norm_residual`] with this layer's weight, bias, eps and weight
    /// (zero-centred where the layer's is): s = x + residual, y = this layer applied to s.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        layer_norm_residual_with(x, residual, &self.weight, &self.bias, self.eps, self.gamma_offset)
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm_with(x, &self.weight, &self.bias, self.eps, self.gamma_offset)
    }
}

/// RMSNorm as a candle layer: weight `[n]`, applied by [`rms_norm`] to the last dimension
/// of its input.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
    /// As [`LayerNorm`]'s.
    gamma_offset: f32,
}

impl RmsNorm {
    /// A layer with `weight` `[n]` (f32, f16 or bf16) and `eps` (finite, > 0); refused as
    /// [`rms_norm`] would refuse them, here rather than at the first forward. candle-nn's
    /// `RmsNorm::new(weight, eps)`, that is. Inputs as [`LayerNorm::new`] says.
    pub fn new(weight: Tensor, eps: f32) -> Result<RmsNorm> {
        let n = weight.dims1()?;
        check_params(Norm::Rms, weight.dtype(), n, &[("gamma", &weight)], eps)?;
        Ok(RmsNorm {
            weight,
            eps,
            gamma_offset: PLAIN_WEIGHT,
        })
    }

    /// The same layer with a zero-centred weight: y = x * rstd * (1 + weight), as Gemma
    /// keeps its RMSNorm weights (see [`LayerNorm::with_zero_centered_weight`]).
    pub fn with_zero_centered_weight(self) -> RmsNorm {
        RmsNorm {
            gamma_offset: ZERO_CENTERED_WEIGHT,
            ..self
        }
    }

    /// Whether the weight is zero-centred.
    pub fn zero_centered_weight(&self) -> bool {
        self.gamma_offset == ZERO_CENTERED_WEIGHT
    }

    /// (y, s) of [`rms_norm_residual`] with this layer's weight, eps and weight (zero-centred
    /// where the layer's is): s = x + residual, y = this layer applied to s.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        rms_norm_residual_with(x, residual, &self.weight, self.eps, self.gamma_offset)
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm_with(x, &self.weight, self.eps, self.gamma_offset)
    }
}

/// This crate's error inside a candle error of [`layer_norm`] or [`rms_norm`] (looking through candle's
/// backtrace and context wrappers), or `None` for candle's own errors.
pub fn as_layernorm_error(e: &Error) -> Option<&crate::Error> {
    match e {
        Error::WrappedContext { wrapped, .. } => wrapped.downcast_ref(),
        Error::WithBacktrace { inner, .. } | Error::Context { inner, .. } | Error::WithPath { inner, .. } => {
            as_layernorm_error(inner)
        }
        _ => None,
    }
}

/// This crate's error as a candle error: the typed error boxed in `WrappedContext` (which
/// [`as_layernorm_error`] unwraps), its message the context.
fn wrap(norm: Norm) -> impl Fn(crate::Error) -> Error {
    move |e| wrap_in(op_name(norm), e)
}

fn wrap_in(name: &str, e: crate::Error) -> Error {
    let context = format!("{name}: {e}");
    Error::WrappedContext {
        wrapped: Box::new(e),
        context,
    }
    .bt()
}

/// `[rows, n]` of x `[..., n]`, rows the product of the leading dimensions: candle's
/// error for a 0-dimensional x, this crate's where rows or n pass [`crate::MAX_DIM`] (a
/// product that overflows counts as past it).
fn rows_and_n(norm: Norm, shape: &Shape) -> Result<[usize; 2]> {
    let dims = shape.dims();
    let n = dims[D::Minus1.to_index(shape, op_name(norm))?];
    let leading = &dims[..dims.len() - 1];
    let rows = leading
        .iter()
        .try_fold(1usize, |rows, &d| rows.checked_mul(d))
        .unwrap_or(usize::MAX);
    check_dim("rows", rows)
        .and(check_dim("n", n))
        .map_err(wrap(norm))?;
    Ok([rows, n])
}

/// Refuses x dtypes other than f32, f16 and bf16; parameters (named) that are not `[n]`,
/// or whose dtype does not go with x's (each the first one's, which is x's or, beside f16
/// or bf16 x, f32); and eps that is not finite and > 0.
fn check_params(norm: Norm, dtype: DType, n: usize, params: &[(&str, &Tensor)], eps: f32) -> Result<()> {
    let name = op_name(norm);
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::UnsupportedDTypeForOp(dtype, name).bt());
    }
    let weights = params.first().map_or(dtype, |(_, p)| p.dtype());
    for &(what, p) in params {
        // A parameter of another dtype than the first, or weights that do not go with x.
        let mismatch = if p.dtype() != weights {
            Some((weights, p.dtype()))
        } else if weights != dtype && weights != DType::F32 {
            Some((dtype, weights))
        } else {
            None
        };
        if let Some((lhs, rhs)) = mismatch {
            return Err(Error::DTypeMismatchBinaryOp { lhs, rhs, op: name }.bt());
        }
        if p.dims() != [n] {
            return Err(Error::UnexpectedShape {
                msg: format!("{name}: {what} must be [n], n being the normalized (last) dimension"),
                expected: n.into(),
                got: p.shape().clone(),
            }
            .bt());
        }
    }
    check_config(n, eps).map_err(wrap(norm))
}

/// Runs `f::<T, W, R>(args)` for the element types of x's dtype `$x`, the weights' `$w` and
/// the residual stream's (the rows normalized) R: x's own (f32, f16 and bf16 with weights of
/// their own type; f16 and bf16 with f32 weights) or, after `f32 stream:`, f32 beside f16 and
/// bf16 x (either weights). Else candle's unsupported-dtype error for the op named `name`
/// (checked before: the ops refuse other types when they are applied).
macro_rules! by_types {
    ($name:expr, $x:expr, $w:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match ($x, $w) {
            (DType::F32, DType::F32) => $f::<f32, f32, f32>($($arg),*),
            (DType::F16, DType::F16) => $f::<f16, f16, f16>($($arg),*),
            (DType::BF16, DType::BF16) => $f::<bf16, bf16, bf16>($($arg),*),
            (DType::F16, DType::F32) => $f::<f16, f32, f16>($($arg),*),
            (DType::BF16, DType::F32) => $f::<bf16, f32, bf16>($($arg),*),
            (dtype, _) => Err(Error::UnsupportedDTypeForOp(dtype, $name).bt()),
        }
    };
    (f32 stream: $name:expr, $x:expr, $w:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match ($x, $w) {
            (DType::F16, DType::F16) => $f::<f16, f16, f32>($($arg),*),
            (DType::BF16, DType::BF16) => $f::<bf16, bf16, f32>($($arg),*),
            (DType::F16, DType::F32) => $f::<f16, f32, f32>($($arg),*),
            (DType::BF16, DType::F32) => $f::<bf16, f32, f32>($($arg),*),
            (dtype, _) => Err(Error::UnsupportedDTypeForOp(dtype, $name).bt()),
        }
    };
}

/// The per-row mean and rstd of a forward, in the memory of the storage it ran on.
enum Stats {
    Host {
        mean: Vec<f32>,
        rstd: Vec<f32>,
    },
    #[cfg(feature = "candle-cuda")]
    Cuda {
        mean: CudaSlice<f32>,
        rstd: CudaSlice<f32>,
    },
}

impl Stats {
    fn host(&self) -> Result<(&[f32], &[f32])> {
        match self {
            Stats::Host { mean, rstd } => Ok((mean, rstd)),
            #[cfg(feature = "candle-cuda")]
            Stats::Cuda { .. } => Err(moved()),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda(&self) -> Result<(&CudaSlice<f32>, &CudaSlice<f32>)> {
        match self {
            Stats::Cuda { mean, rstd } => Ok((mean, rstd)),
            Stats::Host { .. } => Err(moved()),
        }
    }
}

/// An operand, or an output handed over, on other storage than its op's (candle's graph
/// keeps each op's operands on one device, so this does not happen).
fn moved() -> Error {
    Error::Msg("layernorm-cuda: a tensor is not on the device its forward ran on".into()).bt()
}

/// A slot in which one op leaves a buffer for the next, which takes it.
type Slot = Arc<Mutex<Option<Storage>>>;

/// Puts `storage` in `slot`. A panic elsewhere while the slot was held leaves it whole: it
/// is only ever set or taken.
fn leave(slot: &Slot, storage: Storage) {
    *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(storage);
}

/// Takes what `slot` holds: `None` where nothing was left there.
fn take(slot: &Slot) -> Option<Storage> {
    slot.lock().unwrap_or_else(PoisonError::into_inner).take()
}

/// The forward op over (x, gamma, beta) for LayerNorm or (x, gamma) for RMSNorm, contiguous
/// and checked by [`layer_norm`] or [`rms_norm`], and the statistics it leaves for its
/// backward; also the body of [`ResidualForward`].
struct Forward {
    norm: Norm,
    eps: f32,
    /// Added to each gamma_j as it is read (`crate::layer_norm::PLAIN_WEIGHT` or
    /// `ZERO_CENTERED_WEIGHT`).
    gamma_offset: f32,
    /// Set by the forward, which runs once: each call of [`layer_norm`] or [`rms_norm`]
    /// applies an op of its own.
    stats: OnceLock<Arc<Stats>>,
}

/// Refuses a second run of an op that runs once.
fn applied_twice(norm: Norm) -> Error {
    Error::Msg(format!("{}: an op applied twice", op_name(norm))).bt()
}

impl Forward {
    fn new(norm: Norm, eps: f32, gamma_offset: f32) -> Forward {
        Forward {
            norm,
            eps,
            gamma_offset,
            stats: OnceLock::new(),
        }
    }

    fn keep(&self, stats: Stats) -> Result<()> {
        self.stats
            .set(Arc::new(stats))
            .map_err(|_| applied_twice(self.norm))
    }

    /// The forward on CPU storage (beta absent for RMSNorm): y and, with a residual, s of
    /// the residual's dtype; it keeps the statistics.
    fn cpu(
        &self,
        x: Operand<'_, CpuStorage>,
        residual: Option<Operand<'_, CpuStorage>>,
        gamma: Operand<'_, CpuStorage>,
        beta: Option<Operand<'_, CpuStorage>>,
    ) -> Result<(CpuStorage, Option<CpuStorage>)> {
        let name = op_name(self.norm);
        let (x_dtype, w_dtype) = (x.0.dtype(), gamma.0.dtype());
        let (y, sum, stats) = match residual {
            Some(r) if r.0.dtype() != x_dtype => {
                by_types!(f32 stream: name, x_dtype, w_dtype, forward_cpu(self, x, residual, gamma, beta))
            }
            _ => by_types!(
                name,
                x_dtype,
                w_dtype,
                forward_cpu(self, x, residual, gamma, beta)
            ),
        }?;
        self.keep(stats)?;
        Ok((y, sum))
    }

    /// The forward on CUDA storage, as [`Forward::cpu`].
    #[cfg(feature = "candle-cuda")]
    fn cuda(
        &self,
        x: Operand<'_, CudaStorage>,
        residual: Option<Operand<'_, CudaStorage>>,
        gamma: Operand<'_, CudaStorage>,
        beta: Option<Operand<'_, CudaStorage>>,
    ) -> Result<(CudaStorage, Option<CudaStorage>)> {
        let name = op_name(self.norm);
        let (x_dtype, w_dtype) = (x.0.dtype(), gamma.0.dtype());
        let (y, sum, stats) = match residual {
            Some(r) if r.0.dtype() != x_dtype => {
                by_types!(f32 stream: name, x_dtype, w_dtype, forward_cuda(self, x, residual, gamma, beta))
            }
            _ => by_types!(
                name,
                x_dtype,
                w_dtype,
                forward_cuda(self, x, residual, gamma, beta)
            ),
        }?;
        self.keep(stats)?;
        Ok((y, sum))
    }

    /// dx by the [`Backward`] op, from the statistics the forward kept, then the weights'
    /// gradients that op left (dgamma, then LayerNorm's dbeta, end to end, `[params * n]`) by
    /// [`Handover`]. `x` holds the rows the forward normalized (x, or s after a residual),
    /// `dy` is y's gradient, and `dsum` the gradient reaching s (of s's dtype), which dx
    /// includes. Where s is f32 beside dy of f16 or bf16, the residual's gradient too: dx
    /// unrounded, in f32.
    fn backward(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        dy: &Tensor,
        dsum: Option<Tensor>,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let stats = self.stats.get().cloned().ok_or_else(|| {
            Error::Msg(format!("{}: the forward has not run", backward_name(self.norm))).bt()
        })?;
        let op = Backward {
            norm: self.norm,
            gamma_offset: self.gamma_offset,
            dsum,
            stats,
            weight_grads: Slot::default(),
            d_residual: Slot::default(),
        };
        let (weight_grads, d_residual) = (op.weight_grads.clone(), op.d_residual.clone());
        // dy often comes strided (the gradient of a sum is a broadcast).
        let dx = x.apply_op3(gamma, &dy.contiguous()?, op)?;
        let hand_over = |slot, shape| Handover {
            norm: self.norm,
            slot,
            shape,
        };
        let n = gamma.elem_count();
        let weight_grads = gamma.apply_op1(hand_over(weight_grads, (params(self.norm) * n).into()))?;
        let d_residual = match x.dtype() == dy.dtype() {
            true => None,
            false => Some(x.apply_op1(hand_over(d_residual, x.shape().clone()))?),
        };
        Ok((dx, weight_grads, d_residual))
    }

    /// dx, dgamma and (LayerNorm's) dbeta of the plain forward, by [`Forward::backward`],
    /// the weights' gradients viewed apart (`narrow`, no copy).
    fn grads(&self, x: &Tensor, gamma: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let (dx, grads, _) = self.backward(x, gamma, dy, None)?;
        let n = gamma.elem_count();
        let dgamma = grads.narrow(0, 0, n)?;
        let dbeta = match self.norm {
            Norm::Layer => Some(grads.narrow(0, n, n)?),
            Norm::Rms => None,
        };
        Ok((dx, dgamma, dbeta))
    }
}

/// LayerNorm's forward over (x, gamma, beta).
impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        op_name(self.norm)
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        gamma: &CpuStorage,
        lg: &Layout,
        beta: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, _) = self.cpu((x, lx), None, (gamma, lg), Some((beta, lb)))?;
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        gamma: &CudaStorage,
        lg: &Layout,
        beta: &CudaStorage,
        lb: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (y, _) = self.cuda((x, lx), None, (gamma, lg), Some((beta, lb)))?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _beta: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dgamma, dbeta) = self.grads(x, gamma, dy)?;
        Ok((Some(dx), Some(dgamma), dbeta))
    }
}

/// RMSNorm's forward over (x, gamma).
impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        op_name(self.norm)
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        gamma: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, _) = self.cpu((x, lx), None, (gamma, lg), None)?;
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        gamma: &CudaStorage,
        lg: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (y, _) = self.cuda((x, lx), None, (gamma, lg), None)?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dgamma, _) = self.grads(x, gamma, dy)?;
        Ok((Some(dx), Some(dgamma)))
    }
}

/// What a residual forward's two ops, [`ResidualForward`] and [`ResidualSum`], share.
#[derive(Default)]
struct ResidualShared {
    /// s as the forward's pass wrote it, until [`ResidualSum`] hands it over.
    pass: Slot,
    /// s as [`ResidualSum`]'s output, detached from the graph, for the backward.
    sum: OnceLock<Tensor>,
    /// The gradient reaching s (contiguous), left by [`ResidualSum`]'s backward for
    /// [`ResidualForward`]'s, which candle runs after it in the same `backward()` (s comes
    /// after y in the graph) and which takes it. Absent where the loss does not use s. (A
    /// `backward()` that fails between the two leaves it here, for a later `backward()` of
    /// the same graph whose loss does not use s to find: after a failed backward, run the
    /// forward again.)
    dsum: Mutex<Option<Tensor>>,
}

/// The residual forward over (x, residual, weights), contiguous and checked by
/// [`layer_norm_residual`] or [`rms_norm_residual`]: the weights are gamma `[n]` for
/// RMSNorm, gamma and beta `[2, n]` for LayerNorm. Its output is y; s, of the residual's
/// dtype, it leaves for [`ResidualSum`]; the statistics it keeps are s's.
struct ResidualForward {
    forward: Forward,
    shared: Arc<ResidualShared>,
}

impl ResidualForward {
    /// gamma's layout and, for LayerNorm, beta's: the rows of the weights' `[2, n]`.
    fn weights(&self, lw: &Layout) -> Result<(Layout, Option<Layout>)> {
        match self.forward.norm {
            Norm::Layer => Ok((lw.narrow(0, 0, 1)?, Some(lw.narrow(0, 1, 1)?))),
            Norm::Rms => Ok((lw.clone(), None)),
        }
    }

    /// Leaves s for [`ResidualSum`].
    fn leave_sum(&self, sum: Option<Storage>) -> Result<()> {
        let sum = sum.ok_or_else(|| {
            Error::Msg(format!(
                "{}: the pass wrote no s",
                residual_name(self.forward.norm)
            ))
            .bt()
        })?;
        leave(&self.shared.pass, sum);
        Ok(())
    }
}

impl CustomOp3 for ResidualForward {
    fn name(&self) -> &'static str {
        residual_name(self.forward.norm)
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        residual: &CpuStorage,
        lr: &Layout,
        weights: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (lg, lb) = self.weights(lw)?;
        let beta = lb.as_ref().map(|lb| (weights, lb));
        let (y, sum) = self
            .forward
            .cpu((x, lx), Some((residual, lr)), (weights, &lg), beta)?;
        self.leave_sum(sum.map(Storage::Cpu))?;
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        residual: &CudaStorage,
        lr: &Layout,
        weights: &CudaStorage,
        lw: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (lg, lb) = self.weights(lw)?;
        let beta = lb.as_ref().map(|lb| (weights, lb));
        let (y, sum) = self
            .forward
            .cuda((x, lx), Some((residual, lr)), (weights, &lg), beta)?;
        self.leave_sum(sum.map(Storage::Cuda))?;
        Ok((y, lx.shape().clone()))
    }

    /// One backward pass at s with y's gradient and the gradient reaching s that
    /// [`ResidualSum`]'s backward left (where the loss uses s) gives dx, the gradient of
    /// x and, in the residual's dtype, of the residual, and the weights' gradients in the
    /// weights' shape (for LayerNorm, `[2, n]`, which candle splits between gamma and beta).
    fn bwd(
        &self,
        _x: &Tensor,
        _residual: &Tensor,
        weights: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let norm = self.forward.norm;
        let gamma = match norm {
            Norm::Layer => weights.get(0)?,
            Norm::Rms => weights.clone(),
        };
        let sum = self
            .shared
            .sum
            .get()
            .ok_or_else(|| Error::Msg(format!("{}: s was not handed over", backward_name(norm))).bt())?;
        let dsum = self
            .shared
            .dsum
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let (dx, dweights, d_residual) = self.forward.backward(sum, &gamma, dy, dsum)?;
        let dweights = dweights.reshape(weights.shape())?;
        let d_residual = d_residual.unwrap_or_else(|| dx.clone());
        Ok((Some(dx), Some(d_residual), Some(dweights)))
    }
}

/// Applied to y right after [`ResidualForward`]: s, which that op's pass wrote, as this op's
/// output (x's shape, the residual's dtype), handed over without a copy.
struct ResidualSum {
    norm: Norm,
    shared: Arc<ResidualShared>,
}

impl ResidualSum {
    fn take(&self) -> Result<Storage> {
        take(&self.shared.pass)
            .ok_or_else(|| Error::Msg(format!("{}: s is not there", residual_name(self.norm))).bt())
    }
}

impl CustomOp1 for ResidualSum {
    fn name(&self) -> &'static str {
        residual_name(self.norm)
    }

    fn cpu_fwd(&self, _y: &CpuStorage, ly: &Layout) -> Result<(CpuStorage, Shape)> {
        match self.take()? {
            Storage::Cpu(sum) => Ok((sum, ly.shape().clone())),
            _ => Err(moved()),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(&self, _y: &CudaStorage, ly: &Layout) -> Result<(CudaStorage, Shape)> {
        match self.take()? {
            Storage::Cuda(sum) => Ok((sum, ly.shape().clone())),
            _ => Err(moved()),
        }
    }

    /// Leaves s's gradient for [`ResidualForward`]'s backward, which adds it to dx. y gets
    /// none along this edge, but candle's backward wants a gradient for every tensor on the
    /// way to the loss: zeros, broadcast from one element (no buffer of y's size).
    fn bwd(&self, y: &Tensor, _sum: &Tensor, dsum: &Tensor) -> Result<Option<Tensor>> {
        let dsum = dsum.contiguous()?;
        *self.shared.dsum.lock().unwrap_or_else(PoisonError::into_inner) = Some(dsum);
        let zero = Tensor::zeros((), y.dtype(), y.device())?;
        Ok(Some(zero.broadcast_as(y.shape())?))
    }
}

/// The backward op over (x, gamma, dy), with the statistics of x's forward: dx (x's shape,
/// dy's dtype) as its output; dgamma then, for LayerNorm, dbeta, end to end in one 1-D
/// buffer of the weights' dtype, left in `weight_grads` for [`Handover`]; where x is f32
/// beside dy of f16 or bf16 (s of an f32 stream), the residual's gradient in `d_residual`.
/// After a residual forward, x is s.
struct Backward {
    norm: Norm,
    /// The forward's.
    gamma_offset: f32,
    /// The gradient reaching s (x's shape and dtype, contiguous), which dx includes.
    dsum: Option<Tensor>,
    stats: Arc<Stats>,
    weight_grads: Slot,
    d_residual: Slot,
}

impl Backward {
    /// Leaves the weights' gradients and the residual's, where there is one.
    fn leave(&self, weight_grads: Storage, d_residual: Option<Storage>) {
        leave(&self.weight_grads, weight_grads);
        if let Some(d_residual) = d_residual {
            leave(&self.d_residual, d_residual);
        }
    }
}

/// The parameters whose gradients `norm`'s backward returns: gamma and beta, or gamma.
fn params(norm: Norm) -> usize {
    match norm {
        Norm::Layer => 2,
        Norm::Rms => 1,
    }
}

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        backward_name(self.norm)
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        gamma: &CpuStorage,
        lg: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (name, t, w) = (self.name(), dy.dtype(), gamma.dtype());
        let (dx, weight_grads, d_residual) = match x.dtype() == t {
            true => by_types!(name, t, w, backward_cpu(self, x, lx, gamma, lg, dy, ldy)),
            false => by_types!(f32 stream: name, t, w, backward_cpu(self, x, lx, gamma, lg, dy, ldy)),
        }?;
        self.leave(Storage::Cpu(weight_grads), d_residual.map(Storage::Cpu));
        Ok((dx, lx.shape().clone()))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        gamma: &CudaStorage,
        lg: &Layout,
        dy: &CudaStorage,
        ldy: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (name, t, w) = (self.name(), dy.dtype(), gamma.dtype());
        let (dx, weight_grads, d_residual) = match x.dtype() == t {
            true => by_types!(name, t, w, backward_cuda(self, x, lx, gamma, lg, dy, ldy)),
            false => by_types!(f32 stream: name, t, w, backward_cuda(self, x, lx, gamma, lg, dy, ldy)),
        }?;
        self.leave(Storage::Cuda(weight_grads), d_residual.map(Storage::Cuda));
        Ok((dx, lx.shape().clone()))
    }
}

/// Applied right after [`Backward`] (to gamma, or to s): a buffer that op left, as this op's
/// output of `shape`, handed over without a copy: the weights' gradients (`params * n`
/// elements of the weights' dtype), or the f32 residual's.
struct Handover {
    norm: Norm,
    slot: Slot,
    shape: Shape,
}

impl Handover {
    fn take(&self) -> Result<Storage> {
        take(&self.slot).ok_or_else(|| {
            Error::Msg(format!(
                "{}: the gradients are not there",
                backward_name(self.norm)
            ))
            .bt()
        })
    }
}

impl CustomOp1 for Handover {
    fn name(&self) -> &'static str {
        backward_name(self.norm)
    }

    fn cpu_fwd(&self, _operand: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        match self.take()? {
            Storage::Cpu(grads) => Ok((grads, self.shape.clone())),
            _ => Err(moved()),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(&self, _operand: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        match self.take()? {
            Storage::Cuda(grads) => Ok((grads, self.shape.clone())),
            _ => Err(moved()),
        }
    }
}

/// Where a layout's elements lie in its storage: candle's `RequiresContiguous` for a
/// strided one (the ops' operands are made contiguous before they are applied).
fn span(layout: &Layout) -> Result<Range<usize>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(start..end),
        None => Err(Error::RequiresContiguous { op: "layernorm-cuda" }.bt()),
    }
}

/// Refuses an operand (named by the op `op`) whose shape is not `expected`: a residual that
/// is not of x's shape, a dy or dsum that is not of the forward's output shape (candle hands
/// the backward gradients of that shape).
fn expect_shape(op: &'static str, expected: &Shape, got: &Layout) -> Result<()> {
    if expected == got.shape() {
        Ok(())
    } else {
        Err(Error::ShapeMismatchBinaryOp {
            lhs: expected.clone(),
            rhs: got.shape().clone(),
            op,
        }
        .bt())
    }
}

/// Whether the stream's type `R` is wider than x's `T` (f32 beside f16 or bf16): the
/// backward then writes the residual's gradient apart from dx.
fn wide_stream<T: Element, R: Element>() -> bool {
    R::INDEX != T::INDEX
}

// The ops' bodies, CPU beside CUDA: each takes its operands in candle's memory, allocates
// its outputs there, and runs this crate's core (`forward_rows`, `backward_rows`) on them,
// with x of `T`, the weights of `W` and the rows normalized (x, or the residual stream) of
// `R`. Empty inputs run nothing: y, s, dx and the residual's gradient are then empty, and
// dgamma and dbeta are zeros (CPU: allocated so; CUDA: `backward_rows` zeroes them for
// rows = 0, and n = 0 leaves them empty). RMSNorm's forward runs the common core with
// beta = 0, made per call (n elements).

/// `len` zeros in host memory, or this crate's out-of-memory error.
fn zeroed<F: Copy + Default>(norm: Norm, len: usize) -> Result<Vec<F>> {
    zeroed_with(len, "allocating a candle tensor").map_err(wrap(norm))
}

/// A CPU operand's elements.
fn host<'a, T: WithDType>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [T]> {
    Ok(&storage.as_slice::<T>()?[span(layout)?])
}

/// An operand's storage and layout.
type Operand<'a, S> = (&'a S, &'a Layout);

/// y and, with a residual, s in candle's CPU memory, and the statistics.
fn forward_cpu<T: Element + WithDType, W: Weight<T> + WithDType, R: Stream<T> + WithDType>(
    op: &Forward,
    (x, lx): Operand<'_, CpuStorage>,
    residual: Option<Operand<'_, CpuStorage>>,
    (gamma, lg): Operand<'_, CpuStorage>,
    beta: Option<Operand<'_, CpuStorage>>,
) -> Result<(CpuStorage, Option<CpuStorage>, Stats)> {
    let (norm, eps) = (op.norm, op.eps);
    let [rows, n] = rows_and_n(norm, lx.shape())?;
    let len = rows * n;
    let mut y = zeroed::<T>(norm, len)?;
    let mut sum = match residual {
        Some(_) => Some(zeroed::<R>(norm, len)?),
        None => None,
    };
    let (mut mean, mut rstd) = (zeroed(norm, rows)?, zeroed(norm, rows)?);
    if rows > 0 && n > 0 {
        let residual = match (residual, sum.as_deref_mut()) {
            (Some((r, lr)), Some(sum)) => {
                expect_shape(residual_name(norm), lx.shape(), lr)?;
                Some((In::Host(host::<R>(r, lr)?), Out::Host(sum)))
            }
            _ => None,
        };
        let no_beta;
        let beta = match beta {
            Some((beta, lb)) => host(beta, lb)?,
            None => {
                no_beta = zeroed::<W>(norm, n)?;
                &no_beta
            }
        };
        let o = ForwardOperands {
            x: In::Host(host(x, lx)?),
            residual,
            gamma: In::Host(host::<W>(gamma, lg)?),
            gamma_offset: op.gamma_offset,
            beta: In::Host(beta),
            y: Out::Host(&mut y),
            mean: Out::Host(&mut mean),
            rstd: Out::Host(&mut rstd),
        };
        forward_rows(&Device::cpu(), norm, eps, rows, n, o).map_err(wrap(norm))?;
    }
    Ok((
        T::to_cpu_storage_owned(y),
        sum.map(R::to_cpu_storage_owned),
        Stats::Host { mean, rstd },
    ))
}

/// This crate's device on the stream of a candle CUDA device. Made at the first call on
/// that candle device, whose kernels then load into its context (each norm's of each type
/// pair at its first call; far too slow to do per call),
/// and kept for the life of the process, since nothing tells this crate when candle drops
/// the device (programs make their few devices once): a later call finds it here, with the
/// backward's scratch it keeps between calls.
#[cfg(feature = "candle-cuda")]
fn device_of(norm: Norm, cuda: &CudaDevice) -> Result<Device> {
    use std::sync::{Mutex, PoisonError};
    static DEVICES: Mutex<Vec<(DeviceId, Device)>> = Mutex::new(Vec::new());
    // A panic elsewhere while the list was held leaves it whole: entries are pushed whole.
    let mut devices = DEVICES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, device)) = devices.iter().find(|(id, _)| *id == cuda.id()) {
        return Ok(device.clone());
    }
    let device = Device::from_cuda_stream(cuda.cuda_stream()).map_err(wrap(norm))?;
    devices.push((cuda.id(), device.clone()));
    Ok(device)
}

/// A CUDA operand's elements, in the context of `device` (else this crate's
/// `ContextMismatch`).
#[cfg(feature = "candle-cuda")]
fn cuda_in<'a, T: Element + CudaDType>(
    device: &Device,
    norm: Norm,
    what: &'static str,
    (storage, layout): Operand<'a, CudaStorage>,
) -> Result<CudaView<'a, T>> {
    let slice = storage.as_cuda_slice::<T>()?;
    device.check_context(what, slice.context()).map_err(wrap(norm))?;
    Ok(slice.slice(span(layout)?))
}

/// `len` elements of device memory on `stream`, uninitialized.
#[cfg(feature = "candle-cuda")]
fn cuda_out<T: DeviceRepr>(norm: Norm, stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
    let during = "allocating a candle tensor";
    // SAFETY: nothing reads an element before a kernel or a memset on `stream` wrote it:
    // the forward writes all of y (and of s with a residual), mean and rstd (where n = 0,
    // y and s are empty and mean and rstd are never read), the backward all of dx (and of
    // the residual's gradient), dgamma and dbeta.
    crate::gpu::storage::allocate(stream, len * size_of::<T>(), during, || unsafe {
        stream.alloc::<T>(len)
    })
    .map_err(wrap(norm))
}

/// `len` zeros of device memory on `stream`.
#[cfg(feature = "candle-cuda")]
fn cuda_zeros<T: DeviceRepr + ValidAsZeroBits>(
    norm: Norm,
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    let during = "allocating RMSNorm's zero beta";
    crate::gpu::storage::allocate(stream, len * size_of::<T>(), during, || {
        stream.alloc_zeros::<T>(len)
    })
    .map_err(wrap(norm))
}

/// y and s in candle's CUDA memory, and the statistics, as [`forward_cpu`].
#[cfg(feature = "candle-cuda")]
fn forward_cuda<
    T: Element + CudaDType,
    W: Weight<T> + CudaDType + ValidAsZeroBits,
    R: Stream<T> + CudaDType,
>(
    op: &Forward,
    (x, lx): Operand<'_, CudaStorage>,
    residual: Option<Operand<'_, CudaStorage>>,
    (gamma, lg): Operand<'_, CudaStorage>,
    beta: Option<Operand<'_, CudaStorage>>,
) -> Result<(CudaStorage, Option<CudaStorage>, Stats)> {
    let (norm, eps) = (op.norm, op.eps);
    let [rows, n] = rows_and_n(norm, lx.shape())?;
    let device = device_of(norm, &x.device)?;
    let stream = x.device.cuda_stream();
    let len = rows * n;
    let mut y = cuda_out::<T>(norm, &stream, len)?;
    let mut sum = match residual {
        Some(_) => Some(cuda_out::<R>(norm, &stream, len)?),
        None => None,
    };
    let (mut mean, mut rstd) = (cuda_out(norm, &stream, rows)?, cuda_out(norm, &stream, rows)?);
    if rows > 0 && n > 0 {
        let residual = match (residual, sum.as_mut()) {
            (Some((r, lr)), Some(sum)) => {
                expect_shape(residual_name(norm), lx.shape(), lr)?;
                Some((
                    In::Cuda(cuda_in::<R>(&device, norm, "residual", (r, lr))?),
                    Out::Cuda(sum.as_view_mut()),
                ))
            }
            _ => None,
        };
        let no_beta;
        let beta = match beta {
            Some(beta) => cuda_in(&device, norm, "beta", beta)?,
            None => {
                no_beta = cuda_zeros::<W>(norm, &stream, n)?;
                no_beta.as_view()
            }
        };
        let o = ForwardOperands {
            x: In::Cuda(cuda_in(&device, norm, "x", (x, lx))?),
            residual,
            gamma: In::Cuda(cuda_in::<W>(&device, norm, "gamma", (gamma, lg))?),
            gamma_offset: op.gamma_offset,
            beta: In::Cuda(beta),
            y: Out::Cuda(y.as_view_mut()),
            mean: Out::Cuda(mean.as_view_mut()),
            rstd: Out::Cuda(rstd.as_view_mut()),
        };
        forward_rows(&device, norm, eps, rows, n, o).map_err(wrap(norm))?;
    }
    let dev = &x.device;
    Ok((
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        sum.map(|sum| CudaStorage::wrap_cuda_slice(sum, dev.clone())),
        Stats::Cuda { mean, rstd },
    ))
}

/// dx in candle's CPU memory, the weights' gradients (dgamma, then LayerNorm's dbeta), and,
/// where the stream is wider than x, the residual's gradient.
fn backward_cpu<T: Element + WithDType, W: Weight<T> + WithDType, R: Stream<T> + WithDType>(
    op: &Backward,
    x: &CpuStorage,
    lx: &Layout,
    gamma: &CpuStorage,
    lg: &Layout,
    dy: &CpuStorage,
    ldy: &Layout,
) -> Result<(CpuStorage, CpuStorage, Option<CpuStorage>)> {
    let (norm, stats) = (op.norm, &op.stats);
    let [rows, n] = rows_and_n(norm, lx.shape())?;
    expect_shape(backward_name(norm), lx.shape(), ldy)?;
    let (mean, rstd) = stats.host()?;
    let mut dx = zeroed::<T>(norm, rows * n)?;
    let mut weight_grads = zeroed::<W>(norm, params(norm) * n)?;
    let mut d_residual = match wide_stream::<T, R>() {
        true => Some(zeroed::<R>(norm, rows * n)?),
        false => None,
    };
    // dsum's storage stays read-locked while the pass reads it.
    let dsum = op.dsum.as_ref().map(Tensor::storage_and_layout);
    if n > 0 {
        let dsum = match &dsum {
            Some((storage, ls)) => {
                expect_shape(backward_name(norm), lx.shape(), ls)?;
                match &**storage {
                    Storage::Cpu(storage) => Some(In::Host(host::<R>(storage, ls)?)),
                    _ => return Err(moved()),
                }
            }
            None => None,
        };
        let (dgamma, dbeta) = weight_grads.split_at_mut(n);
        let o = BackwardOperands {
            x: In::Host(host::<R>(x, lx)?),
            dy: In::Host(host::<T>(dy, ldy)?),
            dsum,
            gamma: In::Host(host::<W>(gamma, lg)?),
            gamma_offset: op.gamma_offset,
            mean: In::Host(mean),
            rstd: In::Host(rstd),
            dx: Out::Host(&mut dx),
            dres: d_residual.as_deref_mut().map(Out::Host),
            dgamma: Some(Out::Host(dgamma)),
            dbeta: (norm == Norm::Layer).then_some(Out::Host(dbeta)),
        };
        let mode = BackwardMode::Deterministic;
        backward_rows(&Device::cpu(), norm, mode, rows, n, o).map_err(wrap(norm))?;
    }
    Ok((
        T::to_cpu_storage_owned(dx),
        W::to_cpu_storage_owned(weight_grads),
        d_residual.map(R::to_cpu_storage_owned),
    ))
}

/// dx, the weights' gradients and the residual's in candle's CUDA memory, as
/// [`backward_cpu`].
#[cfg(feature = "candle-cuda")]
fn backward_cuda<T: Element + CudaDType, W: Weight<T> + CudaDType, R: Stream<T> + CudaDType>(
    op: &Backward,
    x: &CudaStorage,
    lx: &Layout,
    gamma: &CudaStorage,
    lg: &Layout,
    dy: &CudaStorage,
    ldy: &Layout,
) -> Result<(CudaStorage, CudaStorage, Option<CudaStorage>)> {
    let (norm, stats) = (op.norm, &op.stats);
    let [rows, n] = rows_and_n(norm, lx.shape())?;
    expect_shape(backward_name(norm), lx.shape(), ldy)?;
    let (mean, rstd) = stats.cuda()?;
    let device = device_of(norm, &x.device)?;
    let stream = x.device.cuda_stream();
    let mut dx = cuda_out::<T>(norm, &stream, rows * n)?;
    let mut weight_grads = cuda_out::<W>(norm, &stream, params(norm) * n)?;
    let mut d_residual = match wide_stream::<T, R>() {
        true => Some(cuda_out::<R>(norm, &stream, rows * n)?),
        false => None,
    };
    // dsum's storage stays read-locked while the pass reads it.
    let dsum = op.dsum.as_ref().map(Tensor::storage_and_layout);
    if n > 0 {
        let dsum = match &dsum {
            Some((storage, ls)) => {
                expect_shape(backward_name(norm), lx.shape(), ls)?;
                match &**storage {
                    Storage::Cuda(storage) => {
                        Some(In::Cuda(cuda_in::<R>(&device, norm, "dsum", (storage, ls))?))
                    }
                    _ => return Err(moved()),
                }
            }
            None => None,
        };
        let (dgamma, dbeta) = weight_grads.split_at_mut(n);
        let o = BackwardOperands {
            x: In::Cuda(cuda_in::<R>(&device, norm, "x", (x, lx))?),
            dy: In::Cuda(cuda_in::<T>(&device, norm, "dy", (dy, ldy))?),
            dsum,
            gamma: In::Cuda(cuda_in::<W>(&device, norm, "gamma", (gamma, lg))?),
            gamma_offset: op.gamma_offset,
            mean: In::Cuda(mean.as_view()),
            rstd: In::Cuda(rstd.as_view()),
            dx: Out::Cuda(dx.as_view_mut()),
            dres: d_residual.as_mut().map(|d| Out::Cuda(d.as_view_mut())),
            dgamma: Some(Out::Cuda(dgamma)),
            dbeta: (norm == Norm::Layer).then_some(Out::Cuda(dbeta)),
        };
        let mode = BackwardMode::Deterministic;
        backward_rows(&device, norm, mode, rows, n, o).map_err(wrap(norm))?;
    }
    let dev = &x.device;
    Ok((
        CudaStorage::wrap_cuda_slice(dx, dev.clone()),
        CudaStorage::wrap_cuda_slice(weight_grads, dev.clone()),
        d_residual.map(|d| CudaStorage::wrap_cuda_slice(d, dev.clone())),
    ))
}
