//! Everything that can stop a measurement or the whole run.

use std::path::PathBuf;

use layernorm_cuda::cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Library(#[from] layernorm_cuda::Error),
    /// A CUDA call the benchmark makes itself (events, the L2 flush, the copy).
    #[error("CUDA driver error while {during}: {source}")]
    Driver {
        during: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the peers' results {path}: {reason}")]
    Peers { path: PathBuf, reason: String },
    #[error("cannot draw {path}: {reason}")]
    Plot { path: PathBuf, reason: String },
}

/// Names what the benchmark was doing when a driver call failed.
pub trait During<T> {
    fn during(self, what: &'static str) -> Result<T, BenchError>;
}

impl<T> During<T> for Result<T, DriverError> {
    fn during(self, during: &'static str) -> Result<T, BenchError> {
        self.map_err(|source| BenchError::Driver { during, source })
    }
}
