//! What the run prints and writes: the header, one table per (mode, dtype) in the layout of
//! the peers' pandas tables, and every number as JSON and CSV.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use serde::Serialize;

use crate::config::{Dtype, Mode, Provider};
use crate::error::BenchError;
use crate::sweep::{Measurement, Outcome, Plan};
use crate::timing::CopyBandwidth;

/// Where and how the run measured: the header, and the top of the JSON.
#[derive(Serialize)]
pub struct Run {
    /// "cuda:0 (NVIDIA H200)" or "cpu".
    pub device: String,
    /// UTC, RFC 3339 ("2026-11-22T10:11:12Z").
    pub date: String,
    pub memory: Option<Memory>,
    pub copy: CopyBandwidth,
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
    pub fn print_header(&self, plan: &Plan, l2_flush: bool) {
        println!("ln-bench: LayerNorm bandwidth, {}", self.date);
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
        println!(
            "M = {}; median of {} repetitions after {} warm-up{}; inputs seeded {}; GB/s count \
             fwd 2*M*N*bytes, bwd 3*M*N*bytes (dgamma, dbeta inside the timed call)",
            plan.rows,
            self.reps,
            self.warmup,
            if l2_flush { ", L2 flushed before each" } else { "" },
            self.seed,
        );
    }

    /// One table per (mode, dtype): N down, GB/s and % of copy per provider across.
    pub fn print_tables(&self, plan: &Plan, results: &[Measurement]) {
        for &mode in &plan.modes {
            for &dtype in &plan.dtypes {
                println!("\n{}", self.table(plan, results, mode, dtype));
            }
        }
        let failed: Vec<_> = results.iter().filter(|m| m.failure().is_some()).collect();
        if !failed.is_empty() {
            println!("\n{} configuration(s) FAILED and were not timed:", failed.len());
            for m in failed {
                println!(
                    "  {} {} {} N={}: {}",
                    m.mode,
                    m.dtype,
                    m.provider,
                    m.n,
                    m.failure().unwrap_or_default()
                );
            }
        }
    }

    fn table(&self, plan: &Plan, results: &[Measurement], mode: Mode, dtype: Dtype) -> String {
        let providers = mode.providers();
        let mut header = vec![String::new(), "N".to_string()];
        for p in providers {
            header.push(p.name().to_string());
            header.push(format!("{p} % of copy"));
        }
        let mut rows = Vec::new();
        let mut worst_error: f64 = 0.0;
        for (index, &n) in plan.ns.iter().enumerate() {
            let mut row = vec![index.to_string(), n.to_string()];
            for &provider in providers {
                let found = results
                    .iter()
                    .find(|m| (m.mode, m.dtype, m.provider, m.n) == (mode, dtype, provider, n));
                let (gbps, percent) = match found.map(|m| (m, self.speed(m))) {
                    Some((_, Some((gbps, percent)))) => (format!("{gbps:.1}"), format!("{percent:.1}")),
                    Some(_) => ("FAILED".to_string(), "FAILED".to_string()),
                    None => ("-".to_string(), "-".to_string()),
                };
                row.extend([gbps, percent]);
                if let Some(e) = found.and_then(|m| m.check_error) {
                    worst_error = worst_error.max(e);
                }
            }
            rows.push(row);
        }
        let title = match mode {
            Mode::Fwd => "layer-norm-forward",
            Mode::Bwd => "layer-norm-backward",
        };
        let mut out = format!("{title} ({dtype}, M={}), GB/s:\n", plan.rows);
        out += &aligned(&header, &rows);
        let _ = write!(
            out,
            "checked against float64 first: largest relative error {worst_error:.1e} (tolerance {:.1e})",
            dtype.tolerance()
        );
        out
    }

    /// GB/s and % of copy of a timed configuration.
    pub fn speed(&self, m: &Measurement) -> Option<(f64, f64)> {
        match &m.outcome {
            Outcome::Timed(time) => {
                let gbps = time.gbps(m.mode.bytes(m.dtype, m.rows, m.n));
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
