//! What the kernels (`kernels-gpu/src`) and the host (`host/gpu`) must agree on, written once:
//! how many 16-byte packs a thread holds in each kernel, how each kernel lays out its dynamic
//! shared memory, the cluster sizes, and stage 2's block. Both crates compile this module
//! (`#[path]` from each one's root, as `layout`), so a change here reaches the PTX and the
//! launches together (and build.rs hashes it with the kernel sources). A module, not a crate
//! of its own: a published crate then carries it in its one package.
//!
//! Everything is a `const` or a `const fn` of plain integers: the kernels use the values as
//! const generics and in address arithmetic, the host to size launches and check buffers.
pub mod params;
pub mod registry;

/// Bytes of one pack, the kernels' unit of vector access (`ld.global.v4.u32`).
pub const PACK_BYTES: u32 = 16;

/// Elements of a `bytes`-byte type in one pack: 4 f32, 8 f16 or bf16.
#[inline(always)]
pub const fn pack_len(bytes: u32) -> u32 {
    PACK_BYTES / bytes
}

/// Packs of x each rank of the general forward holds of a row that fits: 8 packs are 32
/// registers of raw words.
pub const FWD_HELD: u32 = 8;

/// Packs of x each rank of the pipelined forward holds for each of its two rows in flight.
pub const PIPE_HELD: u32 = 4;

/// Packs of x, and of the residual, each rank of the held residual forward
/// (`registry::Variant::FwdResidualHeld`) loads together: 2 * 4 packs are 32 registers of
/// its 64, and a block of 1024 ranks holds a 16-bit row of N = 32768 (f32: 16384).
pub const RESIDUAL_HELD: u32 = 4;

/// Packs of x, and of the residual, each rank of the held residual forward over rows shifted
/// alike past a 16-byte boundary (`registry::Variant::FwdResidualHeldShifted`, sm_90) loads
/// together, from the first one on: as many as the aligned rows' `RESIDUAL_HELD`, which fit
/// 59-64 registers in this kernel of its own (as an arm of the aligned held kernel, v82,
/// they spilled 32-64 bytes). A block of 1024 ranks holds a row of 4096 whole packs (16-bit
/// N < 32776, f32 N < 16388).
pub const RESIDUAL_HELD_SHIFTED: u32 = 4;

/// Packs of x each rank of the plain forward over rows shifted alike past a 16-byte boundary
/// (`registry::Variant::FwdHeldShifted`, sm_90) loads together, from the first one on: as
/// many as the row block holds of aligned rows (`PIPE_HELD`). A block of 1024 ranks holds a
/// row of 4096 whole packs (16-bit N < 32776, f32 N < 16388).
pub const FWD_HELD_SHIFTED: u32 = 4;

/// Packs of x each rank of LayerNorm's pipelined forward block team holds of the f32 rows
/// whose next row it stages (`registry::pipeline_stages`): with one row in registers, 6 fit
/// the 64 of its thread limit (8 spilled), and rows of up to 6144 packs (N = 24576) fit
/// 1024 ranks.
pub const STAGED_F32_HELD: u32 = 6;

/// Packs of x each rank of `norm`'s pipelined forward block team holds of rows of `packs`
/// packs of `x_bytes`-byte values.
#[inline(always)]
pub const fn pipelined_block_held(norm: registry::Norm, x_bytes: usize, packs: u32) -> u32 {
    if x_bytes == 4 && registry::pipeline_stages(norm, x_bytes, packs) {
        STAGED_F32_HELD
    } else {
        PIPE_HELD
    }
}

/// Dynamic shared memory of `norm`'s pipelined forward block team of `threads` over rows of
/// `packs` packs of `x_bytes`-byte values: its scratch, then where it stages its next row
/// (`registry::pipeline_stages`), a 16-byte slot for each of the packs a rank holds
/// ([`pipelined_block_held`]).
#[inline(always)]
pub const fn pipelined_smem(norm: registry::Norm, x_bytes: usize, packs: u32, threads: u32) -> u32 {
    if registry::pipeline_stages(norm, x_bytes, packs) {
        SCRATCH_BYTES + threads * pipelined_block_held(norm, x_bytes, packs) * PACK_BYTES
    } else {
        SCRATCH_BYTES
    }
}

/// Elements of x each rank of the few-rows forward (`registry::Variant::FwdFewRows`) holds,
/// with their gamma and beta: 16, as Liger's one-row launches take them (8 warps at N =
/// 4096). Where a multiprocessor has one row at most, its time is one rank's chain of
/// dependent instructions and a block's barriers; more elements a rank means fewer warps
/// for the reductions' barriers to wait for and each scheduler to issue.
pub const FEW_ROWS_ELEMENTS: u32 = 16;

/// Packs of x each rank of the few-rows forward holds of `bytes`-byte values: 2 of f16 or
/// bf16, 4 of f32.
#[inline(always)]
pub const fn few_rows_held(bytes: u32) -> u32 {
    FEW_ROWS_ELEMENTS / pack_len(bytes)
}

/// Elements of a row not 16-byte aligned that a rank reads at once, element by element,
/// before using any (`row::for_each_read`): one load at a time left a rank 2 to 4 bytes in
/// flight for DRAM's whole latency (docs/PERF.md v56).
pub const READ_BATCH_ELEMENTS: u32 = 8;

/// Read batches a rank of the forward's block team takes of rows not all aligned
/// (`plan::Planner::unaligned_block`), so that its reads are mostly whole batches: chosen
/// when a rank's last, short batch went a load at a time (docs/PERF.md v58, v60).
pub const UNALIGNED_BATCHES_PER_RANK: u32 = 4;

/// Packs of x each rank of the general forward holds of an aligned row too long to hold
/// whole; the rest is staged in shared memory. (With 8, the f32 kernel spills at its 64
/// registers.)
pub const PART_HELD: u32 = 4;

/// Dynamic shared memory of a forward block team that stages an aligned row of `packs`
/// whole packs past the `PART_HELD` a rank of its `threads` hold: its scratch, then
/// `copies` areas of one 16-byte slot per staged pack (x's; and the residual's, for the
/// residual forward, which forms s over x's copy).
#[inline(always)]
pub const fn staged_smem(packs: u32, threads: u32, copies: u32) -> u32 {
    SCRATCH_BYTES + copies * packs.saturating_sub(PART_HELD * threads) * PACK_BYTES
}

/// Packs of x and of dy each rank of the backward holds: 2 * 4 packs = 32 registers.
pub const BWD_HELD: u32 = 4;

/// Elements a rank of the backward's block team takes at once in each pass of a row read
/// element by element (`backward::streamed`, since v66: 8 bytes of 16-bit x and of dy in
/// flight a rank, where one at a time waited a DRAM round trip each).
pub const BWD_BATCH_ELEMENTS: u32 = 4;

/// Batches of [`BWD_BATCH_ELEMENTS`] a rank of the owned block kernel takes in each pass of
/// launches whose rows go element by element (`plan::Planner::element_rows_block`), in
/// place of 4 packs' columns a rank: fewer, larger teams, so fewer partial rows (and in
/// locked mode fewer blocks queued on each group's lock) and a shorter chain a row.
pub const BWD_UNALIGNED_BATCHES_PER_RANK: u32 = 2;

/// Whether the backward's block teams take rows of `n` elements of `bytes`-byte x, dy and
/// weights (one size) in 8-byte half packs where a row is 8-byte aligned: only in launches
/// whose rows are a whole number of half packs long, where each row is packed or in half
/// packs (with 8-byte aligned tensors). Where rows of three kinds met (f16 N = 1030 and
/// 4097, f32 4097) half packs ran 22-33% slower than elements (docs/PERF.md v67).
#[inline(always)]
pub const fn block_half_pack_rows(n: u32, bytes: u32) -> bool {
    (n as u64 * bytes as u64).is_multiple_of(PACK_BYTES as u64 / 2)
}

/// Whether `cols` columns (a row, or a cluster's slice of one) of `pack`-element packs fit
/// `held` packs a rank for `ranks` ranks.
#[inline(always)]
pub const fn fits(cols: u32, pack: u32, ranks: u32, held: u32) -> bool {
    cols.div_ceil(pack) <= ranks * held
}

/// Dynamic shared memory every kernel gets at least: the block reductions' 16-byte slot per
/// warp of a 1024-thread block.
pub const SCRATCH_BYTES: u32 = 32 * 16;

/// 8-byte slots in each of a cluster block's two exchange buffers: one per block of the
/// largest cluster.
pub const EXCHANGE_SLOTS: u32 = 8;

/// Bytes a cluster block keeps after [`SCRATCH_BYTES`] for the row sums' exchange: two
/// mbarriers of 8 bytes, two buffers (alternating rows) of [`EXCHANGE_SLOTS`] slots, and a
/// round count (16 bytes kept).
pub const CLUSTER_EXCHANGE_BYTES: u32 = 16 + 2 * 8 * EXCHANGE_SLOTS + 16;

/// A cluster block's scratch: the block reductions' and the exchange.
pub const CLUSTER_SCRATCH_BYTES: u32 = SCRATCH_BYTES + CLUSTER_EXCHANGE_BYTES;

/// Block teams a block may stack along y: team t synchronizes on named barrier 1 + t of the
/// 16 a block has, barrier 0 being the block's.
pub const MAX_STACKED: u32 = 15;

/// Blocks per cluster of the general cluster backward: the portable maximum.
pub const CLUSTER_SIZE: u32 = 8;

/// Blocks per cluster of the held cluster backward, fewest first (the host takes the fewest
/// whose slices fit).
pub const HELD_CLUSTER_SIZES: [u32; 3] = [2, 4, 8];

// Every block of a cluster has its slot in each exchange buffer.
const _: () = assert!(CLUSTER_SIZE <= EXCHANGE_SLOTS && HELD_CLUSTER_SIZES[2] <= EXCHANGE_SLOTS);

/// Columns of each block's slice when a cluster of `c` blocks shares a row of `n`: whole
/// packs of `pack` elements, so that every slice of an aligned row starts aligned.
#[inline(always)]
pub const fn slice_width(n: u32, pack: u32, c: u32) -> u32 {
    n.div_ceil(pack).div_ceil(c) * pack
}

/// Word of column `j` in a shared-memory partial row: one padding word after every 32, so a
/// warp's packs spread over all 32 banks (a pack from a multiple of its length never
/// straddles a padding word, since the pack length divides 32; a shifted row's may).
#[inline(always)]
pub const fn padded(j: u32) -> u32 {
    j + j / 32
}

/// Shared memory of an owned-mode block whose `teams` each sum their partials in shared
/// memory: the scratch, then per team a dgamma and a dbeta row of `n` padded words, plus one.
#[inline(always)]
pub const fn owned_local_smem(teams: u32, n: u32) -> usize {
    SCRATCH_BYTES as usize + teams as usize * 2 * 4 * (padded(n) as usize + 1)
}

/// 16-byte chunks of one rank's held partials (dgamma or dbeta) in the held backward:
/// `BWD_HELD` packs of `pack` f32.
#[inline(always)]
pub const fn held_chunks(pack: u32) -> u32 {
    BWD_HELD * pack / 4
}

/// Shared bytes of one held team of `ranks` ranks: every rank's dgamma and dbeta chunks.
#[inline(always)]
pub const fn held_team_bytes(pack: u32, ranks: u32) -> u32 {
    2 * held_chunks(pack) * ranks * 16
}

/// Shared memory of a held backward block of `threads` (all its teams' ranks) for elements
/// of `pack` per pack: the scratch, then every rank's partials.
#[inline(always)]
pub const fn held_smem(pack: u32, threads: u32) -> usize {
    SCRATCH_BYTES as usize + held_team_bytes(pack, threads) as usize
}

/// Byte offset, past a held block's partials ([`held_smem`]), of the rank's edge partials in
/// the held block kernel over shifted rows (`Variant::BwdHeldBlockShifted`): the block's
/// weights staged first, `cols` of `weight_bytes` rounded up to 16 bytes (its rows all sit
/// as far past a 16-byte boundary, so their packs' columns, and those weights, are the
/// same for every row it takes).
#[inline(always)]
pub const fn held_shifted_edges_at(pack: u32, threads: u32, cols: u32, weight_bytes: u32) -> usize {
    held_smem(pack, threads) + (cols as usize * weight_bytes as usize).next_multiple_of(16)
}

/// Shared memory of the held block kernel over shifted rows: [`held_shifted_edges_at`],
/// then each rank's dgamma and dbeta of its edge column (a 16-byte slot: one access each,
/// in both modules).
#[inline(always)]
pub const fn held_shifted_smem(pack: u32, threads: u32, cols: u32, weight_bytes: u32) -> usize {
    held_shifted_edges_at(pack, threads, cols, weight_bytes) + 16 * threads as usize
}

/// Blocks of the held block kernel over shifted rows of `n` elements of `pack` a pack come
/// in multiples of this: rows `b`, `b + B`, ... (a grid of B blocks) then sit equally far
/// past a 16-byte boundary, as B * n is a whole number of packs.
#[inline(always)]
pub const fn shifted_grid_multiple(n: u32, pack: u32) -> u32 {
    let mut k = 1;
    while !(k as u64 * n as u64).is_multiple_of(pack as u64) {
        k *= 2;
    }
    k
}

/// Shared memory of a general cluster block for rows of `n` (`pack` elements per pack): the
/// cluster scratch, then a padded dgamma and dbeta row of its slice.
#[inline(always)]
pub const fn cluster_smem(n: u32, pack: u32) -> usize {
    owned_local_smem(1, slice_width(n, pack, CLUSTER_SIZE)) + CLUSTER_EXCHANGE_BYTES as usize
}

/// Shared memory of a held cluster block of `threads`: the cluster scratch, then each rank's
/// partials.
#[inline(always)]
pub const fn cluster_held_smem(pack: u32, threads: u32) -> usize {
    held_smem(pack, threads) + CLUSTER_EXCHANGE_BYTES as usize
}

/// Stage 2's tile: 32 columns, read as 8 groups of 4 (one 16-byte load per group and row).
pub const STAGE2_GROUPS: u32 = 8;

/// Partial rows a stage 2 thread loads at once: its loads of both sums (8 of 16 bytes) are
/// in flight together, and their sums added in row order.
pub const STAGE2_BATCH: u32 = 4;

/// Slices of the partial rows a stage 2 block sums at once, a power of two: about
/// `STAGE2_BATCH` rows a slice, so that each thread's rows are one batch of loads and the
/// block's tree of slice sums is as short as that allows; 4 at least (a warp) and 128 at most
/// (1024 threads). One row a slice gave a block of 1024 threads over 128 rows 7 barriers
/// and a multiprocessor of its own, where 32 slices take 5 and leave room for more blocks
/// (H100, docs/PERF.md v47: the backward +2 to +4% at M = 4096 from N = 8192, up to +11% at
/// M = 64-512).
pub const fn stage2_slices(rows: u32) -> u32 {
    let slices = rows.div_ceil(STAGE2_BATCH).next_power_of_two();
    if slices < 4 {
        4
    } else if slices > 128 {
        128
    } else {
        slices
    }
}

/// Stage 2's block over `rows` partial rows: a thread per group and slice.
pub const fn stage2_threads(rows: u32) -> u32 {
    STAGE2_GROUPS * stage2_slices(rows)
}

/// Stage 2's shared memory over `rows` partial rows: a 16-byte slot for dgamma and one for
/// dbeta per thread.
pub const fn stage2_smem(rows: u32) -> u32 {
    2 * 16 * stage2_threads(rows)
}
