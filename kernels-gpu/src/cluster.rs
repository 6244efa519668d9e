//! Thread-block clusters (sm_90, Hopper): `C` blocks the hardware schedules together on one
//! GPC, each able to read the others' shared memory (distributed shared memory, DSMEM).
//!
//! The backward uses them for rows whose partial dgamma/dbeta (8 bytes per column) would not
//! fit one block's shared memory: the C blocks split the row into C slices, each keeps its
//! slice's partials in its own shared memory, and the row's two sums are exchanged through
//! DSMEM, 8 bytes per block and row.
//!
//! Only in the sm_90 module (`cfg(layernorm_sm90)`): these instructions do not exist before.

use core::arch::asm;

use crate::device::{self, shared_ptr};
use crate::team::{Block, SCRATCH_BYTES, Team};

/// This block's rank in its cluster (`%cluster_ctarank`).
#[inline(always)]
fn cluster_rank() -> u32 {
    let r: u32;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u32 {r}, %cluster_ctarank;", r = out(reg32) r, options(pure, nomem, nostack)) }
    r
}

/// This cluster's index in the grid (`%clusterid.x`).
#[inline(always)]
fn cluster_id() -> u32 {
    let r: u32;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u32 {r}, %clusterid.x;", r = out(reg32) r, options(pure, nomem, nostack)) }
    r
}

/// Clusters in the grid (`%nclusterid.x`).
#[inline(always)]
fn cluster_count() -> u32 {
    let r: u32;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u32 {r}, %nclusterid.x;", r = out(reg32) r, options(pure, nomem, nostack)) }
    r
}

/// Arrives at the cluster barrier. Its default semantics are release: shared memory this
/// thread wrote before is visible to any thread of the cluster after its matching [`wait`].
/// (`.relaxed` arrivals need PTX 8.0, which rustc reaches only through an unstable target
/// feature; the sm_90 module stays at PTX 7.8.)
#[inline(always)]
fn arrive() {
    // SAFETY: a barrier arrival; every thread of the cluster arrives, alternating with wait.
    unsafe { asm!("barrier.cluster.arrive.aligned;", options(nostack)) }
}

/// Waits until every thread of the cluster has arrived (acquire semantics).
#[inline(always)]
fn wait() {
    // SAFETY: a barrier wait matching this thread's previous arrival.
    unsafe { asm!("barrier.cluster.wait.aligned;", options(nostack)) }
}

/// The two f32 at byte `offset` of block `rank`'s dynamic shared memory (`mapa` maps the
/// local shared address to that block's window, `ld.shared::cluster` reads it).
///
/// # Safety
/// `offset` is 8-byte aligned and inside every block's shared memory; block `rank` < C
/// wrote it before a release arrival this thread has waited for, and does not exit before
/// this thread arrives again.
#[inline(always)]
unsafe fn read_remote_pair(offset: u32, rank: u32) -> (f32, f32) {
    let (a, b): (f32, f32);
    // SAFETY: the caller guarantees the address and the ordering.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 %base;",
            ".reg .u32 %local, %remote;",
            "mov.u64 %base, dynamic_smem;",
            "cvt.u32.u64 %local, %base;",
            "add.u32 %local, %local, {off};",
            "mapa.shared::cluster.u32 %remote, %local, {rank};",
            "ld.shared::cluster.v2.f32 {{{a}, {b}}}, [%remote];",
            "}}",
            off = in(reg32) offset, rank = in(reg32) rank,
            a = out(reg32) a, b = out(reg32) b,
            options(readonly, nostack)
        );
    }
    (a, b)
}

/// The `C` blocks of a cluster sharing one row, block `rank` taking columns
/// [rank * W, rank * W + W) of it (W = [`slice_width`]). Within the block it is a
/// [`Block`]; its `sum2` then adds the C blocks' sums in rank order, so every block of the
/// cluster gets the same bits.
///
/// Exchange protocol, two cluster barrier phases per row: each `sum2` waits for the
/// previous phase (every block is done reading the last row's slots), writes its slot,
/// arrives (release) and waits, reads all C slots, then arrives again ("done reading").
/// [`Cluster::begin`] makes the first arrival and [`Cluster::end`] the last wait,
/// so no block exits while another may still read its slot.
pub struct Cluster<const C: u32>;

impl<const C: u32> Cluster<C> {
    /// This block's rank in the cluster.
    #[inline(always)]
    pub fn block_rank() -> u32 {
        cluster_rank()
    }

    /// Before the first row: the arrival the first `sum2`'s wait matches.
    #[inline(always)]
    pub fn begin() {
        arrive();
    }

    /// After the last row: every block has finished reading every slot.
    #[inline(always)]
    pub fn end() {
        wait();
    }
}

/// Byte offset of a block's exchange slot (its row sums, 8 bytes) in dynamic shared
/// memory: right after the block reductions' scratch.
const EXCHANGE_OFFSET: u32 = SCRATCH_BYTES;

/// Dynamic shared memory of a cluster kernel before its partial rows: the block
/// reductions' scratch, then the exchange slot (16 bytes, keeping the rows 16-byte aligned).
pub const CLUSTER_SCRATCH_BYTES: u32 = SCRATCH_BYTES + 16;

/// Columns of each block's slice of an `n`-column row: whole packs of `pack` elements, so
/// that every slice of an aligned row starts aligned.
#[inline(always)]
pub fn slice_width(n: u32, pack: u32, c: u32) -> u32 {
    n.div_ceil(pack).div_ceil(c) * pack
}

impl<const C: u32> Team for Cluster<C> {
    const PREFETCH_NEXT_ROW: bool = true;
    #[inline(always)]
    fn rank() -> u32 {
        Block::rank()
    }
    #[inline(always)]
    fn size() -> u32 {
        Block::size()
    }
    #[inline(always)]
    fn id() -> u32 {
        cluster_id()
    }
    #[inline(always)]
    fn count() -> u32 {
        cluster_count()
    }
    #[inline(always)]
    fn sync() {
        Block::sync()
    }
    #[inline(always)]
    fn sum2(a: f32, b: f32) -> (f32, f32) {
        let (a, b) = Block::sum2(a, b);
        let slot = shared_ptr::<[f32; 2]>(EXCHANGE_OFFSET);
        // Every block has read the previous row's slots (their "done reading" arrivals).
        wait();
        if device::thread_idx() == 0 {
            // SAFETY: the slot lies in the cluster scratch the host sized.
            unsafe { slot.write([a, b]) };
        }
        arrive();
        wait();
        let (mut sa, mut sb) = (0.0f32, 0.0f32);
        for q in 0..C {
            // SAFETY: block q wrote its slot before its release arrival, which this thread
            // waited for; it cannot exit before this thread's next arrival.
            let (qa, qb) = unsafe { read_remote_pair(EXCHANGE_OFFSET, q) };
            sa += qa;
            sb += qb;
        }
        arrive();
        (sa, sb)
    }
    #[inline(always)]
    fn broadcast(v: u32) -> u32 {
        Block::broadcast(v)
    }
}
