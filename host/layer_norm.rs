//! The LayerNorm op: checks every input, then runs on the device its tensors live on.
//!
//! Autograd-style, like `torch.autograd.Function`: `forward` returns y and a [`Context`]
//! holding what the backward needs; `backward(&ctx, &dy)` returns dx, dgamma and dbeta.
//! Inputs are `[..., n]`, normalized over the last dimension; the kernels see them as
//! `[rows, n]` with rows the product of the leading dimensions (a reshape, no copy).
//! Absent weights (PyTorch's `bias=False`, `elementwise_affine=False`) are constants on the
//! device that the kernels read as if given (ones for gamma, zeros for beta); the backward
//! then has no gradient for them to return.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};

use crate::borrowed::{BorrowedTensor, BorrowedTensorMut};
use crate::cpu;
use crate::device::{Device, Kind};
use crate::element::{Element, F32Stream, Weight};
use crate::error::{DriverContext, Error, Result};
use crate::gpu::launch::{Backward, Forward};
use crate::gpu::layer_norm as gpu;
use crate::plan::Norm;
use crate::stats::{ReturnTo, StatsPool};
use crate::tensor::{Data, Tensor, host_filled};

/// The largest row count and row length: the kernels index rows and columns with u32 and
/// step by up to 1024 past the end, so both stay below 2^31. Offsets are 64-bit, so
/// `rows * n` is limited only by memory.
pub const MAX_DIM: usize = (1 << 31) - 1;

/// How the backward sums dgamma and dbeta over rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackwardMode {
    /// Each block (on Hopper, for long rows, each cluster) sums its rows' partials and owns
    /// one partial row, and stage 2 adds the partial rows in a fixed order: bitwise
    /// identical results from run to run, no locks.
    #[default]
    Deterministic,
    /// The Triton tutorial's scheme of G groups under atomic spinlocks, taken once per
    /// block rather than once per row: each block sums its rows' partials, as in
    /// `Deterministic`, then adds them into group b mod G (Kahan-compensated) while it holds
    /// that group's lock; stage 2 adds the G groups. `None` picks G from n as the tutorial
    /// does (256 for n <= 1024, 128 to 4096, 96 to 8192, else 64), or more where the launch
    /// has many blocks: a group for every 2 blocks at most. G is never more than the blocks.
    /// The order in which blocks take a lock varies from run to run, so the last bits may
    /// too.
    Locked { groups: Option<u32> },
}

/// Everything the backward needs from a forward: x, and the per-row mean and rstd. `X` is
/// how x is kept: a [`Tensor`] (shared, no copy), or for
/// [`LayerNorm::forward_borrowed`] the caller's [`BorrowedTensor`], whose memory the
/// context then borrows until the backward.
#[derive(Clone, Debug)]
pub struct Context<T: Element, X = Tensor<T>> {
    op: u64,
    x: X,
    mean: Tensor<f32>,
    rstd: Tensor<f32>,
    /// Where mean and rstd go when the context drops: its op's next forward writes them.
    pool: ReturnTo,
    element: std::marker::PhantomData<T>,
}

impl<T: Element, X> Drop for Context<T, X> {
    fn drop(&mut self) {
        self.pool.give_back(&self.mean, &self.rstd);
    }
}

impl<T: Element, X> Context<T, X> {
    /// Per-row means, `[rows]` (rows: the product of x's leading dimensions).
    pub fn mean(&self) -> &Tensor<f32> {
        &self.mean
    }
    /// Per-row 1 / sqrt(var + eps), `[rows]`.
    pub fn rstd(&self) -> &Tensor<f32> {
        &self.rstd
    }
    /// The rows the forward normalized, which the backward reads: x, or s = x + residual
    /// after a residual forward (for [`LayerNorm::forward_residual_borrowed`], the borrow
    /// of s the context keeps, to read meanwhile, e.g. as the next block's residual).
    pub fn normalized(&self) -> &X {
        &self.x
    }
}

/// The context of a residual forward whose stream is kept in f32
/// ([`LayerNorm::forward_residual_f32`]): it holds s, in f32.
pub type F32StreamContext<T> = Context<T, Tensor<f32>>;

/// dx (the shape of x, of x's type `T`), and dgamma and dbeta (`[n]`, of the weights' type
/// `W`) for the parameters the LayerNorm has:
/// `None` where it has no gamma ([`LayerNorm::without_affine`]) or no beta
/// ([`LayerNorm::without_bias`]). As an output of [`LayerNorm::backward_into`], each must be
/// `Some` exactly where the LayerNorm has the parameter ([`Error::ParameterGradient`]).
#[derive(Clone, Debug)]
pub struct Gradients<T: Element, W: Element = T> {
    pub dx: Tensor<T>,
    pub dgamma: Option<Tensor<W>>,
    pub dbeta: Option<Tensor<W>>,
}

/// [`Gradients`] in memory of the caller's, for [`LayerNorm::backward_borrowed`].
#[derive(Debug)]
pub struct BorrowedGradients<'a, T: Element, W: Element = T> {
    pub dx: BorrowedTensorMut<'a, T>,
    pub dgamma: Option<BorrowedTensorMut<'a, W>>,
    pub dbeta: Option<BorrowedTensorMut<'a, W>>,
}

/// A weight or bias of the op: the caller's, or the constant that stands in for an absent
/// one (ones for gamma, zeros for beta), which the kernels read as if it were given.
#[derive(Clone, Debug)]
enum Param<W: Element> {
    Given(Tensor<W>),
    Absent(Tensor<W>),
}

impl<W: Element> Param<W> {
    /// What the kernels read.
    fn tensor(&self) -> &Tensor<W> {
        match self {
            Param::Given(t) | Param::Absent(t) => t,
        }
    }

    fn given(&self) -> Option<&Tensor<W>> {
        match self {
            Param::Given(t) => Some(t),
            Param::Absent(_) => None,
        }
    }
}

/// LayerNorm over the last dimension of `[..., n]` inputs of type `T`, with weight gamma and
/// bias beta (either may be absent, as in PyTorch's `bias=False` and
/// `elementwise_affine=False`) of type `W`: `T`, or f32 beside f16 and bf16 x ([`Weight`]),
/// as `LayerNorm<f16, f32>`.
#[derive(Clone, Debug)]
pub struct LayerNorm<T: Element, W: Element = T> {
    id: u64,
    n: usize,
    gamma: Param<W>,
    beta: Param<W>,
    eps: f32,
    /// Added to each gamma_j as it is read: [`PLAIN_WEIGHT`] or [`ZERO_CENTERED_WEIGHT`].
    gamma_offset: f32,
    mode: BackwardMode,
    /// LayerNorm, or RMSNorm (`crate::rms_norm::RmsNorm` is this op with `Norm::Rms`).
    norm: Norm,
    /// The type of x, y, dy and dx.
    rows: std::marker::PhantomData<fn() -> T>,
    /// Mean and rstd tensors of dropped contexts, for the next forward (crate::stats).
    stats: Arc<StatsPool>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl<T: Element, W: Weight<T>> LayerNorm<T, W> {
    /// An op with `gamma`, `beta` (both `[n]`, on one device) and `eps` (finite, > 0).
    pub fn new(gamma: Tensor<W>, beta: Tensor<W>, eps: f32) -> Result<Self> {
        let [n] = gamma.dims1("gamma")?;
        beta.expect_shape("beta", &[n])?;
        gamma.device().check("beta", &beta)?;
        Self::build(n, Param::Given(gamma), Param::Given(beta), eps, Norm::Layer)
    }

    /// An op with weight `gamma` (`[n]`) and no bias (PyTorch's `bias=False`): y = xhat *
    /// gamma, and the backward's [`Gradients::dbeta`] is `None`.
    pub fn without_bias(gamma: Tensor<W>, eps: f32) -> Result<Self> {
        Self::weighted(gamma, eps, Norm::Layer)
    }

    /// An op with neither weight nor bias over rows of `n` on `device` (PyTorch's
    /// `elementwise_affine=False`): y = xhat, and the backward returns dx only.
    pub fn without_affine(device: &Device, n: usize, eps: f32) -> Result<Self> {
        Self::unweighted(device, n, eps, Norm::Layer)
    }

    /// `norm` over rows of `n` with neither weight nor bias.
    pub(crate) fn unweighted(device: &Device, n: usize, eps: f32, norm: Norm) -> Result<Self> {
        check_config(n, eps)?;
        let ones = device.full(&[n], W::from_f32(1.0))?;
        let zeros = device.zeros(&[n])?;
        Self::build(n, Param::Absent(ones), Param::Absent(zeros), eps, norm)
    }

    /// `norm` with weight `gamma` and no bias.
    pub(crate) fn weighted(gamma: Tensor<W>, eps: f32, norm: Norm) -> Result<Self> {
        let [n] = gamma.dims1("gamma")?;
        check_config(n, eps)?;
        let zeros = gamma.device().zeros(&[n])?;
        Self::build(n, Param::Given(gamma), Param::Absent(zeros), eps, norm)
    }

    fn build(n: usize, gamma: Param<W>, beta: Param<W>, eps: f32, norm: Norm) -> Result<Self> {
        check_config(n, eps)?;
        if let Kind::Cuda(g) = &gamma.tensor().device().kind {
            // The op's kernels are loaded (JIT-compiled, the first time on this device) here,
            // not at its first call: that may be inside a CUDA graph capture, or timed.
            g.kernels.of_norm::<T, W>(norm)?;
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(LayerNorm {
            id,
            n,
            gamma,
            beta,
            eps,
            gamma_offset: PLAIN_WEIGHT,
            mode: BackwardMode::default(),
            norm,
            rows: std::marker::PhantomData,
            stats: Arc::default(),
        })
    }

    /// Uploads `gamma` and `beta` to `device`, then as [`LayerNorm::new`].
    pub fn from_arrays(
        device: &Device,
        gamma: ArrayView1<'_, W>,
        beta: ArrayView1<'_, W>,
        eps: f32,
    ) -> Result<Self> {
        Self::new(device.upload(gamma)?, device.upload(beta)?, eps)
    }

    /// Chooses how the backward sums dgamma and dbeta.
    pub fn with_backward_mode(mut self, mode: BackwardMode) -> Result<Self> {
        if let BackwardMode::Locked { groups: Some(0) } = mode {
            return Err(Error::BadGroups(0));
        }
        self.mode = mode;
        Ok(self)
    }

    /// The same op with a zero-centred weight: gamma holds each weight's distance from 1,
    /// and y = xhat * (1 + gamma) + beta, 1 + gamma formed in f32 as the weight is read (so
    /// a small f16 or bf16 gamma keeps its precision). dgamma is unchanged, since d(1 +
    /// gamma) / dgamma = 1. Gemma's RMSNorm, flash-attention's `zero_centered_weight` and
    /// QuACK's `weight_offset = 1` keep weights so. An op without a weight
    /// ([`LayerNorm::without_affine`]) has nothing to centre: [`Error::NoWeight`].
    pub fn with_zero_centered_weight(mut self) -> Result<Self> {
        if self.gamma.given().is_none() {
            return Err(Error::NoWeight);
        }
        self.gamma_offset = ZERO_CENTERED_WEIGHT;
        Ok(self)
    }

    /// Whether the weight is zero-centred ([`LayerNorm::with_zero_centered_weight`]).
    pub fn zero_centered_weight(&self) -> bool {
        self.gamma_offset == ZERO_CENTERED_WEIGHT
    }

    pub fn device(&self) -> &Device {
        self.gamma.tensor().device()
    }
    /// The length of the normalized (last) dimension.
    pub fn n(&self) -> usize {
        self.n
    }
    /// The weight, where the op has one.
    pub fn gamma(&self) -> Option<&Tensor<W>> {
        self.gamma.given()
    }
    /// The bias, where the op has one.
    pub fn beta(&self) -> Option<&Tensor<W>> {
        self.beta.given()
    }
    pub fn eps(&self) -> f32 {
        self.eps
    }
    pub fn backward_mode(&self) -> BackwardMode {
        self.mode
    }

    /// y = LayerNorm(x) for x `[..., n]` (y of the same shape), and the context for the
    /// backward.
    pub fn forward(&self, x: &Tensor<T>) -> Result<(Tensor<T>, Context<T>)> {
        let mut y = self.device().empty(x.shape())?;
        let ctx = self.forward_into(x, &mut y)?;
        Ok((y, ctx))
    }

    /// As [`LayerNorm::forward`], writing y into `y` (same shape as x, a whole tensor and its
    /// storage's sole handle, even where x is empty).
    pub fn forward_into(&self, x: &Tensor<T>, y: &mut Tensor<T>) -> Result<Context<T>> {
        let (mean, rstd) = self.forward_tensors::<T>(x, None, y)?;
        Ok(self.context(x.clone(), mean, rstd))
    }

    /// The residual add of a pre-norm block fused with the norm, in one pass over memory:
    ///   s = x + residual   (each element summed in f32 and rounded once to `T`)
    ///   y = norm(s)
    /// for x and residual `[..., n]` of one shape. Returns y, s (the residual stream's next
    /// value) and the context, which holds s: the backward
    /// ([`LayerNorm::backward_residual`]) differentiates through s, and its dx is the
    /// gradient of x and of the residual alike.
    pub fn forward_residual(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<T>,
    ) -> Result<(Tensor<T>, Tensor<T>, Context<T>)> {
        let mut y = self.device().empty(x.shape())?;
        let mut sum = self.device().empty(x.shape())?;
        let ctx = self.forward_residual_into(x, residual, &mut y, &mut sum)?;
        Ok((y, sum, ctx))
    }

    /// As [`LayerNorm::forward_residual`], writing y and s into `y` and `sum` (x's shape,
    /// whole tensors, each its storage's sole handle).
    pub fn forward_residual_into(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<T>,
        y: &mut Tensor<T>,
        sum: &mut Tensor<T>,
    ) -> Result<Context<T>> {
        let (mean, rstd) = self.forward_tensors(x, Some((residual, &mut *sum)), y)?;
        Ok(self.context(sum.clone(), mean, rstd))
    }

    /// [`LayerNorm::forward_into`] and the residual forwards, with a residual stream of
    /// `R`: checks the tensors, queues the forward, and returns the statistics for the
    /// context (which holds x, or s where there is a residual).
    fn forward_tensors<R: cpu::Stream<T>>(
        &self,
        x: &Tensor<T>,
        residual: Option<(&Tensor<R>, &mut Tensor<R>)>,
        y: &mut Tensor<T>,
    ) -> Result<(Tensor<f32>, Tensor<f32>)> {
        let [rows, n] = self.check_input("x", x)?;
        y.expect_shape("y", x.shape())?;
        self.device().check("y", y)?;
        if let Some((r, s)) = &residual {
            self.check_input("residual", r)?;
            r.expect_shape("residual", x.shape())?;
            s.expect_shape("sum", x.shape())?;
            self.device().check("sum", s)?;
        }
        // Refused whatever the shape, as the backward refuses its outputs, even where
        // nothing would be written.
        let y = y.data_mut("y")?;
        let (residual, mut sum) = residual.unzip();
        let sum_d = sum.as_mut().map(|s| s.data_mut("sum")).transpose()?;
        let dev = self.device();
        let (mut mean, mut rstd) = self.stats(rows)?;
        if rows > 0 && n > 0 {
            let (mean_d, rstd_d) = (mean.data_mut("mean")?, rstd.data_mut("rstd")?);
            let residual = match (residual, sum_d) {
                (Some(r), Some(s)) => Some((input(dev, r)?, output(dev, s)?)),
                _ => None,
            };
            let x = input(dev, x)?;
            let y = output(dev, y)?;
            self.run_forward(
                rows,
                n,
                x,
                residual,
                y,
                output(dev, mean_d)?,
                output(dev, rstd_d)?,
            )?;
        }
        Ok((mean, rstd))
    }

    /// As [`LayerNorm::forward_into`], writing the statistics into `ctx`'s own mean and
    /// rstd, which then becomes this call's context (of x). Where `ctx` came from a forward
    /// of as many rows and holds its tensors' sole handles, the call allocates nothing and
    /// asks the driver nothing: the form a captured CUDA graph needs, whose replays write
    /// the memory the capture saw. Otherwise the statistics go to new tensors, as in
    /// `forward_into`.
    ///
    /// Errors as `forward_into`, and [`Error::ForeignContext`] for a context of another
    /// op; a call refused for its arguments leaves `ctx` as it was.
    pub fn forward_into_context(&self, x: &Tensor<T>, y: &mut Tensor<T>, ctx: &mut Context<T>) -> Result<()> {
        if ctx.op != self.id {
            return Err(Error::ForeignContext);
        }
        let [rows, n] = self.check_input("x", x)?;
        y.expect_shape("y", x.shape())?;
        self.device().check("y", y)?;
        let y = y.data_mut("y")?;
        let dev = self.device();
        let writable = |t: &mut Tensor<f32>| t.shape() == [rows] && t.data_mut("").is_ok();
        let reuse = n > 0 && writable(&mut ctx.mean) && writable(&mut ctx.rstd);
        let mut fresh = if reuse { None } else { Some(self.stats(rows)?) };
        let (mean, rstd) = match &mut fresh {
            Some((mean, rstd)) => (mean, rstd),
            None => (&mut ctx.mean, &mut ctx.rstd),
        };
        if rows > 0 && n > 0 {
            let (mean_d, rstd_d) = (mean.data_mut("mean")?, rstd.data_mut("rstd")?);
            let x = input(dev, x)?;
            let y = output(dev, y)?;
            self.run_forward::<T>(rows, n, x, None, y, output(dev, mean_d)?, output(dev, rstd_d)?)?;
        }
        if let Some((mean, rstd)) = fresh {
            (ctx.mean, ctx.rstd) = (mean, rstd);
        }
        ctx.x = x.clone();
        Ok(())
    }

    /// As [`LayerNorm::forward_into`], on memory that stays the caller's: x and y are
    /// borrows of `CudaView`s / `CudaViewMut`s in this op's CUDA context (same shape,
    /// `[..., n]`), read and written on this op's device's stream, with no copy and no host
    /// wait. The context borrows x until the backward
    /// ([`LayerNorm::backward_borrowed`]); its mean and rstd are this crate's tensors.
    ///
    /// Errors as `forward_into`, and [`Error::NotCuda`] on a CPU device,
    /// [`Error::ContextMismatch`] or [`Error::DeviceMismatch`] for memory of another
    /// context or GPU.
    pub fn forward_borrowed<'x>(
        &self,
        x: &BorrowedTensor<'x, T>,
        y: &mut BorrowedTensorMut<'_, T>,
    ) -> Result<Context<T, BorrowedTensor<'x, T>>> {
        let (mean, rstd) = self.run_borrowed::<T>(x, None, y)?;
        Ok(self.context(x.clone(), mean, rstd))
    }

    /// [`LayerNorm::forward_residual_into`] on memory that stays the caller's, as
    /// [`LayerNorm::forward_borrowed`]: s = x + residual into `sum`, y = norm(s) into `y`
    /// (all four x's shape, in this op's CUDA context). The context keeps `sum`, read-only
    /// from here on, for the backward ([`LayerNorm::backward_residual_borrowed`]);
    /// [`Context::normalized`] lends it out meanwhile, e.g. as the next block's residual.
    ///
    /// Errors as `forward_residual_into` and `forward_borrowed`; `sum` is then given up
    /// unwritten.
    pub fn forward_residual_borrowed<'s>(
        &self,
        x: &BorrowedTensor<'_, T>,
        residual: &BorrowedTensor<'_, T>,
        y: &mut BorrowedTensorMut<'_, T>,
        mut sum: BorrowedTensorMut<'s, T>,
    ) -> Result<Context<T, BorrowedTensor<'s, T>>> {
        let (mean, rstd) = self.run_borrowed(x, Some((residual, &mut sum)), y)?;
        Ok(self.context(sum.into_shared(), mean, rstd))
    }

    /// The borrowed forwards: checks the borrows (a residual and its sum where given) and
    /// queues the kernel; returns the statistics.
    fn run_borrowed<R: cpu::Stream<T>>(
        &self,
        x: &BorrowedTensor<'_, T>,
        residual: Option<(&BorrowedTensor<'_, R>, &mut BorrowedTensorMut<'_, R>)>,
        y: &mut BorrowedTensorMut<'_, T>,
    ) -> Result<(Tensor<f32>, Tensor<f32>)> {
        let dev = self.device();
        dev.check_context("x", x.context())?;
        let [rows, n] = self.rows_and_n("x", x.shape())?;
        expect_same_shape("y", y.shape(), x.shape())?;
        dev.check_context("y", y.context())?;
        if let Some((r, s)) = &residual {
            expect_same_shape("residual", r.shape(), x.shape())?;
            dev.check_context("residual", r.context())?;
            expect_same_shape("sum", s.shape(), x.shape())?;
            dev.check_context("sum", s.context())?;
        }
        let (mut mean, mut rstd) = self.stats(rows)?;
        if rows > 0 && n > 0 {
            let (mean_d, rstd_d) = (mean.data_mut("mean")?, rstd.data_mut("rstd")?);
            let residual = residual.map(|(r, s)| (In::Cuda(r.cuda_view()), Out::Cuda(s.view_mut())));
            let (x, y) = (In::Cuda(x.cuda_view()), Out::Cuda(y.view_mut()));
            self.run_forward(
                rows,
                n,
                x,
                residual,
                y,
                output(dev, mean_d)?,
                output(dev, rstd_d)?,
            )?;
        }
        Ok((mean, rstd))
    }

    fn context<X>(&self, x: X, mean: Tensor<f32>, rstd: Tensor<f32>) -> Context<T, X> {
        Context {
            op: self.id,
            x,
            mean,
            rstd,
            pool: ReturnTo::new(&self.stats),
            element: std::marker::PhantomData,
        }
    }

    /// Per-row mean and rstd tensors of `rows` for a forward to write: a pair a dropped
    /// context gave back ([`StatsPool`]), or new ones. The kernels write every row's
    /// statistics; those of an empty row are undefined: NaN, as 0/0 gives. (Filling from
    /// the host would cost a copy per call.)
    fn stats(&self, rows: usize) -> Result<(Tensor<f32>, Tensor<f32>)> {
        let dev = self.device();
        if self.n == 0 {
            return Ok((dev.full(&[rows], f32::NAN)?, dev.full(&[rows], f32::NAN)?));
        }
        match self.stats.take(rows) {
            Some(kept) => Ok(kept),
            None => Ok((dev.empty::<f32>(&[rows])?, dev.empty::<f32>(&[rows])?)),
        }
    }

    /// The forward of `[rows, n]` (both >= 1) with this op's parameters, on memory already
    /// checked and ordered for the op's stream.
    #[allow(clippy::too_many_arguments)]
    fn run_forward<'a, R: cpu::Stream<T>>(
        &self,
        rows: usize,
        n: usize,
        x: In<'a, T>,
        residual: Option<(In<'a, R>, Out<'a, R>)>,
        y: Out<'a, T>,
        mean: Out<'a, f32>,
        rstd: Out<'a, f32>,
    ) -> Result<()> {
        let dev = self.device();
        let (gamma, beta) = (input(dev, self.gamma.tensor())?, input(dev, self.beta.tensor())?);
        let o = ForwardOperands {
            x,
            residual,
            gamma,
            gamma_offset: self.gamma_offset,
            beta,
            y,
            mean,
            rstd,
        };
        forward_rows(dev, self.norm, self.eps, rows, n, o)
    }

    /// dx, and dgamma and dbeta for the parameters the op has, for upstream gradient `dy`
    /// (the shape of x).
    pub fn backward(&self, ctx: &Context<T>, dy: &Tensor<T>) -> Result<Gradients<T, W>> {
        self.backward_residual(ctx, dy, None)
    }

    /// As [`LayerNorm::backward`], writing into `grads` (shapes as `backward` returns them;
    /// dgamma and dbeta `Some` exactly where the op has gamma and beta).
    pub fn backward_into(&self, ctx: &Context<T>, dy: &Tensor<T>, grads: &mut Gradients<T, W>) -> Result<()> {
        self.backward_residual_into(ctx, dy, None, grads)
    }

    /// The backward of [`LayerNorm::forward_residual`]: `dy` is y's gradient, and `dsum`
    /// the gradient that reaches s from the residual stream (the next block's input), where
    /// there is one. dx = d/ds (through the norm) + dsum, which is the gradient of both x
    /// and the residual; dgamma and dbeta as [`LayerNorm::backward`]'s. With `dsum` `None`
    /// this is `backward`.
    pub fn backward_residual(
        &self,
        ctx: &Context<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<T>>,
    ) -> Result<Gradients<T, W>> {
        let dev = self.device();
        let n = self.n;
        let param_grad = |p: &Param<W>| p.given().map(|_| dev.empty(&[n])).transpose();
        let mut grads = Gradients {
            dx: dev.empty(dy.shape())?,
            dgamma: param_grad(&self.gamma)?,
            dbeta: param_grad(&self.beta)?,
        };
        self.backward_residual_into(ctx, dy, dsum, &mut grads)?;
        Ok(grads)
    }

    /// As [`LayerNorm::backward_residual`], writing into `grads` (as
    /// [`LayerNorm::backward_into`]).
    pub fn backward_residual_into(
        &self,
        ctx: &Context<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<T>>,
        grads: &mut Gradients<T, W>,
    ) -> Result<()> {
        self.backward_tensors(ctx, dy, dsum, grads, None)
    }

    /// The backward of a context of rows of `R` (x, or s), with `dres` exactly where `R` is
    /// wider than `T`: checks the tensors and queues the backward.
    fn backward_tensors<R: cpu::Stream<T>>(
        &self,
        ctx: &Context<T, Tensor<R>>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<R>>,
        grads: &mut Gradients<T, W>,
        dres: Option<&mut Tensor<R>>,
    ) -> Result<()> {
        if ctx.op != self.id {
            return Err(Error::ForeignContext);
        }
        let [rows, n] = self.check_input("dy", dy)?;
        dy.expect_shape("dy", ctx.x.shape())?;
        if let Some(d) = dsum {
            self.check_input("dsum", d)?;
            d.expect_shape("dsum", ctx.x.shape())?;
        }
        grads.dx.expect_shape("dx", dy.shape())?;
        self.check_param_grad("dgamma", &self.gamma, grads.dgamma.as_ref().map(Tensor::shape))?;
        self.check_param_grad("dbeta", &self.beta, grads.dbeta.as_ref().map(Tensor::shape))?;
        let dev = self.device();
        dev.check("dx", &grads.dx)?;
        for (what, t) in [("dgamma", grads.dgamma.as_ref()), ("dbeta", grads.dbeta.as_ref())] {
            if let Some(t) = t {
                dev.check(what, t)?;
            }
        }
        if let Some(d) = &dres {
            d.expect_shape("d_residual", dy.shape())?;
            dev.check("d_residual", d)?;
        }
        let dx = grads.dx.data_mut("dx")?;
        let dgamma = grads.dgamma.as_mut().map(|t| t.data_mut("dgamma")).transpose()?;
        let dbeta = grads.dbeta.as_mut().map(|t| t.data_mut("dbeta")).transpose()?;
        let dres = dres.map(|t| t.data_mut("d_residual")).transpose()?;
        if n == 0 {
            return Ok(());
        }
        backward_rows(
            dev,
            self.norm,
            self.mode,
            rows,
            n,
            BackwardOperands {
                x: input(dev, &ctx.x)?,
                dy: input(dev, dy)?,
                dsum: dsum.map(|d| input(dev, d)).transpose()?,
                gamma: input(dev, self.gamma.tensor())?,
                gamma_offset: self.gamma_offset,
                mean: input(dev, &ctx.mean)?,
                rstd: input(dev, &ctx.rstd)?,
                dx: output(dev, dx)?,
                dres: dres.map(|d| output(dev, d)).transpose()?,
                dgamma: dgamma.map(|d| output(dev, d)).transpose()?,
                dbeta: dbeta.map(|d| output(dev, d)).transpose()?,
            },
        )
    }

    /// As [`LayerNorm::backward_into`], on memory that stays the caller's: the context of
    /// [`LayerNorm::forward_borrowed`] (which still borrows x), dy and the gradients as
    /// borrows in this op's CUDA context, read and written on this op's device's stream,
    /// with no copy and no host wait. Errors as `backward_into` and `forward_borrowed`.
    pub fn backward_borrowed(
        &self,
        ctx: &Context<T, BorrowedTensor<'_, T>>,
        dy: &BorrowedTensor<'_, T>,
        grads: &mut BorrowedGradients<'_, T, W>,
    ) -> Result<()> {
        self.backward_residual_borrowed(ctx, dy, None, grads)
    }

    /// The backward of [`LayerNorm::forward_residual_borrowed`] (as
    /// [`LayerNorm::backward_residual_into`]) on memory that stays the caller's: dx, the
    /// gradient of x and of the residual alike, includes `dsum` where given. Errors as
    /// `backward_residual_into` and `backward_borrowed`. With `dsum` `None` this is
    /// `backward_borrowed`.
    pub fn backward_residual_borrowed(
        &self,
        ctx: &Context<T, BorrowedTensor<'_, T>>,
        dy: &BorrowedTensor<'_, T>,
        dsum: Option<&BorrowedTensor<'_, T>>,
        grads: &mut BorrowedGradients<'_, T, W>,
    ) -> Result<()> {
        self.backward_borrowed_rows(ctx, dy, dsum, grads, None)
    }

    /// The borrowed backwards, of a context of rows of `R`, with `dres` exactly where `R` is
    /// wider than `T`: checks the borrows and queues the backward.
    fn backward_borrowed_rows<R: cpu::Stream<T>>(
        &self,
        ctx: &Context<T, BorrowedTensor<'_, R>>,
        dy: &BorrowedTensor<'_, T>,
        dsum: Option<&BorrowedTensor<'_, R>>,
        grads: &mut BorrowedGradients<'_, T, W>,
        mut dres: Option<&mut BorrowedTensorMut<'_, R>>,
    ) -> Result<()> {
        if ctx.op != self.id {
            return Err(Error::ForeignContext);
        }
        let dev = self.device();
        dev.check_context("dy", dy.context())?;
        let [rows, n] = self.rows_and_n("dy", dy.shape())?;
        expect_same_shape("dy", dy.shape(), ctx.x.shape())?;
        if let Some(d) = dsum {
            expect_same_shape("dsum", d.shape(), ctx.x.shape())?;
            dev.check_context("dsum", d.context())?;
        }
        expect_same_shape("dx", grads.dx.shape(), dy.shape())?;
        self.check_param_grad("dgamma", &self.gamma, grads.dgamma.as_ref().map(|t| t.shape()))?;
        self.check_param_grad("dbeta", &self.beta, grads.dbeta.as_ref().map(|t| t.shape()))?;
        dev.check_context("dx", grads.dx.context())?;
        for (what, t) in [("dgamma", &grads.dgamma), ("dbeta", &grads.dbeta)] {
            if let Some(t) = t {
                dev.check_context(what, t.context())?;
            }
        }
        if let Some(d) = &dres {
            expect_same_shape("d_residual", d.shape(), dy.shape())?;
            dev.check_context("d_residual", d.context())?;
        }
        if n == 0 {
            return Ok(());
        }
        backward_rows(
            dev,
            self.norm,
            self.mode,
            rows,
            n,
            BackwardOperands {
                x: In::Cuda(ctx.x.cuda_view()),
                dy: In::Cuda(dy.cuda_view()),
                dsum: dsum.map(|d| In::Cuda(d.cuda_view())),
                gamma: input(dev, self.gamma.tensor())?,
                gamma_offset: self.gamma_offset,
                mean: input(dev, &ctx.mean)?,
                rstd: input(dev, &ctx.rstd)?,
                dx: Out::Cuda(grads.dx.view_mut()),
                dres: dres.as_mut().map(|d| Out::Cuda(d.view_mut())),
                dgamma: grads.dgamma.as_mut().map(|t| Out::Cuda(t.view_mut())),
                dbeta: grads.dbeta.as_mut().map(|t| Out::Cuda(t.view_mut())),
            },
        )
    }

    /// `[rows, n]` of an input `[..., n]`, on this op's device.
    fn check_input<E: Element>(&self, what: &'static str, t: &Tensor<E>) -> Result<[usize; 2]> {
        let dims = self.rows_and_n(what, t.shape())?;
        self.device().check(what, t)?;
        Ok(dims)
    }

    /// `[rows, n]` of an input of `shape` `[..., n]`: n its last dimension (the op's), rows
    /// the product of the others (1 for a 1-D input).
    fn rows_and_n(&self, what: &'static str, shape: &[usize]) -> Result<[usize; 2]> {
        let refused = || Error::Shape {
            what,
            got: shape.to_vec(),
            expected: format!(
                "[..., {}] (n = the LayerNorm's, leading dimensions whose product fits usize)",
                self.n
            ),
        };
        let Some((&n, leading)) = shape.split_last() else {
            return Err(refused());
        };
        if n != self.n {
            return Err(refused());
        }
        let rows = leading
            .iter()
            .try_fold(1usize, |rows, &d| rows.checked_mul(d))
            .ok_or_else(refused)?;
        check_dim("rows", rows)?;
        Ok([rows, n])
    }

    /// Refuses a gradient output for a parameter the op lacks, a missing one for a
    /// parameter it has, and one not `[n]`.
    fn check_param_grad(&self, what: &'static str, param: &Param<W>, grad: Option<&[usize]>) -> Result<()> {
        match (param.given().is_some(), grad) {
            (true, Some(shape)) => expect_same_shape(what, shape, &[self.n]),
            (false, None) => Ok(()),
            (op_has_parameter, _) => Err(Error::ParameterGradient {
                what,
                op_has_parameter,
            }),
        }
    }
}

/// The residual stream kept in f32 beside f16 or bf16 x ([`F32Stream`]), as
/// flash-attention's `residual_in_fp32` keeps it: the sum the stream carries from block to
/// block is not rounded to x's type at every layer.
impl<T: F32Stream, W: Weight<T>> LayerNorm<T, W> {
    /// As [`LayerNorm::forward_residual`], with the residual and s in f32:
    ///   s = x + residual   (x widened to f32, the sum in f32, not rounded)
    ///   y = norm(s)        (in x's type)
    /// Returns y, s and the context, which holds s.
    pub fn forward_residual_f32(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<f32>,
    ) -> Result<(Tensor<T>, Tensor<f32>, F32StreamContext<T>)> {
        let mut y = self.device().empty(x.shape())?;
        let mut sum = self.device().empty(x.shape())?;
        let ctx = self.forward_residual_f32_into(x, residual, &mut y, &mut sum)?;
        Ok((y, sum, ctx))
    }

    /// As [`LayerNorm::forward_residual_f32`], writing y and s into `y` and `sum` (x's
    /// shape, whole tensors, each its storage's sole handle).
    pub fn forward_residual_f32_into(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<f32>,
        y: &mut Tensor<T>,
        sum: &mut Tensor<f32>,
    ) -> Result<F32StreamContext<T>> {
        let (mean, rstd) = self.forward_tensors(x, Some((residual, &mut *sum)), y)?;
        Ok(self.context(sum.clone(), mean, rstd))
    }

    /// The backward of [`LayerNorm::forward_residual_f32`]: `dy` is y's gradient (x's
    /// type), and `dsum` the gradient that reaches s from the residual stream (f32), where
    /// there is one. Returns the gradients, whose dx (x's type) is the gradient of x, and
    /// the residual's gradient: the same values in f32, unrounded (x's branch takes them in
    /// x's type, the stream in its own).
    pub fn backward_residual_f32(
        &self,
        ctx: &F32StreamContext<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<f32>>,
    ) -> Result<(Gradients<T, W>, Tensor<f32>)> {
        let dev = self.device();
        let n = self.n;
        let param_grad = |p: &Param<W>| p.given().map(|_| dev.empty(&[n])).transpose();
        let mut grads = Gradients {
            dx: dev.empty(dy.shape())?,
            dgamma: param_grad(&self.gamma)?,
            dbeta: param_grad(&self.beta)?,
        };
        let mut d_residual = dev.empty(dy.shape())?;
        self.backward_residual_f32_into(ctx, dy, dsum, &mut grads, &mut d_residual)?;
        Ok((grads, d_residual))
    }

    /// As [`LayerNorm::backward_residual_f32`], writing into `grads` (as
    /// [`LayerNorm::backward_into`]) and `d_residual` (dy's shape, a whole tensor, its
    /// storage's sole handle).
    pub fn backward_residual_f32_into(
        &self,
        ctx: &F32StreamContext<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<f32>>,
        grads: &mut Gradients<T, W>,
        d_residual: &mut Tensor<f32>,
    ) -> Result<()> {
        self.backward_tensors(ctx, dy, dsum, grads, Some(d_residual))
    }

    /// [`LayerNorm::forward_residual_f32_into`] on memory that stays the caller's, as
    /// [`LayerNorm::forward_residual_borrowed`]: x and y of x's type, the residual and
    /// `sum` of f32; the context keeps `sum` for
    /// [`LayerNorm::backward_residual_f32_borrowed`].
    pub fn forward_residual_f32_borrowed<'s>(
        &self,
        x: &BorrowedTensor<'_, T>,
        residual: &BorrowedTensor<'_, f32>,
        y: &mut BorrowedTensorMut<'_, T>,
        mut sum: BorrowedTensorMut<'s, f32>,
    ) -> Result<Context<T, BorrowedTensor<'s, f32>>> {
        let (mean, rstd) = self.run_borrowed(x, Some((residual, &mut sum)), y)?;
        Ok(self.context(sum.into_shared(), mean, rstd))
    }

    /// The backward of [`LayerNorm::forward_residual_f32_borrowed`] (as
    /// [`LayerNorm::backward_residual_f32_into`]) on memory that stays the caller's: dsum
    /// and `d_residual` of f32, dy and the gradients as [`LayerNorm::backward_borrowed`]'s.
    pub fn backward_residual_f32_borrowed(
        &self,
        ctx: &Context<T, BorrowedTensor<'_, f32>>,
        dy: &BorrowedTensor<'_, T>,
        dsum: Option<&BorrowedTensor<'_, f32>>,
        grads: &mut BorrowedGradients<'_, T, W>,
        d_residual: &mut BorrowedTensorMut<'_, f32>,
    ) -> Result<()> {
        self.backward_borrowed_rows(ctx, dy, dsum, grads, Some(d_residual))
    }
}

/// The forward of `[rows, n]` (both >= 1) on memory already checked and ordered for the
/// stream of `dev`: the op's core, shared by [`LayerNorm`] and the candle ops, which check
/// their operands each their own way.
pub(crate) fn forward_rows<T: Element, W: Weight<T>, R: cpu::Stream<T>>(
    dev: &Device,
    norm: Norm,
    eps: f32,
    rows: usize,
    n: usize,
    o: ForwardOperands<'_, T, W, R>,
) -> Result<()> {
    let ForwardOperands {
        x,
        residual,
        gamma,
        gamma_offset,
        beta,
        y,
        mean,
        rstd,
    } = o;
    match (x, gamma, beta, y, mean, rstd, &dev.kind) {
        (In::Host(x), In::Host(gamma), In::Host(beta), Out::Host(y), Out::Host(mean), Out::Host(rstd), _) => {
            // With a residual, s is formed row by row and normalized as x would be.
            let residual = match residual {
                Some((In::Host(r), Out::Host(s))) => Some((rows_of(r, rows, n), rows_of_mut(s, rows, n))),
                None => None,
                Some(_) => unreachable!("checked: every operand lives on the op's device"),
            };
            R::forward(
                rows_of(x, rows, n),
                residual,
                ArrayView1::from(gamma),
                gamma_offset,
                ArrayView1::from(beta),
                cpu::Normalization {
                    eps,
                    centered: norm == Norm::Layer,
                },
                rows_of_mut(y, rows, n),
                ArrayViewMut1::from(mean),
                ArrayViewMut1::from(rstd),
            )
        }
        (
            In::Cuda(x),
            In::Cuda(gamma),
            In::Cuda(beta),
            Out::Cuda(y),
            Out::Cuda(mean),
            Out::Cuda(rstd),
            Kind::Cuda(g),
        ) => {
            let residual = match residual {
                Some((In::Cuda(r), Out::Cuda(s))) => Some((r, s)),
                None => None,
                Some(_) => unreachable!("checked: every operand lives on the op's device"),
            };
            let stream = &g.stream;
            let packed = match &residual {
                Some((r, s)) => packed_rows::<T, R>(
                    n,
                    &[address(&x, stream), address(&y, stream)],
                    &[address(r, stream), address(s, stream)],
                    &[address(&gamma, stream), address(&beta, stream)],
                ),
                None => packed_rows::<T, T>(
                    n,
                    &[address(&x, stream), address(&y, stream)],
                    &[],
                    &[address(&gamma, stream), address(&beta, stream)],
                ),
            };
            // Rows in half packs are held from their boundary too, as shifted rows: the held
            // residual kernel beat the streamed one's half packs once its teams were 4 packs
            // a rank (H200, docs/PERF.md v84c: +13 to +27% at f16 N = 4100 and 16388). f32
            // rows too, which the streamed kernel took element by element (v85), and the
            // plain forward's rows, which the general kernel streamed (v86).
            let shifted = !packed
                && match &residual {
                    Some((r, s)) => shifted_rows::<T, R>(
                        address(&x, stream),
                        &[address(&y, stream), address(r, stream), address(s, stream)],
                    ),
                    None => shifted_rows::<T, T>(address(&x, stream), &[address(&y, stream)]),
                };
            let a = Forward {
                x,
                residual,
                gamma,
                beta,
                y,
                mean,
                rstd,
                rows: rows as u32,
                n: n as u32,
                eps,
                gamma_offset,
                packed,
                shifted,
                norm,
            };
            gpu::forward(g, a)
        }
        _ => unreachable!("checked: every operand lives on the op's device"),
    }
}

/// The backward of `[rows, n]` (n >= 1) on memory already checked and ordered for the
/// stream of `dev`, with dgamma and dbeta summed as `mode` says. An absent parameter's
/// gradient is summed and dropped (the kernels always write both sums): on a GPU into the
/// stream's workspace, kept between calls as the partial rows are, on the CPU into scratch.
pub(crate) fn backward_rows<T: Element, W: Weight<T>, R: cpu::Stream<T>>(
    dev: &Device,
    norm: Norm,
    mode: BackwardMode,
    rows: usize,
    n: usize,
    o: BackwardOperands<'_, T, W, R>,
) -> Result<()> {
    if rows == 0 {
        // Sums over no rows.
        for sums in [o.dgamma, o.dbeta].into_iter().flatten() {
            zero(dev, sums)?;
        }
        return Ok(());
    }
    // The CPU path's sums of an absent parameter go to scratch; a GPU's to its workspace.
    let (mut gamma_sums, mut beta_sums) = (Vec::new(), Vec::new());
    let (dgamma, dbeta) = match &dev.kind {
        Kind::Cpu => (
            Some(o.dgamma.map_or_else(|| host_scratch(&mut gamma_sums, n), Ok)?),
            Some(o.dbeta.map_or_else(|| host_scratch(&mut beta_sums, n), Ok)?),
        ),
        Kind::Cuda(_) => (o.dgamma, o.dbeta),
    };
    match (o.x, o.dy, o.gamma, o.mean, o.rstd, o.dx, dgamma, dbeta, &dev.kind) {
        (
            In::Host(x),
            In::Host(dy),
            In::Host(gamma),
            In::Host(mean),
            In::Host(rstd),
            Out::Host(dx),
            Some(Out::Host(dgamma)),
            Some(Out::Host(dbeta)),
            _,
        ) => R::backward(
            rows_of(x, rows, n),
            rows_of(dy, rows, n),
            o.dsum.map(|d| match d {
                In::Host(d) => rows_of(d, rows, n),
                In::Cuda(_) => unreachable!("checked: every operand lives on the op's device"),
            }),
            ArrayView1::from(gamma),
            o.gamma_offset,
            ArrayView1::from(mean),
            ArrayView1::from(rstd),
            rows_of_mut(dx, rows, n),
            o.dres.map(|d| match d {
                Out::Host(d) => rows_of_mut(d, rows, n),
                Out::Cuda(_) => unreachable!("checked: every operand lives on the op's device"),
            }),
            ArrayViewMut1::from(dgamma),
            ArrayViewMut1::from(dbeta),
            norm == Norm::Layer,
        ),
        (
            In::Cuda(x),
            In::Cuda(dy),
            In::Cuda(gamma),
            In::Cuda(mean),
            In::Cuda(rstd),
            Out::Cuda(dx),
            dgamma,
            dbeta,
            Kind::Cuda(g),
        ) => {
            let (dgamma, dbeta) = (on_device(dgamma), on_device(dbeta));
            let dsum = o.dsum.map(|d| match d {
                In::Cuda(d) => d,
                In::Host(_) => unreachable!("checked: every operand lives on the op's device"),
            });
            let dres = o.dres.map(|d| match d {
                Out::Cuda(d) => d,
                Out::Host(_) => unreachable!("checked: every operand lives on the op's device"),
            });
            let stream = &g.stream;
            // An absent dsum or dres counts as address 0, which is aligned.
            let (xs, rows_of_r) = (
                [address(&dy, stream), address(&dx, stream)],
                [
                    address(&x, stream),
                    dsum.as_ref().map_or(0, |d| address(d, stream)),
                    dres.as_ref().map_or(0, |d| address(d, stream)),
                ],
            );
            let weights = [address(&gamma, stream)];
            let packed = packed_rows::<T, R>(n, &xs, &rows_of_r, &weights);
            let half_packed =
                !packed && half_packed_rows::<T, W, R>(n, xs.iter().chain(&rows_of_r).chain(&weights));
            let shifted = !packed
                && !half_packed
                && dsum.is_none()
                && dres.is_none()
                && shifted_rows::<T, R>(rows_of_r[0], &xs);
            let a = Backward {
                x,
                dy,
                dsum,
                gamma,
                gamma_offset: o.gamma_offset,
                mean,
                rstd,
                dx,
                dres,
                rows: rows as u32,
                n: n as u32,
                packed,
                half_packed,
                shifted,
                norm,
            };
            let reduction = match mode {
                BackwardMode::Deterministic => gpu::Reduction::Owned,
                BackwardMode::Locked { groups } => gpu::Reduction::Locked { groups },
            };
            gpu::backward(g, reduction, a, dgamma, dbeta)
        }
        _ => unreachable!("checked: every operand lives on the op's device"),
    }
}

/// What the kernels and the CPU path add to each gamma_j as they read it, for weights kept
/// as they are: gamma_j + (-0) is gamma_j to the bit, -0 included.
pub(crate) const PLAIN_WEIGHT: f32 = -0.0;

/// The same for zero-centred weights ([`LayerNorm::with_zero_centered_weight`]): the
/// weight is 1 + gamma_j, formed in f32.
pub(crate) const ZERO_CENTERED_WEIGHT: f32 = 1.0;

/// The operands of a forward, checked and ordered for the op's stream; a residual stream
/// of `R` (`T`, or f32 beside f16 and bf16).
pub(crate) struct ForwardOperands<'a, T, W, R = T> {
    pub(crate) x: In<'a, T>,
    /// The residual, and s = x + residual out, which is then normalized in x's place.
    pub(crate) residual: Option<(In<'a, R>, Out<'a, R>)>,
    pub(crate) gamma: In<'a, W>,
    /// Added to each gamma_j as it is read: [`PLAIN_WEIGHT`] or [`ZERO_CENTERED_WEIGHT`].
    pub(crate) gamma_offset: f32,
    pub(crate) beta: In<'a, W>,
    pub(crate) y: Out<'a, T>,
    pub(crate) mean: Out<'a, f32>,
    pub(crate) rstd: Out<'a, f32>,
}

/// The operands of a backward, checked and ordered for the op's stream. dgamma and dbeta
/// are `None` for the parameters the op lacks. Rows of `R`, as [`ForwardOperands`]'.
pub(crate) struct BackwardOperands<'a, T, W, R = T> {
    /// x, or s after a residual forward.
    pub(crate) x: In<'a, R>,
    pub(crate) dy: In<'a, T>,
    /// The gradient reaching s from the residual stream, which dx includes.
    pub(crate) dsum: Option<In<'a, R>>,
    pub(crate) gamma: In<'a, W>,
    /// As [`ForwardOperands::gamma_offset`].
    pub(crate) gamma_offset: f32,
    pub(crate) mean: In<'a, f32>,
    pub(crate) rstd: In<'a, f32>,
    pub(crate) dx: Out<'a, T>,
    /// Where the stream is wider than x (and only there): dx again, unrounded, as the
    /// residual's gradient.
    pub(crate) dres: Option<Out<'a, R>>,
    pub(crate) dgamma: Option<Out<'a, W>>,
    pub(crate) dbeta: Option<Out<'a, W>>,
}

/// An input's elements, ordered for the op's stream: host memory (CPU ops) or a device
/// view (CUDA ops).
pub(crate) enum In<'a, T> {
    Host(&'a [T]),
    Cuda(CudaView<'a, T>),
}

/// An output's elements, ordered for the op's stream.
pub(crate) enum Out<'a, T> {
    Host(&'a mut [T]),
    Cuda(CudaViewMut<'a, T>),
}

/// Refuses `n` past [`MAX_DIM`] and eps that is not finite and positive.
pub(crate) fn check_config(n: usize, eps: f32) -> Result<()> {
    check_dim("n", n)?;
    if eps.is_finite() && eps > 0.0 {
        Ok(())
    } else {
        Err(Error::BadEps(eps))
    }
}

/// Refuses anything but exactly `expected`.
fn expect_same_shape(what: &'static str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Shape {
            what,
            got: got.to_vec(),
            expected: format!("{expected:?}"),
        })
    }
}

pub(crate) fn check_dim(what: &'static str, value: usize) -> Result<()> {
    if value > MAX_DIM {
        Err(Error::TooLarge {
            what,
            value,
            max: MAX_DIM,
        })
    } else {
        Ok(())
    }
}

/// A GPU op's output, where it has one.
fn on_device<T>(out: Option<Out<'_, T>>) -> Option<CudaViewMut<'_, T>> {
    out.map(|o| match o {
        Out::Cuda(o) => o,
        Out::Host(_) => unreachable!("checked: every operand lives on the op's device"),
    })
}

/// `n` host sums for a gradient the op drops, in `scratch`.
fn host_scratch<W: Element>(scratch: &mut Vec<W>, n: usize) -> Result<Out<'_, W>> {
    *scratch = host_filled(n, W::default())?;
    Ok(Out::Host(scratch))
}

/// Sets every element of an output to zero.
fn zero<T: Element>(dev: &Device, out: Out<'_, T>) -> Result<()> {
    match (out, &dev.kind) {
        (Out::Host(h), _) => h.fill(T::from_f32(0.0)),
        (Out::Cuda(mut v), Kind::Cuda(g)) => g.stream.memset_zeros(&mut v).during("zeroing a tensor")?,
        (Out::Cuda(_), Kind::Cpu) => unreachable!("checked: outputs live on the op's device"),
    }
    Ok(())
}

// Storage accessors. `Device::check` ran on every tensor before these, so CPU ops only see
// host storage and CUDA ops only CUDA storage; the other arm cannot be reached. Inputs are
// read through their range of the storage (they may be views); outputs are whole tensors
// (`Tensor::data_mut` refuses views). CUDA storage is reached through its record, for the
// stream the launch goes on, so that uses on other streams come first (gpu/storage.rs).

fn input<'t, T: Element>(dev: &Device, t: &'t Tensor<T>) -> Result<In<'t, T>> {
    match (t.data(), &dev.kind) {
        (Data::Host(v), _) => Ok(In::Host(&v[t.range()])),
        (Data::Cuda(s), Kind::Cuda(g)) => Ok(In::Cuda(s.read(&g.stream)?.slice(t.range()))),
        (Data::Cuda(_), Kind::Cpu) => unreachable!("checked: CPU ops get host tensors"),
    }
}

fn output<'d, T: Element>(dev: &Device, d: &'d mut Data<T>) -> Result<Out<'d, T>> {
    match (d, &dev.kind) {
        (Data::Host(v), _) => Ok(Out::Host(v)),
        (Data::Cuda(s), Kind::Cuda(g)) => Ok(Out::Cuda(s.write(&g.stream)?.as_view_mut())),
        (Data::Cuda(_), Kind::Cpu) => unreachable!("checked: CPU ops get host tensors"),
    }
}

fn rows_of<T: Element>(v: &[T], rows: usize, n: usize) -> ArrayView2<'_, T> {
    ArrayView2::from_shape((rows, n), v).expect("checked shape")
}

fn rows_of_mut<T: Element>(v: &mut [T], rows: usize, n: usize) -> ArrayViewMut2<'_, T> {
    ArrayViewMut2::from_shape((rows, n), v).expect("checked shape")
}

/// Whether the kernels may walk every row of `n` elements in packs of the rows' type `R`
/// (16 bytes): n a whole number of them, each of `rows` (the tensors of `R`) and of the
/// `weights` (no narrower than x) starting 16-byte aligned, and each of `xs` (the tensors
/// of x's type `T`) aligned to `R`'s pack of its columns: 16 bytes, or 8 for f16/bf16
/// beside rows of f32. This crate's whole tensors always are (device allocations are
/// aligned for any type, 256 bytes or more); views and memory of the caller's need not be.
fn packed_rows<T: Element, R: Element>(n: usize, xs: &[u64], rows: &[u64], weights: &[u64]) -> bool {
    let x_pack = (crate::plan::pack_len::<R>() as usize * size_of::<T>()) as u64;
    (n * size_of::<R>()).is_multiple_of(16)
        && xs.iter().all(|a| a.is_multiple_of(x_pack))
        && rows.iter().chain(weights).all(|a| a.is_multiple_of(16))
}

/// Whether the kernels may walk every row of `n` elements in half packs (four columns, 8
/// bytes): the rows and the weights of one 16-bit type (`T` = `R`, `W` the same size), n a
/// multiple of 4, and every address (each tensor's, the weights' too) 8-byte aligned.
fn half_packed_rows<'a, T: Element, W: Element, R: Element>(
    n: usize,
    addresses: impl IntoIterator<Item = &'a u64>,
) -> bool {
    size_of::<T>() == 2
        && size_of::<R>() == 2
        && size_of::<W>() == 2
        && n.is_multiple_of(4)
        && addresses.into_iter().all(|a| a.is_multiple_of(8))
}

/// Whether the kernels may hold every row from x's first 16-byte boundary on: x and the
/// other rows of one type (`T` = `R`, no wider stream), and each of `others` (the
/// backward's dy and dx, the forward's y, the residual forward's residual and s) as many
/// bytes past a 16-byte boundary as `x`'s, so that each row of them is too (rows of one
/// length apart). The weights may sit anywhere: the backward stages them, the forward
/// reads them off their boundaries.
fn shifted_rows<T: Element, R: Element>(x: u64, others: &[u64]) -> bool {
    size_of::<T>() == size_of::<R>() && others.iter().all(|a| a.abs_diff(x).is_multiple_of(16))
}

/// A device buffer's address. Where the context tracks events, `device_ptr` records a read
/// on `stream`, which the launch that follows does anyway.
fn address<E>(v: &impl DevicePtr<E>, stream: &cudarc::driver::CudaStream) -> u64 {
    let (address, _record) = v.device_ptr(stream);
    address
}
