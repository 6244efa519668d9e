//! The backward's scratch, kept between calls: the f32 partial rows of stage 1 (each
//! buffer with a row more, where stage 2 writes the sums of a parameter the op lacks) and
//! the locked mode's lock and count words. A backward takes what it needs from here instead
//! of allocating per call; a call that needs more replaces the buffer with a larger one
//! (the old one is freed in stream order), so after the first call of the largest shape
//! the backward allocates nothing.
//!
//! One workspace per `Gpu`, that is per stream: every use of it is queued on that stream,
//! so a call's stage 2 has read the partials before the next call's stage 1 writes them,
//! whatever the host threads do. The lock held during a backward only keeps two host
//! threads from handing out the same buffers to launches being built at once.

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut};

use crate::error::{DriverContext, Result};
use crate::gpu::storage::allocate;

/// The retained buffers (empty until a backward needs them).
#[derive(Default)]
pub(crate) struct Workspace {
    part_dgamma: Option<CudaSlice<f32>>,
    part_dbeta: Option<CudaSlice<f32>>,
    words: Option<CudaSlice<u32>>,
}

/// At least `len` elements of `buffer`, reallocated on `stream` where it holds fewer.
fn at_least<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    buffer: &'a mut Option<CudaSlice<T>>,
    stream: &std::sync::Arc<CudaStream>,
    len: usize,
    during: &'static str,
) -> Result<CudaViewMut<'a, T>> {
    let buffer = match buffer.take() {
        Some(kept) if kept.len() >= len => buffer.insert(kept),
        smaller => {
            // The old buffer is freed first (in stream order), so its memory can serve the new.
            drop(smaller);
            // SAFETY: uninitialized device memory; every user writes what it reads first (the
            // partial rows are written whole by stage 1, the words are zeroed below).
            let fresh = allocate(stream, len * size_of::<T>(), during, || unsafe {
                stream.alloc::<T>(len)
            })?;
            buffer.insert(fresh)
        }
    };
    Ok(buffer.slice_mut(..len))
}

impl Workspace {
    /// Two partial buffers of `len` f32 each, uninitialized: stage 1 writes every element it
    /// hands to stage 2.
    pub(crate) fn partials<'a>(
        &'a mut self,
        stream: &std::sync::Arc<CudaStream>,
        len: usize,
    ) -> Result<(CudaViewMut<'a, f32>, CudaViewMut<'a, f32>)> {
        let during = "allocating the backward's partial sums";
        let dgamma = at_least(&mut self.part_dgamma, stream, len, during)?;
        let dbeta = at_least(&mut self.part_dbeta, stream, len, during)?;
        Ok((dgamma, dbeta))
    }

    /// The partials as [`Workspace::partials`], and `words` lock and count words, zero as the
    /// locked stage 1 requires: zeroed by a memset queued on `stream` where they are newly
    /// allocated; otherwise the last locked stage 1 on this stream left them zero (each
    /// group's last unit resets its count, every lock is released), so a call queues no
    /// memset, a launch of its own.
    pub(crate) fn locked<'a>(
        &'a mut self,
        stream: &std::sync::Arc<CudaStream>,
        len: usize,
        words: usize,
    ) -> Result<(CudaViewMut<'a, f32>, CudaViewMut<'a, f32>, CudaViewMut<'a, u32>)> {
        let during = "allocating the backward's partial sums";
        let dgamma = at_least(&mut self.part_dgamma, stream, len, during)?;
        let dbeta = at_least(&mut self.part_dbeta, stream, len, during)?;
        let fresh = !matches!(&self.words, Some(kept) if kept.len() >= words);
        let mut words = at_least(&mut self.words, stream, words, "allocating locks")?;
        if fresh {
            stream.memset_zeros(&mut words).during("zeroing the lock words")?;
        }
        Ok((dgamma, dbeta, words))
    }
}
