//! LayerNorm on a CUDA device: picks each launch's team and grid, allocates the backward's
//! scratch, and queues the kernels. Shapes were checked by the op (`crate::layer_norm`).

use cudarc::driver::CudaSlice;

use super::Gpu;
use super::kernels::{self, Backward, Forward, Grid, Team};
use crate::element::Element;
use crate::error::{DriverContext, Result};
use crate::layer_norm::BackwardMode;

/// Rows of at most this many elements go one warp per row: a warp's 32 lanes hold a
/// 1024-element row in 4 (f16) or 8 (f32) packs each, while a block would idle most threads.
const WARP_ROW_MAX: u32 = 1024;

/// Threads a multiprocessor runs at once (Ampere and Hopper).
const THREADS_PER_SM: u32 = 2048;

/// The team for rows of `n` elements of `T`: a warp for short rows; else a block sized so
/// that each thread handles about four 16-byte packs, between 128 and 1024 threads.
fn team_for<T: Element>(n: u32) -> Team {
    if n <= WARP_ROW_MAX {
        return Team::Warp;
    }
    let pack = (16 / size_of::<T>()) as u32;
    let threads = n.div_ceil(pack * 4).next_multiple_of(32).clamp(128, 1024);
    Team::Block { threads }
}

/// A grid of at most as many teams as the device runs at once (`per_sm_cap` limits that
/// further), and no more than there are rows: each team loops over its rows.
fn resident_grid<T: Element>(gpu: &Gpu, rows: u32, n: u32, per_sm_cap: Option<u32>) -> Grid {
    let team = team_for::<T>(n);
    let per_sm = match team {
        Team::Warp => THREADS_PER_SM / 32,
        Team::Block { threads } => THREADS_PER_SM / threads,
    };
    let per_sm = per_sm_cap.map_or(per_sm, |cap| per_sm.min(cap));
    Grid {
        team,
        teams: (gpu.sm_count * per_sm).min(rows).max(1),
    }
}

pub(crate) struct ForwardBuffers<'a, T> {
    pub(crate) x: &'a CudaSlice<T>,
    pub(crate) gamma: &'a CudaSlice<T>,
    pub(crate) beta: &'a CudaSlice<T>,
    pub(crate) y: &'a mut CudaSlice<T>,
    pub(crate) mean: &'a mut CudaSlice<f32>,
    pub(crate) rstd: &'a mut CudaSlice<f32>,
}

/// Queues the forward of `[rows, n]` (rows, n >= 1).
pub(crate) fn forward<T: Element>(
    gpu: &Gpu,
    b: ForwardBuffers<'_, T>,
    rows: u32,
    n: u32,
    eps: f32,
) -> Result<()> {
    let grid = resident_grid::<T>(gpu, rows, n, None);
    let a = Forward {
        x: b.x,
        gamma: b.gamma,
        beta: b.beta,
        y: b.y,
        mean: b.mean,
        rstd: b.rstd,
        rows,
        n,
        eps,
    };
    kernels::forward(gpu, grid, a)
}

pub(crate) struct BackwardBuffers<'a, T> {
    pub(crate) x: &'a CudaSlice<T>,
    pub(crate) dy: &'a CudaSlice<T>,
    pub(crate) gamma: &'a CudaSlice<T>,
    pub(crate) mean: &'a CudaSlice<f32>,
    pub(crate) rstd: &'a CudaSlice<f32>,
    pub(crate) dx: &'a mut CudaSlice<T>,
    pub(crate) dgamma: &'a mut CudaSlice<T>,
    pub(crate) dbeta: &'a mut CudaSlice<T>,
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

/// Queues the backward of `[rows, n]` (rows, n >= 1): stage 1 then stage 2.
pub(crate) fn backward<T: Element>(
    gpu: &Gpu,
    mode: BackwardMode,
    b: BackwardBuffers<'_, T>,
    rows: u32,
    n: u32,
) -> Result<()> {
    let stage1 = Backward {
        x: b.x,
        dy: b.dy,
        gamma: b.gamma,
        mean: b.mean,
        rstd: b.rstd,
        dx: b.dx,
        rows,
        n,
    };
    let (parts_dgamma, parts_dbeta, part_rows) = match mode {
        BackwardMode::Deterministic => {
            // Every team owns a partial row: fewer warp teams keep the partials small.
            let grid = resident_grid::<T>(gpu, rows, n, Some(16));
            let part_rows = grid.launched_teams();
            let len = part_rows as usize * n as usize;
            // The owned-mode kernel writes every element of every partial row (a team
            // without rows writes zeros).
            let (mut pg, mut pb) = alloc_partials(gpu, len)?;
            kernels::backward_owned(gpu, grid, stage1, &mut pg, &mut pb)?;
            (pg, pb, part_rows)
        }
        BackwardMode::Locked { groups } => {
            // Groups beyond `rows` would get no row (row i goes to group i mod G = i), so
            // clamping changes nothing but leaves no group unwritten.
            let groups = groups.unwrap_or_else(|| default_groups(n as usize)).min(rows);
            let len = groups as usize * n as usize;
            // Every group row is written by its first holder (count word 0) before it is
            // added to, and all `groups` groups get a row since groups <= rows.
            let (mut pg, mut pb) = alloc_partials(gpu, len)?;
            let mut words = gpu
                .stream
                .alloc_zeros::<u32>(2 * groups as usize)
                .during("allocating locks")?;
            let grid = resident_grid::<T>(gpu, rows, n, None);
            kernels::backward_locked(gpu, grid, stage1, &mut pg, &mut pb, &mut words, groups)?;
            (pg, pb, groups)
        }
    };
    kernels::backward_reduce(gpu, &parts_dgamma, &parts_dbeta, part_rows, n, b.dgamma, b.dbeta)
}

/// Two f32 partial buffers of `len`, uninitialized: stage 1 writes every element before
/// stage 2 reads it (each mode's comment says how).
fn alloc_partials(gpu: &Gpu, len: usize) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
    // SAFETY: uninitialized device memory, fully written by stage 1 before any read.
    let (dgamma, dbeta) = unsafe { (gpu.stream.alloc::<f32>(len), gpu.stream.alloc::<f32>(len)) };
    Ok((
        dgamma.during("allocating partials")?,
        dbeta.during("allocating partials")?,
    ))
}
