//! Where tensors live and ops run: the CPU (ndarray) or one CUDA device.

use std::fmt;
use std::sync::Arc;

use ndarray::{ArrayView, Dimension};

use crate::element::Element;
use crate::error::{AllocContext, DriverContext, Error, Result};
use crate::gpu::Gpu;
use crate::gpu::storage::CudaStorage;
use crate::tensor::{Data, Tensor, element_count, host_vec};

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
    /// events, or ordering other CUDA work around this crate's. cudarc's event tracking is
    /// off in its context (this crate orders its tensors across streams itself): slices you
    /// allocate there and use on more than one stream need your own events.
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

    /// Copies an ndarray (any layout, 1-D or 2-D, or more) to this device. Row-major arrays
    /// are copied straight from their memory; strided ones are gathered in row-major order
    /// first.
    pub fn upload<T: Element, D: Dimension>(&self, a: ArrayView<'_, T, D>) -> Result<Tensor<T>> {
        let shape = a.shape().to_vec();
        let data = match a.as_slice() {
            Some(s) => self.copy_in(s)?,
            None => {
                let mut gathered = host_vec(a.len(), "gathering a strided array")?;
                gathered.extend(a.iter().copied());
                match self.kind {
                    Kind::Cpu => Data::Host(gathered),
                    Kind::Cuda(_) => self.copy_in(&gathered)?,
                }
            }
        };
        Ok(Tensor::new(self.clone(), shape, data))
    }

    /// A tensor of `shape` with every element `value` (NaN, say, to see unwritten outputs).
    /// On a GPU the device memory is taken first, so a size that cannot fit there fails
    /// with [`Error::OutOfMemory`] before the host copy of the values is made.
    pub fn full<T: Element>(&self, shape: &[usize], value: T) -> Result<Tensor<T>> {
        let len = element_count::<T>("tensor", shape)?;
        let data = match &self.kind {
            Kind::Cpu => Data::Host(host_filled(len, value)?),
            Kind::Cuda(g) => {
                // SAFETY: uninitialized memory, written in full by the copy below before
                // anything can read it.
                let mut s = unsafe { g.stream.alloc::<T>(len) }.allocating(len * size_of::<T>(), ALLOC)?;
                g.stream
                    .memcpy_htod(&host_filled(len, value)?, &mut s)
                    .during("filling a tensor")?;
                Data::Cuda(CudaStorage::new(s))
            }
        };
        Ok(Tensor::new(self.clone(), shape.to_vec(), data))
    }

    /// A tensor of `shape` full of zeros (on a GPU set by the device, with no host copy).
    pub fn zeros<T: Element>(&self, shape: &[usize]) -> Result<Tensor<T>> {
        let len = element_count::<T>("tensor", shape)?;
        let data = match &self.kind {
            Kind::Cpu => Data::Host(host_filled(len, T::from_f32(0.0))?),
            Kind::Cuda(g) => Data::Cuda(CudaStorage::new(
                g.stream
                    .alloc_zeros::<T>(len)
                    .allocating(len * size_of::<T>(), ALLOC)?,
            )),
        };
        Ok(Tensor::new(self.clone(), shape.to_vec(), data))
    }

    /// A tensor of `shape` whose contents are unspecified (to be written by an op).
    pub(crate) fn empty<T: Element>(&self, shape: &[usize]) -> Result<Tensor<T>> {
        let len = element_count::<T>("tensor", shape)?;
        let data = match &self.kind {
            Kind::Cpu => Data::Host(host_filled(len, T::default())?),
            // SAFETY: the memory is uninitialized; every caller hands it to an op that
            // writes each element before anything reads it.
            Kind::Cuda(g) => Data::Cuda(CudaStorage::new(
                unsafe { g.stream.alloc::<T>(len) }.allocating(len * size_of::<T>(), ALLOC)?,
            )),
        };
        Ok(Tensor::new(self.clone(), shape.to_vec(), data))
    }

    /// Storage on this device holding a copy of `host`.
    fn copy_in<T: Element>(&self, host: &[T]) -> Result<Data<T>> {
        Ok(match &self.kind {
            Kind::Cpu => {
                let mut v = host_vec(host.len(), ALLOC)?;
                v.extend_from_slice(host);
                Data::Host(v)
            }
            Kind::Cuda(g) => Data::Cuda(CudaStorage::new(
                g.stream
                    .clone_htod(host)
                    .allocating(size_of_val(host), "copying to the device")?,
            )),
        })
    }

    /// Whether tensors of `other` can be used by ops on `self`: both the CPU, or the same
    /// CUDA device (streams may differ: each tensor's storage orders its uses across
    /// streams, gpu/storage.rs).
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

/// What `Error::OutOfMemory` says a tensor allocation was doing.
const ALLOC: &str = "allocating a tensor";

/// `len` copies of `value` in host memory, or [`Error::OutOfMemory`].
fn host_filled<T: Element>(len: usize, value: T) -> Result<Vec<T>> {
    let mut v = host_vec(len, ALLOC)?;
    v.resize(len, value);
    Ok(v)
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}
