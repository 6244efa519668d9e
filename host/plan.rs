//! Which kernel runs a call, with which block: a pure function of the shape, the storage
//! types, the pass and the device's limits, so that the choice can be read, printed and
//! tested without a GPU (`tests/plan.rs` checks that the test shapes reach every kernel on
//! sm_80 and sm_90 limits). The launch then sizes the grid from the device's occupancy.
//!
//! The rules, in order:
//! - Rows of up to 1024 elements go one warp per row (8 warps a block), but in the held
//!   backward those of more packs than a warp holds at 4 a lane (f32 N = 513-1024); longer
//!   rows one block per row, about 4 packs a thread (the forward's rows not all aligned:
//!   whole warps of 32 elements a thread or more, four of its read batches), or one pack a
//!   thread in launches of at most one row a multiprocessor (`DeviceLimits::sm_count`).
//!   There each multiprocessor has one row and threads to spare, and the launch takes as
//!   long as one rank's chain of dependent instructions: at 4 packs a rank, about 790
//!   instructions a warp in a bf16 forward of N = 4096 (ncu), where the peers' kernels run
//!   about 320.
//! - Forward: launches of at most one row a multiprocessor over block-team rows all of
//!   aligned packs that 512 threads hold at 16 elements each (N <= 8192) take the few-rows
//!   kernel, a block a row, which loads x, gamma and beta together (one DRAM round trip).
//!   Otherwise, rows all of aligned packs that fit 4 packs a thread take the pipelined
//!   kernel (two rows in flight a team; on sm_90, LayerNorm's 16-bit rows of 2 to 4 packs a
//!   warp lane take the widened warp kernel instead, a warp for every row with x widened
//!   once; LayerNorm's block teams over f32 rows of more than 2048 packs stage their next
//!   row and hold 6 packs a thread of this one, so that two teams fit a multiprocessor up
//!   to N = 12288, and rows up to N = 24576 fit); the others the
//!   general one, which holds rows of up to 8 packs a thread and stages longer aligned rows
//!   in shared memory where it has room. With a residual add, the residual kernels, chosen
//!   by the same rules (staging takes room for the residual's packs too). On sm_90 some
//!   block teams take a block for every row ([`Grid::EveryRow`]): the plain forward's
//!   pipelined teams of 256 ranks, or 512 that hold their next row; the residual forward's
//!   pipelined teams of 256 ranks, and its teams of 512 over f32 x that hold their row;
//!   RMSNorm's 16-bit rows of 2049 to 8192 packs, and its f32 rows of as many that a team
//!   of 512 or 1024 ranks holds at 8 packs a rank, which take the general kernel there.
//!   Every other launch takes a resident grid whose teams loop over the rows. On sm_90,
//!   pipelined block teams over weights of x's type give way to the row block (a block for
//!   every row, holding its row only, at 40 registers) where a multiprocessor runs two of
//!   its blocks or more and more of its threads, and its last wave is nearly full or its
//!   rows fill a team of 512 ranks (2048 packs). On sm_90, launches of more rows than
//!   multiprocessors whose x and y of one type, weights of it, sit alike past 16-byte
//!   boundaries ([`Alignment::Shifted`], 16-bit rows in half packs included), past a warp's
//!   length (f32 rows from 512 whole packs), take the held forward over shifted rows
//!   where their whole packs fit `FWD_HELD_SHIFTED` a rank of 1024: a block for every row,
//!   x held from its boundary.
//! - Residual forward of more rows than multiprocessors over rows all of aligned packs:
//!   16-bit rows with weights of their type longer than the pipelined block holds, up to 4
//!   packs a rank of 1024 (N <= 32768), or that it holds on teams of 128, 256 or 512 ranks
//!   (N = 3073-4096, 7169-8192, 15361-16384), the held residual kernel at 64 registers;
//!   rows too long for a block of 512 to hold at 8 packs a rank (16-bit N > 32768, f32 >
//!   16384), the streamed residual kernel, 512 ranks, which forms and sums s in one pass
//!   and reads it back from L2 for y (both a block for every row on sm_90). On sm_90,
//!   rows of one type with weights of it that sit alike past 16-byte boundaries
//!   ([`Alignment::Shifted`], rows in half packs included) take the held residual
//!   kernel's `_shifted` copy, in packs from their first boundary, where their whole
//!   packs fit `RESIDUAL_HELD_SHIFTED` a rank of 1024 (N < 32776); other rows not all
//!   aligned, the streamed kernel at the general kernel's team.
//! - Backward, either mode (the modes differ only in where each block's sums go): on sm_90,
//!   block-team rows that one block cannot hold (4 packs
//!   a thread) or cannot sum in shared memory split over a cluster, held over the fewest
//!   of 2, 4 or 8 blocks whose slices fit, else the general cluster of 8; rows all of
//!   aligned packs that fit take the held kernel (block teams stacked along y, as many as
//!   the thread limit and shared memory allow); the rest the owned kernel, summing in shared
//!   memory where it fits. Block-team rows of 16-bit x, dy and weights of one type that are
//!   all 8-byte aligned ([`Alignment::HalfPacks`]) are held in half packs, by the held
//!   block and held cluster kernels' `_halves` copies, as aligned rows are in packs; other
//!   block-team rows longer than a warp's whose x, dy and dx (of one size, weights of it
//!   too) sit alike past 16-byte boundaries ([`Alignment::Shifted`]), without a dsum, by
//!   the held block kernel's `_shifted` copy, in packs from x's first boundary, on a grid
//!   whose blocks each take rows of one shift.
//! - Backward with a residual's dsum: as above, but for 16-bit rows with 16-bit weights the
//!   general cluster kernel only (their held cluster kernels take no dsum).
//! - A residual stream kept in f32 beside f16/bf16 x ([`plan_f32_stream`]): the residual
//!   forward and the backward as for f32 rows.

use crate::layout::registry::pipeline_stages;
pub use crate::layout::registry::{Arch, DTYPE_BYTES, DTYPES, Norm, TYPE_PAIRS, TypePair, Variant};
use crate::layout::{
    BWD_BATCH_ELEMENTS, BWD_HELD, BWD_UNALIGNED_BATCHES_PER_RANK, CLUSTER_SIZE, FWD_HELD, FWD_HELD_SHIFTED,
    HELD_CLUSTER_SIZES, MAX_STACKED, PIPE_HELD, READ_BATCH_ELEMENTS, RESIDUAL_HELD, RESIDUAL_HELD_SHIFTED,
    SCRATCH_BYTES, UNALIGNED_BATCHES_PER_RANK, block_half_pack_rows,
};

use crate::element::{Element, F32Stream, Weight, pair_of};
use crate::error::{Error, Result};

/// What the planner needs of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Which PTX module it runs (sm_90 has the cluster kernels).
    pub arch: Arch,
    /// Dynamic shared memory a block may have (the opt-in maximum).
    pub max_smem: u32,
    /// Multiprocessors: launches of at most this many rows run one row a multiprocessor at
    /// most, and are planned for latency (see [`plan`]).
    pub sm_count: u32,
}

impl DeviceLimits {
    /// An A100's: sm_80 module, 163 KB of shared memory a block.
    pub const A100: DeviceLimits = DeviceLimits {
        arch: Arch::Sm80,
        max_smem: 166_912,
        sm_count: 108,
    };
    /// An H100's or H200's (SXM): sm_90 module, 227 KB of shared memory a block.
    pub const H100: DeviceLimits = DeviceLimits {
        arch: Arch::Sm90,
        max_smem: 232_448,
        sm_count: 132,
    };
}

/// What is being launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    /// The forward with a residual add (s = x + residual normalized): its own kernels, which
    /// form s as each row is loaded and then take it as the plain forward takes x.
    ForwardResidual,
    /// Backward stage 1, in either mode: each block sums its rows' partials, then writes
    /// them as its partial row (deterministic) or adds them into a spinlocked group (locked).
    Backward,
    /// As `Backward`, with the gradient reaching a residual forward's s added to dx: the held
    /// cluster kernels of 16-bit rows and weights take none, so such rows that need a
    /// cluster take the general one (`Variant::takes_dsum`).
    BackwardResidual,
}

/// How a launch's rows sit in memory, as far as the planner needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alignment {
    /// Every row of every tensor involved starts 16-byte aligned and `n` is a whole number
    /// of packs.
    Packs,
    /// Not `Packs`, but every row (and the weights) starts 8-byte aligned and `n` is a
    /// multiple of 4: 16-bit x, dy and weights of one type then take half packs (8 bytes).
    HalfPacks,
    /// Neither, but the rows are of one size and every row of each sits as many bytes past a
    /// 16-byte boundary as x's (f16 rows of odd `n` do, from aligned tensors): the
    /// backward's x, dy and dx, which it holds in packs from that boundary without a
    /// residual's dsum; the forward's x and y, and the residual forward's x, y, residual and
    /// s, of one type, which the held forwards' shifted kernels hold so (sm_90), rows in
    /// half packs among them.
    Shifted,
    /// Anything else.
    Other,
}

impl From<bool> for Alignment {
    /// `Packs` where every row is aligned whole packs, else `Other`.
    fn from(aligned: bool) -> Self {
        if aligned {
            Alignment::Packs
        } else {
            Alignment::Other
        }
    }
}

/// One launch's kernel and block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub variant: Variant,
    /// Threads along x: a block team's ranks, or a block of warps.
    pub threads: u32,
    /// Block teams stacked along y (the held backward's), else 1.
    pub stacked: u32,
    /// Dynamic shared memory per block.
    pub smem: u32,
    /// The owned backward sums its partials in shared memory (else straight into its global
    /// partial row; warp teams always sum in shared memory).
    pub local: bool,
    /// How many blocks the launch takes (the forward's choice; every other pass is
    /// resident).
    pub grid: Grid,
}

/// A launch's grid. The kernels loop over rows, team by team, so either is correct; they
/// differ in who hands rows out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// As many blocks as the device runs at once (the occupancy the driver reports), no
    /// more than the rows need: each team loops over its rows, and a pipelined team loads
    /// its next row while it normalizes this one.
    Resident,
    /// A team for every row: each team normalizes one row and its block ends; the hardware
    /// starts the next block as soon as one ends, so the rows in flight on a multiprocessor
    /// are its blocks', one each, not a pipelined team's two.
    EveryRow,
}

/// Rows of at most this many elements go one warp per row: a warp's 32 lanes hold a
/// 1024-element row in 4 (f16) or 8 (f32) packs each, while a block would idle most threads.
const WARP_ROW_MAX: u32 = 1024;

/// The most threads a block has: at 64 registers each, a block of them fills a
/// multiprocessor's register file.
const FULL_BLOCK: u32 = 1024;

/// Warps per block for warp teams: 8 rows in flight per block.
const WARPS_PER_BLOCK: u32 = 8;

/// A multiprocessor's registers (sm_80 and sm_90), given out to warps 256 at a time.
const SM_REGISTERS: u32 = 65536;

/// The most threads and blocks a multiprocessor runs at once (sm_80 and sm_90).
const SM_THREADS: u32 = 2048;
const SM_BLOCKS: u32 = 32;

/// The registers [`Planner::row_block`] counts RMSNorm's f32 row block at where that gives
/// two blocks a multiprocessor or more: its bound before v54, where the rule was measured.
const RMS_F32_ROW_BLOCK_RULE_REGISTERS: u32 = 48;

/// Blocks of `threads` at `registers` a thread that a multiprocessor runs at once (shared
/// memory aside: the kernels it is asked of take only the scratch). Its registers are four
/// sub-partitions' of 16384, each taking whole warps, so the warps they hold come in fours:
/// at 40 registers 48 warps, not 51 (v55: teams of 800 ranks run one block, not two).
fn resident_blocks(threads: u32, registers: u32) -> u32 {
    let warps_by_registers = warps_by_registers(registers) / 4 * 4;
    blocks_of(threads, warps_by_registers)
}

/// Blocks as [`Planner::row_block`]'s wave rule was measured counting them (v48-v54): the
/// register file's warps one by one, past the fours it holds. Where the two differ the
/// rule's decisions stand as measured (v55: counted in fours, it gave 16-bit N = 2560,
/// 3072 and 16896 the row block at M = 4096, -8 to -10%).
fn rule_blocks(threads: u32, registers: u32) -> u32 {
    blocks_of(threads, warps_by_registers(registers))
}

/// The warps of `registers` a thread a multiprocessor's registers hold, 256 at a time.
fn warps_by_registers(registers: u32) -> u32 {
    SM_REGISTERS / (registers * 32).next_multiple_of(256)
}

/// Blocks of `threads` among `warps`, within a multiprocessor's thread and block limits.
fn blocks_of(threads: u32, warps: u32) -> u32 {
    let block_warps = threads.div_ceil(32);
    (warps / block_warps)
        .min(SM_THREADS / (block_warps * 32))
        .min(SM_BLOCKS)
}

/// Elements of `T` in one 16-byte pack, the kernels' unit of vector access.
pub(crate) fn pack_len<T: Element>() -> u32 {
    crate::layout::pack_len(size_of::<T>() as u32)
}

/// Whether a row of `n` elements goes one warp per row.
fn warp_rows(n: u32) -> bool {
    n <= WARP_ROW_MAX
}

/// Which of `norm`'s kernels runs `pass` over `rows` rows of `n` elements of `T` (rows,
/// n >= 1) with weights of `W`, and with which block. `aligned`: how every row of every
/// tensor involved sits ([`Alignment`]; `true` for whole packs, as whole tensors always
/// are, views not always). An error only where no
/// kernel can take the shape: a warp-row backward whose partials do not fit the device's
/// shared memory.
pub fn plan<T: Element, W: Weight<T>>(
    norm: Norm,
    rows: u32,
    n: u32,
    pass: Pass,
    aligned: impl Into<Alignment>,
    limits: DeviceLimits,
) -> Result<Plan> {
    plan_rows::<T>(norm, TYPE_PAIRS[W::PAIR], rows, n, pass, aligned, limits)
}

/// As [`plan`], for x of `T` whose residual stream is kept in f32 ([`F32Stream`]): the
/// residual forward and the backward walk rows of f32 (s), with x, y, dy and dx read and
/// written four columns at a time beside them, and are planned as f32 rows are (the
/// forward's staging takes a 16-byte slot for each of x's 8-byte packs, and the cluster
/// kernels split rows into slices of f32 packs). The plain forward is x's own ([`plan`]).
pub fn plan_f32_stream<T: F32Stream, W: Weight<T>>(
    norm: Norm,
    rows: u32,
    n: u32,
    pass: Pass,
    aligned: impl Into<Alignment>,
    limits: DeviceLimits,
) -> Result<Plan> {
    match pass {
        Pass::Forward => plan::<T, W>(norm, rows, n, pass, aligned, limits),
        _ => plan_rows::<f32>(
            norm,
            TYPE_PAIRS[pair_of::<T, W, f32>()],
            rows,
            n,
            pass,
            aligned,
            limits,
        ),
    }
}

/// The plan of `norm`'s kernels of `pair` whose rows (x, or a residual forward's s) are of
/// `R`.
pub(crate) fn plan_rows<R: Element>(
    norm: Norm,
    pair: TypePair,
    rows: u32,
    n: u32,
    pass: Pass,
    aligned: impl Into<Alignment>,
    limits: DeviceLimits,
) -> Result<Plan> {
    let alignment = aligned.into();
    let planner = Planner::<R> {
        norm,
        rows,
        few_rows: rows <= limits.sm_count,
        n,
        aligned: alignment == Alignment::Packs,
        half_packs: alignment == Alignment::HalfPacks,
        shifted: alignment == Alignment::Shifted,
        limits,
        pair,
        ty: std::marker::PhantomData,
    };
    match pass {
        Pass::Forward => Ok(planner.forward()),
        Pass::ForwardResidual => Ok(planner.forward_residual()),
        Pass::Backward => planner.backward(false),
        Pass::BackwardResidual => planner.backward(true),
    }
}

struct Planner<T> {
    norm: Norm,
    rows: u32,
    /// At most one row a multiprocessor: block teams take a pack a rank.
    few_rows: bool,
    n: u32,
    aligned: bool,
    /// The rows are in half packs ([`Alignment::HalfPacks`]).
    half_packs: bool,
    /// The rows are shifted alike ([`Alignment::Shifted`]).
    shifted: bool,
    limits: DeviceLimits,
    /// The kernels' types: x's, the weights' and the rows' (`T`: x's, or f32 for a residual
    /// stream kept in f32).
    pair: TypePair,
    ty: std::marker::PhantomData<T>,
}

impl<T: Element> Planner<T> {
    /// The registry's thread limit of `v` for these types on this device.
    fn max_threads(&self, v: Variant) -> u32 {
        v.max_threads(self.limits.arch, self.pair)
    }

    /// Threads of a block team on `cols` columns: about `packs_per_thread` packs each, at
    /// least two warps, at most what `v` allows (its registers decide).
    fn block_threads(&self, v: Variant, cols: u32, packs_per_thread: u32) -> u32 {
        cols.div_ceil(pack_len::<T>())
            .div_ceil(packs_per_thread)
            .next_multiple_of(32)
            .clamp(64, self.max_threads(v))
    }

    /// A warp team's block: 8 warps, or fewer where `v`'s registers allow fewer.
    fn warp_threads(&self, v: Variant) -> u32 {
        (WARPS_PER_BLOCK * 32).min(self.max_threads(v))
    }

    /// Whether `cols` columns fit `held` packs a rank of a team of `ranks`.
    fn fits(&self, cols: u32, ranks: u32, held: u32) -> bool {
        crate::layout::fits(cols, pack_len::<T>(), ranks, held)
    }

    /// Whether `v` adds a residual's dsum to dx for these types (rows of the stream's).
    fn takes_dsum(&self, v: Variant) -> bool {
        v.takes_dsum(DTYPE_BYTES[self.pair.stream], DTYPE_BYTES[self.pair.weights])
    }

    fn smem_fits(&self, bytes: usize) -> bool {
        bytes <= self.limits.max_smem as usize
    }

    /// Packs a block team's rank takes of a row: 4, where rows in flight decide the speed;
    /// 1 where each multiprocessor has a row at most, and the time is one rank's chain.
    fn packs_per_rank(&self) -> u32 {
        if self.few_rows { 1 } else { 4 }
    }

    /// `v` with the team's block (warps of 8 where `warp_team`, or a block team of
    /// [`Self::packs_per_rank`]).
    fn team_plan(&self, warp_team: bool, warp: Variant, block: Variant) -> Plan {
        let (variant, threads) = if warp_team {
            (warp, self.warp_threads(warp))
        } else {
            (block, self.block_threads(block, self.n, self.packs_per_rank()))
        };
        Plan {
            variant,
            threads,
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: Grid::Resident,
        }
    }

    fn forward(&self) -> Plan {
        let special = self.few_rows_forward().or_else(|| self.rms_long_rows());
        let special = special.or_else(|| self.held_shifted());
        if let Some(plan) = special.or_else(|| self.widened_warp()) {
            return plan;
        }
        let plan = self.forward_of(
            warp_rows(self.n),
            (Variant::FwdWarp, Variant::FwdBlock),
            (Variant::FwdPipelinedWarp, Variant::FwdPipelinedBlock),
            1,
        );
        if let Some(unaligned) = self.unaligned_block(&plan) {
            return unaligned;
        }
        if let Some(row_block) = self.row_block(&plan) {
            return row_block;
        }
        Plan {
            grid: self.forward_grid(&plan),
            ..plan
        }
    }

    /// The row block (a block for every row, holding its row only, at 40 registers) in place
    /// of the pipelined block `pipelined` on sm_90, over weights of x's type, where three
    /// things hold (H200, docs/PERF.md v48):
    /// - a multiprocessor runs two of its blocks or more ([`resident_blocks`]): with one, it
    ///   idles from a block's end to the next block's start (f32 N = 15872, 992 ranks: -14%;
    ///   800 ranks, whose 50 warps the register file holds once: LayerNorm's f32 N = 12800
    ///   -15 to -18% and f16 25088 -32% beside the pipelined block, v55);
    /// - it runs more of its threads than of the pipelined block's, whose 64 registers
    ///   allow 1024 a multiprocessor, in whole blocks: 768 for teams of 384 or 768 ranks,
    ///   960 for 192 (+2 to +5% there at M = 4096), where the row block's allow 1536;
    /// - its last wave is nearly full: the blocks of every row run in waves of as many as fit the
    ///   device (as the rule counts them: [`rule_blocks`]), and where the last one leaves over 5%
    ///   of the waves' places empty, the pipelined block's resident teams, which share the rows out
    ///   two in flight each, came out ahead (16-bit N = 2048-4096 and 8192 at M = 4096: 1.2 to 5.2
    ///   waves, -2 to -11%; 10.3 waves, 6% empty, at N = 15872: -3%), and where it is nearly full
    ///   the row block gained (3.9 and 7.8 waves at N = 6144 and 12288: +2 and +5%; 20 to 83 waves
    ///   at bf16 M = 65536, N = 2048-8192: +2 to +13%); but rows of 2048 packs, which fill a team
    ///   of 512 ranks at 4 packs each (f32 N = 8192, 16-bit 16384), take it whatever its last wave:
    ///   3 blocks a multiprocessor where the pipelined block runs 2 gained 3% at M = 2048 and 4096
    ///   (5.2 and 10.3 waves, 14% and 6% empty; v52), where f16 15872 (1984 packs) lost 3%.
    ///
    /// RMSNorm's f32 kernel ran at 48 registers until v54, and its blocks are counted there
    /// ([`RMS_F32_ROW_BLOCK_RULE_REGISTERS`]), but for teams that 48 held to one block a
    /// multiprocessor (704-768 ranks, N = 11264-12288), which its 40 let run two (v54: +3.4 /
    /// +5.2 / +5.6% at N = 12288, M = 4096 / 16384 / 65536). Counted at 40 everywhere, the
    /// rule also gave it f32 N = 3072, 6144 at M = 1024 and 8192 and took it from N = 1536
    /// and 2048 at M = 16384: -0.4 to -5.7% each.
    fn row_block(&self, pipelined: &Plan) -> Option<Plan> {
        let row_block = Variant::FwdRowBlock;
        let takes_kernel = pipelined.variant == Variant::FwdPipelinedBlock
            && row_block.in_module(self.limits.arch)
            && row_block.has_pair(self.pair);
        let threads = self.block_threads(row_block, self.n, PIPE_HELD);
        if !takes_kernel || !self.fits(self.n, threads, PIPE_HELD) {
            return None;
        }
        let registers = row_block
            .max_registers(self.limits.arch, self.norm, self.pair)
            .unwrap_or(SM_REGISTERS / FULL_BLOCK);
        // The blocks a multiprocessor runs (one, and it idles from a block's end to the
        // next's start), and the count the wave rule takes.
        let resident = resident_blocks(threads, registers);
        let rule_registers = if self.norm == Norm::Rms && size_of::<T>() == 4 {
            RMS_F32_ROW_BLOCK_RULE_REGISTERS
        } else {
            registers
        };
        let blocks = match rule_blocks(threads, rule_registers) {
            counted if counted >= 2 => counted,
            _ => resident,
        };
        let pipelined_threads =
            resident_blocks(pipelined.threads, SM_REGISTERS / FULL_BLOCK) * pipelined.threads;
        let places = blocks * self.limits.sm_count;
        let waves = self.rows.div_ceil(places);
        let empty = waves * places - self.rows;
        let nearly_full = empty * 20 <= waves * places;
        let whole_team_of_512 = self.n == 512 * PIPE_HELD * pack_len::<T>();
        let takes =
            resident >= 2 && blocks * threads > pipelined_threads && (nearly_full || whole_team_of_512);
        takes.then_some(Plan {
            variant: row_block,
            threads,
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: Grid::EveryRow,
        })
    }

    /// The general block kernel's team over rows not all aligned, for launches of more rows
    /// than multiprocessors: whole warps of ranks that each take `UNALIGNED_BATCHES_PER_RANK`
    /// read batches or more, in place of about 4 packs' columns a rank rounded up to whole
    /// warps. The rows not 16-byte aligned are read element by element, a batch of
    /// `READ_BATCH_ELEMENTS` at once a rank, then a short batch: at f32 N = 4097 the 288
    /// ranks of 4 packs' columns took 14 elements each, one batch and six elements, which
    /// before v60 went a load at a time, each a DRAM round trip.
    fn unaligned_block(&self, general: &Plan) -> Option<Plan> {
        let takes = !self.aligned && !self.few_rows && general.variant == Variant::FwdBlock;
        let per_rank = UNALIGNED_BATCHES_PER_RANK * READ_BATCH_ELEMENTS;
        let threads = (self.n / per_rank / 32 * 32).clamp(64, self.max_threads(Variant::FwdBlock));
        takes.then(|| self.general_smem(Plan { threads, ..*general }, false, 1))
    }

    /// The few-rows forward, a block a row, for launches of at most one row a
    /// multiprocessor over block-team rows, all aligned whole packs that fit
    /// `few_rows_held` packs a rank (16 elements): its ranks load x, gamma and beta together,
    /// one DRAM round trip, where the pipelined kernel loads the weights after the
    /// reductions (docs/PERF.md, "The one-row forward against Liger's").
    fn few_rows_forward(&self) -> Option<Plan> {
        let held = crate::layout::few_rows_held(size_of::<T>() as u32);
        let threads = self.block_threads(Variant::FwdFewRows, self.n, held);
        let takes = self.few_rows && !warp_rows(self.n) && self.aligned && self.fits(self.n, threads, held);
        takes.then_some(Plan {
            variant: Variant::FwdFewRows,
            threads,
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: Grid::EveryRow,
        })
    }

    /// RMSNorm's forward over rows of 2049 to 8192 packs (16-bit N = 16392-65536, f32
    /// 8196-32768), weights of x's type, on sm_90: the general kernel, a block for every row,
    /// rather than the pipelined block (up to 4096 packs) or a resident grid of 1024-rank
    /// teams. 16-bit rows take it at 8 packs a rank at any such length (H200, docs/PERF.md
    /// v35: +2.1 to +5.0% at N = 20480-65536); f32 rows where the team has 512 or 1024 ranks,
    /// whose blocks (64 registers) fill a multiprocessor's 1024 threads (+2.7 to +3.0% at N =
    /// 15872, 16384 and 32768): f32 teams of 352-768 ranks lost 0.8-3.7% that way. Rows of
    /// 2048 packs or fewer gained nothing (f16 15872 and 16384, f32 8192), and LayerNorm's,
    /// which stage their next row, lost.
    /// f32 rows of 4097 to 6144 packs (N = 16388-24576), whose 8 packs a rank would take
    /// 544-768 ranks, go to 512 ranks that hold 4 packs each and stage the rest in shared
    /// memory: two blocks a multiprocessor where the resident grid's 1024 ranks run one
    /// (v53: +22.9 / +14.0 / +4.4% at N = 16896 / 20480 / 24576, M = 4096; 24576 at M = 1024
    /// and 16384 +3.2 / +3.3%), where 7168 and 7680 packs lost 1.3 and 17.5%.
    fn rms_long_rows(&self) -> Option<Plan> {
        let packs = self.n / pack_len::<T>();
        let staged = size_of::<T>() == 4 && (4097..=6144).contains(&packs);
        let (threads, smem) = if staged {
            (512, crate::layout::staged_smem(packs, 512, 1))
        } else {
            (
                self.block_threads(Variant::FwdBlock, self.n, FWD_HELD),
                SCRATCH_BYTES,
            )
        };
        let fills = size_of::<T>() == 2 || threads == 512 || threads == 1024;
        let takes = self.norm == Norm::Rms
            && self.limits.arch == Arch::Sm90
            && self.aligned
            && !self.few_rows
            && self.pair.weights == self.pair.x
            && (2049..=8192).contains(&packs)
            && fills
            && self.smem_fits(smem as usize);
        (takes && (staged || self.fits(self.n, threads, FWD_HELD))).then_some(Plan {
            variant: Variant::FwdBlock,
            threads,
            stacked: 1,
            smem,
            local: false,
            grid: Grid::EveryRow,
        })
    }

    /// LayerNorm's f16 and bf16 rows of aligned packs that a warp holds at 2 to `PIPE_HELD`
    /// packs a lane (N = 257-1024), on sm_90: the widened warp kernel, a warp for every row,
    /// rather than the pipelined warp on a resident grid (H200, docs/PERF.md v43: +0.3 to
    /// +7.6% at N = 264-1024 and M = 64 to 65536; beside f32 weights -1.4 to +2.9%). Rows of
    /// one pack a lane lost 5% at M = 65536 that way, and RMSNorm's rows and LayerNorm's
    /// f32 ones 5-8% at M = 16384.
    fn widened_warp(&self) -> Option<Plan> {
        let packs = self.n / pack_len::<T>();
        let takes = self.norm == Norm::Layer
            && self.limits.arch == Arch::Sm90
            && size_of::<T>() == 2
            && self.aligned
            && packs > 32
            && self.fits(self.n, 32, PIPE_HELD);
        takes.then(|| Plan {
            variant: Variant::FwdWidenedWarp,
            threads: self.warp_threads(Variant::FwdWidenedWarp),
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: Grid::EveryRow,
        })
    }

    /// The plain forward's grid: a team for every row for pipelined block teams of 256
    /// ranks, or of 512 that keep their next row in registers, on sm_90 (H200, docs/PERF.md
    /// v33: LayerNorm +2 to +5% at f16 and bf16 N = 8192, f32 4096 and 8192). At 64
    /// registers a multiprocessor runs 1024 threads, which such blocks fill whole (4 or 2 of
    /// them), so a block that starts as another ends keeps it full without a second row in
    /// flight.
    /// Other shapes lost that way (up to 17%: teams of 384 ranks, 768 threads a
    /// multiprocessor; of 64 to 128, whose short rows pay a block's start and end; of 512
    /// that stage their next row) or gained under 2.5%, and sm_80 is unmeasured.
    fn forward_grid(&self, plan: &Plan) -> Grid {
        let staged = pipeline_stages(self.norm, size_of::<T>(), self.n / pack_len::<T>());
        let fills = plan.threads == 256 || (plan.threads == 512 && !staged);
        self.every_row_on_sm90(plan.variant == Variant::FwdPipelinedBlock && fills)
    }

    /// A team for every row where `measured_faster` on sm_90, the only architecture the
    /// grids were measured on; else the resident grid.
    fn every_row_on_sm90(&self, measured_faster: bool) -> Grid {
        if self.limits.arch == Arch::Sm90 && measured_faster {
            Grid::EveryRow
        } else {
            Grid::Resident
        }
    }

    /// The residual add's kernels, chosen as the plain forward's: their staging takes room
    /// for the residual's packs beside x's.
    fn forward_residual(&self) -> Plan {
        if let Some(plan) = self.residual_held().or_else(|| self.residual_streamed()) {
            return plan;
        }
        let plan = self.forward_of(
            self.residual_warp_rows(),
            (Variant::FwdResidualWarp, Variant::FwdResidualBlock),
            (
                Variant::FwdResidualPipelinedWarp,
                Variant::FwdResidualPipelinedBlock,
            ),
            2,
        );
        self.residual_unaligned(&plan).unwrap_or(Plan {
            grid: self.forward_residual_grid(&plan),
            ..plan
        })
    }

    /// The streamed residual forward at the general block kernel's team, for launches of
    /// more rows than multiprocessors not all aligned: the rows that are not whole aligned
    /// packs it takes in half packs where 8-byte aligned, else element by element (s read
    /// back from L2 twice, as the general kernel does), at 64 registers where the general
    /// kernel's 128 run 16 warps a multiprocessor; the aligned ones it streams rather than
    /// holds or stages. sm_90 only: the sm_80 module's streamed kernel takes aligned rows
    /// only (its element path spilled there).
    fn residual_unaligned(&self, general: &Plan) -> Option<Plan> {
        let takes = self.limits.arch == Arch::Sm90
            && !self.aligned
            && !self.few_rows
            && general.variant == Variant::FwdResidualBlock;
        takes.then_some(Plan {
            variant: Variant::FwdResidualStreamed,
            threads: general.threads,
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: Grid::Resident,
        })
    }

    /// The held residual forward, for launches of more rows than multiprocessors whose rows
    /// are all aligned 16-bit packs, with weights of x's type, a team for every row on sm_90:
    /// - past what the pipelined block holds (4 packs a rank of 512) and within
    ///   `RESIDUAL_HELD` packs a rank of a block of 1024 (N = 16385-32768). At 64 registers
    ///   such a block fills a multiprocessor's register file with 32 warps, where the
    ///   general kernel held these rows at 8 packs a rank of 512 and 128 registers, 16 warps
    ///   (H200, docs/PERF.md v40: +6.6 to +12.3% at N = 20000-32768, RMSNorm +4.8 to +14.9%
    ///   at 32768). Its blocks of 640 and 768 ranks lost 3-6%, so the block is
    ///   [`FULL_BLOCK`];
    /// - rows the pipelined block holds, where the team at 4 packs a rank has 128, 256 or
    ///   512 ranks (so that whole blocks fill a multiprocessor's 1024 threads: N = 3073-4096,
    ///   7169-8192, 15361-16384), in place of the pipelined kernel's two rows in flight at 128
    ///   registers (docs/PERF.md v41: +0.6 to +3.5% at N = 4096, 8192 and 16384, both norms
    ///   and types; teams of 384 ranks, N = 12288, lost 2.7-3.3% in f16).
    ///
    /// Over f32 rows (x, or a stream in f32) it gained 2% at N = 16384 and lost 17% at
    /// 12288, and the registry has it for 16-bit rows only.
    fn residual_held(&self) -> Option<Plan> {
        if self.shifted {
            return self.residual_held_shifted();
        }
        let variant = Variant::FwdResidualHeld;
        let pipelined = self.fits(
            self.n,
            self.max_threads(Variant::FwdResidualPipelinedBlock),
            PIPE_HELD,
        );
        let threads = if pipelined {
            self.block_threads(variant, self.n, RESIDUAL_HELD)
        } else {
            FULL_BLOCK
        };
        let fills = threads >= 128 && FULL_BLOCK.is_multiple_of(threads);
        let takes = variant.has_pair(self.pair)
            && self.aligned
            && !self.few_rows
            && fills
            && self.fits(self.n, threads, RESIDUAL_HELD);
        takes.then(|| Plan {
            variant,
            threads,
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: self.every_row_on_sm90(true),
        })
    }

    /// The held forward over rows shifted alike ([`Alignment::Shifted`]: x and y of one
    /// type, weights of it; 16-bit rows in half packs too), as [`Self::every_row_held_shifted`]
    /// takes them. The general block kernel streams them ([`Self::unaligned_block`]), x read
    /// again from L2 for each pass, in packs from the boundary (RMSNorm's), half packs or
    /// elements: held, LayerNorm's 16-bit rows gained 12-96% (f16 and bf16 N = 1028-16388,
    /// most where they went element by element), RMSNorm's 1-22%, f32 rows of 2051-16387
    /// 6-41% (H200, docs/PERF.md v86).
    ///
    /// f32 rows of fewer than 512 whole packs (N < 2048) keep the general kernel: at N =
    /// 1030 the held kernel's 128 ranks, 65 of them with packs, lost 7.4% in LayerNorm and
    /// gained nothing in RMSNorm (H200, docs/PERF.md v86), where 16-bit rows of as many
    /// columns gained 8-45%.
    fn held_shifted(&self) -> Option<Plan> {
        let short_f32 = size_of::<T>() == 4 && self.n / pack_len::<T>() < 512;
        if short_f32 {
            return None;
        }
        self.every_row_held_shifted(Variant::FwdHeldShifted, FWD_HELD_SHIFTED, warp_rows(self.n))
    }

    /// The held kernel `variant` over rows shifted alike, on sm_90, for launches of more
    /// rows than multiprocessors whose rows, longer than a warp's (`warp_rows`: not), fit
    /// `held` packs a rank of a block from their first 16-byte boundary: the fewest ranks
    /// that hold them, a power of two from 64 to 1024 (whole blocks fill a multiprocessor's
    /// 1024 threads at 64 registers), a team for every row.
    fn every_row_held_shifted(&self, variant: Variant, held: u32, warp_rows: bool) -> Option<Plan> {
        // Whole packs from the first boundary: at most n's (the edge columns go a column a
        // rank).
        let ranks = (self.n / pack_len::<T>()).div_ceil(held);
        let threads = ranks.next_power_of_two().max(64);
        let takes = self.shifted
            && variant.in_module(self.limits.arch)
            && variant.has_pair(self.pair)
            && !self.few_rows
            && !warp_rows
            && threads <= self.max_threads(variant).min(FULL_BLOCK);
        takes.then_some(Plan {
            variant,
            threads,
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: Grid::EveryRow,
        })
    }

    /// The held residual forward over rows shifted alike ([`Alignment::Shifted`]: x, y,
    /// residual and s of one type, weights of it; 16-bit rows in half packs too), as
    /// [`Self::every_row_held_shifted`] takes them, at `RESIDUAL_HELD_SHIFTED` packs a
    /// rank. Streamed ([`Self::residual_unaligned`]), these rows' s is written and then read
    /// back from L2 twice (H200, docs/PERF.md v84b-v85, against the streamed kernel:
    /// LayerNorm's 16-bit rows +73 to +78% at N = 1030, +40 to +56% at 2051-16383;
    /// RMSNorm's at 4 packs a rank rather than 2: +8 to +27% at 4097-16383, and +18% at
    /// 24577; rows in half packs +13 to +27%; f32 rows, which it took element by element,
    /// +20 to +52% at N = 1030-12289).
    fn residual_held_shifted(&self) -> Option<Plan> {
        self.every_row_held_shifted(
            Variant::FwdResidualHeldShifted,
            RESIDUAL_HELD_SHIFTED,
            self.residual_warp_rows(),
        )
    }

    /// The streamed residual forward, 512 ranks, for launches of more rows than
    /// multiprocessors whose rows are all aligned packs too long for the general kernel's
    /// block to hold ([`FWD_HELD`] packs a rank of 512: 16-bit N > 32768, f32 rows, a
    /// stream in f32 included, past 16384), which it would stage or stream at one block a
    /// multiprocessor; a team for every row on sm_90. H200, docs/PERF.md v39: +53 to +59% at
    /// f32 N = 65536 (too long to stage), +3 to +6% at f32 32768 and f16 65536 (staged).
    /// Launches of few rows keep the staged kernel, which has each row's loads in flight at
    /// once.
    fn residual_streamed(&self) -> Option<Plan> {
        let ranks = self.max_threads(Variant::FwdResidualBlock);
        let takes = self.aligned && !self.few_rows && !self.fits(self.n, ranks, FWD_HELD);
        takes.then(|| Plan {
            variant: Variant::FwdResidualStreamed,
            threads: ranks,
            stacked: 1,
            smem: SCRATCH_BYTES,
            local: false,
            grid: self.every_row_on_sm90(true),
        })
    }

    /// The residual forward's grid: a team for every row, on sm_90, for pipelined block
    /// teams of 256 ranks, and, where x itself is f32, for block teams of 512 ranks that
    /// hold their row (pipelined, or the general kernel's held rows: f32 N = 8196-16384)
    /// (H200, docs/PERF.md v34: +3.7 to +4.5% at f16 N = 8192 and f32 4096, +0.2 to +6.3%
    /// over f32 8192-16384). These kernels take up to 128 registers, so a multiprocessor
    /// runs 16 of their warps (4 on each of its quarters), which such blocks fill whole.
    /// Teams of 288-480 ranks, one block a multiprocessor, lost up to 25% that way, 16-bit
    /// rows on 512 ranks (the stream in f32 included) gained or lost 2-6%, and teams of
    /// 64-224 ranks lost up to 8% or gained under 1.3%.
    fn forward_residual_grid(&self, plan: &Plan) -> Grid {
        let f32_x = DTYPE_BYTES[self.pair.x] == 4;
        let every_row = match plan.variant {
            Variant::FwdResidualPipelinedBlock => plan.threads == 256 || (f32_x && plan.threads == 512),
            Variant::FwdResidualBlock => {
                f32_x && plan.threads == 512 && self.aligned && self.fits(self.n, 512, FWD_HELD)
            }
            _ => false,
        };
        self.every_row_on_sm90(every_row)
    }

    /// Whether the residual forward takes its rows a warp each: rows of up to 1024 elements,
    /// but rows of f32 (f32 x, or a residual stream kept in f32) all aligned with more packs
    /// than a warp holds at `PIPE_HELD` a lane (N = 513-1024), which the pipelined block
    /// takes (64 ranks of 3 or 4 packs) rather than the general warp kernel at up to 8 packs
    /// a lane (H200, docs/PERF.md v44: +2.3 to +7.0% at M = 4096, +0.2 to +2.6% at 65536).
    /// The plain forward's f32 rows lost up to 3.1% that way at M = 65536 and keep warps.
    fn residual_warp_rows(&self) -> bool {
        let over_warp = self.n / pack_len::<T>() > 32 * PIPE_HELD;
        warp_rows(self.n) && !(size_of::<T>() == 4 && self.aligned && over_warp)
    }

    /// A forward among its (warp, block) `general` kernels and its `pipelined` ones, the
    /// warp ones where `warp`: rows that are all aligned whole packs the pipelined kernel
    /// holds ([`Self::pipelined`]) take it; the others the general one at four packs a
    /// thread, up to eight where the block is capped (rows to 8 packs a thread stay in
    /// registers), with room to stage rows too long to hold where the device has it: their
    /// packs past `PART_HELD` a rank, in `copies` areas. Rows it cannot stage whole stream,
    /// with the scratch only.
    fn forward_of(
        &self,
        warp: bool,
        general: (Variant, Variant),
        pipelined: (Variant, Variant),
        copies: u32,
    ) -> Plan {
        let plan = self.team_plan(warp, general.0, general.1);
        let pipelined = if warp { pipelined.0 } else { pipelined.1 };
        if let Some(plan) = self.pipelined(pipelined, plan) {
            return plan;
        }
        self.general_smem(plan, warp, copies)
    }

    /// `plan`, a general kernel's, with the shared memory that stages what its teams do not
    /// hold of aligned rows (`copies` of it: x's, and a residual's), where there is room.
    fn general_smem(&self, plan: Plan, warp: bool, copies: u32) -> Plan {
        let ranks = if warp { 32 } else { plan.threads };
        let staged = crate::layout::staged_smem(self.n / pack_len::<T>(), plan.threads, copies);
        let holds = warp || self.fits(self.n, ranks, FWD_HELD);
        Plan {
            smem: if !holds && staged <= self.limits.max_smem {
                staged
            } else {
                SCRATCH_BYTES
            },
            ..plan
        }
    }

    /// The pipelined kernel `variant`'s plan, where every row is aligned whole packs that
    /// fit the packs a rank it holds: 4, or 6 in LayerNorm's block teams over the f32 rows
    /// they stage ([`crate::layout::pipelined_block_held`]). Its block team takes that many
    /// packs a rank, or one where there are few rows; the warp kernel keeps the general
    /// one's block (`general`).
    fn pipelined(&self, variant: Variant, general: Plan) -> Option<Plan> {
        let warp = variant.warp_team();
        let (packs, size) = (self.n / pack_len::<T>(), size_of::<T>());
        let block = variant == Variant::FwdPipelinedBlock;
        let held = if block {
            crate::layout::pipelined_block_held(self.norm, size, packs)
        } else {
            PIPE_HELD
        };
        let threads = match (warp, self.few_rows) {
            (true, _) => general.threads,
            (false, true) => self.block_threads(variant, self.n, self.packs_per_rank()),
            (false, false) => self.block_threads(variant, self.n, held),
        };
        let ranks = if warp { 32 } else { threads };
        if !(self.aligned && self.fits(self.n, ranks, held) && threads <= self.max_threads(variant)) {
            return None;
        }
        let smem = if block {
            crate::layout::pipelined_smem(self.norm, size, packs, threads)
        } else {
            general.smem
        };
        Some(Plan {
            variant,
            threads,
            smem,
            ..general
        })
    }

    /// Stage 1's plan; `dsum`: the launch adds a residual's dsum to dx.
    fn backward(&self, dsum: bool) -> Result<Plan> {
        if let Some(plan) = self.cluster(dsum) {
            return Ok(plan);
        }
        if let Some(plan) = self.held(dsum) {
            return Ok(plan);
        }
        // Each team sums its rows' partials in its own shared memory (about 8n bytes) when
        // they fit; warp teams must (8 warps * 8.3 KB at n = 1024: every sm_80 and later
        // device has room, but one without gets an error, not a launch failure).
        let owned = self.team_plan(warp_rows(self.n), Variant::BwdOwnedWarp, Variant::BwdOwnedBlock);
        let owned = self.element_rows_block(owned);
        let per_block = if warp_rows(self.n) { owned.threads / 32 } else { 1 };
        let local_smem = crate::layout::owned_local_smem(per_block, self.n);
        let local = self.smem_fits(local_smem);
        if warp_rows(self.n) && !local {
            return Err(Error::SharedMemory {
                what: "backward stage 1 (owned, warp per row)",
                needed: local_smem,
                available: self.limits.max_smem as usize,
            });
        }
        Ok(Plan {
            smem: if local { local_smem as u32 } else { SCRATCH_BYTES },
            local,
            ..owned
        })
    }

    /// The owned block kernel's team over launches whose rows go element by element (not
    /// all aligned, nor all a whole number of half packs of x, dy and weights of one size:
    /// `layout::block_half_pack_rows`): ranks of `BWD_UNALIGNED_BATCHES_PER_RANK` batches each
    /// rounded down to whole warps, in place of 4 packs' columns a rank. At 16-bit N = 1030
    /// those are 64 ranks, 16 elements each, a team's row a chain of 4 batches a pass, and a
    /// multiprocessor runs 16 of them at 64 registers (sm_90), each block with its own partial
    /// row: 2112 rows of partials for 4096 rows of data, and in locked mode 16 blocks queued
    /// on each group's lock. 128 ranks there: +17% deterministic, 2.4 times locked (H200,
    /// docs/PERF.md v70). Launches that alternate packed rows and half-pack rows keep 4 packs'
    /// columns a rank, which ran 12% faster at f16 N = 4100 than 512 ranks.
    fn element_rows_block(&self, owned: Plan) -> Plan {
        let bytes = size_of::<T>() as u32;
        let one_size =
            DTYPE_BYTES[self.pair.x] as u32 == bytes && DTYPE_BYTES[self.pair.weights] as u32 == bytes;
        let half_packs = one_size && block_half_pack_rows(self.n, bytes);
        if owned.variant != Variant::BwdOwnedBlock || self.aligned || half_packs || self.few_rows {
            return owned;
        }
        let per_rank = BWD_UNALIGNED_BATCHES_PER_RANK * BWD_BATCH_ELEMENTS;
        let threads = (self.n / per_rank / 32 * 32).clamp(64, self.max_threads(Variant::BwdOwnedBlock));
        Plan { threads, ..owned }
    }

    /// The cluster kernels, where they should run: on sm_90, for block-team rows that one
    /// block cannot hold in registers (4 packs a thread) or cannot sum in shared memory (8n
    /// bytes), as long as an eighth of the row fits. Slices held in registers where every row
    /// is aligned packs (and, with a `dsum`, where the held kernels take it), over the
    /// fewest blocks whose slices fit: fewer blocks wait for each row's sums.
    fn cluster(&self, dsum: bool) -> Option<Plan> {
        let n = self.n;
        if self.limits.arch != Arch::Sm90 || warp_rows(n) {
            return None;
        }
        let packs = n.div_ceil(pack_len::<T>());
        let one_block = self.smem_fits(crate::layout::owned_local_smem(1, n))
            && packs <= self.max_threads(Variant::BwdOwnedBlock) * BWD_HELD;
        let general_smem = crate::layout::cluster_smem(n, pack_len::<T>());
        if one_block || !self.smem_fits(general_smem) {
            return None;
        }
        // 16-bit rows 8-byte aligned are held in half packs, as the held block kernel holds
        // them ([`Self::held`]).
        let held = HELD_CLUSTER_SIZES.iter().find_map(|&size| {
            let variant = if self.half_packs {
                Variant::cluster_held_halves(size).filter(|v| v.has_pair(self.pair))
            } else {
                Variant::cluster_held(size)
            };
            let variant = variant.filter(|v| !dsum || self.takes_dsum(*v))?;
            let slice = crate::layout::slice_width(n, pack_len::<T>(), size);
            let threads = self.block_threads(variant, slice, 4);
            let smem = crate::layout::cluster_held_smem(pack_len::<T>(), threads);
            ((self.aligned || self.half_packs) && self.fits(slice, threads, BWD_HELD) && self.smem_fits(smem))
                .then_some(Plan {
                    variant,
                    threads,
                    stacked: 1,
                    smem: smem as u32,
                    local: true,
                    grid: Grid::Resident,
                })
        });
        held.or_else(|| {
            let slice = crate::layout::slice_width(n, pack_len::<T>(), CLUSTER_SIZE);
            Some(Plan {
                variant: Variant::BwdCluster8,
                threads: self.block_threads(Variant::BwdCluster8, slice, 4),
                stacked: 1,
                smem: general_smem as u32,
                local: true,
                grid: Grid::Resident,
            })
        })
    }

    /// The held stage 1, where it can run: every row whole aligned packs, held in registers
    /// at 4 packs a thread, with room in shared memory for each rank's partials. A block takes
    /// as many teams as the kernel's thread limit and shared memory allow (for block teams,
    /// stacked along y): the same teams per multiprocessor as one-team blocks, since the
    /// limit is the registers', but each block's teams add into one partial row, so there are
    /// fewer partial rows to write and for stage 2 to read (f16 N = 4096: 128 rows of 16 KB,
    /// not 512). Block-team rows shifted alike ([`Alignment::Shifted`]) without a `dsum`
    /// take the held kernel's shifted copy, which holds them in packs from x's first 16-byte
    /// boundary and stages their weights in shared memory.
    fn held(&self, dsum: bool) -> Option<Plan> {
        // Rows of warp length with more packs than a warp holds at `BWD_HELD` a lane (f32 N =
        // 513-1024) go a block team, held, rather than a warp, streamed (the owned kernel):
        // H200, docs/PERF.md v37, 19-44% faster at f32 N = 544-1024 and with a stream in f32.
        let warp = warp_rows(self.n) && self.n / pack_len::<T>() <= 32 * BWD_HELD;
        // Block teams hold 16-bit rows 8-byte aligned in half packs: as many columns a rank
        // as whole packs, read 8 bytes at a time.
        let halves = !warp && self.half_packs && Variant::BwdHeldBlockHalves.has_pair(self.pair);
        // Shifted rows past warp length (rows of warp length stay on the owned warp kernel,
        // where they were measured).
        let shifted =
            !warp_rows(self.n) && !dsum && self.shifted && Variant::BwdHeldBlockShifted.has_pair(self.pair);
        let variant = if warp {
            Variant::BwdHeldWarp
        } else if halves {
            Variant::BwdHeldBlockHalves
        } else if shifted {
            Variant::BwdHeldBlockShifted
        } else {
            Variant::BwdHeldBlock
        };
        // A team's ranks, and the most teams the kernel's thread limit allows a block (one
        // where there are few rows: stacked teams would idle).
        // A shifted row's packs are its whole packs past its head: at most n's whole packs
        // (f16 N = 4097: 512 on 128 ranks), the edges a column a rank besides.
        let cols = if shifted {
            self.n / pack_len::<T>() * pack_len::<T>()
        } else {
            self.n
        };
        let ranks = if warp {
            32
        } else {
            self.block_threads(variant, cols, self.packs_per_rank())
        };
        let most = if warp {
            self.max_threads(variant) / 32
        } else if self.few_rows {
            1
        } else {
            (self.max_threads(variant) / ranks).min(MAX_STACKED)
        };
        // The most of those whose partials fit shared memory (each rank holds its own; a
        // shifted block its staged weights too).
        let weight_bytes = DTYPE_BYTES[self.pair.weights] as u32;
        let held_smem = |threads| {
            if shifted {
                crate::layout::held_shifted_smem(pack_len::<T>(), threads, self.n, weight_bytes)
            } else {
                crate::layout::held_smem(pack_len::<T>(), threads)
            }
        };
        let teams = (1..=most).rev().find(|&t| self.smem_fits(held_smem(ranks * t)))?;
        if !((self.aligned || halves || shifted) && self.fits(cols, ranks, BWD_HELD)) {
            return None;
        }
        let (threads, stacked) = if warp { (32 * teams, 1) } else { (ranks, teams) };
        Some(Plan {
            variant,
            threads,
            stacked,
            smem: held_smem(threads * stacked) as u32,
            local: true,
            grid: Grid::Resident,
        })
    }
}
