//! Non-finite inputs, values at the edges of the storage types, constant rows, and two
//! host threads sharing one GPU.

mod common;

use common::{Rng, gpu_or_skip, mixed_matrix, random_matrix, random_vec, rel_err, to_f64, tolerance};
use layernorm_cuda::{BackwardMode, Device, Element, LayerNorm, Tensor, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array1, Array2, s};

fn devices() -> Vec<Device> {
    let mut d = vec![Device::cpu()];
    d.extend(gpu_or_skip());
    d
}

fn op<T: Element>(device: &Device, gamma: &Array1<T>, beta: &Array1<T>) -> LayerNorm<T> {
    LayerNorm::from_arrays(device, gamma.view(), beta.view(), 1e-5).unwrap()
}

/// A NaN or an infinity makes its own row's y and dx NaN, as in PyTorch, and leaves every
/// other row exactly as it would be without it. dgamma and dbeta sum over all rows, so they
/// are NaN too.
fn check_non_finite_rows<T: Element>(device: &Device, n: usize) {
    let mut rng = Rng::new(70);
    let rows = 6;
    let mut x = mixed_matrix::<T>(&mut rng, rows, n);
    let clean = x.clone();
    x[[1, n / 2]] = T::from_f32(f32::NAN);
    x[[4, 0]] = T::from_f32(f32::INFINITY);
    let dy = random_matrix::<T>(&mut rng, rows, n);
    let (gamma, beta) = (
        random_vec::<T>(&mut rng, n, 1.0, 0.5),
        random_vec::<T>(&mut rng, n, 0.0, 0.5),
    );
    let ln = op(device, &gamma, &beta);
    let run = |x: &Array2<T>| {
        let (y, ctx) = ln.forward(&device.upload(x.view()).unwrap()).unwrap();
        let g = ln.backward(&ctx, &device.upload(dy.view()).unwrap()).unwrap();
        (
            y.to_array2().unwrap(),
            g.dx.to_array2().unwrap(),
            g.dgamma.as_ref().unwrap().to_array1().unwrap(),
        )
    };
    let ((y, dx, dgamma), (y_clean, dx_clean, _)) = (run(&x), run(&clean));
    let what = format!("{} {} n = {n}", device.name(), T::NAME);
    for r in 0..rows {
        let bad = r == 1 || r == 4;
        for (name, out, out_clean) in [("y", &y, &y_clean), ("dx", &dx, &dx_clean)] {
            let row = out.slice(s![r, ..]);
            if bad {
                assert!(
                    row.iter().all(|v| v.to_f32().is_nan()),
                    "{what}: {name} row {r} should be NaN"
                );
            } else {
                let same = row
                    .iter()
                    .zip(out_clean.slice(s![r, ..]))
                    .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                assert!(same, "{what}: {name} row {r} changed by another row's NaN");
            }
        }
    }
    assert!(
        dgamma.iter().all(|v| v.to_f32().is_nan()),
        "{what}: dgamma should be NaN"
    );
}

#[test]
fn non_finite_values_stay_in_their_row() {
    for device in devices() {
        for n in [7, 1000, 4096] {
            check_non_finite_rows::<f32>(&device, n);
            check_non_finite_rows::<f16>(&device, n);
        }
    }
}

/// Rows at the edges of f16: near its largest value (65504), in its subnormal range, and
/// constant (var = 0, so y = beta exactly). All finite and within tolerance.
#[test]
fn extreme_and_constant_rows_are_finite_and_correct() {
    for device in devices() {
        let n = 2048;
        let mut rng = Rng::new(71);
        let x = Array2::from_shape_fn((4, n), |(i, j)| {
            let v = match i {
                0 => 60000.0 * if j % 2 == 0 { 1.0 } else { -1.0 } + 100.0 * rng.uniform(),
                1 => 65000.0 - 1000.0 * rng.uniform().abs(),
                2 => 5e-7 * rng.uniform(),
                _ => 3.25,
            };
            f16::from_f32(v as f32)
        });
        let (gamma, beta) = (
            random_vec::<f16>(&mut rng, n, 1.0, 0.5),
            random_vec::<f16>(&mut rng, n, 0.0, 0.5),
        );
        let (y, ctx) = op(&device, &gamma, &beta)
            .forward(&device.upload(x.view()).unwrap())
            .unwrap();
        let y = y.to_array2().unwrap();
        let (ry, _, _) = reference::forward(
            to_f64(x.view()).view(),
            to_f64(gamma.view()).view(),
            to_f64(beta.view()).view(),
            1e-5f32 as f64,
        );
        let what = device.name();
        assert!(
            y.iter().all(|v| v.to_f32().is_finite()),
            "{what}: non-finite output"
        );
        for r in 0..3 {
            let err = rel_err(y.slice(s![r, ..]), ry.slice(s![r, ..]));
            assert!(err <= tolerance::<f16>(), "{what}: row {r} error {err:e}");
        }
        assert_eq!(y.slice(s![3, ..]), beta, "{what}: a constant row must give beta");
        assert!(ctx.rstd().to_vec().unwrap().iter().all(|r| r.is_finite()));
    }
}

/// Two host threads, each with a stream of its own on one GPU, run forward and backward at
/// the same time on different data; each gets its own correct result.
#[test]
fn two_streams_on_one_gpu_run_concurrently() {
    let Some(gpu) = gpu_or_skip() else { return };
    std::thread::scope(|scope| {
        for t in 0..2u64 {
            let device = gpu.with_new_stream().unwrap();
            scope.spawn(move || {
                let mut rng = Rng::new(80 + t);
                let (rows, n) = (512 + 256 * t as usize, 3000);
                let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
                let beta = random_vec::<f32>(&mut rng, n, 0.0, 0.5);
                let ln = op(&device, &gamma, &beta);
                for round in 0..plain_or_sanitized(20, 2) {
                    let x = mixed_matrix::<f32>(&mut rng, rows, n);
                    let dy = random_matrix::<f32>(&mut rng, rows, n);
                    let (y, ctx) = ln.forward(&device.upload(x.view()).unwrap()).unwrap();
                    let g = ln.backward(&ctx, &device.upload(dy.view()).unwrap()).unwrap();
                    let (ry, _, _) = reference::forward(
                        to_f64(x.view()).view(),
                        to_f64(gamma.view()).view(),
                        to_f64(beta.view()).view(),
                        1e-5f32 as f64,
                    );
                    let (rdx, rdg, _) = reference::backward(
                        to_f64(x.view()).view(),
                        to_f64(dy.view()).view(),
                        to_f64(gamma.view()).view(),
                        1e-5f32 as f64,
                    );
                    let tol = 2.0 * tolerance::<f32>();
                    assert!(
                        rel_err(y.to_array2().unwrap().view(), ry.view()) <= tol,
                        "thread {t} round {round}: y"
                    );
                    assert!(
                        rel_err(g.dx.to_array2().unwrap().view(), rdx.view()) <= tol,
                        "thread {t} round {round}: dx"
                    );
                    assert!(
                        rel_err(g.dgamma.as_ref().unwrap().to_array1().unwrap().view(), rdg.view()) <= tol,
                        "thread {t} round {round}: dgamma"
                    );
                }
            });
        }
    });
}

/// Tensors may move between handles of one GPU, whose streams run concurrently (each
/// tensor's memory orders its uses, README "Guarantees"). Phase 1: stream A is kept busy,
/// then writes y1; B reads y1 at once, so B must wait for A. Phase 2: B is kept busy, then
/// writes z, a tensor of A's, and A copies z to the host at once, so A must wait for B. Every
/// tensor is allocated before the busy work (an upload waits for its stream). Without
/// either wait, B reads y1 before it exists or A copies the NaN poison z starts with.
#[test]
fn tensors_move_between_streams_in_order() {
    let Some(gpu) = gpu_or_skip() else { return };
    let (a, b) = (gpu.with_new_stream().unwrap(), gpu.with_new_stream().unwrap());
    let mut rng = Rng::new(90);
    let (rows, n) = (plain_or_sanitized(2048, 256), 4096);
    let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<f32>(&mut rng, n, 0.0, 0.5);
    let (ln_a, ln_b) = (op(&a, &gamma, &beta), op(&b, &gamma, &beta));
    let x = mixed_matrix::<f32>(&mut rng, rows, n);
    let x_a = a.upload(x.view()).unwrap();
    let mut y1 = common::poisoned::<f32>(&a, &[rows, n]);
    let mut z1 = common::poisoned::<f32>(&b, &[rows, n]);
    let mut z2 = common::poisoned::<f32>(&a, &[rows, n]);
    let busy_in = random_matrix::<f32>(&mut rng, 4 * rows, n);
    let (busy_a, busy_b) = (
        a.upload(busy_in.view()).unwrap(),
        b.upload(busy_in.view()).unwrap(),
    );
    let (mut busy_out_a, mut busy_out_b) = (
        a.zeros::<f32>(busy_a.shape()).unwrap(),
        b.zeros::<f32>(busy_b.shape()).unwrap(),
    );
    // Some milliseconds of work on one stream.
    let keep_busy = |ln: &LayerNorm<f32>, input: &Tensor<f32>, out: &mut Tensor<f32>| {
        for _ in 0..plain_or_sanitized(30, 2) {
            ln.forward_into(input, out).unwrap();
        }
    };

    keep_busy(&ln_a, &busy_a, &mut busy_out_a);
    ln_a.forward_into(&x_a, &mut y1).unwrap();
    ln_b.forward_into(&y1, &mut z1).unwrap();
    let z1 = z1.to_array2().unwrap();

    keep_busy(&ln_b, &busy_b, &mut busy_out_b);
    ln_b.forward_into(&y1, &mut z2).unwrap();
    let z2 = z2.to_array2().unwrap();

    let (g64, b64) = (to_f64(gamma.view()), to_f64(beta.view()));
    let (ry1, _, _) = reference::forward(to_f64(x.view()).view(), g64.view(), b64.view(), 1e-5f32 as f64);
    let (rz, _, _) = reference::forward(ry1.view(), g64.view(), b64.view(), 1e-5f32 as f64);
    for (what, z) in [("phase 1 (B waits for A)", z1), ("phase 2 (A waits for B)", z2)] {
        let err = rel_err(z.view(), rz.view());
        assert!(err <= 2.0 * tolerance::<f32>(), "{what}: error {err:e}");
    }
}

/// Queues tens of milliseconds of work on `device`'s stream and returns without waiting
/// for it: forwards over 256 MB of f32, each about 0.15 to 0.2 ms at an H200's or H100's
/// bandwidth (smaller under compute-sanitizer, see [`plain_or_sanitized`]).
fn queue_long_work(device: &Device) {
    let (rows, n) = (plain_or_sanitized(8192, 256), 8192);
    let zeros = |shape: &[usize]| device.zeros::<f32>(shape).unwrap();
    let ln = LayerNorm::new(zeros(&[n]), zeros(&[n]), 1e-5).unwrap();
    let (x, mut y) = (zeros(&[rows, n]), zeros(&[rows, n]));
    for _ in 0..plain_or_sanitized(200, 2) {
        ln.forward_into(&x, &mut y).unwrap();
    }
}

/// `plain` in an ordinary run, `sanitized` under compute-sanitizer. The stream tests size
/// their busy work to keep a stream occupied for tens of milliseconds; the sanitizer makes
/// each kernel hundreds of times slower (the plain sizes took over 250 s of racecheck on an
/// H200, 2026-11-23), and a run under it checks memory use, not timing-dependent ordering,
/// which the plain run shows. The small sizes still take every path of these tests.
fn plain_or_sanitized(plain: usize, sanitized: usize) -> usize {
    if common::under_compute_sanitizer() {
        sanitized
    } else {
        plain
    }
}

/// Three handles on one GPU, each with a stream of its own and an op (the same gamma and
/// beta on each), a tensor t made on C, and t's forward as one stream computes it.
struct ThreeStreams {
    a: Device,
    c: Device,
    ln_a: LayerNorm<f32>,
    ln_b: LayerNorm<f32>,
    ln_c: LayerNorm<f32>,
    t: Tensor<f32>,
    t_forward: Array2<f32>,
    /// Other values of t's shape.
    other: Array2<f32>,
}

fn three_streams() -> Option<ThreeStreams> {
    let gpu = gpu_or_skip()?;
    let [a, b, c] = [(); 3].map(|_| gpu.with_new_stream().unwrap());
    let mut rng = Rng::new(91);
    let (rows, n) = (plain_or_sanitized(2048, 256), 2048);
    let gamma = random_vec::<f32>(&mut rng, n, 1.0, 0.5);
    let beta = random_vec::<f32>(&mut rng, n, 0.0, 0.5);
    let [ln_a, ln_b, ln_c] = [&a, &b, &c].map(|d| op(d, &gamma, &beta));
    let t = c.upload(mixed_matrix::<f32>(&mut rng, rows, n).view()).unwrap();
    let t_forward = ln_c.forward(&t).unwrap().0.to_array2().unwrap();
    let other = mixed_matrix::<f32>(&mut rng, rows, n);
    Some(ThreeStreams {
        a,
        c,
        ln_a,
        ln_b,
        ln_c,
        t,
        t_forward,
        other,
    })
}

/// Keeps A busy, then queues a forward of t on A and one on B, and returns their outputs.
/// Their contexts, which hold t, are gone: t is its storage's only handle again. B runs at
/// once; A's read of t waits behind the busy work for tens of milliseconds.
fn read_t_on_a_then_b(s: &ThreeStreams) -> [Tensor<f32>; 2] {
    queue_long_work(&s.a);
    let (y_a, ctx_a) = s.ln_a.forward(&s.t).unwrap();
    let (y_b, ctx_b) = s.ln_b.forward(&s.t).unwrap();
    drop((ctx_a, ctx_b));
    [y_a, y_b]
}

/// A and B normalized t's values from before C changed its memory: their outputs are
/// exactly what one stream computed from those values (the forward adds in a fixed order).
fn assert_read_t_as_it_was(what: &str, t_forward: &Array2<f32>, [y_a, y_b]: [Tensor<f32>; 2]) {
    for (stream, y) in [("A", y_a), ("B", y_b)] {
        assert!(
            y.to_array2().unwrap() == *t_forward,
            "{what}: stream {stream} read t's memory after C changed it"
        );
    }
}

/// A write waits for every stream that read the tensor before it, not just the last. A
/// busy stream A reads t, B reads t, then C writes t (`forward_into` with t as y) at once.
/// A record of one read event per tensor, recorded again at each read (cudarc's own
/// tracking), would make C wait for B's read only: C's write, queued long before A's busy
/// work ends, would then overwrite t before A reads it, and A would normalize C's values.
#[test]
fn writing_a_tensor_waits_for_every_stream_that_read_it() {
    let Some(mut s) = three_streams() else { return };
    let x_c = s.c.upload(s.other.view()).unwrap();
    let ys = read_t_on_a_then_b(&s);
    s.ln_c.forward_into(&x_c, &mut s.t).unwrap();
    assert_read_t_as_it_was("write on C", &s.t_forward, ys);
}

/// Freeing waits for every stream that read the tensor, as a write does. A busy stream A
/// reads t, B reads t, then t's last handle goes: its memory is freed on C, the stream it
/// was allocated on, and C allocates the same size at once and fills it with other values.
/// The stream-ordered pool lets an allocation on C reuse memory freed on C without waiting,
/// so that allocation most likely gets t's memory. A free that waited for B's read only
/// (one read event, recorded again at each read) would let that upload overwrite t before
/// A reads it.
#[test]
fn freeing_a_tensor_waits_for_every_stream_that_read_it() {
    let Some(s) = three_streams() else { return };
    let ys = read_t_on_a_then_b(&s);
    drop(s.t);
    let _reuse = s.c.upload(s.other.view()).unwrap();
    assert_read_t_as_it_was("free on C", &s.t_forward, ys);
}

/// What may cross threads: device handles, tensors, ops and contexts are all Send + Sync
/// (each wraps reference-counted driver objects; a handle's work is ordered on its stream).
#[test]
fn handles_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Device>();
    send_sync::<Tensor<f32>>();
    send_sync::<LayerNorm<f16>>();
    send_sync::<layernorm_cuda::Context<f32>>();
}

/// A row of one element has xhat = 0 and c2 = gamma * dy, so dx is exactly 0 in both modes
/// (as in PyTorch), not the rounding error of rstd * c2 (about 1e-5 at rstd = 1/sqrt(eps)).
#[test]
fn one_column_rows_have_zero_dx() {
    fn check<T: Element>(device: &Device) {
        let mut rng = Rng::new(83);
        let (rows, n) = (37, 1);
        let x = random_matrix::<T>(&mut rng, rows, n);
        let dy = random_matrix::<T>(&mut rng, rows, n);
        let (gamma, beta) = (
            random_vec::<T>(&mut rng, n, 1.0, 0.5),
            random_vec::<T>(&mut rng, n, 0.0, 0.5),
        );
        for mode in [BackwardMode::Deterministic, BackwardMode::Locked { groups: None }] {
            let ln = op(device, &gamma, &beta).with_backward_mode(mode).unwrap();
            let (_, ctx) = ln.forward(&device.upload(x.view()).unwrap()).unwrap();
            let grads = ln.backward(&ctx, &device.upload(dy.view()).unwrap()).unwrap();
            let dx = grads.dx.to_vec().unwrap();
            assert!(
                dx.iter().all(|v| v.to_f32() == 0.0),
                "{} {} {mode:?}: dx of one-column rows {dx:?}",
                device.name(),
                T::NAME
            );
        }
    }
    for device in devices() {
        check::<f32>(&device);
        check::<f16>(&device);
        check::<bf16>(&device);
    }
}

/// Rows whose spread or mean is near f32's limit (here up to 3e38, as f32 and bf16 hold):
/// their squared deviations, and even their sums, overflow f32, which left y = beta on the
/// GPU. y, mean and rstd now follow the float64 reference there as on the CPU, and the
/// backward's dgamma and dbeta (sums of dy * xhat, of ordinary size) stay correct.
#[test]
fn rows_near_the_f32_limit_normalize_as_in_f64() {
    fn check<T: Element>(device: &Device, rows: usize, n: usize) {
        let mut rng = Rng::new(89 + n as u64);
        let x = Array2::from_shape_fn((rows, n), |(i, j)| {
            let u = rng.uniform();
            let v = match i % 3 {
                // Both signs at full range: M2 overflows.
                0 => 3e38 * u,
                // One sign, close to the limit: the sum overflows too.
                1 => 2.5e38 + 5e37 * u,
                // Alternating +-3e38 with small noise.
                _ => (if j % 2 == 0 { 3e38 } else { -3e38 }) * (1.0 - 0.1 * u.abs()),
            };
            T::from_f32(v as f32)
        });
        let dy = random_matrix::<T>(&mut rng, rows, n);
        let (gamma, beta) = (
            random_vec::<T>(&mut rng, n, 1.0, 0.5),
            random_vec::<T>(&mut rng, n, 0.0, 0.5),
        );
        let ln = op(device, &gamma, &beta);
        let (y, ctx) = ln.forward(&device.upload(x.view()).unwrap()).unwrap();
        // The residual forward's kernels take such rows as well: with a residual of zeros,
        // s is x and y the same as the plain forward's.
        let zeros = device.zeros::<T>(&[rows, n]).unwrap();
        let (y_residual, s, _) = ln
            .forward_residual(&device.upload(x.view()).unwrap(), &zeros)
            .unwrap();
        let grads = ln.backward(&ctx, &device.upload(dy.view()).unwrap()).unwrap();
        let (xf, gf, bf) = (to_f64(x.view()), to_f64(gamma.view()), to_f64(beta.view()));
        let (ry, rmean, rrstd) = reference::forward(xf.view(), gf.view(), bf.view(), 1e-5f32 as f64);
        let (_, rdgamma, rdbeta) =
            reference::backward(xf.view(), to_f64(dy.view()).view(), gf.view(), 1e-5f32 as f64);
        let what = format!("{} {} n = {n}", device.name(), T::NAME);
        let tol = tolerance::<T>();
        let s = s.to_array2().unwrap();
        assert!(
            s.iter().zip(&x).all(|(s, x)| s.to_f32() == x.to_f32()),
            "{what}: s = x + 0"
        );
        let errs = [
            ("y", rel_err(y.to_array2().unwrap().view(), ry.view())),
            (
                "y of x + 0",
                rel_err(y_residual.to_array2().unwrap().view(), ry.view()),
            ),
            (
                "mean",
                rel_err(ctx.mean().to_array1().unwrap().view(), rmean.view()),
            ),
            (
                "dgamma",
                rel_err(
                    grads.dgamma.as_ref().unwrap().to_array1().unwrap().view(),
                    rdgamma.view(),
                ),
            ),
            (
                "dbeta",
                rel_err(
                    grads.dbeta.as_ref().unwrap().to_array1().unwrap().view(),
                    rdbeta.view(),
                ),
            ),
        ];
        for (name, err) in errs {
            assert!(
                err < tol,
                "{what}: {name} relative error {err:e} (tolerance {tol:e})"
            );
        }
        // rstd is about 1e-38 here, where f32 keeps fewer bits (subnormal): 1e-5 relative.
        let rstd_err = rel_err(ctx.rstd().to_array1().unwrap().view(), rrstd.view());
        assert!(rstd_err < 1e-5, "{what}: rstd relative error {rstd_err:e}");
        let dx = grads.dx.to_vec().unwrap();
        assert!(dx.iter().all(|v| v.to_f32().is_finite()), "{what}: dx not finite");
    }
    for device in devices() {
        // One element at a time (odd n), warp rows, held block rows, streamed block rows;
        // for the residual forward also rows it holds (12288) and stages (bf16 40000), and,
        // in a launch of more rows than multiprocessors, its held kernel's (bf16 20000, by
        // blocks of 1024) and its streamed kernel's (40000, and, on sm_90, rows not whole
        // aligned packs: 4097 in half packs and elements, bf16 4100 in half packs).
        let shapes = [
            (6, 7),
            (6, 1024),
            (6, 4096),
            (6, 12288),
            (6, 40000),
            (140, 20000),
            (140, 40000),
            (140, 4097),
            (140, 4100),
        ];
        for (rows, n) in shapes {
            check::<f32>(&device, rows, n);
            check::<bf16>(&device, rows, n);
        }
    }
}
