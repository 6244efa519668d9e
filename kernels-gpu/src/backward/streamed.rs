//! Stage 1 over rows of any length and alignment: a row's packs held in registers where
//! they fit, else streamed (read once per pass), else element by element; partials into the
//! team's own row (owned mode) or the row's spinlocked group (locked mode).

use super::partials::{GroupLock, PartialRow, padded, padded_len};
use super::{Centering, DxCoefficients, Rows, add_row_sums};
use crate::device;
use crate::element::{Element, MAX_PACK, Pack, is_pack_aligned, read, write};
use crate::row::{BWD_HELD, Held, fits, for_each_chunk, prefetch, values};
use crate::team::{SCRATCH_BYTES, Team};

/// Where a row's partial dgamma and dbeta go.
#[derive(Clone, Copy)]
pub(crate) enum Sink<'a> {
    /// A row this team alone writes.
    Owned(PartialRow),
    /// The row's group, with the group's lock held.
    Locked(&'a GroupLock),
}

/// dx for one row, and its partials into `sink`; `HELD` packs of x and dy per rank stay in
/// registers across the passes.
///
/// # Safety
/// `row` < `r.rows`; with `PACKED` every row pointer (dsum's too, where given) and gamma
/// are 16-byte aligned; with `HELD` > 0 the row [`fits`].
#[inline(always)]
pub(crate) unsafe fn backward_row<T: Element, W: Element, S: Team, const PACKED: bool, const HELD: usize>(
    r: &Rows<T, W>,
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
                r.gamma(j, len),
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
    let coefficients = DxCoefficients::new(s1, r.s2(s2), n);

    // Pass 2: dx (with dsum, where given).
    let dsum = r.dsum_row(offset);
    for_each_chunk::<T, S, PACKED, HELD>(cols, |j, len, slot| {
        let (xhat, wdy, _) = terms(j, len, slot);
        let mut out = [0.0; MAX_PACK];
        for k in 0..len {
            out[k] = centering.dx(wdy[k], xhat[k], coefficients);
        }
        if let Some(dsum) = dsum {
            // SAFETY: dsum holds the row as dx does, aligned where dx's packs are.
            let ds = unsafe { read(dsum, j, len) };
            for k in 0..len {
                out[k] += ds[k];
            }
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
pub(crate) unsafe fn backward_row_any<T: Element, W: Element, S: Team>(
    r: &Rows<T, W>,
    row: u32,
    sink: Sink<'_>,
) {
    let offset = row as usize * r.n as usize;
    let packed = is_pack_aligned(r.x.wrapping_add(offset))
        && is_pack_aligned(r.dy.wrapping_add(offset))
        && is_pack_aligned(r.dx.wrapping_add(offset))
        && r.dsum_row(offset).is_none_or(is_pack_aligned)
        && is_pack_aligned(r.gamma);
    // SAFETY: row < rows; `packed` was checked for every pointer the packed paths read.
    unsafe {
        if packed && fits::<T, S, BWD_HELD>(r.cols) {
            backward_row::<T, W, S, true, BWD_HELD>(r, row, sink)
        } else if packed {
            backward_row::<T, W, S, true, 0>(r, row, sink)
        } else {
            backward_row::<T, W, S, false, 0>(r, row, sink)
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
pub(crate) unsafe fn owned_in_shared<T: Element, W: Element, S: Team>(
    r: &Rows<T, W>,
    scratch: u32,
    out: PartialRow,
) {
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
        unsafe { backward_row_any::<T, W, S>(r, row, Sink::Owned(mine)) };
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
pub(crate) unsafe fn stage1_owned<T: Element, W: Element, S: Team>(
    r: Rows<T, W>,
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
            owned_in_shared::<T, W, S>(&r, SCRATCH_BYTES, out);
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
        unsafe { backward_row_any::<T, W, S>(&r, row, Sink::Owned(part)) };
        S::sync();
        row += S::count();
    }
}

/// Stage 1, locked mode: rows spread over teams, partials into group `row mod G`.
///
/// # Safety
/// `r`'s buffers sized as documented; `lock` as [`GroupLock::acquire`] requires.
#[inline(always)]
pub(crate) unsafe fn stage1_locked<T: Element, W: Element, S: Team>(r: Rows<T, W>, lock: GroupLock) {
    let mut row = S::id();
    while row < r.rows {
        // SAFETY: row < rows.
        unsafe { backward_row_any::<T, W, S>(&r, row, Sink::Locked(&lock)) };
        row += S::count();
    }
}
