//! The sweep: for each dtype and N, random inputs and their float64 reference, then each
//! (mode, provider) checked and, if right, timed. One norm per run (LayerNorm or RMSNorm).

use indicatif::ProgressBar;
use layernorm_cuda::{
    BackwardMode, Context, Device, Element, Gradients, LayerNorm, RmsNorm, Tensor, Weight, bf16, f16,
};

use crate::check::{Check, Reference};
use crate::config::{Dtype, Mode, Norm, Provider, Weights};
use crate::error::BenchError;
use crate::inputs::Inputs;
use crate::timing::{Quantiles, Timer};

/// The norms' eps, as in the peers' benchmarks.
const EPS: f32 = 1e-5;

/// What to measure.
pub struct Plan {
    pub norm: Norm,
    /// The residual add fused with the norm (`forward_residual`, `backward_residual`).
    pub residual: bool,
    pub weights: Weights,
    pub rows: Vec<usize>,
    pub ns: Vec<usize>,
    pub modes: Vec<Mode>,
    pub dtypes: Vec<Dtype>,
    pub seed: u64,
    /// Tables of times in microseconds (small M, where launches dominate) instead of GB/s.
    pub latency_tables: bool,
}

impl Plan {
    /// Every (dtype, M, N, mode, provider) of the plan, in the order they run.
    pub fn configurations(&self) -> usize {
        let per_shape: usize = self.modes.iter().map(|m| m.providers().len()).sum();
        self.dtypes.len() * self.rows.len() * self.ns.len() * per_shape
    }
}

/// One configuration's result.
pub struct Measurement {
    pub mode: Mode,
    pub dtype: Dtype,
    pub provider: Provider,
    pub rows: usize,
    pub n: usize,
    /// None where the configuration failed before its outputs could be compared.
    pub check_error: Option<f64>,
    pub outcome: Outcome,
}

pub enum Outcome {
    Timed(Quantiles),
    /// A wrong output or an error: never timed.
    Failed(String),
}

/// Runs the whole plan; a failing configuration is recorded and the sweep goes on.
pub fn run(plan: &Plan, device: &Device, timer: &mut Timer, progress: &ProgressBar) -> Vec<Measurement> {
    let mut results = Vec::with_capacity(plan.configurations());
    for &dtype in &plan.dtypes {
        for &rows in &plan.rows {
            for &n in &plan.ns {
                let mut sweep = Sweep {
                    plan,
                    device,
                    timer: &mut *timer,
                    progress,
                    dtype,
                    rows,
                    n,
                    results: &mut results,
                };
                match (dtype, plan.weights) {
                    (Dtype::F16, Weights::Same) => sweep.run_shape::<f16, f16>(),
                    (Dtype::F16, Weights::F32) => sweep.run_shape::<f16, f32>(),
                    (Dtype::Bf16, Weights::Same) => sweep.run_shape::<bf16, bf16>(),
                    (Dtype::Bf16, Weights::F32) => sweep.run_shape::<bf16, f32>(),
                    (Dtype::F32, _) => sweep.run_shape::<f32, f32>(),
                }
            }
        }
    }
    results
}

/// One (dtype, M, N) of the sweep.
struct Sweep<'a> {
    plan: &'a Plan,
    device: &'a Device,
    timer: &'a mut Timer,
    progress: &'a ProgressBar,
    dtype: Dtype,
    rows: usize,
    n: usize,
    results: &'a mut Vec<Measurement>,
}

impl Sweep<'_> {
    /// Rows of `T` with weights of `W` (the inputs' weights, widened where `W` is wider).
    fn run_shape<T: Element, W: Weight<T>>(&mut self) {
        let rows = self.rows;
        self.progress.set_message(format!(
            "{} M={rows} N={}: inputs and float64 reference",
            self.dtype, self.n
        ));
        let inputs = Inputs::<T>::random(rows, self.n, self.plan.seed, self.plan.residual);
        let reference = Reference::compute(&inputs, EPS as f64, self.plan.norm);
        let uploaded = self.upload(&inputs);
        for &mode in &self.plan.modes {
            for &provider in mode.providers() {
                self.progress
                    .set_message(format!("{mode} {} M={rows} N={} {provider}", self.dtype, self.n));
                let (check_error, outcome) = match &uploaded {
                    Ok(operands) => self.measure::<T, W>(mode, provider, &inputs, operands, &reference),
                    Err(e) => (None, Outcome::Failed(format!("uploading the inputs: {e}"))),
                };
                self.results.push(Measurement {
                    mode,
                    dtype: self.dtype,
                    provider,
                    rows,
                    n: self.n,
                    check_error,
                    outcome,
                });
                self.progress.inc(1);
            }
        }
    }

    /// The inputs on the device.
    fn upload<T: Element>(&self, inputs: &Inputs<T>) -> layernorm_cuda::Result<Operands<T>> {
        let residual = inputs
            .residual
            .as_ref()
            .map(|r| {
                Ok((
                    self.device.upload(r.residual.view())?,
                    self.device.upload(r.dsum.view())?,
                ))
            })
            .transpose()?;
        Ok(Operands {
            x: self.device.upload(inputs.x.view())?,
            dy: self.device.upload(inputs.dy.view())?,
            residual,
        })
    }

    /// Checks one configuration, then times it if the check passed.
    fn measure<T: Element, W: Weight<T>>(
        &mut self,
        mode: Mode,
        provider: Provider,
        inputs: &Inputs<T>,
        operands: &Operands<T>,
        reference: &Reference,
    ) -> (Option<f64>, Outcome) {
        let measured = Op::<T, W>::new(self.plan.norm, self.device, inputs, provider.backward_mode())
            .map_err(BenchError::from)
            .and_then(|op| match mode {
                Mode::Fwd => self.forward(&op, operands, reference),
                Mode::Bwd => self.backward(&op, operands, reference),
            });
        measured.unwrap_or_else(|e| (None, Outcome::Failed(e.to_string())))
    }

    fn forward<T: Element, W: Weight<T>>(
        &mut self,
        op: &Op<T, W>,
        Operands { x, residual, .. }: &Operands<T>,
        reference: &Reference,
    ) -> Result<(Option<f64>, Outcome), BenchError> {
        let mut y = poisoned(self.device, x.shape())?;
        let Some((residual, _)) = residual else {
            op.forward_into(x, &mut y)?;
            let check = reference.check_forward(&y.to_vec()?, None);
            return Ok(self.time_if_right(check, || {
                op.forward_into(x, &mut y)?;
                Ok(())
            }));
        };
        let mut sum = poisoned(self.device, x.shape())?;
        op.forward_residual_into(x, residual, &mut y, &mut sum)?;
        let check = reference.check_forward(&y.to_vec()?, Some(&sum.to_vec()?));
        Ok(self.time_if_right(check, || {
            op.forward_residual_into(x, residual, &mut y, &mut sum)?;
            Ok(())
        }))
    }

    fn backward<T: Element, W: Weight<T>>(
        &mut self,
        op: &Op<T, W>,
        Operands { x, dy, residual }: &Operands<T>,
        reference: &Reference,
    ) -> Result<(Option<f64>, Outcome), BenchError> {
        // With the residual add, the context holds s, and dx takes dsum.
        let (ctx, dsum) = match residual {
            Some((residual, dsum)) => (op.forward_residual(x, residual)?, Some(dsum)),
            None => (op.forward(x)?, None),
        };
        // Every parameter the op has gets its gradient: gamma always, beta for LayerNorm.
        let mut grads = Gradients {
            dx: poisoned(self.device, x.shape())?,
            dgamma: Some(poisoned::<W>(self.device, &[self.n])?),
            dbeta: match op {
                Op::Layer(_) => Some(poisoned::<W>(self.device, &[self.n])?),
                Op::Rms(_) => None,
            },
        };
        op.backward_residual_into(&ctx, dy, dsum, &mut grads)?;
        let Some(dgamma) = &grads.dgamma else {
            unreachable!("backward_into refuses gradients that do not match the op's parameters")
        };
        let dbeta = grads.dbeta.as_ref().map(Tensor::to_vec).transpose()?;
        let check = reference.check_backward(&grads.dx.to_vec()?, &dgamma.to_vec()?, dbeta.as_deref());
        // The parameters' gradients are part of the op: the whole call is timed.
        Ok(self.time_if_right(check, || {
            Ok(op.backward_residual_into(&ctx, dy, dsum, &mut grads)?)
        }))
    }

    /// Times `op` if `check` passed; a wrong kernel gets no time.
    fn time_if_right(
        &mut self,
        check: Check,
        op: impl FnMut() -> Result<(), BenchError>,
    ) -> (Option<f64>, Outcome) {
        let outcome = match check.failure(self.dtype.tolerance()) {
            Some(why) => Outcome::Failed(why),
            None => match self.timer.time(op) {
                Ok(time) => Outcome::Timed(time),
                Err(e) => Outcome::Failed(e.to_string()),
            },
        };
        (Some(check.error), outcome)
    }
}

/// The inputs on the device: x, dy, and with the residual add the residual and dsum.
struct Operands<T: Element> {
    x: Tensor<T>,
    dy: Tensor<T>,
    residual: Option<(Tensor<T>, Tensor<T>)>,
}

/// The op measured, built from the inputs' weights (in `W`): LayerNorm with gamma and beta,
/// or RMSNorm with gamma.
enum Op<T: Element, W: Element> {
    Layer(LayerNorm<T, W>),
    Rms(RmsNorm<T, W>),
}

impl<T: Element, W: Weight<T>> Op<T, W> {
    fn new(
        norm: Norm,
        device: &Device,
        inputs: &Inputs<T>,
        mode: BackwardMode,
    ) -> layernorm_cuda::Result<Op<T, W>> {
        let widened = |v: &ndarray::Array1<T>| v.mapv(|e| W::from_f32(e.to_f32()));
        let (gamma, beta) = (widened(&inputs.gamma), widened(&inputs.beta));
        Ok(match norm {
            Norm::Layer => Op::Layer(
                LayerNorm::from_arrays(device, gamma.view(), beta.view(), EPS)?.with_backward_mode(mode)?,
            ),
            Norm::Rms => Op::Rms(RmsNorm::from_array(device, gamma.view(), EPS)?.with_backward_mode(mode)?),
        })
    }

    fn forward_into(&self, x: &Tensor<T>, y: &mut Tensor<T>) -> layernorm_cuda::Result<Context<T>> {
        match self {
            Op::Layer(op) => op.forward_into(x, y),
            Op::Rms(op) => op.forward_into(x, y),
        }
    }

    fn forward(&self, x: &Tensor<T>) -> layernorm_cuda::Result<Context<T>> {
        match self {
            Op::Layer(op) => op.forward(x).map(|(_, ctx)| ctx),
            Op::Rms(op) => op.forward(x).map(|(_, ctx)| ctx),
        }
    }

    fn forward_residual_into(
        &self,
        x: &Tensor<T>,
        residual: &Tensor<T>,
        y: &mut Tensor<T>,
        sum: &mut Tensor<T>,
    ) -> layernorm_cuda::Result<Context<T>> {
        match self {
            Op::Layer(op) => op.forward_residual_into(x, residual, y, sum),
            Op::Rms(op) => op.forward_residual_into(x, residual, y, sum),
        }
    }

    /// The context of the residual forward (it holds s).
    fn forward_residual(&self, x: &Tensor<T>, residual: &Tensor<T>) -> layernorm_cuda::Result<Context<T>> {
        match self {
            Op::Layer(op) => op.forward_residual(x, residual).map(|(_, _, ctx)| ctx),
            Op::Rms(op) => op.forward_residual(x, residual).map(|(_, _, ctx)| ctx),
        }
    }

    /// The backward, with dsum where the forward had the residual add (`backward_into`
    /// where it is None).
    fn backward_residual_into(
        &self,
        ctx: &Context<T>,
        dy: &Tensor<T>,
        dsum: Option<&Tensor<T>>,
        grads: &mut Gradients<T, W>,
    ) -> layernorm_cuda::Result<()> {
        match self {
            Op::Layer(op) => op.backward_residual_into(ctx, dy, dsum, grads),
            Op::Rms(op) => op.backward_residual_into(ctx, dy, dsum, grads),
        }
    }
}

/// A tensor full of NaN, so that an element the op leaves unwritten fails the check.
fn poisoned<T: Element>(device: &Device, shape: &[usize]) -> Result<Tensor<T>, BenchError> {
    Ok(device.full(shape, T::from_f32(f32::NAN))?)
}
