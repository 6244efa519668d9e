//! The embedded PTX and its kernels, with their occupancy queries. The PTX for the device's
//! compute capability is loaded in parts, one module per norm and type pair, each when an op
//! of that norm and pair is first made on the device: the driver JIT-compiles a module
//! whole, and all 143 kernels of the sm_90 PTX take it about 29 s where its JIT cache is
//! cold (docs/PERF.md, v18), of which a program that uses one norm on one type pair needs
//! a tenth.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::{self, CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use crate::element::{Element, Weight};
use crate::error::{DriverContext, Error, Result};
use crate::layout::registry::{self, KernelName, TYPE_PAIRS, TypePair};
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

/// The kernels of the device's PTX, loaded a module at a time: one module for each norm and
/// type pair, holding the kernels its ops launch (`registry::kernels_of`).
pub(crate) struct KernelTable {
    ctx: Arc<CudaContext>,
    /// `modules[norm][pair]`, in `Norm::ALL` and `TYPE_PAIRS` order, set at first use.
    modules: [[OnceLock<Module>; TYPE_PAIRS.len()]; 2],
    /// Held while a module loads, so that two threads asking for one module at once
    /// compile it once.
    loading: Mutex<()>,
    /// What the planner needs of this device: its module, the dynamic shared memory a
    /// block may have (the opt-in maximum), and its multiprocessors.
    pub(crate) limits: DeviceLimits,
    /// Stage 2 launches as stage 1's programmatic dependent (gpu/launch.rs,
    /// `launch_dependent`): sm_90 (whose PTX has `griddepcontrol`) under a driver of CUDA
    /// 12.3 or later (the first whose graph capture takes such launches).
    pub(crate) dependent_launch: bool,
}

/// The first driver version (CUDA 12.3) whose stream capture takes programmatic dependent
/// launches.
const DEPENDENT_LAUNCH_DRIVER: i32 = 12030;

/// The first driver version (CUDA 12.1) that loads PTX 8.1, the sm_90 module's version
/// (build.rs). An sm_90 device under an older driver runs the sm_80 module, without the
/// cluster kernels.
const SM90_PTX_DRIVER: i32 = 12010;

/// The installed driver's CUDA version, as 1000 * major + 10 * minor.
fn driver_version() -> Result<i32> {
    let mut version = 0;
    // SAFETY: the driver writes one int through the pointer, which outlives the call.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .during("reading the driver version")?;
    Ok(version)
}

/// One loaded module's kernels, by variant (`Variant::ALL` order); None where the device's
/// PTX lacks the variant (the cluster kernels before sm_90).
struct Module {
    kernels: Vec<Option<Kernel>>,
}

impl KernelTable {
    /// The kernel table of the device of `ctx`, whose compute capability is `major`.x and
    /// which has `sm_count` multiprocessors: the sm_90 PTX (with the cluster kernels) on 9.0
    /// and later where the driver loads it. Loads nothing yet.
    pub(crate) fn new(ctx: &Arc<CudaContext>, major: i32, sm_count: u32) -> Result<KernelTable> {
        let max_smem = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .during("reading the shared memory limit")? as u32;
        let driver = if major >= 9 { driver_version()? } else { 0 };
        let arch = if driver >= SM90_PTX_DRIVER {
            Arch::Sm90
        } else {
            Arch::Sm80
        };
        let dependent_launch = arch == Arch::Sm90 && driver >= DEPENDENT_LAUNCH_DRIVER;
        Ok(KernelTable {
            ctx: ctx.clone(),
            modules: Default::default(),
            loading: Mutex::new(()),
            limits: DeviceLimits {
                arch,
                max_smem,
                sm_count,
            },
            dependent_launch,
        })
    }

    /// `norm`'s kernels of x of type `T` with weights of type `W`, loading their module
    /// (JIT-compiling its PTX) the first time they are asked for.
    pub(crate) fn of_norm<T: Element, W: Weight<T>>(&self, norm: Norm) -> Result<TypeKernels<'_>> {
        self.of_pair(norm, W::PAIR)
    }

    /// As [`KernelTable::of_norm`], for the kernels of type pair `pair` (an index into
    /// `TYPE_PAIRS`): those of a residual stream kept in f32 among them.
    pub(crate) fn of_pair(&self, norm: Norm, pair: usize) -> Result<TypeKernels<'_>> {
        let slot = &self.modules[norm.index()][pair];
        if let Some(module) = slot.get() {
            return Ok(TypeKernels { module });
        }
        let _loading = self.loading.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.get().is_none() {
            // Not set by another thread while this one waited: set only here, under the lock.
            let module = self.load(norm, TYPE_PAIRS[pair])?;
            let _ = slot.set(module);
        }
        let module = slot.get().expect("set above, under the lock");
        Ok(TypeKernels { module })
    }

    /// JIT-compiles the module of `norm` and `pair`, and looks up each of its kernels.
    fn load(&self, norm: Norm, pair: TypePair) -> Result<Module> {
        let arch = self.limits.arch;
        let ptx = match arch {
            Arch::Sm90 => PTX_SM90,
            Arch::Sm80 => PTX_SM80,
        };
        let names: Vec<(Variant, String)> = registry::kernels_of(arch, norm, pair)
            .map(|(norm, v, pair)| (v, KernelName(norm, v, pair).to_string()))
            .collect();
        // A name the PTX lacks is this crate's bug, reported as such.
        let part = registry::ptx_part(ptx, names.iter().map(|(_, name)| name.as_str())).map_err(|name| {
            Error::MissingKernel {
                name: name.to_string(),
            }
        })?;
        let module = self
            .ctx
            .load_module(Ptx::from_src(part))
            .during("loading a PTX module")?;
        let mut kernels: Vec<Option<Kernel>> = Vec::new();
        kernels.resize_with(Variant::ALL.len(), || None);
        for (v, name) in &names {
            kernels[*v as usize] = Some(Kernel::load(&module, name, self.limits.max_smem)?);
        }
        Ok(Module { kernels })
    }
}

/// One type pair's kernels of one norm.
#[derive(Clone, Copy)]
pub(crate) struct TypeKernels<'a> {
    module: &'a Module,
}

impl<'a> TypeKernels<'a> {
    /// The kernel, where the device's PTX has it.
    pub(crate) fn get(self, v: Variant) -> Option<&'a Kernel> {
        self.module.kernels[v as usize].as_ref()
    }

    /// A kernel the module has: any but the held residual forward, which the planner plans
    /// only for the type pairs that have it (`Variant::has_pair`).
    pub(crate) fn any(self, v: Variant) -> &'a Kernel {
        self.get(v)
            .unwrap_or_else(|| panic!("layernorm-cuda bug: {v:?} asked of a module that lacks it"))
    }
}
