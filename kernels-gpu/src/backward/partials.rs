//! The partial dgamma and dbeta rows stage 1 adds into: a team's or block's own row, in
//! shared or global memory, and where each block's sums end up ([`Destination`]): its own
//! row of the partial buffers (owned mode), or added into a spinlocked group row with its
//! compensations (locked mode).

use crate::device::{self, load_f32_l2, shared_ptr};
use crate::element::{MAX_PACK, Pack, is_pack_aligned};
use crate::layout::params::Partials;

/// One row of partial sums: a group row in global memory (locked mode), a block's row in
/// global memory, or a team's row in shared memory (owned mode).
#[derive(Clone, Copy)]
pub(crate) struct PartialRow {
    pub(crate) dgamma: *mut f32,
    pub(crate) dbeta: *mut f32,
    /// Add to what is there (false: overwrite, for the row's first contribution).
    pub(crate) accumulate: bool,
    /// In shared memory (padded, see [`padded`]) rather than global memory.
    pub(crate) shared: bool,
    /// Elements from each sum to its compensation (Kahan's running error, see
    /// [`PartialRow::add`]), or 0 for plain sums.
    pub(crate) compensation: usize,
}

/// Where column j lives in a shared-memory partial row: one padding word after every 32.
/// A rank's pack starts `PACK` words after its neighbour's, so in the plain layout lanes
/// i and i + 32 / PACK hit the same bank (an 8-way conflict for f16); the padding shifts
/// each group of 32 words by one bank, which spreads a warp's 32 lanes over all 32 banks.
/// A pack from a multiple of PACK never straddles a padding word (PACK divides 32); one
/// from a shifted row's boundary may ([`PartialRow::add`]).
#[inline(always)]
pub(crate) fn padded(j: u32) -> usize {
    crate::layout::padded(j) as usize
}

/// Words of a padded shared-memory row of `n` columns.
#[inline(always)]
pub(crate) fn padded_len(n: u32) -> usize {
    padded(n)
}

impl PartialRow {
    /// Row `r` of `[_, n]` buffers in global memory, read through L2 (`ld.global.cg`): a
    /// locked group row was last written by another multiprocessor, whose writes are not
    /// in this one's L1. With `compensation` != 0, each sum keeps its running error that many
    /// elements further on.
    ///
    /// # Safety
    /// `r` < the buffers' row count, and the compensations lie inside them too.
    #[inline(always)]
    pub(crate) unsafe fn global(
        dgamma: *mut f32,
        dbeta: *mut f32,
        r: u32,
        n: u32,
        accumulate: bool,
        compensation: usize,
    ) -> Self {
        let offset = r as usize * n as usize;
        // SAFETY: the caller guarantees the row is inside both buffers.
        let (dgamma, dbeta) = unsafe { (dgamma.add(offset), dbeta.add(offset)) };
        PartialRow {
            dgamma,
            dbeta,
            accumulate,
            shared: false,
            compensation,
        }
    }

    /// Team `t`'s row in shared memory: padded dgamma then padded dbeta for each team of
    /// the block, after `scratch` bytes of reduction scratch. Always accumulates (zeroed
    /// first).
    ///
    /// # Safety
    /// The launch gave the block `scratch + teams * 8 * (padded_len(n) + 1)` bytes.
    #[inline(always)]
    pub(crate) unsafe fn shared(scratch: u32, t: u32, n: u32) -> Self {
        let words = padded_len(n) + 1;
        let base = scratch as usize + t as usize * 8 * words;
        let dgamma = shared_ptr::<f32>(base as u32);
        // SAFETY: the caller guarantees the shared memory holds this team's two rows.
        let dbeta = unsafe { dgamma.add(words) };
        PartialRow {
            dgamma,
            dbeta,
            accumulate: true,
            shared: true,
            compensation: 0,
        }
    }

    /// `len` values from `p`: 16-byte loads through L2 where `vector`, else one at a time
    /// (through L2 for global rows).
    ///
    /// # Safety
    /// `p` holds `len` values; with `vector`, 16-byte aligned and `len` a multiple of 4.
    #[inline(always)]
    pub(crate) unsafe fn load(self, p: *const f32, len: usize, vector: bool) -> Pack {
        let mut out = [0.0; MAX_PACK];
        // SAFETY: the caller's guarantee.
        unsafe {
            if vector {
                for v in 0..len / 4 {
                    let w = device::load_16(p.add(4 * v) as *const u32);
                    for k in 0..4 {
                        out[4 * v + k] = f32::from_bits(w[k]);
                    }
                }
            } else {
                for (k, o) in out.iter_mut().enumerate().take(len) {
                    *o = if self.shared {
                        p.add(k).read()
                    } else {
                        load_f32_l2(p.add(k))
                    };
                }
            }
        }
        out
    }

    /// Stores `len` values at `p`, 16 bytes at a time where `vector`.
    ///
    /// # Safety
    /// As for [`PartialRow::load`], for writing.
    #[inline(always)]
    pub(crate) unsafe fn store(p: *mut f32, len: usize, vector: bool, v: &Pack) {
        // SAFETY: the caller's guarantee.
        unsafe {
            if vector {
                for q in 0..len / 4 {
                    device::store_16(
                        p.add(4 * q) as *mut u32,
                        [0, 1, 2, 3].map(|k| v[4 * q + k].to_bits()),
                    );
                }
            } else {
                for (k, &x) in v.iter().enumerate().take(len) {
                    p.add(k).write(x);
                }
            }
        }
    }

    /// The chunk `[start, start + len)`'s addresses in the dgamma and dbeta rows, and whether
    /// they take 16-byte accesses (global rows, whole aligned words of 4).
    #[inline(always)]
    pub(crate) fn chunk(self, start: u32, len: usize) -> (*mut f32, *mut f32, bool) {
        let at = if self.shared {
            padded(start)
        } else {
            start as usize
        };
        let (g, b) = (self.dgamma.wrapping_add(at), self.dbeta.wrapping_add(at));
        let vector = !self.shared && len.is_multiple_of(4) && is_pack_aligned(g) && is_pack_aligned(b);
        (g, b, vector)
    }

    /// Adds the chunk `[start, start + len)`'s dgamma and dbeta terms. Every load of the
    /// chunk comes before its stores: a store could alias a later load, so interleaving
    /// them would make each load wait a full memory latency for the one before.
    ///
    /// `OFF_PACK`: the chunk may start off a multiple of its length (a shifted row's pack),
    /// and so cross a shared row's padding word ([`padded`]): its words past it then sit
    /// one further on. In a shared row such chunks go a word at a time, each load beside
    /// its store, whether they cross one or not (one f16 pack in four of a shifted row
    /// does): shared memory answers in tens of cycles, and a branch for the crossing ones,
    /// or addresses for a whole pack at once, spilled sm_90's owned block kernels 56-124
    /// bytes at their 64 registers.
    ///
    /// # Safety
    /// The chunk is inside the row, and no other thread writes it concurrently; without
    /// `OFF_PACK`, a chunk longer than one column starts at a multiple of its length.
    #[inline(always)]
    pub(crate) unsafe fn add<const OFF_PACK: bool>(
        self,
        start: u32,
        len: usize,
        dgamma: &Pack,
        dbeta: &Pack,
    ) {
        let (g, b, vector) = self.chunk(start, len);
        let to_padding = (32 - start % 32) as usize;
        if OFF_PACK && self.shared {
            // (A chunk is at most a pack; the bound spares the PTX a panic path.)
            for k in 0..len.min(MAX_PACK) {
                let word = k + (k >= to_padding) as usize;
                // SAFETY: the chunk's columns and the padding word between them lie inside
                // this team's shared row, which it alone writes (shared rows accumulate).
                unsafe {
                    g.add(word).write(g.add(word).read() + dgamma[k]);
                    b.add(word).write(b.add(word).read() + dbeta[k]);
                }
            }
            return;
        }
        let zero = [0.0; MAX_PACK];
        let (old_g, old_b) = if self.accumulate {
            // SAFETY: as above; vectors only where both rows are 16-byte aligned.
            unsafe { (self.load(g, len, vector), self.load(b, len, vector)) }
        } else {
            (zero, zero)
        };
        let sum = |old: &Pack, add: &Pack| core::array::from_fn::<f32, MAX_PACK, _>(|k| old[k] + add[k]);
        // SAFETY: as for the loads; this thread alone writes the chunk.
        unsafe {
            Self::store(g, len, vector, &sum(&old_g, dgamma));
            Self::store(b, len, vector, &sum(&old_b, dbeta));
        }
    }

    /// [`PartialRow::add`] for a row with compensations (the locked mode's group rows, where
    /// one sum takes the partial rows of many blocks in turn): each add is Kahan's. With the sum s
    /// and its running error e (the true sum is s + e),
    ///   u = v + e,   t = s + u,   e = u - (t - s),   s = t
    /// so the error of a column sum stays at a few roundings of the sum however many rows it
    /// takes (plain f32 adds lose about a rounding per row: 8e-6 relative over 100000 rows,
    /// against 2e-7 for PyTorch). Stage 2 adds the compensation rows like any other.
    ///
    /// # Safety
    /// As for [`PartialRow::add`], the chunk's compensations included.
    #[inline(always)]
    unsafe fn add_compensated(self, start: u32, len: usize, dgamma: &Pack, dbeta: &Pack) {
        let (g, b, vector) = self.chunk(start, len);
        let zero = [0.0; MAX_PACK];
        let (eg, eb) = (
            g.wrapping_add(self.compensation),
            b.wrapping_add(self.compensation),
        );
        // G rows apart: aligned as the sums only where G * n is a multiple of 4.
        let vector = vector && is_pack_aligned(eg) && is_pack_aligned(eb);
        let kahan = |s: &Pack, e: &Pack, v: &Pack| -> (Pack, Pack) {
            let (mut sum, mut err) = (zero, zero);
            // (A chunk is at most a pack; the bound spares the PTX a panic path.)
            for k in 0..len.min(MAX_PACK) {
                let u = v[k] + e[k];
                let t = s[k] + u;
                (sum[k], err[k]) = (t, u - (t - s[k]));
            }
            (sum, err)
        };
        // All four loads first: the lock is held for one L2 round trip, not two.
        let (sg, seg, sb, seb) = if self.accumulate {
            // SAFETY: as above; vectors only where all four rows are 16-byte aligned.
            unsafe {
                (
                    self.load(g, len, vector),
                    self.load(eg, len, vector),
                    self.load(b, len, vector),
                    self.load(eb, len, vector),
                )
            }
        } else {
            (zero, zero, zero, zero)
        };
        let ((sg, seg), (sb, seb)) = (kahan(&sg, &seg, dgamma), kahan(&sb, &seb, dbeta));
        // SAFETY: as for the loads; this thread alone writes the chunk.
        unsafe {
            Self::store(g, len, vector, &sg);
            Self::store(eg, len, vector, &seg);
            Self::store(b, len, vector, &sb);
            Self::store(eb, len, vector, &seb);
        }
    }

    /// The chunk's sums into this row: compensated where the row keeps compensations (a
    /// locked group row), else as [`PartialRow::add`].
    ///
    /// # Safety
    /// As for [`PartialRow::add`], the chunk's compensations included.
    #[inline(always)]
    pub(crate) unsafe fn merge(self, start: u32, len: usize, dgamma: &Pack, dbeta: &Pack) {
        // SAFETY: the caller's guarantee.
        unsafe {
            if self.compensation != 0 {
                self.add_compensated(start, len, dgamma, dbeta)
            } else {
                self.add::<false>(start, len, dgamma, dbeta)
            }
        }
    }
}

/// Where a block's partial dgamma and dbeta go at the end of stage 1, from the launch's
/// [`Partials`]. Every stage 1 sums its rows' partials per block first (in shared memory,
/// or in a row of global memory of its own), then hands the block's sums over once:
/// - owned mode (`groups` = 0): into row `unit` of the `[R, n]` buffers, which only this
///   block (or, for clusters, only this block's slice) writes; stage 2 adds the R rows in
///   a fixed order, so the result is bitwise reproducible.
/// - locked mode (the Triton tutorial's scheme, at the granularity of a block's sums rather
///   than of one row): added into group g = `unit` mod G under g's spinlock, an atomic
///   compare-and-swap on a lock word. A count word counts the units that have handed over
///   (the first holder stores, later ones add, the group's last sets it back to 0), so the
///   group rows need no clearing, and the words, zeroed once when the host allocates them,
///   are zero again when each launch ends. Group g's sums are row g, their Kahan
///   compensations row G + g; stage 2 sums the 2G rows. The host takes G no larger than the blocks (or
///   clusters), so every group is written. A cluster's blocks each hand over their own
///   slice of the row, so each slice of a group has its own lock and count word.
#[derive(Clone, Copy)]
pub(crate) struct Destination {
    /// The launch's buffers and, in locked mode, its `groups * slices` lock words, then as
    /// many count words, zero before the launch (and after it). (Kept as the kernel
    /// parameter, not as pointers offset ahead of time: ptxas reads parameters from the
    /// constant bank where they are used, where offset pointers would hold registers across
    /// the row loop.)
    p: Partials,
    /// This block's first column.
    at: u32,
    n: u32,
    /// This block's, or its cluster's, index in the grid.
    unit: u32,
    /// Blocks that share a unit's row, each with its own slice of it, and this block's.
    slices: u32,
    slice: u32,
}

impl Destination {
    /// For the block (or cluster block) of unit `unit` whose columns start at `at`, when
    /// `slices` blocks share each unit's row (`slice` this one's place among them).
    #[inline(always)]
    pub(crate) fn of(p: Partials, n: u32, at: u32, unit: u32, slices: u32, slice: u32) -> Self {
        Destination {
            p,
            at,
            n,
            unit,
            slices,
            slice,
        }
    }

    /// Row `row` of the buffers, from this block's first column.
    ///
    /// # Safety
    /// The buffers hold that row.
    #[inline(always)]
    unsafe fn row(self, row: u32, accumulate: bool, compensation: usize) -> PartialRow {
        let at = self.at as usize;
        let (dgamma, dbeta) = (
            self.p.dgamma.ptr().wrapping_add(at),
            self.p.dbeta.ptr().wrapping_add(at),
        );
        // SAFETY: the caller's guarantee.
        unsafe { PartialRow::global(dgamma, dbeta, row, self.n, accumulate, compensation) }
    }

    /// A row of global memory the block alone writes, for sums it keeps there as it goes
    /// (the owned kernel's block-team rows whose partials do not fit shared memory): its
    /// own partial row in owned mode, which is where they belong; in locked mode row
    /// 2G + `unit`, past the groups and their compensations, which [`Destination::hand_over`]
    /// then reads back. `accumulate` as [`PartialRow::global`] takes it.
    ///
    /// # Safety
    /// The buffers hold that row (owned: `[R, n]`; locked: `[2G + R, n]`).
    #[inline(always)]
    pub(crate) unsafe fn own_row(self, accumulate: bool) -> PartialRow {
        let groups = self.p.groups;
        let row = if groups == 0 {
            self.unit
        } else {
            2 * groups + self.unit
        };
        // SAFETY: the caller's guarantee.
        unsafe { self.row(row, accumulate, 0) }
    }

    /// Whether the block's sums, once in [`Destination::own_row`], are already where they
    /// belong.
    #[inline(always)]
    pub(crate) fn own_row_is_final(self) -> bool {
        self.p.groups == 0
    }

    /// Runs `put` with the row the block's sums go to, where each thread merges its own
    /// columns ([`PartialRow::merge`]): in owned mode the unit's partial row, overwritten; in
    /// locked mode the group's row, compensated, with the group's lock held by the block
    /// for as long as `put` runs. Every thread of the block calls it, on a block-uniform
    /// path (it passes block barriers in locked mode).
    ///
    /// # Safety
    /// The buffers and words sized as [`Destination`] says; `put` writes only this block's
    /// columns of the row.
    #[inline(always)]
    pub(crate) unsafe fn hand_over(self, put: impl FnOnce(PartialRow)) {
        let groups = self.p.groups;
        if groups == 0 {
            // SAFETY: the unit's row exists, and only this block writes these columns.
            put(unsafe { self.row(self.unit, false, 0) });
            return;
        }
        let words = self.p.words.ptr();
        let g = self.unit % groups;
        let w = (g * self.slices + self.slice) as usize;
        // w < groups * slices: the lock word, and its count word after all of them; they
        // are only touched atomically, at the GPU's scope (core's atomics and fences are the
        // system's in PTX, whose fences wait on the host's memory too).
        let (lock, count) = (
            words.wrapping_add(w),
            words.wrapping_add((groups * self.slices) as usize + w),
        );
        // Units that handed over into this group before this one (thread 0's).
        let mut before = 0;
        if device::thread_idx() == 0 && device::thread_idx_y() == 0 {
            // atom.cas: one thread spins; the others wait at the barrier below.
            // SAFETY: the lock and count words, as above.
            unsafe {
                while device::cas_acquire_gpu(lock, 0, 1) != 0 {}
                before = device::load_relaxed_gpu(count);
            }
        }
        let written = device::sync_block_any(before != 0);
        // The acquire was thread 0's; every thread orders its own reads after it.
        device::fence_gpu();
        let compensation = groups as usize * self.n as usize;
        // SAFETY: g < groups, and the buffers hold 2 * groups rows: the group's and its
        // compensations'.
        put(unsafe { self.row(g, written, compensation) });
        // Each thread's writes must reach L2 before the next holder reads them.
        device::fence_gpu();
        device::sync_block();
        if device::thread_idx() == 0 && device::thread_idx_y() == 0 {
            // The group's units are those u < units with u mod G = g; the last of them to
            // hand over sets the count back to 0, so that the words are zero again when the
            // launch ends, as the next launch needs them: the host zeroes them only when it
            // allocates them, not with a memset (a launch of its own) before every call.
            let units = device::grid_dim() / self.slices;
            let group_units = units.saturating_sub(g).div_ceil(groups);
            let handed = before + 1;
            // SAFETY: the lock and count words, as above.
            unsafe {
                device::store_gpu::<false>(count, if handed == group_units { 0 } else { handed });
                device::store_gpu::<true>(lock, 0);
            }
        }
    }
}
