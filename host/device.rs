//! Where tensors live and ops run: the CPU (ndarray) or one CUDA device. Tensors build on
//! this module (tensor.rs, with the `Device` methods that make them); it knows none.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// A device handle: the CPU, or a CUDA device with its own stream.
///
/// Cloning is cheap and shares the stream. Work from one handle runs in order; two handles
/// from [`Device::with_new_stream`] run concurrently on one GPU (see README, "Guarantees").
#[derive(Clone)]
pub struct Device {
    pub(crate) kind: Kind,
}

#[derive(Clone)]
pub(crate) enum Kind {
    Cpu,
    Cuda(Arc<Gpu>),
}

impl Device {
    /// The CPU: ndarray code paths, always available.
    pub fn cpu() -> Device {
        Device { kind: Kind::Cpu }
    }

    /// CUDA device `ordinal`. Fails with [`Error::NoDriver`] where no NVIDIA driver is
    /// installed, [`Error::NoDevice`] where the ordinal does not exist.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Ok(Device {
            kind: Kind::Cuda(Arc::new(Gpu::open(ordinal)?)),
        })
    }

    /// A handle on a stream of yours, in your context (`cudarc`'s, as you made it): this
    /// crate's work is queued on `stream`, in order with yours, and its kernels are loaded
    /// into that context (each norm's of each type pair when its first op is made on the
    /// returned device, once per call of this function). Tensors of this device and your
    /// `CudaSlice`s of the same context pass between the two without a copy
    /// ([`crate::Tensor::from_cuda_slice`], [`crate::Tensor::into_cuda_slice`],
    /// [`crate::BorrowedTensor`]). The context's cudarc event tracking stays as you set it;
    /// tensors are ordered across streams either way (README, "Guarantees").
    ///
    /// Errors: [`Error::UnsupportedDevice`] before sm_80. The kernels load later, each
    /// norm's of each type pair when its first op is made ([`crate::LayerNorm::new`] and
    /// the other constructors, or a candle op's first call): [`Error::Driver`] there where
    /// a module does not load.
    pub fn from_cuda_stream(stream: Arc<cudarc::driver::CudaStream>) -> Result<Device> {
        Ok(Device {
            kind: Kind::Cuda(Arc::new(Gpu::on_stream(stream)?)),
        })
    }

    /// CUDA device 0 if one can be opened, else the CPU together with the reason.
    pub fn cuda_or_cpu() -> (Device, Option<Error>) {
        match Device::cuda(0) {
            Ok(d) => (d, None),
            Err(e) => (Device::cpu(), Some(e)),
        }
    }

    /// A handle on the same device with a stream of its own (the CPU: itself).
    pub fn with_new_stream(&self) -> Result<Device> {
        Ok(match &self.kind {
            Kind::Cpu => Device::cpu(),
            Kind::Cuda(g) => Device {
                kind: Kind::Cuda(Arc::new(g.with_new_stream()?)),
            },
        })
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self.kind, Kind::Cuda(_))
    }

    /// "cpu", or the CUDA device's name and ordinal.
    pub fn name(&self) -> String {
        match &self.kind {
            Kind::Cpu => "cpu".to_string(),
            Kind::Cuda(g) => format!("cuda:{} ({})", g.ordinal, g.name),
        }
    }

    /// Multiprocessors of the CUDA device (None on the CPU).
    pub fn multiprocessors(&self) -> Option<u32> {
        match &self.kind {
            Kind::Cpu => None,
            Kind::Cuda(g) => Some(g.sm_count),
        }
    }

    /// What [`crate::plan::plan`] needs of the CUDA device, to see which kernel a call would
    /// take on it (None on the CPU).
    pub fn plan_limits(&self) -> Option<crate::plan::DeviceLimits> {
        match &self.kind {
            Kind::Cpu => None,
            Kind::Cuda(g) => Some(g.kernels.limits),
        }
    }

    /// The CUDA stream this handle queues its work on (None on the CPU): for timing with
    /// events, or ordering other CUDA work around this crate's. cudarc's event tracking is
    /// off in the contexts this crate creates ([`Device::cuda`]; this crate orders its
    /// tensors across streams itself): slices you allocate there and use on more than one
    /// stream need your own events. A context of yours ([`Device::from_cuda_stream`]) keeps
    /// your setting.
    pub fn cuda_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.kind {
            Kind::Cpu => None,
            Kind::Cuda(g) => Some(&g.stream),
        }
    }

    /// Waits until all work queued on this handle has finished.
    pub fn synchronize(&self) -> Result<()> {
        match &self.kind {
            Kind::Cpu => Ok(()),
            Kind::Cuda(g) => g.synchronize(),
        }
    }

    /// Refuses tensors of `other` for ops on `self` unless both are the CPU or both are in
    /// the same CUDA context (streams may differ: each tensor's storage orders its uses
    /// across streams, gpu/storage.rs). `what` names the tensor in the error.
    pub(crate) fn check_device(&self, what: &'static str, other: &Device) -> Result<()> {
        match (&self.kind, &other.kind) {
            (Kind::Cpu, Kind::Cpu) => Ok(()),
            (Kind::Cuda(_), Kind::Cuda(b)) => self.check_context(what, b.context()),
            _ => Err(Error::DeviceMismatch {
                what,
                got: other.name(),
                expected: self.name(),
            }),
        }
    }

    /// Refuses CUDA memory of context `ctx` for ops on `self` unless `self` runs in that
    /// same context (another GPU: [`Error::DeviceMismatch`]; another context of the same GPU:
    /// [`Error::ContextMismatch`]; the CPU: [`Error::NotCuda`]).
    pub(crate) fn check_context(&self, what: &'static str, ctx: &CudaContext) -> Result<()> {
        let Kind::Cuda(g) = &self.kind else {
            return Err(Error::NotCuda { what: "the device" });
        };
        if **g.context() == *ctx {
            Ok(())
        } else if g.ordinal == ctx.ordinal() {
            Err(Error::ContextMismatch {
                what,
                ordinal: g.ordinal,
            })
        } else {
            Err(Error::DeviceMismatch {
                what,
                got: format!("cuda:{}", ctx.ordinal()),
                expected: self.name(),
            })
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}
