//! What the run prints and writes: the header, one table per (mode, dtype, M) in the layout
//! of the peers' pandas tables (or, for the latency preset, one table of times per (mode,
//! dtype)), the peers' columns beside ours where their JSON was given, and every number as
//! JSON and CSV.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use serde::Serialize;

use crate::config::{Dtype, Mode, Norm, Preset, Provider, Weights};
use crate::error::BenchError;
use crate::peers::PeerRun;
use crate::sweep::{Measurement, Outcome, Plan};
use crate::timing::{CopyBandwidth, Quantiles};

/// Where and how the run measured: the header, and the top of the JSON.
#[derive(Serialize)]
pub struct Run {
    pub norm: Norm,
    /// The residual add fused with the norm (`--residual`).
    pub residual: bool,
    /// Its stream kept in f32 (`--f32-stream`).
    pub f32_stream: bool,
    pub weights: Weights,
    /// "cuda:0 (NVIDIA H200)" or "cpu".
    pub device: String,
    /// UTC, RFC 3339 ("2026-11-22T10:11:12Z").
    pub date: String,
    pub memory: Option<Memory>,
    pub copy: CopyBandwidth,
    /// An empty kernel's launch, timed like an op (latency preset, GPU only).
    pub empty_kernel: Option<Quantiles>,
    pub preset: Option<Preset>,
    pub reps: u32,
    pub warmup: u32,
    pub seed: u64,
}

/// The GPU's memory as the driver reports it.
#[derive(Clone, Copy, Serialize)]
pub struct Memory {
    pub clock_mhz: f64,
    pub bus_width_bits: u32,
    /// 2 transfers per clock x clock x bus width: the datasheet's bandwidth.
    pub peak_gbps: f64,
}

impl Run {
    pub fn print_header(&self, plan: &Plan, l2_flush: bool, peers: Option<&PeerRun>) {
        let norm = match self.norm {
            Norm::Layer => "LayerNorm",
            Norm::Rms => "RMSNorm",
        };
        let weights = match self.weights {
            Weights::Same => "weights of the data's type",
            Weights::F32 => "f32 weights",
        };
        let residual = match (self.residual, self.f32_stream) {
            (true, true) => " with the residual add (s = x + residual), the stream in f32",
            (true, false) => " with the residual add (s = x + residual)",
            _ => "",
        };
        println!("ln-bench: {norm}{residual} bandwidth, {weights}, {}", self.date);
        print!("device: {}", self.device);
        match self.memory {
            Some(m) => println!(
                "; memory clock {:.0} MHz, bus {} bit, peak {:.0} GB/s",
                m.clock_mhz, m.bus_width_bits, m.peak_gbps
            ),
            None => println!(),
        }
        println!(
            "copy: {:.1} GB/s (bytes read + written, {:.0} MiB each way; median {:.3} ms, p20 {:.3}, p80 {:.3})",
            self.copy.gbps,
            self.copy.bytes / 2.0 / (1 << 20) as f64,
            self.copy.time.median_ms,
            self.copy.time.p20_ms,
            self.copy.time.p80_ms,
        );
        if let Some(t) = self.empty_kernel {
            println!(
                "empty kernel (one thread, PTX loaded through cudarc), timed like an op: median {:.2} us, p20 {:.2}, p80 {:.2}",
                t.median_ms * 1e3,
                t.p20_ms * 1e3,
                t.p80_ms * 1e3,
            );
        }
        let rows: Vec<String> = plan.rows.iter().map(usize::to_string).collect();
        let counted = match (self.residual, self.f32_stream) {
            (true, true) => {
                "fwd M*N*(2*bytes + 2*4) (x, y; residual, s in f32), bwd M*N*(2*bytes + 3*4) (dy, dx; s, dsum, d_residual in f32)"
            }
            (true, false) => "fwd 4*M*N*bytes (x, residual, s, y), bwd 4*M*N*bytes (s, dy, dsum, dx)",
            _ => "fwd 2*M*N*bytes, bwd 3*M*N*bytes",
        };
        println!(
            "M = {}; median of {} repetitions after {} warm-up{}; inputs seeded {}; GB/s count \
             {counted} (dgamma, dbeta inside the timed call)",
            rows.join(", "),
            self.reps,
            self.warmup,
            if l2_flush { ", L2 flushed before each" } else { "" },
            self.seed,
        );
        if let Some(peers) = peers {
            let weights = match self.weights {
                Weights::Same => "",
                Weights::F32 => " (their weights of the data's type, ours f32)",
            };
            println!("peers (benches/peers.py): {}{weights}", peers.device);
            for (peer, why) in &peers.missing {
                println!("  {peer}: not measured ({why})");
            }
        }
    }

    /// The tables, then the configurations that failed.
    pub fn print_tables(&self, plan: &Plan, results: &[Measurement], peers: Option<&PeerRun>) {
        for &mode in &plan.modes {
            for &dtype in &plan.dtypes {
                if plan.latency_tables {
                    println!("\n{}", self.latency_table(plan, results, peers, mode, dtype));
                } else {
                    for &rows in &plan.rows {
                        println!(
                            "\n{}",
                            self.bandwidth_table(plan, results, peers, (mode, dtype, rows))
                        );
                    }
                }
            }
        }
        let failed: Vec<_> = results.iter().filter(|m| m.failure().is_some()).collect();
        if !failed.is_empty() {
            println!("\n{} configuration(s) FAILED and were not timed:", failed.len());
            for m in failed {
                println!(
                    "  {} {} {} M={} N={}: {}",
                    m.mode,
                    m.dtype,
                    m.provider,
                    m.rows,
                    m.n,
                    m.failure().unwrap_or_default()
                );
            }
        }
    }

    /// N down; GB/s and % of copy per provider of ours, then GB/s per peer, across.
    fn bandwidth_table(
        &self,
        plan: &Plan,
        results: &[Measurement],
        peers: Option<&PeerRun>,
        (mode, dtype, rows): (Mode, Dtype, usize),
    ) -> String {
        let providers = mode.providers();
        let peer_names = peers.map(|p| p.providers(Some(mode))).unwrap_or_default();
        let mut header = vec![String::new(), "N".to_string()];
        for p in providers {
            header.push(p.name().to_string());
            header.push(format!("{p} % of copy"));
        }
        header.extend(peer_names.iter().map(|p| p.to_string()));
        let mut lines = Vec::new();
        for (index, &n) in plan.ns.iter().enumerate() {
            let mut line = vec![index.to_string(), n.to_string()];
            for &provider in providers {
                let found = find(results, (mode, dtype, provider, rows, n));
                let (gbps, percent) = match found.map(|m| (m, self.speed(m))) {
                    Some((_, Some((gbps, percent)))) => (format!("{gbps:.1}"), format!("{percent:.1}")),
                    Some(_) => ("FAILED".to_string(), "FAILED".to_string()),
                    None => ("-".to_string(), "-".to_string()),
                };
                line.extend([gbps, percent]);
            }
            for &peer in &peer_names {
                line.push(peer_cell(peers, (mode, dtype, peer, rows, n), |_, gbps| {
                    format!("{gbps:.1}")
                }));
            }
            lines.push(line);
        }
        format!(
            "{} ({dtype}, M={rows}), GB/s:\n{}{}",
            title(self.norm, self.residual, self.f32_stream, mode),
            aligned(&header, &lines),
            check_line(results, mode, dtype, Some(rows))
        )
    }

    /// (M, N) down; the median time in microseconds per provider of ours, then per peer,
    /// across; the empty kernel's time, the floor, in the title.
    fn latency_table(
        &self,
        plan: &Plan,
        results: &[Measurement],
        peers: Option<&PeerRun>,
        mode: Mode,
        dtype: Dtype,
    ) -> String {
        let providers = mode.providers();
        let peer_names = peers.map(|p| p.providers(Some(mode))).unwrap_or_default();
        let mut header = vec![String::new(), "M".to_string(), "N".to_string()];
        header.extend(providers.iter().map(|p| p.name().to_string()));
        header.extend(peer_names.iter().map(|p| p.to_string()));
        let shapes = plan
            .rows
            .iter()
            .flat_map(|&rows| plan.ns.iter().map(move |&n| (rows, n)));
        let mut lines = Vec::new();
        for (index, (rows, n)) in shapes.enumerate() {
            let mut line = vec![index.to_string(), rows.to_string(), n.to_string()];
            for &provider in providers {
                line.push(
                    match find(results, (mode, dtype, provider, rows, n)).map(|m| &m.outcome) {
                        Some(Outcome::Timed(t)) => format!("{:.2}", t.median_ms * 1e3),
                        Some(Outcome::Failed(_)) => "FAILED".to_string(),
                        None => "-".to_string(),
                    },
                );
            }
            for &peer in &peer_names {
                line.push(peer_cell(peers, (mode, dtype, peer, rows, n), |ms, _| {
                    format!("{:.2}", ms * 1e3)
                }));
            }
            lines.push(line);
        }
        let floor = match self.empty_kernel {
            Some(t) => format!("; empty kernel {:.2}", t.median_ms * 1e3),
            None => String::new(),
        };
        format!(
            "{} ({dtype}), median microseconds{floor}:\n{}{}",
            title(self.norm, self.residual, self.f32_stream, mode),
            aligned(&header, &lines),
            check_line(results, mode, dtype, None)
        )
    }

    /// GB/s and % of copy of a timed configuration.
    pub fn speed(&self, m: &Measurement) -> Option<(f64, f64)> {
        match &m.outcome {
            Outcome::Timed(time) => {
                let gbps = time.gbps(m.mode.bytes(m.dtype, m.rows, m.n, self.residual, self.f32_stream));
                Some((gbps, 100.0 * gbps / self.copy.gbps))
            }
            Outcome::Failed(_) => None,
        }
    }

    pub fn write_json(&self, path: &Path, results: &[Measurement]) -> Result<(), BenchError> {
        #[derive(Serialize)]
        struct Document<'a> {
            #[serde(flatten)]
            run: &'a Run,
            results: Vec<Record<'a>>,
        }
        let document = Document {
            run: self,
            results: results.iter().map(|m| self.record(m)).collect(),
        };
        let text = serde_json::to_string_pretty(&document).expect("plain data serializes");
        write(path, text + "\n")
    }

    pub fn write_csv(&self, path: &Path, results: &[Measurement]) -> Result<(), BenchError> {
        let mut text = CSV_COLUMNS.join(",") + "\n";
        for m in results {
            let r = self.record(m);
            let cells = [
                csv_text(&self.device),
                csv_text(&self.date),
                format!("{:.3}", self.copy.gbps),
                r.mode.to_string(),
                r.dtype.to_string(),
                r.provider.to_string(),
                r.m.to_string(),
                r.n.to_string(),
                r.status.to_string(),
                csv_number(r.median_ms),
                csv_number(r.p20_ms),
                csv_number(r.p80_ms),
                csv_number(r.gbps),
                csv_number(r.percent_of_copy),
                csv_number(r.check_error),
                r.tolerance.to_string(),
                r.failure.map(csv_text).unwrap_or_default(),
            ];
            text += &(cells.join(",") + "\n");
        }
        write(path, text)
    }

    fn record<'a>(&self, m: &'a Measurement) -> Record<'a> {
        let time = match &m.outcome {
            Outcome::Timed(t) => Some(t),
            Outcome::Failed(_) => None,
        };
        let speed = self.speed(m);
        Record {
            mode: m.mode,
            dtype: m.dtype,
            provider: m.provider,
            m: m.rows,
            n: m.n,
            status: if time.is_some() { "ok" } else { "failed" },
            median_ms: time.map(|t| t.median_ms),
            p20_ms: time.map(|t| t.p20_ms),
            p80_ms: time.map(|t| t.p80_ms),
            gbps: speed.map(|s| s.0),
            percent_of_copy: speed.map(|s| s.1),
            // JSON has no infinity: a NaN output is reported by `failure` instead.
            check_error: m.check_error.filter(|e| e.is_finite()),
            tolerance: m.dtype.tolerance(),
            failure: m.failure(),
        }
    }
}

/// "layer-norm-forward", "rms-norm-residual-backward", ...: the peers' table names (the
/// f32 stream's, "-residual-f32-", none of theirs).
fn title(norm: Norm, residual: bool, f32_stream: bool, mode: Mode) -> String {
    let pass = match mode {
        Mode::Fwd => "forward",
        Mode::Bwd => "backward",
    };
    let residual = match (residual, f32_stream) {
        (true, true) => "-residual-f32",
        (true, false) => "-residual",
        _ => "",
    };
    format!("{}{residual}-{pass}", norm.name())
}

/// The largest check error of ours in (mode, dtype), at M = `rows` or at every M.
fn check_line(results: &[Measurement], mode: Mode, dtype: Dtype, rows: Option<usize>) -> String {
    let worst = results
        .iter()
        .filter(|m| (m.mode, m.dtype) == (mode, dtype) && rows.is_none_or(|rows| m.rows == rows))
        .filter_map(|m| m.check_error)
        .fold(0.0, f64::max);
    format!(
        "checked against float64 first: largest relative error {worst:.1e} (tolerance {:.1e})",
        dtype.tolerance()
    )
}

/// Our measurement of one (mode, dtype, provider, M, N).
fn find(results: &[Measurement], key: (Mode, Dtype, Provider, usize, usize)) -> Option<&Measurement> {
    results
        .iter()
        .find(|m| (m.mode, m.dtype, m.provider, m.rows, m.n) == key)
}

/// A peer's cell: `show(median ms, GB/s)` where it was timed, else why not.
fn peer_cell(
    peers: Option<&PeerRun>,
    (mode, dtype, peer, rows, n): (Mode, Dtype, &str, usize, usize),
    show: impl Fn(f64, f64) -> String,
) -> String {
    match peers.and_then(|p| p.find(mode, dtype, peer, rows, n)) {
        Some(r) => match r.timed() {
            Some((ms, gbps)) => show(ms, gbps),
            None => r.untimed().to_string(),
        },
        None => "-".to_string(),
    }
}

impl Measurement {
    fn failure(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Failed(why) => Some(why),
            Outcome::Timed(_) => None,
        }
    }
}

/// One configuration in the JSON and CSV.
#[derive(Serialize)]
struct Record<'a> {
    mode: Mode,
    dtype: Dtype,
    provider: Provider,
    m: usize,
    n: usize,
    status: &'static str,
    median_ms: Option<f64>,
    p20_ms: Option<f64>,
    p80_ms: Option<f64>,
    gbps: Option<f64>,
    percent_of_copy: Option<f64>,
    check_error: Option<f64>,
    tolerance: f64,
    failure: Option<&'a str>,
}

const CSV_COLUMNS: [&str; 17] = [
    "device",
    "date",
    "copy_gbps",
    "mode",
    "dtype",
    "provider",
    "m",
    "n",
    "status",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "gbps",
    "percent_of_copy",
    "check_error",
    "tolerance",
    "failure",
];

fn csv_number(v: Option<f64>) -> String {
    v.map(|v| format!("{v}")).unwrap_or_default()
}

/// A CSV field, quoted where it holds a separator or a quote.
fn csv_text(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn write(path: &Path, text: String) -> Result<(), BenchError> {
    fs::write(path, text).map_err(|source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Right-aligned columns separated by two spaces, the index column left as pandas prints.
fn aligned(header: &[String], rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for line in std::iter::once(header).chain(rows.iter().map(Vec::as_slice)) {
        for (c, (cell, width)) in line.iter().zip(&widths).enumerate() {
            let _ = match c {
                0 => write!(out, "{cell:<width$}"),
                _ => write!(out, "  {cell:>width$}"),
            };
        }
        out.push('\n');
    }
    out
}
