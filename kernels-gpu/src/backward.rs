//! LayerNorm backward, in two stages.
//!
//! Per row i, with xhat_j = (x_j - mean_i) * rstd_i and wdy_j = gamma_j * dy_j:
//!   c1   = sum_j xhat_j * wdy_j / n
//!   c2   = sum_j wdy_j / n
//!   dx_j = rstd_i * (wdy_j - (xhat_j * c1 + c2))
//! and over all rows:
//!   dgamma_j = sum_i dy_ij * xhat_ij        dbeta_j = sum_i dy_ij
//!
//! Stage 1 writes dx and adds each row's (dy * xhat, dy) into one row of an f32 partial
//! buffer `[R, n]`. Stage 2 sums the R partial rows per column into dgamma and dbeta.
//! Partials are f32 whatever the storage type, so long columns do not round in f16.
//!
//! Two ways to fill the partial buffer:
//! - owned (deterministic): team u handles rows u, u + U, ... and alone owns partial row u;
//!   no locks, and every sum runs in a fixed order, so results are bitwise reproducible.
//! - locked (the Triton tutorial's scheme): row i adds into group i mod G under that group's
//!   spinlock (an atomic compare-and-swap on a lock word); a count word says whether the
//!   group was written yet (first writer stores, later ones add), so the G rows need no
//!   clearing, only the 2*G lock and count words.
//!
//! Versions (docs/PERF.md has the measurements):
//!   v1  three passes over the row: sums, dx (+ partials when owned), and in locked mode a
//!       third pass under the lock, so that the lock is held only while adding partials.
//!   v2  rows of up to 4 packs per rank keep x and dy in registers across the passes (one
//!       read from memory); in owned mode each team adds its partials into its own row of
//!       shared memory, and the block writes one combined row at the end, so partial sums
//!       stop costing a read-modify-write through L2 per row; partials in a pass of their
//!       own in both modes, all loads of a chunk before its stores; stage 2 sums each
//!       column in 8 slices of rows, 4 rows in flight per thread.
//!   v4  shared-memory partial rows padded by a word per 32 (no bank conflicts); global
//!       partial rows read and written in 16-byte vectors.
//!   v9  c1's products and dx's xhat * c1 + c2 each one `fma`; f16/bf16 dx narrowed two
//!       values per instruction.

use core::sync::atomic::{AtomicU32, Ordering, fence};

#[cfg(layernorm_sm90)]
use crate::cluster::{CLUSTER_SCRATCH_BYTES, Cluster, slice_width};
use crate::device::{self, fma, load_f32_l2, shared_ptr};
use crate::element::{Element, MAX_PACK, Pack, is_pack_aligned, read_cached, write};
use crate::row::{BWD_HELD, Held, fits, for_each_chunk, prefetch, values};
use crate::team::{Block, SCRATCH_BYTES, Team, Warp};

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
}

/// Where column j lives in a shared-memory partial row: one padding word after every 32.
/// A rank's pack starts `PACK` words after its neighbour's, so in the plain layout lanes
/// i and i + 32 / PACK hit the same bank (an 8-way conflict for f16); the padding shifts
/// each group of 32 words by one bank, which spreads a warp's 32 lanes over all 32 banks.
/// A pack never straddles a padding word (PACK divides 32), so its words stay contiguous.
#[inline(always)]
fn padded(j: u32) -> usize {
    (j + j / 32) as usize
}

/// Words of a padded shared-memory row of `n` columns.
#[inline(always)]
fn padded_len(n: u32) -> usize {
    padded(n)
}

impl PartialRow {
    /// Row `r` of `[_, n]` buffers in global memory, read through L2 (`ld.global.cg`): a
    /// locked group row was last written by another multiprocessor, whose writes are not
    /// in this one's L1.
    ///
    /// # Safety
    /// `r` < the buffers' row count.
    #[inline(always)]
    unsafe fn global(dgamma: *mut f32, dbeta: *mut f32, r: u32, n: u32, accumulate: bool) -> Self {
        let offset = r as usize * n as usize;
        // SAFETY: the caller guarantees the row is inside both buffers.
        let (dgamma, dbeta) = unsafe { (dgamma.add(offset), dbeta.add(offset)) };
        PartialRow {
            dgamma,
            dbeta,
            accumulate,
            shared: false,
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
        }
    }

    /// Adds the chunk `[start, start + len)`'s dgamma and dbeta terms. Every load of the
    /// chunk comes before its stores: a store could alias a later load, so interleaving
    /// them would make each load wait a full memory latency for the one before.
    ///
    /// # Safety
    /// The chunk is inside the row, and no other thread writes it concurrently.
    #[inline(always)]
    unsafe fn add<T: Element>(self, start: u32, len: usize, dgamma: &Pack, dbeta: &Pack) {
        let at = if self.shared {
            padded(start)
        } else {
            start as usize
        };
        // SAFETY: the caller guarantees bounds and exclusive access.
        let (g, b) = unsafe { (self.dgamma.add(at), self.dbeta.add(at)) };
        let (mut old_g, mut old_b) = ([0.0; MAX_PACK], [0.0; MAX_PACK]);
        let vector = !self.shared && len == T::PACK && is_pack_aligned(g) && is_pack_aligned(b);
        // SAFETY: as above; vectors only where both rows are 16-byte aligned.
        unsafe {
            if self.accumulate {
                if vector {
                    // A global row: 16-byte loads through L2, 4 f32 each.
                    for v in 0..len / 4 {
                        let (wg, wb) = (
                            device::load_16(g.add(4 * v) as *const u32),
                            device::load_16(b.add(4 * v) as *const u32),
                        );
                        for k in 0..4 {
                            (old_g[4 * v + k], old_b[4 * v + k]) =
                                (f32::from_bits(wg[k]), f32::from_bits(wb[k]));
                        }
                    }
                } else {
                    for k in 0..len {
                        (old_g[k], old_b[k]) = if self.shared {
                            (g.add(k).read(), b.add(k).read())
                        } else {
                            (load_f32_l2(g.add(k)), load_f32_l2(b.add(k)))
                        };
                    }
                }
            }
            if vector {
                for v in 0..len / 4 {
                    let word = |a: &Pack, d: &Pack, k: usize| (a[4 * v + k] + d[4 * v + k]).to_bits();
                    device::store_16(
                        g.add(4 * v) as *mut u32,
                        [0, 1, 2, 3].map(|k| word(&old_g, dgamma, k)),
                    );
                    device::store_16(
                        b.add(4 * v) as *mut u32,
                        [0, 1, 2, 3].map(|k| word(&old_b, dbeta, k)),
                    );
                }
            } else {
                for k in 0..len {
                    g.add(k).write(old_g[k] + dgamma[k]);
                    b.add(k).write(old_b[k] + dbeta[k]);
                }
            }
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
            xhat[k] = (xv[k] - mean) * rstd;
            wdy[k] = g[k] * dyv[k];
        }
        (xhat, wdy, dyv)
    };

    // Pass 1: c1 and c2.
    let (mut s1, mut s2) = (0.0f32, 0.0f32);
    for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
        let (xhat, wdy, _) = terms(j, len, slot);
        for k in 0..len {
            s1 = fma(xhat[k], wdy[k], s1);
            s2 += wdy[k];
        }
    });
    let (s1, s2) = S::sum2(s1, s2);
    let (c1, c2) = (s1 / n as f32, s2 / n as f32);

    // Pass 2: dx.
    for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
        let (xhat, wdy, _) = terms(j, len, slot);
        let mut out = [0.0; MAX_PACK];
        for k in 0..len {
            out[k] = rstd * (wdy[k] - fma(xhat[k], c1, c2));
        }
        // SAFETY: as above.
        unsafe { write(dx, j, len, &out) };
    });

    // Pass 3: the partials (dy * xhat, dy), into the team's own row or, with the lock held,
    // into the row's group. A pass of its own keeps fewer values live than adding them
    // during pass 2 (no register spills at 64 per thread), and held rows cost no memory.
    let (part, lock) = match sink {
        Sink::Owned(p) => (p, None),
        // SAFETY: the group index is below G and its lock and count words exist.
        Sink::Locked(l) => (unsafe { l.acquire::<T, S>(row) }, Some(l)),
    };
    for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
        let (xhat, _, dyv) = terms(j, len, slot);
        let mut dgamma = [0.0; MAX_PACK];
        for k in 0..len {
            dgamma[k] = dyv[k] * xhat[k];
        }
        // SAFETY: as above; the row is this team's alone (owned, or locked by it).
        unsafe { part.add::<T>(j, len, &dgamma, &dyv) };
    });
    if let Some(lock) = lock {
        // SAFETY: this team holds the lock it releases.
        unsafe { lock.release::<S>(row) };
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
    /// `words` holds 2 * `groups` words, the group buffers `[groups, n]` f32.
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
        // SAFETY: g < groups.
        unsafe { PartialRow::global(self.dgamma, self.dbeta, g, self.n, written != 0) }
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
            let out = PartialRow::global(part_dgamma, part_dbeta, block, r.n, false);
            owned_in_shared::<T, S>(&r, SCRATCH_BYTES, out);
        }
        return;
    }
    if block >= r.rows {
        // More blocks than rows: this partial row gets no contribution, so it holds zeros.
        // SAFETY: block < gridDim, so the partial row exists.
        let part = unsafe { PartialRow::global(part_dgamma, part_dbeta, block, r.n, false) };
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
        let part = unsafe { PartialRow::global(part_dgamma, part_dbeta, block, r.n, row != block) };
        // SAFETY: row < rows.
        unsafe { backward_row_any::<T, S>(&r, row, Sink::Owned(part)) };
        S::sync();
        row += S::count();
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
        );
        owned_in_shared::<T, Cluster<C>>(&slice, CLUSTER_SCRATCH_BYTES, out);
    }
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

/// Threads of a stage 2 block: 32 columns (one warp reads 128 contiguous bytes of a
/// partial row) times `STAGE2_SLICES` slices of the partial rows.
const STAGE2_SLICES: u32 = 8;

/// Stage 2: dgamma_j and dbeta_j are the sums of column j over the `rows` partial rows.
/// A block takes 32 columns (a warp reads 128 contiguous bytes of a row); its 8 warps each
/// sum every 8th partial row (four rows in flight at a time), then the 8 slice sums are
/// added in slice order. The order of every addition is fixed, so the owned mode stays
/// bitwise reproducible.
///
/// # Safety
/// `part_*` hold `[rows, n]` f32; `dgamma`, `dbeta` hold `n`; the block is 32 x
/// `STAGE2_SLICES` threads with `2 * 4 * 32 * STAGE2_SLICES` bytes of shared memory.
#[inline(always)]
unsafe fn stage2<T: Element>(
    part_dgamma: *const f32,
    part_dbeta: *const f32,
    rows: u32,
    n: u32,
    dgamma: *mut T,
    dbeta: *mut T,
) {
    let (lane, slice) = (device::thread_idx() % 32, device::thread_idx() / 32);
    let slot = device::thread_idx() as usize;
    let (sums_g, sums_b) = (shared_ptr::<f32>(0), shared_ptr::<f32>(4 * 32 * STAGE2_SLICES));
    let mut tile = device::block_idx();
    while tile * 32 < n {
        let j = (tile * 32 + lane) as usize;
        let (mut g, mut b) = ([0.0f32; 4], [0.0f32; 4]);
        if j < n as usize {
            let at = |r: u32| r as usize * n as usize + j;
            let mut r = slice;
            while r + 3 * STAGE2_SLICES < rows {
                for u in 0..4 {
                    // SAFETY: r + u * SLICES < rows and j < n.
                    unsafe {
                        g[u] += *part_dgamma.add(at(r + u as u32 * STAGE2_SLICES));
                        b[u] += *part_dbeta.add(at(r + u as u32 * STAGE2_SLICES));
                    }
                }
                r += 4 * STAGE2_SLICES;
            }
            while r < rows {
                // SAFETY: r < rows and j < n.
                unsafe {
                    g[0] += *part_dgamma.add(at(r));
                    b[0] += *part_dbeta.add(at(r));
                }
                r += STAGE2_SLICES;
            }
        }
        // SAFETY: slot < 32 * SLICES, inside both shared arrays.
        unsafe {
            sums_g.add(slot).write((g[0] + g[1]) + (g[2] + g[3]));
            sums_b.add(slot).write((b[0] + b[1]) + (b[2] + b[3]));
        }
        device::sync_block();
        if slice == 0 && j < n as usize {
            let (mut g, mut b) = (0.0f32, 0.0f32);
            for s in 0..STAGE2_SLICES as usize {
                // SAFETY: s * 32 + lane < 32 * SLICES; written before the barrier.
                unsafe {
                    g += sums_g.add(s * 32 + lane as usize).read();
                    b += sums_b.add(s * 32 + lane as usize).read();
                }
            }
            // SAFETY: j < n.
            unsafe {
                dgamma.add(j).write(T::from_f32(g));
                dbeta.add(j).write(T::from_f32(b));
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
    ($t:ty, $owned_warp:ident, $owned_block:ident, $locked_warp:ident, $locked_block:ident, $reduce:ident) => {
        backward_kernels!(@owned $t, $owned_warp, Warp);
        backward_kernels!(@owned $t, $owned_block, Block);
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
    (@locked $t:ty, $name:ident, $team:ty) => {
        /// Stage 1, locked mode: args (x, dy, gamma, mean, rstd, dx, group_dgamma,
        /// group_dbeta, words, groups, rows, n); `words` is 2 * groups zeroed u32.
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
    layer_norm_bwd_locked_warp_f32,
    layer_norm_bwd_locked_block_f32,
    layer_norm_bwd_reduce_f32
);
backward_kernels!(
    crate::element::F16,
    layer_norm_bwd_owned_warp_f16,
    layer_norm_bwd_owned_block_f16,
    layer_norm_bwd_locked_warp_f16,
    layer_norm_bwd_locked_block_f16,
    layer_norm_bwd_reduce_f16
);
backward_kernels!(
    crate::element::Bf16,
    layer_norm_bwd_owned_warp_bf16,
    layer_norm_bwd_owned_block_bf16,
    layer_norm_bwd_locked_warp_bf16,
    layer_norm_bwd_locked_block_bf16,
    layer_norm_bwd_reduce_bf16
);

/// Blocks per cluster of the cluster stage 1: the portable maximum. Measured against 2
/// and 4 (docs/PERF.md, v6): the smaller slices leave room for more blocks, hence more
/// rows in flight, per multiprocessor, which outweighs the wider barrier.
#[cfg(layernorm_sm90)]
const CLUSTER_SIZE: u32 = 8;

/// Exports the cluster stage 1 (sm_90 module only) of one storage type; build.rs gives it
/// `.reqnctapercluster 8` from its name.
#[cfg(layernorm_sm90)]
macro_rules! cluster_kernels {
    ($t:ty, $name:ident) => {
        /// Stage 1, owned mode over a cluster of 8 blocks: args (x, dy, gamma, mean, rstd,
        /// dx, part_dgamma, part_dbeta, rows, n); the partial buffers hold one row per
        /// cluster.
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
        ) {
            let r = Rows {
                x,
                dy,
                gamma,
                mean,
                rstd,
                dx,
                rows,
                n,
                cols: n,
            };
            // SAFETY: the host sizes every buffer as `stage1_cluster` requires.
            unsafe { stage1_cluster::<$t, CLUSTER_SIZE>(r, part_dgamma, part_dbeta) }
        }
    };
}

#[cfg(layernorm_sm90)]
cluster_kernels!(f32, layer_norm_bwd_cluster8_f32);
#[cfg(layernorm_sm90)]
cluster_kernels!(crate::element::F16, layer_norm_bwd_cluster8_f16);
#[cfg(layernorm_sm90)]
cluster_kernels!(crate::element::Bf16, layer_norm_bwd_cluster8_bf16);
