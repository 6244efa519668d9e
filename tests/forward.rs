//! Forward against the float64 reference, on the CPU path and (where there is one) the GPU.

mod common;

use common::{
    Rng, SHAPES, gpu_or_skip, mixed_matrix, poisoned, random_matrix, random_vec, rel_err, to_f64, tolerance,
};
use layernorm_cuda::{Device, Element, LayerNorm, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array2, ArrayView1};

/// Runs one forward on `device`, with y and the statistics compared to the reference.
fn check_forward<T: Element>(device: &Device, rows: usize, n: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let x = mixed_matrix::<T>(&mut rng, rows, n);
    let gamma = random_vec::<T>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<T>(&mut rng, n, 0.0, 0.5);
    let eps = 1e-5f32;
    let ln = LayerNorm::from_arrays(device, gamma.view(), beta.view(), eps).unwrap();
    let mut y = poisoned::<T>(device, &[rows, n]);
    let ctx = ln
        .forward_into(&device.upload(x.view()).unwrap(), &mut y)
        .unwrap();

    let (ry, rmean, rrstd) = reference::forward(
        to_f64(x.view()).view(),
        to_f64(gamma.view()).view(),
        to_f64(beta.view()).view(),
        eps as f64,
    );
    let err_y = rel_err(y.to_array2().unwrap().view(), ry.view());
    let err_mean = rel_err(ctx.mean().to_array1().unwrap().view(), rmean.view());
    let err_rstd = rel_err(ctx.rstd().to_array1().unwrap().view(), rrstd.view());
    let what = format!("{} forward {} [{rows}, {n}] seed {seed}", device.name(), T::NAME);
    eprintln!("{what}: y {err_y:.2e} mean {err_mean:.2e} rstd {err_rstd:.2e}");
    assert!(
        err_y <= tolerance::<T>(),
        "{what}: y error {err_y:e} > {:e}",
        tolerance::<T>()
    );
    // Statistics are f32 whatever the storage type.
    assert!(err_mean <= 1e-5, "{what}: mean error {err_mean:e}");
    assert!(err_rstd <= 1e-5, "{what}: rstd error {err_rstd:e}");
}

fn check_all_shapes<T: Element>(device: &Device, seed: u64) {
    for (i, &(rows, n)) in SHAPES.iter().enumerate() {
        check_forward::<T>(device, rows, n, seed + i as u64);
    }
}

#[test]
fn cpu_forward_matches_reference() {
    let cpu = Device::cpu();
    check_all_shapes::<f32>(&cpu, 100);
    check_all_shapes::<f16>(&cpu, 200);
    check_all_shapes::<bf16>(&cpu, 300);
}

#[test]
fn gpu_forward_matches_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all_shapes::<f32>(&gpu, 100);
    check_all_shapes::<f16>(&gpu, 200);
    check_all_shapes::<bf16>(&gpu, 300);
}

/// Many rows per team: the grid is smaller than the row count, so teams loop.
#[test]
fn gpu_forward_many_rows() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (i, &(rows, n)) in [(20000, 64), (4096, 1024), (3000, 2048), (1500, 8200)]
        .iter()
        .enumerate()
    {
        check_forward::<f16>(&gpu, rows, n, 400 + i as u64);
        check_forward::<f32>(&gpu, rows, n, 500 + i as u64);
    }
    // LayerNorm's f32 rows of more than 2048 packs (n = 8200 above too), whose pipelined
    // block teams hold 6 packs a rank and stage the next row: many rows a team at n =
    // 12288 and 24576 (the longest such row), and a launch of few rows (1024 ranks of about 5).
    for (i, &(rows, n)) in [(600, 12288), (300, 24576), (3, 20000)].iter().enumerate() {
        check_forward::<f32>(&gpu, rows, n, 510 + i as u64);
    }
}

/// Rows not all 16-byte aligned over more rows than multiprocessors, x and y whole tensors
/// (every row of y as far past a 16-byte boundary as x's): on sm_90 the held forward over
/// shifted rows, 4 packs a rank from the first boundary, the edge columns one by one (256
/// ranks at f32 N = 4097, 128 at f16 4100, 512 at bf16 16388 and f16 16383, 64 at bf16
/// 2051); f32 1030 there, and every row on sm_80, block teams of 32 elements a rank or more
/// (`plan`'s four read batches a rank: 64 ranks at N = 1030, 128 at 4097, 512 at 16388),
/// each rank's batches of 8 elements and its last, short batch (tests/views.rs runs those
/// over many rows on sm_90 too).
#[test]
fn gpu_forward_unaligned_rows_many() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_forward::<f32>(&gpu, 400, 1030, 540);
    check_forward::<f32>(&gpu, 300, 4097, 541);
    check_forward::<f16>(&gpu, 301, 4100, 542);
    check_forward::<bf16>(&gpu, 200, 16388, 543);
    check_forward::<f16>(&gpu, 200, 16383, 544);
    check_forward::<bf16>(&gpu, 300, 2051, 545);
}

/// Rows whose mean is 4000 times their spread, every one (`mixed_matrix` offsets one row in
/// seven by 1000): each row's rstd within 1e-6 of the reference (1e-5 norm-wise elsewhere),
/// on the CPU path and on every path of the GPU forward's streamed statistics, whose Chan
/// merges take each chunk less the row's first value. A float32 model of the merges about 0
/// put single elements' merges on a warp at up to 2e-5 and a block's elements at 1e-5
/// (docs/PERF.md v61). Warp rows element by element (N = 999), block rows in half packs
/// beside packs (f16 4100, f32 4098, bf16 16388) and elements (f32 4097), which sm_90 holds
/// from their first boundary (x and y sit alike), and so streams only where x is a view at
/// an offset y does not share (f16 4100 at 4, f32 4097 at 1), aligned rows
/// streamed in packs (f32 131072, f16 262144: too long to hold or stage); and with a
/// residual added (the row normalized is s = x + residual, its pivot x's and the
/// residual's first values summed): the general kernel's elements (N = 999, and 4097 on
/// sm_80; sm_90 holds those rows as shifted) and
/// streamed packs (f32 131072 over few rows), and the streamed residual kernel (f32 16388,
/// f16 32776 over more rows than multiprocessors).
#[test]
fn forward_offset_rows_keep_their_digits() {
    let mut devices = vec![Device::cpu()];
    devices.extend(gpu_or_skip());
    // `x_at`: x a view at that element offset of a larger buffer (y a whole tensor).
    fn check<T: Element>(device: &Device, rows: usize, n: usize, seed: u64, residual: bool, x_at: usize) {
        let mut rng = Rng::new(seed);
        let mut x = Array2::from_elem((rows, n), T::from_f32(0.0));
        for mut row in x.rows_mut() {
            // Spread 1 to 10, mean 4000 times it: f16's largest values about 40000.
            let scale = 10f64.powf(rng.uniform());
            for v in row.iter_mut() {
                *v = T::from_f32((scale * (4000.0 + rng.normal())) as f32);
            }
        }
        let gamma = random_vec::<T>(&mut rng, n, 1.0, 0.5);
        let beta = random_vec::<T>(&mut rng, n, 0.0, 0.5);
        let ln = LayerNorm::from_arrays(device, gamma.view(), beta.view(), 1e-5).unwrap();
        let x_d = if x_at == 0 {
            device.upload(x.view()).unwrap()
        } else {
            let mut buffer = vec![T::from_f32(0.0); x_at + rows * n];
            for (slot, &v) in buffer[x_at..].iter_mut().zip(x.iter()) {
                *slot = v;
            }
            let storage = device.upload(ArrayView1::from(&buffer)).unwrap();
            storage.view(x_at, &[rows, n]).unwrap()
        };
        let (normalized, ctx) = if residual {
            let r = device
                .upload(random_matrix::<T>(&mut rng, rows, n).view())
                .unwrap();
            let (_, sum, ctx) = ln.forward_residual(&x_d, &r).unwrap();
            (sum.to_array2().unwrap(), ctx)
        } else {
            let mut y = poisoned::<T>(device, &[rows, n]);
            (x, ln.forward_into(&x_d, &mut y).unwrap())
        };
        let (_, _, reference_rstd) = reference::forward(
            to_f64(normalized.view()).view(),
            to_f64(gamma.view()).view(),
            to_f64(beta.view()).view(),
            1e-5,
        );
        let rstd = ctx.rstd().to_array1().unwrap();
        let worst = rstd
            .iter()
            .zip(reference_rstd.iter())
            .map(|(&r, &reference)| (r as f64 - reference).abs() / reference)
            .fold(0.0, f64::max);
        let what = format!(
            "{} forward {} [{rows}, {n}], residual {residual}, x at {x_at}",
            device.name(),
            T::NAME
        );
        assert!(
            worst <= 1e-6,
            "{what}: a row's rstd off by {worst:e} of the reference"
        );
    }
    for device in &devices {
        check::<bf16>(device, 300, 999, 570, false, 0);
        check::<f32>(device, 300, 999, 571, false, 0);
        check::<f16>(device, 300, 4100, 572, false, 0);
        check::<f32>(device, 300, 4098, 573, false, 0);
        check::<f32>(device, 300, 4097, 574, false, 0);
        check::<bf16>(device, 300, 16388, 575, false, 0);
        check::<f16>(device, 300, 4100, 583, false, 4);
        check::<f32>(device, 300, 4097, 584, false, 1);
        check::<f32>(device, 8, 131072, 576, false, 0);
        check::<f16>(device, 8, 262144, 577, false, 0);
        check::<bf16>(device, 300, 999, 578, true, 0);
        check::<f32>(device, 300, 4097, 579, true, 0);
        check::<f32>(device, 140, 16388, 580, true, 0);
        check::<f16>(device, 140, 32776, 581, true, 0);
        check::<f32>(device, 8, 131072, 582, true, 0);
    }
}

/// Rows 8-byte aligned but not 16 read in half packs (`row::HALF_PACKS`), the other rows of
/// the same launch in packs or elements: f16/bf16 rows of a multiple of 4 columns (every
/// other row 16-byte aligned), f32 of a multiple of 2 (N = 1030, 4098; 4097's rows are
/// 8-byte aligned one in two, the others element by element); a tail past the last whole
/// half pack (f32 4097, f16 4102); warp and block teams, few rows and many (on sm_90 the
/// many rows of bf16 1028 and f32 4098, whose x and y sit alike, take the held forward over
/// shifted rows instead; tests/views.rs runs half packs over many rows there).
#[test]
fn gpu_forward_half_packs() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_forward::<f16>(&gpu, 7, 4100, 550);
    check_forward::<f16>(&gpu, 9, 4102, 551);
    check_forward::<bf16>(&gpu, 303, 1028, 552);
    check_forward::<f16>(&gpu, 40, 516, 553);
    check_forward::<f32>(&gpu, 5, 1030, 554);
    check_forward::<f32>(&gpu, 301, 4098, 555);
    check_forward::<f32>(&gpu, 33, 4097, 556);
    check_forward::<f32>(&gpu, 64, 66, 557);
}

/// A team for every row (`plan::Grid::EveryRow`): pipelined teams of 256 ranks (f16 and
/// bf16 N = 8192, f32 4096), each block one row;
/// on sm_90, the widened warp kernel over LayerNorm's 16-bit rows of 2 to 4 packs a lane,
/// each warp one row (N = 264: 33 packs, two in lane 0 and one in the others; 768: three
/// a lane).
#[test]
fn gpu_forward_grid_of_every_row() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_forward::<f16>(&gpu, 300, 8192, 520);
    check_forward::<bf16>(&gpu, 301, 8192, 521);
    check_forward::<f32>(&gpu, 302, 4096, 522);
    check_forward::<bf16>(&gpu, 3001, 264, 524);
    check_forward::<f16>(&gpu, 2003, 768, 525);
}

/// The row block (`plan::Variant::FwdRowBlock`: a block for every row, holding its row
/// only), which sm_90 takes where its last wave is nearly full (132 multiprocessors, whole
/// waves here): f16 rows of 384 ranks (4 blocks a multiprocessor), bf16 of 192 (8), f32 of
/// 384 (4) and 768 (2); and rows of 2048 packs on 512 ranks (3) whatever the last wave
/// (f32 N = 8192 over 303 rows: one wave, 23% empty).
#[test]
fn gpu_forward_row_block() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_forward::<f16>(&gpu, 528, 12288, 530);
    check_forward::<bf16>(&gpu, 1056, 6144, 531);
    check_forward::<f32>(&gpu, 528, 6144, 532);
    check_forward::<f32>(&gpu, 264, 12288, 533);
    check_forward::<f32>(&gpu, 303, 8192, 523);
}

/// Aligned rows longer than one block holds in registers (more than 8 packs a thread of
/// 1024: f32 rows past 32768, f16/bf16 past 65536), which hold 4 packs a thread and stage
/// the rest in shared memory; past the staging's room (227 KB on an H100: f32 rows past
/// about 74000, f16 past 148000) they stream. Many rows and few.
#[test]
fn gpu_forward_long_aligned_rows() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (i, &(rows, n)) in [(300, 65536), (3, 40000), (50, 40000), (20, 100000)]
        .iter()
        .enumerate()
    {
        check_forward::<f32>(&gpu, rows, n, 600 + i as u64);
    }
    check_forward::<f16>(&gpu, 40, 131072, 610);
    check_forward::<f16>(&gpu, 5, 262144, 612);
    check_forward::<bf16>(&gpu, 9, 98304, 611);
}

/// The GPU and the CPU path agree with each other, not only each with the reference.
#[test]
fn gpu_forward_agrees_with_cpu_path() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mut rng = Rng::new(600);
    let (rows, n) = (37, 5000);
    let x = mixed_matrix::<f32>(&mut rng, rows, n);
    let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<f32>(&mut rng, n, 0.0, 0.5);
    let run = |d: &Device| {
        let ln = LayerNorm::from_arrays(d, gamma.view(), beta.view(), 1e-5).unwrap();
        ln.forward(&d.upload(x.view()).unwrap())
            .unwrap()
            .0
            .to_array2()
            .unwrap()
    };
    let (on_gpu, on_cpu) = (run(&gpu), run(&Device::cpu()));
    // Both are f32 computations, each within the f32 tolerance of the reference.
    let err = rel_err(on_gpu.view(), to_f64(on_cpu.view()).view());
    assert!(err <= tolerance::<f32>(), "GPU vs CPU path: {err:e}");
}

/// y narrowed to f16 and bf16 rounds to nearest, ties to even, as `half`'s scalar
/// conversion does. Rows alternate 1 and -1, so mean = 0 and var = 1; with eps = 1e-30 (lost
/// in 1 + eps) rstd = 1 and xhat = ±1 exactly, so y = ±1 + beta exactly in f32. Betas of
/// ulp/2 and 3 ulp/2 (ulp: T's spacing above 1) put y on ties that round one way down and one
/// way up; row lengths of 16 and 22 put them in the conversions' 8-wide body and scalar tail.
fn check_ties_to_even<T: Element>(device: &Device, ulp: f32) {
    let offsets = [0.5f32, 1.5, -0.5, 0.25].map(|k| k * ulp);
    // The test has teeth: the first two are ties, one rounding down and one up.
    assert_eq!(T::from_f32(1.0 + offsets[0]).to_f32(), 1.0);
    assert_eq!(T::from_f32(1.0 + offsets[1]).to_f32(), 1.0 + 2.0 * ulp);
    for n in [16usize, 22] {
        let rows = 3;
        let sign = |j: usize| if j.is_multiple_of(2) { 1.0f32 } else { -1.0 };
        let x = ndarray::Array2::from_shape_fn((rows, n), |(_, j)| T::from_f32(sign(j)));
        let beta = ndarray::Array1::from_shape_fn(n, |j| T::from_f32(offsets[(j / 2) % 4]));
        let gamma = ndarray::Array1::from_elem(n, T::from_f32(1.0));
        let ln = LayerNorm::from_arrays(device, gamma.view(), beta.view(), 1e-30).unwrap();
        let (y, _) = ln.forward(&device.upload(x.view()).unwrap()).unwrap();
        for ((i, j), &v) in y.to_array2().unwrap().indexed_iter() {
            let exact = sign(j) + offsets[(j / 2) % 4];
            assert_eq!(
                v.to_f32(),
                T::from_f32(exact).to_f32(),
                "{} {} [{rows}, {n}] y[{i}, {j}] = {exact} rounded",
                device.name(),
                T::NAME
            );
        }
    }
}

#[test]
fn cpu_forward_rounds_ties_to_even() {
    let cpu = Device::cpu();
    check_ties_to_even::<f16>(&cpu, f16::EPSILON.to_f32());
    check_ties_to_even::<bf16>(&cpu, bf16::EPSILON.to_f32());
}
