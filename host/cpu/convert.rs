//! Rows (or blocks of them) widened to f32 and narrowed back, for the CPU path: one call a
//! row or block, so that f16 and bf16 convert many elements an instruction rather than one
//! at a time.
//!
//! Two builds of each: portable (`half`'s slice conversions, which pick F16C at run time) and
//! one for CPUs with AVX2 and F16C, inlined into the CPU forward's AVX2 build, where the
//! conversions are 8 elements an instruction (`vcvtph2ps` / `vcvtps2ph` for f16, shifts and
//! integer adds for bf16, loads and stores for f32) with no call per chunk.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Row conversions of one storage type. Public only in name: this module is private, so the
/// trait is a bound of [`crate::Element`] that users can neither name nor implement.
pub trait RowConvert: Sized {
    /// `src` widened into `dst` (same lengths).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `src` narrowed into `dst` (same lengths), rounding to nearest even.
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// [`RowConvert::widen`], built for AVX2 and F16C (by default the portable one: a copy
    /// needs no other build).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        Self::widen(src, dst)
    }
    /// [`RowConvert::narrow`], built for AVX2 and F16C; the same results.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn narrow_avx2(src: &[f32], dst: &mut [Self]) {
        Self::narrow(src, dst)
    }
}

/// f32 rows need only a copy. In the AVX2 build it is a loop of 8-lane loads and stores
/// inlined into the row loop: the forward copies a block of 256 elements at a time, and
/// `copy_from_slice` made each block a call to memmove (the f32 forward with a residual
/// copies six blocks a step; it ran slower than when whole rows were copied).
impl RowConvert for f32 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        copy_avx2(src, dst)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn narrow_avx2(src: &[f32], dst: &mut [Self]) {
        copy_avx2(src, dst)
    }
}

/// `src` copied into `dst` (same lengths), 8 elements a load and a store.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn copy_avx2(src: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::{_mm256_loadu_ps, _mm256_storeu_ps};
    assert_eq!(src.len(), dst.len());
    let (src8, tail) = src.as_chunks::<8>();
    let (dst8, dst_tail) = dst.as_chunks_mut::<8>();
    for (s, d) in src8.iter().zip(dst8) {
        // SAFETY: `s` is 32 readable bytes and `d` 32 writable ones; both are unaligned
        // accesses, which these intrinsics allow.
        unsafe { _mm256_storeu_ps(d.as_mut_ptr(), _mm256_loadu_ps(s.as_ptr())) };
    }
    dst_tail.copy_from_slice(tail);
}

impl RowConvert for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
        assert_eq!(src.len(), dst.len());
        let (src8, tail) = src.as_chunks::<8>();
        let (dst8, dst_tail) = dst.as_chunks_mut::<8>();
        for (s, d) in src8.iter().zip(dst8) {
            // SAFETY: `s` is 16 readable bytes and `d` 32 writable ones; both are unaligned
            // accesses, which these intrinsics allow.
            unsafe {
                _mm256_storeu_ps(
                    d.as_mut_ptr(),
                    _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast())),
                )
            };
        }
        for (s, d) in tail.iter().zip(dst_tail) {
            *d = s.to_f32();
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn narrow_avx2(src: &[f32], dst: &mut [Self]) {
        use std::arch::x86_64::{
            _MM_FROUND_TO_NEAREST_INT, _mm_storeu_si128, _mm256_cvtps_ph, _mm256_loadu_ps,
        };
        assert_eq!(src.len(), dst.len());
        let (src8, tail) = src.as_chunks::<8>();
        let (dst8, dst_tail) = dst.as_chunks_mut::<8>();
        for (s, d) in src8.iter().zip(dst8) {
            // SAFETY: `s` is 32 readable bytes and `d` 16 writable ones; both are unaligned
            // accesses, which these intrinsics allow.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
                _mm_storeu_si128(d.as_mut_ptr().cast(), h);
            }
        }
        for (s, d) in tail.iter().zip(dst_tail) {
            *d = f16::from_f32(*s);
        }
    }
}

/// bf16 is the high half of an f32: widening is a shift.
#[inline(always)]
fn bf16_to_f32(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

/// f32 to bf16, rounding to nearest even (NaN stays a quiet NaN), as `bf16::from_f32` does,
/// but branch-free, so that a loop of it vectorizes.
#[inline(always)]
fn f32_to_bf16(v: f32) -> bf16 {
    let bits = v.to_bits();
    let rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
    let quiet_nan = (bits >> 16) | 0x40;
    bf16::from_bits(if v.is_nan() { quiet_nan } else { rounded } as u16)
}

impl RowConvert for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn widen_avx2(src: &[Self], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16_to_f32(s);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn narrow_avx2(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f32_to_bf16(s);
        }
    }
}
