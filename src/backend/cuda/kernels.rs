//! The CUDA C kernels of the backend: their sources (embedded at build time), their
//! compilation by NVRTC for the device's architecture at start-up, and launches.

use std::ffi::c_void;

use cudarc::driver::{result as drv, sys as drv_sys, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

use super::device::Device;
use super::error;
use crate::error::{Error, Result};

/// The header included by every source (`#include "common.cuh"`).
const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel source: (file name, text, kernels it defines).
pub const SOURCES: &[(&str, &str, &[&str])] = &[
    (
        "spots.cu",
        include_str!("../../../kernels/spots.cu"),
        &["spots_f64"],
    ),
    (
        "assemble.cu",
        include_str!("../../../kernels/assemble.cu"),
        &["assemble_f64", "regularize_f64"],
    ),
    (
        "factor.cu",
        include_str!("../../../kernels/factor.cu"),
        &["eye_f64"],
    ),
    (
        "decorrelate.cu",
        include_str!("../../../kernels/decorrelate.cu"),
        &["decorrelate_f64"],
    ),
    (
        "finalize.cu",
        include_str!("../../../kernels/finalize.cu"),
        &["project_f64", "chi2pix_f64"],
    ),
];

/// Replaces the include of the shared header by its text: NVRTC is given one string per
/// program, and the header must not be looked up on the file system at run time.
fn expand(src: &str) -> String {
    src.replace(
        "#include \"common.cuh\"",
        COMMON.replace("#pragma once", "").as_str(),
    )
}

/// Compiles one source for `arch` (e.g. "sm_90") into PTX; the NVRTC log is in the error.
pub fn compile(name: &str, src: &str, arch: &'static str) -> Result<cudarc::nvrtc::Ptx> {
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some(name.to_string()),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(expand(src), opts).map_err(|e| match e {
        CompileError::CompileError { log, options, .. } => Error::Gpu(format!(
            "NVRTC failed to compile {name} for {arch} (options {options:?}):\n{}",
            log.to_string_lossy()
        )),
        other => Error::Gpu(format!("NVRTC failed on {name}: {other:?}")),
    })
}

/// The `compute_XY`/`sm_XY` name NVRTC expects for a compute capability.
pub fn arch_name(cc: (i32, i32)) -> &'static str {
    // NVRTC wants a &'static str; the set of real architectures is small and fixed.
    match cc {
        (7, 0) => "sm_70",
        (7, 2) => "sm_72",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (10, 3) => "sm_103",
        (11, 0) => "sm_110",
        (12, 0) => "sm_120",
        (12, 1) => "sm_121",
        (major, _) if major >= 12 => "sm_120",
        (major, _) if major >= 10 => "sm_100",
        (9, _) => "sm_90",
        (8, _) => "sm_80",
        _ => "sm_70",
    }
}

/// Compiled kernels of one device.
pub(crate) struct Kernels {
    _modules: Vec<std::sync::Arc<CudaModule>>,
    pub spots: CudaFunction,
    pub assemble: CudaFunction,
    pub regularize: CudaFunction,
    pub eye: CudaFunction,
    pub decorrelate: CudaFunction,
    pub project: CudaFunction,
    pub chi2pix: CudaFunction,
}

impl Kernels {
    /// Compiles every source for the device and loads its kernels.
    pub(crate) fn load(dev: &Device) -> Result<Self> {
        let arch = arch_name(dev.arch);
        let mut modules = Vec::new();
        let mut functions = std::collections::HashMap::new();
        for (name, src, kernels) in SOURCES {
            let _r = nvtx::LocalRange::new(nvtx::Str::from_str_lossy(&format!("nvrtc {name}")));
            let ptx = compile(name, src, arch)?;
            let module = dev.ctx.load_module(ptx).map_err(error::driver(format!(
                "cannot load module {name} on device {}",
                dev.ordinal
            )))?;
            for k in *kernels {
                let f = module
                    .load_function(k)
                    .map_err(error::driver(format!("kernel {k} missing from {name}")))?;
                functions.insert(*k, f);
            }
            modules.push(module);
        }
        let mut take = |k: &str| {
            functions
                .remove(k)
                .expect("every kernel is listed in SOURCES")
        };
        Ok(Kernels {
            spots: take("spots_f64"),
            assemble: take("assemble_f64"),
            regularize: take("regularize_f64"),
            eye: take("eye_f64"),
            decorrelate: take("decorrelate_f64"),
            project: take("project_f64"),
            chi2pix: take("chi2pix_f64"),
            _modules: modules,
        })
    }
}

/// Kernel arguments, each stored in an 8-byte slot (pointers, i32, i64, f64); the driver reads
/// as many bytes from a slot as the kernel's parameter has (little-endian).
#[derive(Default)]
pub(crate) struct Args {
    slots: Vec<u64>,
}

impl Args {
    pub(crate) fn new() -> Self {
        Args {
            slots: Vec::with_capacity(32),
        }
    }

    pub(crate) fn ptr(mut self, p: u64) -> Self {
        self.slots.push(p);
        self
    }

    pub(crate) fn i32(mut self, v: i32) -> Self {
        self.slots.push(v as u32 as u64);
        self
    }

    pub(crate) fn i64(mut self, v: i64) -> Self {
        self.slots.push(v as u64);
        self
    }

    pub(crate) fn f64(mut self, v: f64) -> Self {
        self.slots.push(v.to_bits());
        self
    }
}

/// Thread block shape of a launch.
pub(crate) struct Block(pub (u32, u32, u32));

impl From<u32> for Block {
    fn from(x: u32) -> Self {
        Block((x, 1, 1))
    }
}

impl From<(u32, u32)> for Block {
    fn from((x, y): (u32, u32)) -> Self {
        Block((x, y, 1))
    }
}

/// Launches `f` on the device's stream.
pub(crate) fn launch(
    dev: &Device,
    f: &CudaFunction,
    name: &str,
    grid: (u32, u32, u32),
    block: impl Into<Block>,
    smem: usize,
    mut args: Args,
) -> Result<()> {
    let block = block.into().0;
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(());
    }
    let mut params: Vec<*mut c_void> = args
        .slots
        .iter_mut()
        .map(|s| s as *mut u64 as *mut c_void)
        .collect();
    // SAFETY: the argument list matches the kernel's signature (checked by the tests that run
    // every kernel against the CPU reference); the pointers stay valid until the stream syncs.
    unsafe {
        if smem > 48 * 1024 {
            drv::function::set_function_attribute(
                f.cu_function(),
                drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(error::driver(format!(
                "{name}: cannot raise shared memory to {smem} bytes"
            )))?;
        }
        drv::launch_kernel(
            f.cu_function(),
            grid,
            block,
            smem as u32,
            dev.cu_stream(),
            &mut params,
        )
        .map_err(error::driver(format!(
            "launch of {name} (grid {grid:?}, block {block:?}, {smem} B shared)"
        )))
    }
}
