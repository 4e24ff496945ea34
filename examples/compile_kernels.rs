//! Compiles every kernel source with NVRTC into CUBIN for one architecture, without a GPU:
//! a check of the kernels on a machine that has only the NVRTC library (e.g. the
//! `nvidia-cuda-nvrtc-cu12` wheel, see scripts/nvrtc-env). With `--resources`, prints what
//! the assembler reports of each kernel (registers, spills, shared memory).
//!
//! ```text
//! compile_kernels [sm_90] [--resources]
//! ```

use anyhow::Context;
use spex::backend::cuda;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let report = args.iter().any(|a| a == "--resources");
    let arch = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map_or("sm_90", String::as_str);
    for (name, src, kernels) in cuda::SOURCES {
        let t0 = std::time::Instant::now();
        let cubin = cuda::compile(name, src, arch).with_context(|| format!("compiling {name}"))?;
        println!(
            "{name}: {} kernels, {} bytes of CUBIN for {arch} in {:.2} s",
            kernels.len(),
            cubin.len(),
            t0.elapsed().as_secs_f64()
        );
        if report {
            let log = cuda::resources(name, src, arch)?;
            for line in log.lines().filter(|l| !l.trim().is_empty()) {
                println!("    {}", line.trim());
            }
        }
    }
    Ok(())
}
