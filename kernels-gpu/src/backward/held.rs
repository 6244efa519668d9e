//! Stage 1 for launches whose rows are all whole aligned packs held in registers (or, for
//! 16-bit rows 8-byte aligned, half packs; or rows shifted off their 16-byte boundaries,
//! their packs from the first): partials kept per rank in shared memory, no barrier
//! between rows, two rows in flight per team.

use super::partials::Destination;
use super::{Centering, DxCoefficients, Rows, add_row_sums};
use crate::device::{self, fma};
use crate::element::{Element, MAX_PACK, Pack, read, read_cached, write};
use crate::row::{BWD_HELD, Held, PACKS, each_slot, for_each_chunk, head_elements, prefetch};
use crate::team::{SCRATCH_BYTES, Team};

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
    /// `units` packs fill (slot c holds pack rank + c * size), or with `HALVES` `units` half
    /// packs (chunk q is half pack rank + q * size): those its block hands over. A launch
    /// of few rows holds a pack a rank, one slot of `BWD_HELD`, and the stores of the
    /// others would lengthen every rank's one row.
    ///
    /// # Safety
    /// The launch gave the team's area (see [`stage1_held`]).
    #[inline(always)]
    pub(crate) unsafe fn zero<T: Element, const HALVES: bool>(self, rank: u32, size: u32, units: u32) {
        for q in 0..Self::chunks::<T>() {
            if rank + held_unit::<T, HALVES>(q) * size < units {
                // SAFETY: chunk q of this rank lies inside the team's area.
                unsafe {
                    device::store_shared_16(self.dgamma + q * self.stride, [0; 4]);
                    device::store_shared_16(self.dbeta + q * self.stride, [0; 4]);
                }
            }
        }
    }

    /// dgamma += xhat * dy and dbeta += dy for the columns of held slot `c`'s values
    /// `first..first + len` (the whole slot, or one half pack of it).
    ///
    /// # Safety
    /// As for [`RankPartials::zero`]; `c < BWD_HELD`, `first` and `len` multiples of 4 inside
    /// the slot.
    #[inline(always)]
    pub(crate) unsafe fn add<T: Element>(self, c: usize, first: usize, len: usize, xhat: &Pack, dy: &Pack) {
        for h in first / 4..(first + len) / 4 {
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

/// Which of a rank's units (packs, or with `HALVES` half packs: rank + k * size is its
/// k-th) chunk q of [`RankPartials`] covers columns of.
#[inline(always)]
const fn held_unit<T: Element, const HALVES: bool>(q: u32) -> u32 {
    if HALVES { q } else { q / (T::PACK as u32 / 4) }
}

/// Columns in one unit of a held row: a pack's, or four (a 16-bit half pack's).
#[inline(always)]
const fn unit_len<T: Element, const HALVES: bool>() -> u32 {
    if HALVES { 4 } else { T::PACK as u32 }
}

/// Where a row's held packs lie. A shifted row (x, dy and dx of one size, every row pointer
/// as far past a 16-byte boundary as x's: f16 rows of odd N, f32 rows of N not a multiple
/// of 4) has `head` columns before x's first boundary, then `packs` whole packs, held as a
/// packed row's are from column `head`, then a tail of fewer than a pack. The head's and
/// the tail's columns, the row's edges, go one a rank: rank k < head takes column k, the
/// next ranks the tail's in order (a team has 64 ranks or more, the edges 14 at most).
#[derive(Clone, Copy)]
struct Shift {
    head: u32,
    packs: u32,
}

impl Shift {
    /// The packs of a row at `row` of `cols` columns: from its first 16-byte boundary where
    /// `SHIFTED`, else (a packed row) from its start.
    #[inline(always)]
    fn of<X: Element, const SHIFTED: bool>(row: *const X, cols: u32) -> Self {
        let head = if SHIFTED { head_elements(row, cols) } else { 0 };
        Shift {
            head,
            packs: (cols - head) / X::PACK as u32,
        }
    }

    /// Columns before the packs and after them: the ranks below this hold an edge each.
    #[inline(always)]
    fn edges<X: Element>(self, cols: u32) -> u32 {
        cols - self.packs * X::PACK as u32
    }

    /// The edge column of rank `rank`, if it holds one.
    #[inline(always)]
    fn edge<X: Element>(self, rank: u32, cols: u32) -> Option<u32> {
        let column = if rank < self.head {
            rank
        } else {
            self.packs * X::PACK as u32 + rank
        };
        (rank < self.edges::<X>(cols)).then_some(column)
    }
}

/// Shared memory of the held block kernel over shifted rows, past the ranks' partials
/// (`layout::held_shifted_smem`): the weights of the block's packed columns, staged (pack q
/// of them is column head + q * PACK's: every row of the block has the same head), then a
/// 16-byte slot a rank for its edge column: dgamma, dbeta, and the row's xhat and wdy kept
/// for its dx pass. Addresses made where used, from the block's shape (kept across the
/// row loop, they cost registers the rows need).
struct ShiftedShared;

impl ShiftedShared {
    /// The staged weights' first pack.
    #[inline(always)]
    fn weights<X: Element, S: Team>() -> u32 {
        device::shared_addr(SCRATCH_BYTES + S::per_block() * RankPartials::team_bytes::<X>(S::size()))
    }

    /// The edge slot of rank `rank` of the block's team `team`, over rows of `cols`.
    #[inline(always)]
    fn edge<X: Element, W, S: Team>(cols: u32, team: u32, rank: u32) -> u32 {
        let threads = S::per_block() * S::size();
        let at = crate::layout::held_shifted_edges_at(X::PACK as u32, threads, cols, size_of::<W>() as u32);
        device::shared_addr(at as u32 + 16 * (team * S::size() + rank))
    }

    /// dgamma += xhat * dy and dbeta += dy for the edge column of the slot at `at`, and
    /// its xhat and wdy kept beside them for the row's dx pass.
    ///
    /// # Safety
    /// `at` is this rank's slot, its sums set to zero before its first row.
    #[inline(always)]
    unsafe fn add_edge(at: u32, xhat: f32, dy: f32, wdy: f32) {
        // SAFETY: the caller's guarantee; the slot is this rank's alone.
        unsafe {
            let [g, b, _, _] = device::load_shared_16(at);
            let g = fma(xhat, dy, f32::from_bits(g)).to_bits();
            let b = (f32::from_bits(b) + dy).to_bits();
            device::store_shared_16(at, [g, b, xhat.to_bits(), wdy.to_bits()]);
        }
    }

    /// The edge column's xhat and wdy that [`ShiftedShared::add_edge`] kept at `at`.
    ///
    /// # Safety
    /// As for [`ShiftedShared::add_edge`], after it, in this row.
    #[inline(always)]
    unsafe fn edge_terms(at: u32) -> (f32, f32) {
        // SAFETY: the caller's guarantee.
        let [_, _, xhat, wdy] = unsafe { device::load_shared_16(at) };
        (f32::from_bits(xhat), f32::from_bits(wdy))
    }
}

/// Calls `f(j, c, first, len)` for each unit of a held row this rank holds: its first
/// column j, its slot c, and its values `first..first + len` in the slot. Packs: one a
/// slot, the slot's all (rows of whole packs have no element-wise tail, so every chunk
/// `for_each_chunk` yields is a held slot). `HALVES`: two a slot, half pack rank +
/// (2c + h) * size in values 4h..4h + 4. c, first and len are constants in each copy
/// (the halves written out, as [`each_slot`] writes out the slots: a loop over them left
/// the first value's index to run time, and the kept terms in local memory), so the kept
/// terms stay registers.
#[inline(always)]
fn for_each_held_unit<X: Element, S: Team, const HALVES: bool>(
    cols: u32,
    mut f: impl FnMut(u32, usize, usize, usize),
) {
    if HALVES {
        let halves = cols / 4;
        each_slot::<BWD_HELD>(|c| {
            let mut half = |h: usize| {
                let q = S::rank() + (2 * c + h) as u32 * S::size();
                if q < halves {
                    f(4 * q, c, 4 * h, 4)
                }
            };
            half(0);
            half(1);
        });
    } else {
        for_each_chunk::<X, S, PACKS, BWD_HELD>(cols, |j, _, slot| f(j, slot.unwrap_or(0), 0, X::PACK));
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
/// packs that [`fits`]; with `HALVES`, x and dy of one 16-bit type, every row pointer
/// 8-byte aligned, `r.n` and `r.cols` multiples of 4, and `r.cols / 4` half packs that
/// fit `2 * BWD_HELD` a rank; with `SHIFTED` ([`Shift`]), x and dy of one size, every row
/// of dy as far past a 16-byte boundary as x's, no dsum, and the packs fit.
#[inline(always)]
pub(crate) unsafe fn load_held_row<
    X: Element,
    T: Element,
    W,
    S: Team,
    const HALVES: bool,
    const SHIFTED: bool,
>(
    r: &Rows<X, T, W>,
    row: u32,
) -> HeldRow {
    let offset = row as usize * r.n as usize;
    let inside = row < r.rows;
    let shift = || Shift::of::<X, SHIFTED>(r.x.wrapping_add(offset), r.cols);
    let units = if !inside {
        0
    } else if SHIFTED {
        shift().packs
    } else {
        r.cols / unit_len::<X, HALVES>()
    };
    // SAFETY: with row < rows the row lies inside x and dy, aligned whole packs that fit
    // (the caller's guarantee), and inside mean and rstd; past the last row nothing is read.
    unsafe {
        if let Some(dsum) = r.dsum_row(offset)
            && inside
        {
            prefetch::<X, S>(dsum, r.cols);
        }
        let (x, dy) = if SHIFTED {
            let shift = shift();
            let (x, dy) = (r.x.wrapping_add(offset), r.dy.wrapping_add(offset));
            // The row's edge column goes to L2 now and is read in the row's first pass:
            // held in registers across the previous row, its two values spilled the kernel.
            if inside && let Some(e) = shift.edge::<X>(S::rank(), r.cols) {
                device::prefetch_l2(x.add(e as usize) as *const u8);
                device::prefetch_l2(dy.add(e as usize) as *const u8);
            }
            (
                x.wrapping_add(shift.head as usize),
                dy.wrapping_add(shift.head as usize),
            )
        } else {
            (r.x.wrapping_add(offset), r.dy.wrapping_add(offset))
        };
        HeldRow {
            xs: if HALVES {
                Held::load_halves::<X, S>(x, units)
            } else {
                Held::load::<X, S>(x, units)
            },
            dys: if HALVES {
                Held::load_halves::<T, S>(dy, units)
            } else {
                Held::load_as::<X, T, S>(dy, units)
            },
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
/// cluster's, whose row exchange holds registers of its own, and the shifted rows', whose
/// geometry does) keep xhat only in 16-bit types, and form wdy again from dy's held words
/// and the weights: the kept wdy spilled them. Between the passes, before the row's reduction, the loads of the team's next row
/// go out (`next`): they arrive while this row is reduced and written, so each block keeps
/// two rows in flight and DRAM does not idle while the block works on registers. Returns
/// the next row's registers. `HALVES`: the rows in half packs ([`Held::load_halves`]), each
/// read, weighted and written 8 bytes at a time. `SHIFTED`: the row's packs from x's first
/// 16-byte boundary ([`Shift`]), their weights staged, and the rank's edge column with
/// them, its partials beside them ([`ShiftedShared`]).
///
/// # Safety
/// `row` < `r.rows`; every row pointer (dsum's too, where given) and gamma 16-byte aligned,
/// `r.n` and `r.cols` whole numbers of packs, `r.cols` packs that [`fits`] `BWD_HELD` per
/// rank, or with `HALVES` as [`load_held_row`] requires and gamma 8-byte aligned, or with
/// `SHIFTED` as [`load_held_row`] requires, dx as far past a boundary as x, and shared memory
/// staged as [`stage1_held`] stages it; the [`HeldRow`] is row `row`'s; `acc` as
/// [`RankPartials::zero`] requires.
#[inline(always)]
pub(crate) unsafe fn backward_row_held<
    X: Element,
    T: Element,
    W: Element,
    S: Team,
    const TIGHT: bool,
    const HALVES: bool,
    const SHIFTED: bool,
>(
    r: &Rows<X, T, W>,
    row: u32,
    HeldRow { xs, dys, mean, rstd }: HeldRow,
    next: u32,
    acc: RankPartials,
) -> HeldRow {
    let offset = row as usize * r.n as usize;
    // SAFETY: row < rows, so this row lies inside dx.
    let dx = unsafe { r.dx.add(offset) };
    // The held units' columns count from the packs' first: a shifted row's head. Its head,
    // its packs' columns and the rank's edge are made in each pass from the row (`opaque`:
    // kept across the row's reduction, they spilled the 16-bit kernels).
    let geometry = |row: u32| {
        let shift = Shift::of::<X, SHIFTED>(r.x.wrapping_add(row as usize * r.n as usize), r.cols);
        if SHIFTED {
            (
                shift.head,
                shift.packs * X::PACK as u32,
                shift.edge::<X>(S::rank(), r.cols),
            )
        } else {
            (0, r.cols, None)
        }
    };
    let (head, cols, edge) = geometry(row);
    // The weights of a held unit: gamma's own, or a shifted row's staged.
    let weights = |j: u32, len: usize| -> Pack {
        if SHIFTED {
            // SAFETY: j is a pack of the row's packs, whose weights the block staged.
            unsafe { r.gamma_staged(ShiftedShared::weights::<X, S>(), j) }
        } else {
            // SAFETY: j is a unit of the row, aligned to its bytes (the caller's guarantee).
            unsafe { r.gamma(j, len) }
        }
    };
    let centering = Centering::new(mean, rstd);
    // f32 rows hold 16 values a rank: their kept terms take the registers x and dy took.
    let keep_wdy = !TIGHT || X::PACK * BWD_HELD <= 16;
    // wdy_j of a held unit (slot c's values first..first + len, from column j), from dy's
    // held words and the weights, at the unit's places in the slot.
    let wdy = |j: u32, c: usize, first: usize, len: usize| -> Pack {
        let dyv = dys.pack::<T>(c);
        let g = weights(j, len);
        core::array::from_fn(|k| {
            if (first..first + len).contains(&k) {
                g[k - first] * dyv[k]
            } else {
                0.0
            }
        })
    };

    // Pass 1. A shifted row's edge column first: its loads (from L2, where the row's load
    // sent it) then wait while the packs' terms are made.
    let edge_slot = || ShiftedShared::edge::<X, W, S>(r.cols, S::index_in_block(), S::rank());
    let (mut s1, mut s2) = (0.0f32, 0.0f32);
    if let Some(e) = edge {
        // SAFETY: column e is inside the row (and gamma).
        let (xe, dye, g) = unsafe {
            (
                read(r.x.add(offset), e, 1)[0],
                read(r.dy.add(offset), e, 1)[0],
                r.gamma(e, 1)[0],
            )
        };
        let (xhat, wdy) = (centering.xhat(xe), g * dye);
        (s1, s2) = add_row_sums(s1, s2, xhat, wdy);
        // SAFETY: the rank's edge slot, zeroed by `stage1_held`.
        unsafe { ShiftedShared::add_edge(edge_slot(), xhat, dye, wdy) };
    }
    let (mut xhats, mut wdys) = ([[0.0f32; MAX_PACK]; BWD_HELD], [[0.0f32; MAX_PACK]; BWD_HELD]);
    for_each_held_unit::<X, S, HALVES>(cols, |j, c, first, len| {
        let (xv, dyv) = (xs.pack::<X>(c), dys.pack::<T>(c));
        let g = weights(j, len);
        for (k, &g) in g[..len].iter().enumerate() {
            let i = first + k;
            let (xhat, wdy) = (centering.xhat(xv[i]), g * dyv[i]);
            (s1, s2) = add_row_sums(s1, s2, xhat, wdy);
            xhats[c][i] = xhat;
            if keep_wdy {
                wdys[c][i] = wdy;
            }
        }
        // SAFETY: c < BWD_HELD; the rank's partials are its own.
        unsafe { acc.add::<X>(c, first, len, &xhats[c], &dyv) };
    });
    // SAFETY: as this function requires of every row.
    let upcoming = unsafe { load_held_row::<X, T, W, S, HALVES, SHIFTED>(r, next) };
    let (s1, s2) = S::sum2(s1, s2);
    let coefficients = DxCoefficients::new(s1, r.s2(s2), r.n);

    // Pass 2.
    let (head, cols, edge) = if SHIFTED {
        geometry(device::opaque(row))
    } else {
        (head, cols, edge)
    };
    // Shifted rows are planned without either (the host's guarantee).
    let (dsum, dres) = if SHIFTED {
        (None, None)
    } else {
        (r.dsum_row(offset), r.dres_row(offset))
    };
    for_each_held_unit::<X, S, HALVES>(cols, |j, c, first, len| {
        let wdyv = if keep_wdy { wdys[c] } else { wdy(j, c, first, len) };
        let mut out = [0.0; MAX_PACK];
        for k in 0..len {
            out[k] = centering.dx(wdyv[first + k], xhats[c][first + k], coefficients);
        }
        if let Some(dsum) = dsum {
            // From L2, where `load_held_row` prefetched it.
            // SAFETY: dsum's rows are aligned whole units as dx's are (the caller's guarantee).
            let ds = unsafe { read(dsum, j, len) };
            for k in 0..len {
                out[k] += ds[k];
            }
        }
        // SAFETY: as above.
        unsafe {
            write(dx, head + j, len, &out);
            if let Some(dres) = dres {
                write(dres, j, len, &out);
            }
        }
    });
    if let Some(e) = edge {
        // SAFETY: the rank's edge slot, written in pass 1.
        let (xhat, wdy) = unsafe { ShiftedShared::edge_terms(edge_slot()) };
        let out = [centering.dx(wdy, xhat, coefficients); MAX_PACK];
        // SAFETY: column e is inside the row.
        unsafe { write(dx, e, 1, &out) };
    }
    upcoming
}

/// Stage 1 for launches whose rows are all whole aligned packs that fit in registers (the
/// host checks): team u handles rows u, u + U, ... and each rank adds its columns' partials
/// into its own [`RankPartials`]; at the end the block sums its teams' (in team order) and
/// hands them over to `out` for its `r.cols` columns. No barrier between rows: a rank's
/// partials are its own. `TIGHT` and `HALVES` as [`backward_row_held`] takes them.
///
/// `SHIFTED` ([`Shift`]): block b's teams take rows b, b + B, ... (B blocks), the k-th team
/// of the block from row b + k * B on, so that every row a block takes sits as far past a
/// 16-byte boundary as row b (B * n is a whole number of packs) and its packs cover the
/// same columns: the ranks' partials stay by rank as packed rows' do, from column `head`
/// on. The block stages the weights of those columns in shared memory once (each then a
/// 16-byte load, not five from L1: [`Rows::gamma_shifted`]) and keeps each rank's edge
/// partials beside them.
///
/// # Safety
/// As [`backward_row_held`] requires of every row; `out` as [`Destination::hand_over`]
/// requires, for `r.cols` columns; the launch gave each block `scratch + teams_per_block *
/// 8 * BWD_HELD * PACK * size` bytes of shared memory (`size` ranks per team), the first
/// `scratch` for the team's reductions; with `SHIFTED`, `scratch` = `SCRATCH_BYTES`, x, dy
/// and the weights of one size, a grid whose B * n is a whole number of packs, and shared
/// memory of `layout::held_shifted_smem` for `r.cols` columns.
#[inline(always)]
pub(crate) unsafe fn stage1_held<
    X: Element,
    T: Element,
    W: Element,
    S: Team,
    const TIGHT: bool,
    const HALVES: bool,
    const SHIFTED: bool,
>(
    r: Rows<X, T, W>,
    out: Destination,
    scratch: u32,
) {
    let team_bytes = RankPartials::team_bytes::<X>(S::size());
    let team = |t: u32, rank: u32| RankPartials::of::<X>(scratch + t * team_bytes, S::size(), rank);
    let mine = team(S::index_in_block(), S::rank());
    // A shifted block's rows all sit as its first does (`opaque`: made again after the
    // rows, not kept across them, where registers are short).
    let block_shift =
        |block: u32| Shift::of::<X, true>(r.x.wrapping_add(block as usize * r.n as usize), r.cols);
    let units = if SHIFTED {
        block_shift(device::block_idx()).packs
    } else {
        r.cols / unit_len::<X, HALVES>()
    };
    // SAFETY: the launch sized shared memory for every team of the block.
    unsafe { mine.zero::<X, HALVES>(S::rank(), S::size(), units) };
    // Every thread of the block stages weights and takes chunks, whichever team it belongs
    // to (block teams stack along y); made where used, not kept across the row loop.
    let threads = || device::block_dim() * device::block_dim_y();
    let first = || device::thread_idx_y() * device::block_dim() + device::thread_idx();
    // A team's first row, and from each row its next.
    let mut row = if SHIFTED {
        S::index_in_block() * device::grid_dim() + device::block_idx()
    } else {
        S::id()
    };
    let step = || {
        if SHIFTED {
            S::per_block() * device::grid_dim()
        } else {
            S::count()
        }
    };
    if SHIFTED {
        // The weights of the packs' columns, pack q from column head + q * PACK, copied a
        // column at a time (their columns sit off gamma's 16-byte boundaries), a pack a
        // thread; gamma's offset is added where they are read.
        let shift = block_shift(device::block_idx());
        let weights = ShiftedShared::weights::<X, S>();
        let mut q = first();
        while q < shift.packs {
            let values = core::array::from_fn(|k| {
                let column = shift.head + q * X::PACK as u32 + k as u32;
                if k < W::PACK {
                    // SAFETY: column < head + packs * PACK <= cols, inside gamma, which no
                    // launch writes.
                    unsafe { read_cached::<W, true>(r.gamma, column, 1)[0] }
                } else {
                    0.0
                }
            });
            // SAFETY: pack q < packs of the staged weights, inside the launch's shared memory.
            unsafe { device::store_shared_16(weights + 16 * q, W::pack(&values)) };
            q += threads();
        }
        let slot = ShiftedShared::edge::<X, W, S>(r.cols, S::index_in_block(), S::rank());
        // SAFETY: the rank's edge slot, inside the launch's shared memory.
        unsafe { device::store_shared_16(slot, [0; 4]) };
        // Every thread reads weights others staged.
        device::sync_block();
    }
    // SAFETY: the launch's rows are held packs (the caller's guarantee); past the last row
    // nothing is loaded.
    let mut held = unsafe { load_held_row::<X, T, W, S, HALVES, SHIFTED>(&r, row) };
    while row < r.rows {
        let next = row + step();
        // SAFETY: as above, and row < rows.
        held = unsafe { backward_row_held::<X, T, W, S, TIGHT, HALVES, SHIFTED>(&r, row, held, next, mine) };
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
    // the unit it covers, where rank k holds a unit of the rows (p < units). The chunks go
    // in slot order, so the first past the rows' units ends the walk: a launch of few rows
    // fills one slot of `BWD_HELD`.
    let per_unit = unit_len::<X, HALVES>() / 4;
    let size = S::size();
    let (threads, first) = (threads(), first());
    let shift = if SHIFTED {
        block_shift(device::opaque(device::block_idx()))
    } else {
        Shift { head: 0, packs: 0 }
    };
    // SAFETY: the caller's guarantee; each thread merges its own chunks' columns.
    unsafe {
        out.hand_over(|dst| {
            let mut i = first;
            while i < RankPartials::chunks::<X>() * size {
                let (rank, q) = (i % size, i / size);
                let slot_start = held_unit::<X, HALVES>(q) * size;
                if slot_start >= units {
                    break;
                }
                let p = rank + slot_start;
                if p < units {
                    let (mut g, mut b) = ([0.0f32; MAX_PACK], [0.0f32; MAX_PACK]);
                    for t in 0..S::per_block() {
                        // q < chunks, inside team t's area, written before the barrier.
                        let (tg, tb) = team(t, rank).chunk(q);
                        for k in 0..4 {
                            g[k] += f32::from_bits(tg[k]);
                            b[k] += f32::from_bits(tb[k]);
                        }
                    }
                    // Columns inside the block's `cols` (p < units); n and the slice start
                    // are whole numbers of units, so the column is 16-byte aligned in the
                    // f32 partial rows (a shifted row's, from `head`, need not be: the rows
                    // are global, whose chunks then go a column at a time).
                    dst.merge(
                        shift.head + p * unit_len::<X, HALVES>() + 4 * (q % per_unit),
                        4,
                        &g,
                        &b,
                    );
                }
                i += threads;
            }
            // A shifted row's edge columns: rank k's, summed over the teams in team order.
            if SHIFTED && let Some(e) = shift.edge::<X>(first, r.cols) {
                let (mut g, mut b) = ([0.0f32; MAX_PACK], [0.0f32; MAX_PACK]);
                for t in 0..S::per_block() {
                    // Team t's slot of rank `first`, written before the barrier.
                    let [tg, tb, _, _] =
                        device::load_shared_16(ShiftedShared::edge::<X, W, S>(r.cols, t, first));
                    g[0] += f32::from_bits(tg);
                    b[0] += f32::from_bits(tb);
                }
                // Column e < cols, one column: in the row whatever its alignment.
                dst.merge(e, 1, &g, &b);
            }
        })
    }
}
