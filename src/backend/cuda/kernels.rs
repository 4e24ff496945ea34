//! The CUDA C kernels of the backend: their sources (embedded at build time), their
//! compilation by NVRTC into CUBIN (machine code) for the device's architecture at start-up,
//! kept in an on-disk cache, and launches.

use std::ffi::{c_void, CString};

use cudarc::driver::{result as drv, sys as drv_sys, CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use super::device::Device;
use super::error;
use crate::error::{Error, Result};

pub use sources::{expand, SOURCES};
use sources::{source_digest, OPTIONS};

/// The kernel sources and their options, shared with build.rs.
#[path = "kernel_sources.rs"]
mod sources;

// `PREBUILT`: the CUBIN build.rs compiled (empty when NVRTC was not found at build time).
include!(concat!(env!("OUT_DIR"), "/prebuilt_kernels.rs"));

/// Where the machine code of a source came from, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Compiled when spex was built.
    BuiltIn,
    /// The kernel cache.
    Cache,
    /// NVRTC, at start-up.
    Compiled,
}

/// The CUBIN build.rs made of source `name` (text `src`) for `arch`, if any: only for the
/// text and options this binary carries.
pub fn prebuilt(name: &str, src: &str, arch: &str) -> Option<&'static [u8]> {
    let digest = source_digest(name, &expand(src), arch);
    PREBUILT
        .iter()
        .find(|&&(a, n, d, _, _)| a == arch && n == name && d == digest)
        .map(|&(_, _, _, _, cubin)| cubin)
}

/// "built in", "from the cache", "compiled", or how many sources came from each.
pub(crate) fn describe_origins(origins: impl Iterator<Item = Origin>) -> String {
    let origins: Vec<Origin> = origins.collect();
    let count = |o| origins.iter().filter(|&&x| x == o).count();
    let parts: Vec<String> = [
        (Origin::BuiltIn, "built in"),
        (Origin::Cache, "from the cache"),
        (Origin::Compiled, "compiled"),
    ]
    .into_iter()
    .filter(|&(o, _)| count(o) > 0)
    .map(|(o, what)| match count(o) == origins.len() {
        true => what.to_string(),
        false => format!("{} {what}", count(o)),
    })
    .collect();
    parts.join(", ")
}

/// The version of the NVRTC library loaded at run time ("major.minor"); an error when there is
/// none.
pub fn nvrtc_version() -> Result<String> {
    super::device::require_nvrtc()?;
    Ok(cache::nvrtc_version())
}

/// The architectures the binary carries CUBIN for, with the version of the NVRTC that
/// compiled them.
pub fn built_in_archs() -> Vec<(&'static str, &'static str)> {
    let mut archs: Vec<(&str, &str)> = PREBUILT.iter().map(|&(a, _, _, v, _)| (a, v)).collect();
    archs.dedup();
    archs
}

/// Compiles one source for `arch` (e.g. "sm_90") into CUBIN, machine code the driver loads
/// without a JIT pass; the NVRTC log is in the error.
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    compile_with(name, src, arch, &[]).map(|(cubin, _)| cubin)
}

/// What the assembler reports of each kernel of one source compiled for `arch`: registers,
/// spills, shared memory (for kernel work: they decide how many blocks share an SM).
pub fn resources(name: &str, src: &str, arch: &str) -> Result<String> {
    compile_with(name, src, arch, &["--ptxas-options=-v"]).map(|(_, log)| log)
}

/// NVRTC's log of a program.
///
/// # Safety
/// `prog` must be a live NVRTC program.
unsafe fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    nvrtc::get_program_log(prog)
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
            String::from_utf8_lossy(&bytes)
                .trim_end_matches('\0')
                .to_string()
        })
        .unwrap_or_default()
}

/// [`compile`] with `extra` options; the CUBIN and NVRTC's log.
fn compile_with(name: &str, src: &str, arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String)> {
    super::device::require_nvrtc()?;
    let fail = |what: String| Error::Gpu(format!("NVRTC failed on {name} for {arch}: {what}"));
    let text = CString::new(expand(src)).map_err(|e| fail(e.to_string()))?;
    let cname = CString::new(name).map_err(|e| fail(e.to_string()))?;
    let prog = nvrtc::create_program(&text, Some(&cname)).map_err(|e| fail(format!("{e:?}")))?;
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(OPTIONS.iter().chain(extra).map(|o| o.to_string()));
    // SAFETY: `prog` was created above and is destroyed once, at the end.
    let out = unsafe {
        let compiled = nvrtc::compile_program(prog, &options);
        let result = match compiled {
            Err(e) => Err(fail(format!(
                "{e:?} (options {options:?}):\n{}",
                program_log(prog)
            ))),
            Ok(()) => {
                let mut size = 0usize;
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
                let mut cubin = vec![0u8; size];
                nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
                Ok((cubin, program_log(prog)))
            }
        };
        let _ = nvrtc::destroy_program(prog);
        result
    };
    out
}

/// Logs (debug) a loaded kernel's registers and local memory per thread, which decide with
/// its shared memory how many of its blocks share an SM.
fn log_resources(name: &str, f: &CudaFunction) {
    use drv_sys::CUfunction_attribute as A;
    let get = |a| {
        // SAFETY: a loaded function and a plain attribute query.
        unsafe { drv::function::get_function_attribute(f.cu_function(), a) }.unwrap_or(-1)
    };
    tracing::debug!(
        "kernel {name}: {} registers, {} bytes local memory per thread",
        get(A::CU_FUNC_ATTRIBUTE_NUM_REGS),
        get(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
    );
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

/// The CUBIN of one source for `arch`: from the kernel cache when it holds it (and
/// `fresh` is false), else compiled by NVRTC and stored there.
fn cubin_of(
    cache: Option<&cache::Cache>,
    name: &str,
    src: &str,
    arch: &'static str,
    version: &str,
    fresh: bool,
) -> Result<(Vec<u8>, Origin)> {
    let key = cache::key(name, &expand(src), arch, version);
    if !fresh {
        if let Some(cubin) = cache.and_then(|c| c.get(&key)) {
            return Ok((cubin, Origin::Cache));
        }
    }
    let _r = nvtx::LocalRange::new(nvtx::Str::from_str_lossy(&format!("nvrtc {name}")));
    let cubin = compile(name, src, arch)?;
    if let Some(c) = cache {
        c.put(&key, &cubin);
    }
    Ok((cubin, Origin::Compiled))
}

/// The CUBIN of every source for `arch`, in the order of [`SOURCES`], with where each came
/// from: built into the binary, else the kernel cache, else compiled by NVRTC (one thread per
/// source) and stored in the cache.
pub(crate) fn cubins_for(arch: &'static str) -> Result<Vec<(Vec<u8>, Origin)>> {
    let built: Vec<Option<&[u8]>> = SOURCES
        .iter()
        .map(|&(name, src, _)| prebuilt(name, src, arch))
        .collect();
    if built.iter().all(Option::is_some) {
        return Ok(built
            .into_iter()
            .flatten()
            .map(|c| (c.to_vec(), Origin::BuiltIn))
            .collect());
    }
    let version = nvrtc_version()?;
    let cache = cache::Cache::open();
    std::thread::scope(|scope| {
        let jobs: Vec<_> = SOURCES
            .iter()
            .zip(built)
            .map(|(&(name, src, _), built)| {
                let (cache, version) = (cache.as_ref(), &version);
                scope.spawn(move || match built {
                    Some(c) => Ok((c.to_vec(), Origin::BuiltIn)),
                    None => cubin_of(cache, name, src, arch, version, false),
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err(Error::Gpu("NVRTC thread panicked".into())))
            })
            .collect()
    })
}

/// Compiled kernels of one device (clones share the loaded modules).
#[derive(Clone)]
pub(crate) struct Kernels {
    _modules: Vec<std::sync::Arc<CudaModule>>,
    pub spots: CudaFunction,
    pub column_table: CudaFunction,
    pub assemble: CudaFunction,
    pub downdate: CudaFunction,
    pub regularize: CudaFunction,
    pub eye: CudaFunction,
    pub schur_sweep: CudaFunction,
    pub schur_combine: CudaFunction,
    pub schur_end_flux: CudaFunction,
    pub schur_retry_list: CudaFunction,
    pub polar: CudaFunction,
    pub decorrelate: CudaFunction,
    pub project: CudaFunction,
    pub chi2pix: CudaFunction,
    pub outlier_test: CudaFunction,
    pub kept_slots: CudaFunction,
    pub keep_equations: CudaFunction,
}

impl Kernels {
    /// Loads the kernels of `cubins` (from [`cubins_for`] for the device's architecture). A
    /// module the driver refuses (a damaged cache entry, say) is compiled afresh and loaded
    /// once more.
    pub(crate) fn load(
        dev: &Device,
        arch: &'static str,
        cubins: Vec<(Vec<u8>, Origin)>,
    ) -> Result<Self> {
        let mut modules = Vec::new();
        let mut functions = std::collections::HashMap::new();
        for ((name, src, kernels), (cubin, _)) in SOURCES.iter().zip(cubins) {
            let module = match dev.ctx.load_module(Ptx::from_binary(cubin)) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!("cannot load module {name} ({e:?}); compiling it again");
                    let cache = cache::Cache::open();
                    let cubin =
                        cubin_of(cache.as_ref(), name, src, arch, &nvrtc_version()?, true)?.0;
                    dev.ctx
                        .load_module(Ptx::from_binary(cubin))
                        .map_err(error::driver(format!(
                            "cannot load module {name} on device {}",
                            dev.ordinal
                        )))?
                }
            };
            for k in *kernels {
                let f = module
                    .load_function(k)
                    .map_err(error::driver(format!("kernel {k} missing from {name}")))?;
                log_resources(k, &f);
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
            column_table: take("column_table"),
            assemble: take("assemble_f64"),
            downdate: take("downdate_f64"),
            regularize: take("regularize_f64"),
            eye: take("eye_f64"),
            schur_sweep: take("schur_sweep_f64"),
            schur_combine: take("schur_combine_f64"),
            schur_end_flux: take("schur_end_flux_f64"),
            schur_retry_list: take("schur_retry_list"),
            polar: take("polar_f64"),
            decorrelate: take("decorrelate_f64"),
            project: take("project_f64"),
            chi2pix: take("chi2pix_f64"),
            outlier_test: take("outlier_test"),
            kept_slots: take("kept_slots"),
            keep_equations: take("keep_equations"),
            _modules: modules,
        })
    }
}

/// A directory of compiled CUBIN, so that the ranks of later jobs skip NVRTC (about half a
/// second per rank, paid again by every rank of every job): `SPEX_KERNEL_CACHE` (`off`
/// disables it), else `$XDG_CACHE_HOME/spex/kernels`, else `$HOME/.cache/spex/kernels`. An
/// entry is named after a digest of everything that shapes the code (the expanded source, the
/// options, the architecture, the NVRTC version), written atomically, and every failure to
/// read or write it falls back to compiling.
mod cache {
    use std::path::PathBuf;

    pub(super) struct Cache {
        dir: PathBuf,
    }

    impl Cache {
        /// The cache the environment names, or none if it disables it or names no place.
        pub(super) fn open() -> Option<Cache> {
            let dir = match std::env::var_os("SPEX_KERNEL_CACHE") {
                Some(v) if v == "off" || v == "0" || v.is_empty() => return None,
                Some(v) => PathBuf::from(v),
                None => std::env::var_os("XDG_CACHE_HOME")
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
                    .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?
                    .join("spex/kernels"),
            };
            Some(Cache::at(dir))
        }

        pub(super) fn at(dir: PathBuf) -> Cache {
            Cache { dir }
        }

        pub(super) fn get(&self, key: &str) -> Option<Vec<u8>> {
            let mut data = std::fs::read(self.dir.join(key)).ok()?;
            // A complete entry ends with the marker written after the CUBIN.
            if !data.ends_with(END) {
                return None;
            }
            data.truncate(data.len() - END.len());
            tracing::debug!("kernel cache: {key}");
            Some(data)
        }

        pub(super) fn put(&self, key: &str, cubin: &[u8]) {
            let write = || -> std::io::Result<()> {
                std::fs::create_dir_all(&self.dir)?;
                let tmp = self.dir.join(format!(".{key}.{}.tmp", std::process::id()));
                std::fs::write(&tmp, [cubin, END].concat())?;
                std::fs::rename(&tmp, self.dir.join(key))
            };
            if let Err(e) = write() {
                tracing::debug!(
                    "kernel cache {}: cannot store {key}: {e}",
                    self.dir.display()
                );
            }
        }
    }

    const END: &[u8] = b"\nspex kernel cache entry end\n";

    /// The version of the NVRTC library, which shapes the code it writes.
    pub(super) fn nvrtc_version() -> String {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: NVRTC writes two integers; the library was checked before any compile.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        format!("{major}.{minor}")
    }

    /// The file name of the CUBIN of source `name` (expanded `text`) for `arch` by NVRTC
    /// `version`: two independent 64-bit digests (FNV-1a and SipHash) of everything the code
    /// depends on.
    pub(super) fn key(name: &str, text: &str, arch: &str, version: &str) -> String {
        use std::hash::{Hash, Hasher};
        let material = format!(
            "{name}\0{arch}\0{version}\0{:?}\0cubin\0{text}",
            super::OPTIONS
        );
        let mut fnv: u64 = 0xcbf2_9ce4_8422_2325;
        for b in material.bytes() {
            fnv = (fnv ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut sip = std::collections::hash_map::DefaultHasher::new();
        material.hash(&mut sip);
        let stem = name.trim_end_matches(".cu");
        format!("{stem}-{arch}-{fnv:016x}{:016x}.cubin", sip.finish())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn keys_change_with_everything_that_shapes_the_code() {
            let base = key("spots.cu", "__global__ void f() {}", "sm_90", "12.4");
            assert!(
                base.starts_with("spots-sm_90-") && base.ends_with(".cubin"),
                "{base}"
            );
            assert_eq!(
                base,
                key("spots.cu", "__global__ void f() {}", "sm_90", "12.4")
            );
            for other in [
                key("spots.cu", "__global__ void g() {}", "sm_90", "12.4"),
                key("spots.cu", "__global__ void f() {}", "sm_80", "12.4"),
                key("spots.cu", "__global__ void f() {}", "sm_90", "12.6"),
                key("assemble.cu", "__global__ void f() {}", "sm_90", "12.4"),
            ] {
                assert_ne!(base, other);
            }
        }

        #[test]
        fn entries_come_back_whole_or_not_at_all() {
            let dir = tempfile::tempdir().expect("temporary directory");
            let cache = Cache::at(dir.path().join("kernels"));
            assert_eq!(cache.get("a.cubin"), None);
            let code = b"\x7fELF\x02\x01\x01\x00 machine code \x00\xff";
            cache.put("a.cubin", code);
            assert_eq!(cache.get("a.cubin").as_deref(), Some(&code[..]));
            // A file cut short (a writer killed before the rename cannot leave one, but a full
            // disk or a copy can) is not an entry.
            std::fs::write(dir.path().join("kernels/b.cubin"), &code[..6]).expect("write");
            assert_eq!(cache.get("b.cubin"), None);
            // An unwritable place only costs the compile.
            let blocked = Cache::at(dir.path().join("kernels/a.cubin/sub"));
            blocked.put("c.cubin", b"x");
            assert_eq!(blocked.get("c.cubin"), None);
        }
    }
}

/// Kernel arguments, each stored in an 8-byte slot (pointers, i32, i64, f64); the driver reads
/// as many bytes from a slot as the kernel's parameter has (little-endian).
#[derive(Default, Clone)]
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
            // All of L1 as shared memory where the kernel asks for much of it, so that the
            // two blocks its registers allow share an SM.
            drv::function::set_function_attribute(
                f.cu_function(),
                drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .map_err(error::driver(format!(
                "{name}: cannot prefer shared memory to L1"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_code_is_that_of_the_sources_carried() {
        // Every CUBIN build.rs embedded is found for the text this binary carries, and
        // nothing for an architecture it did not build (or any, without NVRTC at build time).
        for &(arch, name, _, _, cubin) in PREBUILT {
            let (_, src, _) = SOURCES
                .iter()
                .find(|s| s.0 == name)
                .expect("a source of the table");
            assert_eq!(prebuilt(name, src, arch), Some(cubin), "{name} for {arch}");
            assert!(
                cubin.starts_with(b"\x7fELF"),
                "{name} for {arch}: not a CUBIN"
            );
        }
        for &(name, src, _) in SOURCES {
            assert_eq!(prebuilt(name, src, "sm_75"), None);
            assert_eq!(prebuilt(name, "changed text", "sm_90"), None);
        }
        // Each built architecture carries every source, once.
        for (arch, _) in built_in_archs() {
            let n = PREBUILT.iter().filter(|e| e.0 == arch).count();
            assert_eq!(n, SOURCES.len(), "{arch}");
        }
    }

    #[test]
    fn origins_are_summed_up_for_the_log() {
        let all = [Origin::BuiltIn; 3];
        assert_eq!(describe_origins(all.into_iter()), "built in");
        let mixed = [Origin::Cache, Origin::Compiled, Origin::Cache];
        assert_eq!(
            describe_origins(mixed.into_iter()),
            "2 from the cache, 1 compiled"
        );
    }
}
