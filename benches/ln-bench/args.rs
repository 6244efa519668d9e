//! Command-line flags. clap reports a bad flag or value itself and exits with code 2.

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use layernorm_cuda::MAX_DIM;

use crate::config::{Dtype, Mode, Norm, Preset, Weights};

/// LayerNorm (or RMSNorm) forward and backward bandwidth on the GPU (GB/s against N at fixed M), each
/// configuration checked against a float64 reference before it is timed. Without a CUDA
/// device it runs the CPU path on smaller sizes instead.
#[derive(Parser, Debug)]
#[command(name = "ln-bench", version)]
pub struct Args {
    /// Shapes, types and tables of a preset: `llm` (bf16, M = 16384, 65536, N = 768, 1024,
    /// 2048, 4096, 5120, 8192) or `latency` (bf16, M = 1, 8, 64, 512, N = 4096, 8192, times
    /// in microseconds beside an empty kernel's). --rows, --n and --dtype override its lists.
    #[arg(long, conflicts_with = "quick")]
    pub preset: Option<Preset>,

    /// Row counts M, comma-separated [default: the preset's; else 4096 on a GPU, 256 on the
    /// CPU].
    #[arg(long, value_delimiter = ',', value_parser = dimension)]
    pub rows: Option<Vec<usize>>,

    /// Row lengths N, comma-separated [default: the preset's; else 1024, 1536, ..., 15872,
    /// 32768, 65536 on a GPU; 512, 1024, 2048, 4096 on the CPU].
    #[arg(long, value_delimiter = ',', value_parser = dimension, conflicts_with = "quick")]
    pub n: Option<Vec<usize>>,

    /// A short list of N for a smoke run: 1024, 4096, 8192, 32768.
    #[arg(long)]
    pub quick: bool,

    /// The normalization: `layer` (LayerNorm with gamma and beta) or `rms` (RMSNorm with
    /// gamma).
    #[arg(long, value_enum, default_value_t = Norm::Layer)]
    pub norm: Norm,

    /// The weights' type: `same` (the data's) or `f32` (f32 gamma and beta, and f32 dgamma
    /// and dbeta, beside f16 and bf16 data: `LayerNorm<T, f32>`, `RmsNorm<T, f32>`).
    #[arg(long, value_enum, default_value_t = Weights::Same)]
    pub weights: Weights,

    /// Measure the residual add of a pre-norm block fused with the norm: the forward reads x
    /// and a residual and writes s = x + residual and y = norm(s); the backward reads s, dy
    /// and dsum (the gradient reaching s from the residual stream) and writes dx. GB/s count
    /// those four tensors once each, both ways.
    #[arg(long)]
    pub residual: bool,

    /// With --residual: the residual stream (the residual, s, dsum and the residual's
    /// gradient) kept in f32 beside f16 and bf16 x (`forward_residual_f32`,
    /// `backward_residual_f32`; f32 x is the plain residual add). GB/s count each tensor at
    /// its own width, the backward's second output (the residual's gradient in f32) too.
    #[arg(long, requires = "residual")]
    pub f32_stream: bool,

    /// Passes to measure.
    #[arg(long, value_delimiter = ',', default_values = ["fwd", "bwd"])]
    pub mode: Vec<Mode>,

    /// Storage types to measure [default: the preset's; else f16, bf16, f32].
    #[arg(long, value_delimiter = ',')]
    pub dtype: Option<Vec<Dtype>>,

    /// Timed repetitions per configuration [default: 50 on a GPU, 10 on the CPU].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub reps: Option<u32>,

    /// Untimed runs before the timed ones [default: 5 on a GPU, 2 on the CPU].
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub warmup: Option<u32>,

    /// Seed of the random inputs.
    #[arg(long, default_value_t = 20261122)]
    pub seed: u64,

    /// Writes every number as JSON (what `benches/peers.py --ours` reads).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Writes every number as CSV, one line per configuration.
    #[arg(long, value_name = "PATH")]
    pub csv: Option<PathBuf>,

    /// Draws GB/s against N, one chart per (mode, dtype, M); PNG or SVG by the file's
    /// extension. Not with `--preset latency`, whose results are tables of times.
    #[arg(long, value_name = "PATH", value_parser = plot_path)]
    pub plot: Option<PathBuf>,

    /// A `benches/peers.py --json` output of the same shapes: its peers are drawn beside ours
    /// in the plot and get their own columns in the tables.
    #[arg(long, value_name = "PATH")]
    pub peers: Option<PathBuf>,
}

/// The parsed flags, with duplicates removed (`--dtype f16,f16` measures f16 once).
pub fn parse() -> Args {
    let mut args = Args::parse();
    dedup(&mut args.mode);
    for list in [&mut args.rows, &mut args.n].into_iter().flatten() {
        dedup(list);
    }
    if let Some(dtypes) = &mut args.dtype {
        dedup(dtypes);
    }
    if args.preset == Some(Preset::Latency) && args.plot.is_some() {
        Args::command()
            .error(
                ErrorKind::ArgumentConflict,
                "--plot draws GB/s against N; `--preset latency` gives tables of times only",
            )
            .exit();
    }
    args
}

fn dedup<T: PartialEq + Copy>(items: &mut Vec<T>) {
    let mut seen = Vec::with_capacity(items.len());
    items.retain(|item| {
        if seen.contains(item) {
            return false;
        }
        seen.push(*item);
        true
    });
}

/// The most elements one `[M, N]` tensor may hold: x, dy, an output and their host copies
/// live at once, 8 GiB each in f32, which the GPU machine (80 GiB device, 128 GiB host)
/// holds and a larger size would not.
pub const MAX_ELEMENTS: usize = 1 << 31;

/// Stops with clap's usage error (exit code 2) where M x N is too large for any M and N.
pub fn check_sizes(rows: &[usize], ns: &[usize]) {
    let too_large = rows
        .iter()
        .flat_map(|&m| ns.iter().map(move |&n| (m, n)))
        .find(|&(m, n)| m.saturating_mul(n) > MAX_ELEMENTS);
    if let Some((rows, n)) = too_large {
        Args::command()
            .error(
                ErrorKind::ValueValidation,
                format!("M x N = {rows} x {n} exceeds this benchmark's limit of 2^31 elements per tensor"),
            )
            .exit();
    }
}

/// A row count or length: at least 1, at most what the library accepts.
fn dimension(s: &str) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number"))?;
    if (1..=MAX_DIM).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is outside 1..={MAX_DIM}"))
    }
}

/// A plot file: the extension picks the format, so it is checked before anything runs.
fn plot_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    match crate::plot::Format::of(&path) {
        Some(_) => Ok(path),
        None => Err(format!("`{s}` must end in .png or .svg")),
    }
}
