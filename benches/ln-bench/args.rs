//! Command-line flags. clap reports a bad flag or value itself and exits with code 2.

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use layernorm_cuda::MAX_DIM;

use crate::config::{Dtype, Mode};

/// LayerNorm forward and backward bandwidth on the GPU (GB/s against N at fixed M), each
/// configuration checked against a float64 reference before it is timed. Without a CUDA
/// device it runs the CPU path on smaller sizes instead.
#[derive(Parser, Debug)]
#[command(name = "ln-bench", version)]
pub struct Args {
    /// Rows M [default: 4096 on a GPU, 256 on the CPU].
    #[arg(long, value_parser = dimension)]
    pub rows: Option<usize>,

    /// Row lengths N, comma-separated [default: 1024, 1536, ..., 15872, 32768, 65536 on a GPU;
    /// 512, 1024, 2048, 4096 on the CPU].
    #[arg(long, value_delimiter = ',', value_parser = dimension, conflicts_with = "quick")]
    pub n: Option<Vec<usize>>,

    /// A short list of N for a smoke run: 1024, 4096, 8192, 32768.
    #[arg(long)]
    pub quick: bool,

    /// Passes to measure.
    #[arg(long, value_delimiter = ',', default_values = ["fwd", "bwd"])]
    pub mode: Vec<Mode>,

    /// Storage types to measure.
    #[arg(long, value_delimiter = ',', default_values = ["f16", "bf16", "f32"])]
    pub dtype: Vec<Dtype>,

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

    /// Draws GB/s against N, one chart per dtype; PNG or SVG by the file's extension.
    #[arg(long, value_name = "PATH", value_parser = plot_path)]
    pub plot: Option<PathBuf>,
}

/// The parsed flags, with duplicates removed (`--dtype f16,f16` measures f16 once).
pub fn parse() -> Args {
    let mut args = Args::parse();
    dedup(&mut args.mode);
    dedup(&mut args.dtype);
    if let Some(n) = &mut args.n {
        dedup(n);
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

/// Stops with clap's usage error (exit code 2) where M x N is too large for any N.
pub fn check_sizes(rows: usize, ns: &[usize]) {
    if let Some(n) = ns.iter().find(|&&n| rows.saturating_mul(n) > MAX_ELEMENTS) {
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
