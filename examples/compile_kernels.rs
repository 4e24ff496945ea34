//! Compiles every kernel source with NVRTC into CUBIN for one architecture, without a GPU:
//! a check of the kernels on a machine that has only the NVRTC library (e.g. the
//! `nvidia-cuda-nvrtc-cu12` wheel, see scripts/nvrtc-env).
//!
//! ```text
//! compile_kernels [sm_90]
//! ```

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90".into());
    for (name, src, kernels) in spex::backend::cuda::SOURCES {
        let t0 = std::time::Instant::now();
        let cubin = spex::backend::cuda::compile(name, src, &arch)
            .with_context(|| format!("compiling {name}"))?;
        println!(
            "{name}: {} kernels, {} bytes of CUBIN for {arch} in {:.2} s",
            kernels.len(),
            cubin.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
