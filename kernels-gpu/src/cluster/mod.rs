//! Thread-block clusters (sm_90, Hopper): `C` blocks the hardware schedules together on one
//! GPC, each able to read the others' shared memory (distributed shared memory, DSMEM).
//!
//! The backward uses them for rows whose partial dgamma/dbeta (8 bytes per column) would not
//! fit one block's shared memory: the C blocks split the row into C slices, each keeps its
//! slice's partials in its own shared memory, and the row's two sums are exchanged through
//! DSMEM, 8 bytes per block and row.
//!
//! Only in the sm_90 module (`cfg(layernorm_sm90)`): these instructions do not exist before.

mod backward;

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
/// Exchange protocol, one cluster barrier phase per row: each `sum2` writes its row sums
/// into one of two slots (rows alternate), arrives (release) and waits (acquire), then reads
/// that slot of all C blocks. A block writes a slot again only two rows later, after the
/// wait of the row between, which every block reaches only once it has read the slot
/// (its arrival releases its reads too). [`Cluster::end`] arrives and waits once more, so
/// no block exits while another may still read its slots.
pub struct Cluster<const C: u32>;

impl<const C: u32> Cluster<C> {
    /// This block's rank in the cluster.
    #[inline(always)]
    pub fn block_rank() -> u32 {
        cluster_rank()
    }

    /// Before the first row: no row exchanged yet.
    #[inline(always)]
    pub fn begin() {
        if device::thread_idx() == 0 {
            // SAFETY: the round counter lies in the cluster scratch the host sized; only
            // thread 0 writes it, and the first `sum2`'s barriers order this write.
            unsafe { shared_ptr::<u32>(ROUND_OFFSET).write(0) };
        }
    }

    /// After the last row: every block has finished reading every slot.
    #[inline(always)]
    pub fn end() {
        arrive();
        wait();
    }
}

/// Byte offset of a block's two exchange slots (a row's two sums, 8 bytes each; rows
/// alternate between them) in dynamic shared memory: right after the block reductions'
/// scratch.
const EXCHANGE_OFFSET: u32 = SCRATCH_BYTES;

/// Byte offset of the block's count of rows exchanged so far (its parity picks the slot).
const ROUND_OFFSET: u32 = EXCHANGE_OFFSET + 16;

/// Dynamic shared memory of a cluster kernel before its partial rows: the block
/// reductions' scratch, the two exchange slots and the round count (32 bytes, keeping the
/// rows 16-byte aligned). Columns of each block's slice: whole packs.
pub use crate::layout::{CLUSTER_SCRATCH_BYTES, slice_width};

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
        let round = shared_ptr::<u32>(ROUND_OFFSET);
        if device::thread_idx() == 0 {
            // SAFETY: the counter and both slots lie in the cluster scratch the host sized.
            // Block::sum2's barriers put this after every thread's read of the counter in
            // the previous row; the slot was last read by the other blocks two rows ago,
            // before their arrivals of the previous row, which this thread waited for.
            unsafe {
                let k = round.read();
                shared_ptr::<[f32; 2]>(EXCHANGE_OFFSET + 8 * (k % 2)).write([a, b]);
                round.write(k + 1);
            }
        }
        arrive();
        wait();
        // SAFETY: thread 0 wrote the counter before its release arrival, waited for above.
        let slot = EXCHANGE_OFFSET + 8 * ((unsafe { round.read() } - 1) % 2);
        let (mut sa, mut sb) = (0.0f32, 0.0f32);
        for q in 0..C {
            // SAFETY: block q wrote this row's slot before its release arrival, which this
            // thread waited for, and writes it again only after this thread's next arrival,
            // before which it cannot exit either.
            let (qa, qb) = unsafe { read_remote_pair(slot, q) };
            sa += qa;
            sb += qb;
        }
        (sa, sb)
    }
}
