//! The few GPU primitives `core` does not give us, each a line or two of PTX.
//!
//! Everything here is `#[inline(always)]`: these are single instructions, and a call
//! boundary in PTX would cost more than the instruction itself.

use core::arch::asm;
use core::arch::nvptx;

// The kernels' dynamic shared memory. The host sizes it at launch (`SCRATCH_BYTES` in
// `team.rs` is the most any kernel uses); `.extern` makes PTX take its size from the launch.
core::arch::global_asm!(".extern .shared .align 16 .b8 dynamic_smem[];");

/// Index of this thread inside its block (x dimension).
#[inline(always)]
pub fn thread_idx() -> u32 {
    // SAFETY: reads the %tid.x special register; no memory is touched.
    unsafe { nvptx::_thread_idx_x() as u32 }
}

/// Number of threads in the block (x dimension).
#[inline(always)]
pub fn block_dim() -> u32 {
    // SAFETY: reads the %ntid.x special register.
    unsafe { nvptx::_block_dim_x() as u32 }
}

/// Index of this thread along the block's y dimension (the block's teams stacked: see
/// `team::Block`).
#[inline(always)]
pub fn thread_idx_y() -> u32 {
    // SAFETY: reads the %tid.y special register.
    unsafe { nvptx::_thread_idx_y() as u32 }
}

/// Number of threads along the block's y dimension.
#[inline(always)]
pub fn block_dim_y() -> u32 {
    // SAFETY: reads the %ntid.y special register.
    unsafe { nvptx::_block_dim_y() as u32 }
}

/// Index of this block in the grid (x dimension).
#[inline(always)]
pub fn block_idx() -> u32 {
    // SAFETY: reads the %ctaid.x special register.
    unsafe { nvptx::_block_idx_x() as u32 }
}

/// Number of blocks in the grid (x dimension).
#[inline(always)]
pub fn grid_dim() -> u32 {
    // SAFETY: reads the %nctaid.x special register.
    unsafe { nvptx::_grid_dim_x() as u32 }
}

/// Lets the stream's next kernel, where the host launched it as this one's programmatic
/// dependent (stage 2 after stage 1, sm_90), start its blocks as this grid's blocks reach
/// here rather than after the last of them ends (`griddepcontrol.launch_dependents`): its
/// launch overlaps this grid's work. It orders no memory: the dependent reads nothing of
/// this grid's before [`wait_for_prerequisite_grid`]. Nothing on sm_80, which has no such
/// launch.
#[inline(always)]
pub fn allow_dependent_launch() {
    #[cfg(layernorm_sm90)]
    // SAFETY: a scheduling hint; it touches no memory and is valid in any thread.
    unsafe {
        asm!("griddepcontrol.launch_dependents;", options(nostack, nomem))
    }
}

/// Waits until the grid this one was launched as a programmatic dependent of has ended and
/// its memory writes are visible (`griddepcontrol.wait`); returns at once for a grid
/// launched without that attribute. Kernels launched that way call it before they touch
/// global memory. Nothing on sm_80.
#[inline(always)]
pub fn wait_for_prerequisite_grid() {
    #[cfg(layernorm_sm90)]
    // SAFETY: a wait; no `nomem`, so the compiler keeps every memory access after it.
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack))
    }
}

/// Block-wide barrier (`bar.sync 0`). Every thread of the block must reach it; global and
/// shared memory writes made before it are visible to the block's threads after it.
#[inline(always)]
pub fn sync_block() {
    // SAFETY: a barrier; callers keep it on a block-uniform control path.
    unsafe { nvptx::_syncthreads() }
}

/// [`sync_block`] that also hands every thread whether any thread's `p` was true
/// (`bar.red.or.pred`): one thread's flag reaches the whole block without shared memory.
#[inline(always)]
pub fn sync_block_any(p: bool) -> bool {
    let out: u32;
    // SAFETY: a barrier with a reduction; callers keep it on a block-uniform control path.
    unsafe {
        asm!(
            "{{",
            ".reg .pred %p, %q;",
            "setp.ne.u32 %p, {i}, 0;",
            "bar.red.or.pred %q, 0, %p;",
            "selp.u32 {o}, 1, 0, %q;",
            "}}",
            i = in(reg32) p as u32,
            o = out(reg32) out,
            options(nostack)
        )
    }
    out != 0
}

/// `fence.acq_rel.gpu`: orders this thread's memory accesses before it against those after
/// it, at the GPU's scope.
#[inline(always)]
pub fn fence_gpu() {
    // SAFETY: a fence; no `nomem`, so the compiler keeps memory accesses on their side.
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) }
}

/// `atom.acquire.gpu.cas`: sets the word at `p` to `new` where it holds `old`; returns what
/// it held.
///
/// # Safety
/// `p` points to a global u32 that is only accessed atomically.
#[inline(always)]
pub unsafe fn cas_acquire_gpu(p: *mut u32, old: u32, new: u32) -> u32 {
    let was: u32;
    // SAFETY: the caller's guarantee.
    unsafe {
        asm!(
            "atom.acquire.gpu.global.cas.b32 {w}, [{p}], {o}, {n};",
            w = out(reg32) was,
            p = in(reg64) p,
            o = in(reg32) old,
            n = in(reg32) new,
            options(nostack)
        )
    }
    was
}

/// `ld.relaxed.gpu`: the word at `p` as the GPU holds it.
///
/// # Safety
/// As for [`cas_acquire_gpu`].
#[inline(always)]
pub unsafe fn load_relaxed_gpu(p: *const u32) -> u32 {
    let v: u32;
    // SAFETY: the caller's guarantee.
    unsafe {
        asm!("ld.relaxed.gpu.global.u32 {v}, [{p}];", v = out(reg32) v, p = in(reg64) p, options(nostack))
    }
    v
}

/// `st.relaxed.gpu` (`RELEASE`: `st.release.gpu`) of `v` at `p`.
///
/// # Safety
/// As for [`cas_acquire_gpu`].
#[inline(always)]
pub unsafe fn store_gpu<const RELEASE: bool>(p: *mut u32, v: u32) {
    // SAFETY: the caller's guarantee.
    unsafe {
        if RELEASE {
            asm!("st.release.gpu.global.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack))
        } else {
            asm!("st.relaxed.gpu.global.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack))
        }
    }
}

/// Barrier `id` (0..16) over the first `count` threads to reach it (`barrier.sync id,
/// count`; `count` a multiple of 32): lets several teams of one block synchronize apart.
/// The same visibility guarantee as [`sync_block`] among those threads.
#[inline(always)]
pub fn sync_threads(id: u32, count: u32) {
    // SAFETY: a barrier; callers give each group of `count` threads its own id, keep it on a
    // group-uniform control path, and never reuse an id for a different count meanwhile.
    unsafe { asm!("barrier.sync {id}, {n};", id = in(reg32) id, n = in(reg32) count, options(nostack)) }
}

/// Warp-wide barrier over all 32 lanes (`bar.warp.sync`), the same guarantee for one warp.
#[inline(always)]
pub fn sync_warp() {
    // SAFETY: all 32 lanes of the warp take part; callers keep it warp-uniform.
    unsafe { asm!("bar.warp.sync 0xffffffff;", options(nostack)) }
}

/// `v` from the lane `lane ^ mask` (butterfly exchange over the full warp).
#[inline(always)]
pub fn shfl_xor(v: f32, mask: u32) -> f32 {
    let out: f32;
    // SAFETY: register-only warp exchange; all 32 lanes execute it (full member mask).
    unsafe {
        asm!("shfl.sync.bfly.b32 {o}, {v}, {m}, 0x1f, 0xffffffff;",
             o = out(reg32) out, v = in(reg32) v, m = in(reg32) mask, options(nostack, nomem));
    }
    out
}

/// `v` from lane `lane + delta`; lanes past 31 get their own `v` back.
#[inline(always)]
pub fn shfl_down(v: f32, delta: u32) -> f32 {
    let out: f32;
    // SAFETY: register-only warp exchange; all 32 lanes execute it (full member mask).
    unsafe {
        asm!("shfl.sync.down.b32 {o}, {v}, {d}, 0x1f, 0xffffffff;",
             o = out(reg32) out, v = in(reg32) v, d = in(reg32) delta, options(nostack, nomem));
    }
    out
}

/// `v` as lane `src` holds it, to every lane.
#[inline(always)]
pub fn shfl_idx(v: f32, src: u32) -> f32 {
    let out: f32;
    // SAFETY: register-only warp exchange; all 32 lanes execute it (full member mask).
    unsafe {
        asm!("shfl.sync.idx.b32 {o}, {v}, {s}, 0x1f, 0xffffffff;",
             o = out(reg32) out, v = in(reg32) v, s = in(reg32) src, options(nostack, nomem));
    }
    out
}

/// Correctly rounded square root (`sqrt.rn.f32`; `core` has no `f32::sqrt` without std).
#[inline(always)]
pub fn sqrt_rn(v: f32) -> f32 {
    let out: f32;
    // SAFETY: register-only arithmetic.
    unsafe {
        asm!("sqrt.rn.f32 {o}, {v};", o = out(reg32) out, v = in(reg32) v, options(pure, nomem, nostack))
    }
    out
}

/// IEEE f16 bits to f32 (exact).
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    let out: f32;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.f32.f16 {o}, {h};", o = out(reg32) out, h = in(reg16) bits, options(pure, nomem, nostack))
    }
    out
}

/// f32 to IEEE f16 bits, round to nearest even (overflow gives ±inf, as PyTorch's cast does).
#[inline(always)]
pub fn f32_to_f16(v: f32) -> u16 {
    let out: u16;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.f16.f32 {h}, {v};", h = out(reg16) out, v = in(reg32) v, options(pure, nomem, nostack))
    }
    out
}

/// bf16 bits to f32: bf16 is the top half of an f32, so this is exact.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits, round to nearest even (`cvt.rn.bf16.f32`, sm_80 and later).
#[inline(always)]
pub fn f32_to_bf16(v: f32) -> u16 {
    let out: u16;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.bf16.f32 {h}, {v};", h = out(reg16) out, v = in(reg32) v, options(pure, nomem, nostack))
    }
    out
}

/// Generic pointer to byte `offset` of the block's dynamic shared memory.
#[inline(always)]
pub fn shared_ptr<T>(offset: u32) -> *mut T {
    let base: u64;
    // SAFETY: takes the address of the module's shared array; no memory is touched.
    unsafe { asm!("cvta.shared.u64 {p}, dynamic_smem;", p = out(reg64) base, options(pure, nomem, nostack)) }
    (base + offset as u64) as *mut T
}

/// Bytes of dynamic shared memory this launch gave each block (`%dynamic_smem_size`).
#[inline(always)]
pub fn dynamic_smem_size() -> u32 {
    let r: u32;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u32 {r}, %dynamic_smem_size;", r = out(reg32) r, options(pure, nomem, nostack)) }
    r
}

/// Shared-window address (32 bits, for `ld.shared`/`st.shared`) of byte `offset` of the
/// block's dynamic shared memory.
#[inline(always)]
pub fn shared_addr(offset: u32) -> u32 {
    let base: u32;
    // SAFETY: takes the address of the module's shared array; no memory is touched.
    unsafe { asm!("mov.u32 {a}, dynamic_smem;", a = out(reg32) base, options(pure, nomem, nostack)) }
    base + offset
}

/// Loads 16 bytes of shared memory (`ld.shared.v4`).
///
/// # Safety
/// `addr` (a [`shared_addr`]) must be 16-byte aligned and inside the block's shared memory.
#[inline(always)]
pub unsafe fn load_shared_16(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees `addr` is aligned and inside shared memory.
    unsafe {
        asm!("ld.shared.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg32) addr, options(readonly, nostack));
    }
    [a, b, c, d]
}

/// Loads 8 bytes from shared memory (`ld.shared.v2`).
///
/// # Safety
/// `addr` must be 8-byte aligned and inside shared memory.
#[inline(always)]
pub unsafe fn load_shared_8(addr: u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    // SAFETY: the caller guarantees `addr` is aligned and inside shared memory.
    unsafe {
        asm!("ld.shared.v2.u32 {{{a}, {b}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, p = in(reg32) addr, options(readonly, nostack));
    }
    [a, b]
}

/// Loads 4 bytes from shared memory (`ld.shared`; the clusters' round count).
///
/// # Safety
/// `addr` must be 4-byte aligned and inside shared memory.
#[cfg(layernorm_sm90)]
#[inline(always)]
pub unsafe fn load_shared_4(addr: u32) -> u32 {
    let a: u32;
    // SAFETY: the caller guarantees `addr` is aligned and inside shared memory.
    unsafe {
        asm!("ld.shared.u32 {a}, [{p}];", a = out(reg32) a, p = in(reg32) addr, options(readonly, nostack));
    }
    a
}

/// Stores 4 bytes to shared memory (`st.shared`).
///
/// # Safety
/// As for [`load_shared_4`].
#[cfg(layernorm_sm90)]
#[inline(always)]
pub unsafe fn store_shared_4(addr: u32, v: u32) {
    // SAFETY: the caller guarantees `addr` is aligned and inside shared memory.
    unsafe { asm!("st.shared.u32 [{p}], {v};", p = in(reg32) addr, v = in(reg32) v, options(nostack)) }
}

/// Stores 16 bytes to shared memory (`st.shared.v4`).
///
/// # Safety
/// As for [`load_shared_16`].
#[inline(always)]
pub unsafe fn store_shared_16(addr: u32, v: [u32; 4]) {
    // SAFETY: the caller guarantees `addr` is aligned and inside shared memory.
    unsafe {
        asm!("st.shared.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
             p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2],
             d = in(reg32) v[3], options(nostack));
    }
}

/// Loads 16 bytes from global memory, bypassing L1 (`ld.global.cg`): data a kernel reads
/// once should not evict what it reads again (gamma, beta).
///
/// # Safety
/// `p` must be 16-byte aligned and valid for a 16-byte read.
#[inline(always)]
pub unsafe fn load_16(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees `p` is aligned and readable for 16 bytes.
    unsafe {
        asm!("ld.global.cg.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) p, options(readonly, nostack));
    }
    [a, b, c, d]
}

/// As [`load_16`], for a kernel's last read of these bytes where it reads other data back
/// from L2 (`ld.global.cs`: the line is cached evict-first, in L1 and L2), so that L2 gives
/// up this line before that data. Only where measured: over rows held in registers the same
/// hint on every load cost 3-5% (docs/PERF.md, v41).
///
/// # Safety
/// As for [`load_16`].
#[inline(always)]
pub unsafe fn load_16_evict_first(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees `p` is aligned and readable for 16 bytes.
    unsafe {
        asm!("ld.global.cs.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) p, options(readonly, nostack));
    }
    [a, b, c, d]
}

/// Copies 16 bytes from global to shared memory without passing through registers
/// (`cp.async.cg`, sm_80 and later): as many copies in flight as the thread issues, at no
/// register cost. The data is there for this thread after [`cp_async_wait_all`].
///
/// # Safety
/// `dst` (a [`shared_addr`]) and `src` 16-byte aligned, inside shared memory and valid for
/// a 16-byte read; nothing reads or writes `dst` until the wait.
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const u32) {
    // SAFETY: the caller guarantees both addresses.
    unsafe {
        asm!("cp.async.cg.shared.global [{d}], [{s}], 16;", d = in(reg32) dst, s = in(reg64) src, options(nostack))
    }
}

/// As [`cp_async_16`], for 8 bytes (`cp.async.ca`: the `.cg` form copies 16 only): four
/// f16/bf16 columns of x beside a row of f32.
///
/// # Safety
/// `dst` and `src` 8-byte aligned, inside shared memory and valid for an 8-byte read;
/// nothing reads or writes `dst` until the wait.
#[inline(always)]
pub unsafe fn cp_async_8(dst: u32, src: *const u32) {
    // SAFETY: the caller guarantees both addresses.
    unsafe {
        asm!("cp.async.ca.shared.global [{d}], [{s}], 8;", d = in(reg32) dst, s = in(reg64) src, options(nostack))
    }
}

/// Waits for this thread's [`cp_async_16`] and [`cp_async_8`] copies; their bytes are then
/// visible to it.
#[inline(always)]
pub fn cp_async_wait_all() {
    // SAFETY: waits on this thread's own copies; no memory is named.
    unsafe { asm!("cp.async.wait_all;", options(nostack)) }
}

/// Loads 16 bytes that other blocks of this launch read too (gamma, beta), kept in L1:
/// through the read-only data path (`ld.global.nc`) where `READ_ONLY`, else the coherent
/// one (`ld.global.ca`, in SASS a strong load at the multiprocessor's scope). The read-only
/// path gained 0.3-1.4% over the plain forwards; the streamed residual kernels keep the
/// coherent one, with which ptxas gives them their 54-63 registers rather than 32 (-4 to
/// -11% there; docs/PERF.md).
///
/// # Safety
/// `p` must be 16-byte aligned and valid for a 16-byte read; with `READ_ONLY`, no thread may
/// write those bytes while the kernel runs (the read-only path would not see the write).
#[inline(always)]
pub unsafe fn load_16_cached<const READ_ONLY: bool>(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees `p` is aligned and readable for 16 bytes, and unwritten
    // during the kernel where READ_ONLY.
    unsafe {
        if READ_ONLY {
            asm!("ld.global.nc.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
                 a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                 p = in(reg64) p, options(readonly, nostack));
        } else {
            asm!("ld.global.ca.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
                 a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                 p = in(reg64) p, options(readonly, nostack));
        }
    }
    [a, b, c, d]
}

/// Loads 8 bytes from global memory as [`load_16`] loads 16: half a pack of f16/bf16, four
/// columns, where a row of them is walked four columns at a time beside an f32 row.
///
/// # Safety
/// `p` must be 8-byte aligned and readable for 8 bytes.
#[inline(always)]
pub unsafe fn load_8(p: *const u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    // SAFETY: the caller guarantees `p` is aligned and readable for 8 bytes.
    unsafe {
        asm!("ld.global.cg.v2.u32 {{{a}, {b}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, p = in(reg64) p, options(readonly, nostack));
    }
    [a, b]
}

/// As [`load_8`], evict-first, as [`load_16_evict_first`] loads 16.
///
/// # Safety
/// As for [`load_8`].
#[inline(always)]
pub unsafe fn load_8_evict_first(p: *const u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    // SAFETY: the caller guarantees `p` is aligned and readable for 8 bytes.
    unsafe {
        asm!("ld.global.cs.v2.u32 {{{a}, {b}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, p = in(reg64) p, options(readonly, nostack));
    }
    [a, b]
}

/// As [`load_8`], through L1 as [`load_16_cached`] reads the weights.
///
/// # Safety
/// As for [`load_8`], and as for [`load_16_cached`] where `READ_ONLY`.
#[inline(always)]
pub unsafe fn load_8_cached<const READ_ONLY: bool>(p: *const u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    // SAFETY: the caller guarantees `p` is aligned and readable for 8 bytes, and unwritten
    // during the kernel where READ_ONLY.
    unsafe {
        if READ_ONLY {
            asm!("ld.global.nc.v2.u32 {{{a}, {b}}}, [{p}];",
                 a = out(reg32) a, b = out(reg32) b, p = in(reg64) p, options(readonly, nostack));
        } else {
            asm!("ld.global.ca.v2.u32 {{{a}, {b}}}, [{p}];",
                 a = out(reg32) a, b = out(reg32) b, p = in(reg64) p, options(readonly, nostack));
        }
    }
    [a, b]
}

/// Stores 8 bytes to global memory.
///
/// # Safety
/// `p` must be 8-byte aligned and writable for 8 bytes.
#[inline(always)]
pub unsafe fn store_8(p: *mut u32, v: [u32; 2]) {
    // SAFETY: the caller guarantees `p` is aligned and writable for 8 bytes.
    unsafe {
        asm!("st.global.v2.u32 [{p}], {{{a}, {b}}};",
             p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], options(nostack));
    }
}

/// As [`store_8`], cached evict-first (`st.global.cs`): bytes this kernel does not read
/// again, beside data it reads back from L2 (as [`load_16_evict_first`]).
///
/// # Safety
/// As for [`store_8`].
#[inline(always)]
pub unsafe fn store_8_evict_first(p: *mut u32, v: [u32; 2]) {
    // SAFETY: the caller guarantees `p` is aligned and writable for 8 bytes.
    unsafe {
        asm!("st.global.cs.v2.u32 [{p}], {{{a}, {b}}};",
             p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], options(nostack));
    }
}

/// Stores 16 bytes to global memory.
///
/// # Safety
/// `p` must be 16-byte aligned and valid for a 16-byte write.
#[inline(always)]
pub unsafe fn store_16(p: *mut u32, v: [u32; 4]) {
    // SAFETY: the caller guarantees `p` is aligned and writable for 16 bytes.
    unsafe {
        asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
             p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2],
             d = in(reg32) v[3], options(nostack));
    }
}

/// As [`store_16`], cached evict-first (`st.global.cs`), as [`store_8_evict_first`].
///
/// # Safety
/// As for [`store_16`].
#[inline(always)]
pub unsafe fn store_16_evict_first(p: *mut u32, v: [u32; 4]) {
    // SAFETY: the caller guarantees `p` is aligned and writable for 16 bytes.
    unsafe {
        asm!("st.global.cs.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
             p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2],
             d = in(reg32) v[3], options(nostack));
    }
}

/// Asks L2 to fetch the 128-byte line holding `p` (`prefetch.global.L2`); no value comes
/// back and nothing waits for it.
///
/// # Safety
/// `p` points into a global allocation.
#[inline(always)]
pub unsafe fn prefetch_l2(p: *const u8) {
    // SAFETY: a cache hint on a valid global address (the caller's guarantee).
    unsafe { asm!("prefetch.global.L2 [{p}];", p = in(reg64) p, options(readonly, nostack)) }
}

/// Loads one f32 through L2 only (`ld.global.cg`): the lock-guarded group buffers are
/// written by other multiprocessors, whose writes L1 (not coherent) would not see.
///
/// # Safety
/// `p` must be valid for a 4-byte read.
#[inline(always)]
pub unsafe fn load_f32_l2(p: *const f32) -> f32 {
    let out: f32;
    // SAFETY: the caller guarantees `p` is readable.
    unsafe {
        asm!("ld.global.cg.f32 {o}, [{p}];", o = out(reg32) out, p = in(reg64) p, options(readonly, nostack))
    }
    out
}

/// `v`, through an instruction the compiler must keep where it stands (`mov`, not `pure`).
/// Values computed from the result are then recomputed at each use instead of being kept
/// alive between uses: held raw words cost half the registers of their widened f16 values.
#[inline(always)]
pub fn opaque(v: u32) -> u32 {
    let out: u32;
    // SAFETY: a register move.
    unsafe { asm!("mov.b32 {o}, {i};", o = out(reg32) out, i = in(reg32) v, options(nomem, nostack)) }
    out
}

/// A pointer through [`opaque`]'s `mov`: addresses computed from it are computed again after
/// each such call, not kept alive across a loop.
#[inline(always)]
pub fn opaque_ptr<T>(p: *const T) -> *const T {
    let out: u64;
    // SAFETY: a register move.
    unsafe { asm!("mov.b64 {o}, {i};", o = out(reg64) out, i = in(reg64) p as u64, options(nomem, nostack)) }
    out as *const T
}

/// `a * b + c` rounded once (`fma.rn.f32`). rustc never contracts a multiply and an add
/// into one instruction, so without this every `a * b + c` costs two. LLVM's own fma
/// intrinsic rather than inline PTX, so that LLVM schedules it as any other arithmetic.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::f32::math::mul_add(a, b, c)
}

/// Two f32 to two IEEE f16 in one word, `lo` in the low half, round to nearest even
/// (`cvt.rn.f16x2.f32`, sm_80): one instruction where two conversions and a permute were.
#[inline(always)]
pub fn f32x2_to_f16x2(lo: f32, hi: f32) -> u32 {
    let out: u32;
    // SAFETY: register-only conversion (the first source goes to the upper half).
    unsafe {
        asm!("cvt.rn.f16x2.f32 {o}, {hi}, {lo};", o = out(reg32) out, hi = in(reg32) hi, lo = in(reg32) lo,
             options(pure, nomem, nostack))
    }
    out
}

/// As [`f32x2_to_f16x2`], to bfloat16 (`cvt.rn.bf16x2.f32`, sm_80).
#[inline(always)]
pub fn f32x2_to_bf16x2(lo: f32, hi: f32) -> u32 {
    let out: u32;
    // SAFETY: register-only conversion (the first source goes to the upper half).
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {o}, {hi}, {lo};", o = out(reg32) out, hi = in(reg32) hi, lo = in(reg32) lo,
             options(pure, nomem, nostack))
    }
    out
}
