//! The LayerNorm op: checks every input, then runs on the device its tensors live on.
//!
//! Autograd-style, like `torch.autograd.Function`: `forward` returns y and a [`Context`]
//! holding what the backward needs; `backward(&ctx, &dy)` returns dx, dgamma and dbeta.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};

use crate::cpu;
use crate::device::{Device, Kind};
use crate::element::Element;
use crate::error::{DriverContext, Error, Result};
use crate::gpu::launch::{Backward, Forward};
use crate::gpu::layer_norm as gpu;
use crate::tensor::{Data, Tensor};

/// The largest row count and row length: the kernels index rows and columns with u32 and
/// step by up to 1024 past the end, so both stay below 2^31. Offsets are 64-bit, so
/// `rows * n` is limited only by memory.
pub const MAX_DIM: usize = (1 << 31) - 1;

/// How the backward sums dgamma and dbeta over rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackwardMode {
    /// Each thread team owns a partial row and stage 2 adds the partials in a fixed order:
    /// bitwise identical results from run to run, no locks.
    #[default]
    Deterministic,
    /// The Triton tutorial's scheme: row i adds into group i mod G under that group's
    /// atomic spinlock. `None` picks G from n (256 for n <= 1024, 128 to 4096, 96 to 8192,
    /// else 64). The order of additions varies from run to run, so the last bits may too.
    Locked { groups: Option<u32> },
}

/// Everything the backward needs from a forward: x, and the per-row mean and rstd.
#[derive(Clone, Debug)]
pub struct Context<T: Element> {
    op: u64,
    x: Tensor<T>,
    mean: Tensor<f32>,
    rstd: Tensor<f32>,
}

impl<T: Element> Context<T> {
    /// Per-row means, `[rows]`.
    pub fn mean(&self) -> &Tensor<f32> {
        &self.mean
    }
    /// Per-row 1 / sqrt(var + eps), `[rows]`.
    pub fn rstd(&self) -> &Tensor<f32> {
        &self.rstd
    }
}

/// dx `[rows, n]`, dgamma `[n]`, dbeta `[n]`.
#[derive(Clone, Debug)]
pub struct Gradients<T: Element> {
    pub dx: Tensor<T>,
    pub dgamma: Tensor<T>,
    pub dbeta: Tensor<T>,
}

/// LayerNorm over the last dimension of `[rows, n]` inputs, with weight `gamma`, bias `beta`.
#[derive(Clone, Debug)]
pub struct LayerNorm<T: Element> {
    id: u64,
    gamma: Tensor<T>,
    beta: Tensor<T>,
    eps: f32,
    mode: BackwardMode,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl<T: Element> LayerNorm<T> {
    /// An op with `gamma`, `beta` (both `[n]`, on one device) and `eps` (finite, > 0).
    pub fn new(gamma: Tensor<T>, beta: Tensor<T>, eps: f32) -> Result<Self> {
        let [n] = gamma.dims1("gamma")?;
        beta.expect_shape("beta", &[n])?;
        gamma.device().check("beta", &beta)?;
        check_dim("n", n)?;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(Error::BadEps(eps));
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(LayerNorm {
            id,
            gamma,
            beta,
            eps,
            mode: BackwardMode::default(),
        })
    }

    /// Uploads `gamma` and `beta` to `device`, then as [`LayerNorm::new`].
    pub fn from_arrays(
        device: &Device,
        gamma: ArrayView1<'_, T>,
        beta: ArrayView1<'_, T>,
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

    pub fn device(&self) -> &Device {
        self.gamma.device()
    }
    pub fn eps(&self) -> f32 {
        self.eps
    }
    pub fn backward_mode(&self) -> BackwardMode {
        self.mode
    }

    /// y = LayerNorm(x) for x `[rows, n]`, and the context for the backward.
    pub fn forward(&self, x: &Tensor<T>) -> Result<(Tensor<T>, Context<T>)> {
        let mut y = self.device().empty(x.shape())?;
        let ctx = self.forward_into(x, &mut y)?;
        Ok((y, ctx))
    }

    /// As [`LayerNorm::forward`], writing y into `y` (same shape as x, a whole tensor and its
    /// storage's sole handle, even where x is empty).
    pub fn forward_into(&self, x: &Tensor<T>, y: &mut Tensor<T>) -> Result<Context<T>> {
        let [rows, n] = self.check_input("x", x)?;
        y.expect_shape("y", x.shape())?;
        self.device().check("y", y)?;
        // Refused whatever the shape, as the backward refuses its outputs, even where
        // nothing would be written.
        let y = y.data_mut("y")?;
        let dev = self.device();
        // The kernels write every row's statistics; those of an empty row are undefined:
        // NaN, as 0/0 gives. (Filling from the host would cost a copy per call.)
        let stats = || {
            if n == 0 {
                dev.full(&[rows], f32::NAN)
            } else {
                dev.empty::<f32>(&[rows])
            }
        };
        let (mut mean, mut rstd) = (stats()?, stats()?);
        if rows > 0 && n > 0 {
            let (mean_d, rstd_d) = (mean.data_mut("mean")?, rstd.data_mut("rstd")?);
            match &dev.kind {
                Kind::Cpu => cpu::forward(
                    host2(x, rows, n),
                    host1(&self.gamma),
                    host1(&self.beta),
                    self.eps,
                    host2_mut(y, rows, n),
                    host1_mut(mean_d),
                    host1_mut(rstd_d),
                )?,
                Kind::Cuda(g) => {
                    let s = &g.stream;
                    let a = Forward {
                        x: cuda(x, s)?,
                        gamma: cuda(&self.gamma, s)?,
                        beta: cuda(&self.beta, s)?,
                        y: cuda_mut(y, s)?,
                        mean: cuda_mut(mean_d, s)?,
                        rstd: cuda_mut(rstd_d, s)?,
                        rows: rows as u32,
                        n: n as u32,
                        eps: self.eps,
                        packed: packed_rows(n, [x, &self.gamma, &self.beta]),
                    };
                    gpu::forward(g, a)?;
                }
            }
        }
        Ok(Context {
            op: self.id,
            x: x.clone(),
            mean,
            rstd,
        })
    }

    /// dx, dgamma and dbeta for upstream gradient `dy` (`[rows, n]`, as y).
    pub fn backward(&self, ctx: &Context<T>, dy: &Tensor<T>) -> Result<Gradients<T>> {
        let dev = self.device();
        let n = self.gamma.len();
        let mut grads = Gradients {
            dx: dev.empty(dy.shape())?,
            dgamma: dev.empty(&[n])?,
            dbeta: dev.empty(&[n])?,
        };
        self.backward_into(ctx, dy, &mut grads)?;
        Ok(grads)
    }

    /// As [`LayerNorm::backward`], writing into `grads` (shapes as `backward` returns them).
    pub fn backward_into(&self, ctx: &Context<T>, dy: &Tensor<T>, grads: &mut Gradients<T>) -> Result<()> {
        if ctx.op != self.id {
            return Err(Error::ForeignContext);
        }
        let [rows, n] = self.check_input("dy", dy)?;
        dy.expect_shape("dy", ctx.x.shape())?;
        grads.dx.expect_shape("dx", &[rows, n])?;
        grads.dgamma.expect_shape("dgamma", &[n])?;
        grads.dbeta.expect_shape("dbeta", &[n])?;
        let dev = self.device();
        for (what, t) in [
            ("dx", &grads.dx),
            ("dgamma", &grads.dgamma),
            ("dbeta", &grads.dbeta),
        ] {
            dev.check(what, t)?;
        }
        let (dx, dgamma, dbeta) = (
            grads.dx.data_mut("dx")?,
            grads.dgamma.data_mut("dgamma")?,
            grads.dbeta.data_mut("dbeta")?,
        );
        if n == 0 {
            return Ok(());
        }
        if rows == 0 {
            // Sums over no rows.
            zero(dev, dgamma)?;
            return zero(dev, dbeta);
        }
        match &dev.kind {
            Kind::Cpu => cpu::backward(
                host2(&ctx.x, rows, n),
                host2(dy, rows, n),
                host1(&self.gamma),
                host1(&ctx.mean),
                host1(&ctx.rstd),
                host2_mut(dx, rows, n),
                host1_mut(dgamma),
                host1_mut(dbeta),
            )?,
            Kind::Cuda(g) => {
                let s = &g.stream;
                let a = Backward {
                    x: cuda(&ctx.x, s)?,
                    dy: cuda(dy, s)?,
                    gamma: cuda(&self.gamma, s)?,
                    mean: cuda(&ctx.mean, s)?,
                    rstd: cuda(&ctx.rstd, s)?,
                    dx: cuda_mut(dx, s)?,
                    rows: rows as u32,
                    n: n as u32,
                    packed: packed_rows(n, [&ctx.x, dy, &self.gamma]),
                };
                let reduction = match self.mode {
                    BackwardMode::Deterministic => gpu::Reduction::Owned,
                    BackwardMode::Locked { groups } => gpu::Reduction::Locked {
                        groups: groups.unwrap_or_else(|| gpu::default_groups(n)),
                    },
                };
                gpu::backward(g, reduction, a, cuda_mut(dgamma, s)?, cuda_mut(dbeta, s)?)?;
            }
        }
        Ok(())
    }

    /// `[rows, n]` of an input, on this op's device, with n = gamma's length.
    fn check_input(&self, what: &'static str, t: &Tensor<T>) -> Result<[usize; 2]> {
        let [rows, n] = t.dims2(what)?;
        if n != self.gamma.len() {
            return Err(Error::Shape {
                what,
                got: t.shape().to_vec(),
                expected: format!("[rows, {}] (n = gamma's length)", self.gamma.len()),
            });
        }
        check_dim("rows", rows)?;
        self.device().check(what, t)?;
        Ok([rows, n])
    }
}

fn check_dim(what: &'static str, value: usize) -> Result<()> {
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

/// Sets every element of a tensor's storage to zero.
fn zero<T: Element>(dev: &Device, data: &mut Data<T>) -> Result<()> {
    match (data, &dev.kind) {
        (Data::Host(h), _) => h.fill(T::from_f32(0.0)),
        (Data::Cuda(s), Kind::Cuda(g)) => g
            .stream
            .memset_zeros(s.write(&g.stream)?)
            .during("zeroing a tensor")?,
        (Data::Cuda(_), Kind::Cpu) => unreachable!("checked: tensors live on the op's device"),
    }
    Ok(())
}

// Storage accessors. `Device::check` ran on every tensor before these, so CPU ops only see
// host storage and CUDA ops only CUDA storage; the other arm cannot be reached. Inputs are
// read through their range of the storage (they may be views); outputs are whole tensors
// (`Tensor::data_mut` refuses views). CUDA storage is reached through its record, for the
// stream the launch goes on, so that uses on other streams come first (gpu/storage.rs).

fn host<T: Element>(t: &Tensor<T>) -> &[T] {
    match t.data() {
        Data::Host(v) => &v[t.range()],
        Data::Cuda(_) => unreachable!("checked: CPU ops get host tensors"),
    }
}

fn host1<T: Element>(t: &Tensor<T>) -> ArrayView1<'_, T> {
    ArrayView1::from(host(t))
}

fn host2<T: Element>(t: &Tensor<T>, rows: usize, n: usize) -> ArrayView2<'_, T> {
    ArrayView2::from_shape((rows, n), host(t)).expect("checked shape")
}

fn host_slice_mut<T: Element>(d: &mut Data<T>) -> &mut [T] {
    match d {
        Data::Host(v) => v,
        Data::Cuda(_) => unreachable!("checked: CPU ops get host tensors"),
    }
}

fn host1_mut<T: Element>(d: &mut Data<T>) -> ArrayViewMut1<'_, T> {
    ArrayViewMut1::from(host_slice_mut(d))
}

fn host2_mut<T: Element>(d: &mut Data<T>, rows: usize, n: usize) -> ArrayViewMut2<'_, T> {
    ArrayViewMut2::from_shape((rows, n), host_slice_mut(d)).expect("checked shape")
}

/// Whether every row of rows of `n` elements starts on a 16-byte boundary in each of
/// `inputs` and in the op's output (a whole tensor, which starts on one): n a whole number
/// of 16-byte packs, and each input's offset in bytes a multiple of 16 (its storage starts
/// aligned: device allocations are aligned for any type, 256 bytes or more).
fn packed_rows<T: Element>(n: usize, inputs: [&Tensor<T>; 3]) -> bool {
    (n * size_of::<T>()).is_multiple_of(16)
        && inputs
            .iter()
            .all(|t| (t.range().start * size_of::<T>()).is_multiple_of(16))
}

fn cuda<'t, T: Element>(t: &'t Tensor<T>, stream: &Arc<CudaStream>) -> Result<CudaView<'t, T>> {
    match t.data() {
        Data::Cuda(s) => Ok(s.read(stream)?.slice(t.range())),
        Data::Host(_) => unreachable!("checked: CUDA ops get device tensors"),
    }
}

fn cuda_mut<'d, T: Element>(d: &'d mut Data<T>, stream: &Arc<CudaStream>) -> Result<&'d mut CudaSlice<T>> {
    match d {
        Data::Cuda(s) => s.write(stream),
        Data::Host(_) => unreachable!("checked: CUDA ops get device tensors"),
    }
}
