//! LayerNorm and RMSNorm backward, in two stages.
//!
//! Per row i, with xhat_j = (x_j - mean_i) * rstd_i and wdy_j = w_j * dy_j, where the
//! weight w_j is gamma_j + gamma_offset (1 for zero-centred weights, else -0; see
//! [`Rows::gamma`]):
//!   c1   = sum_j xhat_j * wdy_j / n
//!   c2   = sum_j wdy_j / n                         (RMSNorm: 0, since y does not depend on
//!                                                   x through a mean)
//!   dx_j = rstd_i * ((wdy_j - c2) - xhat_j * c1)   (computed in halves, see `Centering`)
//! and over all rows:
//!   dgamma_j = sum_i dy_ij * xhat_ij        dbeta_j = sum_i dy_ij
//! (dw_j / dgamma_j = 1, so the offset leaves dgamma as it is).
//! RMSNorm's forward wrote 0 as each row's mean, so its xhat is x_j * rstd_i here.
//! After a residual forward, x is its s (= x + residual), and the gradient reaching s from
//! the residual stream, dsum, where given, joins dx before it is rounded:
//!   dx_j += dsum_j     (dx is then also the gradient of the residual)
//!
//! Stage 1 writes dx and sums each row's (dy * xhat, dy) per block, in shared memory (or,
//! for rows too long for it, a row of global memory of the block's own), then hands the
//! block's sums over once, into an f32 buffer `[R, n]`. Stage 2 sums the R partial rows per
//! column into dgamma and dbeta. Partials are f32 whatever the storage type, so long columns
//! do not round in f16.
//!
//! Two ways to hand the sums over (`partials::Destination`), with the same kernels:
//! - owned (deterministic): each block, or cluster, alone owns one partial row; no locks,
//!   and every sum runs in a fixed order, so results are bitwise reproducible.
//! - locked (the Triton tutorial's scheme, per block rather than per row): block b adds its
//!   sums into group b mod G under that group's spinlock (an atomic compare-and-swap on a
//!   lock word); a count word says whether the group was written yet (first writer stores,
//!   later ones add), so the G rows need no clearing, only the lock and count words. Each
//!   group row keeps a compensation row beside it (Kahan summation); stage 2 sums the 2G
//!   rows. The order in which blocks take a lock varies, so the last bits may too.
//!
//! The kernels, for each type pair <T> of x and gamma (f32, f16, bf16, and f16 or bf16 x
//! with f32 gamma: `f16_f32w`, `bf16_f32w`; and each 16-bit pair whose residual stream is
//! kept in f32, `*_f32s`, whose rows and dsum are f32), as the host's planner
//! (host/plan.rs) picks them; teams are a warp per row for n <= 1024, a block per row
//! beyond:
//! - stage 1, either mode, the first that applies:
//!   - `layer_norm_bwd_cluster<C>_held_<T>`, `layer_norm_bwd_cluster8_<T>` (sm_90 module,
//!     block teams): rows too long for one block to hold in registers (4 packs a thread)
//!     or to sum in shared memory (8n bytes), where an eighth of a row's partials fits. A
//!     cluster of C blocks shares each row, block q taking its q-th slice; the row sums
//!     come from all slices through distributed shared memory (`st.async` into every
//!     block, an mbarrier a row; the sums alternate between two buffers). Where every row
//!     is whole aligned packs, `cluster<C>_held` (`stage1_cluster_held` in crate::cluster::backward): C = 2, 4 or 8, the fewest blocks whose
//!     slices fit 4 packs a rank (fewer blocks wait for each row's sums), each slice as in
//!     [`stage1_held`]; rows of 16-bit x, dy and weights of one type all 8-byte aligned,
//!     `cluster<C>_held_halves`, the same in half packs; else `cluster8`
//!     (`stage1_cluster`): each slice as in the general owned kernel, its partials in
//!     shared memory.
//!   - `layer_norm_bwd_held_{warp,block}_<T>` ([`stage1_held`]): every row whole aligned
//!     packs that fit 4 a rank, with room in shared memory for each rank's partials. x and
//!     dy held in registers; the row sums' pass keeps xhat and wdy in f32 and adds the
//!     partials into each rank's own shared memory (16-byte accesses, no barrier between
//!     rows), so the dx pass is three operations an element; each row's x, dy, mean and
//!     rstd loaded during the previous row's reduction (two rows in flight per team). Block
//!     teams stack along y, and all teams of a block add into one partial row.
//!     `layer_norm_bwd_held_block_halves_<T>` (f16, bf16): the same over rows of x, dy
//!     and weights of one type all 8-byte aligned, held in half packs (slot c keeps half
//!     packs rank + 2c * size and rank + (2c + 1) * size), read and written 8 bytes at a
//!     time. `layer_norm_bwd_held_block_shifted_<T>`: the same over rows of x, dy and
//!     weights of one type whose pointers (dy's and dx's) all sit as far past a 16-byte
//!     boundary as x's, held in packs from x's first boundary, the head and tail a column
//!     a rank; block b's teams take rows b, b + B, ... on a grid of B blocks whose B * n
//!     is whole packs, so all of a block's rows share their head and its ranks' partials
//!     their columns, and the block stages the weights of its packs' columns in shared
//!     memory once.
//!   - `layer_norm_bwd_owned_{warp,block}_<T>` ([`stage1_owned`]): all other rows. Each
//!     team sums its rows' partials in its own shared-memory row (padded by a word per 32:
//!     no bank conflicts), and the block hands their sum, in team order, over; block-team
//!     rows whose partials do not fit in shared memory add straight into the block's own
//!     row in global memory (sm_80, or past what clusters take).
//!
//!   In locked mode with G groups (by default the tutorial's counts, 256 for n <= 1024, 128
//!   to 4096, 96 to 8192, 64 beyond, or one for every 2 blocks or clusters where that is
//!   more; never more than the blocks or clusters).
//! - stage 2, both modes: `layer_norm_bwd_reduce_<W>` ([`stage2`]), W the type of the
//!   weights and their gradients. On sm_90 the host launches it as stage 1's programmatic
//!   dependent: every stage 1 lets it launch from its first instruction, and it waits for
//!   stage 1's end and writes before its first load, so its launch and the start of its
//!   blocks overlap stage 1's last rows instead of following them.
//!
//! The general kernels (owned, `cluster8`) take each row as its pointers and length
//! allow (`streamed::backward_row_any`): x and dy held in registers where the row is aligned and
//! fits 4 packs a rank, else read in 16-byte packs where aligned, in 8-byte half packs where
//! that aligned (x, dy and the weights of one size), in packs from the row's first 16-byte
//! boundary where every row pointer sits as far past one as x's (block teams), else
//! element by element; three passes (sums, dx, partials; cluster teams add a streamed
//! row's partials in the dx pass, so two), each chunk's loads before its stores, block
//! teams' in batches. docs/PERF.md has each version's changes and
//! measurements.
//!
//! Files: this one, the math every stage 1 shares (xhat, dx, the row sums) and the kernel
//! exports; `partials` (the partial rows, and where a block's sums go); `streamed` (the
//! general stage 1: rows of any length and alignment); `held` (the held stage 1);
//! `stage2`. The cluster stage 1 is `crate::cluster::backward`, compiled into the sm_90
//! module only.

// The cluster stage 1 (`crate::cluster::backward`, sm_90 only) shares these.
pub(crate) mod held;
pub(crate) mod partials;
mod stage2;
pub(crate) mod streamed;

use crate::device::{self, fma};
use crate::element::{Element, Pack, read_cached, read_cached_shifted};
use crate::layout::params::{BackwardRows, Partials, Reduce};
use crate::team::{Block, SCRATCH_BYTES, StackedBlock, Warp};
use held::stage1_held;
use partials::Destination;
use stage2::stage2;
use streamed::stage1_owned;

/// The inputs of one backward launch, as the host passes them. A team walks `cols` columns
/// from the row pointers: all `n` of them, or (clusters) a slice, with `x`, `dy`, `gamma`
/// and `dx` then pointing at the slice's first column.
#[derive(Clone, Copy)]
pub(crate) struct Rows<X, T, W> {
    pub(crate) x: *const X,
    pub(crate) dy: *const T,
    pub(crate) gamma: *const W,
    /// Added to each gamma_j as it is read (see [`Rows::gamma`]).
    pub(crate) gamma_offset: f32,
    pub(crate) mean: *const f32,
    pub(crate) rstd: *const f32,
    pub(crate) dx: *mut T,
    /// The gradient reaching a residual forward's s from the residual stream, which dx
    /// includes; null where there is none (see [`Rows::dsum_row`]).
    pub(crate) dsum: *const X,
    /// dx again in the stream's type, where the stream is wider than x and the launch gave
    /// one (see [`Rows::dres_row`]).
    pub(crate) dres: *mut X,
    pub(crate) rows: u32,
    /// Row length: the stride between rows, and the n of c1 and c2.
    pub(crate) n: u32,
    /// Columns this team walks.
    pub(crate) cols: u32,
    /// LayerNorm's rows (dx has the c2 term), or RMSNorm's (it does not).
    pub(crate) centered: bool,
}

impl<X, T, W> Rows<X, T, W> {
    /// The s2 that dx's c2 = s2 / n takes: the row's sum_j wdy_j, or 0 for rows that are not
    /// `centered` (RMSNorm), whose dx has no c2 term (then fma(wdy, 1/2, -0) is wdy / 2
    /// exactly). A plain value chosen here, not a branch inside [`DxCoefficients::new`]:
    /// each norm's kernels then keep the code and registers of their own arm only.
    #[inline(always)]
    pub(crate) fn s2(&self, sum_wdy: f32) -> f32 {
        if self.centered { sum_wdy } else { 0.0 }
    }

    /// The weights of `len` columns from `j` (one, or a pack of the rows' type `X`), each with
    /// the launch's offset added: gamma_j + 1 for zero-centred weights, and for others
    /// gamma_j + (-0), which is gamma_j to the bit (the forward's `Affine` says why).
    ///
    /// # Safety
    /// As [`read_cached`] requires of `gamma` + `j` (no launch writes gamma: its gradient
    /// goes to the partial rows and dgamma).
    #[inline(always)]
    pub(crate) unsafe fn gamma(&self, j: u32, len: usize) -> Pack
    where
        X: Element,
        W: Element,
    {
        // SAFETY: the caller's guarantee.
        let mut g = unsafe { read_cached::<W, true>(self.gamma, j, len) };
        for g in &mut g[..len] {
            *g += self.gamma_offset;
        }
        g
    }

    /// As [`Rows::gamma`], for the pack of columns whose weights a shifted block staged at
    /// `j` past shared address `staged` (`held::stage1_held`).
    ///
    /// # Safety
    /// The block staged them there, 16-byte aligned, W of x's size.
    #[inline(always)]
    pub(crate) unsafe fn gamma_staged(&self, staged: u32, j: u32) -> Pack
    where
        W: Element,
    {
        // SAFETY: the caller's guarantee.
        let mut g = W::unpack(unsafe { device::load_shared_16(staged + j * size_of::<W>() as u32) });
        for g in &mut g[..W::PACK] {
            *g += self.gamma_offset;
        }
        g
    }

    /// As [`Rows::gamma`], for columns whose first is off gamma's 16-byte boundaries (a
    /// shifted row's packs, `streamed::backward_row`), read as [`read_cached_shifted`] reads
    /// them: five loads and registers for 16-bit weights where an element at a time took
    /// eight of each (the owned block kernel spilled at its 64).
    ///
    /// # Safety
    /// Columns `j..j + len` are inside gamma (no launch writes it).
    #[inline(always)]
    pub(crate) unsafe fn gamma_shifted(&self, j: u32, len: usize) -> Pack
    where
        X: Element,
        W: Element,
    {
        // SAFETY: the caller's guarantee.
        let mut g = unsafe { read_cached_shifted::<W, true>(self.gamma, j, len) };
        for g in &mut g[..len] {
            *g += self.gamma_offset;
        }
        g
    }

    /// The dsum of the row starting `offset` elements in (None without one).
    #[inline(always)]
    pub(crate) fn dsum_row(&self, offset: usize) -> Option<*const X> {
        (!self.dsum.is_null()).then(|| self.dsum.wrapping_add(offset))
    }

    /// Where dx also goes, in the stream's type, for the row starting `offset` elements in:
    /// only where the stream is wider than x (a constant, so kernels of one type have no code
    /// for it) and the launch gave the buffer.
    #[inline(always)]
    pub(crate) fn dres_row(&self, offset: usize) -> Option<*mut X> {
        (size_of::<X>() != size_of::<T>() && !self.dres.is_null()).then(|| self.dres.wrapping_add(offset))
    }

    /// These rows' `cols` columns from column `at` (a cluster block's slice), dsum's too
    /// where there is one.
    #[cfg(layernorm_sm90)]
    #[inline(always)]
    pub(crate) fn slice(self, at: u32, cols: u32) -> Self {
        let at = at as usize;
        Rows {
            x: self.x.wrapping_add(at),
            dy: self.dy.wrapping_add(at),
            gamma: self.gamma.wrapping_add(at),
            dx: self.dx.wrapping_add(at),
            dsum: self.dsum_row(at).unwrap_or(self.dsum),
            dres: self.dres.wrapping_add(at),
            cols,
            ..self
        }
    }

    /// These rows, without their dsum where `variant` takes none for these types
    /// ([`crate::layout::registry::Variant::takes_dsum`]): a null dsum lets the compiler drop its code from the
    /// kernel (the host sends no launch with one there).
    #[cfg(layernorm_sm90)]
    #[inline(always)]
    pub(crate) fn for_kernel(self, variant: crate::layout::registry::Variant) -> Self {
        if variant.takes_dsum(size_of::<X>(), size_of::<W>()) {
            self
        } else {
            Rows {
                dsum: core::ptr::null(),
                ..self
            }
        }
    }

    /// A launch's rows, all `n` columns of each.
    #[inline(always)]
    pub(crate) fn of(p: BackwardRows<T, W, X>, centered: bool) -> Self {
        let (x, dy, gamma, dx) = (p.x.ptr(), p.dy.ptr(), p.gamma.ptr(), p.dx.ptr());
        let (mean, rstd) = (p.mean.ptr(), p.rstd.ptr());
        Rows {
            x,
            dy,
            gamma,
            gamma_offset: p.gamma_offset,
            mean,
            rstd,
            dx,
            dsum: p.dsum.ptr(),
            dres: p.dres.ptr(),
            rows: p.rows,
            n: p.n,
            cols: p.n,
            centered,
        }
    }
}

/// One element's terms added to the row sums s1 = sum_j xhat_j * wdy_j and s2 = sum_j wdy_j.
#[inline(always)]
pub(crate) fn add_row_sums(s1: f32, s2: f32, xhat: f32, wdy: f32) -> (f32, f32) {
    (fma(xhat, wdy, s1), s2 + wdy)
}

/// A row's xhat and dx, from its mean and rstd, computed in halves:
///   xhat_j = (x_j - mean) * rstd            as  fma(x_j, 1/2, -mean/2) * (2 rstd)
///   dx_j   = rstd * ((wdy_j - c2) - xhat_j * c1)
///                                           as  (2 rstd) * fma(-xhat_j, c1/2, fma(wdy_j, 1/2, -c2/2))
/// Halving is exact, so wherever x_j - mean and wdy_j - c2 are normal f32 numbers these are
/// the bits of the plain forms; but x_j - mean itself overflows where x_j and mean have
/// opposite signs near f32's limit (rows the forward normalized with scaled statistics),
/// and its half cannot. wdy_j - c2 comes first, exactly where the two are close, so dx is
/// exactly 0 wherever it should be (n = 1: xhat = 0 and c2 = wdy); the earlier two-fma form
/// rstd * wdy_j + (xhat_j * (-rstd c1) - rstd c2) left the rounding of rstd * c2 behind
/// (1e-5 at rstd = 316). Four values a row, as that form had.
#[derive(Clone, Copy)]
pub(crate) struct Centering {
    pub(crate) neg_half_mean: f32,
    pub(crate) twice_rstd: f32,
}

impl Centering {
    #[inline(always)]
    pub(crate) fn new(mean: f32, rstd: f32) -> Self {
        Centering {
            neg_half_mean: -0.5 * mean,
            twice_rstd: 2.0 * rstd,
        }
    }

    #[inline(always)]
    pub(crate) fn xhat(self, x: f32) -> f32 {
        fma(x, 0.5, self.neg_half_mean) * self.twice_rstd
    }

    /// dx_j from the row's [`DxCoefficients`].
    #[inline(always)]
    pub(crate) fn dx(self, wdy: f32, xhat: f32, c: DxCoefficients) -> f32 {
        self.twice_rstd * fma(-xhat, c.half_c1, fma(wdy, 0.5, c.neg_half_c2))
    }
}

/// c1 / 2 and -c2 / 2 of a row (c1 = s1 / n, c2 = s2 / n), as [`Centering::dx`] takes them.
#[derive(Clone, Copy)]
pub(crate) struct DxCoefficients {
    pub(crate) half_c1: f32,
    pub(crate) neg_half_c2: f32,
}

impl DxCoefficients {
    /// From the row's sums s1 = sum_j xhat_j * wdy_j and s2 = sum_j wdy_j (see
    /// [`Rows::s2`]).
    #[inline(always)]
    pub(crate) fn new(s1: f32, s2: f32, n: u32) -> Self {
        DxCoefficients {
            half_c1: 0.5 * (s1 / n as f32),
            neg_half_c2: -0.5 * (s2 / n as f32),
        }
    }
}

/// Exports the stage 1 kernels of one type pair (x, dy and dx of type `$t`, gamma of `$w`),
/// `<norm>_bwd_<kind>_<types>`, for both norms (RMSNorm's rows are not `centered`, a
/// constant the compiler folds): owned and held, each for warp- and block-per-row, each for
/// both modes (the launch's `Partials` say which).
macro_rules! backward_kernels {
    ($module:ident, $types:literal, $t:ty, $w:ty, $x:ty) => {
        mod $module {
            use super::*;
            backward_kernels!(@norm layer, "layer_norm", true, $types, $t, $w, $x);
            backward_kernels!(@norm rms, "rms_norm", false, $types, $t, $w, $x);
        }
    };
    (@norm $norm:ident, $prefix:literal, $centered:literal, $types:literal, $t:ty, $w:ty, $x:ty) => {
        mod $norm {
            use super::*;
            backward_kernels!(@owned $prefix, $centered, $types, $t, $w, $x, owned_warp, Warp, true);
            // sm_90's block kernel holds no row, at 64 registers (`Variant::max_registers`).
            backward_kernels!(@owned $prefix, $centered, $types, $t, $w, $x, owned_block, Block, { !cfg!(layernorm_sm90) });
            backward_kernels!(@held $prefix, $centered, $types, $t, $w, $x, held_warp, Warp, false, false);
            backward_kernels!(@held $prefix, $centered, $types, $t, $w, $x, held_block, StackedBlock, false, false);
        }
    };
    // The held block kernel over rows in half packs: 16-bit x, dy and weights of one type.
    (@halves $module:ident, $types:literal, $t:ty) => {
        mod $module {
            use super::*;
            mod layer {
                use super::*;
                backward_kernels!(@held "layer_norm", true, $types, $t, $t, $t, held_block_halves, StackedBlock, true, false);
            }
            mod rms {
                use super::*;
                backward_kernels!(@held "rms_norm", false, $types, $t, $t, $t, held_block_halves, StackedBlock, true, false);
            }
        }
    };
    // The held block kernel over shifted rows: x, dy and weights of one type, every row
    // pointer as far past a 16-byte boundary as x's.
    (@shifted $module:ident, $types:literal, $t:ty) => {
        mod $module {
            use super::*;
            mod layer {
                use super::*;
                backward_kernels!(@held "layer_norm", true, $types, $t, $t, $t, held_block_shifted, StackedBlock, false, true);
            }
            mod rms {
                use super::*;
                backward_kernels!(@held "rms_norm", false, $types, $t, $t, $t, held_block_shifted, StackedBlock, false, true);
            }
        }
    };
    (@owned $prefix:literal, $centered:literal, $types:literal, $t:ty, $w:ty, $x:ty, $kind:ident, $team:ty, $hold:expr) => {
        /// Stage 1 over rows of any length and alignment; block b hands its sums over to
        /// `out` (its partial row, or its group under the lock); `local` != 0 sums in
        /// shared memory first (required for warp teams).
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes.
        #[unsafe(export_name = concat!($prefix, "_bwd_", stringify!($kind), "_", $types))]
        pub unsafe extern "ptx-kernel" fn $kind(p: BackwardRows<$t, $w, $x>, out: Partials, local: u32) {
            device::allow_dependent_launch();
            let out = Destination::of(out, p.n, 0, device::block_idx(), 1, 0);
            let r = Rows::of(p, $centered);
            // SAFETY: the host sizes every buffer as `stage1_owned` requires.
            unsafe { stage1_owned::<$x, $t, $w, $team, $hold>(r, out, local != 0) }
        }
    };
    (@held $prefix:literal, $centered:literal, $types:literal, $t:ty, $w:ty, $x:ty, $kind:ident, $team:ty,
     $halves:literal, $shifted:literal) => {
        /// Stage 1, rows all whole aligned packs held in registers: the block's teams
        /// (warps, or block teams stacked along y) all add into its shared memory, and block
        /// b hands the sums over to `out` (its partial row, or its group under the lock).
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows that hold.
        #[unsafe(export_name = concat!($prefix, "_bwd_", stringify!($kind), "_", $types))]
        pub unsafe extern "ptx-kernel" fn $kind(p: BackwardRows<$t, $w, $x>, out: Partials) {
            device::allow_dependent_launch();
            let out = Destination::of(out, p.n, 0, device::block_idx(), 1, 0);
            let r = Rows::of(p, $centered);
            // SAFETY: the host launches this kernel only as `stage1_held` requires. Shifted
            // rows' kernels are `TIGHT`: their row geometry takes registers that keeping
            // wdy would spill (16-bit), and wdy is formed again from weights in shared memory.
            unsafe { stage1_held::<$x, $t, $w, $team, $shifted, $halves, $shifted>(r, out, SCRATCH_BYTES) }
        }
    };
}

/// Exports stage 2 for one type of dgamma and dbeta, which both norms and every x type with
/// those weights use.
macro_rules! reduce_kernel {
    ($t:ty, $reduce:ident) => {
        /// Stage 2: sums `[rows, n]` f32 partials per column into dgamma and dbeta.
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $reduce(p: Reduce<$t>) {
            // Stage 1's partials: on sm_90 this grid may start while stage 1 runs.
            device::wait_for_prerequisite_grid();
            let (dgamma, dbeta) = (p.dgamma.ptr(), p.dbeta.ptr());
            // SAFETY: the host sizes every buffer as `stage2` requires.
            unsafe {
                stage2::<$t>(
                    p.part_dgamma.ptr(),
                    p.part_dbeta.ptr(),
                    p.rows,
                    p.n,
                    dgamma,
                    dbeta,
                )
            }
        }
    };
}

backward_kernels!(f32_f32, "f32", f32, f32, f32);
backward_kernels!(
    f16_f16,
    "f16",
    crate::element::F16,
    crate::element::F16,
    crate::element::F16
);
backward_kernels!(
    bf16_bf16,
    "bf16",
    crate::element::Bf16,
    crate::element::Bf16,
    crate::element::Bf16
);
backward_kernels!(f16_f32, "f16_f32w", crate::element::F16, f32, crate::element::F16);
backward_kernels!(
    bf16_f32,
    "bf16_f32w",
    crate::element::Bf16,
    f32,
    crate::element::Bf16
);
backward_kernels!(
    f16_f32s,
    "f16_f32s",
    crate::element::F16,
    crate::element::F16,
    f32
);
backward_kernels!(
    bf16_f32s,
    "bf16_f32s",
    crate::element::Bf16,
    crate::element::Bf16,
    f32
);
backward_kernels!(f16_f32w_f32s, "f16_f32w_f32s", crate::element::F16, f32, f32);
backward_kernels!(bf16_f32w_f32s, "bf16_f32w_f32s", crate::element::Bf16, f32, f32);
backward_kernels!(@halves f16_halves, "f16", crate::element::F16);
backward_kernels!(@halves bf16_halves, "bf16", crate::element::Bf16);
backward_kernels!(@shifted f32_shifted, "f32", f32);
backward_kernels!(@shifted f16_shifted, "f16", crate::element::F16);
backward_kernels!(@shifted bf16_shifted, "bf16", crate::element::Bf16);
reduce_kernel!(f32, layer_norm_bwd_reduce_f32);
reduce_kernel!(crate::element::F16, layer_norm_bwd_reduce_f16);
reduce_kernel!(crate::element::Bf16, layer_norm_bwd_reduce_bf16);
