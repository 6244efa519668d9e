//! How a team walks one row: which chunks each rank takes, and which of them it holds in
//! registers so that a second pass over the row costs no memory traffic at all.

use crate::device;
use crate::element::{Element, MAX_PACK, Pack, load_pack, read, read_half_pack};
use crate::team::Team;

/// The most packs per rank a [`Held`] may hold (`for_each_chunk` is written out for 8).
pub const MAX_HELD: usize = 8;
/// Packs per rank the forward holds in registers (x), as a const generic.
pub const FWD_HELD: usize = crate::layout::FWD_HELD as usize;
/// Packs per rank the backward holds (x and dy each), as a const generic.
pub const BWD_HELD: usize = crate::layout::BWD_HELD as usize;

/// Up to `K` packs of a row in registers, as raw 16-byte words: pack `rank + c * size` in
/// slot c. Raw words take half the registers of widened f16/bf16 values; widening again on
/// each pass is one `cvt` per element.
pub struct Held<const K: usize> {
    words: [[u32; 4]; K],
}

impl<const K: usize> Held<K> {
    /// Loads this rank's packs among the row's first `packs`. All K loads are issued before
    /// any value is used: K independent 16-byte loads in flight per thread hide DRAM latency.
    ///
    /// # Safety
    /// `row` is 16-byte aligned and holds `packs` whole packs.
    #[inline(always)]
    pub unsafe fn load<T: Element, S: Team>(row: *const T, packs: u32) -> Self {
        // SAFETY: the caller's guarantee.
        unsafe { Self::load_as::<T, T, S>(row, packs) }
    }

    /// As [`Held::load`], for values of `T` in packs of row type `G`'s columns (`G::PACK`
    /// of them: f16 or bf16 beside an f32 row, 8 bytes a pack; `G` = `T`, 16).
    ///
    /// # Safety
    /// `row` is aligned to a pack's bytes and holds `packs` whole packs.
    #[inline(always)]
    pub unsafe fn load_as<G: Element, T: Element, S: Team>(row: *const T, packs: u32) -> Self {
        // SAFETY: the caller's guarantee.
        unsafe { Self::load_with::<G, T, S, false>(row, packs) }
    }

    /// As [`Held::load_as`]; `EVICT_FIRST`: the kernel's last read of these packs, beside
    /// data it reads back from L2 ([`load_pack`]).
    ///
    /// # Safety
    /// As for [`Held::load_as`].
    #[inline(always)]
    pub unsafe fn load_with<G: Element, T: Element, S: Team, const EVICT_FIRST: bool>(
        row: *const T,
        packs: u32,
    ) -> Self {
        let mut words = [[0u32; 4]; K];
        for (c, w) in words.iter_mut().enumerate() {
            let p = S::rank() + c as u32 * S::size();
            if p < packs {
                // SAFETY: p < packs, and the caller guarantees alignment and bounds.
                *w = unsafe { load_pack::<G, T, EVICT_FIRST>(row.add(p as usize * G::PACK)) };
            }
        }
        Held { words }
    }

    /// As [`Held::load`], for a row of 16-bit values 8-byte aligned but not 16, in half
    /// packs (four columns, 8 bytes): slot c keeps half packs rank + 2c * size and
    /// rank + (2c + 1) * size, one in each half of its words, among the row's first
    /// `halves`. A rank's k-th half pack is then rank + k * size, in columns of four as a
    /// packed row's are over its whole packs, so the layouts by rank hold for both.
    ///
    /// # Safety
    /// `row` is 8-byte aligned and holds `halves` whole half packs of a 16-bit type.
    #[inline(always)]
    pub unsafe fn load_halves<T: Element, S: Team>(row: *const T, halves: u32) -> Self {
        let mut words = [[0u32; 4]; K];
        for (c, w) in words.iter_mut().enumerate() {
            // The halves written out: their words' indices constants, so they stay registers.
            let mut half = |h: usize| {
                let q = S::rank() + (2 * c + h) as u32 * S::size();
                if q < halves {
                    // SAFETY: q < halves, each 8 bytes at an 8-byte boundary (the caller's
                    // guarantee).
                    let [a, b] = unsafe { device::load_8(row.add(4 * q as usize) as *const u32) };
                    (w[2 * h], w[2 * h + 1]) = (a, b);
                }
            };
            half(0);
            half(1);
        }
        Held { words }
    }

    /// The values of slot `c`, widened anew at each call (see [`device::opaque`]).
    #[inline(always)]
    pub fn pack<T: Element>(&self, c: usize) -> Pack {
        T::unpack(self.words[c].map(device::opaque))
    }

    /// The residual add of two rows' held packs, slot by slot:
    ///   s_j = x_j + residual_j   (in f32, rounded once to `T`)
    /// x's packs of type `Y`, the residual's of the rows' type `T`: `Y`, or f32 beside f16
    /// or bf16 x (a residual stream kept in f32), whose packs of `T`'s columns x's were
    /// loaded in ([`Held::load_as`]).
    #[inline(always)]
    pub fn sum<Y: Element, T: Element>(&self, residual: &Held<K>) -> Self {
        let mut words = [[0u32; 4]; K];
        each_slot::<K>(|c| {
            let (mut s, r) = (self.pack::<Y>(c), residual.pack::<T>(c));
            for k in 0..T::PACK {
                s[k] += r[k];
            }
            words[c] = T::pack(&s);
        });
        Held { words }
    }

    /// Stores this rank's packs among the row's first `packs` (the slots [`Held::load`]
    /// fills) to `row`.
    ///
    /// # Safety
    /// `row` is 16-byte aligned and holds `packs` whole packs.
    #[inline(always)]
    pub unsafe fn store<T: Element, S: Team>(&self, row: *mut T, packs: u32) {
        each_slot::<K>(|c| {
            let p = S::rank() + c as u32 * S::size();
            if p < packs {
                // SAFETY: p < packs, and the caller guarantees alignment and bounds.
                unsafe { device::store_16(row.add(p as usize * T::PACK) as *mut u32, self.words[c]) };
            }
        });
    }
}

/// A rank's packs of one row widened to f32 once, pack `rank + c * size` in slot c, for
/// passes that change them in place (the pipelined forward centres them: d_j = x_j - mean,
/// which its y then reads). Where registers allow, this is the cheaper form: a [`Held`]
/// row is widened again on every pass, one instruction an element each time.
pub struct Widened<const K: usize> {
    values: [Pack; K],
    /// The row's packs: slot c holds pack rank + c * size where that is below this.
    packs: u32,
}

impl<const K: usize> Widened<K> {
    /// The values of `held`'s slots among the row's first `packs` (the others stay 0).
    /// Widened from raw words already in registers: widening straight from shared memory
    /// instead spilled the pipelined kernel at 64 registers (docs/PERF.md, v31).
    #[inline(always)]
    pub fn of<T: Element, S: Team>(held: &Held<K>, packs: u32) -> Self {
        let mut values = [[0.0; crate::element::MAX_PACK]; K];
        each_held_slot::<S, K>(packs, |c, _| values[c] = held.pack::<T>(c));
        Widened { values, packs }
    }

    /// Calls `f(start, values)` for each of this rank's packs of the row: its first
    /// element and its values, which `f` may change.
    #[inline(always)]
    pub fn for_each<T: Element, S: Team>(&mut self, mut f: impl FnMut(u32, &mut Pack)) {
        let values = &mut self.values;
        each_held_slot::<S, K>(self.packs, |c, p| f(p * T::PACK as u32, &mut values[c]));
    }
}

/// Calls `f(c, p)` for each slot c < `K` of a rank's held packs whose pack p = rank + c *
/// size is among the row's first `packs`.
#[inline(always)]
pub fn each_held_slot<S: Team, const K: usize>(packs: u32, mut f: impl FnMut(usize, u32)) {
    each_slot::<K>(|c| {
        let p = S::rank() + c as u32 * S::size();
        if p < packs {
            f(c, p)
        }
    });
}

/// Calls `f(c)` for each slot c < `K` of a [`Held<K>`], written out rather than looped:
/// with c a constant in each copy, the slots stay registers. A loop LLVM declines to unroll
/// (its body is large; 8 slots of f16 packs are) would index them at run time and move them
/// to local memory.
#[inline(always)]
pub fn each_slot<const K: usize>(mut f: impl FnMut(usize)) {
    const { assert!(K <= MAX_HELD) };
    let mut slot = |c: usize| {
        if c < K {
            f(c)
        }
    };
    slot(0);
    slot(1);
    slot(2);
    slot(3);
    slot(4);
    slot(5);
    slot(6);
    slot(7);
}

/// The values of chunk (`start`, `len`): from slot `c` of `held`, or read from `row` (one
/// vector for `len` > 1: 8 bytes for the four f16/bf16 columns of an f32 row's pack,
/// [`Held::load_as`]).
///
/// # Safety
/// As for [`crate::element::read`] when the chunk is not held.
#[inline(always)]
pub unsafe fn values<T: Element, const K: usize>(
    held: &Held<K>,
    row: *const T,
    start: u32,
    len: usize,
    slot: Option<usize>,
) -> Pack {
    match slot {
        Some(c) => held.pack::<T>(c),
        // SAFETY: the caller guarantees bounds and alignment.
        None => unsafe { read(row, start, len) },
    }
}

/// Prefetches the `n` elements at `row` into L2, one 128-byte line per rank at a time.
/// A team calls it for its next row while the current row's loads are in flight: the next
/// row then streams from DRAM during this row's reductions and stores, which otherwise
/// leave the memory system idle, and its loads find it in L2.
///
/// # Safety
/// `row` holds `n` elements.
#[inline(always)]
pub unsafe fn prefetch<T, S: Team>(row: *const T, n: u32) {
    let bytes = n as usize * size_of::<T>();
    let start = row as usize;
    // Lines from the one holding the first byte to the one holding the last.
    let (first, last) = (start / 128, (start + bytes).saturating_sub(1) / 128);
    let mut line = first + S::rank() as usize;
    while bytes > 0 && line <= last {
        // The part of the line inside the row: its start, or the row's first byte.
        let at = (line * 128).max(start);
        // SAFETY: start <= at < start + bytes, inside the row.
        unsafe { device::prefetch_l2(at as *const u8) };
        line += S::size() as usize;
    }
}

/// Whether a row of `n` elements fits `K` held packs per rank.
#[inline(always)]
pub fn fits<T: Element, S: Team, const K: usize>(n: u32) -> bool {
    n / T::PACK as u32 <= S::size() * K as u32
}

/// The whole packs of a row past the `K` a rank holds (packs `rank + K * size`,
/// `rank + (K + 1) * size`, ...: rows too long to hold in registers), copied into the block's
/// dynamic shared memory after its first `scratch` bytes. Pack `p` takes slot `p - K * size`, so a
/// warp's 32 ranks fill 512 contiguous bytes (no bank conflicts), and each rank reads back
/// only the slots it filled: its own copies' wait is the only synchronization.
#[derive(Clone, Copy)]
pub struct Staged<const K: usize> {
    /// Shared address of slot 0.
    base: u32,
    /// Slots the launch's shared memory holds.
    slots: u32,
}

impl<const K: usize> Staged<K> {
    /// The staging area after the first `scratch` bytes of dynamic shared memory.
    #[inline(always)]
    pub fn after(scratch: u32) -> Self {
        Staged {
            base: device::shared_addr(scratch),
            slots: device::dynamic_smem_size().saturating_sub(scratch) / 16,
        }
    }

    /// The staging area after the first `scratch` bytes cut in two of equal slots: one for
    /// x's packs, one for the residual's, of the rows a residual forward stages
    /// ([`Staged::sum_into`]).
    #[inline(always)]
    pub fn halves_after(scratch: u32) -> (Self, Self) {
        let whole = Staged::<K>::after(scratch);
        let slots = whole.slots / 2;
        (
            Staged { slots, ..whole },
            Staged {
                base: whole.base + slots * 16,
                slots,
            },
        )
    }

    /// Whether the whole packs of an `n`-element row past the held ones all have a slot.
    #[inline(always)]
    pub fn holds<T: Element, S: Team>(self, n: u32) -> bool {
        (n / T::PACK as u32).saturating_sub(K as u32 * S::size()) <= self.slots
    }

    /// Copies this rank's packs past the held ones into their slots, all at once (no
    /// registers held, so every copy is in flight together), and waits for them.
    ///
    /// # Safety
    /// `row` is 16-byte aligned and holds `n` elements, and [`Staged::holds`] it; the
    /// shared memory past `scratch` is this team's alone.
    #[inline(always)]
    pub unsafe fn fill<T: Element, S: Team>(self, row: *const T, n: u32) {
        // SAFETY: the caller's guarantee.
        unsafe { self.fill_async::<T, T, S>(row, n) };
        device::cp_async_wait_all();
    }

    /// As [`Staged::fill`], without the wait: the copies are this rank's to read only after
    /// its next `device::cp_async_wait_all`. The row's values are of `T`, taken in packs of
    /// the rows' type `G`'s columns: 16 bytes a slot, or 8 in the slot's first half (four
    /// f16/bf16 columns of x beside a residual stream of f32).
    ///
    /// # Safety
    /// As for [`Staged::fill`], the row aligned to a pack's bytes; nothing reads or writes
    /// the slots until the wait.
    #[inline(always)]
    pub unsafe fn fill_async<G: Element, T: Element, S: Team>(self, row: *const T, n: u32) {
        let packs = n / G::PACK as u32;
        let first = K as u32 * S::size();
        let mut p = S::rank() + first;
        while p < packs {
            let (slot, pack) = (
                self.base + (p - first) * 16,
                row.wrapping_add(p as usize * G::PACK) as *const u32,
            );
            // SAFETY: p < packs, a whole pack of the aligned row; slot p - first exists.
            unsafe {
                if G::PACK * size_of::<T>() == 16 {
                    device::cp_async_16(slot, pack)
                } else {
                    device::cp_async_8(slot, pack)
                }
            };
            p += S::size();
        }
    }

    /// The residual add over this rank's staged packs: x's copies in `self` (of `Y`, in
    /// packs of `T`'s columns, as [`Staged::fill_async`] copies them), the residual's in
    /// `residual` (both filled by this rank, the copies waited for),
    ///   s_j = x_j + residual_j   (in f32, rounded once to the stream's type `T`)
    /// written to the row `sum` and over x's copies, whole 16-byte packs of `T`, which
    /// [`Staged::for_each`] then reads as s.
    ///
    /// # Safety
    /// This rank filled both stagings with the same row; `sum` is 16-byte aligned and holds
    /// the `n`-element row.
    #[inline(always)]
    pub unsafe fn sum_into<T: Element, Y: Element, S: Team>(self, residual: Self, sum: *mut T, n: u32) {
        let packs = n / T::PACK as u32;
        let first = K as u32 * S::size();
        let mut p = S::rank() + first;
        while p < packs {
            let slot = (p - first) * 16;
            // SAFETY: both slots hold pack p, copied there by this rank (x's 8 bytes of it
            // where Y is narrower); pack p is a whole aligned pack of the row `sum`.
            unsafe {
                let x = if T::PACK * size_of::<Y>() == 16 {
                    device::load_shared_16(self.base + slot)
                } else {
                    let [a, b] = device::load_shared_8(self.base + slot);
                    [a, b, 0, 0]
                };
                let mut s = Y::unpack(x);
                let r = T::unpack(device::load_shared_16(residual.base + slot));
                for k in 0..T::PACK {
                    s[k] += r[k];
                }
                let words = T::pack(&s);
                device::store_16(sum.add(p as usize * T::PACK) as *mut u32, words);
                device::store_shared_16(self.base + slot, words);
            }
            p += S::size();
        }
    }

    /// Calls `f(start, values)` for each of this rank's packs past the held ones, from the
    /// slots [`Staged::fill`] filled.
    ///
    /// # Safety
    /// This rank filled the slots with this row.
    #[inline(always)]
    pub unsafe fn for_each<T: Element, S: Team>(self, n: u32, mut f: impl FnMut(u32, Pack)) {
        let packs = n / T::PACK as u32;
        let first = K as u32 * S::size();
        let mut p = S::rank() + first;
        while p < packs {
            // SAFETY: the slot holds pack p, copied there by this rank.
            let w = unsafe { device::load_shared_16(self.base + (p - first) * 16) };
            f(p * T::PACK as u32, T::unpack(w));
            p += S::size();
        }
    }
}

/// A whole row's staging, pack p in slot p: a team's next row, copied in while the team
/// works on the row before it (the pipelined forward, where
/// `layout::registry::pipeline_stages`).
impl Staged<0> {
    /// Copies this rank's packs among the row's first `packs`, the ones a [`Held<H>`]
    /// holds, into their slots without waiting. The slots' addresses go through
    /// [`device::opaque`]: formed anew at each call, not kept in registers across the
    /// team's row loop (which spilled the kernel even at 64 registers).
    ///
    /// # Safety
    /// `row` is 16-byte aligned and holds `packs` whole packs, each with a slot; nothing
    /// reads or writes this rank's slots until its next `device::cp_async_wait_all`.
    #[inline(always)]
    pub unsafe fn fill_held_async<T: Element, S: Team, const H: usize>(self, row: *const T, packs: u32) {
        let (base, rank) = (device::opaque(self.base), device::opaque(S::rank()));
        each_slot::<H>(|c| {
            let p = rank + c as u32 * S::size();
            if p < packs {
                // SAFETY: the caller's guarantee: pack p is a whole aligned pack of the row,
                // slot p exists.
                unsafe {
                    device::cp_async_16(
                        base + p * 16,
                        row.wrapping_add(p as usize * T::PACK) as *const u32,
                    )
                };
            }
        });
    }

    /// The packs [`Staged::fill_held_async`] copied, as a [`Held<H>`].
    ///
    /// # Safety
    /// This rank copied the row's first `packs` into its slots and waited for the copies.
    #[inline(always)]
    pub unsafe fn held<S: Team, const H: usize>(self, packs: u32) -> Held<H> {
        let mut words = [[0u32; 4]; H];
        let (base, rank) = (device::opaque(self.base), device::opaque(S::rank()));
        each_slot::<H>(|c| {
            let p = rank + c as u32 * S::size();
            if p < packs {
                // SAFETY: the caller's guarantee: slot p holds pack p, copied by this rank.
                words[c] = unsafe { device::load_shared_16(base + p * 16) };
            }
        });
        Held { words }
    }
}

/// The chunks a row walk takes ([`for_each_chunk`], [`for_each_read`]), named by their
/// bytes (the const `CHUNK`): whole 16-byte packs where every pointer of the row is 16-byte
/// aligned, half packs (8 bytes: 4 f16/bf16 columns or 2 f32) where all are 8-byte
/// aligned, else single elements. A row of f16 whose length is a multiple of 4 but not 8
/// starts 16-byte aligned every other row and 8-byte aligned on the others.
pub const PACKS: usize = 16;
/// Half packs: see [`PACKS`].
pub const HALF_PACKS: usize = 8;
/// Single elements: see [`PACKS`].
pub const ELEMENTS: usize = 1;
/// Whole 16-byte packs from the row's first 16-byte boundary on, where the row's pointers all
/// sit equally far past one (an f16 row of N = 4097 sits 2 bytes further along than the row
/// before it) and its weights' columns need not be aligned; the columns before the boundary
/// and after the last whole pack one by one ([`for_each_read`]). A name, not a size (as
/// the others are): its chunks are [`PACKS`]' 16 bytes.
pub const SHIFTED_PACKS: usize = 17;

/// The widest chunk ([`PACKS`], [`HALF_PACKS`] or [`ELEMENTS`]) a row of `T` allows: its
/// pointers `rows` aligned to the chunk's bytes, and its weights' `weights` (of `W`) to
/// their vector's, the chunk's columns of `W` (f32 weights beside a half pack of f16: 16
/// bytes), or 16 where that is more (two loads). Half packs need weights no narrower than
/// the row (their f16 columns beside two of f32 would be 4 bytes).
#[inline(always)]
pub fn chunk_of<T: Element, W: Element>(rows: &[usize], weights: &[usize]) -> usize {
    let aligned = |chunk: usize| {
        let weight_bytes = (chunk / size_of::<T>() * size_of::<W>()).min(PACKS);
        rows.iter().all(|p| p.is_multiple_of(chunk)) && weights.iter().all(|p| p.is_multiple_of(weight_bytes))
    };
    if aligned(PACKS) {
        PACKS
    } else if size_of::<W>() >= size_of::<T>() && aligned(HALF_PACKS) {
        HALF_PACKS
    } else {
        ELEMENTS
    }
}

/// The elements of a `CHUNK`-byte chunk of `T`.
#[inline(always)]
const fn chunk_len<T: Element, const CHUNK: usize>() -> usize {
    if CHUNK == ELEMENTS {
        1
    } else if CHUNK == SHIFTED_PACKS {
        PACKS / size_of::<T>()
    } else {
        CHUNK / size_of::<T>()
    }
}

/// Calls `f(start, len, slot)` for each piece of an `n`-element row this rank handles.
///
/// Chunks of `CHUNK` bytes ([`PACKS`]: every pointer of the row 16-byte aligned; [`HALF_PACKS`]:
/// 8-byte): rank r takes chunks r, r + size, ..., so a warp's loads cover contiguous spans
/// (512 bytes of packs); with `K` > 0 (packs only) these are exactly the packs a
/// [`Held<K>`] holds (the caller checked [`fits`]) and `slot` names them. The elements after
/// the last whole chunk follow one by one (len = 1, slot None); with [`ELEMENTS`], every
/// element does.
#[inline(always)]
pub fn for_each_chunk<T: Element, S: Team, const CHUNK: usize, const K: usize>(
    n: u32,
    f: impl FnMut(u32, usize, Option<usize>),
) {
    walk_chunks::<T, S, CHUNK, K, false>(n, 0, f)
}

/// [`for_each_chunk`], whole chunks from column `head` on (the columns before it one by
/// one, with the tail's: one call site for single elements, whose copies of a pass's code
/// cost the owned block kernel registers). `OPAQUE_RANK`: the rank through
/// [`device::opaque`], so that values made from it (a pack's columns) are made again in
/// each pass rather than kept across the team's row loop.
#[inline(always)]
fn walk_chunks<T: Element, S: Team, const CHUNK: usize, const K: usize, const OPAQUE_RANK: bool>(
    n: u32,
    head: u32,
    mut f: impl FnMut(u32, usize, Option<usize>),
) {
    // Held slots are whole packs (a shifted row's from its head on).
    const { assert!(K == 0 || CHUNK == PACKS || CHUNK == SHIFTED_PACKS) };
    let rank = if OPAQUE_RANK {
        device::opaque(S::rank())
    } else {
        S::rank()
    };
    let width = chunk_len::<T, CHUNK>() as u32;
    let chunks = (n - head) / width;
    if K > 0 {
        // Slot by slot ([`each_slot`]), so that `Held`'s slots stay registers.
        each_slot::<K>(|c| {
            let p = rank + c as u32 * S::size();
            if p < chunks {
                f(head + p * width, T::PACK, Some(c));
            }
        });
    } else {
        let mut p = rank;
        while p < chunks {
            f(head + p * width, width as usize, None);
            p += S::size();
        }
    }
    for_each_edge_column::<S>(rank, n, head, head + chunks * width, |j| f(j, 1, None));
}

/// The columns of a row outside its whole chunks, those before `head` and those from
/// `tail` on, as one run handed out rank by rank (`rank` this rank's, as the caller took
/// it): column `i` of the run by rank `i mod size`. Every walk of a row that a rank writes
/// and then reads back (the residual forward's s) must hand its edges out alike.
#[inline(always)]
pub fn for_each_edge_column<S: Team>(rank: u32, n: u32, head: u32, tail: u32, mut f: impl FnMut(u32)) {
    let mut j = if rank < head { rank } else { tail + rank - head };
    while j < n {
        f(j);
        // A rank's head column (one at most: head < size) is followed by its tail's.
        j += S::size() + if j < head { tail - head } else { 0 };
    }
}

/// Elements of a row at `row`, `n` long, before its first 16-byte boundary (at most `n`):
/// the head a shifted walk takes one by one ([`for_each_shifted_chunk`]).
#[inline(always)]
pub fn head_elements<T>(row: *const T, n: u32) -> u32 {
    let to_boundary = (16 - row as usize % 16) % 16;
    ((to_boundary / size_of::<T>()) as u32).min(n)
}

/// As [`for_each_chunk`] in whole packs, for a row whose pointers all sit the same bytes
/// past a 16-byte boundary (an f16 row of N = 4097 sits 2 bytes further along than the
/// row before it): the packs from column `head` ([`head_elements`]) on, where every
/// pointer's packs are aligned (held slots too: a [`Held`] loaded from the row + `head`),
/// then the `head` columns before them and the tail one by one. Element by element, each
/// 16 bytes of f16 took 8 loads.
#[inline(always)]
pub fn for_each_shifted_chunk<T: Element, S: Team, const K: usize>(
    n: u32,
    head: u32,
    f: impl FnMut(u32, usize, Option<usize>),
) {
    // The rank opaque: two of its pack columns, kept across the team's row loop, spilled
    // sm_90's owned block kernels at their 64 registers.
    walk_chunks::<T, S, PACKS, K, true>(n, head, f)
}

/// Items `from..n` of a row (its elements, or its chunks: [`for_each_chunk_batched`]), item
/// `from + i` by rank `i mod size` (as [`for_each_chunk`] hands them out), `BATCH` a rank at
/// a time, for a caller that stores after it loads: `load(j)` for each item of the batch
/// first, then `f(j, loaded)` for each. The compiler may not move a load past a store that
/// might alias it, so item by item each item's loads waited for the last one's store: a
/// DRAM round trip each (the residual add at f16 N = 4097 ran at 660 GB/s, docs/PERF.md
/// after v62). `OPAQUE_RANK`: the rank through [`device::opaque`] (values made from it
/// made again at each call rather than kept across the caller's row loop).
#[inline(always)]
pub fn for_each_batched<S: Team, V: Copy + Default, const BATCH: usize, const OPAQUE_RANK: bool>(
    from: u32,
    n: u32,
    mut load: impl FnMut(u32) -> V,
    mut f: impl FnMut(u32, V),
) {
    let size = S::size();
    let rank = if OPAQUE_RANK {
        device::opaque(S::rank())
    } else {
        S::rank()
    };
    let mut j = from + rank;
    while j < n {
        let item = |u: usize| j + u as u32 * size;
        let mut loaded = [V::default(); BATCH];
        each_slot::<BATCH>(|u| {
            if item(u) < n {
                loaded[u] = load(item(u));
            }
        });
        each_slot::<BATCH>(|u| {
            if item(u) < n {
                f(item(u), loaded[u]);
            }
        });
        j += BATCH as u32 * size;
    }
}

/// As [`for_each_chunk`] with no chunk held, `BATCH` chunks a rank at a time as
/// [`for_each_batched`] takes them: `load(start, len)` for each chunk of a batch, then
/// `f(start, len, loaded)` for each. The elements after the last whole chunk follow one by
/// one (at most 3 of them, one per rank: a batch of their own gains nothing).
#[inline(always)]
pub fn for_each_chunk_batched<
    T: Element,
    S: Team,
    V: Copy + Default,
    const CHUNK: usize,
    const BATCH: usize,
>(
    n: u32,
    mut load: impl FnMut(u32, usize) -> V,
    mut f: impl FnMut(u32, usize, V),
) {
    let width = chunk_len::<T, CHUNK>() as u32;
    let chunks = n / width;
    // The rank opaque, as in [`for_each_shifted_chunk`]: a half pack's first column, kept
    // across the row loop, spilled sm_90's owned block kernels.
    for_each_batched::<S, V, BATCH, true>(
        0,
        chunks,
        |p| load(p * width, width as usize),
        |p, v| f(p * width, width as usize, v),
    );
    let mut j = chunks * width + S::rank();
    // Single elements have no tail (and with none written here, the compiler need not
    // prove that `chunks * width + rank` cannot wrap).
    while width > 1 && j < n {
        f(j, 1, load(j, 1));
        j += S::size();
    }
}

/// What a rank of a row no rank holds reads at once ([`for_each_read`]): 4 packs or 8
/// half packs (64 bytes in flight a rank), or `layout::READ_BATCH_ELEMENTS` elements of a
/// row not 8-byte aligned; a shifted row's packs as its team says
/// ([`Team::SHIFTED_READ_BATCH`]). A load at a time left a rank 16 bytes in flight (2 to 4 element
/// by element) for DRAM's whole latency (v56).
pub const READ_BATCH_PACKS: usize = 4;
const READ_BATCH_HALF_PACKS: usize = 2 * READ_BATCH_PACKS;
const READ_BATCH_ELEMENTS: usize = crate::layout::READ_BATCH_ELEMENTS as usize;
/// The most chunks a batch holds.
const READ_BATCH_MAX: usize = if READ_BATCH_ELEMENTS > READ_BATCH_HALF_PACKS {
    READ_BATCH_ELEMENTS
} else {
    READ_BATCH_HALF_PACKS
};

/// As [`for_each_chunk`] over a row no rank holds (`K` = 0), with the chunks' values read
/// from `row` for `f(start, len, values)`: this rank's whole chunks of `CHUNK` bytes a
/// batch at a time, the batch's loads issued before `f` sees any of them (the last, short
/// batch too, then given to `f` one by one), then the elements past the last whole chunk.
/// Each rank takes the chunks [`for_each_chunk`] gives it. [`SHIFTED_PACKS`]: the packs
/// from the row's first 16-byte boundary on ([`head_elements`]), then the columns before
/// it with the tail's ([`for_each_edge_column`]).
///
/// # Safety
/// `row` holds `n` elements, aligned to `CHUNK`'s bytes (to its own size for
/// [`SHIFTED_PACKS`]).
#[inline(always)]
pub unsafe fn for_each_read<T: Element, S: Team, const CHUNK: usize>(
    row: *const T,
    n: u32,
    mut f: impl FnMut(u32, usize, &Pack),
) {
    // SAFETY: the caller's guarantee.
    unsafe {
        read_batches::<T, S, CHUNK>(row, n, |start, step, width, v, count| {
            // Written out ([`each_slot`]): a loop over a batch of half packs, whose y is
            // large, stayed a loop and indexed the batch in local memory.
            each_slot::<READ_BATCH_MAX>(|u| {
                if u < count {
                    f(start + u as u32 * step, width, &v[u]);
                }
            })
        })
    }
}

/// As [`for_each_read`], for a caller that needs the values only, not their columns (a
/// row's statistics): `f(values)` takes a pack's values, or a batch's half packs or
/// elements gathered into one call, so that LayerNorm's Chan merge (a division) comes once
/// a batch rather than once a chunk.
///
/// # Safety
/// As for [`for_each_read`].
#[inline(always)]
pub unsafe fn for_each_read_values<T: Element, S: Team, const CHUNK: usize>(
    row: *const T,
    n: u32,
    mut f: impl FnMut(&[f32]),
) {
    // SAFETY: the caller's guarantee.
    unsafe {
        read_batches::<T, S, CHUNK>(row, n, |_, _, width, v, count| {
            if width < T::PACK {
                // Constant indices only, so that the batch stays in registers.
                let mut gathered = [0.0; READ_BATCH_MAX * MAX_PACK / 2];
                for u in 0..READ_BATCH_MAX {
                    for k in 0..MAX_PACK / 2 {
                        if u < count && k < width {
                            gathered[u * width + k] = v[u][k];
                        }
                    }
                }
                f(&gathered[..count * width]);
            } else {
                each_slot::<READ_BATCH_MAX>(|u| {
                    if u < count {
                        f(&v[u][..width]);
                    }
                })
            }
        })
    }
}

/// Chunks a batch of [`for_each_read`] holds.
#[inline(always)]
fn read_batch<S: Team, const CHUNK: usize>() -> usize {
    match (CHUNK, S::HOLDS_PART_OF_LONG_ROWS) {
        (ELEMENTS, _) => READ_BATCH_ELEMENTS,
        (PACKS, true) => READ_BATCH_PACKS,
        (SHIFTED_PACKS, _) => S::SHIFTED_READ_BATCH,
        (_, true) => READ_BATCH_HALF_PACKS,
        // Warp teams, which the host gives only rows short enough for warps: 16 bytes at a
        // time, a pack or two half packs (batches of packs cost their 64 registers a spill
        // on sm_80).
        (_, false) => PACKS / CHUNK,
    }
}

/// The reads of [`for_each_read`]: `f(start, step, width, values, count)` takes `count`
/// chunks of `width` elements, at columns `start + u * step` for u < `count`: a batch (all
/// its loads issued first), or one chunk of the last, short batch (loaded with the others).
///
/// # Safety
/// As for [`for_each_read`].
#[inline(always)]
unsafe fn read_batches<T: Element, S: Team, const CHUNK: usize>(
    row: *const T,
    n: u32,
    mut f: impl FnMut(u32, u32, usize, &[Pack; READ_BATCH_MAX], usize),
) {
    let (width, batch) = (chunk_len::<T, CHUNK>() as u32, read_batch::<S, CHUNK>());
    // The first whole chunk's column: a shifted row's head (made from the row where used,
    // not kept across the caller's passes), else 0.
    let first = if CHUNK == SHIFTED_PACKS {
        head_elements(row, n)
    } else {
        0
    };
    // Called below with whole chunks of the row (or its elements), aligned to CHUNK.
    let load = |start: u32, len: usize| {
        // SAFETY: the caller's guarantee, for a chunk inside the row.
        unsafe {
            if CHUNK == HALF_PACKS {
                read_half_pack(row, start, len)
            } else {
                read(row, start, len)
            }
        }
    };
    let (chunks, size) = ((n - first) / width, S::size());
    let mut c = S::rank();
    while c + (batch as u32 - 1) * size < chunks {
        let mut v = [[0.0; MAX_PACK]; READ_BATCH_MAX];
        for (u, v) in v.iter_mut().enumerate().take(batch) {
            // Chunk c + u size < chunks.
            *v = load(first + (c + u as u32 * size) * width, width as usize);
        }
        f(first + c * width, size * width, width as usize, &v, batch);
        c += batch as u32 * size;
    }
    if c < chunks {
        // This rank's chunks past its last whole batch, fewer than a batch: loaded together
        // too, then given to `f` one by one, each moved to the front of the batch (constant
        // indices, so that the batch stays in registers and `f` is inlined once). Loaded one
        // at a time, f16 N = 1030's 4 half packs a rank on 64 ranks waited 4 DRAM round
        // trips and lost 6-7% to its elements (docs/PERF.md v60).
        let mut v = [[0.0; MAX_PACK]; READ_BATCH_MAX];
        each_slot::<READ_BATCH_MAX>(|u| {
            let chunk = c + u as u32 * size;
            if u + 1 < batch && chunk < chunks {
                // Chunk < chunks.
                v[u] = load(first + chunk * width, width as usize);
            }
        });
        while c < chunks {
            f(first + c * width, 0, width as usize, &v, 1);
            each_slot::<READ_BATCH_MAX>(|u| {
                if u + 2 < batch {
                    v[u] = v[u + 1];
                }
            });
            c += size;
        }
    }
    // The elements past the last whole chunk, and a shifted row's head (fewer columns than
    // a pack, so one a rank at most), as the other walks hand them out.
    for_each_edge_column::<S>(S::rank(), n, first, first + chunks * width, |j| {
        let mut v = [[0.0; MAX_PACK]; READ_BATCH_MAX];
        // SAFETY: j < n.
        v[0] = unsafe { read(row, j, 1) };
        f(j, 0, 1, &v, 1);
    });
}
