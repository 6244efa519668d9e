//! Stage 2: the partial rows' column sums into dgamma and dbeta, in a fixed order.

use crate::device;
use crate::element::Element;

/// Stage 2's tile of 32 columns as 8 groups of 4, and the partial rows a thread loads at once.
use crate::layout::{STAGE2_BATCH, STAGE2_GROUPS};

/// Stage 2: dgamma_j and dbeta_j are the sums of column j over the `rows` partial rows.
/// A block takes a tile of 32 columns, its threads `S` slices of 8 groups (S the host's
/// `layout::stage2_slices(rows)`, a power of two from 4 to 128, about `rows / STAGE2_BATCH`);
/// thread (slice s, group q) sums columns 4q..4q+4 of rows s, s + S, ... (`STAGE2_BATCH`
/// rows in flight at a time, 16-byte loads where n is a whole number of 4-column groups,
/// row by row in order), then the S slice sums meet in a
/// fixed pairwise tree (slice s += slice s + h for h = S/2, ..., 1). For a given number of
/// partial rows the order of every addition is fixed, so the owned mode stays bitwise
/// reproducible.
///
/// # Safety
/// `part_*` hold `[rows, n]` f32 (16-byte aligned); `dgamma`, `dbeta` hold `n`; the block
/// is `layout::stage2_threads(rows)` threads with `layout::stage2_smem(rows)` bytes of
/// shared memory.
#[inline(always)]
pub(crate) unsafe fn stage2<T: Element>(
    part_dgamma: *const f32,
    part_dbeta: *const f32,
    rows: u32,
    n: u32,
    dgamma: *mut T,
    dbeta: *mut T,
) {
    let slices = device::block_dim() / STAGE2_GROUPS;
    let (group, slice) = (
        device::thread_idx() % STAGE2_GROUPS,
        device::thread_idx() / STAGE2_GROUPS,
    );
    let vector = n.is_multiple_of(4);
    // This thread's slot of slice sums: dgamma's 16 bytes, then (after all slots) dbeta's.
    let slot = |s: u32| device::shared_addr((s * STAGE2_GROUPS + group) * 16);
    let dbeta_slots = STAGE2_GROUPS * slices * 16;
    let mut tile = device::block_idx();
    while tile * 32 < n {
        let j = tile * 32 + 4 * group;
        // Columns j..j + 4 of partial row r, zero past n.
        let load = |part: *const f32, r: u32| -> [f32; 4] {
            let at = r as usize * n as usize + j as usize;
            if vector && j < n {
                // SAFETY: r < rows, j + 4 <= n (n a multiple of 4); the row and the group
                // start 16-byte aligned.
                unsafe { device::load_16(part.add(at) as *const u32).map(f32::from_bits) }
            } else {
                [0, 1, 2, 3].map(|k| {
                    if j + k < n {
                        // SAFETY: r < rows, and only columns below n are read.
                        unsafe { *part.add(at + k as usize) }
                    } else {
                        0.0
                    }
                })
            }
        };
        let (mut g, mut b) = ([0.0f32; 4], [0.0f32; 4]);
        let mut r = slice;
        while r < rows {
            // A batch's loads first, all in flight together. Rows past the last read as
            // zeros, which leave the sums' bits as they are: the sums start at +0.0, never
            // become -0.0 (x + -x rounds to +0.0), and x + 0.0 is x for every other x.
            let batch: [u32; STAGE2_BATCH as usize] = core::array::from_fn(|u| r + u as u32 * slices);
            let row = |part: *const f32, q: u32| if q < rows { load(part, q) } else { [0.0; 4] };
            let (pg, pb) = (
                batch.map(|q| row(part_dgamma, q)),
                batch.map(|q| row(part_dbeta, q)),
            );
            for u in 0..STAGE2_BATCH as usize {
                for k in 0..4 {
                    g[k] += pg[u][k];
                    b[k] += pb[u][k];
                }
            }
            r += STAGE2_BATCH * slices;
        }
        // SAFETY: slot(slice) lies in the block's shared memory (launch guarantee).
        unsafe {
            device::store_shared_16(slot(slice), g.map(f32::to_bits));
            device::store_shared_16(slot(slice) + dbeta_slots, b.map(f32::to_bits));
        }
        let mut half = slices / 2;
        while half > 0 {
            device::sync_block();
            if slice < half {
                // SAFETY: slice + half < slices; both slots written before the barrier.
                unsafe {
                    for at in [slot(slice), slot(slice) + dbeta_slots] {
                        let (mine, other) = (
                            device::load_shared_16(at),
                            device::load_shared_16(at + half * 16 * STAGE2_GROUPS),
                        );
                        let sum = [0, 1, 2, 3]
                            .map(|k| (f32::from_bits(mine[k]) + f32::from_bits(other[k])).to_bits());
                        device::store_shared_16(at, sum);
                    }
                }
            }
            half /= 2;
        }
        if slice == 0 {
            // SAFETY: slot 0 of this group holds the tile's sums (written by this thread).
            let (g, b) = unsafe {
                (
                    device::load_shared_16(slot(0)),
                    device::load_shared_16(slot(0) + dbeta_slots),
                )
            };
            for k in 0..4 {
                let col = j as usize + k;
                if col < n as usize {
                    // SAFETY: col < n.
                    unsafe {
                        dgamma.add(col).write(T::from_f32(f32::from_bits(g[k])));
                        dbeta.add(col).write(T::from_f32(f32::from_bits(b[k])));
                    }
                }
            }
        }
        // The next tile's slice sums overwrite these.
        device::sync_block();
        tile += device::grid_dim();
    }
}
