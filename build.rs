//! Compiles the CUDA kernels into CUBIN for the common data-centre GPUs when spex is built, so
//! that a first run on a GPU node costs no NVRTC (seconds): the machine code is embedded in
//! the binary, as CUDA programs embed theirs. The run-time path stays: an architecture not
//! built here, or a driver that refuses the embedded code, gets its kernels from the kernel
//! cache or NVRTC at start-up.
//!
//! NVRTC is optional at build time. It is looked up as `SPEX_NVRTC` names it (the library, or
//! the directory that holds it), else through the dynamic loader (`LD_LIBRARY_PATH`, e.g. the
//! directory `scripts/nvrtc-env` prints); without it nothing is embedded.
//! `SPEX_KERNEL_ARCHS` chooses the architectures (default `sm_80,sm_90`; `none` embeds
//! nothing).

use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

include!("src/backend/cuda/kernel_sources.rs");

const DEFAULT_ARCHS: &str = "sm_80,sm_90";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=src/backend/cuda/kernel_sources.rs");
    for var in ["SPEX_NVRTC", "SPEX_KERNEL_ARCHS", "LD_LIBRARY_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let archs = std::env::var("SPEX_KERNEL_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.into());
    let archs: Vec<&str> = archs
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "none")
        .collect();
    let wanted = std::env::var_os("CARGO_FEATURE_CUDA").is_some() && !archs.is_empty();
    let built = if wanted {
        match Nvrtc::load() {
            Some(nvrtc) => compile_all(&nvrtc, &archs, &out),
            None => {
                if std::env::var_os("SPEX_NVRTC").is_some() {
                    println!("cargo:warning=SPEX_NVRTC names no usable NVRTC library: no kernels built in");
                }
                Vec::new()
            }
        }
    } else {
        Vec::new()
    };
    write_table(&out, &built);
}

/// One embedded CUBIN: architecture, source name, digest, file in OUT_DIR, NVRTC version.
struct Built {
    arch: String,
    name: &'static str,
    digest: u64,
    file: PathBuf,
    version: String,
}

/// A source's name, text and NVRTC's CUBIN of it (or its log).
type Compiled = (&'static str, &'static str, Result<Vec<u8>, String>);

/// Every source for every architecture, one thread per program. An architecture this NVRTC
/// cannot compile for (too old a library, or an error in a kernel) is left out with a
/// warning: its kernels then compile at run time, where an error stops the GPU backend.
fn compile_all(nvrtc: &Nvrtc, archs: &[&str], out: &Path) -> Vec<Built> {
    let version = nvrtc.version();
    let compiled: Vec<Vec<Compiled>> = std::thread::scope(|scope| {
        let per_arch: Vec<Vec<_>> = archs
            .iter()
            .map(|&arch| {
                SOURCES
                    .iter()
                    .map(|&(name, src, _)| {
                        scope.spawn(move || (name, src, nvrtc.compile(name, &expand(src), arch)))
                    })
                    .collect()
            })
            .collect();
        per_arch
            .into_iter()
            .map(|jobs| {
                jobs.into_iter()
                    .map(|j| j.join().expect("compile thread"))
                    .collect()
            })
            .collect()
    });
    let mut built = Vec::new();
    for (&arch, sources) in archs.iter().zip(compiled) {
        let all: Result<Vec<_>, _> = sources
            .into_iter()
            .map(|(name, src, cubin)| cubin.map(|c| (name, src, c)).map_err(|log| (name, log)))
            .collect();
        let all = match all {
            Ok(all) => all,
            Err((name, log)) => {
                let first = log.lines().next().unwrap_or("no log");
                println!("cargo:warning=NVRTC {version} cannot compile {name} for {arch} ({first}): no kernels built in for {arch}");
                continue;
            }
        };
        for (name, src, cubin) in all {
            let file = out.join(format!("{}-{arch}.cubin", name.trim_end_matches(".cu")));
            std::fs::write(&file, cubin).expect("write CUBIN to OUT_DIR");
            built.push(Built {
                arch: arch.to_string(),
                name,
                digest: source_digest(name, &expand(src), arch),
                file,
                version: version.clone(),
            });
        }
    }
    built
}

/// `prebuilt_kernels.rs`: the table the backend includes.
fn write_table(out: &Path, built: &[Built]) {
    let mut text = String::from(
        "/// CUBIN compiled when spex was built: (architecture, source, digest of the source \
         (`source_digest`), NVRTC version, machine code).\n\
         pub(crate) const PREBUILT: &[(&str, &str, u64, &str, &[u8])] = &[\n",
    );
    for b in built {
        writeln!(
            text,
            "    ({:?}, {:?}, {:#x}, {:?}, include_bytes!({:?})),",
            b.arch, b.name, b.digest, b.version, b.file
        )
        .expect("write to a String");
    }
    text.push_str("];\n");
    std::fs::write(out.join("prebuilt_kernels.rs"), text).expect("write prebuilt_kernels.rs");
}

type CreateProgram = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileProgram = unsafe extern "C" fn(*mut c_void, c_int, *const *const c_char) -> c_int;
type GetSize = unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int;
type GetBytes = unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// The few NVRTC entry points a build needs, loaded at build time.
struct Nvrtc {
    lib: libloading::Library,
}

impl Nvrtc {
    /// The library `SPEX_NVRTC` names, else the first NVRTC the dynamic loader finds.
    fn load() -> Option<Nvrtc> {
        let names = ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"];
        let candidates: Vec<PathBuf> = match std::env::var_os("SPEX_NVRTC").map(PathBuf::from) {
            Some(p) if p.is_dir() => names.iter().map(|n| p.join(n)).collect(),
            Some(p) => vec![p],
            None => names.iter().map(PathBuf::from).collect(),
        };
        candidates.iter().find_map(|c| {
            // SAFETY: loading NVRTC runs no initialisation code that the build depends on.
            let lib = unsafe { libloading::Library::new(c) }.ok()?;
            let nvrtc = Nvrtc { lib };
            nvrtc.symbol::<Version>(b"nvrtcVersion\0").map(|_| nvrtc)
        })
    }

    fn symbol<T: Copy>(&self, name: &[u8]) -> Option<T> {
        // SAFETY: each symbol is read with the type NVRTC's header declares for it.
        unsafe { self.lib.get::<T>(name).ok().map(|s| *s) }
    }

    fn version(&self) -> String {
        let (mut major, mut minor) = (0, 0);
        if let Some(f) = self.symbol::<Version>(b"nvrtcVersion\0") {
            // SAFETY: NVRTC writes two integers.
            unsafe { f(&mut major, &mut minor) };
        }
        format!("{major}.{minor}")
    }

    /// The CUBIN of one expanded source for `arch`, or NVRTC's log.
    fn compile(&self, name: &str, text: &str, arch: &str) -> Result<Vec<u8>, String> {
        let missing = || format!("NVRTC lacks an entry point needed to compile {name}");
        let create = self
            .symbol::<CreateProgram>(b"nvrtcCreateProgram\0")
            .ok_or_else(missing)?;
        let compile = self
            .symbol::<CompileProgram>(b"nvrtcCompileProgram\0")
            .ok_or_else(missing)?;
        let size = self
            .symbol::<GetSize>(b"nvrtcGetCUBINSize\0")
            .ok_or_else(missing)?;
        let get = self
            .symbol::<GetBytes>(b"nvrtcGetCUBIN\0")
            .ok_or_else(missing)?;
        let log_size = self
            .symbol::<GetSize>(b"nvrtcGetProgramLogSize\0")
            .ok_or_else(missing)?;
        let log = self
            .symbol::<GetBytes>(b"nvrtcGetProgramLog\0")
            .ok_or_else(missing)?;
        let destroy = self
            .symbol::<DestroyProgram>(b"nvrtcDestroyProgram\0")
            .ok_or_else(missing)?;
        let cstr = |s: &str| CString::new(s).map_err(|e| e.to_string());
        let (text, cname) = (cstr(text)?, cstr(name)?);
        let options: Vec<CString> = std::iter::once(format!("--gpu-architecture={arch}"))
            .chain(OPTIONS.iter().map(|o| o.to_string()))
            .map(|o| cstr(&o))
            .collect::<Result<_, _>>()?;
        let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut prog = std::ptr::null_mut();
        // SAFETY: the calls follow NVRTC's API: the program is created, compiled, read and
        // destroyed once, with buffers of the sizes NVRTC reports.
        unsafe {
            if create(
                &mut prog,
                text.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ) != 0
            {
                return Err(format!("nvrtcCreateProgram failed for {name}"));
            }
            let status = compile(prog, pointers.len() as c_int, pointers.as_ptr());
            let result = if status == 0 {
                let mut n = 0usize;
                size(prog, &mut n);
                let mut cubin = vec![0u8; n];
                get(prog, cubin.as_mut_ptr().cast());
                Ok(cubin)
            } else {
                let mut n = 0usize;
                log_size(prog, &mut n);
                let mut text = vec![0u8; n];
                log(prog, text.as_mut_ptr().cast());
                Err(String::from_utf8_lossy(&text)
                    .trim_end_matches('\0')
                    .to_string())
            };
            destroy(&mut prog);
            result
        }
    }
}
