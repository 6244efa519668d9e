//! LayerNorm on a CUDA device: takes each launch's kernel, block and kind of grid from
//! `crate::plan`, sizes a resident grid from the device's occupancy (queried once per
//! kernel and block), takes the backward's scratch from the stream's workspace
//! (gpu/workspace.rs), and queues the kernels. Shapes were checked by the op
//! (`crate::layer_norm`), which also ordered the tensors' memory for `gpu.stream`
//! (gpu/storage.rs). The scratch is used on `gpu.stream`
//! alone, so stream order is all it needs: it is plain cudarc slices, with no record.

use std::sync::PoisonError;

use cudarc::driver::CudaViewMut;

use super::Gpu;
use super::launch::{self, Backward, Forward, Launch, Sums, Team};
use super::module::Kernel;
use crate::element::{Element, Weight, pair_of};
use crate::error::Result;
use crate::plan::{Grid, Pass, Plan, TYPE_PAIRS, Variant, pack_len, plan_rows};

/// The team of a planned kernel.
fn team_of(plan: &Plan) -> Team {
    if plan.variant.warp_team() {
        Team::Warp
    } else {
        Team::Block
    }
}

/// The launch shape of `plan`, one block (the grid is sized next).
fn shape(plan: &Plan) -> Launch {
    Launch {
        blocks: 1,
        threads: plan.threads,
        stacked: plan.stacked,
        smem: plan.smem,
    }
}

/// `plan`'s grid of blocks ([`Grid`]): a team for every row, or as many blocks as the
/// device runs at once and no more than the rows need, whose teams loop over the rows.
fn grid(gpu: &Gpu, kernel: &Kernel, rows: u32, plan: &Plan) -> Result<Launch> {
    let shape = shape(plan);
    let every_row = rows.div_ceil(shape.teams_per_block(team_of(plan))).max(1);
    let blocks = match plan.grid {
        Grid::EveryRow => every_row,
        Grid::Resident => {
            let per_sm = kernel.blocks_per_sm(plan.threads * plan.stacked, plan.smem)?;
            (gpu.sm_count * per_sm).min(every_row).max(1)
        }
    };
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

/// Queues the forward of `[rows, n]` (rows, n >= 1), with a residual stream of `R` where
/// there is a residual (planned as rows of `R`: `crate::plan::plan_f32_stream`).
pub(crate) fn forward<T: Element, W: Weight<T>, R: Element>(
    gpu: &Gpu,
    a: Forward<'_, T, W, R>,
) -> Result<()> {
    let (pass, pair) = if a.residual.is_some() {
        (Pass::ForwardResidual, pair_of::<T, W, R>())
    } else {
        (Pass::Forward, W::PAIR)
    };
    let (types, limits) = (TYPE_PAIRS[pair], gpu.kernels.limits);
    let plan = if pass == Pass::Forward {
        plan_rows::<T>(a.norm, types, a.rows, a.n, pass, a.alignment(), limits)?
    } else {
        plan_rows::<R>(a.norm, types, a.rows, a.n, pass, a.alignment(), limits)?
    };
    let kernel = gpu.kernels.of_pair(a.norm, pair)?.any(plan.variant);
    let launch = grid(gpu, kernel, a.rows, &plan)?;
    launch::forward(gpu, kernel, launch, a)
}

/// Blocks (or clusters) the locked mode's default groups take each, at most.
const LOCKED_BLOCKS_PER_GROUP: u32 = 2;

/// The locked mode's group count where the caller names none, for a launch of `units`
/// blocks (or clusters): the tutorial's for rows of `n` (more groups for short rows, where
/// many rows finish at once and would otherwise queue on few locks), or more, so that no
/// group takes more than [`LOCKED_BLOCKS_PER_GROUP`] blocks. The tutorial takes a lock per
/// row; we take one per block, so a launch's blocks, not its rows, queue on the locks, and
/// launches of many small blocks (the owned block kernel's 64-160-rank teams, 6-10 a
/// multiprocessor) queued 6-10 to a group: f32 N = 1030 ran at half the deterministic
/// mode's speed there, f16 N = 4097 on 2 blocks a group at 95% of it (H200, docs/PERF.md v70).
fn default_groups(n: u32, units: u32) -> u32 {
    let tutorial = match n {
        0..=1024 => 256,
        1025..=4096 => 128,
        4097..=8192 => 96,
        _ => 64,
    };
    tutorial.max(units.div_ceil(LOCKED_BLOCKS_PER_GROUP))
}

/// How stage 1's blocks hand their sums of dgamma and dbeta over. The op converts its
/// `BackwardMode` to this, the group count resolved, so that this layer does not depend on
/// the op. The kernels are the same either way.
#[derive(Clone, Copy)]
pub(crate) enum Reduction {
    /// Each block (or cluster) owns a partial row; stage 2 adds them in a fixed order.
    Owned,
    /// Block (or cluster) u adds its sums into group u mod `groups` (>= 1; `None`: as
    /// [`default_groups`] picks) under that group's spinlock.
    Locked { groups: Option<u32> },
}

/// `sums`, or for a parameter the op lacks, `n` sums of `W` in `spare`, the room the
/// workspace keeps past the partial rows, which stage 2 writes and nothing reads.
fn or_spare<'a, W>(
    sums: Option<CudaViewMut<'a, W>>,
    spare: &'a mut CudaViewMut<'_, f32>,
    n: u32,
) -> CudaViewMut<'a, W> {
    sums.unwrap_or_else(|| {
        // SAFETY: f32 room for n values holds n of W (2 or 4 bytes, 4-byte aligned), and
        // stage 2 only writes them.
        unsafe { spare.transmute_mut::<W>(n as usize) }
            .unwrap_or_else(|| unreachable!("n f32 hold n sums of W"))
    })
}

/// Queues the backward of `[rows, n]` (rows, n >= 1) of rows of `R` (x, or a residual
/// forward's s): stage 1 then stage 2. The sums of a parameter the op lacks (`None`: no
/// beta, or no weights at all) go to the workspace, past the partial rows, and are dropped:
/// the kernels write both sums, and a call allocates nothing for them.
pub(crate) fn backward<T: Element, W: Weight<T>, R: Element>(
    gpu: &Gpu,
    mode: Reduction,
    stage1: Backward<'_, T, W, R>,
    dgamma: Option<CudaViewMut<'_, W>>,
    dbeta: Option<CudaViewMut<'_, W>>,
) -> Result<()> {
    let (rows, n) = (stage1.rows, stage1.n);
    // Held until stage 2 is queued: the buffers are this stream's, reused call after call.
    let mut workspace = gpu.workspace.lock().unwrap_or_else(PoisonError::into_inner);
    let pass = if stage1.dsum.is_some() {
        Pass::BackwardResidual
    } else {
        Pass::Backward
    };
    let pair = pair_of::<T, W, R>();
    let plan = plan_rows::<R>(
        stage1.norm,
        TYPE_PAIRS[pair],
        rows,
        n,
        pass,
        stage1.alignment(),
        gpu.kernels.limits,
    )?;
    let team = team_of(&plan);
    let kernels = gpu.kernels.of_pair(stage1.norm, pair)?;
    let kernel = kernels.any(plan.variant);
    // The launch, its units (blocks, or clusters of `slices` blocks: one partial row each in
    // owned mode) and whether its blocks keep their sums in a row of global memory.
    let slices = plan.variant.cluster();
    let (launch, units, own_rows) = if slices > 1 {
        let clusters = kernel
            .active_clusters(&gpu.stream, slices, plan.threads, plan.smem)?
            .min(rows);
        let launch = Launch {
            blocks: clusters * slices,
            ..shape(&plan)
        };
        (launch, clusters, false)
    } else if matches!(
        plan.variant,
        Variant::BwdHeldWarp | Variant::BwdHeldBlock | Variant::BwdHeldBlockHalves
    ) {
        let launch = balanced(grid(gpu, kernel, rows, &plan)?, rows, team);
        (launch, launch.blocks, false)
    } else if plan.variant == Variant::BwdHeldBlockShifted {
        // Blocks in whole multiples of the rows' period, so that each block's rows sit alike:
        // fewer where the device runs that many, else one period (a launch of few rows).
        let period = crate::layout::shifted_grid_multiple(n, pack_len::<R>());
        let launch = balanced(grid(gpu, kernel, rows, &plan)?, rows, team);
        let blocks = (launch.blocks / period).max(1) * period;
        (Launch { blocks, ..launch }, blocks, false)
    } else {
        let launch = grid(gpu, kernel, rows, &plan)?;
        (launch, launch.blocks, !plan.local)
    };
    // Every unit writes every column of its partial row; in locked mode, every group gets a
    // unit (no more groups than units), and its first holder writes it (count word 0) before
    // others add to it; the blocks' own rows, where they keep them, follow the 2G group rows.
    // Each buffer holds its rows, then n f32 of room for a dropped parameter's n sums (W is
    // at most 4 bytes).
    let (mut parts_dgamma, mut parts_dbeta, buffer_rows, part_rows, mut locks) = match mode {
        Reduction::Owned => {
            let (pg, pb) = workspace.partials(&gpu.stream, (units as usize + 1) * n as usize)?;
            (pg, pb, units as usize, units, None)
        }
        Reduction::Locked { groups } => {
            let groups = groups.unwrap_or_else(|| default_groups(n, units)).min(units);
            let buffer_rows = 2 * groups as usize + if own_rows { units as usize } else { 0 };
            let words = 2 * (groups * slices) as usize;
            let (pg, pb, words) = workspace.locked(&gpu.stream, (buffer_rows + 1) * n as usize, words)?;
            // Stage 2 sums the compensation rows with the sums.
            (pg, pb, buffer_rows, 2 * groups, Some((words, groups)))
        }
    };
    let rows_len = buffer_rows * n as usize;
    let (mut parts_dgamma, mut spare_dgamma) = parts_dgamma.split_at_mut(rows_len);
    let (mut parts_dbeta, mut spare_dbeta) = parts_dbeta.split_at_mut(rows_len);
    let (mut dgamma, mut dbeta) = (
        or_spare(dgamma, &mut spare_dgamma, n),
        or_spare(dbeta, &mut spare_dbeta, n),
    );
    let sums = Sums {
        dgamma: &mut parts_dgamma,
        dbeta: &mut parts_dbeta,
        locks: locks.as_mut().map(|(words, groups)| (words, *groups)),
    };
    match plan.variant {
        v if v.cluster() > 1 => launch::backward_cluster(gpu, v, launch, stage1, sums)?,
        v if v.held_unclustered() => launch::backward_held(gpu, v, launch, stage1, sums)?,
        _ => launch::backward_owned(gpu, team, launch, stage1, sums, plan.local)?,
    }
    launch::backward_reduce(
        gpu,
        kernels.any(Variant::BwdReduce),
        (&parts_dgamma, &parts_dbeta),
        part_rows,
        n,
        &mut dgamma,
        &mut dbeta,
    )
}
