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

use crate::device;
use crate::team::{Block, NarrowBlock, SCRATCH_BYTES, Team};

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
/// Release makes the thread wait for every load and store it has in flight (`MEMBAR.ALL.GPU`
/// before the arrival in the SASS), so rows do not pass it: only [`Cluster::begin`] and
/// [`Cluster::end`] do.
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

/// Sets up the mbarrier at `bar` (a [`device::shared_addr`]) for one arrival a phase, and
/// makes the setup visible to the cluster's asynchronous operations (`st.async` of other
/// blocks) once a cluster barrier has passed.
///
/// # Safety
/// `bar` is 8-byte aligned, inside the block's shared memory, and not in use as a barrier.
#[inline(always)]
unsafe fn init_barrier(bar: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "mbarrier.init.shared::cta.b64 [{bar}], 1;",
            "fence.mbarrier_init.release.cluster;",
            bar = in(reg32) bar,
            options(nostack)
        )
    }
}

/// Arrives once at the mbarrier `bar`, announcing `bytes` that asynchronous stores will
/// complete in its current phase (`mbarrier.arrive.expect_tx`; release at the block's
/// scope, which waits for nothing in flight to global memory).
///
/// # Safety
/// `bar` was set up by [`init_barrier`]; this is its phase's one arrival.
#[inline(always)]
unsafe fn arrive_expecting(bar: u32, bytes: u32) {
    // SAFETY: the caller guarantees the barrier and the phase.
    unsafe {
        asm!(
            "{{",
            ".reg .b64 %state;",
            "mbarrier.arrive.expect_tx.shared::cta.b64 %state, [{bar}], {bytes};",
            "}}",
            bar = in(reg32) bar, bytes = in(reg32) bytes,
            options(nostack)
        )
    }
}

/// Stores `[a, b]` at shared address `slot` of block `rank`'s shared memory and completes 8
/// bytes of the current phase of that block's mbarrier at shared address `bar` (`mapa` maps
/// each local address to that block's window, `st.async` writes and signals). The store is
/// asynchronous: this thread does not wait for it, nor for anything else in flight.
///
/// # Safety
/// `slot` (8-byte aligned) and `bar` are inside every block's shared memory, the barrier set
/// up and expecting the bytes in the phase they belong to; no thread of block `rank` reads
/// or writes the slot until that phase completes.
#[inline(always)]
unsafe fn send_pair(slot: u32, bar: u32, rank: u32, [a, b]: [f32; 2]) {
    // SAFETY: the caller guarantees the addresses and the phase.
    unsafe {
        asm!(
            "{{",
            ".reg .u32 %slot, %bar;",
            "mapa.shared::cluster.u32 %slot, {slot}, {rank};",
            "mapa.shared::cluster.u32 %bar, {bar}, {rank};",
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%slot], {{{a}, {b}}}, [%bar];",
            "}}",
            slot = in(reg32) slot, bar = in(reg32) bar, rank = in(reg32) rank,
            a = in(reg32) a, b = in(reg32) b,
            options(nostack)
        )
    }
}

/// Waits until the phase of parity `parity` of the mbarrier `bar` has completed (acquire at
/// the block's scope: what completed it, the asynchronous stores into this block's shared
/// memory among them, is visible after).
///
/// # Safety
/// `bar` was set up by [`init_barrier`], and that phase will complete.
#[inline(always)]
unsafe fn wait_phase(bar: u32, parity: u32) {
    loop {
        let done: u32;
        // SAFETY: the caller guarantees the barrier.
        unsafe {
            asm!(
                "{{",
                ".reg .pred %done;",
                "mbarrier.try_wait.parity.shared::cta.b64 %done, [{bar}], {parity};",
                "selp.u32 {done}, 1, 0, %done;",
                "}}",
                bar = in(reg32) bar, parity = in(reg32) parity, done = out(reg32) done,
                options(nostack)
            )
        }
        if done != 0 {
            return;
        }
    }
}

/// The `C` blocks of a cluster sharing one row, block `rank` taking columns
/// [rank * W, rank * W + W) of it (W = [`slice_width`]). Within the block it is a
/// [`Block`]; its `sum2` then adds the C blocks' sums in rank order, so every block of the
/// cluster gets the same bits.
///
/// Exchange protocol, no cluster barrier per row: each block has two exchange buffers (rows
/// alternate: the team's k-th row, round k, takes buffer k mod 2), each C slots of 8 bytes
/// and an mbarrier, and a count of the rounds exchanged, which every thread reads before
/// the block's reduction and thread 0 advances after it. For its row's sums, thread 0 of
/// block q arrives at its own buffer's mbarrier expecting 8C bytes, and stores the block's
/// pair into slot q of that buffer in every block of the cluster (`st.async`, which
/// completes 8 bytes of the receiver's phase); every thread waits for its buffer's phase,
/// then reads the C slots. Nothing waits for the next row's loads, which a cluster
/// barrier's release would (docs/PERF.md, v46). A block stores into a buffer again two
/// rounds later, after waiting for round k + 1, which needs every block's round k + 1 pair,
/// each sent after that block read round k's slots. [`Cluster::begin`] sets up the
/// mbarriers before any block stores; [`Cluster::end`] arrives and waits once, so no block
/// exits while another may still store into it.
pub struct Cluster<const C: u32>;

impl<const C: u32> Cluster<C> {
    /// This block's rank in the cluster.
    #[inline(always)]
    pub fn block_rank() -> u32 {
        cluster_rank()
    }

    /// Before the first row: no round exchanged yet, and both buffers' mbarriers set up, in
    /// every block of the cluster.
    #[inline(always)]
    pub fn begin() {
        if device::thread_idx() == 0 {
            // SAFETY: the count lies in the cluster scratch the host sized; the cluster
            // barrier below orders this write before every thread's first read.
            unsafe { device::store_shared_4(device::shared_addr(ROUND_OFFSET), 0) };
            for buffer in 0..2 {
                // SAFETY: the mbarrier lies in the cluster scratch the host sized, and nothing
                // uses it before the cluster barrier below.
                unsafe { init_barrier(barrier_addr(buffer)) };
            }
        }
        arrive();
        wait();
    }

    /// After the last row: every block has received every store into it.
    #[inline(always)]
    pub fn end() {
        arrive();
        wait();
    }
}

/// Byte offset of the exchange's two mbarriers (8 bytes each), then its two buffers of
/// [`EXCHANGE_SLOTS`] 8-byte slots, then the count of rounds exchanged (16 bytes kept), in
/// dynamic shared memory: right after the block reductions' scratch. (A count in shared
/// memory, not in a register the row loop would carry: the held rows leave none.)
const EXCHANGE_OFFSET: u32 = SCRATCH_BYTES;

/// Byte offset of the count of rounds exchanged so far (its parity picks the buffer).
const ROUND_OFFSET: u32 = EXCHANGE_OFFSET + 16 + 16 * EXCHANGE_SLOTS;

// The exchange's mbarriers, slots and count fit the scratch the host gives a cluster block.
const _: () = assert!(ROUND_OFFSET + 4 <= CLUSTER_SCRATCH_BYTES);

/// The shared address of buffer `buffer`'s mbarrier.
#[inline(always)]
fn barrier_addr(buffer: u32) -> u32 {
    device::shared_addr(EXCHANGE_OFFSET + 8 * buffer)
}

/// The byte offset of slot `q` of buffer `buffer`.
#[inline(always)]
fn slot_offset(buffer: u32, q: u32) -> u32 {
    EXCHANGE_OFFSET + 16 + 8 * (EXCHANGE_SLOTS * buffer + q)
}

/// Dynamic shared memory of a cluster kernel before its partial rows: the block
/// reductions' scratch and the exchange (keeping the rows 16-byte aligned). Columns of each
/// block's slice: whole packs.
pub use crate::layout::{CLUSTER_SCRATCH_BYTES, EXCHANGE_SLOTS, slice_width};

impl<const C: u32> Team for Cluster<C> {
    const PREFETCH_NEXT_ROW: bool = true;
    const PARTIALS_WITH_DX: bool = true;
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
        let counter = device::shared_addr(ROUND_OFFSET);
        // SAFETY: the count lies in the cluster scratch the host sized. Thread 0 wrote it
        // last before its arrival of the previous round, which this thread's wait acquired,
        // and writes it again only after the barriers of `NarrowBlock::sum2` below.
        let round = unsafe { device::load_shared_4(counter) };
        let (a, b) = NarrowBlock::sum2(a, b);
        let (buffer, parity) = (round % 2, round / 2 % 2);
        let bar = barrier_addr(buffer);
        if device::thread_idx() == 0 {
            let slot = device::shared_addr(slot_offset(buffer, cluster_rank()));
            // SAFETY: the count as above: every thread read it before the barriers, and the
            // arrival (release) orders this write before every thread's next read, after
            // its wait. The mbarrier and slots lie in every block's cluster scratch, set up
            // by `begin`; this is the buffer's phase for this round in every block (the
            // rounds go alike in all of them), whose one arrival is this block's thread 0,
            // and no block reads its slot q before the phase completes (see the protocol
            // above).
            unsafe {
                device::store_shared_4(counter, round + 1);
                arrive_expecting(bar, 8 * C);
            }
            // A loop, not C stores unrolled: their remote addresses would all be live at
            // once, where the held row leaves no registers.
            let mut q = 0;
            while q < device::opaque(C) {
                // SAFETY: as above.
                unsafe { send_pair(slot, bar, q, [a, b]) };
                q += 1;
            }
        }
        // SAFETY: the phase completes once thread 0 has arrived and every block's pair has
        // landed, which every block sends for this round.
        unsafe { wait_phase(bar, parity) };
        // In rank order, one slot at a time (a loop, as the stores: C slots in flight at
        // once would take 2C registers).
        let (mut sa, mut sb) = (0.0f32, 0.0f32);
        let mut q = 0;
        while q < device::opaque(C) {
            // SAFETY: slot q of this buffer was stored by block q in this round's phase,
            // which completed above, and is stored again only two rounds on.
            let [qa, qb] = unsafe { device::load_shared_8(device::shared_addr(slot_offset(buffer, q))) };
            sa += f32::from_bits(qa);
            sb += f32::from_bits(qb);
            q += 1;
        }
        (sa, sb)
    }
}
