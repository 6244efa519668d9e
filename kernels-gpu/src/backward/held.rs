//! Stage 1 for launches whose rows are all whole aligned packs held in registers: partials
//! kept per rank in shared memory, no barrier between rows, two rows in flight per team.

use super::partials::Destination;
use super::{Centering, DxCoefficients, Rows, add_row_sums};
use crate::device::{self, fma};
use crate::element::{Element, MAX_PACK, Pack, read, write};
use crate::row::{BWD_HELD, Held, PACKS, for_each_chunk, prefetch};
use crate::team::Team;

/// One rank's partial dgamma and dbeta over the rows its team handled, for the columns of
/// its held packs, in shared memory laid out by rank: the rank's `chunks` 16-byte chunks
/// (4 columns each; chunk q covers elements 4 * (q % (PACK / 4)).. of its slot q / (PACK /
/// 4)) sit `size * 16` bytes apart, so the 32 lanes of a warp touch 512 contiguous bytes in
/// each access: one 16-byte access per 4 columns and no bank conflicts, where the
/// column-ordered rows of the general path take one access per column. dbeta's chunks
/// follow all of dgamma's.
#[derive(Clone, Copy)]
pub(crate) struct RankPartials {
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
    pub(crate) const fn chunks<T: Element>() -> u32 {
        crate::layout::held_chunks(T::PACK as u32)
    }

    /// Shared bytes of one team of `size` ranks: dgamma and dbeta chunks of every rank.
    #[inline(always)]
    pub(crate) fn team_bytes<T: Element>(size: u32) -> u32 {
        crate::layout::held_team_bytes(T::PACK as u32, size)
    }

    /// Rank `rank`'s partials in the team whose area starts at byte `base` of shared memory.
    #[inline(always)]
    pub(crate) fn of<T: Element>(base: u32, size: u32, rank: u32) -> Self {
        let dgamma = device::shared_addr(base + rank * 16);
        RankPartials {
            dgamma,
            dbeta: dgamma + Self::chunks::<T>() * size * 16,
            stride: size * 16,
        }
    }

    /// Sets to zero the chunks of the held slots of rank `rank` (of `size`) that rows of
    /// `packs` packs fill (slot c holds pack rank + c * size): those its block hands over.
    /// A launch of few rows holds a pack a rank, one slot of `BWD_HELD`, and the stores of
    /// the others would lengthen every rank's one row.
    ///
    /// # Safety
    /// The launch gave the team's area (see [`stage1_held`]).
    #[inline(always)]
    pub(crate) unsafe fn zero<T: Element>(self, rank: u32, size: u32, packs: u32) {
        for q in 0..Self::chunks::<T>() {
            if rank + q / (T::PACK as u32 / 4) * size < packs {
                // SAFETY: chunk q of this rank lies inside the team's area.
                unsafe {
                    device::store_shared_16(self.dgamma + q * self.stride, [0; 4]);
                    device::store_shared_16(self.dbeta + q * self.stride, [0; 4]);
                }
            }
        }
    }

    /// dgamma += xhat * dy and dbeta += dy for the columns of held slot `c`.
    ///
    /// # Safety
    /// As for [`RankPartials::zero`]; `c < BWD_HELD`.
    #[inline(always)]
    pub(crate) unsafe fn add<T: Element>(self, c: usize, xhat: &Pack, dy: &Pack) {
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
    pub(crate) unsafe fn chunk(self, q: u32) -> ([u32; 4], [u32; 4]) {
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
pub(crate) struct HeldRow {
    xs: Held<BWD_HELD>,
    dys: Held<BWD_HELD>,
    mean: f32,
    rstd: f32,
}

/// Issues the loads of row `row`'s x, dy, mean and rstd (none where `row` is past the last
/// row, the pipeline's end: the values then stay zero and are never used). RMSNorm's
/// mean is 0 (its forward wrote 0s), a constant rather than a load and a register. mean
/// and rstd travel with the row: loaded when the row is used, each would cost its own DRAM round
/// trip before the row's first sum. The row's dsum, where given, is prefetched into L2:
/// held in registers too, it would spill the half-type kernels, and pass 2 then reads each
/// pack from L2 rather than from DRAM.
///
/// # Safety
/// Every row pointer 16-byte aligned, `r.n` and `r.cols` whole numbers of packs, `r.cols`
/// packs that [`fits`].
#[inline(always)]
pub(crate) unsafe fn load_held_row<X: Element, T: Element, W, S: Team>(
    r: &Rows<X, T, W>,
    row: u32,
) -> HeldRow {
    let offset = row as usize * r.n as usize;
    let inside = row < r.rows;
    let packs = if inside { r.cols / X::PACK as u32 } else { 0 };
    // SAFETY: with row < rows the row lies inside x and dy, aligned whole packs that fit
    // (the caller's guarantee), and inside mean and rstd; past the last row nothing is read.
    unsafe {
        if let Some(dsum) = r.dsum_row(offset)
            && inside
        {
            prefetch::<X, S>(dsum, r.cols);
        }
        HeldRow {
            xs: Held::load::<X, S>(r.x.wrapping_add(offset), packs),
            dys: Held::load_as::<X, T, S>(r.dy.wrapping_add(offset), packs),
            mean: if inside && r.centered {
                *r.mean.add(row as usize)
            } else {
                0.0
            },
            rstd: if inside { *r.rstd.add(row as usize) } else { 0.0 },
        }
    }
}

/// dx for one row of a launch whose rows are all whole packs held in registers, and the
/// row's partials into the rank's own [`RankPartials`]. Two passes over registers:
///   pass 1:  xhat_j, wdy_j = w_j * dy_j       (kept in f32 for pass 2)
///            s1 = sum_j xhat_j * wdy_j,  s2 = sum_j wdy_j   (c1 = s1 / n, c2 = s2 / n)
///            dgamma_j += xhat_j * dy_j,  dbeta_j += dy_j
///   pass 2:  dx_j = rstd * ((wdy_j - c2) - xhat_j * c1)
/// Pass 1 widens x, dy and the weights once, and the partials need nothing of the row's
/// sums, so pass 2 is three floating-point operations an element and a store: in 16-bit
/// types, where a byte holds twice the elements, the instructions an element rather than
/// the bytes set this kernel's pace (docs/PERF.md, v45). The kept terms take the registers
/// the held x and dy free (16-bit: 64 f32 where they took 32 words). `TIGHT` kernels (the
/// cluster's, whose row exchange holds registers of its own) keep xhat only in 16-bit
/// types, and form wdy again from dy's held words and the weights: the kept wdy spilled
/// them. Between the passes, before the row's reduction, the loads of the team's next row
/// go out (`next`): they arrive while this row is reduced and written, so each block keeps
/// two rows in flight and DRAM does not idle while the block works on registers. Returns
/// the next row's registers.
///
/// # Safety
/// `row` < `r.rows`; every row pointer (dsum's too, where given) and gamma 16-byte aligned,
/// `r.n` and `r.cols` whole numbers of packs, `r.cols` packs that [`fits`] `BWD_HELD` per
/// rank; the [`HeldRow`] is
/// row `row`'s; `acc` as [`RankPartials::zero`] requires.
#[inline(always)]
pub(crate) unsafe fn backward_row_held<X: Element, T: Element, W: Element, S: Team, const TIGHT: bool>(
    r: &Rows<X, T, W>,
    row: u32,
    HeldRow { xs, dys, mean, rstd }: HeldRow,
    next: u32,
    acc: RankPartials,
) -> HeldRow {
    let offset = row as usize * r.n as usize;
    // SAFETY: row < rows, so this row lies inside dx.
    let dx = unsafe { r.dx.add(offset) };
    let centering = Centering::new(mean, rstd);
    // f32 rows hold 16 values a rank: their kept terms take the registers x and dy took.
    let keep_wdy = !TIGHT || X::PACK * BWD_HELD <= 16;
    // wdy_j of a held slot, from dy's held words and the weights.
    let wdy = |j: u32, c: usize| -> Pack {
        let dyv = dys.pack::<T>(c);
        // SAFETY: j is a pack of the row, aligned (the caller's guarantee).
        let g = unsafe { r.gamma(j, X::PACK) };
        core::array::from_fn(|k| g[k] * dyv[k])
    };

    // Pass 1. Rows of whole packs have no element-wise tail, so every chunk for_each_chunk
    // yields is a held slot (c a constant in each copy: the kept terms stay registers).
    let (mut xhats, mut wdys) = ([[0.0f32; MAX_PACK]; BWD_HELD], [[0.0f32; MAX_PACK]; BWD_HELD]);
    let (mut s1, mut s2) = (0.0f32, 0.0f32);
    for_each_chunk::<X, S, PACKS, BWD_HELD>(r.cols, |j, _, slot| {
        let c = slot.unwrap_or(0);
        let (xv, dyv) = (xs.pack::<X>(c), dys.pack::<T>(c));
        // SAFETY: j is a pack of the row, aligned (the caller's guarantee).
        let g = unsafe { r.gamma(j, X::PACK) };
        for k in 0..X::PACK {
            let (xhat, wdy) = (centering.xhat(xv[k]), g[k] * dyv[k]);
            (s1, s2) = add_row_sums(s1, s2, xhat, wdy);
            xhats[c][k] = xhat;
            if keep_wdy {
                wdys[c][k] = wdy;
            }
        }
        // SAFETY: c < BWD_HELD; the rank's partials are its own.
        unsafe { acc.add::<X>(c, &xhats[c], &dyv) };
    });
    // SAFETY: as this function requires of every row.
    let upcoming = unsafe { load_held_row::<X, T, W, S>(r, next) };
    let (s1, s2) = S::sum2(s1, s2);
    let coefficients = DxCoefficients::new(s1, r.s2(s2), r.n);

    // Pass 2.
    let (dsum, dres) = (r.dsum_row(offset), r.dres_row(offset));
    for_each_chunk::<X, S, PACKS, BWD_HELD>(r.cols, |j, _, slot| {
        let c = slot.unwrap_or(0);
        let wdyv = if keep_wdy { wdys[c] } else { wdy(j, c) };
        let mut out = [0.0; MAX_PACK];
        for k in 0..X::PACK {
            out[k] = centering.dx(wdyv[k], xhats[c][k], coefficients);
        }
        if let Some(dsum) = dsum {
            // From L2, where `load_held_row` prefetched it.
            // SAFETY: dsum's rows are aligned whole packs as dx's are (the caller's guarantee).
            let ds = unsafe { read(dsum, j, X::PACK) };
            for k in 0..X::PACK {
                out[k] += ds[k];
            }
        }
        // SAFETY: as above.
        unsafe {
            write(dx, j, X::PACK, &out);
            if let Some(dres) = dres {
                write(dres, j, X::PACK, &out);
            }
        }
    });
    upcoming
}

/// Stage 1 for launches whose rows are all whole aligned packs that fit in registers (the
/// host checks): team u handles rows u, u + U, ... and each rank adds its columns' partials
/// into its own [`RankPartials`]; at the end the block sums its teams' (in team order) and
/// hands them over to `out` for its `r.cols` columns. No barrier between rows: a rank's
/// partials are its own. `TIGHT` as [`backward_row_held`] takes it.
///
/// # Safety
/// As [`backward_row_held`] requires of every row; `out` as [`Destination::hand_over`]
/// requires, for `r.cols` columns; the launch gave each block `scratch + teams_per_block *
/// 8 * BWD_HELD * PACK * size` bytes of shared memory (`size` ranks per team), the first
/// `scratch` for the team's reductions.
#[inline(always)]
pub(crate) unsafe fn stage1_held<X: Element, T: Element, W: Element, S: Team, const TIGHT: bool>(
    r: Rows<X, T, W>,
    out: Destination,
    scratch: u32,
) {
    let team_bytes = RankPartials::team_bytes::<X>(S::size());
    let team = |t: u32, rank: u32| RankPartials::of::<X>(scratch + t * team_bytes, S::size(), rank);
    let mine = team(S::index_in_block(), S::rank());
    // SAFETY: the launch sized shared memory for every team of the block.
    unsafe { mine.zero::<X>(S::rank(), S::size(), r.cols / X::PACK as u32) };
    let mut row = S::id();
    // SAFETY: the launch's rows are held packs (the caller's guarantee); past the last row
    // nothing is loaded.
    let mut held = unsafe { load_held_row::<X, T, W, S>(&r, row) };
    while row < r.rows {
        let next = row + S::count();
        // SAFETY: as above, and row < rows.
        held = unsafe { backward_row_held::<X, T, W, S, TIGHT>(&r, row, held, next, mine) };
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
    // the pack it covers, where rank k's slot holds a pack of the rows (p < packs). The
    // chunks go in slot order, so the first past the rows' packs ends the walk: a launch of
    // few rows fills one slot of `BWD_HELD`.
    let (packs, per_pack) = (r.cols / X::PACK as u32, X::PACK as u32 / 4);
    let size = S::size();
    // Every thread of the block takes chunks, whichever team it belongs to (block teams
    // stack along y).
    let threads = device::block_dim() * device::block_dim_y();
    let first = device::thread_idx_y() * device::block_dim() + device::thread_idx();
    // SAFETY: the caller's guarantee; each thread merges its own chunks' columns.
    unsafe {
        out.hand_over(|dst| {
            let mut i = first;
            while i < RankPartials::chunks::<X>() * size {
                let (rank, q) = (i % size, i / size);
                let slot_start = q / per_pack * size;
                if slot_start >= packs {
                    break;
                }
                let p = rank + slot_start;
                if p < packs {
                    let (mut g, mut b) = ([0.0f32; MAX_PACK], [0.0f32; MAX_PACK]);
                    for t in 0..S::per_block() {
                        // q < chunks, inside team t's area, written before the barrier.
                        let (tg, tb) = team(t, rank).chunk(q);
                        for k in 0..4 {
                            g[k] += f32::from_bits(tg[k]);
                            b[k] += f32::from_bits(tb[k]);
                        }
                    }
                    // Columns inside the block's `cols` (p < packs); n and the slice start
                    // are whole numbers of packs, so the column is 16-byte aligned.
                    dst.merge(p * X::PACK as u32 + 4 * (q % per_pack), 4, &g, &b);
                }
                i += threads;
            }
        })
    }
}
