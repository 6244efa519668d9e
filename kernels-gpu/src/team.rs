//! Teams: the threads that share one row. A warp (32 lanes, exchanging through shuffles)
//! for short rows, where a block would leave most threads idle; a whole block (up to 1024
//! threads, warps exchanging through shared memory) for long rows.
//!
//! Every reduction hands all ranks the same bits: sums use a butterfly (a + b == b + a
//! exactly), mean/variance use one fixed merge tree whose root is then broadcast.

use crate::device::{self, shared_ptr, shfl_down, shfl_idx, shfl_xor};

/// Block reductions use the first `SCRATCH_BYTES` of dynamic shared memory: one 16-byte slot
/// per warp of a 1024-thread block. The host launches every kernel with at least that much.
pub use crate::layout::SCRATCH_BYTES;

/// Count, mean and sum of squared deviations (M2) of a set of values.
///
/// Merging two sets (Chan, Golub and LeVeque) with d = mean_b - mean_a, n = n_a + n_b:
///   mean = mean_a + d * n_b / n
///   M2   = M2_a + M2_b + d^2 * n_a * n_b / n
/// never subtracts two large sums, so a row whose mean is large against its spread keeps
/// its precision, unlike var = E[x^2] - E[x]^2 in f32.
#[derive(Clone, Copy)]
pub struct Stats {
    pub n: f32,
    pub mean: f32,
    pub m2: f32,
}

impl Stats {
    pub const EMPTY: Stats = Stats {
        n: 0.0,
        mean: 0.0,
        m2: 0.0,
    };

    #[inline(always)]
    pub fn merge(self, o: Stats) -> Stats {
        if o.n == 0.0 {
            return self;
        }
        if self.n == 0.0 {
            return o;
        }
        let n = self.n + o.n;
        let d = o.mean - self.mean;
        let w = o.n / n;
        Stats {
            n,
            mean: self.mean + d * w,
            m2: self.m2 + o.m2 + d * d * self.n * w,
        }
    }

    /// The statistics of the values `v_j - pivot` (a pack, a batch or a single element),
    /// computed exactly in two passes over registers: mean first, then squared deviations
    /// from it. M2 is the same whatever the pivot; the mean is `pivot` less. With a pivot
    /// near the values (a row's first), the merges' means and their differences are of the
    /// spread's size, not the values', and lose no digits to a large mean.
    #[inline(always)]
    pub fn of(v: &[f32], pivot: f32) -> Stats {
        let mut s = 0.0;
        for &x in v {
            s += x - pivot;
        }
        let n = v.len() as f32;
        let mean = s / n;
        let mut m2 = 0.0;
        for &x in v {
            let d = x - pivot - mean;
            m2 += d * d;
        }
        Stats { n, mean, m2 }
    }

    /// The same set, its mean taken `pivot` less.
    #[inline(always)]
    pub fn less(self, pivot: f32) -> Stats {
        Stats {
            mean: self.mean - pivot,
            ..self
        }
    }

    #[inline(always)]
    fn shfl_down(self, delta: u32) -> Stats {
        Stats {
            n: shfl_down(self.n, delta),
            mean: shfl_down(self.mean, delta),
            m2: shfl_down(self.m2, delta),
        }
    }

    #[inline(always)]
    fn shfl_idx(self, src: u32) -> Stats {
        Stats {
            n: shfl_idx(self.n, src),
            mean: shfl_idx(self.mean, src),
            m2: shfl_idx(self.m2, src),
        }
    }
}

/// Merge over a warp; every lane gets lane 0's result of the same fixed tree.
#[inline(always)]
fn warp_stats(mut s: Stats) -> Stats {
    let mut delta = 16;
    while delta > 0 {
        // Lanes past 31 - delta merge garbage, but only lanes below delta feed lane 0.
        s = s.merge(s.shfl_down(delta));
        delta /= 2;
    }
    s.shfl_idx(0)
}

/// Sums of `V` values over a warp: a butterfly, which leaves the same bits in every lane.
#[inline(always)]
fn warp_sums<const V: usize>(mut v: [f32; V]) -> [f32; V] {
    let mut mask = 16;
    while mask > 0 {
        for x in &mut v {
            *x += shfl_xor(*x, mask);
        }
        mask /= 2;
    }
    v
}

/// The threads sharing one row.
pub trait Team {
    /// Whether the backward prefetches the team's next row into L2 while it works on the
    /// current one. Measured (docs/PERF.md, v6): it pays for cluster teams, whose rows
    /// wait on a cluster-wide barrier with nothing in flight; for warp and block teams the
    /// extra instructions and L2 lines cost more than the overlap gains.
    const PREFETCH_NEXT_ROW: bool = false;

    /// Whether the forward holds the first packs of rows too long to hold whole, streaming
    /// only the rest (docs/PERF.md, v13). Block teams do; the host gives warps only rows
    /// that fit, and the path would cost the warp kernels registers they do not have.
    const HOLDS_PART_OF_LONG_ROWS: bool = false;

    /// Whether the backward takes rows whose pointers sit the same bytes past a 16-byte
    /// boundary in packs from that boundary (`backward::streamed::backward_row_any`), rather
    /// than element by element. Block teams do. Warp teams' rows are short, and with them
    /// too sm_90's owned block kernels spilled 20-32 bytes more at their 64 registers; with
    /// cluster teams, the general cluster8 kernels spilled 4-12 bytes at their 96 (and the
    /// rows that reach them, past 16384 elements, are mostly 8-byte aligned: half packs).
    const TAKES_SHIFTED_ROWS: bool = false;

    /// Whether the backward adds a streamed row's partials in the pass that writes dx, so
    /// that x, dy and gamma are read twice a row, not three times
    /// (`backward::streamed::backward_row`). Cluster teams do: the general cluster8 kernel
    /// is bound by the instructions it issues (docs/PERF.md, v74), and the third pass
    /// repeats the loads, the widening and xhat. Block teams keep the pass of its own (with
    /// the merge, sm_90's 16-bit owned block kernels spilled 4-16 bytes at their 64
    /// registers), as do held rows (their third pass reads nothing, and the merge spilled
    /// the 16-bit cluster8 kernels 8-24 bytes at their 96).
    const PARTIALS_WITH_DX: bool = false;

    /// Packs of a shifted row (`row::SHIFTED_PACKS`) each rank has in flight at once
    /// (`row::for_each_read`). 4 (64 bytes a rank) where the row comes from DRAM, as the
    /// plain forward's x does: with 2, RMSNorm's plain block kernels lost 1-9% (f16 N =
    /// 4097 and 16383, f32 2051 and 4097; docs/PERF.md v79). [`ResidualBlock`] takes 2.
    const SHIFTED_READ_BATCH: usize = crate::row::READ_BATCH_PACKS;

    /// Index of this thread within the team.
    fn rank() -> u32;
    /// Threads in the team.
    fn size() -> u32;
    /// Index of this team in the grid.
    fn id() -> u32;
    /// Teams in the grid.
    fn count() -> u32;
    /// Index of this team within its block (0 for teams of a whole block or more).
    #[inline(always)]
    fn index_in_block() -> u32 {
        0
    }
    /// Teams per block (1 for teams of a whole block or more).
    #[inline(always)]
    fn per_block() -> u32 {
        1
    }
    /// Barrier over the team; memory written before it is visible to the team after it.
    fn sync();
    /// Two sums over the team, the same in every rank.
    fn sum2(a: f32, b: f32) -> (f32, f32);
}

/// The forward's teams: they also sum one value (half the shuffles of [`Team::sum2`]: a
/// shuffle is an instruction the compiler cannot drop, even of a constant), and merge row
/// statistics (the streamed rows).
pub trait StatsTeam: Team {
    /// A sum over the team, the same in every rank.
    fn sum(a: f32) -> f32;
    /// `Stats` merged over the team, the same in every rank.
    fn reduce_stats(s: Stats) -> Stats;
}

/// One warp per row: lanes 0..32.
pub struct Warp;

impl Team for Warp {
    #[inline(always)]
    fn rank() -> u32 {
        device::thread_idx() % 32
    }
    #[inline(always)]
    fn size() -> u32 {
        32
    }
    #[inline(always)]
    fn id() -> u32 {
        device::block_idx() * (device::block_dim() / 32) + device::thread_idx() / 32
    }
    #[inline(always)]
    fn count() -> u32 {
        device::grid_dim() * (device::block_dim() / 32)
    }
    #[inline(always)]
    fn index_in_block() -> u32 {
        device::thread_idx() / 32
    }
    #[inline(always)]
    fn per_block() -> u32 {
        device::block_dim() / 32
    }
    #[inline(always)]
    fn sync() {
        device::sync_warp()
    }
    #[inline(always)]
    fn sum2(a: f32, b: f32) -> (f32, f32) {
        let [a, b] = warp_sums([a, b]);
        (a, b)
    }
}

impl StatsTeam for Warp {
    #[inline(always)]
    fn sum(a: f32) -> f32 {
        warp_sums([a])[0]
    }
    #[inline(always)]
    fn reduce_stats(s: Stats) -> Stats {
        warp_stats(s)
    }
}

/// One block per row: `blockDim.x` threads (a multiple of 32, at most 1024) share the row,
/// warps exchanging through shared memory. [`Block`] is one team per block; a
/// [`StackedBlock`] stacks `blockDim.y` such teams (at most 15), as the held backward does so
/// that its teams add their partials into one partial row. Stacked team `t` synchronizes on
/// barrier `1 + t` over its own threads, so it never waits for another team; a lone block
/// team uses the block barrier and needs no registers for the stack. `NARROW`: the warps'
/// slots are addressed through 32-bit shared-window addresses in inline PTX (one register
/// fewer than a generic pointer), for kernels at tight register bounds (the held cluster
/// kernels at 128, the row block at 40, which spill with generic pointers); the others
/// write and read the slots as plain Rust, which LLVM schedules around: the same kernels
/// through inline PTX lost 8-17% at f32 N = 32768-65536 (docs/PERF.md v48).
/// `SHIFTED_READ_BATCH`: as [`Team::SHIFTED_READ_BATCH`].
pub struct Blocks<
    const STACKED: bool,
    const NARROW: bool = false,
    const SHIFTED_READ_BATCH: usize = { crate::row::READ_BATCH_PACKS },
>;

/// A whole block per row, launched one-dimensional.
pub type Block = Blocks<false>;

/// [`Block`] with its slots at 32-bit addresses (the sm_90 module's clusters and row block).
#[cfg(layernorm_sm90)]
pub type NarrowBlock = Blocks<false, true>;

/// `blockDim.y` teams of `blockDim.x` threads per block, one row each.
pub type StackedBlock = Blocks<true>;

/// [`Block`] for the streamed residual forward, whose row passes read back the s it has
/// just written, from L2: its shifted rows' reads go 2 packs a rank at a time. With 4,
/// LayerNorm's kernels spilled 8-16 bytes at their 64 registers on sm_90; with 2, both
/// norms' 16-bit kernels gained up to 31% and lost at most 4.3% (docs/PERF.md v79).
pub type ResidualBlock = Blocks<false, false, 2>;

impl<const STACKED: bool, const NARROW: bool, const SHIFTED_READ_BATCH: usize>
    Blocks<STACKED, NARROW, SHIFTED_READ_BATCH>
{
    /// This team's index in its block's stack.
    #[inline(always)]
    fn stack_index() -> u32 {
        if STACKED { device::thread_idx_y() } else { 0 }
    }

    /// Teams in the block.
    #[inline(always)]
    fn stack_len() -> u32 {
        if STACKED { device::block_dim_y() } else { 1 }
    }

    /// Writes each warp's slot, then gives every lane `k < warps` (the team's warps) the
    /// slot of the team's warp `k`; a team is whole warps, and its warps' slots follow the
    /// teams before it. The barriers on both sides let the next reduction reuse the slots.
    #[inline(always)]
    fn exchange(slot: [f32; 3], empty: [f32; 3]) -> [f32; 3] {
        let team_warps = device::block_dim() / 32;
        let first = Self::stack_index() * team_warps;
        let (warp, lane) = (first + device::thread_idx() / 32, device::thread_idx() % 32);
        let warp_slot = |w: u32| device::shared_addr(16 * w);
        let slots = shared_ptr::<[f32; 4]>(0);
        if lane == 0 {
            let v = [slot[0], slot[1], slot[2], 0.0];
            // SAFETY: warp < 32 (at most 1024 threads a block) and the scratch holds 32
            // slots of 16 bytes.
            unsafe {
                if NARROW {
                    device::store_shared_16(warp_slot(warp), v.map(f32::to_bits))
                } else {
                    slots.add(warp as usize).write(v)
                }
            };
        }
        Self::sync();
        let out = if lane < team_warps {
            // SAFETY: first + lane is one of the team's warps, whose slot was written before
            // the barrier.
            let v = unsafe {
                if NARROW {
                    device::load_shared_16(warp_slot(first + lane)).map(f32::from_bits)
                } else {
                    slots.add((first + lane) as usize).read()
                }
            };
            [v[0], v[1], v[2]]
        } else {
            empty
        };
        Self::sync();
        out
    }
}

impl<const STACKED: bool, const NARROW: bool, const SHIFTED_READ_BATCH: usize> Team
    for Blocks<STACKED, NARROW, SHIFTED_READ_BATCH>
{
    const HOLDS_PART_OF_LONG_ROWS: bool = true;
    const TAKES_SHIFTED_ROWS: bool = true;
    const SHIFTED_READ_BATCH: usize = SHIFTED_READ_BATCH;
    #[inline(always)]
    fn rank() -> u32 {
        device::thread_idx()
    }
    #[inline(always)]
    fn size() -> u32 {
        device::block_dim()
    }
    #[inline(always)]
    fn id() -> u32 {
        device::block_idx() * Self::stack_len() + Self::stack_index()
    }
    #[inline(always)]
    fn count() -> u32 {
        device::grid_dim() * Self::stack_len()
    }
    #[inline(always)]
    fn index_in_block() -> u32 {
        Self::stack_index()
    }
    #[inline(always)]
    fn per_block() -> u32 {
        Self::stack_len()
    }
    #[inline(always)]
    fn sync() {
        if STACKED {
            device::sync_threads(1 + device::thread_idx_y(), device::block_dim())
        } else {
            device::sync_block()
        }
    }
    #[inline(always)]
    fn sum2(a: f32, b: f32) -> (f32, f32) {
        let [a, b] = warp_sums([a, b]);
        let v = Self::exchange([a, b, 0.0], [0.0; 3]);
        let [a, b] = warp_sums([v[0], v[1]]);
        (a, b)
    }
}

impl<const STACKED: bool, const NARROW: bool, const SHIFTED_READ_BATCH: usize> StatsTeam
    for Blocks<STACKED, NARROW, SHIFTED_READ_BATCH>
{
    #[inline(always)]
    fn sum(a: f32) -> f32 {
        let v = Self::exchange([warp_sums([a])[0], 0.0, 0.0], [0.0; 3]);
        warp_sums([v[0]])[0]
    }
    #[inline(always)]
    fn reduce_stats(s: Stats) -> Stats {
        let w = warp_stats(s);
        let e = Stats::EMPTY;
        let v = Self::exchange([w.n, w.mean, w.m2], [e.n, e.mean, e.m2]);
        warp_stats(Stats {
            n: v[0],
            mean: v[1],
            m2: v[2],
        })
    }
}
