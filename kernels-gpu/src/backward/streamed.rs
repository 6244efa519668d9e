//! Stage 1 over rows of any length and alignment: a row's packs held in registers where
//! they fit, else streamed (read once per pass), else in half packs or element by element;
//! partials into the team's own row, in shared memory or (block teams, rows too long for
//! it) the block's row of global memory, handed over once at the end ([`Destination`]).

use super::partials::{Destination, PartialRow, padded, padded_len};
use super::{Centering, DxCoefficients, Rows, add_row_sums};
use crate::device;
use crate::element::{
    Element, MAX_PACK, Pack, is_pack_aligned, is_pack_aligned_as, read, read_half_pack, write,
};
use crate::layout::block_half_pack_rows;
use crate::row::{
    BWD_HELD, ELEMENTS, HALF_PACKS, Held, PACKS, chunk_of, fits, for_each_chunk, for_each_chunk_batched,
    for_each_shifted_chunk, head_elements, prefetch, values,
};
use crate::team::{SCRATCH_BYTES, Team};

/// Elements a rank of a block team takes at once in each pass of a row not 8-byte aligned
/// (the host sizes the owned block kernel's teams by it).
const BATCH_ELEMENTS: usize = crate::layout::BWD_BATCH_ELEMENTS as usize;
/// Half packs a rank of a block team takes at once in each pass of a row 8-byte aligned but
/// not 16: 16 bytes of x and 16 of dy in flight, twice a batch of elements' at f16.
const BATCH_HALF_PACKS: usize = 2;

/// dx for one row, and its partials into `part`, a row this team alone writes; `HELD` packs
/// of x and dy per rank stay in registers across the passes. `SHIFTED` (with [`PACKS`]):
/// the row's packs start at x's first 16-byte boundary, its head before it goes element by
/// element ([`for_each_shifted_chunk`]), and gamma, whose columns then sit off its own
/// boundaries, is read in words or elements ([`Rows::gamma_shifted`]).
///
/// # Safety
/// `row` < `r.rows`; `CHUNK` is [`PACKS`], [`HALF_PACKS`] or [`ELEMENTS`]. With [`PACKS`]
/// every row pointer (dsum's too, where given) and gamma are 16-byte aligned, or with
/// `SHIFTED` x, dy and dx are of one size and every row pointer sits as many bytes past a
/// 16-byte boundary as x's; with [`HALF_PACKS`] x, dy and gamma are of one size and every
/// row pointer and gamma 8-byte aligned; with `HELD` > 0 the row (past its head) [`fits`].
#[inline(always)]
pub(crate) unsafe fn backward_row<
    X: Element,
    T: Element,
    W: Element,
    S: Team,
    const CHUNK: usize,
    const HELD: usize,
    const SHIFTED: bool,
>(
    r: &Rows<X, T, W>,
    row: u32,
    part: PartialRow,
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
    let head = if SHIFTED { head_elements(x, cols) } else { 0 };
    // A shifted row that starts at a boundary is a packed row: gamma in packs where aligned.
    let packed_gamma = head == 0 && is_pack_aligned(r.gamma);
    let packs = if CHUNK == PACKS {
        (cols - head) / X::PACK as u32
    } else {
        0
    };
    // SAFETY: with HELD > 0 the row past its head is packed and fits (the caller's
    // guarantee), x + head and dy + head at a boundary.
    let (xs, dys) = unsafe {
        (
            Held::<HELD>::load::<X, S>(x.wrapping_add(head as usize), packs),
            Held::<HELD>::load_as::<X, T, S>(dy.wrapping_add(head as usize), packs),
        )
    };
    // The team's next row streams into L2 while this one is worked on (teams that gain
    // from it: see `Team::PREFETCH_NEXT_ROW`).
    let next = row + S::count();
    if S::PREFETCH_NEXT_ROW && next < r.rows {
        let at = next as usize * n as usize;
        // SAFETY: next < rows, so its `cols` columns lie inside x and dy.
        unsafe {
            prefetch::<X, S>(r.x.add(at), cols);
            prefetch::<T, S>(r.dy.add(at), cols);
        }
    }
    let centering = Centering::new(mean, rstd);
    // (xhat, gamma * dy, dy) of one chunk. Half packs go through L1, as the forward's do: each
    // pass reads the row again, and the next finds it there.
    let terms = |j: u32, len: usize, slot: Option<usize>| -> (Pack, Pack, Pack) {
        // SAFETY: the walks yield in-bounds chunks, of CHUNK's width only as it allows.
        let (xv, dyv, g) = unsafe {
            if CHUNK == HALF_PACKS {
                (
                    read_half_pack(x, j, len),
                    read_half_pack(dy, j, len),
                    r.gamma(j, len),
                )
            } else {
                (
                    values(&xs, x, j, len, slot),
                    values(&dys, dy, j, len, slot),
                    if SHIFTED && !packed_gamma {
                        r.gamma_shifted(j, len)
                    } else {
                        r.gamma(j, len)
                    },
                )
            }
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
    let mut add_sums = |len: usize, (xhat, wdy, _): (Pack, Pack, Pack)| {
        for k in 0..len {
            (s1, s2) = add_row_sums(s1, s2, xhat[k], wdy[k]);
        }
    };
    if batches::<S, CHUNK>() {
        batched::<X, S, _, CHUNK>(cols, |j, len| terms(j, len, None), |_, len, t| add_sums(len, t));
    } else {
        walk::<X, S, CHUNK, HELD, SHIFTED>(cols, head, |j, len, slot| add_sums(len, terms(j, len, slot)));
    }
    let (s1, s2) = S::sum2(s1, s2);
    let coefficients = DxCoefficients::new(s1, r.s2(s2), n);

    // The partials (dy * xhat, dy) into the team's row: in a pass of their own (pass 3),
    // which keeps fewer values live than adding them during pass 2 (no register spills at
    // 64 per thread) and, for held rows, costs no memory; or, for teams whose streamed rows
    // gain more from one read fewer (`Team::PARTIALS_WITH_DX`), during pass 2.
    let add_partials = |j: u32, len: usize, (xhat, _, dyv): (Pack, Pack, Pack)| {
        let mut dgamma = [0.0; MAX_PACK];
        for k in 0..len {
            dgamma[k] = dyv[k] * xhat[k];
        }
        // SAFETY: as above; the row is this team's alone.
        unsafe { part.add::<SHIFTED>(j, len, &dgamma, &dyv) };
    };
    let partials_with_dx = S::PARTIALS_WITH_DX && HELD == 0 && !batches::<S, CHUNK>();

    // Pass 2: dx (with dsum, where given), and the residual's copy of it where asked. A
    // batch loads dsum with the rest; a chunk at a time loads it after dx's arithmetic
    // (`write_dx` calls `ds` then), which keeps fewer values live (the owned warp kernel
    // spilled otherwise).
    let (dsum, dres) = (r.dsum_row(offset), r.dres_row(offset));
    // SAFETY: dsum holds the row as dx does, aligned where dx's packs are.
    let read_dsum = |j: u32, len: usize| dsum.map(|dsum| unsafe { read(dsum, j, len) });
    let write_dx = |j: u32, len: usize, (xhat, wdy): (Pack, Pack), ds: &dyn Fn() -> Option<Pack>| {
        let mut out = [0.0; MAX_PACK];
        for k in 0..len {
            out[k] = centering.dx(wdy[k], xhat[k], coefficients);
        }
        if let Some(ds) = ds() {
            for k in 0..len {
                out[k] += ds[k];
            }
        }
        // SAFETY: as above; dres holds the row as dsum does.
        unsafe {
            write(dx, j, len, &out);
            if let Some(dres) = dres {
                write(dres, j, len, &out);
            }
        }
    };
    if batches::<S, CHUNK>() {
        batched::<X, S, _, CHUNK>(
            cols,
            |j, len| {
                let (xhat, wdy, _) = terms(j, len, None);
                (xhat, wdy, read_dsum(j, len))
            },
            |j, len, (xhat, wdy, ds)| write_dx(j, len, (xhat, wdy), &|| ds),
        );
    } else if partials_with_dx {
        walk::<X, S, CHUNK, HELD, SHIFTED>(cols, head, |j, len, slot| {
            let (xhat, wdy, dyv) = terms(j, len, slot);
            write_dx(j, len, (xhat, wdy), &|| read_dsum(j, len));
            add_partials(j, len, (xhat, wdy, dyv));
        });
    } else {
        walk::<X, S, CHUNK, HELD, SHIFTED>(cols, head, |j, len, slot| {
            let (xhat, wdy, _) = terms(j, len, slot);
            write_dx(j, len, (xhat, wdy), &|| read_dsum(j, len))
        });
    }

    // Pass 3: the partials, where pass 2 did not add them.
    if batches::<S, CHUNK>() {
        batched::<X, S, _, CHUNK>(cols, |j, len| terms(j, len, None), &add_partials);
    } else if !partials_with_dx {
        walk::<X, S, CHUNK, HELD, SHIFTED>(cols, head, |j, len, slot| {
            add_partials(j, len, terms(j, len, slot))
        });
    }
}

/// This rank's chunks of a row of `cols` columns as [`backward_row`]'s `CHUNK`, `HELD` and
/// `SHIFTED` take them (`head`: the shifted row's, else 0), one at a time.
#[inline(always)]
fn walk<X: Element, S: Team, const CHUNK: usize, const HELD: usize, const SHIFTED: bool>(
    cols: u32,
    head: u32,
    f: impl FnMut(u32, usize, Option<usize>),
) {
    if SHIFTED {
        for_each_shifted_chunk::<X, S, HELD>(cols, head, f)
    } else {
        for_each_chunk::<X, S, CHUNK, HELD>(cols, f)
    }
}

/// Whether [`backward_row`]'s passes take a row's chunks in batches, every load of a batch
/// before its first store ([`for_each_chunk_batched`]): a block team's elements and half
/// packs. Warp teams, whose rows are short, keep one at a time (the owned warp kernel
/// spilled at 4 elements).
#[inline(always)]
const fn batches<S: Team, const CHUNK: usize>() -> bool {
    (CHUNK == ELEMENTS || CHUNK == HALF_PACKS) && S::HOLDS_PART_OF_LONG_ROWS
}

/// A pass of [`backward_row`] over the row's chunks in batches ([`batches`]):
/// [`BATCH_ELEMENTS`] elements or [`BATCH_HALF_PACKS`] half packs a rank at a time.
#[inline(always)]
fn batched<X: Element, S: Team, V: Copy + Default, const CHUNK: usize>(
    cols: u32,
    load: impl FnMut(u32, usize) -> V,
    f: impl FnMut(u32, usize, V),
) {
    if CHUNK == HALF_PACKS {
        for_each_chunk_batched::<X, S, V, CHUNK, BATCH_HALF_PACKS>(cols, load, f)
    } else {
        for_each_chunk_batched::<X, S, V, CHUNK, BATCH_ELEMENTS>(cols, load, f)
    }
}

/// [`backward_row`] with the row's access pattern picked: packed and held in registers
/// (where `HOLD`: kernels whose registers allow it), packed and streamed, in half packs
/// (every row pointer 8-byte aligned, x, dy and the weights of one size: f16 rows of N = 4
/// mod 8 every other row, f32 rows of even N), in packs from the first 16-byte boundary
/// (teams that [`Team::TAKES_SHIFTED_ROWS`], rows shifted off their boundaries: on the
/// packed rows' path, as a path of their own spilled the owned block kernel; after half
/// packs, which ran f32 N = 1030 5.5% faster), or element by element. Half packs beside
/// weights wider than x (f32 beside f16) spilled the general cluster kernels 8-16 bytes at
/// their 96 registers, even a half pack at a time. Teams that batch ([`batches`]) take half
/// packs only in launches of [`block_half_pack_rows`]; cluster teams, which do not batch,
/// take them wherever a row allows: the launch's test cost their 96 registers 4 bytes of
/// spill (LayerNorm's f16 and bf16 kernels).
///
/// # Safety
/// `row` < `r.rows`.
#[inline(always)]
pub(crate) unsafe fn backward_row_any<X: Element, T: Element, W: Element, S: Team, const HOLD: bool>(
    r: &Rows<X, T, W>,
    row: u32,
    part: PartialRow,
) {
    let offset = row as usize * r.n as usize;
    let packed = is_pack_aligned(r.x.wrapping_add(offset))
        && is_pack_aligned_as::<X, _>(r.dy.wrapping_add(offset))
        && is_pack_aligned_as::<X, _>(r.dx.wrapping_add(offset))
        && r.dsum_row(offset).is_none_or(is_pack_aligned)
        && r.dres_row(offset).is_none_or(|d| is_pack_aligned(d.cast_const()))
        && is_pack_aligned(r.gamma);
    // Every row pointer the same bytes past a 16-byte boundary (x, dy and dx of one size, so
    // an element's offset is the same in each): the row in packs after its head.
    let shifted = || {
        let x = r.x.wrapping_add(offset) as usize % 16;
        let same = |p: usize| p % 16 == x;
        size_of::<X>() == size_of::<T>()
            && same(r.dy.wrapping_add(offset) as usize)
            && same(r.dx.wrapping_add(offset) as usize)
            && r.dsum_row(offset).is_none_or(|d| same(d as usize))
    };
    let halves = || {
        let rows = [
            r.x.wrapping_add(offset) as usize,
            r.dy.wrapping_add(offset) as usize,
            r.dx.wrapping_add(offset) as usize,
        ];
        let dsum = r.dsum_row(offset).map_or(rows[0], |d| d as usize);
        size_of::<X>() == size_of::<T>()
            && size_of::<X>() == size_of::<W>()
            && (!batches::<S, HALF_PACKS>() || block_half_pack_rows(r.n, size_of::<X>() as u32))
            && chunk_of::<X, W>(&[rows[0], rows[1], rows[2], dsum], &[r.gamma as usize]) != ELEMENTS
    };
    // SAFETY: row < rows; `packed` and `halves` were checked for every pointer the packed
    // and half-pack paths read (dres is never given where x and dy are of one size).
    unsafe {
        if HOLD && packed && fits::<X, S, BWD_HELD>(r.cols) {
            backward_row::<X, T, W, S, PACKS, BWD_HELD, false>(r, row, part)
        } else if packed || (S::TAKES_SHIFTED_ROWS && !halves() && shifted()) {
            // Other teams' packed rows keep the plain path (no head, partials a pack at once).
            if S::TAKES_SHIFTED_ROWS {
                backward_row::<X, T, W, S, PACKS, 0, true>(r, row, part)
            } else {
                backward_row::<X, T, W, S, PACKS, 0, false>(r, row, part)
            }
        } else if halves() {
            backward_row::<X, T, W, S, HALF_PACKS, 0, false>(r, row, part)
        } else {
            backward_row::<X, T, W, S, ELEMENTS, 0, false>(r, row, part)
        }
    }
}

/// The partials in shared memory: each team sums its rows' partials in its own
/// shared-memory row (after `scratch` bytes), then the block adds its teams' rows, in team
/// order, and hands their sums (columns 0..r.cols) over to `out`.
///
/// # Safety
/// `r`'s buffers sized as documented; `out` as [`Destination::hand_over`] requires, for
/// `r.cols` columns; the launch gave each block `scratch + per_block * 8 *
/// (padded_len(cols) + 1)` bytes of shared memory.
#[inline(always)]
pub(crate) unsafe fn owned_in_shared<X: Element, T: Element, W: Element, S: Team, const HOLD: bool>(
    r: &Rows<X, T, W>,
    scratch: u32,
    out: Destination,
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
        unsafe { backward_row_any::<X, T, W, S, HOLD>(r, row, mine) };
        // The next row may map a column to another rank (packed vs unpacked rows); the
        // barrier orders this row's partial writes before the next row's reads.
        S::sync();
        row += S::count();
    }
    // Every team of the block is done: add their rows, in team order, and hand them over.
    device::sync_block();
    // SAFETY: the caller's guarantee; each thread merges its own columns.
    unsafe {
        out.hand_over(|dst| {
            let mut j = device::thread_idx();
            while j < r.cols {
                let (mut g, mut b) = ([0.0; MAX_PACK], [0.0; MAX_PACK]);
                for t in 0..S::per_block() {
                    // Team t's rows exist (launch guarantee) and all teams wrote theirs
                    // before the barrier.
                    let p = PartialRow::shared(scratch, t, r.cols);
                    g[0] += p.dgamma.add(padded(j)).read();
                    b[0] += p.dbeta.add(padded(j)).read();
                }
                // j < cols, this thread's column.
                dst.merge(j, 1, &g, &b);
                j += device::block_dim();
            }
        })
    }
}

/// Stage 1, owned mode: team u handles rows u, u + U, ... (U = teams), and block b hands
/// its sums over to `out` (unit b). With `local`, each team sums into its own shared-memory
/// row, and the block adds its teams' rows (in team order) at the end; without it (block
/// teams whose rows do not fit in shared memory), the team adds straight into the block's
/// own row of global memory ([`Destination::own_row`]).
///
/// # Safety
/// `r`'s buffers sized as documented; `out` as [`Destination`] says for unit `blockIdx`,
/// with the block's own row where `local` is false; with `local`, the launch gave each block
/// `SCRATCH_BYTES + teams_per_block * 8 * (padded_len(n) + 1)` bytes of shared memory.
/// Warp teams require `local`.
#[inline(always)]
pub(crate) unsafe fn stage1_owned<X: Element, T: Element, W: Element, S: Team, const HOLD: bool>(
    r: Rows<X, T, W>,
    out: Destination,
    local: bool,
) {
    if local {
        // SAFETY: the launch sized shared memory for every team of the block.
        unsafe { owned_in_shared::<X, T, W, S, HOLD>(&r, SCRATCH_BYTES, out) };
        return;
    }
    // Only block teams come here (one team per block), so the block's row is this team's.
    let block = device::block_idx();
    if block >= r.rows {
        // More blocks than rows: the block's row gets no contribution, so it holds zeros.
        // SAFETY: the block's own row exists (the caller's guarantee).
        let part = unsafe { out.own_row(false) };
        let mut q = S::rank() as usize;
        while q < r.n as usize {
            // SAFETY: q < n.
            unsafe { (part.dgamma.add(q).write(0.0), part.dbeta.add(q).write(0.0)) };
            q += S::size() as usize;
        }
    }
    let mut row = block;
    while row < r.rows {
        // SAFETY: as above; the first row overwrites, later rows add.
        let part = unsafe { out.own_row(row != block) };
        // SAFETY: row < rows.
        unsafe { backward_row_any::<X, T, W, S, HOLD>(&r, row, part) };
        S::sync();
        row += S::count();
    }
    if out.own_row_is_final() {
        return;
    }
    // Locked mode: the block's row, complete after the barrier, goes into its group.
    device::sync_block();
    // SAFETY: the block's own row exists; each thread merges its own columns.
    unsafe {
        let own = out.own_row(true);
        out.hand_over(|dst| {
            let mut j = device::thread_idx();
            while j < r.n {
                let (g, b) = (
                    own.load(own.dgamma.add(j as usize), 1, false),
                    own.load(own.dbeta.add(j as usize), 1, false),
                );
                dst.merge(j, 1, &g, &b);
                j += device::block_dim();
            }
        })
    }
}
