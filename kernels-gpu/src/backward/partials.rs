//! The partial dgamma and dbeta rows stage 1 adds into: a team's or block's own row, in
//! shared or global memory (owned mode), or a spinlocked group row with its compensations
//! (locked mode).

use core::sync::atomic::{AtomicU32, Ordering, fence};

use crate::device::{self, load_f32_l2, shared_ptr};
use crate::element::{Element, MAX_PACK, Pack, is_pack_aligned};
use crate::team::Team;

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
/// A pack never straddles a padding word (PACK divides 32), so its words stay contiguous.
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
    /// they take 16-byte accesses.
    #[inline(always)]
    pub(crate) fn chunk<T: Element>(self, start: u32, len: usize) -> (*mut f32, *mut f32, bool) {
        let at = if self.shared {
            padded(start)
        } else {
            start as usize
        };
        let (g, b) = (self.dgamma.wrapping_add(at), self.dbeta.wrapping_add(at));
        let vector = !self.shared && len == T::PACK && is_pack_aligned(g) && is_pack_aligned(b);
        (g, b, vector)
    }

    /// Adds the chunk `[start, start + len)`'s dgamma and dbeta terms. Every load of the
    /// chunk comes before its stores: a store could alias a later load, so interleaving
    /// them would make each load wait a full memory latency for the one before.
    ///
    /// # Safety
    /// The chunk is inside the row, and no other thread writes it concurrently.
    #[inline(always)]
    pub(crate) unsafe fn add<T: Element>(self, start: u32, len: usize, dgamma: &Pack, dbeta: &Pack) {
        let (g, b, vector) = self.chunk::<T>(start, len);
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
    /// one sum may take every row of the batch in turn): each add is Kahan's. With the sum s
    /// and its running error e (the true sum is s + e),
    ///   u = v + e,   t = s + u,   e = u - (t - s),   s = t
    /// so the error of a column sum stays at a few roundings of the sum however many rows it
    /// takes (plain f32 adds lose about a rounding per row: 8e-6 relative over 100000 rows,
    /// against 2e-7 for PyTorch). Stage 2 adds the compensation rows like any other.
    ///
    /// # Safety
    /// As for [`PartialRow::add`], the chunk's compensations included.
    #[inline(always)]
    pub(crate) unsafe fn add_compensated<T: Element>(
        self,
        start: u32,
        len: usize,
        dgamma: &Pack,
        dbeta: &Pack,
    ) {
        let (g, b, vector) = self.chunk::<T>(start, len);
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
}

/// The G group rows of the locked mode with their lock and count words.
pub(crate) struct GroupLock {
    /// `[2 * groups, n]`: group g's sums in row g, their compensations in row G + g.
    pub(crate) dgamma: *mut f32,
    pub(crate) dbeta: *mut f32,
    /// `groups` lock words, then `groups` count words; zero before the launch.
    pub(crate) words: *mut u32,
    pub(crate) groups: u32,
    pub(crate) n: u32,
}

impl GroupLock {
    /// The group of row `row`: `row mod G` (the host never passes G = 0; the guard keeps
    /// a division-by-zero panic, which would need core's panic machinery, out of the PTX).
    #[inline(always)]
    pub(crate) fn group(&self, row: u32) -> u32 {
        row.checked_rem(self.groups).unwrap_or(0)
    }

    /// Spins until this team holds row `row`'s group, then returns the group row.
    ///
    /// # Safety
    /// `words` holds 2 * `groups` words, the group buffers `[2 * groups, n]` f32.
    #[inline(always)]
    pub(crate) unsafe fn acquire<T: Element, S: Team>(&self, row: u32) -> PartialRow {
        let g = self.group(row);
        // SAFETY: g < groups, and lock words are only touched atomically.
        let (lock, count) = unsafe {
            (
                AtomicU32::from_ptr(self.words.add(g as usize)),
                AtomicU32::from_ptr(self.words.add((self.groups + g) as usize)),
            )
        };
        let mut written = 0;
        if S::rank() == 0 {
            // atom.cas: one thread per team spins; the others wait at the barrier below.
            while lock
                .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {}
            written = count.load(Ordering::Relaxed);
        }
        let written = S::broadcast(written);
        // The acquire was rank 0's; every rank orders its own reads after it.
        fence(Ordering::Acquire);
        // Group g's compensations are rows G + g.
        let compensation = self.groups as usize * self.n as usize;
        // SAFETY: g < groups, and the buffers hold 2 * groups rows.
        unsafe { PartialRow::global(self.dgamma, self.dbeta, g, self.n, written != 0, compensation) }
    }

    /// Publishes the team's writes to the group row, marks it written and unlocks it.
    ///
    /// # Safety
    /// This team holds `row`'s group (from [`GroupLock::acquire`]).
    #[inline(always)]
    pub(crate) unsafe fn release<S: Team>(&self, row: u32) {
        let g = self.group(row);
        // Each rank's writes must reach L2 before the next holder reads them.
        fence(Ordering::Release);
        S::sync();
        if S::rank() == 0 {
            // SAFETY: g < groups; these words are only touched atomically.
            let (lock, count) = unsafe {
                (
                    AtomicU32::from_ptr(self.words.add(g as usize)),
                    AtomicU32::from_ptr(self.words.add((self.groups + g) as usize)),
                )
            };
            count.store(1, Ordering::Relaxed);
            lock.store(0, Ordering::Release);
        }
    }
}
