//! Host work split over the cores (16 on the GPU machine): input generation, the float64
//! reference and output scans would otherwise take longer than the GPU timing itself.

use std::ops::Range;

/// `f` on consecutive ranges covering `0..len`, one per core, run in parallel; results
/// in range order.
pub fn map_ranges<R: Send>(len: usize, f: impl Fn(Range<usize>) -> R + Sync) -> Vec<R> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let step = len.div_ceil(cores).max(1);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..len)
            .step_by(step)
            .map(|start| s.spawn(move || f(start..(start + step).min(len))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect()
    })
}
