//! Row-major tensors on the CPU or a CUDA device.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use ndarray::{Array1, Array2, ArrayD, IxDyn};

use crate::device::{Device, Kind};
use crate::element::Element;
use crate::error::{DriverContext, Error, Result};

/// A dense row-major tensor. Cloning shares the storage (tensors are immutable except
/// through the `*_into` ops, which need the only handle).
#[derive(Clone)]
pub struct Tensor<T: Element> {
    device: Device,
    shape: Vec<usize>,
    data: Arc<Data<T>>,
}

pub(crate) enum Data<T> {
    Host(Vec<T>),
    Cuda(CudaSlice<T>),
}

impl<T> Data<T> {
    fn len(&self) -> usize {
        match self {
            Data::Host(v) => v.len(),
            Data::Cuda(s) => s.len(),
        }
    }
}

/// The number of elements of `shape`, or a shape error naming `what` where the product, in
/// bytes of `T`, does not fit in `isize` (the most one allocation may hold).
pub(crate) fn element_count<T: Element>(what: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |count, &d| count.checked_mul(d))
        .filter(|&count| {
            count
                .checked_mul(size_of::<T>())
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| Error::Shape {
            what,
            got: shape.to_vec(),
            expected: format!("at most {} bytes of {} in all", isize::MAX, T::NAME),
        })
}

/// An empty host vector with room for `len` elements, or [`Error::OutOfMemory`] where host
/// memory cannot provide it (instead of aborting the process).
pub(crate) fn host_vec<T>(len: usize, during: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        bytes: len.saturating_mul(size_of::<T>()),
        during,
    })?;
    Ok(v)
}

impl<T: Element> Tensor<T> {
    /// A whole tensor over `data`, which holds exactly the elements of `shape`.
    pub(crate) fn new(device: Device, shape: Vec<usize>, data: Data<T>) -> Tensor<T> {
        debug_assert_eq!(data.len(), shape.iter().product::<usize>());
        Tensor {
            device,
            shape,
            data: Arc::new(data),
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The elements in row-major order, copied to the host ([`Error::OutOfMemory`] where
    /// host memory cannot hold them).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let during = "copying to the host";
        let mut out = host_vec(self.len(), during)?;
        match (&*self.data, &self.device.kind) {
            (Data::Host(v), _) => out.extend_from_slice(v),
            (Data::Cuda(s), Kind::Cuda(g)) => {
                out.resize(self.len(), T::default());
                g.stream.memcpy_dtoh(s, &mut out).during(during)?;
            }
            (Data::Cuda(_), Kind::Cpu) => unreachable!("CUDA storage always carries its CUDA device"),
        }
        Ok(out)
    }

    /// Copies to the host as an n-dimensional array.
    pub fn to_array(&self) -> Result<ArrayD<T>> {
        let v = self.to_vec()?;
        Ok(ArrayD::from_shape_vec(IxDyn(&self.shape), v).expect("a tensor's length matches its shape"))
    }

    /// Copies a 2-D tensor to the host.
    pub fn to_array2(&self) -> Result<Array2<T>> {
        let [r, c] = self.dims2("tensor")?;
        Ok(Array2::from_shape_vec((r, c), self.to_vec()?).expect("a tensor's length matches its shape"))
    }

    /// Copies a 1-D tensor to the host.
    pub fn to_array1(&self) -> Result<Array1<T>> {
        let [n] = self.dims1("tensor")?;
        Ok(Array1::from_shape_vec(n, self.to_vec()?).expect("a tensor's length matches its shape"))
    }

    /// The two dimensions of a 2-D tensor, or a shape error naming `what`.
    pub(crate) fn dims2(&self, what: &'static str) -> Result<[usize; 2]> {
        match self.shape[..] {
            [r, c] => Ok([r, c]),
            _ => Err(Error::Shape {
                what,
                got: self.shape.clone(),
                expected: "a 2-D [rows, n] tensor".into(),
            }),
        }
    }

    /// The length of a 1-D tensor, or a shape error naming `what`.
    pub(crate) fn dims1(&self, what: &'static str) -> Result<[usize; 1]> {
        match self.shape[..] {
            [n] => Ok([n]),
            _ => Err(Error::Shape {
                what,
                got: self.shape.clone(),
                expected: "a 1-D tensor".into(),
            }),
        }
    }

    /// Refuses anything but exactly `shape`.
    pub(crate) fn expect_shape(&self, what: &'static str, shape: &[usize]) -> Result<()> {
        if self.shape == shape {
            Ok(())
        } else {
            Err(Error::Shape {
                what,
                got: self.shape.clone(),
                expected: format!("{shape:?}"),
            })
        }
    }

    pub(crate) fn data(&self) -> &Data<T> {
        &self.data
    }

    /// The storage, for writing: only the sole handle may write.
    pub(crate) fn data_mut(&mut self, what: &'static str) -> Result<&mut Data<T>> {
        Arc::get_mut(&mut self.data).ok_or(Error::SharedOutput { what })
    }
}

impl<T: Element> std::fmt::Debug for Tensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor<{}>{:?} on {}", T::NAME, self.shape, self.device.name())
    }
}
