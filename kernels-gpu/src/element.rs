//! Storage types the kernels read and write (f32, f16, bf16), all computed in f32.
//!
//! Every access is one element or one vector: a 16-byte "pack" (4 f32 or 8 f16/bf16), or
//! half of one where a row is aligned only to 8 bytes. 16 bytes is the widest load a
//! thread can issue; a warp's 32 packs are 512 contiguous bytes, four full 128-byte lines,
//! so one instruction moves as much as the bus allows.

use crate::device;

/// The most elements one pack holds (8 halves in 16 bytes); f32 uses the first 4.
pub const MAX_PACK: usize = 8;

/// A pack widened to f32; only the first `T::PACK` entries are meaningful.
pub type Pack = [f32; MAX_PACK];

/// A storage type of x, y, gamma, beta, dy, dx, dgamma and dbeta.
pub trait Element: Copy {
    /// Elements in one 16-byte pack.
    const PACK: usize;

    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;

    /// Widens 16 raw bytes (as four words) into a pack.
    fn unpack(words: [u32; 4]) -> Pack;
    /// Narrows a pack into 16 raw bytes.
    fn pack(v: &Pack) -> [u32; 4];
}

impl Element for f32 {
    const PACK: usize = 4;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn unpack(w: [u32; 4]) -> Pack {
        let mut p = [0.0; MAX_PACK];
        for k in 0..4 {
            p[k] = f32::from_bits(w[k]);
        }
        p
    }
    #[inline(always)]
    fn pack(v: &Pack) -> [u32; 4] {
        [v[0].to_bits(), v[1].to_bits(), v[2].to_bits(), v[3].to_bits()]
    }
}

/// IEEE binary16, as raw bits (no_std has no f16 type we can rely on).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct F16(pub u16);

/// bfloat16, as raw bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(pub u16);

/// Both 16-bit types pack two elements per word, low half first (little-endian order).
macro_rules! half_element {
    ($ty:ident, $to:path, $from:path, $from2:path) => {
        impl Element for $ty {
            const PACK: usize = 8;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $to(self.0)
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                $ty($from(v))
            }
            #[inline(always)]
            fn unpack(w: [u32; 4]) -> Pack {
                let mut p = [0.0; MAX_PACK];
                for k in 0..4 {
                    p[2 * k] = $to(w[k] as u16);
                    p[2 * k + 1] = $to((w[k] >> 16) as u16);
                }
                p
            }
            #[inline(always)]
            fn pack(v: &Pack) -> [u32; 4] {
                let mut w = [0u32; 4];
                for k in 0..4 {
                    w[k] = $from2(v[2 * k], v[2 * k + 1]);
                }
                w
            }
        }
    };
}
half_element!(
    F16,
    device::f16_to_f32,
    device::f32_to_f16,
    device::f32x2_to_f16x2
);
half_element!(
    Bf16,
    device::bf16_to_f32,
    device::f32_to_bf16,
    device::f32x2_to_bf16x2
);

/// The raw words of the `len` values of `T` at `p`, one vector load: 16 bytes, or 8 (half a
/// pack of f16/bf16 or f32: a row aligned only to 8 bytes, or four f16/bf16 columns beside
/// an f32 row's pack), the rest of the words zero. `EVICT_FIRST`: the kernel's last read of
/// them, beside data it reads back from L2 ([`device::load_16_evict_first`]).
///
/// # Safety
/// The `len` values at `p` are readable, `len * size_of::<T>()` is 16 or 8, and `p` is
/// aligned to it.
#[inline(always)]
unsafe fn load_vector<T, const EVICT_FIRST: bool>(p: *const T, len: usize) -> [u32; 4] {
    // SAFETY: the caller's guarantee.
    unsafe {
        match (len * size_of::<T>() == 16, EVICT_FIRST) {
            (true, false) => device::load_16(p as *const u32),
            (true, true) => device::load_16_evict_first(p as *const u32),
            (false, evict_first) => {
                let [a, b] = if evict_first {
                    device::load_8_evict_first(p as *const u32)
                } else {
                    device::load_8(p as *const u32)
                };
                [a, b, 0, 0]
            }
        }
    }
}

/// Stores the first `len` values of `words` at `p`, as [`load_vector`] loads them;
/// `EVICT_FIRST`: bytes the kernel does not read again, beside data it reads back from L2.
///
/// # Safety
/// As for [`load_vector`], writable.
#[inline(always)]
unsafe fn store_vector<T, const EVICT_FIRST: bool>(p: *mut T, len: usize, words: [u32; 4]) {
    // SAFETY: the caller's guarantee.
    unsafe {
        match (len * size_of::<T>() == 16, EVICT_FIRST) {
            (true, false) => device::store_16(p as *mut u32, words),
            (true, true) => device::store_16_evict_first(p as *mut u32, words),
            (false, false) => device::store_8(p as *mut u32, [words[0], words[1]]),
            (false, true) => device::store_8_evict_first(p as *mut u32, [words[0], words[1]]),
        }
    }
}

/// The raw words of a pack of row type `G`'s columns of `T` at `p`: 16 bytes (`G` = `T`,
/// or no narrower), or 8 (four f16/bf16 columns beside an f32 row's pack), as
/// [`load_vector`] loads them.
///
/// # Safety
/// The `G::PACK` values at `p` are readable and aligned to their size, 16 or 8 bytes.
#[inline(always)]
pub unsafe fn load_pack<G: Element, T, const EVICT_FIRST: bool>(p: *const T) -> [u32; 4] {
    // SAFETY: the caller's guarantee.
    unsafe { load_vector::<T, EVICT_FIRST>(p, G::PACK) }
}

/// Reads `len` elements from `row[start..]`: one vector load when `len` > 1 (a pack of
/// 16 bytes, or 8: [`load_vector`], the address aligned to it), else the single element
/// `row[start]`. Data read once goes around L1 so that gamma and beta stay there.
///
/// # Safety
/// The elements must be in bounds, and a vector aligned to its size.
#[inline(always)]
pub unsafe fn read<T: Element>(row: *const T, start: u32, len: usize) -> Pack {
    // SAFETY: the caller guarantees bounds and, for a vector, alignment.
    unsafe {
        let p = row.add(start as usize);
        if len > 1 {
            T::unpack(load_vector::<T, false>(p, len))
        } else {
            let mut v = [0.0; MAX_PACK];
            v[0] = p.read().to_f32();
            v
        }
    }
}

/// As [`read`] for a half pack (8 bytes, `len` > 1) or an element, the half pack through
/// L1 (`ld.global.ca`), where single elements go by default: a row walked in half packs is
/// read twice by the same rank (its statistics, then y), and the second read finds it
/// there. Around L1, as packs go, they were 3-6% slower (H200, docs/PERF.md v59).
///
/// # Safety
/// As for [`read`]; `len * size_of::<T>()` is 8 where `len` > 1.
#[inline(always)]
pub unsafe fn read_half_pack<T: Element>(row: *const T, start: u32, len: usize) -> Pack {
    // SAFETY: the caller guarantees bounds and, for a half pack, its 8-byte alignment.
    unsafe {
        if len > 1 {
            let [a, b] = device::load_8_cached::<false>(row.add(start as usize) as *const u32);
            T::unpack([a, b, 0, 0])
        } else {
            read(row, start, len)
        }
    }
}

/// As [`read`], for the weights every row uses (gamma, beta), which stay in L1 (through the
/// read-only path where `READ_ONLY`: [`device::load_16_cached`]): `len` of them from
/// `v[start..]`, one, or the columns of a row's vector: 8 bytes of weights (one load),
/// 16, or 32 (two: f32 weights beside eight f16 or bf16 columns).
///
/// # Safety
/// The elements must be in bounds, `v + start` aligned to the vector's bytes (or to 16 for
/// 32 bytes) where `len` > 1, and with `READ_ONLY` nothing may write them while the kernel
/// runs.
#[inline(always)]
pub unsafe fn read_cached<W: Element, const READ_ONLY: bool>(v: *const W, start: u32, len: usize) -> Pack {
    let mut out = [0.0; MAX_PACK];
    // SAFETY: the caller guarantees bounds, for vectors alignment, and with READ_ONLY that
    // the weights stay unwritten while the kernel runs; pack q of the weights starts q * 16
    // bytes past the first.
    unsafe {
        let p = v.add(start as usize);
        if len == 1 {
            out[0] = p.read().to_f32();
        } else if len * size_of::<W>() == 8 {
            let [a, b] = device::load_8_cached::<READ_ONLY>(p as *const u32);
            out = W::unpack([a, b, 0, 0]);
        } else {
            for q in 0..MAX_PACK / W::PACK {
                if q * W::PACK < len {
                    let pack = W::unpack(device::load_16_cached::<READ_ONLY>(
                        p.add(q * W::PACK) as *const u32
                    ));
                    for k in 0..W::PACK {
                        out[q * W::PACK + k] = pack[k];
                    }
                }
            }
        }
    }
    out
}

/// As [`read_cached`], for `len` columns from `v[start..]` whose first is off the weights'
/// vector boundaries (the packs of a row shifted off its 16-byte boundaries, whose weights'
/// columns are not): eight 16-bit weights as four 4-byte words where column `start` begins
/// one, else column `start` alone, three words from `start + 1` and column `start + 7`
/// alone, each word then the halves of two (five loads and registers, where an element at
/// a time took eight of each); others an element at a time. They come from L1, where every
/// row keeps them.
///
/// # Safety
/// The elements must be in bounds, and with `READ_ONLY` nothing may write them while the
/// kernel runs.
#[inline(always)]
pub unsafe fn read_cached_shifted<W: Element, const READ_ONLY: bool>(
    v: *const W,
    start: u32,
    len: usize,
) -> Pack {
    let at = v.wrapping_add(start as usize);
    if size_of::<W>() == 2 && len == 8 {
        let words = if (at as usize).is_multiple_of(4) {
            let p = at as *const u32;
            // SAFETY: columns start..start + 8 are inside v (the caller's guarantee), four
            // words from a word's boundary.
            unsafe { [p.read(), p.add(1).read(), p.add(2).read(), p.add(3).read()] }
        } else {
            // SAFETY: as above: column start, three words from start + 1 (a word's
            // boundary, start being one past it), and column start + 7.
            let (first, w, last) = unsafe {
                let first = (at as *const u16).read() as u32;
                let p = at.add(1) as *const u32;
                let w = [p.read(), p.add(1).read(), p.add(2).read()];
                (first, w, (at.add(7) as *const u16).read() as u32)
            };
            let halves = |lo: u32, hi: u32| (lo >> 16) | (hi << 16);
            [
                first | (w[0] << 16),
                halves(w[0], w[1]),
                halves(w[1], w[2]),
                halves(w[2], last),
            ]
        };
        W::unpack(words)
    } else {
        // Constant indices (no `take(len)`), so that the values stay registers.
        let mut out = [0.0; MAX_PACK];
        for (k, o) in out.iter_mut().enumerate() {
            if k < len {
                // SAFETY: column start + k is inside v (the caller's guarantee).
                *o = unsafe { read_cached::<W, READ_ONLY>(v, start + k as u32, 1)[0] };
            }
        }
        out
    }
}

/// [`read_cached`], or where `SHIFTED` and `len` > 1 [`read_cached_shifted`].
///
/// # Safety
/// As for the one called.
#[inline(always)]
pub unsafe fn read_weights<W: Element, const READ_ONLY: bool, const SHIFTED: bool>(
    v: *const W,
    start: u32,
    len: usize,
) -> Pack {
    // SAFETY: the caller's guarantee.
    unsafe {
        if SHIFTED && len > 1 {
            read_cached_shifted::<W, READ_ONLY>(v, start, len)
        } else {
            read_cached::<W, READ_ONLY>(v, start, len)
        }
    }
}

/// Calls `f(at, step, weights)` for each pack of weights over the `len` columns `start..`
/// (one column, or a row's vector of them): `weights` holds columns `start + at .. start +
/// at + step`, read as [`read_cached`] reads them. For f32 weights beside 8-column packs of
/// f16 or bf16 that is two calls of four, so that each half's weights are dead before the
/// next half's are loaded: the kernels that hold rows in registers have no room for all
/// eight at once. `SHIFTED`: the columns' first may be off the weights' vector boundaries
/// ([`read_cached_shifted`]).
///
/// # Safety
/// As for [`read_cached`], without the alignment where `SHIFTED`.
#[inline(always)]
pub unsafe fn for_each_weight_pack<W: Element, const READ_ONLY: bool, const SHIFTED: bool>(
    v: *const W,
    start: u32,
    len: usize,
    mut f: impl FnMut(usize, usize, &Pack),
) {
    // SAFETY: the caller's guarantee, for `len` columns from `start`.
    let read = |start: u32, len: usize| unsafe { read_weights::<W, READ_ONLY, SHIFTED>(v, start, len) };
    if len <= W::PACK {
        return f(0, len, &read(start, len));
    }
    let step = W::PACK;
    for q in 0..MAX_PACK / W::PACK {
        let at = q * step;
        if at < len {
            // `at` is a whole pack of weights into the chunk.
            f(at, step, &read(start + at as u32, step));
        }
    }
}

/// Writes the first `len` entries of `v` to `row[start..]`, as [`read`] reads them.
///
/// # Safety
/// The elements must be in bounds, and a vector aligned to its size.
#[inline(always)]
pub unsafe fn write<T: Element>(row: *mut T, start: u32, len: usize, v: &Pack) {
    // SAFETY: the caller's guarantee.
    unsafe { write_with::<T, false>(row, start, len, v) }
}

/// As [`write`]; `EVICT_FIRST` as for [`store_vector`].
///
/// # Safety
/// As for [`write`].
#[inline(always)]
pub unsafe fn write_with<T: Element, const EVICT_FIRST: bool>(row: *mut T, start: u32, len: usize, v: &Pack) {
    // SAFETY: the caller guarantees bounds and, for a vector, alignment.
    unsafe {
        let p = row.add(start as usize);
        if len > 1 {
            store_vector::<T, EVICT_FIRST>(p, len, T::pack(v))
        } else {
            p.write(T::from_f32(v[0]))
        }
    }
}

/// True where `p` can be read in 16-byte packs.
#[inline(always)]
pub fn is_pack_aligned<T>(p: *const T) -> bool {
    (p as usize).is_multiple_of(16)
}

/// True where `p`'s values of `T` can be read in packs of row type `G`'s columns
/// ([`load_pack`]): 16-byte aligned for a pack of `T`'s own, 8 for four f16/bf16 columns
/// beside an f32 row.
#[inline(always)]
pub fn is_pack_aligned_as<G: Element, T>(p: *const T) -> bool {
    (p as usize).is_multiple_of(G::PACK * size_of::<T>())
}
