//! Backward against the float64 reference (itself checked by finite differences), in both
//! modes, plus the spinlock's stress cases and the deterministic mode's reproducibility.

mod common;

use common::{Problem, Rng, SHAPES, gpu_or_skip, poisoned, rel_err, to_f64, tolerance};
use layernorm_cuda::{BackwardMode, Device, Element, Gradients, LayerNorm, bf16, f16};
use layernorm_reference as reference;
use ndarray::{Array1, Array2};

const LOCKED: BackwardMode = BackwardMode::Locked { groups: None };

/// The float64 reference's backward against central differences of its forward, for the
/// scalar loss L = sum(y * dy): dL/dx, dL/dgamma and dL/dbeta.
#[test]
fn finite_difference_matches_reference() {
    let mut rng = Rng::new(1);
    let (rows, n, eps) = (3, 7, 1e-5);
    let x = Array2::from_shape_fn((rows, n), |_| rng.normal() * 2.0 + 0.5);
    let dy = Array2::from_shape_fn((rows, n), |_| rng.normal());
    let gamma = Array1::from_shape_fn(n, |_| 1.0 + 0.5 * rng.uniform());
    let beta = Array1::from_shape_fn(n, |_| 0.5 * rng.uniform());
    let loss = |x: &Array2<f64>, g: &Array1<f64>, b: &Array1<f64>| {
        (reference::forward(x.view(), g.view(), b.view(), eps).0 * &dy).sum()
    };
    let (dx, dgamma, dbeta) = reference::backward(x.view(), dy.view(), gamma.view(), eps);
    let h = 1e-6;
    let central = |plus: f64, minus: f64| (plus - minus) / (2.0 * h);
    for i in 0..rows {
        for j in 0..n {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[[i, j]] += h;
            xm[[i, j]] -= h;
            let fd = central(loss(&xp, &gamma, &beta), loss(&xm, &gamma, &beta));
            assert!(
                (fd - dx[[i, j]]).abs() < 1e-6 * (1.0 + fd.abs()),
                "dx[{i},{j}]: {fd} vs {}",
                dx[[i, j]]
            );
        }
    }
    for j in 0..n {
        let (mut gp, mut gm, mut bp, mut bm) = (gamma.clone(), gamma.clone(), beta.clone(), beta.clone());
        gp[j] += h;
        gm[j] -= h;
        bp[j] += h;
        bm[j] -= h;
        let fd_g = central(loss(&x, &gp, &beta), loss(&x, &gm, &beta));
        let fd_b = central(loss(&x, &gamma, &bp), loss(&x, &gamma, &bm));
        assert!(
            (fd_g - dgamma[j]).abs() < 1e-6 * (1.0 + fd_g.abs()),
            "dgamma[{j}]: {fd_g} vs {}",
            dgamma[j]
        );
        assert!(
            (fd_b - dbeta[j]).abs() < 1e-6 * (1.0 + fd_b.abs()),
            "dbeta[{j}]: {fd_b} vs {}",
            dbeta[j]
        );
    }
}

/// Backward checks of a problem of weights of the rows' own type.
impl<T: Element> Problem<T> {
    /// Forward then backward on `device` with `mode`, into NaN-poisoned outputs.
    fn run(&self, device: &Device, mode: BackwardMode) -> (Array2<T>, Array1<T>, Array1<T>) {
        let (rows, n) = self.x.dim();
        let ln = LayerNorm::from_arrays(device, self.gamma.view(), self.beta.view(), 1e-5)
            .unwrap()
            .with_backward_mode(mode)
            .unwrap();
        let (_, ctx) = ln.forward(&device.upload(self.x.view()).unwrap()).unwrap();
        let mut grads = Gradients {
            dx: poisoned(device, &[rows, n]),
            dgamma: Some(poisoned(device, &[n])),
            dbeta: Some(poisoned(device, &[n])),
        };
        ln.backward_into(&ctx, &device.upload(self.dy.view()).unwrap(), &mut grads)
            .unwrap();
        (
            grads.dx.to_array2().unwrap(),
            grads.dgamma.as_ref().unwrap().to_array1().unwrap(),
            grads.dbeta.as_ref().unwrap().to_array1().unwrap(),
        )
    }

    /// [`Problem::check`] in both modes.
    fn check_both_modes(&self, device: &Device, what: &str) {
        self.check(device, BackwardMode::Deterministic, what);
        self.check(device, LOCKED, what);
    }

    /// Checks `run`'s result against the reference.
    fn check(&self, device: &Device, mode: BackwardMode, what: &str) {
        let (dx, dgamma, dbeta) = self.run(device, mode);
        let (rdx, rdgamma, rdbeta) = reference::backward(
            to_f64(self.x.view()).view(),
            to_f64(self.dy.view()).view(),
            to_f64(self.gamma.view()).view(),
            1e-5f32 as f64,
        );
        let errs = [
            ("dx", rel_err(dx.view(), rdx.view())),
            ("dgamma", rel_err(dgamma.view(), rdgamma.view())),
            ("dbeta", rel_err(dbeta.view(), rdbeta.view())),
        ];
        let what = format!(
            "{} backward {mode:?} {} {:?} {what}",
            device.name(),
            T::NAME,
            self.x.dim()
        );
        eprintln!("{what}: {errs:?}");
        // dx subtracts two row means from gamma * dy; allow twice the forward's tolerance.
        let tol = 2.0 * tolerance::<T>();
        for (name, err) in errs {
            assert!(err <= tol, "{what}: {name} error {err:e} > {tol:e}");
        }
    }
}

fn check_all_shapes<T: Element>(device: &Device, mode: BackwardMode, seed: u64) {
    for (i, &(rows, n)) in SHAPES.iter().enumerate() {
        let seed = seed + i as u64;
        Problem::<T>::random(rows, n, seed).check(device, mode, &format!("seed {seed}"));
    }
}

#[test]
fn cpu_backward_matches_reference() {
    let cpu = Device::cpu();
    check_all_shapes::<f32>(&cpu, BackwardMode::Deterministic, 1000);
    check_all_shapes::<f16>(&cpu, BackwardMode::Deterministic, 1100);
    check_all_shapes::<bf16>(&cpu, BackwardMode::Deterministic, 1200);
}

/// Rows enough for the CPU backward to split them into its parts (at most 16 runs of
/// consecutive rows, the last one shorter here) and over threads: every part's sums reach
/// dgamma and dbeta once, and a second call gives the same bits.
#[test]
fn cpu_backward_over_parts_and_threads() {
    fn check<T: Element>(seed: u64) {
        let cpu = Device::cpu();
        let p = Problem::<T>::random(1001, 300, seed);
        p.check(&cpu, BackwardMode::Deterministic, "split over parts");
        let bits = |(dx, dgamma, dbeta): (Array2<T>, Array1<T>, Array1<T>)| -> Vec<u32> {
            dx.iter()
                .chain(&dgamma)
                .chain(&dbeta)
                .map(|v| v.to_f32().to_bits())
                .collect()
        };
        let (a, b) = (
            bits(p.run(&cpu, BackwardMode::Deterministic)),
            bits(p.run(&cpu, BackwardMode::Deterministic)),
        );
        assert!(a == b, "{}: two calls differ", T::NAME);
    }
    check::<f32>(1300);
    check::<f16>(1301);
    check::<bf16>(1302);
}

#[test]
fn gpu_backward_deterministic_matches_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all_shapes::<f32>(&gpu, BackwardMode::Deterministic, 1000);
    check_all_shapes::<f16>(&gpu, BackwardMode::Deterministic, 1100);
    check_all_shapes::<bf16>(&gpu, BackwardMode::Deterministic, 1200);
}

#[test]
fn gpu_backward_locked_matches_reference() {
    let Some(gpu) = gpu_or_skip() else { return };
    check_all_shapes::<f32>(&gpu, LOCKED, 1000);
    check_all_shapes::<f16>(&gpu, LOCKED, 1100);
    check_all_shapes::<bf16>(&gpu, LOCKED, 1200);
}

/// Many rows per team, warp- and block-per-row (f32 rows of warp length too), both modes.
#[test]
fn gpu_backward_many_rows() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (i, &(rows, n)) in [(20000, 64), (4096, 1024), (3000, 2048), (1500, 8200)]
        .iter()
        .enumerate()
    {
        let p = Problem::<f16>::random(rows, n, 1300 + i as u64);
        p.check(&gpu, BackwardMode::Deterministic, "many rows");
        p.check(&gpu, LOCKED, "many rows");
    }
    // f32 rows of warp length past what a warp holds: held block teams stacked along y.
    for (i, &(rows, n)) in [(4096, 1024), (3000, 544)].iter().enumerate() {
        let p = Problem::<f32>::random(rows, n, 1310 + i as u64);
        p.check(&gpu, BackwardMode::Deterministic, "many f32 rows");
        p.check(&gpu, LOCKED, "many f32 rows");
    }
}

/// Rows 8-byte aligned but not 16 every other row (f16 and bf16 N = 4 mod 8, f32 N = 2 mod
/// 4): those rows in half packs, the others in packs, in one launch, so that a team's
/// columns change hands between its rows. Warp teams (f16 N = 36), block teams (f32
/// 1030), the held block kernel in half packs (f16 4100, bf16 2052: every row in half
/// packs, 4100's last slot half full), and on sm_90 the held cluster kernels in half packs
/// (bf16 16388 over 2 blocks, f16 32772 over 4 and 65540 over 8: past what one block
/// holds), both modes.
#[test]
fn gpu_backward_rows_8_byte_aligned() {
    let Some(gpu) = gpu_or_skip() else { return };
    let f16_cases = [(4096, 36), (1500, 4100)];
    for (i, &(rows, n)) in f16_cases.iter().enumerate() {
        Problem::<f16>::random(rows, n, 1800 + i as u64).check_both_modes(&gpu, "8-byte aligned rows");
    }
    Problem::<bf16>::random(700, 2052, 1812).check_both_modes(&gpu, "8-byte aligned rows");
    Problem::<f16>::random(200, 32772, 1813).check_both_modes(&gpu, "8-byte aligned rows");
    Problem::<f16>::random(100, 65540, 1814).check_both_modes(&gpu, "8-byte aligned rows");
    Problem::<f32>::random(2000, 1030, 1810).check_both_modes(&gpu, "8-byte aligned rows");
    Problem::<bf16>::random(300, 16388, 1811).check_both_modes(&gpu, "8-byte aligned rows");
}

/// Rows whose pointers all sit the same bytes past a 16-byte boundary, a different number
/// from row to row: the held block kernel's shifted copy holds each in packs from its first
/// boundary, its head and tail a column a rank, on a grid whose blocks each take rows of
/// one head, and stages gamma's columns off its own boundaries (f16 N = 4097: every head
/// from 0 to 7 elements, odd ones starting gamma's columns mid-word; bf16 N = 1030: heads
/// of 0, 2, 4 and 6; f32 N = 4097: 0 to 3), both modes. Fewer rows than the grid's period
/// (blocks without rows hand over zeros), a row count no multiple of it, and N = 3 mod 8.
#[test]
fn gpu_backward_rows_shifted_off_their_boundaries() {
    let Some(gpu) = gpu_or_skip() else { return };
    Problem::<f16>::random(1000, 4097, 1820).check_both_modes(&gpu, "shifted rows");
    Problem::<bf16>::random(3000, 1030, 1821).check_both_modes(&gpu, "shifted rows");
    Problem::<f32>::random(1000, 4097, 1822).check_both_modes(&gpu, "shifted rows");
    Problem::<f16>::random(5, 4097, 1823).check_both_modes(&gpu, "shifted rows, few");
    Problem::<bf16>::random(999, 2051, 1824).check_both_modes(&gpu, "shifted rows");
    Problem::<f16>::random(300, 16383, 1825).check_both_modes(&gpu, "shifted rows, long");
}

/// Rows too long for one block to hold in registers or to sum in shared memory (8n
/// bytes): on Hopper, clusters of 8 blocks split each row (kernels-gpu/src/cluster/),
/// elsewhere partials go through global memory. Many rows per cluster, fewer rows than clusters,
/// odd n (misaligned rows, a ragged last slice), each storage type.
#[test]
fn gpu_backward_long_rows() {
    let Some(gpu) = gpu_or_skip() else { return };
    let f16_cases = [(300, 32768), (200, 65536), (3, 40000)];
    for (i, &(rows, n)) in f16_cases.iter().enumerate() {
        Problem::<f16>::random(rows, n, 1700 + i as u64).check(
            &gpu,
            BackwardMode::Deterministic,
            "long rows",
        );
    }
    // f32 rows past 4 packs a thread of one block: clustered so that they stay in registers.
    Problem::<f32>::random(100, 15872, 1713).check(&gpu, BackwardMode::Deterministic, "long rows");
    Problem::<f32>::random(130, 32768, 1710).check(&gpu, BackwardMode::Deterministic, "long rows");
    Problem::<f32>::random(40, 65536, 1711).check(&gpu, BackwardMode::Deterministic, "long rows");
    Problem::<bf16>::random(67, 100001, 1712).check(&gpu, BackwardMode::Deterministic, "long rows");
    // The locked mode over clusters: each block of a cluster hands its slice of the sums
    // over under a lock of its own (held slices, then the general kernel's).
    Problem::<f16>::random(300, 32768, 1714).check(&gpu, LOCKED, "long rows, locked");
    Problem::<f32>::random(130, 32768, 1715).check(
        &gpu,
        BackwardMode::Locked { groups: Some(3) },
        "long rows, G = 3",
    );
    Problem::<bf16>::random(67, 100001, 1716).check(&gpu, LOCKED, "long rows, locked");
}

/// The spinlock under its worst cases: one group that every block contends for, more groups
/// than rows (and than blocks), many blocks per group. Each run must finish (no hang), match the reference,
/// and agree with the deterministic mode.
#[test]
fn gpu_spinlock_stress() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cases: &[(usize, usize, u32)] = &[(8192, 256, 1), (4096, 4096, 1), (10, 512, 64), (2048, 2000, 4)];
    for (i, &(rows, n, groups)) in cases.iter().enumerate() {
        let p = Problem::<f32>::random(rows, n, 1400 + i as u64);
        let what = format!("G = {groups}");
        p.check(&gpu, BackwardMode::Locked { groups: Some(groups) }, &what);
        let (dx_l, dg_l, db_l) = p.run(&gpu, BackwardMode::Locked { groups: Some(groups) });
        let (dx_d, dg_d, db_d) = p.run(&gpu, BackwardMode::Deterministic);
        // dx does not depend on the mode at all; the sums differ only in addition order.
        assert_eq!(dx_l, dx_d, "{what}: dx differs between modes");
        assert!(
            rel_err(dg_l.view(), to_f64(dg_d.view()).view()) <= 1e-5,
            "{what}: dgamma modes disagree"
        );
        assert!(
            rel_err(db_l.view(), to_f64(db_d.view()).view()) <= 1e-5,
            "{what}: dbeta modes disagree"
        );
    }
}

/// The deterministic mode gives the same bits twice, for every storage type.
#[test]
fn gpu_deterministic_mode_is_bitwise_reproducible() {
    let Some(gpu) = gpu_or_skip() else { return };
    fn twice<T: Element + PartialEq>(gpu: &Device, rows: usize, n: usize, seed: u64) {
        let p = Problem::<T>::random(rows, n, seed);
        let (a, b) = (
            p.run(gpu, BackwardMode::Deterministic),
            p.run(gpu, BackwardMode::Deterministic),
        );
        let bits = |v: &Array1<T>| v.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a.1),
            bits(&b.1),
            "{} [{rows}, {n}]: dgamma differs between runs",
            T::NAME
        );
        assert_eq!(
            bits(&a.2),
            bits(&b.2),
            "{} [{rows}, {n}]: dbeta differs between runs",
            T::NAME
        );
    }
    twice::<f32>(&gpu, 4096, 1024, 1500);
    twice::<f16>(&gpu, 3000, 4096, 1501);
    twice::<bf16>(&gpu, 777, 20000, 1502);
    // Clusters on Hopper: the row sums cross blocks through distributed shared memory.
    twice::<f16>(&gpu, 257, 32768, 1503);
    twice::<f32>(&gpu, 33, 65537, 1504);
}

/// The backward's workspace (kept per stream between calls) gives the bits a fresh one does:
/// calls of shapes that need more, then less, then more scratch again, in both modes, each
/// against the same call on a handle of its own (a new stream, so an empty workspace).
/// Deterministic results must match bit for bit; the locked mode's sums run in whatever
/// order the locks are taken, so those match the reference instead.
#[test]
fn gpu_backward_workspace_reuse_matches_fresh_workspace() {
    let Some(gpu) = gpu_or_skip() else { return };
    let bits = |v: &Array1<f16>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Small, large (more partial rows and wider ones), small again, the largest last.
    let shapes = [(64, 1024), (4096, 8192), (33, 777), (2048, 32768)];
    for (i, &(rows, n)) in shapes.iter().enumerate() {
        let p = Problem::<f16>::random(rows, n, 1600 + i as u64);
        let fresh = gpu.with_new_stream().unwrap();
        let (reused, new) = (
            p.run(&gpu, BackwardMode::Deterministic),
            p.run(&fresh, BackwardMode::Deterministic),
        );
        assert_eq!(bits(&reused.1), bits(&new.1), "[{rows}, {n}]: dgamma");
        assert_eq!(bits(&reused.2), bits(&new.2), "[{rows}, {n}]: dbeta");
        assert_eq!(
            reused.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            new.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "[{rows}, {n}]: dx"
        );
    }
    for (i, &(rows, n)) in shapes.iter().enumerate() {
        // The lock words come from the workspace too: zeroed on every call.
        let seed = 1700 + i as u64;
        Problem::<f16>::random(rows, n, seed).check(&gpu, LOCKED, &format!("reused workspace, seed {seed}"));
    }
}

/// GPU and CPU path agree on the same inputs.
#[test]
fn gpu_backward_agrees_with_cpu_path() {
    let Some(gpu) = gpu_or_skip() else { return };
    let p = Problem::<f32>::random(37, 5000, 1600);
    let (g, c) = (
        p.run(&gpu, BackwardMode::Deterministic),
        p.run(&Device::cpu(), BackwardMode::Deterministic),
    );
    // Both are f32 computations, each within the f32 tolerance of the reference.
    let tol = tolerance::<f32>();
    for (what, err) in [
        ("dx", rel_err(g.0.view(), to_f64(c.0.view()).view())),
        ("dgamma", rel_err(g.1.view(), to_f64(c.1.view()).view())),
        ("dbeta", rel_err(g.2.view(), to_f64(c.2.view()).view())),
    ] {
        assert!(err <= tol, "GPU vs CPU path, {what}: {err:e}");
    }
}
