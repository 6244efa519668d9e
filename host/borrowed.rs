//! Shaped borrows of CUDA memory that stays the caller's: inputs over a `CudaView`, outputs
//! over a `CudaViewMut`, for [`crate::LayerNorm::forward_borrowed`] and
//! [`crate::LayerNorm::backward_borrowed`]. Nothing is copied; the op checks that the memory
//! is in its device's context and queues its work on its device's stream.

use cudarc::driver::{CudaContext, CudaView, CudaViewMut, DeviceSlice};

use crate::element::Element;
use crate::error::Result;
use crate::tensor::check_length;

/// A read-only `[..., n]` tensor over a `CudaView` of yours (x, dy): no copy, and the
/// memory stays yours. The op reads it on its device's stream; writes of yours on other
/// streams must be ordered before (cudarc's event tracking does it where it is on).
#[derive(Debug)]
pub struct BorrowedTensor<'a, T: Element> {
    data: CudaView<'a, T>,
    shape: Vec<usize>,
}

impl<'a, T: Element> BorrowedTensor<'a, T> {
    /// `data` seen with `shape`, row-major. [`crate::Error::Length`] where `shape` does not
    /// hold exactly `data.len()` elements.
    pub fn new(data: CudaView<'a, T>, shape: &[usize]) -> Result<Self> {
        check_length("the borrowed view", data.len(), shape)?;
        Ok(BorrowedTensor {
            data,
            shape: shape.to_vec(),
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The memory (a copy of the view, not of the data): e.g. to read s through the
    /// context of a residual forward ([`crate::Context::normalized`]).
    pub fn cuda_view(&self) -> CudaView<'a, T> {
        self.data.slice(..)
    }

    /// The context the memory belongs to.
    pub(crate) fn context(&self) -> &CudaContext {
        self.data.stream().context()
    }
}

impl<T: Element> Clone for BorrowedTensor<'_, T> {
    fn clone(&self) -> Self {
        BorrowedTensor {
            data: self.cuda_view(),
            shape: self.shape.clone(),
        }
    }
}

/// A writable `[..., n]` tensor over a `CudaViewMut` of yours (y, dx, dgamma, dbeta): the
/// op writes it on its device's stream; uses of yours on other streams must be ordered
/// after (cudarc's event tracking does it where it is on).
#[derive(Debug)]
pub struct BorrowedTensorMut<'a, T: Element> {
    data: CudaViewMut<'a, T>,
    shape: Vec<usize>,
}

impl<'a, T: Element> BorrowedTensorMut<'a, T> {
    /// `data` seen with `shape`, row-major. [`crate::Error::Length`] where `shape` does not
    /// hold exactly `data.len()` elements.
    pub fn new(data: CudaViewMut<'a, T>, shape: &[usize]) -> Result<Self> {
        check_length("the borrowed view", data.len(), shape)?;
        Ok(BorrowedTensorMut {
            data,
            shape: shape.to_vec(),
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The same memory and shape, read-only from here on (as cudarc's `into_view`), for as
    /// long as the borrow lasts.
    pub fn into_shared(self) -> BorrowedTensor<'a, T> {
        BorrowedTensor {
            data: self.data.into_view(),
            shape: self.shape,
        }
    }

    /// The memory, for the op.
    pub(crate) fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.data.slice_mut(..)
    }

    /// The context the memory belongs to.
    pub(crate) fn context(&self) -> &CudaContext {
        self.data.stream().context()
    }
}
