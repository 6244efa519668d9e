//! Opening a CUDA device: driver check, context, stream, module; or taking a caller's
//! stream and loading the module into its context.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream, sys};

use super::module::KernelTable;
use super::workspace::Workspace;
use crate::error::{DriverContext, Error, Result};

/// One device's context, the stream every operation of a `Device` handle runs on, and its
/// kernels (each module loaded at first use).
pub(crate) struct Gpu {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) kernels: Arc<KernelTable>,
    pub(crate) name: String,
    pub(crate) ordinal: usize,
    /// Multiprocessors: resident grids are sized from this.
    pub(crate) sm_count: u32,
    /// The backward's scratch on this handle's stream, kept between calls.
    pub(crate) workspace: Mutex<Workspace>,
}

/// Whether libcuda can be loaded, asked before any CUDA call: cudarc panics inside its
/// loader when it is missing.
#[cfg(not(feature = "candle-cuda"))]
fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// With `candle-cuda`, candle's CUDA backend has cudarc link libcuda into the program when
/// it is built (cudarc's `dynamic-linking`, which has no loader to ask): a program that
/// runs has the driver's library.
#[cfg(feature = "candle-cuda")]
fn driver_present() -> bool {
    true
}

impl Gpu {
    /// Opens device `ordinal`; its kernels load at their first use (gpu/module.rs).
    pub(crate) fn open(ordinal: usize) -> Result<Gpu> {
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        let count = CudaContext::device_count().during("counting devices")?.max(0) as usize;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).during("creating the context")?;
        // cudarc's event tracking orders a write or a free after the last reader only, and
        // costs event calls at every launch even where one stream does everything;
        // gpu/storage.rs orders tensors' memory instead.
        // SAFETY: cudarc's conditions for slices without tracking hold for every slice this
        // crate makes in this context, all allocated after this line: a tensor's storage
        // orders its uses and its free across streams (gpu/storage.rs), and the ops' scratch
        // buffers are allocated, used and freed on one stream. Slices that users make on
        // `Device::cuda_stream()` are theirs to order, as its documentation says.
        unsafe { ctx.disable_event_tracking() };
        Gpu::on_stream(ctx.new_stream().during("creating a stream")?)
    }

    /// A handle on `stream`, in whatever context it belongs to (this crate's or a caller's),
    /// whose kernels load into that context as they are first used. The context's cudarc event tracking is
    /// left as it is: in a caller's context that is the caller's setting (gpu/storage.rs
    /// says why either setting is sound for tensors).
    pub(crate) fn on_stream(stream: Arc<CudaStream>) -> Result<Gpu> {
        let ctx = stream.context().clone();
        let name = ctx.name().during("reading the device name")?;
        let (major, minor) = ctx
            .compute_capability()
            .during("reading the compute capability")?;
        if major < 8 {
            return Err(Error::UnsupportedDevice { name, major, minor });
        }
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during("reading the multiprocessor count")? as u32;
        let kernels = Arc::new(KernelTable::new(&ctx, major, sm_count)?);
        Ok(Gpu {
            stream,
            kernels,
            name,
            ordinal: ctx.ordinal(),
            sm_count,
            workspace: Mutex::default(),
        })
    }

    /// Another handle on the same device and kernels, with a stream of its own.
    pub(crate) fn with_new_stream(&self) -> Result<Gpu> {
        let stream = self.stream.context().new_stream().during("creating a stream")?;
        Ok(Gpu {
            stream,
            kernels: self.kernels.clone(),
            name: self.name.clone(),
            ordinal: self.ordinal,
            sm_count: self.sm_count,
            workspace: Mutex::default(),
        })
    }

    /// The context this handle's work runs in.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }

    /// Waits for everything queued on this handle's stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().during("synchronizing the stream")
    }
}
