//! What one measurement is: a pass (mode), a storage type (dtype) and an implementation
//! (provider), with the byte count its GB/s are computed from and its check tolerance.

use std::fmt;

use clap::ValueEnum;
use layernorm_cuda::BackwardMode;
use serde::{Deserialize, Serialize};

/// A named set of shapes, measured the same way in ln-bench and `benches/peers.py`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// Realistic transformer shapes: bf16, M = 16384 and 65536 (tokens per batch), N = 768 to
    /// 8192 (hidden sizes of BERT-base to 70B-class models); GB/s tables.
    Llm,
    /// Small batches, where launch and synchronization costs dominate: bf16, M = 1, 8, 64,
    /// 512, N = 4096 and 8192; tables in microseconds beside an empty kernel's launch.
    Latency,
}

impl Preset {
    pub fn rows(self) -> &'static [usize] {
        match self {
            Preset::Llm => &[16384, 65536],
            Preset::Latency => &[1, 8, 64, 512],
        }
    }

    pub fn ns(self) -> &'static [usize] {
        match self {
            Preset::Llm => &[768, 1024, 2048, 4096, 5120, 8192],
            Preset::Latency => &[4096, 8192],
        }
    }

    pub fn dtypes(self) -> &'static [Dtype] {
        &[Dtype::Bf16]
    }
}

/// The normalization measured: LayerNorm (centered rows, gamma and beta) or RMSNorm (rows
/// not centered, gamma only). Its bytes are counted the same way: each of x, dy, y and dx
/// once; the weights and row statistics are small beside them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    Layer,
    Rms,
}

/// The weights' type (gamma and beta, and their gradients): the data's own, or f32 beside
/// f16 and bf16 data (mixed precision; f32 data has f32 weights either way). The bytes are
/// counted the same way: the weights are small beside the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Weights {
    /// The data's type.
    Same,
    F32,
}

impl Norm {
    /// The name the tables use: "layer-norm" or "rms-norm", as in the peers' tables.
    pub fn name(self) -> &'static str {
        match self {
            Norm::Layer => "layer-norm",
            Norm::Rms => "rms-norm",
        }
    }
}

/// The pass measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Fwd,
    Bwd,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Fwd => "fwd",
            Mode::Bwd => "bwd",
        }
    }

    /// The providers measured in this pass, in table order.
    pub fn providers(self) -> &'static [Provider] {
        match self {
            Mode::Fwd => &[Provider::Ours],
            Mode::Bwd => &[Provider::OursDeterministic, Provider::OursLocked],
        }
    }

    /// Bytes the pass must move, as the peers count them: forward reads x and writes y;
    /// backward reads x and dy and writes dx; with the `residual` add, forward reads x and
    /// the residual and writes s and y, backward reads s, dy and dsum and writes dx (gamma,
    /// beta, dgamma, dbeta and the row statistics are small beside these and not counted).
    /// With the stream in f32 (`f32_stream`), the residual, s and dsum count 4 bytes an
    /// element, and the backward also writes the residual's gradient (f32).
    pub fn bytes(self, dtype: Dtype, rows: usize, n: usize, residual: bool, f32_stream: bool) -> f64 {
        let x = dtype.bytes() as f64;
        let stream = if f32_stream { 4.0 } else { x };
        let per_element = match (self, residual) {
            (Mode::Fwd, true) => 2.0 * x + 2.0 * stream,
            (Mode::Bwd, true) if f32_stream => 2.0 * x + 3.0 * stream,
            (Mode::Bwd, true) => 2.0 * x + 2.0 * stream,
            (Mode::Fwd, false) => 2.0 * x,
            (Mode::Bwd, false) => 3.0 * x,
        };
        per_element * rows as f64 * n as f64
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The storage type of x, y, gamma, beta and the gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F16,
    Bf16,
    F32,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// The largest accepted ||out - ref|| / ||ref|| against the float64 reference. Outputs
    /// are rounded to the storage type, which alone costs up to one unit roundoff per
    /// element (f16 2^-11, bf16 2^-8): four of them leave room for f32 arithmetic, yet a
    /// wrong kernel (a missed element, a wrong statistic) lands orders of magnitude above.
    /// f32's own roundoff (2^-24) is far below what f32 sums over 65536-element rows and
    /// 4096-row columns can promise, so f32 gets 1e-4.
    pub fn tolerance(self) -> f64 {
        let unit_roundoff = match self {
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
            Dtype::F32 => 2f64.powi(-24),
        };
        (4.0 * unit_roundoff).max(1e-4)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An implementation measured: this crate's forward, or its backward in one of its modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Provider {
    #[serde(rename = "ours")]
    Ours,
    #[serde(rename = "ours-deterministic")]
    OursDeterministic,
    #[serde(rename = "ours-locked")]
    OursLocked,
}

impl Provider {
    pub fn name(self) -> &'static str {
        match self {
            Provider::Ours => "ours",
            Provider::OursDeterministic => "ours-deterministic",
            Provider::OursLocked => "ours-locked",
        }
    }

    /// The backward mode this provider runs (the forward has none: `Ours` gets the default).
    pub fn backward_mode(self) -> BackwardMode {
        match self {
            Provider::Ours | Provider::OursDeterministic => BackwardMode::Deterministic,
            Provider::OursLocked => BackwardMode::Locked { groups: None },
        }
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
