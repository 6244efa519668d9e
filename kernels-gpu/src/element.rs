//! Storage types the kernels read and write (f32, f16, bf16), all computed in f32.
//!
//! Every access is either one element or one 16-byte vector ("pack"): 4 f32 or 8 f16/bf16.
//! 16 bytes is the widest load a thread can issue; a warp's 32 packs are 512 contiguous
//! bytes, four full 128-byte lines, so one instruction moves as much as the bus allows.

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

/// The raw words of a pack of row type `G`'s columns of `T` at `p`: 16 bytes (`G` = `T`,
/// or no narrower), or 8 (four f16/bf16 columns beside an f32 row's pack), the rest of the
/// words zero. `EVICT_FIRST`: the kernel's last read of them, beside data it reads back
/// from L2 ([`device::load_16_evict_first`]).
///
/// # Safety
/// The `G::PACK` values at `p` are readable and aligned to their size, 16 or 8 bytes.
#[inline(always)]
pub unsafe fn load_pack<G: Element, T, const EVICT_FIRST: bool>(p: *const T) -> [u32; 4] {
    // SAFETY: the caller's guarantee.
    unsafe {
        match (G::PACK * size_of::<T>() == 16, EVICT_FIRST) {
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

/// Stores the first `G::PACK` values of `words` at `p`, as [`load_pack`] loads them;
/// `EVICT_FIRST`: bytes the kernel does not read again, beside data it reads back from L2.
///
/// # Safety
/// As for [`load_pack`], writable.
#[inline(always)]
pub unsafe fn store_pack<G: Element, T, const EVICT_FIRST: bool>(p: *mut T, words: [u32; 4]) {
    // SAFETY: the caller's guarantee.
    unsafe {
        match (G::PACK * size_of::<T>() == 16, EVICT_FIRST) {
            (true, false) => device::store_16(p as *mut u32, words),
            (true, true) => device::store_16_evict_first(p as *mut u32, words),
            (false, false) => device::store_8(p as *mut u32, [words[0], words[1]]),
            (false, true) => device::store_8_evict_first(p as *mut u32, [words[0], words[1]]),
        }
    }
}

/// Reads `len` elements from `row[start..]`: one 16-byte load when `len == T::PACK` (the
/// address must then be 16-byte aligned), else the single element `row[start]`. Data read
/// once goes around L1 so that gamma and beta stay there.
///
/// # Safety
/// The elements must be in bounds, and a whole pack aligned.
#[inline(always)]
pub unsafe fn read<T: Element>(row: *const T, start: u32, len: usize) -> Pack {
    // SAFETY: the caller's guarantee.
    unsafe { read_as::<T, T>(row, start, len) }
}

/// As [`read`], for values of `T` walked in chunks of row type `G`: a vector load of
/// `G::PACK` values (16 bytes, or 8 for f16/bf16 beside f32 rows: a residual stream kept
/// in f32) when `len == G::PACK`, else the single element `row[start]`.
///
/// # Safety
/// The elements must be in bounds, and a vector aligned to its size.
#[inline(always)]
pub unsafe fn read_as<G: Element, T: Element>(row: *const T, start: u32, len: usize) -> Pack {
    // SAFETY: the caller guarantees bounds and, for a vector, alignment.
    unsafe {
        let p = row.add(start as usize);
        if len == G::PACK {
            T::unpack(load_pack::<G, T, false>(p))
        } else {
            let mut v = [0.0; MAX_PACK];
            v[0] = p.read().to_f32();
            v
        }
    }
}

/// As [`read`], for the weights every row uses (gamma, beta), which stay in L1 (through the
/// read-only path where `READ_ONLY`: [`device::load_16_cached`]): `len` of
/// them from `v[start..]`, one, or a whole pack of the row's type `G`, which for f32
/// weights beside f16 or bf16 rows is two packs of weights (the row's 8 columns are 32
/// bytes of f32), and for f16/bf16 weights beside f32 rows half of one (8 bytes).
///
/// # Safety
/// The elements must be in bounds, `v + start` aligned to the pack's bytes where `len` > 1
/// (16, or 8 for four 16-bit weights), and with `READ_ONLY` nothing may write them while
/// the kernel runs.
#[inline(always)]
pub unsafe fn read_cached<G: Element, W: Element, const READ_ONLY: bool>(
    v: *const W,
    start: u32,
    len: usize,
) -> Pack {
    let mut out = [0.0; MAX_PACK];
    // SAFETY: the caller guarantees bounds, for packs alignment, and with READ_ONLY that the
    // weights stay unwritten while the kernel runs; pack q of the weights starts q * 16
    // bytes past the first.
    unsafe {
        let p = v.add(start as usize);
        if len == 1 {
            out[0] = p.read().to_f32();
        } else if G::PACK * size_of::<W>() == 8 {
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

/// Calls `f(at, step, weights)` for each pack of weights over the `len` columns `start..`
/// (one column, or a whole pack of row type `G`): `weights` holds columns `start + at ..
/// start + at + step`, read as [`read_cached`] reads them. For f32 weights beside 8-column
/// packs of f16 or bf16 that is two calls of four, so that each half's weights are dead
/// before the next half's are loaded: the kernels that hold rows in registers have no room
/// for all eight at once.
///
/// # Safety
/// As for [`read_cached`].
#[inline(always)]
pub unsafe fn for_each_weight_pack<G: Element, W: Element, const READ_ONLY: bool>(
    v: *const W,
    start: u32,
    len: usize,
    mut f: impl FnMut(usize, usize, &Pack),
) {
    if len <= W::PACK {
        // SAFETY: the caller's guarantee.
        return f(0, len, &unsafe { read_cached::<G, W, READ_ONLY>(v, start, len) });
    }
    let step = W::PACK;
    for q in 0..MAX_PACK / W::PACK {
        let at = q * step;
        if at < len {
            // SAFETY: the caller's guarantee; `at` is a whole pack of weights into the chunk.
            f(at, step, &unsafe {
                read_cached::<G, W, READ_ONLY>(v, start + at as u32, step)
            });
        }
    }
}

/// Writes the first `len` entries of `v` to `row[start..]`, as [`read`] reads them.
///
/// # Safety
/// The elements must be in bounds, and a whole pack aligned.
#[inline(always)]
pub unsafe fn write<T: Element>(row: *mut T, start: u32, len: usize, v: &Pack) {
    // SAFETY: the caller's guarantee.
    unsafe { write_as::<T, T, false>(row, start, len, v) }
}

/// As [`write`], in chunks of row type `G`, as [`read_as`] reads them; `EVICT_FIRST` as for
/// [`store_pack`].
///
/// # Safety
/// The elements must be in bounds, and a vector aligned to its size.
#[inline(always)]
pub unsafe fn write_as<G: Element, T: Element, const EVICT_FIRST: bool>(
    row: *mut T,
    start: u32,
    len: usize,
    v: &Pack,
) {
    // SAFETY: the caller guarantees bounds and, for a vector, alignment.
    unsafe {
        let p = row.add(start as usize);
        if len == G::PACK {
            store_pack::<G, T, EVICT_FIRST>(p, T::pack(v))
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
