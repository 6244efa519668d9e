//! Where tensors live and ops run: the CPU (ndarray) or one CUDA device.

use std::fmt;
use std::sync::Arc;

use ndarray::{ArrayView, Dimension};

use crate::element::Element;
use crate::error::{DriverContext, Error, Result};
use crate::gpu::Gpu;
use crate::tensor::{Data, Tensor};

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

    /// The CUDA stream this handle queues its work on (None on the CPU): for timing with
    /// events, or ordering other CUDA work around this crate's.
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

    /// Copies an ndarray (any layout, 1-D or 2-D, or more) to this device.
    pub fn upload<T: Element, D: Dimension>(&self, a: ArrayView<'_, T, D>) -> Result<Tensor<T>> {
        let shape = a.shape().to_vec();
        let host: Vec<T> = match a.as_slice() {
            Some(s) => s.to_vec(),
            None => a.iter().copied().collect(), // strided views are copied in row-major order
        };
        self.upload_vec(shape, host)
    }

    /// A tensor of `shape` with every element `value` (NaN, say, to see unwritten outputs).
    pub fn full<T: Element>(&self, shape: &[usize], value: T) -> Result<Tensor<T>> {
        self.upload_vec(shape.to_vec(), vec![value; shape.iter().product()])
    }

    /// A tensor of `shape` whose contents are unspecified (to be written by an op).
    pub(crate) fn empty<T: Element>(&self, shape: &[usize]) -> Result<Tensor<T>> {
        let len = shape.iter().product();
        let data = match &self.kind {
            Kind::Cpu => Data::Host(vec![T::default(); len]),
            // SAFETY: the memory is uninitialized; every caller hands it to an op that
            // writes each element before anything reads it.
            Kind::Cuda(g) => Data::Cuda(unsafe { g.stream.alloc::<T>(len) }.during("allocating a tensor")?),
        };
        Ok(Tensor::new(self.clone(), shape.to_vec(), data))
    }

    fn upload_vec<T: Element>(&self, shape: Vec<usize>, host: Vec<T>) -> Result<Tensor<T>> {
        let data = match &self.kind {
            Kind::Cpu => Data::Host(host),
            Kind::Cuda(g) => Data::Cuda(g.stream.clone_htod(&host).during("copying to the device")?),
        };
        Ok(Tensor::new(self.clone(), shape, data))
    }

    /// Whether tensors of `other` can be used by ops on `self`: both the CPU, or the same
    /// CUDA device (streams may differ; cudarc orders their use with events).
    pub(crate) fn same_as(&self, other: &Device) -> bool {
        match (&self.kind, &other.kind) {
            (Kind::Cpu, Kind::Cpu) => true,
            (Kind::Cuda(a), Kind::Cuda(b)) => a.ordinal == b.ordinal,
            _ => false,
        }
    }

    /// Refuses a tensor from another device.
    pub(crate) fn check<T: Element>(&self, what: &'static str, t: &Tensor<T>) -> Result<()> {
        if self.same_as(t.device()) {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                what,
                got: t.device().name(),
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
