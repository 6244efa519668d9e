//! RMSNorm: per row, rstd = 1 / sqrt(sum_j x_j^2 / n + eps) and y_j = x_j * rstd * gamma_j.
//!
//! The same op as [`LayerNorm`], with the rows not centered: the same checks, contexts,
//! devices and backward modes, and the same kernels compiled for RMSNorm (`rms_norm_*` in
//! kernels-gpu; the backward drops LayerNorm's mean(gamma * dy) term). This file is the
//! public face: the constructors RMSNorm has (a weight or none, never a bias), and the calls,
//! each handed to the shared op.

use ndarray::ArrayView1;

use crate::borrowed::{BorrowedTensor, BorrowedTensorMut};
use crate::device::Device;
use crate::element::{Element, F32Stream, Weight};
use crate::error::Result;
use crate::layer_norm::{BackwardMode, BorrowedGradients, Context, F32StreamContext, Gradients, LayerNorm};
use crate::plan::Norm;
use crate::tensor::Tensor;

/// RMSNorm over the last dimension of `[..., n]` inputs of type `T`, with weight gamma of
/// type `W` (`T`, or f32 beside f16 and bf16 x, as `RmsNorm<bf16, f32>`) or none (PyTorch's
/// `torch.nn.RMSNorm`, `elementwise_affine` true or false). Its contexts hold the per-row
/// rstd, and a mean of 0. Its gradients have no `dbeta`.
#[derive(Clone, Debug)]
pub struct RmsNorm<T: Element, W: Element = T> {
    op: LayerNorm<T, W>,
}

impl<T: Element, W: Weight<T>> RmsNorm<T, W> {
    /// An op with weight `gamma` (`[n]`) and `eps` (finite, > 0).
    pub fn new(gamma: Tensor<W>, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            op: LayerNorm::weighted(gamma, eps, Norm::Rms)?,
        })
    }

    /// An op without weight over rows of `n` on `device`: y = x * rstd, and the backward
    /// returns dx only.
    pub fn without_affine(device: &Device, n: usize, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            op: LayerNorm::unweighted(device, n, eps, Norm::Rms)?,
        })
    }

    /// Uploads `gamma` to `device`, then as [`RmsNorm::new`].
    pub fn from_array(device: &Device, gamma: ArrayView1<'_, W>, eps: f32) -> Result<Self> {
        Self::new(device.upload(gamma)?, eps)
    }

    /// The same op with backward mode `mode` (as [`LayerNorm::with_backward_mode`]).
    pub fn with_backward_mode(self, mode: BackwardMode) -> Result<Self> {
        Ok(RmsNorm {
            op: self.op.with_backward_mode(mode)?,
        })
    }

    /// The same op with a zero-centred weight: y = x * rstd * (1 + gamma), as Gemma keeps
    /// its RMSNorm weights (see [`LayerNorm::with_zero_centered_weight`]).
    pub fn with_zero_centered_weight(self) -> Result<Self> {
        Ok(RmsNorm {
            op: self.op.with_zero_centered_weight()?,
        })
    }

    /// Whether the weight is zero-centred.
    pub fn zero_centered_weight(&self) -> bool {
        self.op.zero_centered_weight()
    }

    /// The device its weight (or its rows) live on.
    pub fn device(&self) -> &Device {
        self.op.device()
    }

    /// Row length.
    pub fn n(&self) -> usize {
        self.op.n()
    }

    /// The weight, where the op has one.
    pub fn gamma(&self) -> Option<&Tensor<W>> {
        self.op.gamma()
    }

    pub fn eps(&self) -> f32 {
        self.op.eps()
    }

    pub fn backward_mode(&self) -> BackwardMode {
        self.op.backward_mode()
    }

    /// y for `x` (`[..., n]`), and the context the backward needs.
    pub fn forward(&self, x: &Tensor<T>) -> Result<(Tensor<T>, Context<T>)> {
        self.op.forward(x)
    }

    /// As [`RmsNorm::forward`], into `y` (x's shape).
    pub fn forward_into(&self, x: &Tensor<T>, y: &mut Tensor<T>) -> Result<Context<T>> {
        self.op.forward_into(x, y)
    }

    /// The residual add fused with the norm (as [`LayerNorm::forward_residual`]): s = x +
    /// residual, y = RMSNorm(s); returns y, s and the context (of s).
    pub fn forward_residual(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<T>,
    ) -> Result<(Tensor<T>, Tensor<T>, Context<T>)> {
        self.op.forward_residual(x, residual)
    }

    /// As [`RmsNorm::forward_residual`], into `y` and `sum` (x's shape).
    pub fn forward_residual_into(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<T>,
        y: &mut Tensor<T>,
        sum: &mut Tensor<T>,
    ) -> Result<Context<T>> {
        self.op.forward_residual_into(x, residual, y, sum)
    }

    /// As [`LayerNorm::forward_into_context`]: the statistics into an earlier call's
    /// context, allocating nothing where it holds them alone (for CUDA graphs).
    pub fn forward_into_context(&self, x: &Tensor<T>, y: &mut Tensor<T>, ctx: &mut Context<T>) -> Result<()> {
        self.op.forward_into_context(x, y, ctx)
    }

    /// As [`LayerNorm::forward_borrowed`]: on memory the caller keeps owning.
    pub fn forward_borrowed<'x>(
        &self,
        x: &BorrowedTensor<'x, T>,
        y: &mut BorrowedTensorMut<'_, T>,
    ) -> Result<Context<T, BorrowedTensor<'x, T>>> {
        self.op.forward_borrowed(x, y)
    }

    /// As [`LayerNorm::forward_residual_borrowed`]: s = x + residual into `sum`, y =
    /// RMSNorm(s), on memory the caller keeps owning; the context keeps `sum`.
    pub fn forward_residual_borrowed<'s>(
        &self,
        x: &BorrowedTensor<'_, T>,
        residual: &BorrowedTensor<'_, T>,
        y: &mut BorrowedTensorMut<'_, T>,
        sum: BorrowedTensorMut<'s, T>,
    ) -> Result<Context<T, BorrowedTensor<'s, T>>> {
        self.op.forward_residual_borrowed(x, residual, y, sum)
    }

    /// dx and, where the op has a weight, dgamma for upstream gradient `dy`.
    pub fn backward(&self, ctx: &Context<T>, dy: &Tensor<T>) -> Result<Gradients<T, W>> {
        self.op.backward(ctx, dy)
    }

    /// As [`RmsNorm::backward`], into `grads` (its `dbeta` must be `None`).
    pub fn backward_into(&self, ctx: &Context<T>, dy: &Tensor<T>, grads: &mut Gradients<T, W>) -> Result<()> {
        self.op.backward_into(ctx, dy, grads)
    }

    /// The backward of [`RmsNorm::forward_residual`] (as [`LayerNorm::backward_residual`]):
    /// dx (of x and of the residual alike) includes `dsum`, the gradient reaching s from the
    /// residual stream, where given.
    pub fn backward_residual(
        &self,
        ctx: &Context<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<T>>,
    ) -> Result<Gradients<T, W>> {
        self.op.backward_residual(ctx, dy, dsum)
    }

    /// As [`RmsNorm::backward_residual`], into `grads` (its `dbeta` must be `None`).
    pub fn backward_residual_into(
        &self,
        ctx: &Context<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<T>>,
        grads: &mut Gradients<T, W>,
    ) -> Result<()> {
        self.op.backward_residual_into(ctx, dy, dsum, grads)
    }

    /// As [`LayerNorm::backward_borrowed`]: on memory the caller keeps owning.
    pub fn backward_borrowed(
        &self,
        ctx: &Context<T, BorrowedTensor<'_, T>>,
        dy: &BorrowedTensor<'_, T>,
        grads: &mut BorrowedGradients<'_, T, W>,
    ) -> Result<()> {
        self.op.backward_borrowed(ctx, dy, grads)
    }

    /// As [`LayerNorm::backward_residual_borrowed`]: the backward of
    /// [`RmsNorm::forward_residual_borrowed`], dx including `dsum` where given.
    pub fn backward_residual_borrowed(
        &self,
        ctx: &Context<T, BorrowedTensor<'_, T>>,
        dy: &BorrowedTensor<'_, T>,
        dsum: Option<&BorrowedTensor<'_, T>>,
        grads: &mut BorrowedGradients<'_, T, W>,
    ) -> Result<()> {
        self.op.backward_residual_borrowed(ctx, dy, dsum, grads)
    }
}

/// The residual stream kept in f32 beside f16 or bf16 x, as [`LayerNorm`]'s
/// `forward_residual_f32` keeps it.
impl<T: F32Stream, W: Weight<T>> RmsNorm<T, W> {
    /// As [`LayerNorm::forward_residual_f32`]: s = x + residual in f32 (not rounded),
    /// y = RMSNorm(s) in x's type; returns y, s and the context (of s).
    pub fn forward_residual_f32(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<f32>,
    ) -> Result<(Tensor<T>, Tensor<f32>, F32StreamContext<T>)> {
        self.op.forward_residual_f32(x, residual)
    }

    /// As [`RmsNorm::forward_residual_f32`], into `y` and `sum` (x's shape).
    pub fn forward_residual_f32_into(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<f32>,
        y: &mut Tensor<T>,
        sum: &mut Tensor<f32>,
    ) -> Result<F32StreamContext<T>> {
        self.op.forward_residual_f32_into(x, residual, y, sum)
    }

    /// The backward of [`RmsNorm::forward_residual_f32`] (as
    /// [`LayerNorm::backward_residual_f32`]): the gradients, whose dx is x's, and the
    /// residual's gradient in f32.
    pub fn backward_residual_f32(
        &self,
        ctx: &F32StreamContext<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<f32>>,
    ) -> Result<(Gradients<T, W>, Tensor<f32>)> {
        self.op.backward_residual_f32(ctx, dy, dsum)
    }

    /// As [`RmsNorm::backward_residual_f32`], into `grads` (its `dbeta` must be `None`) and
    /// `d_residual` (dy's shape).
    pub fn backward_residual_f32_into(
        &self,
        ctx: &F32StreamContext<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<f32>>,
        grads: &mut Gradients<T, W>,
        d_residual: &mut Tensor<f32>,
    ) -> Result<()> {
        self.op
            .backward_residual_f32_into(ctx, dy, dsum, grads, d_residual)
    }

    /// As [`LayerNorm::forward_residual_f32_borrowed`]: on memory the caller keeps owning;
    /// the context keeps `sum` (f32).
    pub fn forward_residual_f32_borrowed<'s>(
        &self,
        x: &BorrowedTensor<'_, T>,
        residual: &BorrowedTensor<'_, f32>,
        y: &mut BorrowedTensorMut<'_, T>,
        sum: BorrowedTensorMut<'s, f32>,
    ) -> Result<Context<T, BorrowedTensor<'s, f32>>> {
        self.op.forward_residual_f32_borrowed(x, residual, y, sum)
    }

    /// As [`LayerNorm::backward_residual_f32_borrowed`]: the backward of
    /// [`RmsNorm::forward_residual_f32_borrowed`] on memory the caller keeps owning.
    pub fn backward_residual_f32_borrowed(
        &self,
        ctx: &Context<T, BorrowedTensor<'_, f32>>,
        dy: &BorrowedTensor<'_, T>,
        dsum: Option<&BorrowedTensor<'_, f32>>,
        grads: &mut BorrowedGradients<'_, T, W>,
        d_residual: &mut BorrowedTensorMut<'_, f32>,
    ) -> Result<()> {
        self.op
            .backward_residual_f32_borrowed(ctx, dy, dsum, grads, d_residual)
    }
}
