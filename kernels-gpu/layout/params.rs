//! The kernels' parameters: one `#[repr(C)]` struct per list that several kernels share. The
//! host fills them and passes each by value (cuLaunchKernel copies its bytes into the
//! kernel's parameter space); the kernel reads its fields there (`ld.param`). Both compile
//! this file, so a field added, removed or reordered changes both sides at once, and the PTX
//! shows each struct as one `.param .align 8 .b8 name[size]`.
//!
//! Device addresses are 64-bit integers on both sides, typed by what they point at: the
//! host has them from the driver, and a kernel turns them into pointers (`ptr`).

use core::marker::PhantomData;

use super::registry::Variant;

/// The device address of `T` values a kernel reads.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct In<T> {
    address: u64,
    points_at: PhantomData<fn() -> T>,
}

/// The device address of `T` values a kernel writes (and may read back).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Out<T> {
    address: u64,
    points_at: PhantomData<fn() -> T>,
}

impl<T> In<T> {
    /// The address the driver gave for this buffer.
    pub const fn new(address: u64) -> Self {
        In {
            address,
            points_at: PhantomData,
        }
    }
    /// No buffer: address 0, for an optional input that is absent.
    pub const fn none() -> Self {
        In::new(0)
    }
    /// As a pointer: only a kernel can read through it.
    #[inline(always)]
    pub fn ptr(self) -> *const T {
        self.address as *const T
    }
}

impl<T> Out<T> {
    /// The address the driver gave for this buffer.
    pub const fn new(address: u64) -> Self {
        Out {
            address,
            points_at: PhantomData,
        }
    }
    /// No buffer: address 0, for an optional output that is absent.
    pub const fn none() -> Self {
        Out::new(0)
    }
    /// As a pointer: only a kernel can write through it.
    #[inline(always)]
    pub fn ptr(self) -> *mut T {
        self.address as *mut T
    }
}

/// Plain data the kernels take by value: `#[repr(C)]`, of integers and addresses only, laid
/// out alike on the host (x86-64, aarch64) and the GPU.
///
/// # Safety
/// Only the structs of this file implement it.
pub unsafe trait KernelParams: Copy {}

/// The forward's: `[rows, n]` x in, y out (of type `T`), `[n]` gamma and beta (of type `W`:
/// `T`, or f32 beside f16 and bf16), `[rows]` f32 mean and rstd out, eps, and what each
/// gamma_j takes added as it is read (1 for zero-centred weights, else -0, which leaves
/// every value's bits as they are). With a residual (address not 0), the rows normalized
/// are s = x + residual, which the kernel writes to `sum` (`[rows, n]` of `T` each; address
/// 0 for both where there is none).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Forward<T, W, R = T> {
    pub x: In<T>,
    pub residual: In<R>,
    pub sum: Out<R>,
    pub gamma: In<W>,
    pub beta: In<W>,
    pub y: Out<T>,
    pub mean: Out<f32>,
    pub rstd: Out<f32>,
    pub rows: u32,
    pub n: u32,
    pub eps: f32,
    pub gamma_offset: f32,
}

/// Every stage 1's rows: `[rows, n]` x and dy in, dx out (of type `T`), `[n]` gamma (of type
/// `W`) and its offset (as [`Forward`]'s), and the forward's `[rows]` mean and rstd. `dsum`,
/// where its address is not 0, is the gradient that reaches a residual forward's s from
/// elsewhere (`[rows, n]` of `T`), which dx then includes.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct BackwardRows<T, W, X = T> {
    pub x: In<X>,
    pub dy: In<T>,
    pub dsum: In<X>,
    pub gamma: In<W>,
    pub mean: In<f32>,
    pub rstd: In<f32>,
    pub dx: Out<T>,
    /// With a residual stream of another type than x (f32 beside f16 or bf16), where the
    /// address is not 0: dx again, in the stream's type (the gradient of the residual,
    /// which rounding to x's type would cut); address 0 otherwise.
    pub dres: Out<X>,
    pub rows: u32,
    pub n: u32,
    pub gamma_offset: f32,
}

/// Where every stage 1's blocks hand their partial sums over (the kernels'
/// `partials::Destination`), in one of two modes:
/// - owned (`groups` = 0, `words` none): `[R, n]` f32 each, one row per block (or cluster),
///   which it writes whole;
/// - locked (`groups` = G >= 1): `[2G, n]` f32 each, the group sums then their
///   compensations (`[2G + R, n]` for the owned kernel without `local`, whose blocks keep
///   their own rows after those), and `2 * G * C` zeroed lock and count words (C the blocks
///   of a cluster, 1 without clusters).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Partials {
    pub dgamma: Out<f32>,
    pub dbeta: Out<f32>,
    pub words: Out<u32>,
    pub groups: u32,
}

/// Stage 2's: `[rows, n]` f32 partials in, `[n]` dgamma and dbeta out (of the weights' type).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Reduce<T> {
    pub part_dgamma: In<f32>,
    pub part_dbeta: In<f32>,
    pub dgamma: Out<T>,
    pub dbeta: Out<T>,
    pub rows: u32,
    pub n: u32,
}

// SAFETY: `#[repr(C)]`, of 64-bit addresses and 32-bit numbers only (all four impls).
unsafe impl<T: Copy, W: Copy, R: Copy> KernelParams for Forward<T, W, R> {}
// SAFETY: as above.
unsafe impl<T: Copy, W: Copy, X: Copy> KernelParams for BackwardRows<T, W, X> {}
// SAFETY: as above.
unsafe impl<T: Copy> KernelParams for Reduce<T> {}
// SAFETY: as above.
unsafe impl KernelParams for Partials {}

/// The bytes of each parameter that `variant`'s kernels declare, in order (the same for
/// every type pair): what the host passes, and what a test finds in the PTX.
pub const fn param_bytes(variant: Variant) -> &'static [usize] {
    use core::mem::size_of;
    const ROWS: usize = size_of::<BackwardRows<f32, f32>>();
    match variant {
        Variant::FwdWarp
        | Variant::FwdBlock
        | Variant::FwdPipelinedWarp
        | Variant::FwdPipelinedBlock
        | Variant::FwdRowBlock
        | Variant::FwdHeldShifted
        | Variant::FwdWidenedWarp
        | Variant::FwdFewRows
        | Variant::FwdResidualHeld
        | Variant::FwdResidualHeldShifted
        | Variant::FwdResidualStreamed
        | Variant::FwdResidualWarp
        | Variant::FwdResidualBlock
        | Variant::FwdResidualPipelinedWarp
        | Variant::FwdResidualPipelinedBlock => &[size_of::<Forward<f32, f32>>()],
        Variant::BwdOwnedWarp | Variant::BwdOwnedBlock => &[ROWS, size_of::<Partials>(), size_of::<u32>()],
        Variant::BwdHeldWarp
        | Variant::BwdHeldBlock
        | Variant::BwdHeldBlockHalves
        | Variant::BwdHeldBlockShifted
        | Variant::BwdCluster8
        | Variant::BwdCluster2Held
        | Variant::BwdCluster4Held
        | Variant::BwdCluster8Held
        | Variant::BwdCluster2HeldHalves
        | Variant::BwdCluster4HeldHalves
        | Variant::BwdCluster8HeldHalves => &[ROWS, size_of::<Partials>()],
        Variant::BwdReduce => &[size_of::<Reduce<f32>>()],
    }
}
