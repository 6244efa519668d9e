//! Backward stage 1 over clusters of `C` blocks: each block takes a slice of every row of its
//! cluster, the row sums come from all `C` slices, and each block hands its slice of the
//! cluster's sums over (the cluster's partial row, or its group's under the slice's lock).

use super::{CLUSTER_SCRATCH_BYTES, Cluster, slice_width};
use crate::backward::Rows;
use crate::backward::held::stage1_held;
use crate::backward::partials::Destination;
use crate::backward::streamed::owned_in_shared;
use crate::element::{Bf16, Element, F16};
use crate::layout::params::Partials;
use crate::layout::registry::Variant;
use crate::team::Team;

/// Stage 1 over clusters of `C` blocks (sm_90): cluster u handles rows u, u + U, ...
/// (U = clusters); block q of the cluster takes the q-th slice of each row ([`slice_width`]
/// columns), keeps that slice's partials in its shared memory, and hands them over for unit
/// u at the end (its columns of partial row u, or of group u mod G). The row sums c1 and c2
/// come from all C slices ([`Cluster`]'s `sum2`). dx includes dsum where the launch has one.
///
/// # Safety
/// `r`'s buffers sized as documented (`r.cols` = `r.n`); `out` as [`Destination`] says,
/// with units of C slices;
/// the launch gave each block `CLUSTER_SCRATCH_BYTES + 8 * (padded_len(W) + 1)` bytes of
/// shared memory (W = `slice_width(n, PACK, C)`), in clusters of `C` blocks.
#[inline(always)]
unsafe fn stage1_cluster<X: Element, T: Element, W: Element, const C: u32>(r: Rows<X, T, W>, out: Partials) {
    let width = slice_width(r.n, X::PACK as u32, C);
    let start = (Cluster::<C>::block_rank() * width).min(r.n);
    let cols = width.min(r.n - start);
    // The slice's first column. A cluster's last slices may be empty (start == n); their
    // pointers are then never read.
    let slice = r.slice(start, cols);
    let (rank, id) = (Cluster::<C>::block_rank(), Cluster::<C>::id());
    let out = Destination::of(out, r.n, start, id, C, rank);
    Cluster::<C>::begin();
    // SAFETY: the cluster's unit exists (cluster id < clusters) and only this block hands
    // over its slice's columns of it; the launch sized shared memory for one slice.
    unsafe { owned_in_shared::<X, T, W, Cluster<C>, true>(&slice, CLUSTER_SCRATCH_BYTES, out) };
    Cluster::<C>::end();
}

/// Stage 1 over clusters of `C` blocks for rows that are all whole aligned
/// packs: as [`stage1_cluster`] (block q takes the q-th slice of each row, the row sums come
/// from all C slices), with each slice held in registers, two rows in flight and the
/// partials kept by rank, as [`stage1_held`]. dx includes dsum where the launch has one
/// and the kernel takes it ([`Rows::for_kernel`]). `HALVES`: rows of 16-bit values 8-byte
/// aligned, held in half packs ([`stage1_held`]); the slices keep their whole packs' widths,
/// so each starts 8-byte aligned too.
///
/// # Safety
/// `r`'s buffers sized as documented (`r.cols` = `r.n`), every row 16-byte aligned and `n`
/// a whole number of packs (with `HALVES`, as [`stage1_held`] requires of half packs); a
/// slice's packs [`fits`] `BWD_HELD` per rank; `out` as
/// [`Destination`] says, with units of C slices; the launch gave each block `CLUSTER_SCRATCH_BYTES + 8 * BWD_HELD *
/// PACK * blockDim` bytes of shared memory, in clusters of `C` blocks.
#[inline(always)]
unsafe fn stage1_cluster_held<X: Element, T: Element, W: Element, const C: u32, const HALVES: bool>(
    r: Rows<X, T, W>,
    out: Partials,
) {
    let width = slice_width(r.n, X::PACK as u32, C);
    let start = (Cluster::<C>::block_rank() * width).min(r.n);
    // The slice's first column. A cluster's last slices may be empty (start == n); their
    // pointers are then never read.
    let slice = r
        .for_kernel(held_variant::<C, HALVES>())
        .slice(start, width.min(r.n - start));
    let (rank, id) = (Cluster::<C>::block_rank(), Cluster::<C>::id());
    let out = Destination::of(out, r.n, start, id, C, rank);
    Cluster::<C>::begin();
    // SAFETY: the cluster's unit exists (cluster id < clusters), only this block hands over
    // its slice's columns of it, and the launch sized shared memory for its ranks.
    unsafe { stage1_held::<X, T, W, Cluster<C>, true, HALVES, false>(slice, out, CLUSTER_SCRATCH_BYTES) };
    Cluster::<C>::end();
}

/// The registry's held cluster kernel over `C` blocks (in half packs where `HALVES`).
const fn held_variant<const C: u32, const HALVES: bool>() -> Variant {
    let variant = if HALVES {
        Variant::cluster_held_halves(C)
    } else {
        Variant::cluster_held(C)
    };
    match variant {
        Some(v) => v,
        None => panic!("a held cluster kernel over C blocks exists"),
    }
}

/// Blocks per cluster of the general cluster kernels: the portable maximum. Measured
/// against 2 and 4 (docs/PERF.md, v6): their smaller slices leave room for more blocks,
/// hence more rows in flight, per multiprocessor, which outweighs the wider barrier.
use crate::layout::CLUSTER_SIZE;
use crate::layout::params::BackwardRows;

/// Exports the cluster stage 1 kernels (sm_90 module only) of one type pair (x, dy and dx
/// of type `$t`, gamma of `$w`, the rows (s) and dsum of `$x`) for both norms: the general
/// one over 8 blocks, and the held one over 2, 4 and 8 (the host takes the fewest blocks
/// whose slices fit 4 packs a rank: fewer blocks wait for each row's sums).
/// build.rs gives each `.reqnctapercluster C` from the registry.
macro_rules! cluster_kernels {
    ($module:ident, $types:literal, $t:ty, $w:ty, $x:ty) => {
        mod $module {
            use super::*;
            cluster_kernels!(@norm layer, "layer_norm", true, $types, $t, $w, $x);
            cluster_kernels!(@norm rms, "rms_norm", false, $types, $t, $w, $x);
        }
    };
    (@norm $norm:ident, $prefix:literal, $centered:literal, $types:literal, $t:ty, $w:ty, $x:ty) => {
        mod $norm {
            use super::*;
            cluster_kernels!(@one $prefix, $centered, $types, $t, $w, $x, cluster2_held, stage1_cluster_held, [2, false],
                "Stage 1 over a cluster of 2 blocks, slices held (rows of aligned packs).");
            cluster_kernels!(@one $prefix, $centered, $types, $t, $w, $x, cluster4_held, stage1_cluster_held, [4, false],
                "Stage 1 over a cluster of 4 blocks, slices held (rows of aligned packs).");
            cluster_kernels!(@one $prefix, $centered, $types, $t, $w, $x, cluster8_held, stage1_cluster_held, [8, false],
                "Stage 1 over a cluster of 8 blocks, slices held (rows of aligned packs).");
            cluster_kernels!(@one $prefix, $centered, $types, $t, $w, $x, cluster8, stage1_cluster, [{ CLUSTER_SIZE }],
                "Stage 1 over a cluster of 8 blocks.");
        }
    };
    // The held cluster kernels over 16-bit rows 8-byte aligned, in half packs: x, dy and
    // weights of one type.
    (@halves $module:ident, $types:literal, $t:ty) => {
        mod $module {
            use super::*;
            cluster_kernels!(@halves_norm layer, "layer_norm", true, $types, $t);
            cluster_kernels!(@halves_norm rms, "rms_norm", false, $types, $t);
        }
    };
    (@halves_norm $norm:ident, $prefix:literal, $centered:literal, $types:literal, $t:ty) => {
        mod $norm {
            use super::*;
            cluster_kernels!(@one $prefix, $centered, $types, $t, $t, $t, cluster2_held_halves, stage1_cluster_held,
                [2, true], "Stage 1 over a cluster of 2 blocks, slices held in half packs.");
            cluster_kernels!(@one $prefix, $centered, $types, $t, $t, $t, cluster4_held_halves, stage1_cluster_held,
                [4, true], "Stage 1 over a cluster of 4 blocks, slices held in half packs.");
            cluster_kernels!(@one $prefix, $centered, $types, $t, $t, $t, cluster8_held_halves, stage1_cluster_held,
                [8, true], "Stage 1 over a cluster of 8 blocks, slices held in half packs.");
        }
    };
    (@one $prefix:literal, $centered:literal, $types:literal, $t:ty, $w:ty, $x:ty, $kind:ident, $stage:ident,
     [$($generics:tt)*], $doc:literal) => {
        #[doc = $doc]
        /// Each cluster is one unit of the partial buffers (a row, or a share of a group).
        ///
        /// # Safety
        /// Launched by the host with buffers of the documented sizes, on rows the kernel
        /// takes (`$stage`'s safety section).
        #[unsafe(export_name = concat!($prefix, "_bwd_", stringify!($kind), "_", $types))]
        pub unsafe extern "ptx-kernel" fn $kind(p: BackwardRows<$t, $w, $x>, out: Partials) {
            crate::device::allow_dependent_launch();
            // SAFETY: the host launches this kernel only as `$stage` requires.
            unsafe { $stage::<$x, $t, $w, $($generics)*>(Rows::of(p, $centered), out) }
        }
    };
}

cluster_kernels!(f32_f32, "f32", f32, f32, f32);
cluster_kernels!(f16_f16, "f16", F16, F16, F16);
cluster_kernels!(bf16_bf16, "bf16", Bf16, Bf16, Bf16);
cluster_kernels!(f16_f32, "f16_f32w", F16, f32, F16);
cluster_kernels!(bf16_f32, "bf16_f32w", Bf16, f32, Bf16);
cluster_kernels!(f16_f32s, "f16_f32s", F16, F16, f32);
cluster_kernels!(bf16_f32s, "bf16_f32s", Bf16, Bf16, f32);
cluster_kernels!(f16_f32w_f32s, "f16_f32w_f32s", F16, f32, f32);
cluster_kernels!(bf16_f32w_f32s, "bf16_f32w_f32s", Bf16, f32, f32);
cluster_kernels!(@halves f16_halves, "f16", F16);
cluster_kernels!(@halves bf16_halves, "bf16", Bf16);
