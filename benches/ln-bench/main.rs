//! ln-bench: LayerNorm (or, with `--norm rms`, RMSNorm) forward and backward bandwidth
//! against N, each configuration checked against float64 before it is timed, with the
//! device's copy bandwidth as the ceiling.
//!
//! Exit code: 0 when every configuration passed its check, 1 when one failed (or the run
//! could not finish), 2 for bad flags.
//!
//! Layout: `args` (flags), `config` (what a measurement is, the presets), `inputs` and
//! `check` (random inputs, the float64 reference), `timing` (CUDA events or the host clock,
//! the empty kernel), `sweep` (the loop), `report` and `plot` (what comes out), `peers` (the
//! peers' numbers from `benches/peers.py`, shown beside ours), `parallel` (host work over
//! the cores).

mod args;
mod check;
mod config;
mod error;
mod inputs;
mod parallel;
mod peers;
mod plot;
mod report;
mod sweep;
mod timing;

use std::process::ExitCode;
use std::time::SystemTime;

use indicatif::{ProgressBar, ProgressStyle};
use layernorm_cuda::cudarc::driver::{CudaContext, sys::CUdevice_attribute};
use layernorm_cuda::{Device, Error};

use crate::args::Args;
use crate::config::{Dtype, Preset};
use crate::error::BenchError;
use crate::peers::PeerRun;
use crate::report::{Memory, Run};
use crate::sweep::Plan;
use crate::timing::Timer;

/// The peers' benchmark sizes on a GPU (without a preset): M = 4096, N = 1024 to 15872 in
/// steps of 512, then two long rows.
const GPU_ROWS: usize = 4096;
fn gpu_ns() -> Vec<usize> {
    (2..32).map(|i| 512 * i).chain([32768, 65536]).collect()
}
const GPU_REPS: u32 = 50;
const GPU_WARMUP: u32 = 5;

/// The CPU path is a fallback that shows the program works: sizes that take seconds.
const CPU_ROWS: usize = 256;
const CPU_NS: [usize; 4] = [512, 1024, 2048, 4096];
const CPU_REPS: u32 = 10;
const CPU_WARMUP: u32 = 2;

const QUICK_NS: [usize; 4] = [1024, 4096, 8192, 32768];

fn main() -> ExitCode {
    let args = args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("ln-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the sweep and reports it; true when every configuration passed its check.
fn run(args: &Args) -> Result<bool, BenchError> {
    let device = open_device()?;
    let on_gpu = device.is_cuda();
    let (rows, default_ns, reps, warmup) = if on_gpu {
        (GPU_ROWS, gpu_ns(), GPU_REPS, GPU_WARMUP)
    } else {
        (CPU_ROWS, CPU_NS.to_vec(), CPU_REPS, CPU_WARMUP)
    };
    let preset = args.preset;
    let plan = Plan {
        norm: args.norm,
        residual: args.residual,
        f32_stream: args.f32_stream,
        weights: args.weights,
        rows: match (&args.rows, preset) {
            (Some(rows), _) => rows.clone(),
            (None, Some(preset)) => preset.rows().to_vec(),
            (None, None) => vec![rows],
        },
        ns: match (&args.n, preset, args.quick) {
            (Some(ns), _, _) => ns.clone(),
            (None, Some(preset), _) => preset.ns().to_vec(),
            (None, None, true) => QUICK_NS.to_vec(),
            (None, None, false) => default_ns,
        },
        modes: args.mode.clone(),
        dtypes: match (&args.dtype, preset) {
            (Some(dtypes), _) => dtypes.clone(),
            (None, Some(preset)) => preset.dtypes().to_vec(),
            (None, None) => vec![Dtype::F16, Dtype::Bf16, Dtype::F32],
        },
        seed: args.seed,
        latency_tables: preset == Some(Preset::Latency),
    };
    let (reps, warmup) = (args.reps.unwrap_or(reps), args.warmup.unwrap_or(warmup));
    args::check_sizes(&plan.rows, &plan.ns);
    // Read before anything is measured, so that a wrong path costs no GPU time.
    let peers = args
        .peers
        .as_deref()
        .map(|path| PeerRun::read(path, args.norm, args.residual, args.f32_stream))
        .transpose()?;

    let (mut timer, memory) = match device.cuda_stream() {
        Some(stream) => (Timer::gpu(stream, warmup, reps)?, memory_of(stream.context())),
        None => (Timer::Cpu { warmup, reps }, None),
    };
    let run = Run {
        norm: plan.norm,
        residual: plan.residual,
        f32_stream: plan.f32_stream,
        weights: plan.weights,
        device: device.name(),
        date: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        memory,
        copy: timer.copy_bandwidth()?,
        empty_kernel: if plan.latency_tables {
            timer.launch_floor()?
        } else {
            None
        },
        preset,
        reps,
        warmup,
        seed: plan.seed,
    };
    run.print_header(&plan, on_gpu, peers.as_ref());

    let progress = ProgressBar::new(plan.configurations() as u64).with_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let results = sweep::run(&plan, &device, &mut timer, &progress);
    progress.finish_and_clear();

    run.print_tables(&plan, &results, peers.as_ref());
    if let Some(path) = &args.json {
        run.write_json(path, &results)?;
    }
    if let Some(path) = &args.csv {
        run.write_csv(path, &results)?;
    }
    if let Some(path) = &args.plot {
        plot::draw(path, &run, &plan, &results, peers.as_ref())?;
    }
    Ok(results
        .iter()
        .all(|m| matches!(m.outcome, sweep::Outcome::Timed(_))))
}

/// CUDA device 0, or the CPU with the reason printed as the first line. With
/// LAYERNORM_REQUIRE_GPU=1 (set on the GPU machine) a missing device is an error instead.
fn open_device() -> Result<Device, BenchError> {
    match Device::cuda(0) {
        Ok(device) => Ok(device),
        Err(e) if std::env::var("LAYERNORM_REQUIRE_GPU").as_deref() == Ok("1") => Err(e.into()),
        Err(e) => {
            let kind = match e {
                Error::NoDriver | Error::NoDevice { .. } => "no CUDA device",
                _ => "CUDA device 0 cannot be used",
            };
            println!("ln-bench: {kind} ({e}); running the CPU path on smaller sizes instead.");
            Ok(Device::cpu())
        }
    }
}

/// The memory clock and bus width, where the driver reports them.
fn memory_of(ctx: &CudaContext) -> Option<Memory> {
    let clock_khz = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
        .ok()?;
    let bus_bits = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
        .ok()?;
    (clock_khz > 0 && bus_bits > 0).then(|| Memory {
        clock_mhz: clock_khz as f64 / 1e3,
        bus_width_bits: bus_bits as u32,
        peak_gbps: 2.0 * clock_khz as f64 * 1e3 * (bus_bits as f64 / 8.0) / 1e9,
    })
}
