//! LayerNorm backward, in two stages.
//!
//! Per row i, with xhat_j = (x_j - mean_i) * rstd_i and wdy_j = gamma_j * dy_j:
//!   c1   = sum_j xhat_j * wdy_j / n
//!   c2   = sum_j wdy_j / n
//!   dx_j = rstd_i * ((wdy_j - c2) - xhat_j * c1)   (computed in halves, see `Centering`)
//! and over all rows:
//!   dgamma_j = sum_i dy_ij * xhat_ij        dbeta_j = sum_i dy_ij
//!
//! Stage 1 writes dx and adds each row's (dy * xhat, dy) into one row of an f32 partial
//! buffer `[R, n]`. Stage 2 sums the R partial rows per column into dgamma and dbeta.
//! Partials are f32 whatever the storage type, so long columns do not round in f16.
//!
//! Two ways to fill the partial buffer:
//! - owned (deterministic): each block, or cluster, alone owns one partial row, which its
//!   teams' rows add into; no locks, and every sum runs in a fixed order, so results are
//!   bitwise reproducible.
//! - locked (the Triton tutorial's scheme): row i adds into group i mod G under that group's
//!   spinlock (an atomic compare-and-swap on a lock word); a count word says whether the
//!   group was written yet (first writer stores, later ones add), so the G rows need no
//!   clearing, only the 2*G lock and count words. Each group row keeps a compensation row
//!   beside it (Kahan summation), so that a group that takes many rows in turn does not
//!   lose a rounding per row; stage 2 sums the 2G rows.
//!
//! The kernels, for T = f32, f16, bf16, as the host (host/gpu/layer_norm.rs) picks them;
//! teams are a warp per row for n <= 1024, a block per row beyond:
//! - owned mode, the first that applies:
//!   - `layer_norm_bwd_cluster<C>_held_<T>`, `layer_norm_bwd_cluster8_<T>` (sm_90 module,
//!     block teams): rows too long for one block to hold in registers (4 packs a thread)
//!     or to sum in shared memory (8n bytes), where an eighth of a row's partials fits. A
//!     cluster of C blocks shares each row, block q taking its q-th slice; the row sums
//!     come from all slices through distributed shared memory, one cluster barrier per row
//!     (the sums alternate between two slots). Where every row is whole aligned packs,
//!     `cluster<C>_held` (`stage1_cluster_held`): C = 2, 4 or 8, the fewest blocks whose
//!     slices fit 4 packs a rank (fewer blocks wait at each barrier), each slice as in
//!     [`stage1_held`]; else `cluster8` (`stage1_cluster`): each slice as in the general
//!     owned kernel, its partials in shared memory.
//!   - `layer_norm_bwd_held_{warp,block}_<T>` ([`stage1_held`]): every row whole aligned
//!     packs that fit 4 a rank, with room in shared memory for each rank's partials. x and
//!     dy held in registers; dx and the partials in the same pass, into each rank's own
//!     shared memory (16-byte accesses, no barrier between rows); each row's x, dy, mean and
//!     rstd loaded during the previous row's reduction (two rows in flight per team). Block
//!     teams stack along y, and all teams of a block add into one partial row.
//!   - `layer_norm_bwd_owned_{warp,block}_<T>` ([`stage1_owned`]): all other rows. Each
//!     team sums its rows' partials in its own shared-memory row (padded by a word per 32:
//!     no bank conflicts), and the block writes their sum, in team order, as its partial
//!     row; block-team rows whose partials do not fit in shared memory add straight into
//!     the block's partial row in global memory (sm_80, or past what clusters take).
//! - locked mode: `layer_norm_bwd_locked_{warp,block}_<T>` ([`stage1_locked`]), with G
//!   groups (by default 256 for n <= 1024, 128 to 4096, 96 to 8192, 64 beyond).
//! - stage 2, both modes: `layer_norm_bwd_reduce_<T>` ([`stage2`]).
//!
//! The general kernels (owned, `cluster8`, locked) take each row as its pointers and length
//! allow ([`backward_row_any`]): x and dy held in registers where the row is aligned and
//! fits 4 packs a rank, else read in 16-byte packs where aligned, else element by element;
//! three passes (sums, dx, partials), each chunk's loads before its stores.
//! docs/PERF.md has each version's changes and measurements.

use core::sync::atomic::{AtomicU32, Ordering, fence};

#[cfg(layernorm_sm90)]
use crate::cluster::{CLUSTER_SCRATCH_BYTES, Cluster, slice_width};
use crate::device::{self, fma, load_f32_l2, shared_ptr};
use crate::element::{Element, MAX_PACK, Pack, is_pack_aligned, read_cached, write};
use crate::row::{BWD_HELD, Held, fits, for_each_chunk, prefetch, values};
use crate::team::{Block, SCRATCH_BYTES, StackedBlock, Team, Warp};

/// The inputs of one backward launch, as the host passes them. A team walks `cols` columns
/// from the row pointers: all `n` of them, or (clusters) a slice, with `x`, `dy`, `gamma`
/// and `dx` then pointing at the slice's first column.
#[derive(Clone, Copy)]
struct Rows<T> {
    x: *const T,
    dy: *const T,
    gamma: *const T,
    mean: *const f32,
    rstd: *const f32,
    dx: *mut T,
    rows: u32,
    /// Row length: the stride between rows, and the n of c1 and c2.
    n: u32,
    /// Columns this team walks.
    cols: u32,
}

/// One element's terms added to the row sums s1 = sum_j xhat_j * wdy_j and s2 = sum_j wdy_j.
#[inline(always)]
fn add_row_sums(s1: f32, s2: f32, xhat: f32, wdy: f32) -> (f32, f32) {
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
struct Centering {
    neg_half_mean: f32,
    twice_rstd: f32,
}

impl Centering {
    #[inline(always)]
    fn new(mean: f32, rstd: f32) -> Self {
        Centering {
            neg_half_mean: -0.5 * mean,
            twice_rstd: 2.0 * rstd,
        }
    }

    #[inline(always)]
    fn xhat(self, x: f32) -> f32 {
        fma(x, 0.5, self.neg_half_mean) * self.twice_rstd
    }

    /// dx_j from the row's [`DxCoefficients`].
    #[inline(always)]
    fn dx(self, wdy: f32, xhat: f32, c: DxCoefficients) -> f32 {
        self.twice_rstd * fma(-xhat, c.half_c1, fma(wdy, 0.5, c.neg_half_c2))
    }
}

/// c1 / 2 and -c2 / 2 of a row (c1 = s1 / n, c2 = s2 / n), as [`Centering::dx`] takes them.
#[derive(Clone, Copy)]
struct DxCoefficients {
    half_c1: f32,
    neg_half_c2: f32,
}

impl DxCoefficients {
    /// From the row's sums s1 = sum_j xhat_j * wdy_j and s2 = sum_j wdy_j.
    #[inline(always)]
    fn new(s1: f32, s2: f32, n: u32) -> Self {
        DxCoefficients {
            half_c1: 0.5 * (s1 / n as f32),
            neg_half_c2: -0.5 * (s2 / n as f32),
        }
    }
}

/// One row of partial sums: a group row in global memory (locked mode), a block's row in
/// global memory, or a team's row in shared memory (owned mode).
#[derive(Clone, Copy)]
struct PartialRow {
    dgamma: *mut f32,
    dbeta: *mut f32,
    /// Add to what is there (false: overwrite, for the row's first contribution).
    accumulate: bool,
    /// In shared memory (padded, see [`padded`]) rather than global memory.
    shared: bool,
    /// Elements from each sum to its compensation (Kahan's running error, see
    /// [`PartialRow::add`]), or 0 for plain sums.
    compensation: usize,
}

/// Where column j lives in a shared-memory partial row: one padding word after every 32.
/// A rank's pack starts `PACK` words after its neighbour's, so in the plain layout lanes
/// i and i + 32 / PACK hit the same bank (an 8-way conflict for f16); the padding shifts
/// each group of 32 words by one bank, which spreads a warp's 32 lanes over all 32 banks.
/// A pack never straddles a padding word (PACK divides 32), so its words stay contiguous.
#[inline(always)]
fn padded(j: u32) -> usize {
    layernorm_layout::padded(j) as usize
}

/// Words of a padded shared-memory row of `n` columns.
#[inline(always)]
fn padded_len(n: u32) -> usize {
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
    unsafe fn global(
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
    unsafe fn shared(scratch: u32, t: u32, n: u32) -> Self {
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
    unsafe fn load(self, p: *const f32, len: usize, vector: bool) -> Pack {
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
    unsafe fn store(p: *mut f32, len: usize, vector: bool, v: &Pack) {
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
    fn chunk<T: Element>(self, start: u32, len: usize) -> (*mut f32, *mut f32, bool) {
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
    unsafe fn add<T: Element>(self, start: u32, len: usize, dgamma: &Pack, dbeta: &Pack) {
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
    unsafe fn add_compensated<T: Element>(self, start: u32, len: usize, dgamma: &Pack, dbeta: &Pack) {
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

/// Where a row's partial dgamma and dbeta go.
#[derive(Clone, Copy)]
enum Sink<'a> {
    /// A row this team alone writes.
    Owned(PartialRow),
    /// The row's group, with the group's lock held.
    Locked(&'a GroupLock),
}

/// dx for one row, and its partials into `sink`; `HELD` packs of x and dy per rank stay in
/// registers across the passes.
///
/// # Safety
/// `row` < `r.rows`; with `PACKED` every row pointer and gamma are 16-byte aligned; with
/// `HELD` > 0 the row [`fits`].
#[inline(always)]
unsafe fn backward_row<T: Element, S: Team, const PACKED: bool, const HELD: usize>(
    r: &Rows<T>,
    row: u32,
    sink: Sink<'_>,
) {
    let offset = row as usize * r.n as usize;
    // SAFETY: row < rows, so these rows lie inside x, dy, dx, mean and rstd.
    let (x, dy, dx, mean, rstd) = unsafe {
        (
            r.x.add(offset),
            r.dy.add(offset),
            r.dx.add(offset),
            *r.mean.add(row as usize),
            *r.rstd.add(row as usize),
        )
    };
    let (n, cols) = (r.n, r.cols);
    let packs = if PACKED { cols / T::PACK as u32 } else { 0 };
    // SAFETY: with HELD > 0 the row is packed and fits (the caller's guarantee).
    let (xs, dys) = unsafe {
        (
            Held::<HELD>::load::<T, S>(x, packs),
            Held::<HELD>::load::<T, S>(dy, packs),
        )
    };
    // The team's next row streams into L2 while this one is worked on (teams that gain
    // from it: see `Team::PREFETCH_NEXT_ROW`).
    let next = row + S::count();
    if S::PREFETCH_NEXT_ROW && next < r.rows {
        let at = next as usize * n as usize;
        // SAFETY: next < rows, so its `cols` columns lie inside x and dy.
        unsafe {
            prefetch::<T, S>(r.x.add(at), cols);
            prefetch::<T, S>(r.dy.add(at), cols);
        }
    }
    let centering = Centering::new(mean, rstd);
    // (xhat, gamma * dy, dy) of one chunk.
    let terms = |j: u32, len: usize, slot: Option<usize>| -> (Pack, Pack, Pack) {
        // SAFETY: for_each_chunk yields in-bounds chunks, whole packs only when PACKED.
        let (xv, dyv, g) = unsafe {
            (
                values(&xs, x, j, len, slot),
                values(&dys, dy, j, len, slot),
                read_cached(r.gamma, j, len),
            )
        };
        let (mut xhat, mut wdy) = ([0.0; MAX_PACK], [0.0; MAX_PACK]);
        for k in 0..len {
            xhat[k] = centering.xhat(xv[k]);
            wdy[k] = g[k] * dyv[k];
        }
        (xhat, wdy, dyv)
    };

    // Pass 1: the row sums (the same arithmetic as the held path's, so that dx is the same
    // bits whichever path computed it).
    let (mut s1, mut s2) = (0.0f32, 0.0f32);
    for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
        let (xhat, wdy, _) = terms(j, len, slot);
        for k in 0..len {
            (s1, s2) = add_row_sums(s1, s2, xhat[k], wdy[k]);
        }
    });
    let (s1, s2) = S::sum2(s1, s2);
    let coefficients = DxCoefficients::new(s1, s2, n);

    // Pass 2: dx.
    for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
        let (xhat, wdy, _) = terms(j, len, slot);
        let mut out = [0.0; MAX_PACK];
        for k in 0..len {
            out[k] = centering.dx(wdy[k], xhat[k], coefficients);
        }
        // SAFETY: as above.
        unsafe { write(dx, j, len, &out) };
    });

    // Pass 3: the partials (dy * xhat, dy), into the team's own row or, with the lock held,
    // into the row's group (compensated sums). A pass of its own keeps fewer values live than
    // adding them during pass 2 (no register spills at 64 per thread), and held rows cost no
    // memory. One loop per sink, so that each kernel carries only its own way of adding.
    let partials = |j: u32, len: usize, slot: Option<usize>| {
        let (xhat, _, dyv) = terms(j, len, slot);
        let mut dgamma = [0.0; MAX_PACK];
        for k in 0..len {
            dgamma[k] = dyv[k] * xhat[k];
        }
        (dgamma, dyv)
    };
    match sink {
        Sink::Owned(part) => for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
            let (dgamma, dbeta) = partials(j, len, slot);
            // SAFETY: as above; the row is this team's alone.
            unsafe { part.add::<T>(j, len, &dgamma, &dbeta) };
        }),
        Sink::Locked(lock) => {
            // SAFETY: the group index is below G and its lock and count words exist.
            let part = unsafe { lock.acquire::<T, S>(row) };
            for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
                let (dgamma, dbeta) = partials(j, len, slot);
                // SAFETY: as above; the group's row is this team's while it holds the lock.
                unsafe { part.add_compensated::<T>(j, len, &dgamma, &dbeta) };
            });
            // SAFETY: this team holds the lock it releases.
            unsafe { lock.release::<S>(row) };
        }
    }
}

/// [`backward_row`] with the row's access pattern picked: packed and held in registers,
/// packed and streamed, or element by element.
///
/// # Safety
/// `row` < `r.rows`.
#[inline(always)]
unsafe fn backward_row_any<T: Element, S: Team>(r: &Rows<T>, row: u32, sink: Sink<'_>) {
    let offset = row as usize * r.n as usize;
    let packed = is_pack_aligned(r.x.wrapping_add(offset))
        && is_pack_aligned(r.dy.wrapping_add(offset))
        && is_pack_aligned(r.dx.wrapping_add(offset))
        && is_pack_aligned(r.gamma);
    // SAFETY: row < rows; `packed` was checked for every pointer the packed paths read.
    unsafe {
        if packed && fits::<T, S, BWD_HELD>(r.cols) {
            backward_row::<T, S, true, BWD_HELD>(r, row, sink)
        } else if packed {
            backward_row::<T, S, true, 0>(r, row, sink)
        } else {
            backward_row::<T, S, false, 0>(r, row, sink)
        }
    }
}

/// The G group rows of the locked mode with their lock and count words.
struct GroupLock {
    /// `[2 * groups, n]`: group g's sums in row g, their compensations in row G + g.
    dgamma: *mut f32,
    dbeta: *mut f32,
    /// `groups` lock words, then `groups` count words; zero before the launch.
    words: *mut u32,
    groups: u32,
    n: u32,
}

impl GroupLock {
    /// The group of row `row`: `row mod G` (the host never passes G = 0; the guard keeps
    /// a division-by-zero panic, which would need core's panic machinery, out of the PTX).
    #[inline(always)]
    fn group(&self, row: u32) -> u32 {
        row.checked_rem(self.groups).unwrap_or(0)
    }

    /// Spins until this team holds row `row`'s group, then returns the group row.
    ///
    /// # Safety
    /// `words` holds 2 * `groups` words, the group buffers `[2 * groups, n]` f32.
    #[inline(always)]
    unsafe fn acquire<T: Element, S: Team>(&self, row: u32) -> PartialRow {
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
    unsafe fn release<S: Team>(&self, row: u32) {
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

/// The owned mode with partials in shared memory: each team sums its rows' partials in its
/// own shared-memory row (after `scratch` bytes), then the block adds its teams' rows, in
/// team order, into `out` (columns 0..r.cols, overwritten).
///
/// # Safety
/// `r`'s buffers sized as documented; `out` holds `r.cols` columns that no other block
/// writes; the launch gave each block `scratch + per_block * 8 * (padded_len(cols) + 1)`
/// bytes of shared memory.
#[inline(always)]
unsafe fn owned_in_shared<T: Element, S: Team>(r: &Rows<T>, scratch: u32, out: PartialRow) {
    // SAFETY: the launch sized shared memory for every team of the block.
    let mine = unsafe { PartialRow::shared(scratch, S::index_in_block(), r.cols) };
    let mut q = S::rank() as usize;
    while q < padded_len(r.cols) {
        // SAFETY: q < padded_len(cols), inside this team's rows.
        unsafe { (mine.dgamma.add(q).write(0.0), mine.dbeta.add(q).write(0.0)) };
        q += S::size() as usize;
    }
    S::sync();
    let mut row = S::id();
    while row < r.rows {
        // SAFETY: row < rows; the shared row is this team's alone.
        unsafe { backward_row_any::<T, S>(r, row, Sink::Owned(mine)) };
        // The next row may map a column to another rank (packed vs unpacked rows); the
        // barrier orders this row's partial writes before the next row's reads.
        S::sync();
        row += S::count();
    }
    // Every team of the block is done: add their rows, in team order, into `out`.
    device::sync_block();
    let mut j = device::thread_idx();
    while j < r.cols {
        let (mut g, mut b) = (0.0f32, 0.0f32);
        for t in 0..S::per_block() {
            // SAFETY: team t's rows exist (launch guarantee) and all teams wrote theirs
            // before the barrier.
            unsafe {
                let p = PartialRow::shared(scratch, t, r.cols);
                g += p.dgamma.add(padded(j)).read();
                b += p.dbeta.add(padded(j)).read();
            }
        }
        // SAFETY: j < cols; this thread alone writes column j of `out`.
        unsafe {
            out.dgamma.add(j as usize).write(g);
            out.dbeta.add(j as usize).write(b);
        }
        j += device::block_dim();
    }
}

/// Stage 1, owned mode: team u handles rows u, u + U, ... (U = teams), and block b writes
/// partial row b. With `local`, each team sums into its own shared-memory row, and the block
/// adds its teams' rows (in team order) into row b at the end; without it (block teams whose
/// rows do not fit in shared memory), the team adds straight into row b in global memory.
///
/// # Safety
/// `r`'s buffers sized as documented; `part_*` hold `[gridDim, n]` f32; with `local`, the
/// launch gave each block `SCRATCH_BYTES + teams_per_block * 8 * (padded_len(n) + 1)` bytes of
/// shared memory.
/// Warp teams require `local`.
#[inline(always)]
unsafe fn stage1_owned<T: Element, S: Team>(
    r: Rows<T>,
    part_dgamma: *mut f32,
    part_dbeta: *mut f32,
    local: bool,
) {
    let block = device::block_idx();
    if local {
        // SAFETY: block < gridDim, so row b exists; the launch sized shared memory for
        // every team of the block.
        unsafe {
            let out = PartialRow::global(part_dgamma, part_dbeta, block, r.n, false, 0);
            owned_in_shared::<T, S>(&r, SCRATCH_BYTES, out);
        }
        return;
    }
    if block >= r.rows {
        // More blocks than rows: this partial row gets no contribution, so it holds zeros.
        // SAFETY: block < gridDim, so the partial row exists.
        let part = unsafe { PartialRow::global(part_dgamma, part_dbeta, block, r.n, false, 0) };
        let mut q = S::rank() as usize;
        while q < r.n as usize {
            // SAFETY: q < n.
            unsafe { (part.dgamma.add(q).write(0.0), part.dbeta.add(q).write(0.0)) };
            q += S::size() as usize;
        }
        return;
    }
    let mut row = block;
    while row < r.rows {
        // SAFETY: block < gridDim; the first row overwrites, later rows add. Only block
        // teams come here (one team per block), so the row is this team's alone.
        let part = unsafe { PartialRow::global(part_dgamma, part_dbeta, block, r.n, row != block, 0) };
        // SAFETY: row < rows.
        unsafe { backward_row_any::<T, S>(&r, row, Sink::Owned(part)) };
        S::sync();
        row += S::count();
    }
}

/// One rank's partial dgamma and dbeta over the rows its team handled, for the columns of
/// its held packs, in shared memory laid out by rank: the rank's `chunks` 16-byte chunks
/// (4 columns each; chunk q covers elements 4 * (q % (PACK / 4)).. of its slot q / (PACK /
/// 4)) sit `size * 16` bytes apart, so the 32 lanes of a warp touch 512 contiguous bytes in
/// each access: one 16-byte access per 4 columns and no bank conflicts, where the
/// column-ordered rows of the general path take one access per column. dbeta's chunks
/// follow all of dgamma's.
#[derive(Clone, Copy)]
struct RankPartials {
    /// Shared address of chunk 0 of this rank's dgamma.
    dgamma: u32,
    /// Shared address of chunk 0 of this rank's dbeta.
    dbeta: u32,
    /// Bytes from one chunk of a rank to its next (`size * 16`).
    stride: u32,
}

impl RankPartials {
    /// 16-byte chunks per rank and sum: `BWD_HELD` packs of `T::PACK` f32.
    #[inline(always)]
    const fn chunks<T: Element>() -> u32 {
        layernorm_layout::held_chunks(T::PACK as u32)
    }

    /// Shared bytes of one team of `size` ranks: dgamma and dbeta chunks of every rank.
    #[inline(always)]
    fn team_bytes<T: Element>(size: u32) -> u32 {
        layernorm_layout::held_team_bytes(T::PACK as u32, size)
    }

    /// Rank `rank`'s partials in the team whose area starts at byte `base` of shared memory.
    #[inline(always)]
    fn of<T: Element>(base: u32, size: u32, rank: u32) -> Self {
        let dgamma = device::shared_addr(base + rank * 16);
        RankPartials {
            dgamma,
            dbeta: dgamma + Self::chunks::<T>() * size * 16,
            stride: size * 16,
        }
    }

    /// Sets every chunk to zero.
    ///
    /// # Safety
    /// The launch gave the team's area (see [`stage1_held`]).
    #[inline(always)]
    unsafe fn zero<T: Element>(self) {
        for q in 0..Self::chunks::<T>() {
            // SAFETY: chunk q of this rank lies inside the team's area.
            unsafe {
                device::store_shared_16(self.dgamma + q * self.stride, [0; 4]);
                device::store_shared_16(self.dbeta + q * self.stride, [0; 4]);
            }
        }
    }

    /// dgamma += xhat * dy and dbeta += dy for the columns of held slot `c`.
    ///
    /// # Safety
    /// As for [`RankPartials::zero`]; `c < BWD_HELD`.
    #[inline(always)]
    unsafe fn add<T: Element>(self, c: usize, xhat: &Pack, dy: &Pack) {
        for h in 0..T::PACK / 4 {
            let at = (c * T::PACK / 4 + h) as u32 * self.stride;
            // SAFETY: chunk c * PACK / 4 + h < chunks, inside this rank's area.
            let (g, b) = unsafe {
                (
                    device::load_shared_16(self.dgamma + at),
                    device::load_shared_16(self.dbeta + at),
                )
            };
            let k = 4 * h;
            let g = [0, 1, 2, 3].map(|i| fma(xhat[k + i], dy[k + i], f32::from_bits(g[i])).to_bits());
            let b = [0, 1, 2, 3].map(|i| (f32::from_bits(b[i]) + dy[k + i]).to_bits());
            // SAFETY: as above.
            unsafe {
                device::store_shared_16(self.dgamma + at, g);
                device::store_shared_16(self.dbeta + at, b);
            }
        }
    }

    /// Chunk `q`'s dgamma and dbeta.
    ///
    /// # Safety
    /// As for [`RankPartials::zero`]; `q < chunks`.
    #[inline(always)]
    unsafe fn chunk(self, q: u32) -> ([u32; 4], [u32; 4]) {
        // SAFETY: the caller's guarantee.
        unsafe {
            (
                device::load_shared_16(self.dgamma + q * self.stride),
                device::load_shared_16(self.dbeta + q * self.stride),
            )
        }
    }
}

/// A row's x and dy, `BWD_HELD` packs of each per rank, in registers, and its mean and
/// rstd.
struct HeldRow {
    xs: Held<BWD_HELD>,
    dys: Held<BWD_HELD>,
    mean: f32,
    rstd: f32,
}

/// Issues the loads of row `row`'s x, dy, mean and rstd (none where `row` is past the last
/// row, the pipeline's end: the values then stay zero and are never used). mean and rstd
/// travel with the row: loaded when the row is used, each would cost its own DRAM round
/// trip before the row's first sum.
///
/// # Safety
/// Every row pointer 16-byte aligned, `r.n` and `r.cols` whole numbers of packs, `r.cols`
/// packs that [`fits`].
#[inline(always)]
unsafe fn load_held_row<T: Element, S: Team>(r: &Rows<T>, row: u32) -> HeldRow {
    let offset = row as usize * r.n as usize;
    let inside = row < r.rows;
    let packs = if inside { r.cols / T::PACK as u32 } else { 0 };
    // SAFETY: with row < rows the row lies inside x and dy, aligned whole packs that fit
    // (the caller's guarantee), and inside mean and rstd; past the last row nothing is read.
    unsafe {
        HeldRow {
            xs: Held::load::<T, S>(r.x.wrapping_add(offset), packs),
            dys: Held::load::<T, S>(r.dy.wrapping_add(offset), packs),
            mean: if inside { *r.mean.add(row as usize) } else { 0.0 },
            rstd: if inside { *r.rstd.add(row as usize) } else { 0.0 },
        }
    }
}

/// dx for one row of a launch whose rows are all whole packs held in registers, and the
/// row's partials into the rank's own [`RankPartials`]. Two passes over registers:
///   pass 1:  s1 = sum_j xhat_j * wdy_j,  s2 = sum_j wdy_j   (c1 = s1 / n, c2 = s2 / n)
///   pass 2:  dx_j = rstd * wdy_j + (xhat_j * a + b),  a = -rstd * c1,  b = -rstd * c2,
///            dgamma_j += xhat_j * dy_j,  dbeta_j += dy_j
/// Between them, before the row's reduction, the loads of the team's next row go out
/// (`next`): they arrive while this row is reduced, written and summed, so each block keeps
/// two rows in flight and DRAM does not idle while the block works on registers. Returns
/// the next row's registers.
///
/// # Safety
/// `row` < `r.rows`; every row pointer and gamma 16-byte aligned, `r.n` and `r.cols` whole
/// numbers of packs, `r.cols` packs that [`fits`] `BWD_HELD` per rank; the [`HeldRow`] is
/// row `row`'s; `acc` as [`RankPartials::zero`] requires.
#[inline(always)]
unsafe fn backward_row_held<T: Element, S: Team>(
    r: &Rows<T>,
    row: u32,
    HeldRow { xs, dys, mean, rstd }: HeldRow,
    next: u32,
    acc: RankPartials,
) -> HeldRow {
    let offset = row as usize * r.n as usize;
    // SAFETY: row < rows, so this row lies inside dx.
    let dx = unsafe { r.dx.add(offset) };
    // The held slot's (x, dy, gamma); rows of whole packs have no element-wise tail, so every
    // chunk for_each_chunk yields is a held slot.
    let held = |j: u32, slot: Option<usize>| {
        let c = slot.unwrap_or(0);
        // SAFETY: j is a pack of the row, aligned (the caller's guarantee).
        let g = unsafe { read_cached(r.gamma, j, T::PACK) };
        (c, xs.pack::<T>(c), dys.pack::<T>(c), g)
    };

    let centering = Centering::new(mean, rstd);

    // Pass 1.
    let (mut s1, mut s2) = (0.0f32, 0.0f32);
    for_each_chunk::<T, S, true, BWD_HELD>(r.cols, |j, _, slot| {
        let (_, xv, dyv, g) = held(j, slot);
        for k in 0..T::PACK {
            (s1, s2) = add_row_sums(s1, s2, centering.xhat(xv[k]), g[k] * dyv[k]);
        }
    });
    // SAFETY: as this function requires of every row.
    let upcoming = unsafe { load_held_row::<T, S>(r, next) };
    let (s1, s2) = S::sum2(s1, s2);
    let coefficients = DxCoefficients::new(s1, s2, r.n);

    // Pass 2.
    for_each_chunk::<T, S, true, BWD_HELD>(r.cols, |j, _, slot| {
        let (c, xv, dyv, g) = held(j, slot);
        let (mut xhat, mut out) = ([0.0; MAX_PACK], [0.0; MAX_PACK]);
        for k in 0..T::PACK {
            xhat[k] = centering.xhat(xv[k]);
            out[k] = centering.dx(g[k] * dyv[k], xhat[k], coefficients);
        }
        // SAFETY: as above; the rank's partials are its own.
        unsafe {
            write(dx, j, T::PACK, &out);
            acc.add::<T>(c, &xhat, &dyv);
        }
    });
    upcoming
}

/// Stage 1, owned mode, for launches whose rows are all whole aligned packs that fit in
/// registers (the host checks): team u handles rows u, u + U, ... and each rank adds its
/// columns' partials into its own [`RankPartials`]; at the end the block sums its teams' (in
/// team order) into its `r.cols` columns of partial row `out_row`. No barrier between rows:
/// a rank's partials are its own.
///
/// # Safety
/// As [`backward_row_held`] requires of every row; `part_*` point at this block's first
/// column of `[_, n]` f32 buffers that hold row `out_row`; the launch gave each block
/// `scratch + teams_per_block * 8 * BWD_HELD * PACK * size` bytes of shared memory (`size`
/// ranks per team), the first `scratch` for the team's reductions.
#[inline(always)]
unsafe fn stage1_held<T: Element, S: Team>(
    r: Rows<T>,
    part_dgamma: *mut f32,
    part_dbeta: *mut f32,
    out_row: u32,
    scratch: u32,
) {
    let team_bytes = RankPartials::team_bytes::<T>(S::size());
    let team = |t: u32, rank: u32| RankPartials::of::<T>(scratch + t * team_bytes, S::size(), rank);
    let mine = team(S::index_in_block(), S::rank());
    // SAFETY: the launch sized shared memory for every team of the block.
    unsafe { mine.zero::<T>() };
    let mut row = S::id();
    // SAFETY: the launch's rows are held packs (the caller's guarantee); past the last row
    // nothing is loaded.
    let mut held = unsafe { load_held_row::<T, S>(&r, row) };
    while row < r.rows {
        let next = row + S::count();
        // SAFETY: as above, and row < rows.
        held = unsafe { backward_row_held::<T, S>(&r, row, held, next, mine) };
        row = next;
    }
    // Each stacked team passes its own barrier before the block's. The block barrier alone
    // orders every rank's partials before the reads below, but compute-sanitizer's racecheck
    // loses that ordering for a team whose last barrier was its named one while another
    // team (one with no rows left, say) already waited at the block barrier, and reports
    // the reads below as races; a barrier per block, not per row, keeps its verdict clean.
    if S::per_block() > 1 {
        S::sync();
    }
    device::sync_block();
    // Chunk q of rank k (in every team): the teams' sums in team order, into the columns of
    // the pack it covers.
    let (packs, per_pack) = (r.cols / T::PACK as u32, T::PACK as u32 / 4);
    let (size, row_at) = (S::size(), out_row as usize * r.n as usize);
    // Every thread of the block takes chunks, whichever team it belongs to (block teams
    // stack along y).
    let threads = device::block_dim() * device::block_dim_y();
    let mut i = device::thread_idx_y() * device::block_dim() + device::thread_idx();
    while i < RankPartials::chunks::<T>() * size {
        let (rank, q) = (i % size, i / size);
        let p = rank + q / per_pack * size;
        if p < packs {
            let (mut g, mut b) = ([0.0f32; 4], [0.0f32; 4]);
            for t in 0..S::per_block() {
                // SAFETY: q < chunks, inside team t's area, written before the barrier.
                let (tg, tb) = unsafe { team(t, rank).chunk(q) };
                for k in 0..4 {
                    g[k] += f32::from_bits(tg[k]);
                    b[k] += f32::from_bits(tb[k]);
                }
            }
            let col = row_at + (p * T::PACK as u32 + 4 * (q % per_pack)) as usize;
            // SAFETY: col + 4 <= cols inside partial row out_row (p < packs); n and the
            // slice start are whole numbers of packs, so the column is 16-byte aligned.
            unsafe {
                device::store_16(part_dgamma.add(col) as *mut u32, g.map(f32::to_bits));
                device::store_16(part_dbeta.add(col) as *mut u32, b.map(f32::to_bits));
            }
        }
        i += threads;
    }
}

/// Stage 1, owned mode over clusters of `C` blocks (sm_90): cluster u handles rows u,
/// u + U, ... (U = clusters); block q of the cluster takes the q-th slice of each row
/// ([`slice_width`] columns), keeps that slice's partials in its shared memory, and writes
/// them into columns of partial row u at the end. The row sums c1 and c2 come from all C
/// slices ([`Cluster`]'s `sum2`).
///
/// # Safety
/// `r`'s buffers sized as documented (`r.cols` = `r.n`); `part_*` hold `[clusters, n]` f32;
/// the launch gave each block `CLUSTER_SCRATCH_BYTES + 8 * (padded_len(W) + 1)` bytes of
/// shared memory (W = `slice_width(n, PACK, C)`), in clusters of `C` blocks.
#[cfg(layernorm_sm90)]
#[inline(always)]
unsafe fn stage1_cluster<T: Element, const C: u32>(r: Rows<T>, part_dgamma: *mut f32, part_dbeta: *mut f32) {
    let width = slice_width(r.n, T::PACK as u32, C);
    let start = (Cluster::<C>::block_rank() * width).min(r.n);
    let cols = width.min(r.n - start);
    let at = start as usize;
    // The slice's first column. A cluster's last slices may be empty (start == n); their
    // pointers are then never read.
    let slice = Rows {
        x: r.x.wrapping_add(at),
        dy: r.dy.wrapping_add(at),
        gamma: r.gamma.wrapping_add(at),
        dx: r.dx.wrapping_add(at),
        cols,
        ..r
    };
    Cluster::<C>::begin();
    // SAFETY: the cluster's partial row exists (cluster id < clusters) and only this block
    // writes its slice's columns of it; the launch sized shared memory for one slice.
    unsafe {
        let out = PartialRow::global(
            part_dgamma.wrapping_add(at),
            part_dbeta.wrapping_add(at),
            Cluster::<C>::id(),
            r.n,
            false,
            0,
        );
        owned_in_shared::<T, Cluster<C>>(&slice, CLUSTER_SCRATCH_BYTES, out);
    }
    Cluster::<C>::end();
}

/// Stage 1, owned mode over clusters of `C` blocks for rows that are all whole aligned
/// packs: as [`stage1_cluster`] (block q takes the q-th slice of each row, the row sums come
/// from all C slices), with each slice held in registers, two rows in flight and the
/// partials kept by rank, as [`stage1_held`].
///
/// # Safety
/// `r`'s buffers sized as documented (`r.cols` = `r.n`), every row 16-byte aligned and `n`
/// a whole number of packs; a slice's packs [`fits`] `BWD_HELD` per rank; `part_*` hold
/// `[clusters, n]` f32; the launch gave each block `CLUSTER_SCRATCH_BYTES + 8 * BWD_HELD *
/// PACK * blockDim` bytes of shared memory, in clusters of `C` blocks.
#[cfg(layernorm_sm90)]
#[inline(always)]
unsafe fn stage1_cluster_held<T: Element, const C: u32>(
    r: Rows<T>,
    part_dgamma: *mut f32,
    part_dbeta: *mut f32,
) {
    let width = slice_width(r.n, T::PACK as u32, C);
    let start = (Cluster::<C>::block_rank() * width).min(r.n);
    let at = start as usize;
    // The slice's first column. A cluster's last slices may be empty (start == n); their
    // pointers are then never read.
    let slice = Rows {
        x: r.x.wrapping_add(at),
        dy: r.dy.wrapping_add(at),
        gamma: r.gamma.wrapping_add(at),
        dx: r.dx.wrapping_add(at),
        cols: width.min(r.n - start),
        ..r
    };
    Cluster::<C>::begin();
    // SAFETY: the cluster's partial row exists (cluster id < clusters), only this block
    // writes its slice's columns of it, and the launch sized shared memory for its ranks.
    unsafe {
        stage1_held::<T, Cluster<C>>(
            slice,
            part_dgamma.wrapping_add(at),
            part_dbeta.wrapping_add(at),
            Cluster::<C>::id(),
            CLUSTER_SCRATCH_BYTES,
        )
    };
    Cluster::<C>::end();
}

/// Stage 1, locked mode: rows spread over teams, partials into group `row mod G`.
///
/// # Safety
/// `r`'s buffers sized as documented; `lock` as [`GroupLock::acquire`] requires.
#[inline(always)]
unsafe fn stage1_locked<T: Element, S: Team>(r: Rows<T>, lock: GroupLock) {
    let mut row = S::id();
    while row < r.rows {
        // SAFETY: row < rows.
        unsafe { backward_row_any::<T, S>(&r, row, Sink::Locked(&lock)) };
        row += S::count();
    }
}

/// Stage 2's tile of 32 columns as 8 groups of 4, and the slices of partial rows a block sums
/// at once (128: with 8 groups, 1024 threads, so that each slice's few rows load at once).
use layernorm_layout::{STAGE2_GROUPS, STAGE2_SLICES};

/// Stage 2: dgamma_j and dbeta_j are the sums of column j over the `rows` partial rows.
/// A block takes a tile of 32 columns; thread (slice s, group q) sums columns 4q..4q+4 of
/// rows s, s + 128, ... (four rows in flight at a time, 16-byte loads where n is a whole
/// number of 4-column groups), then the 128 slice sums meet in a fixed pairwise tree
/// (slice s += slice s + h for h = 64, 32, ..., 1). The order of every addition is fixed,
/// so the owned mode stays bitwise reproducible.
///
/// # Safety
/// `part_*` hold `[rows, n]` f32 (16-byte aligned); `dgamma`, `dbeta` hold `n`; the block
/// is `STAGE2_GROUPS * STAGE2_SLICES` threads with `2 * 16 * STAGE2_GROUPS * STAGE2_SLICES`
/// bytes of shared memory.
#[inline(always)]
unsafe fn stage2<T: Element>(
    part_dgamma: *const f32,
    part_dbeta: *const f32,
    rows: u32,
    n: u32,
    dgamma: *mut T,
    dbeta: *mut T,
) {
    let (group, slice) = (
        device::thread_idx() % STAGE2_GROUPS,
        device::thread_idx() / STAGE2_GROUPS,
    );
    let vector = n % 4 == 0;
    // This thread's slot of slice sums: dgamma's 16 bytes, then (after all slots) dbeta's.
    let slot = |s: u32| device::shared_addr((s * STAGE2_GROUPS + group) * 16);
    let dbeta_slots = STAGE2_GROUPS * STAGE2_SLICES * 16;
    let mut tile = device::block_idx();
    while tile * 32 < n {
        let j = tile * 32 + 4 * group;
        // Columns j..j + 4 of partial row r, zero past n.
        let load = |part: *const f32, r: u32| -> [f32; 4] {
            let at = r as usize * n as usize + j as usize;
            if vector && j < n {
                // SAFETY: r < rows, j + 4 <= n (n a multiple of 4); the row and the group
                // start 16-byte aligned.
                unsafe { device::load_16(part.add(at) as *const u32).map(f32::from_bits) }
            } else {
                [0, 1, 2, 3].map(|k| {
                    if j + k < n {
                        // SAFETY: r < rows, and only columns below n are read.
                        unsafe { *part.add(at + k as usize) }
                    } else {
                        0.0
                    }
                })
            }
        };
        let (mut g, mut b) = ([0.0f32; 4], [0.0f32; 4]);
        let mut r = slice;
        while r + 3 * STAGE2_SLICES < rows {
            // All eight loads first: the four rows' loads are in flight together.
            let rows4 = [0, 1, 2, 3].map(|u| r + u * STAGE2_SLICES);
            let (pg, pb) = (
                rows4.map(|q| load(part_dgamma, q)),
                rows4.map(|q| load(part_dbeta, q)),
            );
            for u in 0..4 {
                for k in 0..4 {
                    g[k] += pg[u][k];
                    b[k] += pb[u][k];
                }
            }
            r += 4 * STAGE2_SLICES;
        }
        while r < rows {
            let (pg, pb) = (load(part_dgamma, r), load(part_dbeta, r));
            for k in 0..4 {
                g[k] += pg[k];
                b[k] += pb[k];
            }
            r += STAGE2_SLICES;
        }
        // SAFETY: slot(slice) lies in the block's shared memory (launch guarantee).
        unsafe {
            device::store_shared_16(slot(slice), g.map(f32::to_bits));
            device::store_shared_16(slot(slice) + dbeta_slots, b.map(f32::to_bits));
        }
        let mut half = STAGE2_SLICES / 2;
        while half > 0 {
            device::sync_block();
            if slice < half {
                // SAFETY: slice + half < SLICES; both slots written before the barrier.
                unsafe {
                    for at in [slot(slice), slot(slice) + dbeta_slots] {
                        let (mine, other) = (
                            device::load_shared_16(at),
                            device::load_shared_16(at + half * 16 * STAGE2_GROUPS),
                        );
                        let sum = [0, 1, 2, 3]
                            .map(|k| (f32::from_bits(mine[k]) + f32::from_bits(other[k])).to_bits());
                        device::store_shared_16(at, sum);
                    }
                }
            }
            half /= 2;
        }
        if slice == 0 {
            // SAFETY: slot 0 of this group holds the tile's sums (written by this thread).
            let (g, b) = unsafe {
                (
                    device::load_shared_16(slot(0)),
                    device::load_shared_16(slot(0) + dbeta_slots),
                )
            };
            for k in 0..4 {
                let col = j as usize + k;
                if col < n as usize {
                    // SAFETY: col < n.
                    unsafe {
                        dgamma.add(col).write(T::from_f32(f32::from_bits(g[k])));
                        dbeta.add(col).write(T::from_f32(f32::from_bits(b[k])));
                    }
                }
            }
        }
        // The next tile's slice sums overwrite these.
        device::sync_block();
        tile += device::grid_dim();
    }
}

/// Exports the backward kernels of one storage type: stage 1 owned and locked, each for
/// warp- and block-per-row, and stage 2.
macro_rules! backward_kernels {
    ($t:ty, $owned_warp:ident, $owned_block:ident, $held_warp:ident, $held_block:ident, $locked_warp:ident,
     $locked_block:ident, $reduce:ident) => {
        backward_kernels!(@owned $t, $owned_warp, Warp);
        backward_kernels!(@owned $t, $owned_block, Block);
        backward_kernels!(@held $t, $held_warp, Warp);
        backward_kernels!(@held $t, $held_block, StackedBlock);
        backward_kernels!(@locked $t, $locked_warp, Warp);
        backward_kernels!(@locked $t, $locked_block, Block);

        /// Stage 2: sums `[rows, n]` f32 partials per column into dgamma and dbeta.
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $reduce(
            part_dgamma: *const f32,
            part_dbeta: *const f32,
            rows: u32,
            n: u32,
            dgamma: *mut $t,
            dbeta: *mut $t,
        ) {
            // SAFETY: the host sizes every buffer as `stage2` requires.
            unsafe { stage2::<$t>(part_dgamma, part_dbeta, rows, n, dgamma, dbeta) }
        }
    };
    (@owned $t:ty, $name:ident, $team:ty) => {
        /// Stage 1, owned (deterministic) mode: args (x, dy, gamma, mean, rstd, dx,
        /// part_dgamma, part_dbeta, rows, n, local); the partial buffers hold one row per
        /// block; `local` != 0 sums in shared memory first (required for warp teams).
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(
            x: *const $t,
            dy: *const $t,
            gamma: *const $t,
            mean: *const f32,
            rstd: *const f32,
            dx: *mut $t,
            part_dgamma: *mut f32,
            part_dbeta: *mut f32,
            rows: u32,
            n: u32,
            local: u32,
        ) {
            let r = Rows { x, dy, gamma, mean, rstd, dx, rows, n, cols: n };
            // SAFETY: the host sizes every buffer as `stage1_owned` requires.
            unsafe { stage1_owned::<$t, $team>(r, part_dgamma, part_dbeta, local != 0) }
        }
    };
    (@held $t:ty, $name:ident, $team:ty) => {
        /// Stage 1, owned mode, rows all whole aligned packs held in registers: args (x, dy,
        /// gamma, mean, rstd, dx, part_dgamma, part_dbeta, rows, n); one partial row per
        /// block, whose teams (warps, or block teams stacked along y) all add into it.
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows that hold.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(
            x: *const $t,
            dy: *const $t,
            gamma: *const $t,
            mean: *const f32,
            rstd: *const f32,
            dx: *mut $t,
            part_dgamma: *mut f32,
            part_dbeta: *mut f32,
            rows: u32,
            n: u32,
        ) {
            let r = Rows { x, dy, gamma, mean, rstd, dx, rows, n, cols: n };
            let block = device::block_idx();
            // SAFETY: the host launches this kernel only as `stage1_held` requires; block b
            // writes partial row b.
            unsafe { stage1_held::<$t, $team>(r, part_dgamma, part_dbeta, block, SCRATCH_BYTES) }
        }
    };
    (@locked $t:ty, $name:ident, $team:ty) => {
        /// Stage 1, locked mode: args (x, dy, gamma, mean, rstd, dx, group_dgamma,
        /// group_dbeta, words, groups, rows, n); the group buffers are `[2 * groups, n]`
        /// (sums, then their compensations); `words` is 2 * groups zeroed u32.
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(
            x: *const $t,
            dy: *const $t,
            gamma: *const $t,
            mean: *const f32,
            rstd: *const f32,
            dx: *mut $t,
            group_dgamma: *mut f32,
            group_dbeta: *mut f32,
            words: *mut u32,
            groups: u32,
            rows: u32,
            n: u32,
        ) {
            let r = Rows { x, dy, gamma, mean, rstd, dx, rows, n, cols: n };
            let lock = GroupLock { dgamma: group_dgamma, dbeta: group_dbeta, words, groups, n };
            // SAFETY: the host sizes every buffer as `stage1_locked` requires.
            unsafe { stage1_locked::<$t, $team>(r, lock) }
        }
    };
}

backward_kernels!(
    f32,
    layer_norm_bwd_owned_warp_f32,
    layer_norm_bwd_owned_block_f32,
    layer_norm_bwd_held_warp_f32,
    layer_norm_bwd_held_block_f32,
    layer_norm_bwd_locked_warp_f32,
    layer_norm_bwd_locked_block_f32,
    layer_norm_bwd_reduce_f32
);
backward_kernels!(
    crate::element::F16,
    layer_norm_bwd_owned_warp_f16,
    layer_norm_bwd_owned_block_f16,
    layer_norm_bwd_held_warp_f16,
    layer_norm_bwd_held_block_f16,
    layer_norm_bwd_locked_warp_f16,
    layer_norm_bwd_locked_block_f16,
    layer_norm_bwd_reduce_f16
);
backward_kernels!(
    crate::element::Bf16,
    layer_norm_bwd_owned_warp_bf16,
    layer_norm_bwd_owned_block_bf16,
    layer_norm_bwd_held_warp_bf16,
    layer_norm_bwd_held_block_bf16,
    layer_norm_bwd_locked_warp_bf16,
    layer_norm_bwd_locked_block_bf16,
    layer_norm_bwd_reduce_bf16
);

/// Blocks per cluster of the general cluster kernels: the portable maximum. Measured
/// against 2 and 4 (docs/PERF.md, v6): their smaller slices leave room for more blocks,
/// hence more rows in flight, per multiprocessor, which outweighs the wider barrier.
#[cfg(layernorm_sm90)]
use layernorm_layout::CLUSTER_SIZE;

/// Exports the cluster stage 1 kernels (sm_90 module only) of one storage type: the general
/// one over 8 blocks, and the held one over 2, 4 and 8 (the host takes the fewest blocks
/// whose slices fit 4 packs a rank: fewer blocks wait at each row's cluster barrier).
/// build.rs gives each `.reqnctapercluster C` from its name.
#[cfg(layernorm_sm90)]
macro_rules! cluster_kernels {
    ($t:ty, $name:ident, $held2:ident, $held4:ident, $held8:ident) => {
        cluster_kernels!(@one $t, $held2, stage1_cluster_held, 2,
            "Stage 1, owned mode over a cluster of 2 blocks, slices held (rows of aligned packs).");
        cluster_kernels!(@one $t, $held4, stage1_cluster_held, 4,
            "Stage 1, owned mode over a cluster of 4 blocks, slices held (rows of aligned packs).");
        cluster_kernels!(@one $t, $held8, stage1_cluster_held, 8,
            "Stage 1, owned mode over a cluster of 8 blocks, slices held (rows of aligned packs).");
        cluster_kernels!(@one $t, $name, stage1_cluster, CLUSTER_SIZE, "Stage 1, owned mode over a cluster of 8 blocks.");
    };
    (@one $t:ty, $name:ident, $stage:ident, $c:expr, $doc:literal) => {
        #[doc = $doc]
        /// Args (x, dy, gamma, mean, rstd, dx, part_dgamma, part_dbeta, rows, n); the
        /// partial buffers hold one row per cluster.
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows the kernel
        /// takes (`$stage`'s safety section).
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(
            x: *const $t,
            dy: *const $t,
            gamma: *const $t,
            mean: *const f32,
            rstd: *const f32,
            dx: *mut $t,
            part_dgamma: *mut f32,
            part_dbeta: *mut f32,
            rows: u32,
            n: u32,
        ) {
            let r = Rows { x, dy, gamma, mean, rstd, dx, rows, n, cols: n };
            // SAFETY: the host launches this kernel only as `$stage` requires.
            unsafe { $stage::<$t, { $c }>(r, part_dgamma, part_dbeta) }
        }
    };
}

#[cfg(layernorm_sm90)]
cluster_kernels!(
    f32,
    layer_norm_bwd_cluster8_f32,
    layer_norm_bwd_cluster2_held_f32,
    layer_norm_bwd_cluster4_held_f32,
    layer_norm_bwd_cluster8_held_f32
);
#[cfg(layernorm_sm90)]
cluster_kernels!(
    crate::element::F16,
    layer_norm_bwd_cluster8_f16,
    layer_norm_bwd_cluster2_held_f16,
    layer_norm_bwd_cluster4_held_f16,
    layer_norm_bwd_cluster8_held_f16
);
#[cfg(layernorm_sm90)]
cluster_kernels!(
    crate::element::Bf16,
    layer_norm_bwd_cluster8_bf16,
    layer_norm_bwd_cluster2_held_bf16,
    layer_norm_bwd_cluster4_held_bf16,
    layer_norm_bwd_cluster8_held_bf16
);
