//! The embedded PTX and its kernels: the module for the device's compute capability, loaded
//! once, and every kernel the registry (`crate::layout::registry`) lists, by variant and
//! type pair, with their occupancy queries.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use crate::element::{Element, Weight};
use crate::error::{DriverContext, Result};
use crate::layout::registry::{self, TYPE_PAIRS};
use crate::plan::{Arch, DeviceLimits, Norm, Variant};

/// The kernels for sm_80 and later, built from `kernels-gpu/` by build.rs.
const PTX_SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/layernorm_kernels.ptx"));
/// The same kernels for sm_90 (Hopper) and later, plus the cluster kernels.
const PTX_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/layernorm_kernels_sm90.ptx"));

/// A kernel of the loaded module, and the occupancies asked of the driver so far: a launch
/// of a shape seen before asks the driver nothing.
pub(crate) struct Kernel {
    func: CudaFunction,
    /// (shape, blocks a multiprocessor runs or clusters the device runs). A handful of
    /// entries: one per block shape the planner picks.
    occupancy: Mutex<Vec<(LaunchShape, u32)>>,
}

/// What a kernel's occupancy depends on: (cluster size or 1, threads, shared memory bytes).
type LaunchShape = (u32, u32, u32);

impl Kernel {
    /// The function, for a launch.
    pub(crate) fn func(&self) -> &CudaFunction {
        &self.func
    }

    fn load(module: &Arc<CudaModule>, name: &str, max_smem: u32) -> Result<Kernel> {
        let func = module.load_function(name).during("looking up a kernel")?;
        // Blocks may take more than the default 48 KB of shared memory (owned-mode partials).
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            max_smem as i32,
        )
        .during("raising a kernel's shared memory limit")?;
        Ok(Kernel {
            func,
            occupancy: Mutex::default(),
        })
    }

    /// Clusters of the kernel's (compile-time) `size` blocks, `threads` and `smem` per
    /// block, that the device runs at once (>= 1).
    pub(crate) fn active_clusters(
        &self,
        stream: &Arc<CudaStream>,
        size: u32,
        threads: u32,
        smem: u32,
    ) -> Result<u32> {
        self.cached((size, threads, smem), || {
            let config = LaunchConfig {
                grid_dim: (size, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem,
            };
            let n = self
                .func
                .occupancy_max_active_clusters(config, stream)
                .during("querying cluster occupancy")?;
            Ok(n.max(1))
        })
    }

    /// Blocks of `threads` threads and `smem` bytes one multiprocessor runs at once (>= 1).
    pub(crate) fn blocks_per_sm(&self, threads: u32, smem: u32) -> Result<u32> {
        self.cached((1, threads, smem), || {
            let n = self
                .func
                .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
                .during("querying occupancy")?;
            Ok(n.max(1))
        })
    }

    /// The occupancy of `key` from the cache, or from `query` (then kept). For one kernel on
    /// one device it depends on nothing else. (Queried outside the lock: two threads may
    /// both ask the first time, and store the same answer.)
    fn cached(&self, key: LaunchShape, query: impl FnOnce() -> Result<u32>) -> Result<u32> {
        let known =
            |cache: &Vec<((u32, u32, u32), u32)>| cache.iter().find(|(k, _)| *k == key).map(|&(_, n)| n);
        if let Some(n) = known(&self.occupancy.lock().unwrap_or_else(PoisonError::into_inner)) {
            return Ok(n);
        }
        let n = query()?;
        let mut cache = self.occupancy.lock().unwrap_or_else(PoisonError::into_inner);
        if known(&cache).is_none() {
            cache.push((key, n));
        }
        Ok(n)
    }
}

/// Every kernel of the loaded module, as the registry (`crate::layout::registry`) lists
/// them, by norm, variant and type pair.
pub(crate) struct KernelTable {
    /// `kernels[norm][variant][pair]`, in `Norm::ALL`, `Variant::ALL` and `TYPE_PAIRS` order;
    /// None where the module lacks the kernel (the cluster kernels before sm_90), the norm
    /// has none of its own (stage 2, which LayerNorm's serves for both), or the kernel does
    /// not come in the pair (stage 2 of mixed pairs, whose weights' own pair serves).
    kernels: [Vec<[Option<Kernel>; TYPE_PAIRS.len()]>; 2],
    /// What the planner needs of this device: its module, and the dynamic shared memory a
    /// block may have (the opt-in maximum).
    pub(crate) limits: DeviceLimits,
}

impl KernelTable {
    /// JIT-compiles the PTX for this device (once per device) and looks up every kernel the
    /// registry lists for its module: the sm_90 module (with the cluster kernels) on compute
    /// capability 9.0 and later.
    pub(crate) fn load(ctx: &Arc<CudaContext>, major: i32) -> Result<KernelTable> {
        let max_smem = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .during("reading the shared memory limit")? as u32;
        let arch = if major >= 9 { Arch::Sm90 } else { Arch::Sm80 };
        let ptx = match arch {
            Arch::Sm90 => PTX_SM90,
            Arch::Sm80 => PTX_SM80,
        };
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .during("loading the PTX module")?;
        let mut kernels: [Vec<[Option<Kernel>; TYPE_PAIRS.len()]>; 2] = Default::default();
        for table in &mut kernels {
            table.resize_with(Variant::ALL.len(), Default::default);
        }
        for (norm, v, pair) in registry::kernels(arch) {
            let name = format!("{}_{}_{}", norm.prefix(), v.stem(), pair.name);
            let at = TYPE_PAIRS
                .iter()
                .position(|&p| p == pair)
                .expect("a registry pair");
            kernels[norm.index()][v as usize][at] = Some(Kernel::load(&module, &name, max_smem)?);
        }
        let limits = DeviceLimits { arch, max_smem };
        Ok(KernelTable { kernels, limits })
    }

    /// `norm`'s kernels of x of type `T` with weights of type `W`.
    pub(crate) fn of_norm<T: Element, W: Weight<T>>(&self, norm: Norm) -> TypeKernels<'_> {
        TypeKernels {
            table: self,
            norm,
            pair: W::PAIR,
        }
    }

    /// Stage 2 writing dgamma and dbeta of type `W` (LayerNorm's, which serves both norms
    /// and every x type with those weights).
    pub(crate) fn reduce<W: Element>(&self) -> &Kernel {
        self.of_norm::<W, W>(Norm::Layer).any(Variant::BwdReduce)
    }
}

/// One type pair's kernels.
#[derive(Clone, Copy)]
pub(crate) struct TypeKernels<'a> {
    table: &'a KernelTable,
    norm: Norm,
    pair: usize,
}

impl<'a> TypeKernels<'a> {
    /// The kernel, where the loaded module has it.
    pub(crate) fn get(self, v: Variant) -> Option<&'a Kernel> {
        let norm = if self.norm.has(v) { self.norm } else { Norm::Layer };
        self.table.kernels[norm.index()][v as usize][self.pair].as_ref()
    }

    /// A kernel every module has.
    pub(crate) fn any(self, v: Variant) -> &'a Kernel {
        self.get(v)
            .unwrap_or_else(|| panic!("layernorm-cuda bug: {v:?} asked of a module that lacks it"))
    }
}
