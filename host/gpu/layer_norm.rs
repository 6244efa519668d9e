//! LayerNorm on a CUDA device: picks each launch's team and grid, allocates the backward's
//! scratch, and queues the kernels. Shapes were checked by the op (`crate::layer_norm`),
//! which also ordered the tensors' memory for `gpu.stream` (gpu/storage.rs). The scratch is
//! allocated, used and freed on `gpu.stream` alone, so stream order is all it needs: it is
//! plain cudarc slices, with no record.

use cudarc::driver::CudaSlice;

use layernorm_layout::registry::Variant;
use layernorm_layout::{HELD_CLUSTER_SIZES, MAX_STACKED};

use super::Gpu;
use super::kernels::{self, Backward, Forward, Kernel, Launch, SCRATCH_BYTES, Team};
use crate::element::Element;
use crate::error::{AllocContext, Result};

/// Rows of at most this many elements go one warp per row: a warp's 32 lanes hold a
/// 1024-element row in 4 (f16) or 8 (f32) packs each, while a block would idle most threads.
const WARP_ROW_MAX: u32 = 1024;

/// Warps per block for warp teams: 8 rows in flight per block.
const WARPS_PER_BLOCK: u32 = 8;

/// The team for rows of `n` elements.
fn team_for(n: u32) -> Team {
    if n <= WARP_ROW_MAX {
        Team::Warp
    } else {
        Team::Block
    }
}

/// Threads of a block team: about `packs_per_thread` 16-byte packs each, at least two warps,
/// at most what the kernel allows (its registers decide).
fn block_threads<T: Element>(kernel: &Kernel, n: u32, packs_per_thread: u32) -> u32 {
    let packs = n.div_ceil(kernels::pack_len::<T>());
    packs
        .div_ceil(packs_per_thread)
        .next_multiple_of(32)
        .clamp(64, kernel.max_threads)
}

/// A persistent grid of blocks of `threads` x `stacked` threads: as many blocks as the
/// device runs at once, and no more than the rows need; teams loop over the rows.
fn resident(
    gpu: &Gpu,
    kernel: &Kernel,
    rows: u32,
    team: Team,
    threads: u32,
    stacked: u32,
    smem: u32,
) -> Result<Launch> {
    let shape = Launch {
        blocks: 1,
        threads,
        stacked,
        smem,
    };
    let per_sm = kernel.blocks_per_sm(threads * stacked, smem)?;
    let blocks = (gpu.sm_count * per_sm)
        .min(rows.div_ceil(shape.teams_per_block(team)))
        .max(1);
    Ok(Launch { blocks, ..shape })
}

/// `launch` with the fewest blocks that leave no team more rows than it had: teams loop
/// over rows, so the busiest team sets the time, and every block costs the backward one
/// more partial row to write and sum (4096 rows on 660 teams is 7 rows for the busiest; 586
/// teams do the same in 7, with 74 fewer partial rows).
fn balanced(launch: Launch, rows: u32, team: Team) -> Launch {
    let per_block = launch.teams_per_block(team);
    let most = rows.div_ceil(launch.blocks * per_block);
    Launch {
        blocks: rows.div_ceil(most).div_ceil(per_block),
        ..launch
    }
}

/// A warp team's block: 8 warps, or fewer where the kernel's registers allow fewer.
fn warp_threads(kernel: &Kernel) -> u32 {
    (WARPS_PER_BLOCK * 32).min(kernel.max_threads)
}

/// Queues the forward of `[rows, n]` (rows, n >= 1).
pub(crate) fn forward<T: Element>(gpu: &Gpu, a: Forward<'_, T>) -> Result<()> {
    let (rows, n) = (a.rows, a.n);
    let k = gpu.kernels.of::<T>();
    let team = team_for(n);
    let (kernel, threads) = match team {
        Team::Warp => (k.any(Variant::FwdWarp), warp_threads(k.any(Variant::FwdWarp))),
        // Four packs per thread, up to eight where the block is capped: rows to 8 packs per
        // thread stay in registers (kernels-gpu/src/row.rs).
        Team::Block => (
            k.any(Variant::FwdBlock),
            block_threads::<T>(k.any(Variant::FwdBlock), n, 4),
        ),
    };
    // Rows that are all aligned whole packs, 4 a thread at most, take the pipelined kernel
    // (same launch bounds, so the same block).
    let pipelined = match team {
        Team::Warp => k.any(Variant::FwdPipelinedWarp),
        Team::Block => k.any(Variant::FwdPipelinedBlock),
    };
    let fits = kernels::fits_held::<T>(team, threads, n, kernels::PIPE_HELD);
    let (kernel, smem) = if a.packed && fits && threads <= pipelined.max_threads {
        (pipelined, SCRATCH_BYTES)
    } else {
        (kernel, kernels::forward_smem::<T>(gpu, team, threads, n))
    };
    let launch = resident(gpu, kernel, rows, team, threads, 1, smem)?;
    kernels::forward(gpu, kernel, launch, a)
}

/// The tutorial's group count for the locked mode: more groups for short rows, where many
/// rows finish at once and would otherwise queue on few locks.
pub(crate) fn default_groups(n: usize) -> u32 {
    match n {
        0..=1024 => 256,
        1025..=4096 => 128,
        4097..=8192 => 96,
        _ => 64,
    }
}

/// How stage 1 sums dgamma and dbeta over rows. The op converts its `BackwardMode` to this,
/// the group count resolved, so that this layer does not depend on the op.
#[derive(Clone, Copy)]
pub(crate) enum Reduction {
    /// Each team owns a partial row; stage 2 adds the partials in a fixed order.
    Owned,
    /// Row i adds into group i mod `groups` (>= 1) under that group's spinlock.
    Locked { groups: u32 },
}

/// Queues the backward of `[rows, n]` (rows, n >= 1): stage 1 then stage 2.
pub(crate) fn backward<T: Element>(
    gpu: &Gpu,
    mode: Reduction,
    stage1: Backward<'_, T>,
    dgamma: &mut CudaSlice<T>,
    dbeta: &mut CudaSlice<T>,
) -> Result<()> {
    let (rows, n) = (stage1.rows, stage1.n);
    let k = gpu.kernels.of::<T>();
    let team = team_for(n);
    let cluster = match (mode, team) {
        (Reduction::Owned, Team::Block) => cluster_for::<T>(gpu, n),
        _ => None,
    };
    let held = match (mode, cluster) {
        (Reduction::Owned, None) => held(gpu, team, &stage1),
        _ => None,
    };
    let (parts_dgamma, parts_dbeta, part_rows) = match (mode, cluster, held) {
        (Reduction::Owned, Some(general), _) => {
            // Slices held in registers where every row is aligned packs, over the fewest
            // blocks whose slices fit: fewer blocks wait at each row's cluster barrier.
            let mut held_kernels = HELD_CLUSTER_SIZES
                .iter()
                .filter_map(|&size| Some((size, k.get(Variant::cluster_held(size)?)?)));
            let held_slices = held_kernels.find_map(|(size, kernel)| {
                let slice = kernels::cluster_slice::<T>(n, size);
                let threads = block_threads::<T>(kernel, slice, 4);
                let smem = kernels::cluster_held_smem::<T>(threads);
                let fits = kernels::fits_held::<T>(Team::Block, threads, slice, kernels::BWD_HELD);
                (stage1.packed && fits && smem <= gpu.kernels.max_smem as usize).then_some((
                    kernel,
                    size,
                    threads,
                    smem as u32,
                ))
            });
            let (kernel, size, threads, smem) = held_slices.unwrap_or_else(|| {
                let slice = kernels::cluster_slice::<T>(n, kernels::CLUSTER_SIZE);
                (
                    general,
                    kernels::CLUSTER_SIZE,
                    block_threads::<T>(general, slice, 4),
                    kernels::cluster_smem::<T>(n) as u32,
                )
            });
            let clusters = kernel.active_clusters(gpu, size, threads, smem)?.min(rows);
            let launch = Launch {
                blocks: clusters * size,
                threads,
                stacked: 1,
                smem,
            };
            // Each cluster writes every column of its partial row (each block its slice).
            let (mut pg, mut pb) = alloc_partials(gpu, clusters as usize * n as usize)?;
            kernels::backward_cluster(gpu, held_slices.is_some(), size, launch, stage1, &mut pg, &mut pb)?;
            (pg, pb, clusters)
        }
        (Reduction::Owned, None, Some((kernel, threads, stacked))) => {
            let smem = kernels::held_smem::<T>(threads * stacked) as u32;
            let launch = balanced(
                resident(gpu, kernel, rows, team, threads, stacked, smem)?,
                rows,
                team,
            );
            // The held kernel writes every element of every block's partial row.
            let (mut pg, mut pb) = alloc_partials(gpu, launch.blocks as usize * n as usize)?;
            kernels::backward_held(gpu, team, launch, stage1, &mut pg, &mut pb)?;
            (pg, pb, launch.blocks)
        }
        (Reduction::Owned, None, None) => {
            // Block teams: 4 packs per thread, all held (`BWD_HELD`).
            // The fewest threads per row leave room for the most rows per multiprocessor at
            // the backward's 80 to 128 registers per thread.
            let (kernel, threads) = match team {
                Team::Warp => (
                    k.any(Variant::BwdOwnedWarp),
                    warp_threads(k.any(Variant::BwdOwnedWarp)),
                ),
                Team::Block => {
                    let kernel = k.any(Variant::BwdOwnedBlock);
                    (kernel, block_threads::<T>(kernel, n, 4))
                }
            };
            // Each team sums its rows' partials in its own shared memory (about 8n bytes)
            // when they fit; warp teams must (8 warps * 8.3 KB at n = 1024: every sm_80 and
            // later device has room, but one without gets an error, not a launch failure).
            let per_block = if team == Team::Warp { threads / 32 } else { 1 };
            let local_smem = kernels::owned_local_smem(per_block, n);
            if team == Team::Warp {
                kernels::check_smem(gpu, local_smem, "backward stage 1 (owned, warp per row)")?;
            }
            let local = local_smem <= gpu.kernels.max_smem as usize;
            let smem = if local { local_smem as u32 } else { SCRATCH_BYTES };
            let launch = resident(gpu, kernel, rows, team, threads, 1, smem)?;
            // The owned-mode kernel writes every element of every block's partial row.
            let (mut pg, mut pb) = alloc_partials(gpu, launch.blocks as usize * n as usize)?;
            kernels::backward_owned(gpu, team, launch, stage1, &mut pg, &mut pb, local)?;
            (pg, pb, launch.blocks)
        }
        (Reduction::Locked { groups }, _, _) => {
            // Groups beyond `rows` would get no row (row i goes to group i mod G = i), so
            // clamping changes nothing but leaves no group unwritten.
            let groups = groups.min(rows);
            // Every group row (and its compensation row) is written by its first holder
            // (count word 0) before it is added to, and all `groups` groups get a row since
            // groups <= rows.
            let (mut pg, mut pb) = alloc_partials(gpu, 2 * groups as usize * n as usize)?;
            let words_len = 2 * groups as usize;
            let mut words = gpu
                .stream
                .alloc_zeros::<u32>(words_len)
                .allocating(4 * words_len, "allocating locks")?;
            let (kernel, threads) = match team {
                Team::Warp => (
                    k.any(Variant::BwdLockedWarp),
                    warp_threads(k.any(Variant::BwdLockedWarp)),
                ),
                Team::Block => {
                    let kernel = k.any(Variant::BwdLockedBlock);
                    (kernel, block_threads::<T>(kernel, n, 4))
                }
            };
            let launch = resident(gpu, kernel, rows, team, threads, 1, SCRATCH_BYTES)?;
            kernels::backward_locked(gpu, team, launch, stage1, &mut pg, &mut pb, &mut words, groups)?;
            // Stage 2 sums the compensation rows with the sums.
            (pg, pb, 2 * groups)
        }
    };
    kernels::backward_reduce(gpu, &parts_dgamma, &parts_dbeta, part_rows, n, dgamma, dbeta)
}

/// The held stage 1 kernel and its block, `threads` x `stacked`, where it can run the owned
/// backward: every row whole aligned packs, held in registers at 4 packs a thread, with
/// room in shared memory for each rank's partials. A block takes as many teams as the
/// kernel's thread limit and shared memory allow (for block teams, stacked along y): the
/// same teams per multiprocessor as one-team blocks, since the limit is the registers',
/// but each block's teams add into one partial row, so there are fewer partial rows to
/// write and for stage 2 to read (f16 N = 4096: 128 rows of 16 KB, not 512).
fn held<'k, T: Element>(
    gpu: &'k Gpu,
    team: Team,
    a: &kernels::Backward<'_, T>,
) -> Option<(&'k Kernel, u32, u32)> {
    let k = gpu.kernels.of::<T>();
    // A team's ranks, and the most teams the kernel's thread limit allows a block.
    let (kernel, ranks, most) = match team {
        Team::Warp => {
            let kernel = k.any(Variant::BwdHeldWarp);
            (kernel, 32, kernel.max_threads / 32)
        }
        Team::Block => {
            let kernel = k.any(Variant::BwdHeldBlock);
            let ranks = block_threads::<T>(kernel, a.n, 4);
            (kernel, ranks, (kernel.max_threads / ranks).min(MAX_STACKED))
        }
    };
    // The most of those whose partials fit shared memory (each rank holds its own).
    let teams = (1..=most)
        .rev()
        .find(|&t| kernels::held_smem::<T>(ranks * t) <= gpu.kernels.max_smem as usize)?;
    let fits = kernels::fits_held::<T>(team, ranks, a.n, kernels::BWD_HELD);
    let (threads, stacked) = match team {
        Team::Warp => (32 * teams, 1),
        Team::Block => (ranks, teams),
    };
    (a.packed && fits).then_some((kernel, threads, stacked))
}

/// The cluster kernel, where it should run the owned backward of block-team rows of `n`:
/// on sm_90 and later, for rows that one block can neither hold in registers (4 packs a
/// thread) nor sum in shared memory (8n bytes), as long as an eighth of the row fits.
fn cluster_for<T: Element>(gpu: &Gpu, n: u32) -> Option<&Kernel> {
    let k = gpu.kernels.of::<T>();
    let kernel = k.get(Variant::BwdCluster8)?;
    let max_smem = gpu.kernels.max_smem as usize;
    let packs = n.div_ceil(kernels::pack_len::<T>());
    let one_block =
        kernels::owned_local_smem(1, n) <= max_smem && packs <= k.any(Variant::BwdOwnedBlock).max_threads * 4;
    (!one_block && kernels::cluster_smem::<T>(n) <= max_smem).then_some(kernel)
}

/// Two f32 partial buffers of `len`, uninitialized: stage 1 writes every element before
/// stage 2 reads it (each mode's comment says how).
fn alloc_partials(gpu: &Gpu, len: usize) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
    // SAFETY: uninitialized device memory, fully written by stage 1 before any read.
    let (dgamma, dbeta) = unsafe { (gpu.stream.alloc::<f32>(len), gpu.stream.alloc::<f32>(len)) };
    let during = "allocating the backward's partial sums";
    Ok((
        dgamma.allocating(4 * len, during)?,
        dbeta.allocating(4 * len, during)?,
    ))
}
