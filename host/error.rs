//! Every way a call can fail, as one typed error.

use cudarc::driver::DriverError;
use cudarc::driver::sys::CUresult;

/// Errors of this crate. Bad input is reported before anything is launched.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `libcuda` could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver found (libcuda could not be loaded); use Device::cpu() to run on the CPU")]
    NoDriver,
    /// The driver is there but reports no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    /// The device is older than the PTX's target (sm_80).
    #[error("CUDA device {name} has compute capability {major}.{minor}; these kernels need 8.0 or later")]
    UnsupportedDevice { name: String, major: i32, minor: i32 },
    /// The CUDA driver refused a call (a failed launch, ...). Allocations that do not fit
    /// are [`Error::OutOfMemory`] instead.
    #[error("CUDA driver error during {during}: {source}")]
    Driver {
        during: &'static str,
        #[source]
        source: DriverError,
    },
    /// An allocation of `bytes` did not fit: in device memory (the driver's
    /// `CUDA_ERROR_OUT_OF_MEMORY`) or, on the CPU and for host copies, in host memory.
    /// Nothing was allocated, and the device stays usable.
    #[error("out of memory while {during} ({bytes} bytes)")]
    OutOfMemory { bytes: usize, during: &'static str },
    /// A kernel variant needs more shared memory per block than the device allows. Every
    /// GPU these kernels run on (sm_80 and later, 99 KB or more) has enough for the
    /// variants this crate picks; the check runs before every launch all the same.
    #[error("{what} needs {needed} bytes of shared memory per block; this device allows {available}")]
    SharedMemory {
        what: &'static str,
        needed: usize,
        available: usize,
    },
    /// A tensor's shape does not fit the operation (or its size in bytes does not fit in
    /// `isize`, the most one allocation may hold).
    #[error("{what} has shape {got:?}, expected {expected}")]
    Shape {
        what: &'static str,
        got: Vec<usize>,
        expected: String,
    },
    /// eps must be finite and positive.
    #[error("eps must be finite and greater than 0, got {0}")]
    BadEps(f32),
    /// A dimension is larger than the kernels' index types allow.
    #[error("{what} = {value} exceeds the supported maximum of {max}")]
    TooLarge {
        what: &'static str,
        value: usize,
        max: usize,
    },
    /// Tensors of one call live on different devices (or on the CPU and a GPU).
    #[error("{what} lives on {got}, but the operation runs on {expected}")]
    DeviceMismatch {
        what: &'static str,
        got: String,
        expected: String,
    },
    /// Tensors of one call live in different CUDA contexts of the same GPU (a `Device` from
    /// [`crate::Device::from_cuda_stream`] over a context of your own, and one of this
    /// crate's): memory of one context is not used by another context's kernels.
    #[error("{what} lives in another CUDA context of GPU {ordinal} than the operation's")]
    ContextMismatch { what: &'static str, ordinal: usize },
    /// A CUDA-only call (CUDA memory in or out) made with a tensor or device on the CPU.
    #[error("{what} is on the CPU, but this call needs a CUDA device")]
    NotCuda { what: &'static str },
    /// CUDA memory handed in with a shape whose element count is not its length.
    #[error("{what} holds {len} elements, but shape {shape:?} does not have exactly that many")]
    Length {
        what: &'static str,
        len: usize,
        shape: Vec<usize>,
    },
    /// A gradient output given for a weight or bias the LayerNorm does not have, or missing
    /// for one it has (dgamma for gamma, dbeta for beta).
    #[error("{what} must be {} here: the LayerNorm {} the matching parameter", if *.op_has_parameter { "Some" } else { "None" }, if *.op_has_parameter { "has" } else { "does not have" })]
    ParameterGradient {
        what: &'static str,
        op_has_parameter: bool,
    },
    /// A backward context handed to a LayerNorm other than the one that made it.
    #[error("this backward context was produced by another LayerNorm")]
    ForeignContext,
    /// An output tensor passed to a `*_into` call, or a tensor turned into a `CudaSlice`, is
    /// shared with another handle.
    #[error("{what} is shared with another Tensor handle and cannot be written in place or given up")]
    SharedOutput { what: &'static str },
    /// An output passed to a `*_into` call, or a tensor turned into a `CudaSlice`, is a view
    /// of part of its storage (see [`crate::Tensor::view`]): these must be whole tensors.
    #[error(
        "{what} is a view of part of a larger tensor's storage; outputs and tensors given up as a CudaSlice must be whole tensors"
    )]
    ViewOutput { what: &'static str },
    /// A view reaching past the end of the tensor it is taken from.
    #[error("a view of {len} elements at offset {offset} does not fit in a tensor of {available} elements")]
    ViewOutOfRange {
        offset: usize,
        len: usize,
        available: usize,
    },
    /// A row range outside the tensor's rows, or with its start after its end.
    #[error("rows {start}..{end} are not a range within the tensor's {rows} rows")]
    RowsOutOfRange { start: usize, end: usize, rows: usize },
    /// The number of lock groups for the locked backward must be at least 1.
    #[error("the locked backward needs at least 1 group, got {0}")]
    BadGroups(u32),
    /// A zero-centred weight asked of an op without a weight (`without_affine`).
    #[error("the op has no weight to take as zero-centred")]
    NoWeight,
    /// The embedded PTX lacks a kernel the registry lists: a build of this crate that is
    /// out of step with itself (report it).
    #[error("layernorm-cuda's PTX has no kernel {name}")]
    MissingKernel { name: String },
}

/// This crate's `Result`.
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches what was being done to a driver error.
pub(crate) trait DriverContext<T> {
    fn during(self, what: &'static str) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, DriverError> {
    fn during(self, during: &'static str) -> Result<T> {
        self.map_err(|source| Error::Driver { during, source })
    }
}

/// As [`DriverContext`], for calls that allocate `bytes` of device memory: the driver's
/// out-of-memory error becomes [`Error::OutOfMemory`].
pub(crate) trait AllocContext<T> {
    fn allocating(self, bytes: usize, during: &'static str) -> Result<T>;
}

impl<T> AllocContext<T> for std::result::Result<T, DriverError> {
    fn allocating(self, bytes: usize, during: &'static str) -> Result<T> {
        self.map_err(|source| match source.0 {
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { bytes, during },
            _ => Error::Driver { during, source },
        })
    }
}
