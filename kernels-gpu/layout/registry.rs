//! Every kernel of the two PTX modules, once: its name, the storage types it comes in, its
//! launch bound per module and type, its cluster size, and whether only the sm_90 module has
//! it. build.rs writes the bounds and cluster sizes into the PTX from this table (it
//! includes this file), the host loads the kernels by it, and a host test checks the
//! checked-in PTX against it.
//!
//! Launch bounds (`.maxntid`, the most threads a block may have) decide each kernel's
//! register budget: 1024 threads leave 64 registers a thread, 768 leave 80, 640 leave 96,
//! 512 leave 128 (a quarter of the register file serves a quarter of the warps, so 576
//! threads get no more than 640). Rust has no attribute for them; build.rs adds them.
//! - The forward and stage 2 run at 1024 (64 registers): a multiprocessor then holds 2048
//!   threads, and rows in flight, not registers, decide the memory traffic under way.
//! - Stage 1 holds x and dy and adds partials a pack at a time, and spills at 64: the owned
//!   mode, with its shared-memory rows and their final combine, needs 128 (512) where it
//!   holds rows (sm_80's block kernel, and the warp kernel; sm_90's block kernel holds none
//!   and is bound to 64 registers: `Variant::max_registers`) (the f32
//!   block kernel on sm_90 fitted 96 (640) with flat parameters; with its parameters in
//!   structs, whose pointers are generic rather than global, it spills 8 bytes there); the
//!   held mode keeps two rows in
//!   registers in 128 (512), and on sm_80, whose ptxas needs more for f16/bf16, in 168
//!   (384); the cluster kernels (a slice per block) fit 96 (640) in f16/bf16 and need 128
//!   (512) when held; the general one in f32 spilled at 128 once its blocks also handed
//!   their sums over under a lock, and has 168 (384).
//! - The few-rows forward holds x, gamma and beta of 16 columns a thread, and spilled at 64
//!   registers: it runs at 512 (128), which takes rows of up to N = 8192 (a block a row,
//!   one block a multiprocessor at most, so occupancy does not matter).
//! - The row block holds one row, 4 packs a thread: bound to 40 registers, below its 1024
//!   threads' 64 (see `Variant::max_registers`).
//! - The held forward over shifted rows holds one row, 4 packs a rank from its first
//!   16-byte boundary, at the 64 registers of its 1024 threads (54-61 used).
//! - The residual forward keeps the row pointers of x, the residual, s and y, and runs at
//!   512 (128) with `.minnctapersm 1` (see `Variant::one_block_per_sm`).
//!   Its held kernel loads 4 packs of x and of the residual a rank, and its streamed kernel
//!   holds nothing across a row's reduction: both run at 1024 (64), so that a
//!   multiprocessor runs a block of 1024, or two of 512.
//! - f32 weights beside f16/bf16 rows cost the kernels that hold rows in registers the
//!   weights' extra words: the general block forward needs 80 (768), and the held cluster
//!   kernels 168 (384).
//! - A residual stream in f32 beside f16/bf16 x: the held stage 1 on sm_80 spilled 12 bytes
//!   at 168 (384) in LayerNorm and has 255 (256). Its cluster kernels walk rows of f32 as
//!   the f32 ones do: 168 (384) for the general one, 128 (512) held, f32 weights or not
//!   (a pack of f32 rows has four weights, not the eight of 16-bit rows).
//!
//! Fewer registers, more blocks resident; `.ci/run`'s ptxas check fails on any spill.

/// Storage types.
pub const DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// Bytes of a value of each of [`DTYPES`].
pub const DTYPE_BYTES: [usize; 3] = [4, 2, 2];

/// The types of one kernel: `x` of x, y, dy and dx, `weights` of gamma, beta and their
/// gradients, `stream` of a residual forward's residual and s and of the backward's rows
/// (s) and dsum: x's own, or f32 beside f16 and bf16 x (a residual stream kept in f32);
/// indices into [`DTYPES`]. `name` is the last part of the kernel's name:
/// `<norm>_<stem>_<name>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypePair {
    pub name: &'static str,
    pub x: usize,
    pub weights: usize,
    pub stream: usize,
}

impl TypePair {
    /// Whether the residual stream is of another type than x (f32 beside f16 or bf16).
    pub const fn wide_stream(self) -> bool {
        self.stream != self.x
    }
}

/// Every type pair a kernel comes in, in the order the host keeps them: weights of x's own
/// type, then f32 weights beside f16 and bf16 rows (mixed-precision training keeps its
/// parameters and their gradients in f32), then each 16-bit pair with its residual stream
/// in f32. Stage 2 writes only the weights' gradients and comes in the first three alone;
/// a stream in f32 has only the kernels that read or write the stream (the residual
/// forward and stage 1; see [`Variant::has_pair`]).
pub const TYPE_PAIRS: [TypePair; 9] = [
    TypePair {
        name: "f32",
        x: 0,
        weights: 0,
        stream: 0,
    },
    TypePair {
        name: "f16",
        x: 1,
        weights: 1,
        stream: 1,
    },
    TypePair {
        name: "bf16",
        x: 2,
        weights: 2,
        stream: 2,
    },
    TypePair {
        name: "f16_f32w",
        x: 1,
        weights: 0,
        stream: 1,
    },
    TypePair {
        name: "bf16_f32w",
        x: 2,
        weights: 0,
        stream: 2,
    },
    TypePair {
        name: "f16_f32s",
        x: 1,
        weights: 1,
        stream: 0,
    },
    TypePair {
        name: "bf16_f32s",
        x: 2,
        weights: 2,
        stream: 0,
    },
    TypePair {
        name: "f16_f32w_f32s",
        x: 1,
        weights: 0,
        stream: 0,
    },
    TypePair {
        name: "bf16_f32w_f32s",
        x: 2,
        weights: 0,
        stream: 0,
    },
];

/// The pair of x of storage type `x` with weights of type `weights` (indices into
/// [`DTYPES`]), where the kernels have it.
pub const fn type_pair(x: usize, weights: usize) -> Option<usize> {
    stream_pair(x, weights, x)
}

/// The pair of x of type `x`, weights of type `weights` and a residual stream of type
/// `stream` (indices into [`DTYPES`]), where the kernels have it.
pub const fn stream_pair(x: usize, weights: usize, stream: usize) -> Option<usize> {
    let mut p = 0;
    while p < TYPE_PAIRS.len() {
        let pair = TYPE_PAIRS[p];
        if pair.x == x && pair.weights == weights && pair.stream == stream {
            return Some(p);
        }
        p += 1;
    }
    None
}

/// What a row is normalized by: LayerNorm centers it on its mean and divides by its
/// standard deviation; RMSNorm divides by its root mean square. The kernels of both are the
/// same code, compiled once per norm (a const generic), so each has the other's paths and
/// registers but none of its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    Layer,
    Rms,
}

impl Norm {
    /// Both norms, in table order.
    pub const ALL: [Norm; 2] = [Norm::Layer, Norm::Rms];

    /// The first part of its kernels' names: `layer_norm` or `rms_norm`.
    pub const fn prefix(self) -> &'static str {
        match self {
            Norm::Layer => "layer_norm",
            Norm::Rms => "rms_norm",
        }
    }

    /// Whether `norm` has a kernel of `variant` of its own. Stage 2 (column sums of the
    /// partial rows) is the same for both and exists once, as LayerNorm's; the widened warp
    /// forward is LayerNorm's alone (RMSNorm's rows keep the pipelined warp, which was
    /// faster for them).
    pub const fn has(self, variant: Variant) -> bool {
        matches!(self, Norm::Layer) || !matches!(variant, Variant::BwdReduce | Variant::FwdWidenedWarp)
    }

    /// Whether `norm`'s ops launch `variant`: its own kernels, and stage 2, LayerNorm's
    /// serving both norms.
    pub const fn launches(self, variant: Variant) -> bool {
        self.has(variant) || matches!(variant, Variant::BwdReduce)
    }

    /// Its index in per-norm tables.
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// The name of `norm`'s kernel `variant` of `pair` in the PTX modules:
/// `<norm prefix>_<variant stem>_<pair name>` (e.g. `rms_norm_bwd_held_block_bf16_f32w`).
pub struct KernelName(pub Norm, pub Variant, pub TypePair);

// Host only: in the kernels' PTX its code would be a function that calls core's formatting.
#[cfg(not(target_arch = "nvptx64"))]
impl core::fmt::Display for KernelName {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let KernelName(norm, variant, pair) = self;
        write!(f, "{}_{}_{}", norm.prefix(), variant.stem(), pair.name)
    }
}

/// The marker LLVM writes before each function of a PTX file.
pub const FUNCTION_MARKER: &str = "\t// .globl\t";

/// The PTX of the kernels `names` alone, cut from a whole module's `ptx` (what the host loads
/// of a module, a norm and type pair at a time): the file's header (version, target, address
/// size, the dynamic shared memory every kernel shares), then each kernel's text, from its
/// `// .globl` marker to the next function's. Every kernel is one self-contained function
/// (the kernels call nothing: `.ci/run` refuses a `call` in the PTX), so the part compiles
/// as the whole does. Err: the first name the PTX lacks. (Host only, as [`KernelName`]'s
/// text.)
#[cfg(not(target_arch = "nvptx64"))]
pub fn ptx_part<'a>(ptx: &str, names: impl Iterator<Item = &'a str>) -> Result<String, &'a str> {
    let header_end = ptx.find(FUNCTION_MARKER).unwrap_or(ptx.len());
    let mut part = String::with_capacity(ptx.len() / 8);
    part.push_str(&ptx[..header_end]);
    for name in names {
        let marker = format!("{FUNCTION_MARKER}{name}\n");
        let start = ptx.find(&marker).ok_or(name)?;
        let body = start + marker.len();
        let end = ptx[body..]
            .find(FUNCTION_MARKER)
            .map_or(ptx.len(), |at| body + at);
        part.push_str(&ptx[start..end]);
    }
    Ok(part)
}

/// Every kernel of `arch`'s module, as (norm, variant, type pair), in the order of
/// [`Norm::ALL`], [`Variant::ALL`] and [`TYPE_PAIRS`]: the kernel its [`KernelName`] names.
pub fn kernels(arch: Arch) -> impl Iterator<Item = (Norm, Variant, TypePair)> {
    Norm::ALL.into_iter().flat_map(move |norm| {
        Variant::ALL
            .into_iter()
            .filter(move |&v| v.in_module(arch) && norm.has(v))
            .flat_map(move |v| {
                TYPE_PAIRS
                    .into_iter()
                    .filter(move |&pair| v.has_pair(pair))
                    .map(move |pair| (norm, v, pair))
            })
    })
}

/// The kernels that `norm`'s ops on `pair` launch on `arch`, one per variant of the module,
/// as (norm, variant, type pair) of the kernel's name: `norm`'s own kernel of `pair` where
/// there is one, else the one that serves it (stage 2: LayerNorm's, of the weights' own
/// type; for a residual stream in f32, the plain forward of x's pair), but the kernels that
/// only their own pairs have ([`Variant::own_pairs_only`]) and those `norm` does not launch
/// ([`Norm::launches`]). What one lazily loaded module of the host holds.
pub fn kernels_of(arch: Arch, norm: Norm, pair: TypePair) -> impl Iterator<Item = (Norm, Variant, TypePair)> {
    Variant::ALL
        .into_iter()
        .filter(move |&v| v.in_module(arch) && norm.launches(v) && (v.has_pair(pair) || !v.own_pairs_only()))
        .map(move |v| {
            let owner = if norm.has(v) { norm } else { Norm::Layer };
            let served = if v.has_pair(pair) {
                Some(pair)
            } else if matches!(v, Variant::BwdReduce) {
                type_pair(pair.weights, pair.weights).map(|p| TYPE_PAIRS[p])
            } else {
                type_pair(pair.x, pair.weights).map(|p| TYPE_PAIRS[p])
            };
            match served {
                Some(served) => (owner, v, served),
                None => panic!(
                    "every weight type has kernels of its own pair, every x and weights pair its forwards"
                ),
            }
        })
}

/// Whether `norm`'s pipelined forward block teams over rows of `packs` packs of
/// `x_bytes`-byte values keep their next row in shared memory (copied there by `cp.async`)
/// rather than in registers, where one row then fits, widened to f32 once
/// (`Variant::max_registers`): LayerNorm's rows of f16 and bf16, and its f32 rows of more
/// than 2048 packs (N > 8192), on which two teams of 4 packs a rank would not fit a
/// multiprocessor's 1024 threads; those hold 6 packs a rank (`super::pipelined_block_held`).
/// LayerNorm's shorter f32 rows measured 2-4% slower that way, RMSNorm's 16-bit rows up to
/// 4% (docs/PERF.md, v30 and v32).
pub const fn pipeline_stages(norm: Norm, x_bytes: usize, packs: u32) -> bool {
    matches!(norm, Norm::Layer) && (x_bytes == 2 || packs > 2048)
}

/// The two PTX modules: sm_80 (every GPU from the A100 on) and sm_90 (Hopper, with the
/// cluster kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Sm80,
    Sm90,
}

/// A kernel, whatever its storage type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Forward, a warp per row (rows of up to 1024).
    FwdWarp,
    /// Forward, a block per row.
    FwdBlock,
    /// Forward for rows all of aligned packs that fit 4 a rank (the block team over
    /// LayerNorm's f32 rows of more than 2048 packs: 6): two rows in flight a team.
    FwdPipelinedWarp,
    FwdPipelinedBlock,
    /// Forward of rows all of aligned packs that fit 4 a rank, a block for every row
    /// holding its row only (no next row in flight: fewer registers).
    FwdRowBlock,
    /// Forward of rows of one type shifted alike past a 16-byte boundary (16-bit rows in half
    /// packs too), a block for every row holding its row at 4 packs a rank from the boundary
    /// (sm_90).
    FwdHeldShifted,
    /// Forward of LayerNorm's 16-bit rows that a warp holds at 2 to 4 packs a lane, a warp
    /// for every row: x widened to f32 once, no next row in flight (sm_90).
    FwdWidenedWarp,
    /// Forward for launches of at most one row a multiprocessor over rows of aligned packs
    /// (a block a row): x, gamma and beta loaded together, `layout::few_rows_held` packs a
    /// rank.
    FwdFewRows,
    /// Forward of s = x + residual (the pre-norm residual add), which it also writes.
    FwdResidualWarp,
    FwdResidualBlock,
    /// The same for rows all of aligned packs that fit 4 a rank: two rows in flight a team.
    FwdResidualPipelinedWarp,
    FwdResidualPipelinedBlock,
    /// The same over rows of aligned packs past what `FwdResidualPipelinedBlock` holds, a
    /// block per row at 64 registers: 16-bit rows held at `RESIDUAL_HELD` packs a rank by
    /// up to 1024 ranks,
    FwdResidualHeld,
    /// Rows of one type shifted alike past a 16-byte boundary, held as that kernel holds
    /// its rows, 4 packs a rank from the boundary (sm_90),
    FwdResidualHeldShifted,
    /// or, too long for that, s formed and summed as it streams in, y from s read back from
    /// L2.
    FwdResidualStreamed,
    /// Backward stage 1, owned (deterministic) mode, rows streamed or held.
    BwdOwnedWarp,
    BwdOwnedBlock,
    /// Stage 1, owned mode, rows all of aligned packs held in registers.
    BwdHeldWarp,
    BwdHeldBlock,
    /// The held block kernel over 16-bit rows 8-byte aligned, in half packs.
    BwdHeldBlockHalves,
    /// The held block kernel over shifted rows: every row of x, dy and dx as far past a
    /// 16-byte boundary as x's, held in packs from there.
    BwdHeldBlockShifted,
    /// Stage 2: the partial rows' column sums.
    BwdReduce,
    /// Stage 1, owned mode, rows split over clusters of 8 blocks (sm_90).
    BwdCluster8,
    /// The same with each block's slice held, over 2, 4 or 8 blocks (sm_90).
    BwdCluster2Held,
    BwdCluster4Held,
    BwdCluster8Held,
    /// The same over 16-bit rows 8-byte aligned, in half packs (sm_90).
    BwdCluster2HeldHalves,
    BwdCluster4HeldHalves,
    BwdCluster8HeldHalves,
}

impl Variant {
    /// Every kernel, in the order the host keeps them.
    pub const ALL: [Variant; 29] = [
        Variant::FwdWarp,
        Variant::FwdBlock,
        Variant::FwdPipelinedWarp,
        Variant::FwdPipelinedBlock,
        Variant::FwdRowBlock,
        Variant::FwdHeldShifted,
        Variant::FwdWidenedWarp,
        Variant::FwdFewRows,
        Variant::FwdResidualWarp,
        Variant::FwdResidualBlock,
        Variant::FwdResidualPipelinedWarp,
        Variant::FwdResidualPipelinedBlock,
        Variant::FwdResidualHeld,
        Variant::FwdResidualHeldShifted,
        Variant::FwdResidualStreamed,
        Variant::BwdOwnedWarp,
        Variant::BwdOwnedBlock,
        Variant::BwdHeldWarp,
        Variant::BwdHeldBlock,
        Variant::BwdHeldBlockHalves,
        Variant::BwdHeldBlockShifted,
        Variant::BwdReduce,
        Variant::BwdCluster8,
        Variant::BwdCluster2Held,
        Variant::BwdCluster4Held,
        Variant::BwdCluster8Held,
        Variant::BwdCluster2HeldHalves,
        Variant::BwdCluster4HeldHalves,
        Variant::BwdCluster8HeldHalves,
    ];

    /// The name between `layer_norm_` and the storage type.
    pub const fn stem(self) -> &'static str {
        match self {
            Variant::FwdWarp => "fwd_warp",
            Variant::FwdBlock => "fwd_block",
            Variant::FwdPipelinedWarp => "fwd_pipelined_warp",
            Variant::FwdPipelinedBlock => "fwd_pipelined_block",
            Variant::FwdRowBlock => "fwd_row_block",
            Variant::FwdHeldShifted => "fwd_held_shifted",
            Variant::FwdWidenedWarp => "fwd_widened_warp",
            Variant::FwdFewRows => "fwd_few_rows",
            Variant::FwdResidualWarp => "fwd_residual_warp",
            Variant::FwdResidualBlock => "fwd_residual_block",
            Variant::FwdResidualPipelinedWarp => "fwd_residual_pipelined_warp",
            Variant::FwdResidualPipelinedBlock => "fwd_residual_pipelined_block",
            Variant::FwdResidualHeld => "fwd_residual_held",
            Variant::FwdResidualHeldShifted => "fwd_residual_held_shifted",
            Variant::FwdResidualStreamed => "fwd_residual_streamed",
            Variant::BwdOwnedWarp => "bwd_owned_warp",
            Variant::BwdOwnedBlock => "bwd_owned_block",
            Variant::BwdHeldWarp => "bwd_held_warp",
            Variant::BwdHeldBlock => "bwd_held_block",
            Variant::BwdHeldBlockHalves => "bwd_held_block_halves",
            Variant::BwdHeldBlockShifted => "bwd_held_block_shifted",
            Variant::BwdReduce => "bwd_reduce",
            Variant::BwdCluster8 => "bwd_cluster8",
            Variant::BwdCluster2Held => "bwd_cluster2_held",
            Variant::BwdCluster4Held => "bwd_cluster4_held",
            Variant::BwdCluster8Held => "bwd_cluster8_held",
            Variant::BwdCluster2HeldHalves => "bwd_cluster2_held_halves",
            Variant::BwdCluster4HeldHalves => "bwd_cluster4_held_halves",
            Variant::BwdCluster8HeldHalves => "bwd_cluster8_held_halves",
        }
    }

    /// Blocks per cluster (`.reqnctapercluster`), 1 for kernels without clusters.
    pub const fn cluster(self) -> u32 {
        match self {
            Variant::BwdCluster8 | Variant::BwdCluster8Held | Variant::BwdCluster8HeldHalves => 8,
            Variant::BwdCluster4Held | Variant::BwdCluster4HeldHalves => 4,
            Variant::BwdCluster2Held | Variant::BwdCluster2HeldHalves => 2,
            _ => 1,
        }
    }

    /// Whether the kernel's bound says that one block a multiprocessor is enough
    /// (`.minnctapersm 1`): without it, ptxas held the residual forward to 64 registers
    /// whatever its `.maxntid` allowed, and spilled.
    pub const fn one_block_per_sm(self) -> bool {
        matches!(
            self,
            Variant::FwdResidualWarp
                | Variant::FwdResidualBlock
                | Variant::FwdResidualPipelinedWarp
                | Variant::FwdResidualPipelinedBlock
        )
    }

    /// Whether the kernel adds a residual's dsum to dx, for rows (x, or a residual stream
    /// kept in f32) of `row_bytes`-byte values with `weight_bytes`-byte weights: every stage
    /// 1 kernel but the held cluster ones of 16-bit rows with 16-bit weights, which a fifth
    /// row pointer spills at their 128 registers (the host sends such a backward to the
    /// general cluster kernel). Rows of f32 take half the packs of 16-bit rows a rank, which
    /// leaves the registers for it.
    pub const fn takes_dsum(self, row_bytes: usize, weight_bytes: usize) -> bool {
        let held_cluster = self.held_cluster();
        !(held_cluster && row_bytes == 2 && weight_bytes == 2)
    }

    /// Whether only the sm_90 module has the kernel: clusters exist from sm_90 on, and the
    /// widened warp forward, the row block and the held forwards over shifted rows were
    /// measured faster only there (no sm_80 device measured them).
    pub const fn sm90_only(self) -> bool {
        self.cluster() > 1
            || matches!(
                self,
                Variant::FwdWidenedWarp
                    | Variant::FwdRowBlock
                    | Variant::FwdHeldShifted
                    | Variant::FwdResidualHeldShifted
            )
    }

    /// The launch bound of the kernel for type pair `pair` in `arch`'s module (the module
    /// header explains each number).
    pub const fn max_threads(self, arch: Arch, pair: TypePair) -> u32 {
        let f32 = pair.x == 0;
        let f32_rows = pair.stream == 0;
        let f32_weights_of_halves = pair.weights == 0 && !f32;
        match (self, arch) {
            (Variant::FwdBlock, _) if f32_weights_of_halves => 768,
            (
                Variant::FwdWarp
                | Variant::FwdBlock
                | Variant::FwdResidualHeld
                | Variant::FwdResidualHeldShifted
                | Variant::FwdResidualStreamed
                | Variant::BwdReduce,
                _,
            ) => 1024,
            (
                Variant::FwdPipelinedWarp
                | Variant::FwdPipelinedBlock
                | Variant::FwdRowBlock
                | Variant::FwdHeldShifted
                | Variant::FwdWidenedWarp,
                _,
            ) => 1024,
            (Variant::FwdFewRows, _) => 512,
            (
                Variant::FwdResidualWarp
                | Variant::FwdResidualBlock
                | Variant::FwdResidualPipelinedWarp
                | Variant::FwdResidualPipelinedBlock,
                _,
            ) => 512,
            (Variant::BwdOwnedWarp, _) => 512,
            (Variant::BwdOwnedBlock, _) => 512,
            (
                Variant::BwdHeldWarp
                | Variant::BwdHeldBlock
                | Variant::BwdHeldBlockHalves
                | Variant::BwdHeldBlockShifted,
                _,
            ) => match arch {
                Arch::Sm80 if pair.wide_stream() => 256,
                Arch::Sm80 => 384,
                Arch::Sm90 => 512,
            },
            (Variant::BwdCluster8, _) if f32_rows => 384,
            (Variant::BwdCluster8, _) => 640,
            (
                Variant::BwdCluster2Held
                | Variant::BwdCluster4Held
                | Variant::BwdCluster8Held
                | Variant::BwdCluster2HeldHalves
                | Variant::BwdCluster4HeldHalves
                | Variant::BwdCluster8HeldHalves,
                _,
            ) => {
                if f32_weights_of_halves && !f32_rows {
                    384
                } else {
                    512
                }
            }
        }
    }

    /// The register bound of `norm`'s kernel for type pair `pair` (`.maxnreg`), where it has
    /// one besides its thread limit's: LayerNorm's pipelined forward block teams over 16-bit
    /// rows beside f32 weights keep their next row in shared memory (`pipeline_stages`) and
    /// this row as raw words, and fit 56 registers without spilling, where ptxas would take
    /// 64 and run fewer threads a multiprocessor. (With weights of x's type they keep this
    /// row widened to f32, in the 64 of the thread limit: docs/PERF.md, v31.) The row block
    /// holds one row of 4 packs a rank and fits 40 without spilling, so that a
    /// multiprocessor runs 1536 of its threads where 64 allow 1024 (RMSNorm's f32 kernel
    /// since v54, which takes gamma's addresses anew each row; at 48 it ran 1152). The owned
    /// backward's block kernel in the sm_90 module holds no row (rows all of aligned packs
    /// that fit go to the held kernels), and fits 64 where its 512 threads allow 128, so
    /// that a multiprocessor runs 32 of its warps, not 16 (sm_80's ptxas spilled its
    /// f16/bf16 kernels 24-28 bytes there, so that module's keeps holding rows at 128).
    pub const fn max_registers(self, arch: Arch, norm: Norm, pair: TypePair) -> Option<u32> {
        // Weights of another type than x's are f32 beside 16-bit rows, staged at any length.
        let stages = pipeline_stages(norm, DTYPE_BYTES[pair.x], 0);
        match self {
            Variant::FwdPipelinedBlock if stages && pair.weights != pair.x => Some(56),
            Variant::FwdRowBlock => Some(40),
            Variant::BwdOwnedBlock if matches!(arch, Arch::Sm90) => Some(64),
            _ => None,
        }
    }

    /// Whether the kernel runs one warp per row (else a block, or a cluster, per row).
    pub const fn warp_team(self) -> bool {
        matches!(
            self,
            Variant::FwdWarp
                | Variant::FwdPipelinedWarp
                | Variant::FwdWidenedWarp
                | Variant::FwdResidualWarp
                | Variant::FwdResidualPipelinedWarp
                | Variant::BwdOwnedWarp
                | Variant::BwdHeldWarp
        )
    }

    /// Whether `arch`'s module has the kernel.
    pub const fn in_module(self, arch: Arch) -> bool {
        !self.sm90_only() || matches!(arch, Arch::Sm90)
    }

    /// Whether the kernel comes in type pair `pair`: stage 2, which reads f32 partials and
    /// writes the weights' gradients, only in pairs of one type; the held residual forward
    /// over aligned rows only over f16 and bf16 rows with weights and stream of their type, the widened warp
    /// forward only over f16 and bf16 x (with weights of its type or f32), the held block
    /// kernel in half packs over f16 and bf16 x, dy and weights of one type, the held
    /// kernels over shifted rows (stage 1, the residual forward) over rows and weights of
    /// one type, the row block and the held forward over shifted rows only with weights of
    /// x's type; with a residual stream in f32, only the kernels that
    /// read or write it: the residual forward and stage 1.
    pub const fn has_pair(self, pair: TypePair) -> bool {
        if matches!(self, Variant::FwdRowBlock | Variant::FwdHeldShifted) {
            // Where they were measured (H200, docs/PERF.md v48, v86).
            return pair.weights == pair.x && !pair.wide_stream();
        }
        if matches!(self, Variant::FwdWidenedWarp) {
            return DTYPE_BYTES[pair.x] == 2 && !pair.wide_stream();
        }
        if self.halves() {
            // Half packs of 16-bit rows: 8 bytes of x, dy and the weights alike.
            return DTYPE_BYTES[pair.x] == 2 && pair.weights == pair.x && pair.stream == pair.x;
        }
        if matches!(
            self,
            Variant::BwdHeldBlockShifted | Variant::FwdResidualHeldShifted
        ) {
            // Rows of one type shifted alike. The backward's staged weights are packs of x's
            // columns; the residual forward's f32 rows gained 20-52% held (docs/PERF.md v85),
            // where the streamed kernel's shifted packs lost to its elements (v78). One arm
            // for both: a third arm here grew this function past what rustc inlines across
            // crates, and the kernels then called it.
            return pair.weights == pair.x && pair.stream == pair.x;
        }
        if matches!(self, Variant::FwdResidualHeld) {
            // Where it was measured faster (H200, docs/PERF.md v40: f32 rows, a stream in
            // f32 included, gained 2% or lost up to 17%; f32 weights beside 16-bit rows
            // spilled it at 64 registers).
            return DTYPE_BYTES[pair.x] == 2 && pair.weights == pair.x && pair.stream == pair.x;
        }
        if pair.wide_stream() {
            return !matches!(
                self,
                Variant::FwdWarp
                    | Variant::FwdBlock
                    | Variant::FwdPipelinedWarp
                    | Variant::FwdPipelinedBlock
                    | Variant::FwdRowBlock
                    | Variant::FwdFewRows
                    | Variant::BwdReduce
            );
        }
        !matches!(self, Variant::BwdReduce) || pair.x == pair.weights
    }

    /// Whether only the type pairs that have the kernel launch it (the planner takes it only
    /// there): no other pair's kernel serves a pair without one.
    pub const fn own_pairs_only(self) -> bool {
        matches!(
            self,
            Variant::FwdResidualHeld
                | Variant::FwdResidualHeldShifted
                | Variant::FwdWidenedWarp
                | Variant::FwdRowBlock
                | Variant::FwdHeldShifted
                | Variant::BwdHeldBlockHalves
                | Variant::BwdHeldBlockShifted
                | Variant::BwdCluster2HeldHalves
                | Variant::BwdCluster4HeldHalves
                | Variant::BwdCluster8HeldHalves
        )
    }

    /// Whether the kernel is a held stage-1 kernel without clusters: warp or block teams, in
    /// packs, half packs or shifted packs.
    pub const fn held_unclustered(self) -> bool {
        matches!(
            self,
            Variant::BwdHeldWarp
                | Variant::BwdHeldBlock
                | Variant::BwdHeldBlockHalves
                | Variant::BwdHeldBlockShifted
        )
    }

    /// Whether the kernel holds rows in half packs (16-bit rows 8-byte aligned).
    pub const fn halves(self) -> bool {
        matches!(
            self,
            Variant::BwdHeldBlockHalves
                | Variant::BwdCluster2HeldHalves
                | Variant::BwdCluster4HeldHalves
                | Variant::BwdCluster8HeldHalves
        )
    }

    /// Whether the kernel is a held cluster kernel (in packs or half packs).
    pub const fn held_cluster(self) -> bool {
        matches!(
            self,
            Variant::BwdCluster2Held
                | Variant::BwdCluster4Held
                | Variant::BwdCluster8Held
                | Variant::BwdCluster2HeldHalves
                | Variant::BwdCluster4HeldHalves
                | Variant::BwdCluster8HeldHalves
        )
    }

    /// The held cluster kernel over `size` blocks in half packs (as [`Variant::cluster_held`]).
    pub const fn cluster_held_halves(size: u32) -> Option<Variant> {
        match size {
            2 => Some(Variant::BwdCluster2HeldHalves),
            4 => Some(Variant::BwdCluster4HeldHalves),
            8 => Some(Variant::BwdCluster8HeldHalves),
            _ => None,
        }
    }

    /// The held cluster kernel over `size` blocks (one of `HELD_CLUSTER_SIZES` (layout/mod.rs)).
    pub const fn cluster_held(size: u32) -> Option<Variant> {
        match size {
            2 => Some(Variant::BwdCluster2Held),
            4 => Some(Variant::BwdCluster4Held),
            8 => Some(Variant::BwdCluster8Held),
            _ => None,
        }
    }
}
