//! Device memory that several streams may use, and the record that orders their uses.
//!
//! cudarc can order the streams that use a `CudaSlice` itself, with a read and a write event
//! per slice, but it records the read event again at every read: after reads on two streams
//! a write or a free waits for the later one only, while the earlier may still be running.
//! Its tracking is therefore off in this crate's contexts (`Gpu::open`), and each storage
//! keeps its own record instead: the stream that last wrote it, and the other streams that
//! have read it since. Uses on another stream are ordered lazily, when they come, by a
//! wait for the other stream's tail (an event recorded on it then: a stream runs its work
//! in order, so its tail includes every use it queued before):
//! - a read on S waits for the last writer's tail, unless S is the writer or has waited
//!   for it already (then it is in the record's readers);
//! - a write on S, and the free (cudarc queues it on the stream the memory was allocated
//!   on), wait for the tails of the writer and of every reader, other than S itself.
//!
//! The allocation counts as a write on its stream (the memory exists only in that stream's
//! order), so a program that uses one stream never meets another stream here and records
//! no events at all. A caller's `CudaSlice` taken over by a tensor
//! (`Tensor::from_cuda_slice`) starts the same way: its pending work counts as queued on
//! the stream it was allocated on, `slice.stream()`.
//!
//! Contexts that are not this crate's (`Device::from_cuda_stream`) keep the event tracking
//! their owner chose. Where it is on, cudarc also waits and records its own events for each
//! slice, beside this record: every wait it adds is for work this record orders as well or
//! for work on the same stream, so results are the same and only event calls are added;
//! where it is off, this record alone orders tensors, as in this crate's own contexts.
//! Memory that stays the caller's (`BorrowedTensor`, `BorrowedTensorMut`) is used only on
//! the op's stream; how it is ordered with the caller's other streams is the caller's, as
//! for any cudarc view (cudarc's tracking does it where it is on).
//!
//! A tensor gives its slice back (`Tensor::into_cuda_slice`) once every stream of the
//! record has been waited for, by the device handle's stream and by the slice's own.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaSlice, CudaStream, DriverError};

use crate::error::{AllocContext, DriverContext, Result};

/// Device memory of `bytes` from `alloc`, an allocation queued on `stream`.
///
/// The stream-ordered pool keeps memory freed in stream order reserved, not free on the
/// device, until a synchronization hands it back; an allocation larger than what the device
/// has free then fails although the program holds far less. So where the driver reports out
/// of memory, this waits for the context's streams (their queued frees run, and the pool
/// returns what they free) and tries once more before it reports [`crate::Error::OutOfMemory`].
pub(crate) fn allocate<S>(
    stream: &CudaStream,
    bytes: usize,
    during: &'static str,
    mut alloc: impl FnMut() -> std::result::Result<S, DriverError>,
) -> Result<S> {
    match alloc() {
        Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            stream.context().synchronize().during(during)?;
            alloc()
        }
        first => first,
    }
    .allocating(bytes, during)
}

/// A device allocation and the record of the streams that have used it.
pub(crate) struct CudaStorage<T> {
    /// Reached only through [`CudaStorage::read`] and [`CudaStorage::write`], which order
    /// the use first.
    slice: CudaSlice<T>,
    uses: Mutex<Uses>,
}

/// The streams that have used a storage since its last write.
struct Uses {
    /// The stream of the last write.
    writer: Arc<CudaStream>,
    /// Streams other than `writer` that have read since, each after a wait for the write.
    readers: Vec<Arc<CudaStream>>,
}

impl<T> CudaStorage<T> {
    /// The storage of `slice`, which has been used (allocated, perhaps written) on no stream
    /// but the one it was allocated on.
    pub(crate) fn new(slice: CudaSlice<T>) -> CudaStorage<T> {
        let writer = slice.stream().clone();
        CudaStorage {
            slice,
            uses: Mutex::new(Uses {
                writer,
                readers: Vec::new(),
            }),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.slice.len()
    }

    /// The memory, to be read by work queued on `stream` next: `stream` has been made to wait
    /// for the last write.
    pub(crate) fn read(&self, stream: &Arc<CudaStream>) -> Result<&CudaSlice<T>> {
        // No driver call is made under the lock. The writer cannot change meanwhile (a write
        // needs `&mut self`), and `stream` joins the readers only once its wait is queued, so
        // a second thread reading on `stream` never skips a wait that is not queued yet.
        let writer = {
            let uses = self.lock();
            (!uses.waited(stream)).then(|| uses.writer.clone())
        };
        if let Some(writer) = writer {
            stream
                .join(&writer)
                .during("ordering a read after another stream's write")?;
            let mut uses = self.lock();
            if !uses.waited(stream) {
                uses.readers.push(stream.clone());
            }
        }
        Ok(&self.slice)
    }

    /// The memory, to be written by work queued on `stream` next: `stream` has been made to
    /// wait for every other stream's use since the last write, and the write.
    pub(crate) fn write(&mut self, stream: &Arc<CudaStream>) -> Result<&mut CudaSlice<T>> {
        let uses = self.uses.get_mut().unwrap_or_else(PoisonError::into_inner);
        uses.join_all(stream)
            .during("ordering a write after other streams' uses")?;
        if !Arc::ptr_eq(&uses.writer, stream) {
            uses.writer = stream.clone();
        }
        uses.readers.clear();
        Ok(&mut self.slice)
    }

    /// The slice itself, for the caller to use on `stream` or on the stream it was allocated
    /// on: both wait for every use in the record first (no host wait).
    pub(crate) fn into_slice(self, stream: &Arc<CudaStream>) -> Result<CudaSlice<T>> {
        // Taken apart by hand: `Drop` would order a free that is not coming.
        let mut this = ManuallyDrop::new(self);
        let ordered = this
            .uses
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .join_all(stream)
            .and_then(|()| {
                let home = this.slice.stream();
                if Arc::ptr_eq(home, stream) {
                    Ok(())
                } else {
                    home.join(stream)
                }
            });
        // SAFETY: `this` is ManuallyDrop and neither used nor dropped after these two reads,
        // so each field is moved out exactly once and nothing is dropped twice.
        let (slice, uses) = unsafe { (std::ptr::read(&this.slice), std::ptr::read(&this.uses)) };
        drop(uses);
        match ordered {
            Ok(()) => Ok(slice),
            Err(e) => {
                // The slice is dropped on return, and its free must not overtake the uses
                // the failed wait would have ordered: wait for the whole device, as `Drop`
                // does on the same error.
                let synchronized = slice.context().synchronize();
                slice.context().record_err(synchronized);
                Err(e).during("ordering a tensor's memory before giving it up")
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Uses> {
        // Each change to the record is one push or one assignment, so a panic elsewhere while
        // the lock was held cannot have left it half made.
        self.uses.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Uses {
    /// Whether work queued on `stream` from now on runs after the last write.
    fn waited(&self, stream: &Arc<CudaStream>) -> bool {
        Arc::ptr_eq(&self.writer, stream) || self.readers.iter().any(|r| Arc::ptr_eq(r, stream))
    }

    /// Makes `stream` wait for the work queued so far on every other stream of the record.
    fn join_all(&self, stream: &Arc<CudaStream>) -> std::result::Result<(), DriverError> {
        for other in std::iter::once(&self.writer).chain(&self.readers) {
            if !Arc::ptr_eq(other, stream) {
                stream.join(other)?;
            }
        }
        Ok(())
    }
}

impl<T> Drop for CudaStorage<T> {
    fn drop(&mut self) {
        // `slice` is dropped after this, and cudarc queues its free on the stream it was
        // allocated on: that stream waits for the other streams' uses first.
        let free_on = self.slice.stream();
        let uses = self.uses.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = uses.join_all(free_on) {
            // A drop cannot return the error. Wait for all of the device's work instead, so
            // the free is safe all the same, and leave the error in the context for its next
            // call to report, as cudarc does with errors in its own drops. (The wait goes
            // first: it begins by taking any stored error, and would fail with ours unwaited.)
            let ctx = free_on.context();
            let synchronized = ctx.synchronize();
            ctx.record_err::<()>(Err(e));
            ctx.record_err(synchronized);
        }
    }
}
