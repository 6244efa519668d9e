//! The planner (`layernorm_cuda::plan`) against the kernel registry: the shapes the GPU tests
//! run reach every kernel of both modules, on an A100's limits (sm_80) and an H100's or H200's
//! (sm_90), so that no kernel goes untested on the GPU. Pure: no device needed.
//!
//! And the checked-in PTX modules against the same registry (kernels-gpu/layout/registry.rs):
//! each module has exactly the registry's kernels for it, each with the registry's launch
//! bound, cluster size and parameter sizes (kernels-gpu/layout/params.rs). build.rs writes
//! them from the same table; this catches a checked-in file that was edited by hand or came
//! from another table, and counts the cluster kernels. (Here rather than in a binary of their own: every test binary makes a
//! CUDA call where a GPU is, or compute-sanitizer fails it.)

mod common;
// The parameter structs' sizes (`params::param_bytes`), which the library keeps to itself.
#[allow(dead_code)]
#[path = "../kernels-gpu/layout/mod.rs"]
mod layout;

use std::collections::{BTreeMap, BTreeSet};

use layernorm_cuda::plan::{
    Alignment, Arch, DeviceLimits, Grid, Norm, Pass, Plan, Variant, plan, plan_f32_stream,
};
use layernorm_cuda::{Element, F32Stream, Weight, bf16, f16};

/// (type pair, pass, rows, n) the GPU tests run LayerNorm on, whole tensors (aligned where
/// n is whole packs, in half packs where 16-bit rows and weights are a whole number of
/// them): every shape of `common::SHAPES` in every type pair (tests/weights.rs runs the f32
/// weights), pass (both backward modes run the same kernels; tests/residual.rs the residual
/// passes), at its own rows (at most one a multiprocessor: the few-rows plans), and the
/// long rows of tests/forward.rs and tests/backward.rs and the many-row forwards of
/// tests/forward.rs in the types they use.
fn test_cases() -> Vec<(usize, Pass, u32, u32)> {
    let passes = [
        Pass::Forward,
        Pass::Backward,
        Pass::ForwardResidual,
        Pass::BackwardResidual,
    ];
    let mut cases = Vec::new();
    for &(rows, n) in common::SHAPES {
        for dtype in 0..layout::registry::TYPE_PAIRS.len() {
            for pass in passes {
                cases.push((dtype, pass, rows as u32, n as u32));
            }
        }
    }
    let (f32, f16, bf16) = (0, 1, 2);
    for n in [32768, 65536, 40000] {
        cases.push((f16, Pass::Backward, MANY, n));
    }
    for n in [15872, 32768, 65536] {
        cases.push((f32, Pass::Backward, MANY, n));
    }
    cases.push((bf16, Pass::Backward, MANY, 100001));
    for n in [65536, 40000, 100000] {
        cases.push((f32, Pass::Forward, MANY, n));
    }
    cases.push((f16, Pass::Forward, MANY, 131072));
    cases.push((f16, Pass::Forward, MANY, 262144));
    cases.push((bf16, Pass::Forward, MANY, 98304));
    // `gpu_forward_many_rows` and `gpu_forward_grid_of_every_row`.
    for (dtype, rows, n) in [
        (f16, 3000, 2048),
        (f32, 3000, 2048),
        (f16, 300, 8192),
        (bf16, 301, 8192),
        (f32, 302, 4096),
        (f32, 303, 8192),
        (f32, 600, 12288),
        (f32, 300, 24576),
    ] {
        cases.push((dtype, Pass::Forward, rows, n));
    }
    // `gpu_forward_unaligned_rows_many`.
    for (dtype, rows, n) in [
        (f32, 400, 1030),
        (f32, 300, 4097),
        (f16, 301, 4100),
        (bf16, 200, 16388),
        (f16, 200, 16383),
        (bf16, 300, 2051),
    ] {
        cases.push((dtype, Pass::Forward, rows, n));
    }
    // And `gpu_forward_row_block`.
    for (dtype, rows, n) in [
        (f16, 528, 12288),
        (bf16, 1056, 6144),
        (f32, 528, 6144),
        (f32, 264, 12288),
    ] {
        cases.push((dtype, Pass::Forward, rows, n));
    }
    // tests/backward.rs, `gpu_backward_rows_8_byte_aligned` (half packs, in rows enough
    // for the held block kernel's plan).
    cases.push((f16, Pass::Backward, 1500, 4100));
    cases.push((bf16, Pass::Backward, 700, 2052));
    cases.push((bf16, Pass::Backward, 300, 16388));
    cases.push((f16, Pass::Backward, 200, 32772));
    cases.push((f16, Pass::Backward, 100, 65540));
    // tests/residual.rs, `gpu_residual_streamed_rows_match_the_reference`.
    let bf16_f32w_f32s = 8;
    assert_eq!(
        layout::registry::TYPE_PAIRS[bf16_f32w_f32s].name,
        "bf16_f32w_f32s"
    );
    for (dtype, n) in [(f32, 16388), (f16, 32776), (bf16_f32w_f32s, 16388)] {
        cases.push((dtype, Pass::ForwardResidual, 140, n));
    }
    // And `gpu_residual_held_rows_match_the_reference`.
    let held = [
        (f16, 32768),
        (bf16, 20000),
        (f16, 16392),
        (bf16, 24576),
        (f16, 4096),
        (bf16, 8184),
        (f16, 15368),
    ];
    for (dtype, n) in held {
        cases.push((dtype, Pass::ForwardResidual, 140, n));
    }
    cases
}

/// (type pair, pass, rows, n) the GPU tests run RMSNorm on besides, as [`test_cases`]:
/// tests/residual.rs, `gpu_residual_unaligned_rows_of_many_match_the_reference` (the held
/// residual kernel's shifted copy, which LayerNorm's runs there too).
fn rms_test_cases() -> Vec<(usize, Pass, u32, u32)> {
    let (f16, bf16) = (1, 2);
    [
        (bf16, 1030),
        (f16, 2051),
        (f16, 4097),
        (f16, 16383),
        (bf16, 20001),
    ]
    .into_iter()
    .map(|(dtype, n)| (dtype, Pass::ForwardResidual, 140, n))
    .collect()
}

fn plan_of<T: Element, W: Weight<T>>(rows: u32, n: u32, pass: Pass, limits: DeviceLimits) -> Plan {
    norm_plan_of::<T, W>(Norm::Layer, rows, n, pass, limits)
}

/// As [`plan_of`], of `norm`'s kernels.
fn norm_plan_of<T: Element, W: Weight<T>>(
    norm: Norm,
    rows: u32,
    n: u32,
    pass: Pass,
    limits: DeviceLimits,
) -> Plan {
    let pack = (16 / size_of::<T>()) as u32;
    // A whole tensor's rows of 16-bit values and weights, n a multiple of 4, start 8-byte
    // aligned, as the library finds them, which the backward takes in half packs and the
    // forwards as shifted rows; other rows of whole tensors of x, dy and dx (x, y, the
    // residual and s) each sit as far past a boundary as x's.
    let backward = matches!(pass, Pass::Backward | Pass::BackwardResidual);
    let alignment = if n.is_multiple_of(pack) {
        Alignment::Packs
    } else if backward && size_of::<T>() == 2 && size_of::<W>() == 2 && n.is_multiple_of(4) {
        Alignment::HalfPacks
    } else {
        Alignment::Shifted
    };
    plan::<T, W>(norm, rows, n, pass, alignment, limits).unwrap()
}

/// As [`plan_of`], with the residual stream in f32 (rows of f32: aligned where n is whole
/// packs of f32).
fn stream_plan_of<T: F32Stream, W: Weight<T>>(rows: u32, n: u32, pass: Pass, limits: DeviceLimits) -> Plan {
    plan_f32_stream::<T, W>(Norm::Layer, rows, n, pass, n.is_multiple_of(4), limits).unwrap()
}

/// Rows enough that every multiprocessor has several: the planner's rules for throughput.
const MANY: u32 = 4096;

fn reached(limits: DeviceLimits) -> BTreeSet<String> {
    let layer = test_cases().into_iter().map(|case| (Norm::Layer, case));
    let rms = rms_test_cases().into_iter().map(|case| (Norm::Rms, case));
    layer
        .chain(rms)
        .map(|(norm, (dtype, pass, rows, n))| {
            let p = match layout::registry::TYPE_PAIRS[dtype].name {
                "f32" => norm_plan_of::<f32, f32>(norm, rows, n, pass, limits),
                "f16" => norm_plan_of::<f16, f16>(norm, rows, n, pass, limits),
                "bf16" => norm_plan_of::<bf16, bf16>(norm, rows, n, pass, limits),
                "f16_f32w" => norm_plan_of::<f16, f32>(norm, rows, n, pass, limits),
                "bf16_f32w" => norm_plan_of::<bf16, f32>(norm, rows, n, pass, limits),
                "f16_f32s" => stream_plan_of::<f16, f16>(rows, n, pass, limits),
                "bf16_f32s" => stream_plan_of::<bf16, bf16>(rows, n, pass, limits),
                "f16_f32w_f32s" => stream_plan_of::<f16, f32>(rows, n, pass, limits),
                "bf16_f32w_f32s" => stream_plan_of::<bf16, f32>(rows, n, pass, limits),
                other => panic!("a type pair this test does not know: {other}"),
            };
            format!("{:?}", p.variant)
        })
        .collect()
}

#[test]
fn test_shapes_reach_every_kernel() {
    for limits in [DeviceLimits::A100, DeviceLimits::H100] {
        check_coverage(limits);
    }
}

/// The same on the GPU the tests run on, with the limits it reports: its module and its
/// shared memory. (This also gives the binary a CUDA call, which the GPU machine's
/// compute-sanitizer runs need.)
#[test]
fn gpu_test_shapes_reach_every_kernel_of_this_device() {
    let Some(gpu) = common::gpu_or_skip() else { return };
    let limits = gpu.plan_limits().expect("a CUDA device has plan limits");
    println!("{}: {limits:?}", gpu.name());
    check_coverage(limits);
}

/// Every stage 1 and forward kernel of `limits`' module is some test case's plan (stage 2
/// runs after every backward).
fn check_coverage(limits: DeviceLimits) {
    let mut all: BTreeSet<String> = Variant::ALL
        .iter()
        .filter(|v| v.in_module(limits.arch) && **v != Variant::BwdReduce)
        .map(|v| format!("{v:?}"))
        .collect();
    let reached = reached(limits);
    all.retain(|v| !reached.contains(v));
    assert!(all.is_empty(), "{:?}: no test shape reaches {all:?}", limits.arch);
}

/// The forward's rows neither aligned nor shifted alike (`Alignment::Other`: x a view at an
/// offset y does not share), over more rows than multiprocessors: block teams
/// whose ranks take four read batches of 8 elements or more (whole warps, 64 to 1024 ranks),
/// where about 4 packs' columns a rank gave f32 N = 4097 288 ranks of 14 elements (one batch
/// and six single loads). Few rows keep a pack's columns a rank; aligned rows their kernels.
#[test]
fn unaligned_forward_rows_take_four_read_batches_a_rank() {
    let h = DeviceLimits::H100;
    for (n, threads) in [(1030, 64), (4097, 128), (16388, 512), (65537, 1024)] {
        for norm in [Norm::Layer, Norm::Rms] {
            let p = plan::<f32, f32>(norm, MANY, n, Pass::Forward, false, h).unwrap();
            assert_eq!(
                (p.variant, p.threads),
                (Variant::FwdBlock, threads),
                "{norm:?} f32 N = {n}"
            );
        }
    }
    let p = plan::<f16, f16>(Norm::Layer, MANY, 4100, Pass::Forward, false, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdBlock, 128));
    let p = plan::<bf16, f32>(Norm::Rms, MANY, 16388, Pass::Forward, false, DeviceLimits::A100).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdBlock, 512));
    // Rows of a warp's length keep the warp; few rows, a pack's columns a rank.
    let p = plan::<f32, f32>(Norm::Layer, MANY, 769, Pass::Forward, false, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdWarp, 256));
    let p = plan::<f32, f32>(Norm::Layer, 3, 4097, Pass::Forward, false, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdBlock, 1024));
    // The residual forward keeps the general kernel's team (about 4 packs' columns a
    // rank), on sm_90 in the streamed kernel at 64 registers.
    let p = plan::<f32, f32>(Norm::Layer, MANY, 4097, Pass::ForwardResidual, false, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdResidualStreamed, 288));
    let p = plan::<f32, f32>(
        Norm::Layer,
        MANY,
        4097,
        Pass::ForwardResidual,
        false,
        DeviceLimits::A100,
    )
    .unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdResidualBlock, 288));
}

/// The backward's owned block kernel over rows that go element by element: ranks of two
/// batches of 4 elements, whole warps, 64 to 512 (its bound), where 4 packs' columns a rank
/// gave 16-bit N = 1030 64 ranks of 16 elements. Launches whose rows are packed or half
/// packs (x, dy and weights of one size, rows a whole number of half packs), few rows, and
/// aligned rows keep 4 packs' columns a rank.
#[test]
fn element_rows_of_the_owned_block_take_two_batches_a_rank() {
    for limits in [DeviceLimits::H100, DeviceLimits::A100] {
        for norm in [Norm::Layer, Norm::Rms] {
            let owned = |n, p: Plan| {
                assert_eq!(p.variant, Variant::BwdOwnedBlock, "{norm:?} N = {n}");
                p.threads
            };
            for (n, threads) in [(1030, 128), (1031, 128), (2050, 256), (4097, 512)] {
                let p = plan::<f16, f16>(norm, MANY, n, Pass::Backward, false, limits).unwrap();
                assert_eq!(owned(n, p), threads, "{norm:?} f16 N = {n}");
            }
            let p = plan::<f32, f32>(norm, MANY, 4097, Pass::Backward, false, limits).unwrap();
            assert_eq!(owned(4097, p), 512);
            // f16 beside f32 weights: no half packs, so every unaligned row is elements.
            let p = plan::<f16, f32>(norm, MANY, 4100, Pass::Backward, false, limits).unwrap();
            assert_eq!(owned(4100, p), 512);
            // Rows packed or in half packs: 4 packs' columns a rank (513 packs: 160 ranks).
            let p = plan::<f16, f16>(norm, MANY, 4100, Pass::Backward, false, limits).unwrap();
            assert_eq!(owned(4100, p), 160);
            let p = plan::<f32, f32>(norm, MANY, 1030, Pass::Backward, false, limits).unwrap();
            assert_eq!(owned(1030, p), 96);
            // Few rows: a pack's columns a rank, as before.
            let p = plan::<f16, f16>(norm, 3, 4097, Pass::Backward, false, limits).unwrap();
            assert_eq!(owned(4097, p), 512);
            let p = plan::<f16, f16>(norm, 3, 1030, Pass::Backward, false, limits).unwrap();
            assert_eq!(owned(1030, p), 160);
        }
    }
}

/// Block-team rows shifted alike (x, dy and dx each as far past a 16-byte boundary as x's,
/// as whole tensors' rows of odd N are) with weights of x's type are held from x's first
/// boundary: f16 N = 4097 on 128 ranks (at most 512 whole packs past a row's head, 4 a
/// rank; the head and tail a column a rank), teams stacked as the thread limit and shared
/// memory allow (the staged weights beside the partials), f32 N = 1030 and 4097 likewise.
/// Not with a residual's dsum, f32 weights beside 16-bit rows, warp rows, or other
/// misaligned rows.
#[test]
fn shifted_rows_take_the_held_block_kernel() {
    for limits in [DeviceLimits::H100, DeviceLimits::A100] {
        for norm in [Norm::Layer, Norm::Rms] {
            let shifted =
                |pass| plan::<f16, f16>(norm, MANY, 4097, pass, Alignment::Shifted, limits).unwrap();
            let p = shifted(Pass::Backward);
            assert_eq!(
                (p.variant, p.threads),
                (Variant::BwdHeldBlockShifted, 128),
                "{norm:?}"
            );
            assert!(p.stacked >= 2, "{norm:?}: {p:?}");
            assert_eq!(
                shifted(Pass::BackwardResidual).variant,
                Variant::BwdOwnedBlock,
                "{norm:?} dsum"
            );
            for n in [1030, 4097] {
                let p = plan::<f32, f32>(norm, MANY, n, Pass::Backward, Alignment::Shifted, limits).unwrap();
                assert_eq!(p.variant, Variant::BwdHeldBlockShifted, "{norm:?} f32 {n}");
            }
            let p = plan::<f16, f32>(norm, MANY, 4097, Pass::Backward, Alignment::Shifted, limits).unwrap();
            assert_eq!(p.variant, Variant::BwdOwnedBlock, "{norm:?} f32 weights");
            let p = plan::<f16, f16>(norm, MANY, 1001, Pass::Backward, Alignment::Shifted, limits).unwrap();
            assert_eq!(p.variant, Variant::BwdOwnedWarp, "{norm:?} warp rows");
            let p = plan::<f32, f32>(norm, MANY, 1023, Pass::Backward, Alignment::Shifted, limits).unwrap();
            assert_eq!(p.variant, Variant::BwdOwnedWarp, "{norm:?} f32 warp rows");
            let p = plan::<f16, f16>(norm, MANY, 4097, Pass::Backward, Alignment::Other, limits).unwrap();
            assert_eq!(p.variant, Variant::BwdOwnedBlock, "{norm:?} other rows");
        }
    }
}

/// Asserts that `norm`'s `pass` over many rows shifted alike takes `variant` on sm_90, a
/// block for every row, on `threads` ranks at each `(n, threads)` of `sixteen_bit` (f16
/// and bf16) and of `f32`.
fn assert_held_shifted(
    norm: Norm,
    pass: Pass,
    variant: Variant,
    sixteen_bit: &[(u32, u32)],
    f32: &[(u32, u32)],
) {
    let h = DeviceLimits::H100;
    let planned = |p: Plan| (p.variant, p.threads, p.grid);
    for &(n, threads) in sixteen_bit {
        let want = (variant, threads, Grid::EveryRow);
        let p = plan::<f16, f16>(norm, MANY, n, pass, Alignment::Shifted, h).unwrap();
        assert_eq!(planned(p), want, "{norm:?} {pass:?} f16 {n}");
        let p = plan::<bf16, bf16>(norm, MANY, n, pass, Alignment::Shifted, h).unwrap();
        assert_eq!(planned(p), want, "{norm:?} {pass:?} bf16 {n}");
    }
    for &(n, threads) in f32 {
        let p = plan::<f32, f32>(norm, MANY, n, pass, Alignment::Shifted, h).unwrap();
        assert_eq!(
            planned(p),
            (variant, threads, Grid::EveryRow),
            "{norm:?} {pass:?} f32 {n}"
        );
    }
}

/// The residual forward over rows shifted alike (x, y, residual and s of one type, weights
/// of it) takes the held residual kernel's shifted copy on sm_90, both norms, in packs from
/// the first boundary, 4 packs a rank of the fewest ranks, a power of two from 64, that
/// hold the row's whole packs, a block for every row: f16 N = 1030 (128 whole packs at
/// most) and 2051 (256) on 64 ranks, 4097 (512) and 4100 (rows in half packs, which the
/// host gives as shifted: 512) on 128, 16383 (2047) on 512, 20001 (2500) on 1024; f32 N =
/// 1030 (257) and 2051 (512) on 128, 4097 (1024) on 256, 12289 (3072) on 1024. Not past
/// what 1024 ranks hold (f16 32776, f32 16389), nor f32 weights, launches of few rows, or
/// sm_80: those stream; nor rows a warp takes (1022). The aligned rows keep the held
/// kernel.
#[test]
fn shifted_residual_rows_take_the_held_kernel() {
    let h = DeviceLimits::H100;
    let res = Pass::ForwardResidual;
    let shifted = Variant::FwdResidualHeldShifted;
    for norm in [Norm::Layer, Norm::Rms] {
        assert_held_shifted(
            norm,
            res,
            shifted,
            &[
                (1030, 64),
                (2051, 64),
                (4097, 128),
                (4100, 128),
                (16383, 512),
                (20001, 1024),
            ],
            &[(1030, 128), (2051, 128), (4097, 256), (12289, 1024)],
        );
        for (n, alignment, what) in [
            (32776, Alignment::Shifted, "32776"),
            (4097, Alignment::Other, "other rows"),
        ] {
            let p = plan::<f16, f16>(norm, MANY, n, res, alignment, h).unwrap();
            assert_eq!(p.variant, Variant::FwdResidualStreamed, "{norm:?} {what}");
        }
        let p = plan::<f32, f32>(norm, MANY, 16389, res, Alignment::Shifted, h).unwrap();
        assert_eq!(p.variant, Variant::FwdResidualStreamed, "{norm:?} f32 16389");
        let p = plan::<f16, f32>(norm, MANY, 4097, res, Alignment::Shifted, h).unwrap();
        assert_eq!(p.variant, Variant::FwdResidualStreamed, "{norm:?} f32 weights");
        let p = plan::<f16, f16>(norm, 100, 4097, res, Alignment::Shifted, h).unwrap();
        assert_ne!(p.variant, shifted, "{norm:?} few rows");
        let p = plan::<f16, f16>(norm, MANY, 1022, res, Alignment::Shifted, h).unwrap();
        assert_eq!(p.variant, Variant::FwdResidualWarp, "{norm:?} warp rows");
        let p = plan::<f16, f16>(norm, MANY, 4097, res, Alignment::Shifted, DeviceLimits::A100).unwrap();
        assert_ne!(p.variant, shifted, "{norm:?} sm_80");
        let p = plan::<f16, f16>(norm, MANY, 32768, res, Alignment::Packs, h).unwrap();
        let held = (Variant::FwdResidualHeld, 1024);
        assert_eq!((p.variant, p.threads), held, "{norm:?} aligned");
    }
}

/// The plain forward over rows shifted alike (x and y of one type, weights of it; 16-bit
/// rows in half packs, which the host gives as shifted, among them) takes the held forward
/// over shifted rows on sm_90, both norms: 4 packs a rank from the first boundary, of the
/// fewest ranks, a power of two from 64, that hold the row's whole packs, a block for every
/// row: 16-bit N = 1030 (128 whole packs at most) and 2051 (256) on 64 ranks, 4097 (512)
/// and 4100 (512) on 128, 16383 (2047) on 512, 32775 (4096) on 1024; f32 N = 2051 (512) on
/// 128, 4097 (1024) on 256, 16387 (4096) on 1024. Not f32 rows of fewer than 512 whole
/// packs (1030), past what 1024 ranks hold (f16 32776), f32 weights beside 16-bit rows,
/// launches of few rows, or sm_80: those take the general block kernel; nor rows a warp
/// takes (1022). Aligned rows keep their kernels.
#[test]
fn shifted_rows_take_the_held_forward() {
    let h = DeviceLimits::H100;
    let fwd = Pass::Forward;
    let held = Variant::FwdHeldShifted;
    for norm in [Norm::Layer, Norm::Rms] {
        assert_held_shifted(
            norm,
            fwd,
            held,
            &[
                (1030, 64),
                (2051, 64),
                (4097, 128),
                (4100, 128),
                (16383, 512),
                (32775, 1024),
            ],
            &[(2051, 128), (4097, 256), (16387, 1024)],
        );
        for (what, p) in [
            (
                "f32 1030",
                plan::<f32, f32>(norm, MANY, 1030, fwd, Alignment::Shifted, h),
            ),
            (
                "32776",
                plan::<f16, f16>(norm, MANY, 32776, fwd, Alignment::Shifted, h),
            ),
            (
                "f32 weights",
                plan::<f16, f32>(norm, MANY, 4097, fwd, Alignment::Shifted, h),
            ),
            (
                "few rows",
                plan::<f16, f16>(norm, 100, 4097, fwd, Alignment::Shifted, h),
            ),
            (
                "sm_80",
                plan::<f16, f16>(norm, MANY, 4097, fwd, Alignment::Shifted, DeviceLimits::A100),
            ),
            (
                "other rows",
                plan::<f16, f16>(norm, MANY, 4097, fwd, Alignment::Other, h),
            ),
        ] {
            assert_eq!(p.unwrap().variant, Variant::FwdBlock, "{norm:?} {what}");
        }
        let p = plan::<f16, f16>(norm, MANY, 1022, fwd, Alignment::Shifted, h).unwrap();
        assert_eq!(p.variant, Variant::FwdWarp, "{norm:?} warp rows");
        let p = plan::<f16, f16>(norm, MANY, 4096, fwd, Alignment::Packs, h).unwrap();
        assert_ne!(p.variant, held, "{norm:?} aligned");
    }
}

/// Block-team rows of 16-bit values and weights of one type, 8-byte aligned and a whole
/// number of half packs (f16 N = 4100 and 16388 of a whole tensor: every other row starts
/// 8 bytes past a 16-byte boundary), are held in half packs as packed rows are in packs:
/// 4 packs' columns a rank (513 packs: 160 ranks, 3 teams a block of 512); on sm_90 rows
/// past what a block holds, over the fewest of 2, 4 or 8 blocks whose slices fit, as packed
/// rows are (f16 16388, 32772, 65540). Not with f32 weights, whose 8-byte alignment gives
/// no 16-bit half packs, nor warp rows, nor (clusters) a residual's dsum.
#[test]
fn half_packed_rows_take_the_held_block_kernel() {
    for limits in [DeviceLimits::H100, DeviceLimits::A100] {
        for norm in [Norm::Layer, Norm::Rms] {
            let halves =
                |n| plan::<f16, f16>(norm, MANY, n, Pass::Backward, Alignment::HalfPacks, limits).unwrap();
            let p = halves(4100);
            assert_eq!(
                (p.variant, p.threads),
                (Variant::BwdHeldBlockHalves, 160),
                "{norm:?}"
            );
            assert_eq!(
                p.stacked,
                if limits.arch == Arch::Sm90 { 3 } else { 2 },
                "{norm:?}"
            );
            let p = plan::<bf16, bf16>(
                norm,
                MANY,
                4100,
                Pass::BackwardResidual,
                Alignment::HalfPacks,
                limits,
            )
            .unwrap();
            assert_eq!(p.variant, Variant::BwdHeldBlockHalves, "{norm:?} bf16 with dsum");
            let p = plan::<f16, f32>(norm, MANY, 4100, Pass::Backward, Alignment::HalfPacks, limits).unwrap();
            assert_eq!(p.variant, Variant::BwdOwnedBlock, "{norm:?} f32 weights");
            let p = halves(1020);
            assert_eq!(p.variant, Variant::BwdOwnedWarp, "{norm:?} warp rows");
            if limits.arch == Arch::Sm90 {
                for (n, v) in [
                    (16388, Variant::BwdCluster2HeldHalves),
                    (32772, Variant::BwdCluster4HeldHalves),
                    (65540, Variant::BwdCluster8HeldHalves),
                ] {
                    assert_eq!(halves(n).variant, v, "{norm:?} {n}");
                }
                let p = plan::<f16, f16>(
                    norm,
                    MANY,
                    16388,
                    Pass::BackwardResidual,
                    Alignment::HalfPacks,
                    limits,
                )
                .unwrap();
                assert_eq!(p.variant, Variant::BwdCluster8, "{norm:?} 16388 with dsum");
            }
        }
    }
}

/// A few choices spelled out, as a reader would check them against the rules in plan.rs.
#[test]
fn known_choices() {
    let h = DeviceLimits::H100;
    let p = plan::<f16, f16>(Norm::Layer, MANY, 1024, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdWidenedWarp, 256));
    let p = plan::<f16, f16>(Norm::Rms, MANY, 1024, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdPipelinedWarp, 256));
    let p = plan::<f16, f16>(Norm::Layer, MANY, 4096, Pass::Backward, true, h).unwrap();
    // 512 packs at 4 a thread: 128 ranks, and the 512-thread bound stacks 4 teams.
    assert_eq!((p.variant, p.threads, p.stacked), (Variant::BwdHeldBlock, 128, 4));
    let p = plan::<f16, f16>(Norm::Layer, MANY, 4097, Pass::Backward, false, h).unwrap();
    assert_eq!(p.variant, Variant::BwdOwnedBlock);
    let p = plan::<f32, f32>(Norm::Layer, MANY, 65536, Pass::Backward, true, h).unwrap();
    assert_eq!(p.variant, Variant::BwdCluster8Held);
    let p = plan::<f32, f32>(Norm::Layer, MANY, 65536, Pass::Backward, true, DeviceLimits::A100).unwrap();
    assert_eq!(p.variant, Variant::BwdOwnedBlock);
    assert!(
        !p.local,
        "f32 rows of 65536 do not fit an A100 block's shared memory"
    );
    let p = plan::<f16, f16>(Norm::Layer, MANY, 1024, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!(p.variant, Variant::FwdResidualPipelinedWarp);
    // 2048 packs at 4 a thread on 512 threads: pipelined, as the plain forward.
    let p = plan::<f32, f32>(Norm::Layer, MANY, 8192, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdResidualPipelinedBlock, 512));
    // 8192 packs, more than 512 threads hold at 8 a thread: streamed over many rows, a
    // block for every row on sm_90; over few rows, 4 a thread held and the other 6144 staged
    // twice (x's and the residual's) after the 512-byte scratch.
    let p = plan::<f32, f32>(Norm::Layer, MANY, 32768, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!(
        (p.variant, p.threads, p.smem, p.grid),
        (Variant::FwdResidualStreamed, 512, 512, Grid::EveryRow)
    );
    let p = plan::<f32, f32>(Norm::Layer, 100, 32768, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!(
        (p.variant, p.threads, p.smem),
        (Variant::FwdResidualBlock, 512, 512 + 2 * 6144 * 16)
    );
    // 4096 packs fit 1024 threads at 4: the held kernel; beside f32 weights (a 768-thread
    // bound), held by the general kernel at 8 a thread on 512.
    let p = plan::<f16, f16>(Norm::Layer, MANY, 32768, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdResidualHeld, 1024));
    let p = plan::<f16, f32>(Norm::Layer, MANY, 32768, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdResidualBlock, 512));
    // With dsum, long f16 rows take the general cluster kernel (the held ones of f16 rows and
    // weights take no dsum), and f32 rows or weights the held one, as without.
    let p = plan::<f16, f16>(Norm::Layer, MANY, 32768, Pass::Backward, true, h).unwrap();
    assert_eq!(p.variant, Variant::BwdCluster2Held);
    let p = plan::<f16, f16>(Norm::Layer, MANY, 32768, Pass::BackwardResidual, true, h).unwrap();
    assert_eq!(p.variant, Variant::BwdCluster8);
    let residual = plan::<f16, f32>(Norm::Layer, MANY, 32768, Pass::BackwardResidual, true, h).unwrap();
    assert_eq!(
        residual,
        plan::<f16, f32>(Norm::Layer, MANY, 32768, Pass::Backward, true, h).unwrap()
    );
    assert_eq!(residual.variant, Variant::BwdCluster4Held);
    let residual = plan::<f32, f32>(Norm::Layer, MANY, 32768, Pass::BackwardResidual, true, h).unwrap();
    assert_eq!(
        residual,
        plan::<f32, f32>(Norm::Layer, MANY, 32768, Pass::Backward, true, h).unwrap()
    );
    assert_eq!(residual.variant, Variant::BwdCluster4Held);
    assert_eq!(DeviceLimits::H100.arch, Arch::Sm90);
}

/// LayerNorm's pipelined forward over rows of f16 and bf16 stages each block team's next row
/// in shared memory after the scratch, a 16-byte slot for each of the 4 packs a rank holds;
/// over f32 rows of more than 2048 packs too, with 6 packs a rank. Shorter f32 rows and
/// RMSNorm's keep it in registers and take the scratch alone.
#[test]
fn pipelined_forward_stages_layer_norm_half_rows() {
    let h = DeviceLimits::H100;
    // 1536 packs of f16 or bf16: 384 ranks of 4 (over 300 rows: at 4096, the row block
    // takes f16 rows, `row_block_where_its_last_wave_is_nearly_full`).
    let staged = (Variant::FwdPipelinedBlock, 384, 512 + 384 * 4 * 16);
    let p = plan::<f16, f16>(Norm::Layer, 300, 12288, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads, p.smem), staged);
    let p = plan::<bf16, f32>(Norm::Layer, MANY, 12288, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads, p.smem), staged);
    let p = plan::<f16, f16>(Norm::Rms, 300, 12288, Pass::Forward, true, h).unwrap();
    assert_eq!(
        (p.variant, p.threads, p.smem),
        (Variant::FwdPipelinedBlock, 384, 512)
    );
    // 2048 packs of f32: 512 ranks of 4 (RMSNorm's; LayerNorm's take the row block).
    let p = plan::<f32, f32>(Norm::Rms, MANY, 8192, Pass::Forward, true, h).unwrap();
    assert_eq!(
        (p.variant, p.threads, p.smem),
        (Variant::FwdPipelinedBlock, 512, 512)
    );
    // 3072 packs of f32: 512 ranks of 6 (two teams a multiprocessor, where 768 ranks of 4
    // fit one), each with 6 slots; RMSNorm's stay 768 ranks of 4, in registers (over 300
    // rows: over 4096 the row block takes them).
    let p = plan::<f32, f32>(Norm::Layer, 300, 12288, Pass::Forward, true, h).unwrap();
    assert_eq!(
        (p.variant, p.threads, p.smem),
        (Variant::FwdPipelinedBlock, 512, 512 + 512 * 6 * 16)
    );
    let p = plan::<f32, f32>(Norm::Rms, 300, 12288, Pass::Forward, true, h).unwrap();
    assert_eq!(
        (p.variant, p.threads, p.smem),
        (Variant::FwdPipelinedBlock, 768, 512)
    );
    // 6 packs a rank take rows of up to 6144 packs (N = 24576) on 1024 ranks; one pack
    // more and the general kernel holds them (8 a rank), as it does RMSNorm's past 4096.
    let p = plan::<f32, f32>(Norm::Layer, MANY, 24576, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdPipelinedBlock, 1024));
    let p = plan::<f32, f32>(Norm::Layer, MANY, 24580, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.smem), (Variant::FwdBlock, 512));
    // RMSNorm's rows of 6144 packs: 512 ranks of 4, the other 4096 packs staged.
    let p = plan::<f32, f32>(Norm::Rms, MANY, 24576, Pass::Forward, true, h).unwrap();
    assert_eq!(
        (p.variant, p.threads, p.smem),
        (Variant::FwdBlock, 512, 512 + 4096 * 16)
    );
    // Warp rows keep theirs in registers too.
    let p = plan::<f32, f32>(Norm::Layer, MANY, 512, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.smem), (Variant::FwdPipelinedWarp, 512));
}

/// RMSNorm's 16-bit rows of 2049 to 8192 packs, and its f32 rows of as many on teams of 512
/// or 1024 ranks at 8 packs a rank, weights of x's type, take the general kernel with a
/// block for every row on sm_90 (docs/PERF.md v35); so do its f32 rows of 4097 to 6144
/// packs, on 512 ranks that stage what they do not hold (v53); other team sizes, shorter
/// and longer rows, f32 weights beside 16-bit x, few rows, unaligned rows, sm_80 and
/// LayerNorm do not.
#[test]
fn rms_long_rows_every_row_on_the_general_kernel() {
    let h = DeviceLimits::H100;
    let rms = |n| plan::<f32, f32>(Norm::Rms, MANY, n, Pass::Forward, true, h).unwrap();
    let rms16 = |n| plan::<bf16, bf16>(Norm::Rms, MANY, n, Pass::Forward, true, h).unwrap();
    let shape = |p: Plan| (p.variant, p.threads, p.smem, p.grid);
    let every_row = |threads| (Variant::FwdBlock, threads, 512, Grid::EveryRow);
    // 16-bit: 2049 packs (N = 16392) on 288 ranks, 2560 (20480) on 320, 8192 (65536) on
    // 1024.
    assert_eq!(shape(rms16(16392)), every_row(288));
    assert_eq!(shape(rms16(20480)), every_row(320));
    assert_eq!(shape(rms16(65536)), every_row(1024));
    // f32: 3968 packs (N = 15872) and 4096 on 512 ranks, 8192 (32768) on 1024.
    assert_eq!(shape(rms(15872)), every_row(512));
    assert_eq!(shape(rms(16384)), every_row(512));
    assert_eq!(shape(rms(32768)), every_row(1024));
    // f32 rows of 4097-6144 packs: 512 ranks of 4 packs, the rest in shared memory, two
    // blocks a multiprocessor (N = 16388 stages 2049 packs, 24576 4096).
    let staged = |packs: u32| (Variant::FwdBlock, 512, 512 + (packs - 2048) * 16, Grid::EveryRow);
    assert_eq!(shape(rms(16388)), staged(4097));
    assert_eq!(shape(rms(20480)), staged(5120));
    assert_eq!(shape(rms(24576)), staged(6144));
    // One pack more (N = 24580, 6145 packs) and the 1024-rank team holds it, resident.
    assert_eq!(shape(rms(24580)), (Variant::FwdBlock, 1024, 512, Grid::Resident));
    // f32 teams of other sizes keep their launch: 2304 packs (N = 9216, 576 ranks of 4)
    // and 3072 (12288, 768) the pipelined block over 300 rows, and over 4096 the row block,
    // whose last wave is nearly full; 7168 (28672, 896) the general one resident.
    for n in [9216, 12288] {
        let p = plan::<f32, f32>(Norm::Rms, 300, n, Pass::Forward, true, h).unwrap();
        assert_eq!(p.variant, Variant::FwdPipelinedBlock, "{n}");
        assert_eq!(shape(rms(n)).0, Variant::FwdRowBlock, "{n}");
    }
    assert_eq!(shape(rms(28672)).3, Grid::Resident);
    // 2048 packs and fewer: the pipelined block (f32 8192 on 512 ranks), or the row block
    // that fills them (16-bit 16384).
    assert_eq!(shape(rms(8192)).0, Variant::FwdPipelinedBlock);
    assert_eq!(shape(rms16(16384)).0, Variant::FwdRowBlock);
    // Past 8192 packs: resident (f32 N = 32772 stages on 1024 ranks).
    assert_eq!(shape(rms(32772)).3, Grid::Resident);
    // f32 weights, few rows, unaligned rows, sm_80, LayerNorm: as before.
    let p = plan::<bf16, f32>(Norm::Rms, MANY, 32768, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.grid), (Variant::FwdPipelinedBlock, Grid::Resident));
    let p = plan::<f32, f32>(Norm::Rms, 8, 16384, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdPipelinedBlock, 1024));
    let p = plan::<f32, f32>(Norm::Rms, MANY, 16384, Pass::Forward, false, h).unwrap();
    assert_eq!(p.grid, Grid::Resident);
    let p = plan::<f32, f32>(Norm::Rms, MANY, 16384, Pass::Forward, true, DeviceLimits::A100).unwrap();
    assert_eq!((p.variant, p.grid), (Variant::FwdPipelinedBlock, Grid::Resident));
    let p = plan::<f32, f32>(Norm::Layer, MANY, 16384, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.grid), (Variant::FwdPipelinedBlock, Grid::Resident));
}

/// The plain forward on sm_90 launches a block for every row where its pipelined block
/// teams have 256 ranks, or 512 that keep their next row in registers; elsewhere, on sm_80
/// and in every other pass, a resident grid.
#[test]
fn forward_grid_every_row_where_measured_faster() {
    let h = DeviceLimits::H100;
    let fwd = |norm, n| plan::<f16, f16>(norm, MANY, n, Pass::Forward, true, h).unwrap();
    let fwd32 = |norm, n| plan::<f32, f32>(norm, MANY, n, Pass::Forward, true, h).unwrap();
    let shape = |p: Plan| (p.variant, p.threads, p.grid);
    let (layer, rms, block) = (Norm::Layer, Norm::Rms, Variant::FwdPipelinedBlock);
    // 256 ranks, whether the next row is staged (f16) or held (f32, RMSNorm).
    for p in [
        fwd(layer, 8192),
        fwd(rms, 8192),
        fwd32(layer, 4096),
        fwd32(rms, 4096),
    ] {
        assert_eq!(shape(p), (block, 256, Grid::EveryRow));
    }
    // 512 ranks holding their next row (RMSNorm's f32 N = 8192 and f16 15872: 1984 packs),
    // not staging it (LayerNorm's f16 15872); LayerNorm's f32 8192 takes the row block.
    for p in [fwd32(rms, 8192), fwd(rms, 15872)] {
        assert_eq!(shape(p), (block, 512, Grid::EveryRow));
    }
    assert_eq!(shape(fwd(layer, 15872)), (block, 512, Grid::Resident));
    // Warp rows (but LayerNorm's 16-bit ones of 2 to 4 packs a lane: the widened warp
    // kernel), smaller and other team sizes: resident.
    assert_eq!(
        shape(fwd(rms, 1024)),
        (Variant::FwdPipelinedWarp, 256, Grid::Resident)
    );
    assert_eq!(shape(fwd(layer, 4096)), (block, 128, Grid::Resident));
    assert_eq!(shape(fwd32(layer, 2048)), (block, 128, Grid::Resident));
    // (f32 N = 6144 and 12288, f16 12288: the row block over 4096 rows.)
    let resident = |p: Plan| (p.variant, p.threads, p.grid);
    let at300 = |n| plan::<f32, f32>(Norm::Layer, 300, n, Pass::Forward, true, h).unwrap();
    assert_eq!(resident(at300(6144)), (block, 384, Grid::Resident));
    assert_eq!(resident(at300(12288)), (block, 512, Grid::Resident));
    let p = plan::<f16, f16>(Norm::Rms, 300, 12288, Pass::Forward, true, h).unwrap();
    assert_eq!(resident(p), (block, 384, Grid::Resident));
    // Unaligned rows take the general kernel, resident.
    let p = plan::<f16, f16>(Norm::Layer, MANY, 8192, Pass::Forward, false, h).unwrap();
    assert_eq!((p.variant, p.grid), (Variant::FwdBlock, Grid::Resident));
    // sm_80, unmeasured there, and the other passes keep the resident grid.
    let p = plan::<f16, f16>(Norm::Layer, MANY, 8192, Pass::Forward, true, DeviceLimits::A100).unwrap();
    assert_eq!(shape(p), (block, 256, Grid::Resident));
    let p = plan::<f32, f32>(Norm::Layer, MANY, 4096, Pass::Backward, true, h).unwrap();
    assert_eq!(p.grid, Grid::Resident);
}

/// The row block (docs/PERF.md v48), a block for every row holding its row only at 40
/// registers (RMSNorm's f32 kernel 48), in place of the pipelined block on sm_90 over
/// weights of x's type, where a multiprocessor runs two of its blocks or more, more of its
/// threads than of the pipelined block's (64 registers: 1024 a multiprocessor, in whole
/// blocks), and its last wave leaves at most 5% of the waves' places empty (132
/// multiprocessors).
#[test]
fn row_block_where_its_last_wave_is_nearly_full() {
    let h = DeviceLimits::H100;
    let (layer, rms) = (Norm::Layer, Norm::Rms);
    let f16 = |norm, rows, n| plan::<f16, f16>(norm, rows, n, Pass::Forward, true, h).unwrap();
    let bf16 = |rows, n| plan::<bf16, bf16>(Norm::Layer, rows, n, Pass::Forward, true, h).unwrap();
    let f32 = |norm, rows, n| plan::<f32, f32>(norm, rows, n, Pass::Forward, true, h).unwrap();
    let shape = |p: Plan| (p.variant, p.threads, p.grid);
    let row = |threads| (Variant::FwdRowBlock, threads, Grid::EveryRow);
    // 16-bit N = 12288: 384 ranks, 4 blocks a multiprocessor (1536 threads, where the
    // pipelined block runs 768), 528 places: 4096 rows are 7.76 waves, 3% of places empty.
    assert_eq!(shape(f16(layer, MANY, 12288)), row(384));
    assert_eq!(shape(f16(rms, MANY, 12288)), row(384));
    // N = 6144: 192 ranks, 8 blocks (the pipelined block 5), 1056 places, 3.88 waves.
    assert_eq!(shape(f16(layer, MANY, 6144)), row(192));
    // f32 N = 6144 on 384 ranks; 12288 on 768 (2 blocks: 264 places, 15.5 waves), where the
    // pipelined block takes 512 of 6 packs.
    assert_eq!(shape(f32(layer, MANY, 6144)), row(384));
    assert_eq!(shape(f32(layer, MANY, 12288)), row(768));
    // bf16 over 65536 rows: 64 ranks at N = 2048 (25 blocks, 3300 places, 19.9 waves), 128
    // at 4096, 256 at 8192.
    for (n, threads) in [(2048, 64), (4096, 128), (8192, 256)] {
        assert_eq!(shape(bf16(65536, n)), row(threads));
    }
    // A wave exactly full: RMSNorm's f32 N = 6144, 384 ranks at 48 registers (3 blocks,
    // 396 places) over 396 rows; over 4096 rows (10.34 waves, 6% empty), not.
    assert_eq!(shape(f32(rms, 396, 6144)), row(384));
    assert_eq!(f32(rms, MANY, 6144).variant, Variant::FwdPipelinedBlock);
    // Last waves over 5% empty: 16-bit N = 2048 (1.24 waves), 4096 (2.59), 8192 (256
    // ranks, 6 blocks, 5.17 waves), 15872 (512 ranks, 3 blocks, 10.34 waves).
    for n in [2048, 4096, 8192, 15872] {
        assert_eq!(f16(layer, MANY, n).variant, Variant::FwdPipelinedBlock, "f16 {n}");
    }
    // But rows of 2048 packs, a team of 512 ranks at 4 packs each, whatever the last wave:
    // f32 N = 8192 and 16-bit 16384 over 4096 rows (10.34 waves) and 2048 (5.17, 14% empty).
    for rows in [MANY, 2048] {
        assert_eq!(shape(f32(layer, rows, 8192)), row(512), "f32 8192, {rows} rows");
        assert_eq!(shape(f16(layer, rows, 16384)), row(512), "f16 16384, {rows} rows");
        assert_eq!(
            shape(f16(rms, rows, 16384)),
            row(512),
            "RMSNorm f16 16384, {rows} rows"
        );
    }
    // One block a multiprocessor: f32 N = 15872 (992 ranks), RMSNorm's f32 13312 (832 ranks,
    // at its 40 registers too), and 800 ranks (f32 N = 12800, 16-bit 25600 and 25088): 25
    // warps a block, past half the 48 that 40 registers hold in fours, though half of 51.
    assert_eq!(f32(layer, MANY, 15872).variant, Variant::FwdPipelinedBlock);
    assert_eq!(f32(rms, MANY, 13312).variant, Variant::FwdPipelinedBlock);
    for rows in [1024, MANY, 65536] {
        assert_eq!(f32(layer, rows, 12800).variant, Variant::FwdPipelinedBlock);
        for n in [25088, 25600] {
            assert_eq!(
                f16(layer, rows, n).variant,
                Variant::FwdPipelinedBlock,
                "f16 {n}, {rows} rows"
            );
        }
    }
    // RMSNorm's f32 row block is counted at 48 registers where that gives two blocks or
    // more (N = 6144 above: 3 blocks), and at its 40 where 48 gives one: N = 11264-12288
    // (704-768 ranks), two blocks (264 places; 15.5 waves over 4096 rows at 12288); 800
    // ranks (N = 12800) take 50 warps, past the 48 that 40 registers hold in fours.
    for n in [11264, 12288] {
        assert_eq!(shape(f32(rms, MANY, n)), row(n / 16), "RMSNorm f32 {n}");
    }
    assert_eq!(shape(f32(rms, 264, 12288)), row(768));
    assert_eq!(f32(rms, MANY, 12800).variant, Variant::FwdPipelinedBlock);
    // No more threads than the pipelined block: RMSNorm's f32 N = 8192 (512 ranks, two
    // blocks of either).
    assert_eq!(f32(rms, MANY, 8192).variant, Variant::FwdPipelinedBlock);
    // f32 weights, sm_80, few rows: the pipelined block.
    let p = plan::<bf16, f32>(Norm::Layer, 65536, 4096, Pass::Forward, true, h).unwrap();
    assert_eq!(p.variant, Variant::FwdPipelinedBlock);
    let p = plan::<bf16, bf16>(Norm::Layer, 65536, 4096, Pass::Forward, true, DeviceLimits::A100).unwrap();
    assert_eq!(p.variant, Variant::FwdPipelinedBlock);
    assert_eq!(f16(layer, 100, 12288).variant, Variant::FwdPipelinedBlock);
}

/// The residual forward's grid (docs/PERF.md v34): a block for every row for pipelined
/// teams of 256 ranks, for teams of 512 over f32 x that hold their row, and for the held
/// (16-bit rows, v40 and v41) and streamed kernels' blocks; resident for the team sizes
/// that lost that way, 16-bit x on 512 ranks, staged f32 rows, unaligned rows and sm_80.
#[test]
fn residual_forward_grid_every_row_where_measured_faster() {
    let h = DeviceLimits::H100;
    let res = Pass::ForwardResidual;
    let f16 = |norm, n| plan::<f16, f16>(norm, MANY, n, res, true, h).unwrap();
    let f32 = |norm, n| plan::<f32, f32>(norm, MANY, n, res, true, h).unwrap();
    let stream = |norm, n| plan_f32_stream::<bf16, bf16>(norm, MANY, n, res, true, h).unwrap();
    let shape = |p: Plan| (p.variant, p.threads, p.grid);
    let f16_f32w = |norm, n| plan::<f16, f32>(norm, MANY, n, res, true, h).unwrap();
    let (pipelined, general) = (Variant::FwdResidualPipelinedBlock, Variant::FwdResidualBlock);
    let held = Variant::FwdResidualHeld;
    for norm in [Norm::Layer, Norm::Rms] {
        // Pipelined teams of 256 ranks but over 16-bit rows with weights of their type (the
        // stream in f32: rows of f32 s).
        for p in [f16_f32w(norm, 8192), f32(norm, 4096), stream(norm, 4096)] {
            assert_eq!(shape(p), (pipelined, 256, Grid::EveryRow));
        }
        // Those the held kernel takes on 128, 256 or 512 ranks, 4 packs a rank or fewer.
        for (n, ranks) in [(4096, 128), (3080, 128), (8192, 256), (16384, 512), (15872, 512)] {
            assert_eq!(shape(f16(norm, n)), (held, ranks, Grid::EveryRow), "n = {n}");
        }
        // 512 ranks over f32 x: pipelined at 8192, the general kernel's held rows beyond.
        assert_eq!(shape(f32(norm, 8192)), (pipelined, 512, Grid::EveryRow));
        for n in [8200, 12288, 16384] {
            assert_eq!(shape(f32(norm, n)), (general, 512, Grid::EveryRow));
        }
        // 16-bit rows past the pipelined block, up to 4 packs a rank of 1024: the held
        // kernel, a block of 1024 for every row.
        for n in [16392, 20000, 32768] {
            assert_eq!(shape(f16(norm, n)), (held, 1024, Grid::EveryRow));
        }
        // 16-bit x on 512 ranks (f16 with f32 weights at 15872, the stream in f32 at 8192
        // and 12288), other team sizes: resident.
        assert_eq!(shape(f16_f32w(norm, 15872)), (pipelined, 512, Grid::Resident));
        assert_eq!(shape(stream(norm, 8192)), (pipelined, 512, Grid::Resident));
        assert_eq!(shape(stream(norm, 12288)), (general, 512, Grid::Resident));
        // Rows too long to hold at 8 packs a rank, streamed: a block for every row.
        let streamed = (Variant::FwdResidualStreamed, 512, Grid::EveryRow);
        for p in [f32(norm, 32768), f16(norm, 65536), stream(norm, 32768)] {
            assert_eq!(shape(p), streamed);
        }
        assert_eq!(shape(f16_f32w(norm, 4096)), (pipelined, 128, Grid::Resident));
        // 16-bit rows whose team has 384 ranks (lost 2.7-3.3% on the held kernel) or 64.
        assert_eq!(shape(f16(norm, 12288)), (pipelined, 384, Grid::Resident));
        assert_eq!(shape(f16(norm, 2048)), (pipelined, 64, Grid::Resident));
        assert_eq!(shape(f32(norm, 6144)), (pipelined, 384, Grid::Resident));
        assert_eq!(
            shape(f16(norm, 1024)),
            (Variant::FwdResidualPipelinedWarp, 256, Grid::Resident)
        );
        // Unaligned rows (the streamed kernel, which takes them element by element at 64
        // registers; on sm_80 the general kernel), few rows, and sm_80 (unmeasured there).
        let p = plan::<f32, f32>(norm, MANY, 12288, res, false, h).unwrap();
        assert_eq!(shape(p), (Variant::FwdResidualStreamed, 512, Grid::Resident));
        let p = plan::<f32, f32>(norm, MANY, 12288, res, false, DeviceLimits::A100).unwrap();
        assert_eq!(shape(p), (general, 512, Grid::Resident));
        let p = plan::<f32, f32>(norm, h.sm_count, 12288, res, false, h).unwrap();
        assert_eq!(p.variant, general);
        let p = plan::<f32, f32>(norm, h.sm_count, 12288, res, true, h).unwrap();
        assert_eq!(p.variant, general);
        let p = plan::<f16, f16>(norm, MANY, 32768, res, true, DeviceLimits::A100).unwrap();
        assert_eq!(shape(p), (Variant::FwdResidualHeld, 1024, Grid::Resident));
        let p = plan::<f32, f32>(norm, MANY, 4096, res, true, DeviceLimits::A100).unwrap();
        assert_eq!(shape(p), (pipelined, 256, Grid::Resident));
    }
}

/// Launches of at most one row a multiprocessor over block-team rows of aligned packs that
/// fit 16 elements a rank on 512 ranks take the few-rows forward (x, gamma and beta loaded
/// together), a block a row; others, and one more row, the plans they took before.
#[test]
fn few_rows_forward_holds_16_columns_a_rank() {
    let h = DeviceLimits::H100;
    for limits in [h, DeviceLimits::A100] {
        let fwd = |rows| plan::<bf16, bf16>(Norm::Rms, rows, 4096, Pass::Forward, true, limits).unwrap();
        // 512 packs, 2 a rank.
        assert_eq!(
            (fwd(1).variant, fwd(1).threads, fwd(1).grid),
            (Variant::FwdFewRows, 256, Grid::EveryRow)
        );
        assert_eq!(fwd(limits.sm_count), fwd(1));
        assert_eq!(fwd(limits.sm_count + 1).variant, Variant::FwdPipelinedBlock);
    }
    // f32 N = 8192: 2048 packs, 4 a rank, the kernel's 512-thread bound.
    let p = plan::<f32, f32>(Norm::Layer, 64, 8192, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdFewRows, 512));
    // f16 beside f32 weights, N = 1032 (129 packs): 65 ranks, three warps.
    let p = plan::<f16, f32>(Norm::Layer, 3, 1032, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdFewRows, 96));
    // Past 512 ranks of 16 columns (f32 N = 8196), unaligned rows, and warp rows: as before.
    let p = plan::<f32, f32>(Norm::Layer, 64, 8196, Pass::Forward, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdPipelinedBlock, 1024));
    let p = plan::<f16, f16>(Norm::Layer, 3, 4097, Pass::Forward, false, h).unwrap();
    assert_eq!(p.variant, Variant::FwdBlock);
    let p = plan::<bf16, bf16>(Norm::Layer, 1, 1024, Pass::Forward, true, h).unwrap();
    assert_eq!(p.variant, Variant::FwdWidenedWarp);
    let p = plan::<bf16, bf16>(Norm::Rms, 1, 1024, Pass::Forward, true, h).unwrap();
    assert_eq!(p.variant, Variant::FwdPipelinedWarp);
}

/// LayerNorm's f16 and bf16 rows of aligned packs that a warp holds at 2 to 4 packs a lane
/// (N = 257-1024), with weights of their type or f32, take the widened warp kernel on sm_90,
/// a warp for every row (docs/PERF.md v43); rows of one pack a lane, longer and unaligned
/// rows, f32 rows, RMSNorm, the residual forward and sm_80 do not.
#[test]
fn widened_warp_rows() {
    let h = DeviceLimits::H100;
    let shape = |p: Plan| (p.variant, p.threads, p.grid);
    let widened = (Variant::FwdWidenedWarp, 256, Grid::EveryRow);
    let layer = |n, aligned, limits| plan::<bf16, bf16>(Norm::Layer, MANY, n, Pass::Forward, aligned, limits);
    for n in [264, 512, 768, 1024] {
        assert_eq!(shape(layer(n, true, h).unwrap()), widened, "n = {n}");
        let p = plan::<f16, f32>(Norm::Layer, MANY, n, Pass::Forward, true, h).unwrap();
        assert_eq!(shape(p), widened, "f16 with f32 weights, n = {n}");
    }
    let pipelined = (Variant::FwdPipelinedWarp, 256, Grid::Resident);
    assert_eq!(shape(layer(256, true, h).unwrap()), pipelined);
    assert_eq!(shape(layer(1024, true, DeviceLimits::A100).unwrap()), pipelined);
    assert_eq!(layer(1024, false, h).unwrap().variant, Variant::FwdWarp);
    assert_eq!(layer(1032, true, h).unwrap().variant, Variant::FwdPipelinedBlock);
    let p = plan::<bf16, bf16>(Norm::Rms, MANY, 1024, Pass::Forward, true, h).unwrap();
    assert_eq!(shape(p), pipelined);
    let p = plan::<f32, f32>(Norm::Layer, MANY, 512, Pass::Forward, true, h).unwrap();
    assert_eq!(shape(p), pipelined);
    let p = plan::<bf16, bf16>(Norm::Layer, MANY, 1024, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!(p.variant, Variant::FwdResidualPipelinedWarp);
}

/// The residual forward's rows of f32 (f32 x, or a stream in f32) of warp length with more
/// packs than a warp holds at `PIPE_HELD` a lane (N = 513-1024), all aligned, take the
/// pipelined block, 64 ranks (docs/PERF.md v44); shorter, unaligned and 16-bit rows, and
/// the plain forward's f32 rows, keep warps.
#[test]
fn residual_f32_rows_of_warp_length_take_block_teams() {
    let h = DeviceLimits::H100;
    let block = (Variant::FwdResidualPipelinedBlock, 64);
    for limits in [h, DeviceLimits::A100] {
        for n in [516, 768, 1024] {
            for norm in [Norm::Layer, Norm::Rms] {
                let p = plan::<f32, f32>(norm, MANY, n, Pass::ForwardResidual, true, limits).unwrap();
                assert_eq!((p.variant, p.threads), block, "f32 n = {n}");
                let p =
                    plan_f32_stream::<bf16, f32>(norm, MANY, n, Pass::ForwardResidual, true, limits).unwrap();
                assert_eq!((p.variant, p.threads), block, "stream in f32, n = {n}");
            }
        }
    }
    let residual =
        |n, aligned| plan::<f32, f32>(Norm::Layer, MANY, n, Pass::ForwardResidual, aligned, h).unwrap();
    assert_eq!(residual(512, true).variant, Variant::FwdResidualPipelinedWarp);
    assert_eq!(residual(1024, false).variant, Variant::FwdResidualWarp);
    let p = plan::<f16, f16>(Norm::Layer, MANY, 1024, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!(p.variant, Variant::FwdResidualPipelinedWarp);
    let p = plan::<f32, f32>(Norm::Layer, MANY, 1024, Pass::Forward, true, h).unwrap();
    assert_eq!(p.variant, Variant::FwdWarp);
}

/// The other passes' launches of at most one row a multiprocessor spread each block-team
/// row over a pack a rank, up to the kernel's thread limit, with no stacked teams; one more
/// row and the throughput plans come back.
#[test]
fn few_rows_take_a_pack_a_rank() {
    let h = DeviceLimits::H100;
    // The residual forward's bound is 512: f16 N = 8192 (1024 packs) at two a rank.
    let p = plan::<f16, f16>(Norm::Layer, 8, 8192, Pass::ForwardResidual, true, h).unwrap();
    assert_eq!((p.variant, p.threads), (Variant::FwdResidualPipelinedBlock, 512));
    let bwd = |rows| plan::<bf16, bf16>(Norm::Layer, rows, 4096, Pass::Backward, true, h).unwrap();
    assert_eq!(
        (bwd(1).variant, bwd(1).threads, bwd(1).stacked),
        (Variant::BwdHeldBlock, 512, 1)
    );
    assert_eq!(
        (bwd(h.sm_count + 1).threads, bwd(h.sm_count + 1).stacked),
        (128, 4)
    );
    // The A100 module's held kernels are bound at 384 threads: 512 packs on 384 ranks, one
    // or two each.
    let a = DeviceLimits::A100;
    let p = plan::<bf16, bf16>(Norm::Layer, 1, 4096, Pass::Backward, true, a).unwrap();
    assert_eq!((p.variant, p.threads, p.stacked), (Variant::BwdHeldBlock, 384, 1));
}

/// The backward's rows of warp length with more packs than a warp holds at 4 a lane (f32 N
/// = 513-1024, whole packs) take held block teams, not the owned warp kernel (docs/PERF.md
/// v37): 64 ranks of 4 packs stacked along y at many rows, a pack a rank at few; on both
/// architectures, and with the residual stream in f32 (rows of f32) too. Rows a warp holds
/// (f32 N = 512, f16 N = 1024) stay held warp rows; rows that are not whole packs stay on
/// the owned warp kernel.
#[test]
fn backward_warp_length_rows_past_a_held_warp_take_block_teams() {
    for limits in [DeviceLimits::A100, DeviceLimits::H100] {
        for n in [544, 768, 1024] {
            for pass in [Pass::Backward, Pass::BackwardResidual] {
                let p = plan_of::<f32, f32>(MANY, n, pass, limits);
                assert_eq!(
                    (p.variant, p.threads),
                    (Variant::BwdHeldBlock, 64),
                    "n = {n}: {p:?}"
                );
                assert!(p.stacked > 1, "n = {n}: {p:?}");
                let p = stream_plan_of::<bf16, bf16>(MANY, n, pass, limits);
                assert_eq!(
                    (p.variant, p.threads),
                    (Variant::BwdHeldBlock, 64),
                    "n = {n}: {p:?}"
                );
            }
            let p = plan_of::<f32, f32>(1, n, Pass::Backward, limits);
            assert_eq!(
                (p.variant, p.threads, p.stacked),
                (Variant::BwdHeldBlock, (n / 4).next_multiple_of(32), 1)
            );
        }
        assert_eq!(
            plan_of::<f32, f32>(MANY, 512, Pass::Backward, limits).variant,
            Variant::BwdHeldWarp
        );
        assert_eq!(
            plan_of::<f16, f16>(MANY, 1024, Pass::Backward, limits).variant,
            Variant::BwdHeldWarp
        );
        assert_eq!(
            plan_of::<f32, f32>(MANY, 1023, Pass::Backward, limits).variant,
            Variant::BwdOwnedWarp
        );
    }
}

const SM80: &str = include_str!("../kernels-gpu/layernorm_kernels.ptx");
const SM90: &str = include_str!("../kernels-gpu/layernorm_kernels_sm90.ptx");

/// Kernel name -> (.maxntid x, .reqnctapercluster x or 1), as the module declares them.
fn declared(ptx: &str) -> BTreeMap<String, (u32, u32)> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in ptx.lines() {
        if let Some(entry) = line.strip_prefix(".visible .entry ") {
            let name = entry.split('(').next().unwrap().to_string();
            out.insert(name.clone(), (0, 1));
            current = Some(name);
        }
        let Some(name) = &current else { continue };
        let first = |directive: &str| -> Option<u32> {
            let rest = line.strip_prefix(directive)?;
            rest.split(',').next()?.trim().parse().ok()
        };
        if let Some(n) = first(".maxntid ") {
            out.get_mut(name).unwrap().0 = n;
        }
        if let Some(c) = first(".reqnctapercluster ") {
            out.get_mut(name).unwrap().1 = c;
        }
    }
    out
}

fn expected(arch: Arch) -> BTreeMap<String, (u32, u32)> {
    layout::registry::kernels(layout_arch(arch))
        .map(|(norm, v, pair)| {
            let name = layout::registry::KernelName(norm, v, pair).to_string();
            (name, (v.max_threads(layout_arch(arch), pair), v.cluster()))
        })
        .collect()
}

#[test]
fn checked_in_modules_declare_the_registry() {
    for (arch, ptx) in [(Arch::Sm80, SM80), (Arch::Sm90, SM90)] {
        assert_eq!(declared(ptx), expected(arch), "{arch:?} module");
    }
}

#[test]
fn only_the_sm90_module_has_cluster_kernels() {
    let clusters = |ptx| declared(ptx).values().filter(|(_, c)| *c > 1).count();
    assert_eq!(clusters(SM80), 0);
    // The general cluster kernel over 8 blocks and the held ones over 2, 4 and 8, in all
    // nine type pairs (the four with the stream in f32 too), for each of the two norms; the
    // held ones in half packs over f16 and bf16 alone.
    assert_eq!(clusters(SM90), 72 + 3 * 2 * 2);
}

/// Kernel name -> the bytes of each parameter it declares: `.param .align A .b8 name[B]` (a
/// struct by value) is B, `.param .u32` is 4.
fn declared_params(ptx: &str) -> BTreeMap<String, Vec<usize>> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in ptx.lines() {
        if let Some(entry) = line.strip_prefix(".visible .entry ") {
            let name = entry.split('(').next().unwrap().to_string();
            out.insert(name.clone(), Vec::new());
            current = Some(name);
            continue;
        }
        let Some(name) = &current else { continue };
        let Some(param) = line.trim().strip_prefix(".param ") else {
            if line.starts_with(')') {
                current = None;
            }
            continue;
        };
        let bytes = if let Some(array) = param.split('[').nth(1) {
            array.split(']').next().unwrap().parse().unwrap()
        } else if param.starts_with(".u32") || param.starts_with(".f32") {
            4
        } else {
            panic!("{name}: a parameter this test does not know: {param}")
        };
        out.get_mut(name).unwrap().push(bytes);
    }
    out
}

/// Every part of both PTX modules that the host loads (a norm and type pair's kernels,
/// `registry::ptx_part`) holds the header and each of its kernels once, whole, and no other
/// kernel: what the driver then compiles (on a GPU, every test that launches).
#[test]
fn each_module_part_holds_its_kernels_whole() {
    use layout::registry::{FUNCTION_MARKER, KernelName, Norm, TYPE_PAIRS, kernels_of, ptx_part};
    for (arch, ptx) in [(Arch::Sm80, SM80), (Arch::Sm90, SM90)] {
        for norm in Norm::ALL {
            for pair in TYPE_PAIRS {
                let names: Vec<String> = kernels_of(layout_arch(arch), norm, pair)
                    .map(|(norm, v, pair)| KernelName(norm, v, pair).to_string())
                    .collect();
                let part = ptx_part(ptx, names.iter().map(String::as_str)).unwrap();
                assert!(part.contains(".address_size 64") && part.contains("dynamic_smem[]"));
                assert_eq!(
                    part.matches(".entry ").count(),
                    names.len(),
                    "{norm:?} {}",
                    pair.name
                );
                for name in &names {
                    assert_eq!(part.matches(&format!(".entry {name}(")).count(), 1, "{name}");
                    // The kernel's text ends where the next function's marker starts.
                    let whole = &ptx[ptx.find(&format!(".entry {name}(")).unwrap()..];
                    let end = whole.find(FUNCTION_MARKER).unwrap_or(whole.len());
                    assert!(part.contains(&whole[..end]), "{name} whole");
                }
            }
        }
    }
    assert_eq!(
        ptx_part(SM80, ["no_such_kernel"].into_iter()),
        Err("no_such_kernel")
    );
}

#[test]
fn checked_in_modules_take_the_parameter_structs() {
    for (arch, ptx) in [(Arch::Sm80, SM80), (Arch::Sm90, SM90)] {
        let expected: BTreeMap<String, Vec<usize>> = layout::registry::kernels(layout_arch(arch))
            .map(|(norm, v, pair)| {
                let name = layout::registry::KernelName(norm, v, pair).to_string();
                (name, layout::params::param_bytes(v).to_vec())
            })
            .collect();
        assert_eq!(declared_params(ptx), expected, "{arch:?} module");
    }
}

/// The layout module's own `Arch` for the public one (the same enum, compiled twice: once
/// in the library, once here for `param_bytes`).
fn layout_arch(arch: Arch) -> layout::registry::Arch {
    match arch {
        Arch::Sm80 => layout::registry::Arch::Sm80,
        Arch::Sm90 => layout::registry::Arch::Sm90,
    }
}

/// With the residual stream in f32, the residual passes plan rows of f32: on sm_80 the held
/// stage 1 within its 256-thread bound, and on sm_90 the cluster kernels for rows one block
/// cannot take, as f32 rows have them: slices held over 2 blocks at N = 12288 and 16384
/// (to 2048 packs a slice, 4 a rank on 512), 4 at N = 32768, 8 at N = 65536, and the
/// general cluster kernel for rows that are not whole packs (N = 12289) or whose slices do
/// not fit 4 packs a rank (N = 131072); at N = 262144 an eighth of the row's partials passes
/// shared memory, and the owned block kernel sums in global memory. The f32 rows take dsum in the held cluster
/// kernels, so a residual backward plans as a plain one. The forward stages rows too long to
/// hold where shared memory has room for the f32 rows' packs twice (x's 8-byte packs take
/// 16-byte slots): on sm_90 N = 32768 (8192 packs, 2048 of them held on 512 threads, 6144
/// staged twice: 192 KB past the scratch), not N = 65536 (384 KB); on sm_80 neither (163 KB).
#[test]
fn f32_stream_plans() {
    for limits in [DeviceLimits::A100, DeviceLimits::H100] {
        for n in [
            1, 1024, 4096, 8192, 12288, 12289, 16384, 32768, 65536, 131072, 262144,
        ] {
            for pass in [Pass::ForwardResidual, Pass::Backward, Pass::BackwardResidual] {
                let p = stream_plan_of::<bf16, f32>(MANY, n, pass, limits);
                if pass == Pass::ForwardResidual {
                    // Past 4096 f32 packs (512 ranks at 8), the streamed kernel, which
                    // stages nothing; on sm_90 also rows not whole packs (N = 12289).
                    let unaligned = limits.arch == Arch::Sm90 && !n.is_multiple_of(4) && n > 1024;
                    let streamed = n > 16384 || unaligned;
                    assert_eq!(p.smem, 512, "n = {n}, {limits:?}: {p:?}");
                    assert_eq!(
                        p.variant == Variant::FwdResidualStreamed,
                        streamed,
                        "n = {n}: {p:?}"
                    );
                    continue;
                }
                let cluster = match (limits.arch, n) {
                    (Arch::Sm90, 12288 | 16384) => Some(Variant::BwdCluster2Held),
                    (Arch::Sm90, 32768) => Some(Variant::BwdCluster4Held),
                    (Arch::Sm90, 65536) => Some(Variant::BwdCluster8Held),
                    (Arch::Sm90, 12289 | 131072) => Some(Variant::BwdCluster8),
                    _ => None,
                };
                match cluster {
                    Some(v) => assert_eq!(p.variant, v, "n = {n}, {pass:?}: {p:?}"),
                    None => assert_eq!(p.variant.cluster(), 1, "n = {n}, {pass:?}: {p:?}"),
                }
                if limits.arch == Arch::Sm80
                    && matches!(p.variant, Variant::BwdHeldWarp | Variant::BwdHeldBlock)
                {
                    assert!(p.threads * p.stacked <= 256, "n = {n}: {p:?}");
                }
            }
        }
    }
    // One row, a pack a rank on at most 512 threads (tests/residual.rs's forward paths):
    // held at N = 16384 (4096 packs, 8 a rank), staged at N = 20000 (5000 packs, 2048 held).
    let fwd = |n| stream_plan_of::<bf16, f32>(1, n, Pass::ForwardResidual, DeviceLimits::H100);
    for (n, smem) in [(16384, 512), (20000, 512 + 2 * (5000 - 2048) * 16), (65536, 512)] {
        assert_eq!(
            (fwd(n).variant, fwd(n).threads, fwd(n).smem),
            (Variant::FwdResidualBlock, 512, smem)
        );
    }
    // f16 N = 4096 in f32 rows: 1024 packs, four a rank on 256 ranks, held.
    let p = stream_plan_of::<f16, f16>(MANY, 4096, Pass::Backward, DeviceLimits::H100);
    assert_eq!((p.variant, p.threads), (Variant::BwdHeldBlock, 256));
    // Plain forwards of these types are x's own.
    assert_eq!(
        stream_plan_of::<f16, f16>(MANY, 4096, Pass::Forward, DeviceLimits::H100),
        plan_of::<f16, f16>(MANY, 4096, Pass::Forward, DeviceLimits::H100)
    );
}

/// The host launches stage 2 as stage 1's programmatic dependent on sm_90 (gpu/launch.rs,
/// `launch_dependent`), which is sound only if stage 2 waits for stage 1 before it touches
/// global memory: in the sm_90 module every stage 2 kernel runs `griddepcontrol.wait` before
/// its first global load, store or atomic, and every stage 1 kernel signals
/// (`launch_dependents`), without which stage 2 would start only as stage 1's blocks end.
/// No forward kernel and nothing in the sm_80 module (which has no such instruction) does
/// either.
#[test]
fn stage2_waits_for_stage1_in_the_sm90_module() {
    let touches_global = |line: &str| {
        let op = line.trim_start();
        [
            "ld.global",
            "st.global",
            "atom.global",
            "red.global",
            "cp.async",
            "ld.volatile.global",
        ]
        .iter()
        .any(|prefix| op.starts_with(prefix))
    };
    use layout::registry::Variant as V;
    for (arch, ptx) in [(Arch::Sm80, SM80), (Arch::Sm90, SM90)] {
        for (norm, v, pair) in layout::registry::kernels(layout_arch(arch)) {
            let name = layout::registry::KernelName(norm, v, pair).to_string();
            // The module's header (no instructions) and this kernel's text.
            let body = layout::registry::ptx_part(ptx, std::iter::once(name.as_str())).unwrap();
            let waits = body.find("griddepcontrol.wait;");
            let signals = body.contains("griddepcontrol.launch_dependents;");
            let stage1 = v.cluster() > 1
                || matches!(
                    v,
                    V::BwdOwnedWarp
                        | V::BwdOwnedBlock
                        | V::BwdHeldWarp
                        | V::BwdHeldBlock
                        | V::BwdHeldBlockHalves
                        | V::BwdHeldBlockShifted
                );
            match (arch, v) {
                (Arch::Sm90, V::BwdReduce) => {
                    let wait = waits.unwrap_or_else(|| panic!("{name} does not wait"));
                    let (mut at, mut first_global) = (0, None);
                    for line in body.lines() {
                        if touches_global(line) {
                            first_global = Some(line);
                            break;
                        }
                        at += line.len() + 1;
                    }
                    let line = first_global.unwrap_or_else(|| panic!("{name}: no global access"));
                    assert!(
                        wait < at,
                        "{name} reaches `{}` before griddepcontrol.wait",
                        line.trim()
                    );
                    assert!(!signals, "{name}");
                }
                (Arch::Sm90, _) => {
                    assert_eq!(signals, stage1, "{name}: launch_dependents");
                    assert!(waits.is_none(), "{name} waits");
                }
                (Arch::Sm80, _) => assert!(!body.contains("griddepcontrol"), "{name}"),
            }
        }
    }
}
