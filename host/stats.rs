//! The per-row mean and rstd a forward writes for its backward, kept for the next forward
//! once the context that held them is gone. On a CUDA device a fresh pair is two
//! stream-ordered allocations and, when the context drops, two frees, queued on the stream
//! beside the kernel: about 1 us of GPU time a call, a tenth of a forward at M = 4096,
//! N = 1024 (docs/PERF.md, "Forward against the peers at v21"). A training step drops each
//! context after its backward, so the next forward of the op finds its pair here.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::tensor::Tensor;

/// Pairs kept at most: contexts of a few micro-batches in flight, each `[rows]` of f32.
const KEPT: usize = 4;

/// A mean and an rstd tensor, `[rows]` each.
pub(crate) type Stats = (Tensor<f32>, Tensor<f32>);

/// Pairs that no context holds any more, each its storage's only handle: a forward may
/// write them as it would fresh ones. Shared by an op and its clones.
#[derive(Debug, Default)]
pub(crate) struct StatsPool {
    kept: Mutex<Vec<Stats>>,
}

impl StatsPool {
    /// A kept pair of `rows`, if there is one.
    pub(crate) fn take(&self, rows: usize) -> Option<Stats> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let at = kept.iter().position(|(mean, _)| mean.shape() == [rows])?;
        Some(kept.swap_remove(at))
    }

    /// Keeps `stats` (whole tensors that nothing else holds), dropping the oldest pair past
    /// [`KEPT`].
    fn give_back(&self, stats: Stats) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() == KEPT {
            kept.remove(0);
        }
        kept.push(stats);
    }
}

/// A context's link back to its op's pool: weak, so that a context outliving its op keeps
/// no pool alive.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReturnTo(Weak<StatsPool>);

impl ReturnTo {
    pub(crate) fn new(pool: &Arc<StatsPool>) -> ReturnTo {
        ReturnTo(Arc::downgrade(pool))
    }

    /// Called as a context drops: hands its pair to the pool where the context holds the
    /// only handles (no clone of the context, no tensor the caller took from it).
    pub(crate) fn give_back(&self, mean: &Tensor<f32>, rstd: &Tensor<f32>) {
        if let Some(pool) = self.0.upgrade()
            && mean.is_sole()
            && rstd.is_sole()
        {
            pool.give_back((mean.clone(), rstd.clone()));
        }
    }
}
