//! The sweep: for each dtype and N, random inputs and their float64 reference, then each
//! (mode, provider) checked and, if right, timed. One norm per run (LayerNorm or RMSNorm).

use indicatif::ProgressBar;
use layernorm_cuda::{
    BackwardMode, Context, Device, Element, F32StreamContext, Gradients, LayerNorm, RmsNorm, Tensor, Weight,
    bf16, f16,
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
    /// Its stream kept in f32 beside f16/bf16 x (`forward_residual_f32`, ...).
    pub f32_stream: bool,
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
                match (dtype, plan.weights, plan.f32_stream) {
                    (Dtype::F16, Weights::Same, false) => sweep.run_shape::<f16, f16, f16>(),
                    (Dtype::F16, Weights::F32, false) => sweep.run_shape::<f16, f32, f16>(),
                    (Dtype::Bf16, Weights::Same, false) => sweep.run_shape::<bf16, bf16, bf16>(),
                    (Dtype::Bf16, Weights::F32, false) => sweep.run_shape::<bf16, f32, bf16>(),
                    (Dtype::F16, Weights::Same, true) => sweep.run_shape::<f16, f16, f32>(),
                    (Dtype::F16, Weights::F32, true) => sweep.run_shape::<f16, f32, f32>(),
                    (Dtype::Bf16, Weights::Same, true) => sweep.run_shape::<bf16, bf16, f32>(),
                    (Dtype::Bf16, Weights::F32, true) => sweep.run_shape::<bf16, f32, f32>(),
                    (Dtype::F32, _, _) => sweep.run_shape::<f32, f32, f32>(),
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
    /// Rows of `T` with weights of `W` (the inputs' weights, widened where `W` is wider)
    /// and a residual stream of `R`.
    fn run_shape<T: Element, W: Weight<T>, R: Stream<T>>(&mut self) {
        let rows = self.rows;
        self.progress.set_message(format!(
            "{} M={rows} N={}: inputs and float64 reference",
            self.dtype, self.n
        ));
        let inputs = Inputs::<T, R>::random(rows, self.n, self.plan.seed, self.plan.residual);
        let reference = Reference::compute(&inputs, EPS as f64, self.plan.norm);
        let uploaded = self.upload(&inputs);
        for &mode in &self.plan.modes {
            for &provider in mode.providers() {
                self.progress
                    .set_message(format!("{mode} {} M={rows} N={} {provider}", self.dtype, self.n));
                let (check_error, outcome) = match &uploaded {
                    Ok(operands) => self.measure::<T, W, R>(mode, provider, &inputs, operands, &reference),
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
    fn upload<T: Element, R: Element>(
        &self,
        inputs: &Inputs<T, R>,
    ) -> layernorm_cuda::Result<Operands<T, R>> {
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
    fn measure<T: Element, W: Weight<T>, R: Stream<T>>(
        &mut self,
        mode: Mode,
        provider: Provider,
        inputs: &Inputs<T, R>,
        operands: &Operands<T, R>,
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

    fn forward<T: Element, W: Weight<T>, R: Stream<T>>(
        &mut self,
        op: &Op<T, W>,
        Operands { x, residual, .. }: &Operands<T, R>,
        reference: &Reference,
    ) -> Result<(Option<f64>, Outcome), BenchError> {
        let mut y = poisoned(self.device, x.shape())?;
        let Some((residual, _)) = residual else {
            op.forward_into(x, &mut y)?;
            let check = reference.check_forward::<T, T>(&y.to_vec()?, None);
            return Ok(self.time_if_right(check, || {
                op.forward_into(x, &mut y)?;
                Ok(())
            }));
        };
        let mut sum = poisoned::<R>(self.device, x.shape())?;
        R::forward_into(op, x, residual, &mut y, &mut sum)?;
        let check = reference.check_forward(&y.to_vec()?, Some(&sum.to_vec()?));
        Ok(self.time_if_right(check, || {
            R::forward_into(op, x, residual, &mut y, &mut sum)?;
            Ok(())
        }))
    }

    fn backward<T: Element, W: Weight<T>, R: Stream<T>>(
        &mut self,
        op: &Op<T, W>,
        Operands { x, dy, residual }: &Operands<T, R>,
        reference: &Reference,
    ) -> Result<(Option<f64>, Outcome), BenchError> {
        // Every parameter the op has gets its gradient: gamma always, beta for LayerNorm.
        let mut grads = Gradients {
            dx: poisoned(self.device, x.shape())?,
            dgamma: Some(poisoned::<W>(self.device, &[self.n])?),
            dbeta: match op {
                Op::Layer(_) => Some(poisoned::<W>(self.device, &[self.n])?),
                Op::Rms(_) => None,
            },
        };
        let Some((residual, dsum)) = residual else {
            let ctx = op.forward(x)?;
            op.backward_into(&ctx, dy, &mut grads)?;
            let check = self.check_gradients::<T, W, T>(reference, &grads, None)?;
            // The parameters' gradients are part of the op: the whole call is timed.
            return Ok(self.time_if_right(check, || Ok(op.backward_into(&ctx, dy, &mut grads)?)));
        };
        // With the residual add, the context holds s, and dx takes dsum; with the stream in
        // f32, the residual's gradient is a second output.
        let ctx = {
            let (mut y, mut sum) = (
                poisoned(self.device, x.shape())?,
                poisoned::<R>(self.device, x.shape())?,
            );
            R::forward_into(op, x, residual, &mut y, &mut sum)?
        };
        let mut d_residual = R::d_residual(self.device, x.shape())?;
        R::backward_into(op, &ctx, dy, dsum, &mut grads, d_residual.as_mut())?;
        let check = self.check_gradients(reference, &grads, d_residual.as_ref())?;
        Ok(self.time_if_right(check, || {
            Ok(R::backward_into(
                op,
                &ctx,
                dy,
                dsum,
                &mut grads,
                d_residual.as_mut(),
            )?)
        }))
    }

    /// dx (and the residual's gradient in the stream's type, where the op writes one), dgamma
    /// and dbeta against the reference.
    fn check_gradients<T: Element, W: Element, R: Element>(
        &self,
        reference: &Reference,
        grads: &Gradients<T, W>,
        d_residual: Option<&Tensor<R>>,
    ) -> Result<Check, BenchError> {
        let Some(dgamma) = &grads.dgamma else {
            unreachable!("backward_into refuses gradients that do not match the op's parameters")
        };
        let (dgamma, dbeta) = (
            dgamma.to_vec()?,
            grads.dbeta.as_ref().map(Tensor::to_vec).transpose()?,
        );
        let dx = reference.check_backward(&grads.dx.to_vec()?, &dgamma, dbeta.as_deref());
        Ok(match d_residual {
            Some(d) => Check::worst([
                dx,
                reference.check_backward(&d.to_vec()?, &dgamma, dbeta.as_deref()),
            ]),
            None => dx,
        })
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

/// The inputs on the device: x, dy, and with the residual add the residual and dsum, of
/// the stream's type `R`.
struct Operands<T: Element, R: Element = T> {
    x: Tensor<T>,
    dy: Tensor<T>,
    residual: Option<(Tensor<R>, Tensor<R>)>,
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
        inputs: &Inputs<T, impl Element>,
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

    fn backward_into(
        &self,
        ctx: &Context<T>,
        dy: &Tensor<T>,
        grads: &mut Gradients<T, W>,
    ) -> layernorm_cuda::Result<()> {
        match self {
            Op::Layer(op) => op.backward_into(ctx, dy, grads),
            Op::Rms(op) => op.backward_into(ctx, dy, grads),
        }
    }
}

/// How the residual add reaches the op with its stream in `Self` beside x of `T`: x's own
/// type (`forward_residual_into`, `backward_residual_into`), or f32 beside f16 and bf16
/// (`forward_residual_f32_into`, `backward_residual_f32_into`, whose backward writes the
/// residual's gradient as a second output).
trait Stream<T: Element>: Element {
    type Context;

    /// The forward with the residual add (s into `sum`); its context holds s.
    fn forward_into<W: Weight<T>>(
        op: &Op<T, W>,
        x: &Tensor<T>,
        residual: &Tensor<Self>,
        y: &mut Tensor<T>,
        sum: &mut Tensor<Self>,
    ) -> layernorm_cuda::Result<Self::Context>;

    /// The residual's gradient as an output of its own (f32 stream), poisoned; None where
    /// dx is it.
    fn d_residual(device: &Device, shape: &[usize]) -> Result<Option<Tensor<Self>>, BenchError>;

    /// The backward with dsum (and the residual's gradient where [`Stream::d_residual`]
    /// gave an output).
    fn backward_into<W: Weight<T>>(
        op: &Op<T, W>,
        ctx: &Self::Context,
        dy: &Tensor<T>,
        dsum: &Tensor<Self>,
        grads: &mut Gradients<T, W>,
        d_residual: Option<&mut Tensor<Self>>,
    ) -> layernorm_cuda::Result<()>;
}

impl<T: Element> Stream<T> for T {
    type Context = Context<T>;

    fn forward_into<W: Weight<T>>(
        op: &Op<T, W>,
        x: &Tensor<T>,
        residual: &Tensor<T>,
        y: &mut Tensor<T>,
        sum: &mut Tensor<T>,
    ) -> layernorm_cuda::Result<Context<T>> {
        match op {
            Op::Layer(op) => op.forward_residual_into(x, residual, y, sum),
            Op::Rms(op) => op.forward_residual_into(x, residual, y, sum),
        }
    }

    fn d_residual(_: &Device, _: &[usize]) -> Result<Option<Tensor<T>>, BenchError> {
        Ok(None)
    }

    fn backward_into<W: Weight<T>>(
        op: &Op<T, W>,
        ctx: &Context<T>,
        dy: &Tensor<T>,
        dsum: &Tensor<T>,
        grads: &mut Gradients<T, W>,
        _: Option<&mut Tensor<T>>,
    ) -> layernorm_cuda::Result<()> {
        match op {
            Op::Layer(op) => op.backward_residual_into(ctx, dy, Some(dsum), grads),
            Op::Rms(op) => op.backward_residual_into(ctx, dy, Some(dsum), grads),
        }
    }
}

/// The stream in f32 beside x of each 16-bit type.
macro_rules! f32_stream {
    ($t:ty) => {
        impl Stream<$t> for f32 {
            type Context = F32StreamContext<$t>;

            fn forward_into<W: Weight<$t>>(
                op: &Op<$t, W>,
                x: &Tensor<$t>,
                residual: &Tensor<f32>,
                y: &mut Tensor<$t>,
                sum: &mut Tensor<f32>,
            ) -> layernorm_cuda::Result<F32StreamContext<$t>> {
                match op {
                    Op::Layer(op) => op.forward_residual_f32_into(x, residual, y, sum),
                    Op::Rms(op) => op.forward_residual_f32_into(x, residual, y, sum),
                }
            }

            fn d_residual(device: &Device, shape: &[usize]) -> Result<Option<Tensor<f32>>, BenchError> {
                poisoned(device, shape).map(Some)
            }

            fn backward_into<W: Weight<$t>>(
                op: &Op<$t, W>,
                ctx: &F32StreamContext<$t>,
                dy: &Tensor<$t>,
                dsum: &Tensor<f32>,
                grads: &mut Gradients<$t, W>,
                d_residual: Option<&mut Tensor<f32>>,
            ) -> layernorm_cuda::Result<()> {
                let Some(d_residual) = d_residual else {
                    unreachable!("`d_residual` gives the f32 stream an output")
                };
                match op {
                    Op::Layer(op) => op.backward_residual_f32_into(ctx, dy, Some(dsum), grads, d_residual),
                    Op::Rms(op) => op.backward_residual_f32_into(ctx, dy, Some(dsum), grads, d_residual),
                }
            }
        }
    };
}

f32_stream!(f16);
f32_stream!(bf16);

/// A tensor full of NaN, so that an element the op leaves unwritten fails the check.
fn poisoned<T: Element>(device: &Device, shape: &[usize]) -> Result<Tensor<T>, BenchError> {
    Ok(device.full(shape, T::from_f32(f32::NAN))?)
}
