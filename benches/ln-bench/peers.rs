//! The peers' numbers, read from a `benches/peers.py --json` output, to show beside ours.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde::Deserialize;

use crate::config::{Dtype, Mode, Norm};
use crate::error::BenchError;

/// What peers.py measured: the fields ln-bench shows; the rest of its JSON is ignored.
#[derive(Deserialize)]
pub struct PeerRun {
    pub device: String,
    /// The norm the peers ran; files written before RMSNorm was measured hold LayerNorm.
    #[serde(default = "layer_norm")]
    pub norm: Norm,
    /// Whether the peers ran the residual add with the norm (files before it: no).
    #[serde(default)]
    pub residual: bool,
    /// Whether its residual stream was in f32 (`peers.py --f32-stream`; files before it: no).
    #[serde(default)]
    pub f32_stream: bool,
    pub results: Vec<PeerRecord>,
    /// Peers that could not be imported, with the reason.
    #[serde(default)]
    pub missing: BTreeMap<String, String>,
}

/// One peer's configuration: timed ("ok"), or "failed" its check, or "n/a" (it cannot run
/// this shape, e.g. the Triton tutorial's rows past 64 KB).
#[derive(Deserialize)]
pub struct PeerRecord {
    pub mode: Mode,
    pub dtype: Dtype,
    pub provider: String,
    pub m: usize,
    pub n: usize,
    pub status: String,
    pub median_ms: Option<f64>,
    pub gbps: Option<f64>,
}

fn layer_norm() -> Norm {
    Norm::Layer
}

impl PeerRun {
    /// The peers' run at `path`, which must have measured `norm`, with the residual add or
    /// without, its stream in f32 or not, as this run: other numbers beside ours would
    /// compare different operations.
    pub fn read(path: &Path, norm: Norm, residual: bool, f32_stream: bool) -> Result<PeerRun, BenchError> {
        let unreadable = |reason: String| BenchError::Peers {
            path: path.to_path_buf(),
            reason,
        };
        let text = fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?;
        let run: PeerRun = serde_json::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
        if run.norm != norm {
            return Err(unreadable(format!(
                "it measured {}, this run measures {} (peers.py --norm)",
                run.norm.name(),
                norm.name()
            )));
        }
        if run.residual != residual {
            let with = |r: bool| if r { "with" } else { "without" };
            return Err(unreadable(format!(
                "it measured the norm {} the residual add, this run {} it (peers.py --residual)",
                with(run.residual),
                with(residual)
            )));
        }
        if run.f32_stream != f32_stream {
            let kept = |f: bool| if f { "in f32" } else { "in x's type" };
            return Err(unreadable(format!(
                "it kept the residual stream {}, this run {} (peers.py --f32-stream)",
                kept(run.f32_stream),
                kept(f32_stream)
            )));
        }
        Ok(run)
    }

    /// The peers measured in `mode` (in any, for None), in the order peers.py ran them.
    pub fn providers(&self, mode: Option<Mode>) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for r in self
            .results
            .iter()
            .filter(|r| mode.is_none_or(|mode| r.mode == mode))
        {
            if !names.contains(&r.provider.as_str()) {
                names.push(&r.provider);
            }
        }
        names
    }

    /// The record of one configuration, if peers.py measured it.
    pub fn find(&self, mode: Mode, dtype: Dtype, provider: &str, m: usize, n: usize) -> Option<&PeerRecord> {
        self.results
            .iter()
            .find(|r| (r.mode, r.dtype, r.m, r.n) == (mode, dtype, m, n) && r.provider == provider)
    }
}

impl PeerRecord {
    /// The median time in ms and GB/s, where the peer timed this configuration.
    pub fn timed(&self) -> Option<(f64, f64)> {
        match (self.status.as_str(), self.median_ms, self.gbps) {
            ("ok", Some(ms), Some(gbps)) => Some((ms, gbps)),
            _ => None,
        }
    }

    /// What a table says where the peer has no time: a failed check, or a shape it cannot run.
    pub fn untimed(&self) -> &'static str {
        if self.status == "failed" { "FAILED" } else { "n/a" }
    }
}
