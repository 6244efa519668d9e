//! Row-major tensors on the CPU or a CUDA device, views of them, and their storage, with the
//! `Device` methods that allocate it (`upload`, `full`, `zeros`).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView};
use ndarray::{Array1, Array2, ArrayD, ArrayView, Dimension, IxDyn};

use crate::device::{Device, Kind};
use crate::element::Element;
use crate::error::{DriverContext, Error, Result};
use crate::gpu::storage::{CudaStorage, allocate};

/// A dense row-major tensor: a whole allocation, or a view of a run of consecutive elements
/// of another tensor ([`Tensor::view`], [`Tensor::slice_rows`]). Cloning and views share the
/// storage; tensors are immutable except through the `*_into` ops, which write only into a
/// whole tensor that is its storage's only handle.
#[derive(Clone)]
pub struct Tensor<T: Element> {
    device: Device,
    shape: Vec<usize>,
    /// Index in the storage of this tensor's first element (0 but for views).
    offset: usize,
    data: Arc<Data<T>>,
}

pub(crate) enum Data<T> {
    Host(Vec<T>),
    /// Device memory, with the record that orders its uses across streams.
    Cuda(CudaStorage<T>),
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
fn element_count<T: Element>(what: &'static str, shape: &[usize]) -> Result<usize> {
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

/// Refuses memory of `len` elements for `shape` unless `shape` has exactly `len` elements.
pub(crate) fn check_length(what: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    if shape.iter().try_fold(1usize, |count, &d| count.checked_mul(d)) == Some(len) {
        Ok(())
    } else {
        Err(Error::Length {
            what,
            len,
            shape: shape.to_vec(),
        })
    }
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
    fn new(device: Device, shape: Vec<usize>, data: Data<T>) -> Tensor<T> {
        debug_assert_eq!(data.len(), shape.iter().product::<usize>());
        Tensor {
            device,
            shape,
            offset: 0,
            data: Arc::new(data),
        }
    }

    /// A view of `shape` over this tensor's elements `offset..offset + len`, in row-major
    /// order (`len` being the element count of `shape`): no copy, the storage is shared.
    ///
    /// Views start at any element, so their rows need not be aligned for the kernels'
    /// 16-byte loads; the kernels then read such rows element by element, with the same
    /// results. A view can be any input of an op (x, gamma, beta, dy); as the output of a
    /// `*_into` call it is refused with [`Error::ViewOutput`]. Errors:
    /// [`Error::ViewOutOfRange`] where the view reaches past this tensor's end,
    /// [`Error::Shape`] where `shape`'s size overflows.
    pub fn view(&self, offset: usize, shape: &[usize]) -> Result<Tensor<T>> {
        let len = element_count::<T>("view", shape)?;
        let available = self.len();
        if offset.checked_add(len).is_none_or(|end| end > available) {
            return Err(Error::ViewOutOfRange {
                offset,
                len,
                available,
            });
        }
        Ok(Tensor {
            device: self.device.clone(),
            shape: shape.to_vec(),
            offset: self.offset + offset,
            data: self.data.clone(),
        })
    }

    /// Rows `rows` (indices along the first dimension) as a view: shape
    /// `[rows.len(), ...the other dimensions]`, sharing the storage as [`Tensor::view`].
    /// Errors: [`Error::RowsOutOfRange`] unless `rows.start <= rows.end <= shape[0]`,
    /// [`Error::Shape`] for a 0-dimensional tensor.
    pub fn slice_rows(&self, rows: Range<usize>) -> Result<Tensor<T>> {
        let Some((&count, rest)) = self.shape.split_first() else {
            return Err(Error::Shape {
                what: "tensor",
                got: self.shape.clone(),
                expected: "at least one dimension to slice rows of".into(),
            });
        };
        if rows.start > rows.end || rows.end > count {
            return Err(Error::RowsOutOfRange {
                start: rows.start,
                end: rows.end,
                rows: count,
            });
        }
        // Multiplied from rows.start on: a tensor with no rows may have other dimensions whose
        // product overflows, and its one range starts at 0. Saturating, so an offset that
        // cannot exist is refused by `view` instead of wrapping around.
        let offset = rest.iter().fold(rows.start, |o, &d| o.saturating_mul(d));
        let mut shape = self.shape.clone();
        shape[0] = rows.len();
        self.view(offset, &shape)
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

    /// Whether this tensor is a view of part of its storage (an input only, never an output).
    pub fn is_view(&self) -> bool {
        self.len() != self.data.len()
    }

    /// The elements in row-major order, copied to the host ([`Error::OutOfMemory`] where
    /// host memory cannot hold them).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let during = "copying to the host";
        let mut out = host_vec(self.len(), during)?;
        match (&*self.data, &self.device.kind) {
            (Data::Host(v), _) => out.extend_from_slice(&v[self.range()]),
            (Data::Cuda(s), Kind::Cuda(g)) => {
                out.resize(self.len(), T::default());
                let s = s.read(&g.stream)?;
                g.stream
                    .memcpy_dtoh(&s.slice(self.range()), &mut out)
                    .during(during)?;
            }
            (Data::Cuda(_), Kind::Cpu) => unreachable!("CUDA storage always carries its CUDA device"),
        }
        Ok(out)
    }

    /// Copies to the host as an n-dimensional array. [`Error::Shape`] where ndarray cannot
    /// hold the shape: no elements, but other dimensions whose product passes `isize::MAX`.
    pub fn to_array(&self) -> Result<ArrayD<T>> {
        let v = self.to_vec()?;
        ArrayD::from_shape_vec(IxDyn(&self.shape), v).map_err(|_| self.not_an_array())
    }

    /// Copies a 2-D tensor to the host ([`Error::Shape`] as [`Tensor::to_array`]).
    pub fn to_array2(&self) -> Result<Array2<T>> {
        let [r, c] = self.dims2("tensor")?;
        Array2::from_shape_vec((r, c), self.to_vec()?).map_err(|_| self.not_an_array())
    }

    /// The one shape ndarray refuses that a tensor can have (the length always matches).
    fn not_an_array(&self) -> Error {
        Error::Shape {
            what: "tensor",
            got: self.shape.clone(),
            expected: format!(
                "dimensions whose product, zeros left out, is at most {}",
                isize::MAX
            ),
        }
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

    /// A tensor of `shape` over `slice`, a `CudaSlice` of yours in `device`'s context, taken
    /// over without a copy (give it back with [`Tensor::into_cuda_slice`]). Its pending
    /// work counts as queued on the stream it was allocated on (`slice.stream()`), which
    /// this crate's first use on another stream waits for; a write of yours queued on a
    /// third stream must be ordered by you (cudarc's event tracking does it where it is on).
    ///
    /// Errors: [`Error::NotCuda`] for the CPU, [`Error::ContextMismatch`] or
    /// [`Error::DeviceMismatch`] for a slice of another context or GPU, [`Error::Length`]
    /// where `shape` does not hold exactly `slice.len()` elements.
    pub fn from_cuda_slice(device: &Device, slice: CudaSlice<T>, shape: &[usize]) -> Result<Tensor<T>> {
        device.check_context("the slice", slice.context())?;
        check_length("the slice", slice.len(), shape)?;
        Ok(Tensor::new(
            device.clone(),
            shape.to_vec(),
            Data::Cuda(CudaStorage::new(slice)),
        ))
    }

    /// This tensor's memory as a `CudaSlice`, without a copy or a host wait: queued work on
    /// the device handle's stream and on the slice's own stream (`slice.stream()`, which
    /// frees it) runs after every use of it so far, on any stream. Only a whole tensor that
    /// is its storage's sole handle can give its memory up.
    ///
    /// Errors: [`Error::NotCuda`] on the CPU, [`Error::ViewOutput`] for a view,
    /// [`Error::SharedOutput`] where another handle shares the storage (this handle is
    /// dropped either way; the others keep the storage).
    pub fn into_cuda_slice(self) -> Result<CudaSlice<T>> {
        let what = "the tensor given up as a CudaSlice";
        let Kind::Cuda(g) = &self.device.kind else {
            return Err(Error::NotCuda { what });
        };
        if self.is_view() {
            return Err(Error::ViewOutput { what });
        }
        match Arc::try_unwrap(self.data) {
            Ok(Data::Cuda(s)) => s.into_slice(&g.stream),
            Ok(Data::Host(_)) => unreachable!("a CUDA device's tensors have CUDA storage"),
            Err(_) => Err(Error::SharedOutput { what }),
        }
    }

    /// This tensor's elements (a view's included) as a `CudaView`, for reads queued on the
    /// device handle's stream ([`Device::cuda_stream`]): that stream has waited for the last
    /// write, and later writes and the free wait for it. No copy, no host wait.
    /// [`Error::NotCuda`] on the CPU.
    pub fn cuda_view(&self) -> Result<CudaView<'_, T>> {
        match (&*self.data, &self.device.kind) {
            (Data::Cuda(s), Kind::Cuda(g)) => Ok(s.read(&g.stream)?.slice(self.range())),
            _ => Err(Error::NotCuda {
                what: "the tensor viewed as a CudaView",
            }),
        }
    }

    /// The storage; this tensor's elements are `range()` of it.
    pub(crate) fn data(&self) -> &Data<T> {
        &self.data
    }

    /// Where this tensor's elements lie in its storage.
    pub(crate) fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }

    /// Whether this is a whole tensor and its storage's only handle: what
    /// [`Tensor::data_mut`] lets an op write.
    pub(crate) fn is_sole(&self) -> bool {
        !self.is_view() && Arc::strong_count(&self.data) == 1 && Arc::weak_count(&self.data) == 0
    }

    /// The storage, for writing: only a whole tensor (not a view), and only its sole handle.
    pub(crate) fn data_mut(&mut self, what: &'static str) -> Result<&mut Data<T>> {
        if self.is_view() {
            return Err(Error::ViewOutput { what });
        }
        Arc::get_mut(&mut self.data).ok_or(Error::SharedOutput { what })
    }
}

// `Device`'s methods that make tensors or take one live here, beside the storage they
// fill, so that device.rs needs nothing of tensors: the device is the layer below,
// tensors build on it, and the op on both.
impl Device {
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
                let mut s = allocate(&g.stream, len * size_of::<T>(), ALLOC, || unsafe {
                    g.stream.alloc::<T>(len)
                })?;
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
            Kind::Cuda(g) => Data::Cuda(CudaStorage::new(allocate(
                &g.stream,
                len * size_of::<T>(),
                ALLOC,
                || g.stream.alloc_zeros::<T>(len),
            )?)),
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
            Kind::Cuda(g) => Data::Cuda(CudaStorage::new(allocate(
                &g.stream,
                len * size_of::<T>(),
                ALLOC,
                || unsafe { g.stream.alloc::<T>(len) },
            )?)),
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
            Kind::Cuda(g) => Data::Cuda(CudaStorage::new(allocate(
                &g.stream,
                size_of_val(host),
                "copying to the device",
                || g.stream.clone_htod(host),
            )?)),
        })
    }

    /// Refuses a tensor from another device or CUDA context.
    pub(crate) fn check<T: Element>(&self, what: &'static str, t: &Tensor<T>) -> Result<()> {
        self.check_device(what, t.device())
    }
}

/// What `Error::OutOfMemory` says a tensor allocation was doing.
const ALLOC: &str = "allocating a tensor";

/// `len` copies of `value` in host memory, or [`Error::OutOfMemory`].
pub(crate) fn host_filled<T: Element>(len: usize, value: T) -> Result<Vec<T>> {
    let mut v = host_vec(len, ALLOC)?;
    v.resize(len, value);
    Ok(v)
}

impl<T: Element> std::fmt::Debug for Tensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor<{}>{:?} on {}", T::NAME, self.shape, self.device.name())?;
        if self.is_view() {
            write!(f, " (a view from element {})", self.offset)?;
        }
        Ok(())
    }
}
