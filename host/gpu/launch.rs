//! The launches: each fills the kernel's parameter structs (`crate::layout::params`,
//! which the kernels compile too) and queues it.
//!
//! Each launch checks the buffer lengths the kernel relies on before it launches, so the
//! `unsafe` here rests on checks made next to it, not on callers far away.

use crate::layout::params::{self, BackwardRows, In, KernelParams, Out, Partials, Reduce};
use cudarc::driver::{
    CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop, sys,
};

use super::Gpu;
use super::module::Kernel;
use crate::element::{Element, Weight, pair_of};
use crate::error::{DriverContext, Error, Result};
use crate::plan::{Alignment, Norm, TYPE_PAIRS, Variant, pack_len};

// What the kernels and the launches must agree on, from the one crate both compile.
pub(crate) use crate::layout::{BWD_HELD, CLUSTER_SIZE, SCRATCH_BYTES};
use crate::layout::{stage2_smem, stage2_threads};

/// Which threads share a row: one warp (short rows), or a whole block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Team {
    Warp,
    Block,
}

/// One launch's shape. Each team loops over rows `id, id + teams, ...`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Launch {
    pub(crate) blocks: u32,
    /// Threads along the block's x dimension: a block team's ranks, or a block of warps.
    pub(crate) threads: u32,
    /// Block teams stacked along y (`StackedBlock` in kernels-gpu/src/team.rs): more than
    /// one only for the held backward, whose teams then share a partial row.
    pub(crate) stacked: u32,
    pub(crate) smem: u32,
}

impl Launch {
    /// Teams in one block of this launch.
    pub(crate) fn teams_per_block(self, team: Team) -> u32 {
        match team {
            Team::Warp => self.threads / 32,
            Team::Block => self.stacked,
        }
    }

    /// The driver's launch configuration, or [`Error::SharedMemory`] where the blocks would
    /// need more shared memory than the device allows (`what` names the kernel).
    fn config(self, gpu: &Gpu, what: &'static str) -> Result<LaunchConfig> {
        check_smem(gpu, self.smem as usize, what)?;
        Ok(LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (self.threads, self.stacked, 1),
            shared_mem_bytes: self.smem,
        })
    }
}

/// Refuses `needed` bytes of shared memory per block beyond what the device allows.
pub(crate) fn check_smem(gpu: &Gpu, needed: usize, what: &'static str) -> Result<()> {
    let available = gpu.kernels.limits.max_smem as usize;
    if needed <= available {
        Ok(())
    } else {
        Err(Error::SharedMemory {
            what,
            needed,
            available,
        })
    }
}

/// A parameter struct, passed as one launch argument: cudarc hands the driver its address,
/// and the driver copies its bytes into the kernel's parameter space.
#[repr(transparent)]
struct ByValue<P>(P);

// SAFETY: `KernelParams` structs are `#[repr(C)]` plain data (addresses and 32-bit numbers)
// that the kernels declare, from the same source, as one by-value parameter.
unsafe impl<P: KernelParams> DeviceRepr for ByValue<P> {}

/// cudarc's guards for a launch's buffers (None for a buffer it is not given), to be dropped
/// after the launch is queued.
type Guards<'a, const N: usize> = [Option<SyncOnDrop<'a>>; N];

/// The address of a buffer a kernel reads, and cudarc's guard for that use, to be dropped
/// after the launch is queued.
fn input<'a, T>(gpu: &'a Gpu, buffer: &'a impl DevicePtr<T>) -> (In<T>, SyncOnDrop<'a>) {
    let (address, guard) = buffer.device_ptr(&gpu.stream);
    (In::new(address), guard)
}

/// The address of a buffer a kernel writes, and cudarc's guard for that use, as [`input`].
fn output<'a, T>(gpu: &'a Gpu, buffer: &'a mut impl DevicePtrMut<T>) -> (Out<T>, SyncOnDrop<'a>) {
    let (address, guard) = buffer.device_ptr_mut(&gpu.stream);
    (Out::new(address), guard)
}

/// Panics unless `cond`: a launch's buffer lengths are this crate's own invariant (the op
/// checked the user's shapes already), so a failure here is a bug in this crate, and
/// stopping beats letting a kernel run past a buffer.
fn require(cond: bool, what: &str) {
    assert!(cond, "layernorm-cuda bug: launch buffer too small ({what})");
}

/// Forward: the arguments of `<norm>_fwd_<kind>_<types>`, x of type `T`, the weights of
/// `W`, and a residual stream of `R` (`T`, or f32 beside f16 and bf16). Inputs are views,
/// which may start at any element (the kernels check each row's alignment).
pub(crate) struct Forward<'a, T, W, R = T> {
    pub(crate) x: CudaView<'a, T>,
    /// The residual add: the residual, and s = x + residual out (`[rows, n]` each), which
    /// the kernel then normalizes.
    pub(crate) residual: Option<(CudaView<'a, R>, CudaViewMut<'a, R>)>,
    pub(crate) gamma: CudaView<'a, W>,
    pub(crate) beta: CudaView<'a, W>,
    pub(crate) y: CudaViewMut<'a, T>,
    pub(crate) mean: CudaViewMut<'a, f32>,
    pub(crate) rstd: CudaViewMut<'a, f32>,
    pub(crate) rows: u32,
    pub(crate) n: u32,
    pub(crate) eps: f32,
    /// Added to each gamma_j as the kernels read it (`params::Forward::gamma_offset`).
    pub(crate) gamma_offset: f32,
    /// Every row of x and y, gamma and beta (and of the residual and s) starts aligned to
    /// a pack of the rows' type (16 bytes; 8 for x and y of f16/bf16 beside a stream of f32),
    /// and n is a whole number of packs.
    pub(crate) packed: bool,
    /// Not `packed`, but x and y (and the residual and s) are of one type and every row of
    /// each sits as many bytes past a 16-byte boundary as x's (rows in half packs too: every
    /// other row of f16 N = 4100 sits 8 bytes past one).
    pub(crate) shifted: bool,
    /// LayerNorm's kernels or RMSNorm's.
    pub(crate) norm: Norm,
}

impl<T, W, R> Forward<'_, T, W, R> {
    /// How the rows sit, for the planner.
    pub(crate) fn alignment(&self) -> Alignment {
        if self.packed {
            Alignment::Packs
        } else if self.shifted {
            Alignment::Shifted
        } else {
            Alignment::Other
        }
    }
}

/// Whether `cols` columns of whole packs (a row, or a cluster's slice of one) fit `held`
/// packs a rank of a team in blocks of `threads`.
pub(crate) fn fits_held<T: Element>(team: Team, threads: u32, cols: u32, held: u32) -> bool {
    let ranks = if team == Team::Warp { 32 } else { threads };
    crate::layout::fits(cols, pack_len::<T>(), ranks, held)
}

/// Queues the forward kernel `f`, which the caller picked for `a` and `launch` (a
/// pipelined one only where `a.packed` and its rows [`fits_held`] the packs a rank the
/// kernel holds: `PIPE_HELD`, or `layout::pipelined_block_held` for the block team).
pub(crate) fn forward<T: Element, W: Weight<T>, R: Element>(
    gpu: &Gpu,
    f: &Kernel,
    launch: Launch,
    mut a: Forward<'_, T, W, R>,
) -> Result<()> {
    let (rows, n) = (a.rows as usize, a.n as usize);
    require(a.x.len() >= rows * n && a.y.len() >= rows * n, "x/y");
    require(a.gamma.len() >= n && a.beta.len() >= n, "gamma/beta");
    require(a.mean.len() >= rows && a.rstd.len() >= rows, "mean/rstd");
    require(launch.smem >= SCRATCH_BYTES, "scratch");
    if let Some((r, s)) = &a.residual {
        require(r.len() >= rows * n && s.len() >= rows * n, "residual/sum");
    }
    let config = launch.config(gpu, "the forward kernel")?;
    let ((x, _x), (gamma, _gamma), (beta, _beta)) =
        (input(gpu, &a.x), input(gpu, &a.gamma), input(gpu, &a.beta));
    let ((residual, _residual), (sum, _sum)) = match &mut a.residual {
        Some((r, s)) => {
            let ((r, gr), (s, gs)) = (input(gpu, r), output(gpu, s));
            ((r, Some(gr)), (s, Some(gs)))
        }
        None => ((In::none(), None), (Out::none(), None)),
    };
    let ((y, _y), (mean, _mean), (rstd, _rstd)) = (
        output(gpu, &mut a.y),
        output(gpu, &mut a.mean),
        output(gpu, &mut a.rstd),
    );
    let (rows, n, eps, gamma_offset) = (a.rows, a.n, a.eps, a.gamma_offset);
    let p = ByValue(params::Forward {
        x,
        residual,
        sum,
        gamma,
        beta,
        y,
        mean,
        rstd,
        rows,
        n,
        eps,
        gamma_offset,
    });
    let mut b = gpu.stream.launch_builder(f.func());
    b.arg(&p);
    // SAFETY: every forward kernel takes one `params::Forward` (kernels-gpu/src/forward.rs),
    // and every buffer holds what the kernel indexes (checked above).
    unsafe { b.launch(config) }.during("launching the forward kernel")?;
    Ok(())
}

/// Backward stage 1's common arguments (inputs as views, as for [`Forward`]): x (or a
/// residual forward's s), dsum and dres of the rows' type `R`, the rest as [`Forward`]'s.
pub(crate) struct Backward<'a, T, W, R = T> {
    pub(crate) x: CudaView<'a, R>,
    pub(crate) dy: CudaView<'a, T>,
    /// The gradient reaching a residual forward's s from elsewhere, which dx includes.
    pub(crate) dsum: Option<CudaView<'a, R>>,
    pub(crate) gamma: CudaView<'a, W>,
    /// As [`Forward::gamma_offset`].
    pub(crate) gamma_offset: f32,
    pub(crate) mean: CudaView<'a, f32>,
    pub(crate) rstd: CudaView<'a, f32>,
    pub(crate) dx: CudaViewMut<'a, T>,
    /// With a residual stream wider than x (f32 beside f16/bf16): dx again, unrounded, as
    /// the residual's gradient. The kernels of one type have no code for it: None there.
    pub(crate) dres: Option<CudaViewMut<'a, R>>,
    pub(crate) rows: u32,
    pub(crate) n: u32,
    /// Every row of x, dy and dx (dsum and dres too), and gamma, starts aligned to a pack
    /// of the rows' type, as [`Forward::packed`] says, and n is a whole number of packs.
    pub(crate) packed: bool,
    /// Not `packed`, but x, dy and gamma are of one 16-bit type, every row of x, dy, dx
    /// and dsum, and gamma, starts 8-byte aligned, and n is a multiple of 4 (half packs).
    pub(crate) half_packed: bool,
    /// Neither, but x, dy and dx are of one size (`T` = `R`), there is no dsum or dres, and
    /// every row of dy and dx sits as many bytes past a 16-byte boundary as x's.
    pub(crate) shifted: bool,
    /// LayerNorm's kernels or RMSNorm's.
    pub(crate) norm: Norm,
}

impl<T: Element, W: Weight<T>, R: Element> Backward<'_, T, W, R> {
    /// How the rows sit, for the planner.
    pub(crate) fn alignment(&self) -> Alignment {
        if self.packed {
            Alignment::Packs
        } else if self.half_packed {
            Alignment::HalfPacks
        } else if self.shifted {
            Alignment::Shifted
        } else {
            Alignment::Other
        }
    }

    /// Every stage 1's first parameter, and cudarc's guards for its buffers (to be dropped
    /// after the launch is queued).
    fn params<'s>(&'s mut self, gpu: &'s Gpu) -> (ByValue<BackwardRows<T, W, R>>, Guards<'s, 8>) {
        let ((x, gx), (dy, gdy), (gamma, ggamma)) =
            (input(gpu, &self.x), input(gpu, &self.dy), input(gpu, &self.gamma));
        let (dsum, gdsum) = match &self.dsum {
            Some(d) => {
                let (d, g) = input(gpu, d);
                (d, Some(g))
            }
            None => (In::none(), None),
        };
        let ((mean, gmean), (rstd, grstd)) = (input(gpu, &self.mean), input(gpu, &self.rstd));
        let (dx, gdx) = output(gpu, &mut self.dx);
        let (dres, gdres) = match &mut self.dres {
            Some(d) => {
                let (d, g) = output(gpu, d);
                (d, Some(g))
            }
            None => (Out::none(), None),
        };
        let (rows, n, gamma_offset) = (self.rows, self.n, self.gamma_offset);
        let p = ByValue(BackwardRows {
            x,
            dy,
            dsum,
            gamma,
            mean,
            rstd,
            dx,
            dres,
            rows,
            n,
            gamma_offset,
        });
        (
            p,
            [
                Some(gx),
                Some(gdy),
                gdsum,
                Some(ggamma),
                Some(gmean),
                Some(grstd),
                Some(gdx),
                gdres,
            ],
        )
    }

    /// Launches `f` with (rows, partials); `what` names it in errors.
    ///
    /// # Safety
    /// `f` takes exactly these parameters, and `launch` gives it the grid and shared memory
    /// it indexes with them.
    unsafe fn launch_with_partials(
        mut self,
        gpu: &Gpu,
        f: &Kernel,
        launch: Launch,
        mut sums: Sums<'_, '_>,
        what: &'static str,
    ) -> Result<()> {
        let config = launch.config(gpu, what)?;
        let (rows, _rows) = self.params(gpu);
        let (partials, _guards) = sums.params(gpu);
        let mut b = gpu.stream.launch_builder(f.func());
        b.arg(&rows).arg(&partials);
        // SAFETY: the caller's guarantee.
        unsafe { b.launch(config) }.during(what)?;
        Ok(())
    }

    fn check(&self) {
        let (rows, n) = (self.rows as usize, self.n as usize);
        require(self.x.len() >= rows * n && self.dy.len() >= rows * n, "x/dy");
        require(self.dx.len() >= rows * n && self.gamma.len() >= n, "dx/gamma");
        require(self.mean.len() >= rows && self.rstd.len() >= rows, "mean/rstd");
        require(self.dsum.as_ref().is_none_or(|d| d.len() >= rows * n), "dsum");
        require(self.dres.as_ref().is_none_or(|d| d.len() >= rows * n), "dres");
        require(
            self.dres.is_some() == (size_of::<R>() > size_of::<T>()),
            "dres exactly where the stream is wider than x",
        );
    }

    /// Its norm's kernels of its types.
    fn kernels<'g>(&self, gpu: &'g Gpu) -> Result<super::module::TypeKernels<'g>> {
        gpu.kernels.of_pair(self.norm, pair_of::<T, W, R>())
    }
}

/// Where a stage 1's blocks hand their sums over (the kernels' `Partials`): one partial row
/// per unit (a block, or a cluster) in owned mode; in locked mode, `groups` group rows and
/// their compensations, with `2 * groups * slices` lock and count words, zero (slices: the
/// blocks of a cluster, 1 without clusters).
pub(crate) struct Sums<'a, 'b> {
    pub(crate) dgamma: &'b mut CudaViewMut<'a, f32>,
    pub(crate) dbeta: &'b mut CudaViewMut<'a, f32>,
    pub(crate) locks: Option<(&'b mut CudaViewMut<'a, u32>, u32)>,
}

impl Sums<'_, '_> {
    /// Checks the buffers against `units` units of `slices` blocks over rows of `n`, where
    /// the locked mode also needs a row per unit of the blocks' own (`own_rows`: the owned
    /// kernel without `local`).
    fn check(&self, units: u32, slices: u32, n: u32, own_rows: bool) {
        let rows = match &self.locks {
            None => units as usize,
            Some((words, groups)) => {
                require(*groups >= 1 && *groups <= units, "groups");
                require(words.len() >= 2 * (*groups * slices) as usize, "lock words");
                2 * *groups as usize + if own_rows { units as usize } else { 0 }
            }
        };
        let len = rows * n as usize;
        require(
            self.dgamma.len() >= len && self.dbeta.len() >= len,
            "partial rows",
        );
    }

    /// The kernels' parameter, and the guards that order the buffers' use on the stream.
    fn params<'g>(&'g mut self, gpu: &'g Gpu) -> (ByValue<Partials>, Guards<'g, 3>) {
        let ((dgamma, g1), (dbeta, g2)) = (output(gpu, &mut *self.dgamma), output(gpu, &mut *self.dbeta));
        let (words, groups, g3) = match &mut self.locks {
            Some((words, groups)) => {
                let groups = *groups;
                let (words, guard) = output(gpu, &mut **words);
                (words, groups, Some(guard))
            }
            None => (Out::none(), 0, None),
        };
        let partials = ByValue(Partials {
            dgamma,
            dbeta,
            words,
            groups,
        });
        (partials, [Some(g1), Some(g2), g3])
    }
}

/// Stage 1, the general kernel: one unit per block. With `local`, each team of a block sums
/// in its own rows of shared memory after the scratch (warp teams must).
pub(crate) fn backward_owned<T: Element, W: Weight<T>, R: Element>(
    gpu: &Gpu,
    team: Team,
    launch: Launch,
    mut a: Backward<'_, T, W, R>,
    mut sums: Sums<'_, '_>,
    local: bool,
) -> Result<()> {
    a.check();
    sums.check(launch.blocks, 1, a.n, !local);
    require(launch.stacked == 1, "owned blocks are one team");
    let teams_per_block = launch.teams_per_block(team);
    let local_bytes = owned_local_smem(teams_per_block, a.n);
    require(
        launch.smem >= SCRATCH_BYTES && (!local || launch.smem as usize >= local_bytes),
        "owned smem",
    );
    require(local || team == Team::Block, "warp teams sum in shared memory");
    let k = a.kernels(gpu)?;
    let f = k.any(if team == Team::Warp {
        Variant::BwdOwnedWarp
    } else {
        Variant::BwdOwnedBlock
    });
    let config = launch.config(gpu, "backward stage 1 (owned)")?;
    let (rows, _rows) = a.params(gpu);
    let (partials, _guards) = sums.params(gpu);
    let local = local as u32;
    let mut b = gpu.stream.launch_builder(f.func());
    b.arg(&rows).arg(&partials).arg(&local);
    // SAFETY: `backward_kernels!(@owned ..)` in kernels-gpu/src/backward/mod.rs takes
    // (BackwardRows, Partials, u32), every buffer (shared memory included) holds what the
    // kernel indexes (checked above), and the lock words are zero (`Sums`).
    unsafe { b.launch(config) }.during("launching backward stage 1 (owned)")?;
    Ok(())
}

/// Stage 1, rows all held (`a.packed`, and the rows fit `BWD_HELD` packs a rank; or for
/// [`Variant::BwdHeldBlockHalves`], `a.half_packed` and as many half packs a rank as 8-byte
/// halves of `BWD_HELD` packs; or for [`Variant::BwdHeldBlockShifted`], `a.shifted`, the
/// rows fit, and a grid whose rows of one block sit alike): one unit per block, each rank
/// summing its columns' partials in its own shared memory ([`held_smem`], or
/// `layout::held_shifted_smem`). `variant` is one of the held kernels.
pub(crate) fn backward_held<T: Element, W: Weight<T>, R: Element>(
    gpu: &Gpu,
    variant: Variant,
    launch: Launch,
    a: Backward<'_, T, W, R>,
    sums: Sums<'_, '_>,
) -> Result<()> {
    a.check();
    let team = if variant == Variant::BwdHeldWarp {
        Team::Warp
    } else {
        Team::Block
    };
    let (pair, pack) = (TYPE_PAIRS[pair_of::<T, W, R>()], pack_len::<R>());
    let threads = launch.threads * launch.stacked;
    // Half packs: as many a rank as 8-byte halves of the packs that fit (a 16-bit row fits
    // in half packs where it fits in packs). Shifted rows: their whole packs past the head,
    // at most n's, on a grid whose blocks each take rows of one shift.
    let (rows, cols, smem) = match variant {
        Variant::BwdHeldBlockHalves => (
            a.half_packed && variant.has_pair(pair) && a.n.is_multiple_of(4),
            a.n,
            held_smem::<R>(threads),
        ),
        Variant::BwdHeldBlockShifted => (
            a.shifted
                && a.dsum.is_none()
                && a.dres.is_none()
                && variant.has_pair(pair)
                && launch
                    .blocks
                    .is_multiple_of(crate::layout::shifted_grid_multiple(a.n, pack)),
            a.n / pack * pack,
            crate::layout::held_shifted_smem(pack, threads, a.n, size_of::<W>() as u32),
        ),
        _ => (a.packed, a.n, held_smem::<R>(threads)),
    };
    require(
        rows && fits_held::<R>(team, launch.threads, cols, BWD_HELD),
        "held rows",
    );
    sums.check(launch.blocks, 1, a.n, false);
    require(launch.smem as usize >= smem, "held smem");
    let f = a.kernels(gpu)?.any(variant);
    // SAFETY: `backward_kernels!(@held ..)` in kernels-gpu/src/backward/mod.rs takes these
    // arguments; every buffer (shared memory included) holds what the kernel indexes, and
    // every row is whole aligned packs (or half packs, or shifted packs on a grid that
    // keeps each block's rows alike) that fit (checked above).
    unsafe { a.launch_with_partials(gpu, f, launch, sums, "backward stage 1 (held rows)") }
}

/// Shared memory of a held stage 1 block of `threads` (all its teams' ranks).
pub(crate) fn held_smem<T: Element>(threads: u32) -> usize {
    crate::layout::held_smem(pack_len::<T>(), threads)
}

pub(crate) use crate::layout::owned_local_smem;

/// Stage 1 over clusters of `size` blocks: `launch.blocks / size` units of `size` slices,
/// each block of a cluster summing one slice of the row in shared memory: held in
/// registers (`held`, rows all aligned packs; sizes `HELD_CLUSTER_SIZES`) or not (size
/// [`CLUSTER_SIZE`]).
pub(crate) fn backward_cluster<T: Element, W: Weight<T>, R: Element>(
    gpu: &Gpu,
    variant: Variant,
    launch: Launch,
    a: Backward<'_, T, W, R>,
    sums: Sums<'_, '_>,
) -> Result<()> {
    a.check();
    let size = variant.cluster();
    require(size > 1, "a cluster kernel");
    require(
        a.dsum.is_none() || variant.takes_dsum(size_of::<R>(), size_of::<W>()),
        "a cluster kernel that takes dsum",
    );
    require(launch.blocks.is_multiple_of(size), "whole clusters");
    sums.check(launch.blocks / size, size, a.n, false);
    let smem = if variant.held_cluster() {
        let slice = cluster_slice::<R>(a.n, size);
        // Half packs: as many a rank as 8-byte halves of the packs that fit, every slice
        // starting at a whole pack.
        let rows = if variant.halves() {
            a.half_packed && variant.has_pair(TYPE_PAIRS[pair_of::<T, W, R>()]) && a.n.is_multiple_of(4)
        } else {
            a.packed
        };
        require(
            rows && fits_held::<R>(Team::Block, launch.threads, slice, BWD_HELD),
            "held cluster slices",
        );
        cluster_held_smem::<R>(launch.threads)
    } else {
        require(size == CLUSTER_SIZE, "general cluster size");
        cluster_smem::<R>(a.n)
    };
    let kernel = a.kernels(gpu)?.get(variant);
    require(launch.smem as usize >= smem, "cluster smem");
    let Some(f) = kernel else {
        panic!("layernorm-cuda bug: a cluster launch on a device without cluster kernels");
    };
    // SAFETY: `cluster_kernels!` in kernels-gpu/src/cluster/backward.rs takes these arguments for
    // every cluster kernel, every buffer (shared memory included) holds what the kernel
    // indexes (checked above, with the held kernel's rows and slices), and the grid is
    // whole clusters of the size the kernel declares.
    unsafe { a.launch_with_partials(gpu, f, launch, sums, "backward stage 1 (clusters)") }
}

/// Columns of one block's slice when a cluster of `size` blocks shares a row of `n`.
pub(crate) fn cluster_slice<T: Element>(n: u32, size: u32) -> u32 {
    crate::layout::slice_width(n, pack_len::<T>(), size)
}

/// Shared memory of a general cluster block on rows of `n`.
pub(crate) fn cluster_smem<T: Element>(n: u32) -> usize {
    crate::layout::cluster_smem(n, pack_len::<T>())
}

/// Shared memory of a held cluster block of `threads`.
pub(crate) fn cluster_held_smem<T: Element>(threads: u32) -> usize {
    crate::layout::cluster_held_smem(pack_len::<T>(), threads)
}

/// Stage 2 (`f`, the module's `BwdReduce` kernel): column sums of `[rows, n]` partials into
/// dgamma and dbeta.
pub(crate) fn backward_reduce<W: Element>(
    gpu: &Gpu,
    f: &Kernel,
    (part_dgamma, part_dbeta): (&CudaViewMut<'_, f32>, &CudaViewMut<'_, f32>),
    rows: u32,
    n: u32,
    dgamma: &mut CudaViewMut<'_, W>,
    dbeta: &mut CudaViewMut<'_, W>,
) -> Result<()> {
    let parts = rows as usize * n as usize;
    require(
        part_dgamma.len() >= parts && part_dbeta.len() >= parts,
        "partials",
    );
    require(
        dgamma.len() >= n as usize && dbeta.len() >= n as usize,
        "dgamma/dbeta",
    );
    // A tile of 32 columns per block, a slice of threads per `STAGE2_BATCH` partial rows
    // (4 to 128 slices); at most as many blocks as fill the multiprocessors' 2048 threads
    // (blocks loop over tiles).
    let threads = stage2_threads(rows);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(32).min(gpu.sm_count * (2048 / threads)).max(1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: stage2_smem(rows),
    };
    let ((part_dgamma, _part_dgamma), (part_dbeta, _part_dbeta)) =
        (input(gpu, part_dgamma), input(gpu, part_dbeta));
    let ((dgamma, _dgamma), (dbeta, _dbeta)) = (output(gpu, dgamma), output(gpu, dbeta));
    let p = ByValue(Reduce {
        part_dgamma,
        part_dbeta,
        dgamma,
        dbeta,
        rows,
        n,
    });
    // SAFETY: `layer_norm_bwd_reduce_<W>` in kernels-gpu/src/backward/mod.rs takes one
    // `Reduce`, every buffer holds what the kernel indexes, and the kernel waits for stage
    // 1 (`griddepcontrol.wait`) before its first access to memory.
    unsafe { launch_dependent(gpu, f, cfg, &p) }.during("launching backward stage 2")
}

/// Queues `f`, whose one parameter is `p`, as the programmatic dependent of the kernel
/// queued before it on the stream, where the device and driver allow it
/// (`Gpu::kernels.dependent_launch`), else as a plain launch. A dependent's blocks may
/// start once every block of the kernel before it has run `griddepcontrol.launch_dependents`
/// (stage 1 does, first thing): its launch then overlaps that kernel's last rows rather
/// than following its end. A kernel before it that gives no such signal lets it start as
/// its blocks end.
///
/// # Safety
/// `f` takes exactly one `P`; `config` gives it the grid and shared memory it indexes; it
/// runs `griddepcontrol.wait` before any access to global memory.
unsafe fn launch_dependent<P: KernelParams>(
    gpu: &Gpu,
    f: &Kernel,
    config: LaunchConfig,
    p: &ByValue<P>,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    if !gpu.kernels.dependent_launch {
        let mut b = gpu.stream.launch_builder(f.func());
        b.arg(p);
        // SAFETY: the caller's guarantee.
        return unsafe { b.launch(config) }.map(|_| ());
    }
    gpu.stream.context().bind_to_thread()?;
    let mut value = sys::CUlaunchAttributeValue { pad: [0; 64] };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attribute = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let launch = sys::CUlaunchConfig {
        gridDimX: config.grid_dim.0,
        gridDimY: config.grid_dim.1,
        gridDimZ: config.grid_dim.2,
        blockDimX: config.block_dim.0,
        blockDimY: config.block_dim.1,
        blockDimZ: config.block_dim.2,
        sharedMemBytes: config.shared_mem_bytes,
        hStream: gpu.stream.cu_stream(),
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // The driver reads the parameter's bytes through this pointer during the call.
    let mut params = [p as *const ByValue<P> as *mut std::ffi::c_void];
    // SAFETY: `launch` and `params` outlive the call, which copies them; `f` belongs to the
    // stream's context (bound above); the kernel's side is the caller's guarantee.
    unsafe {
        sys::cuLaunchKernelEx(
            &launch,
            f.func().cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}
