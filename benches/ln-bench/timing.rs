//! Timing the way the peers are timed (`triton.testing.do_bench`): warm-up runs, then many
//! repetitions, each between two CUDA events with the L2 cache flushed before it, reported
//! as the median and the 20% and 80% quantiles.

use std::sync::Arc;
use std::time::Instant;

use layernorm_cuda::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, LaunchConfig, sys};
use layernorm_cuda::cudarc::nvrtc::Ptx;
use serde::Serialize;

use crate::error::{BenchError, During};

/// Bytes written between repetitions to evict the inputs from L2 (50 MB on H100, 60 MB on
/// H200): a larger buffer than any of these, so every repetition starts from DRAM.
const L2_FLUSH_BYTES: usize = 256 << 20;

/// Bytes of each buffer in the device-to-device copy that sets the ceiling.
const GPU_COPY_BYTES: usize = 1 << 30;

/// Bytes of each buffer in the CPU's copy: far beyond its caches, small enough to be quick.
const CPU_COPY_BYTES: usize = 64 << 20;

/// What the copy's source holds: not zeros, which some hardware moves faster.
const COPY_PATTERN: u8 = 0xA5;

/// A kernel that does nothing, as PTX text (no CUDA compiler needed: the driver JIT-compiles
/// it for the device, as it does the library's kernels). One block of one thread launched
/// and timed like an op gives the floor under any op's time: the launch and the two events.
const EMPTY_KERNEL_PTX: &str = "\
.version 7.0
.target sm_80
.address_size 64
.visible .entry empty_kernel()
{
    ret;
}
";

/// Milliseconds per repetition: median, 20% and 80% quantiles.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Quantiles {
    pub median_ms: f64,
    pub p20_ms: f64,
    pub p80_ms: f64,
}

impl Quantiles {
    /// Quantiles interpolated linearly between order statistics, as `torch.quantile` does
    /// in `do_bench`. `ms` must not be empty.
    fn of(mut ms: Vec<f64>) -> Quantiles {
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let pos = q * (ms.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            ms[lo] + (ms[hi] - ms[lo]) * (pos - lo as f64)
        };
        Quantiles {
            median_ms: at(0.5),
            p20_ms: at(0.2),
            p80_ms: at(0.8),
        }
    }

    /// GB/s (10^9 bytes per second) for `bytes` moved in the median time.
    pub fn gbps(&self, bytes: f64) -> f64 {
        bytes / (self.median_ms * 1e-3) / 1e9
    }
}

/// Device-to-device copy bandwidth, counting bytes read plus bytes written: the ceiling
/// the LayerNorm numbers are measured against.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CopyBandwidth {
    pub bytes: f64,
    #[serde(flatten)]
    pub time: Quantiles,
    pub gbps: f64,
}

impl CopyBandwidth {
    fn from_time(bytes_each_way: usize, time: Quantiles) -> CopyBandwidth {
        let bytes = 2.0 * bytes_each_way as f64;
        CopyBandwidth {
            bytes,
            time,
            gbps: time.gbps(bytes),
        }
    }
}

/// Times an operation on the GPU (CUDA events on the library's stream) or on the CPU
/// (the host clock; the CPU path is synchronous).
pub enum Timer {
    Gpu(GpuTimer),
    Cpu { warmup: u32, reps: u32 },
}

pub struct GpuTimer {
    stream: Arc<CudaStream>,
    flush: CudaSlice<u8>,
    /// One (start, end) pair per repetition, all read after one synchronize, so no host
    /// wait sits between repetitions.
    events: Vec<(CudaEvent, CudaEvent)>,
    warmup: u32,
}

impl Timer {
    pub fn gpu(stream: &Arc<CudaStream>, warmup: u32, reps: u32) -> Result<Timer, BenchError> {
        let flush = stream
            .alloc_zeros::<u8>(L2_FLUSH_BYTES)
            .during("allocating the L2 flush buffer")?;
        let ctx = stream.context();
        // `new_event(None)` would disable timing.
        let timed = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        let events = (0..reps)
            .map(|_| Ok((timed()?, timed()?)))
            .collect::<Result<_, _>>()
            .during("creating timing events")?;
        Ok(Timer::Gpu(GpuTimer {
            stream: stream.clone(),
            flush,
            events,
            warmup,
        }))
    }

    /// Runs `op` for the warm-up, then once per repetition, and returns the quantiles of
    /// the repetitions' times.
    pub fn time(&mut self, mut op: impl FnMut() -> Result<(), BenchError>) -> Result<Quantiles, BenchError> {
        match self {
            Timer::Gpu(g) => {
                for _ in 0..g.warmup {
                    op()?;
                }
                for (start, end) in &g.events {
                    // The flush goes before the start event: it keeps the GPU busy while
                    // the host queues the op, so launch latency stays out of the time.
                    g.stream
                        .memset_zeros(&mut g.flush)
                        .during("flushing the L2 cache")?;
                    start.record(&g.stream).during("recording a start event")?;
                    op()?;
                    end.record(&g.stream).during("recording an end event")?;
                }
                g.stream.synchronize().during("waiting for the timed runs")?;
                let ms = g
                    .events
                    .iter()
                    .map(|(start, end)| start.elapsed_ms(end).map(f64::from))
                    .collect::<Result<_, _>>()
                    .during("reading event times")?;
                Ok(Quantiles::of(ms))
            }
            Timer::Cpu { warmup, reps } => {
                for _ in 0..*warmup {
                    op()?;
                }
                let mut ms = Vec::with_capacity(*reps as usize);
                for _ in 0..*reps {
                    let start = Instant::now();
                    op()?;
                    ms.push(start.elapsed().as_secs_f64() * 1e3);
                }
                Ok(Quantiles::of(ms))
            }
        }
    }

    /// The time of an empty kernel's launch, timed like an op: the floor under the latency
    /// tables. None on the CPU, where there is no launch.
    pub fn launch_floor(&mut self) -> Result<Option<Quantiles>, BenchError> {
        let Timer::Gpu(g) = self else {
            return Ok(None);
        };
        let stream = g.stream.clone();
        let kernel = stream
            .context()
            .load_module(Ptx::from_src(EMPTY_KERNEL_PTX))
            .and_then(|module| module.load_function("empty_kernel"))
            .during("loading the empty kernel")?;
        let one_thread = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        self.time(|| {
            // SAFETY: the kernel takes no parameters and touches no memory; the launch
            // passes none, with a grid and block the kernel accepts.
            unsafe { stream.launch_builder(&kernel).launch(one_thread) }
                .map(drop)
                .during("launching the empty kernel")
        })
        .map(Some)
    }

    /// The copy ceiling, timed like everything else: a 1 GiB device-to-device copy on the
    /// GPU, a 64 MiB slice copy on the CPU.
    pub fn copy_bandwidth(&mut self) -> Result<CopyBandwidth, BenchError> {
        match self {
            Timer::Gpu(g) => {
                let stream = g.stream.clone();
                let src = stream
                    .clone_htod(&vec![COPY_PATTERN; GPU_COPY_BYTES])
                    .during("uploading the copy source")?;
                let mut dst = stream
                    .alloc_zeros::<u8>(GPU_COPY_BYTES)
                    .during("allocating the copy destination")?;
                let time = self.time(|| {
                    stream
                        .memcpy_dtod(&src, &mut dst)
                        .during("copying device to device")
                })?;
                Ok(CopyBandwidth::from_time(GPU_COPY_BYTES, time))
            }
            Timer::Cpu { .. } => {
                let src = vec![COPY_PATTERN; CPU_COPY_BYTES];
                let mut dst = vec![0u8; CPU_COPY_BYTES];
                let time = self.time(|| {
                    dst.copy_from_slice(&src);
                    std::hint::black_box(&mut dst);
                    Ok(())
                })?;
                Ok(CopyBandwidth::from_time(CPU_COPY_BYTES, time))
            }
        }
    }
}
