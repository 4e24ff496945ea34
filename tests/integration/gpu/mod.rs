//! CUDA backend against the CPU reference. These tests need an NVIDIA GPU, so they are
//! ignored by a plain `cargo test` (which lists them as ignored); on a GPU machine run them
//! with `--include-ignored` (`scripts/gpu-check` does), where a missing device fails them.

use std::io::Write;

use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

use spex::backend::cpu::CpuBackend;
use spex::backend::cuda::{self, CudaBackend};
use spex::backend::{Backend, FrameInput, Progress};
use spex::compare::agreement;
use spex::extract::{PatchResult, PatchStatus, SolveOptions};
use spex::image::Image;
use spex::plan::{Plan, PlanOptions};
use spex::psf::GaussHermitePsf;
use spex::simulate::{simulate, SimulateOptions};

mod fallbacks;
mod kept;
mod placed;
mod rejection;

/// Prints past the test harness's output capture, so that the figures are always visible.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// The backend of device 0; these tests fail where there is none.
fn backend() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("no usable CUDA device: {e}"))
}

fn psf() -> GaussHermitePsf {
    GaussHermitePsf::read(&crate::common::data("psf-r0-00067784.fits")).expect("test PSF")
}

/// A simulated image of the plan's fibers over its padded wavelengths (seeded sky and object
/// spectra, Poisson and read noise, masked cosmic-ray tracks and a bad column).
fn synthetic_image(psf: &GaussHermitePsf, plan: &Plan, seed: u64) -> Image {
    let mut o = SimulateOptions::new(
        plan.fibers(),
        plan.fullwave[0],
        plan.fullwave[plan.fullwave.len() - 1],
    );
    o.seed = seed;
    // dense enough that several patches see masked pixels
    o.cosmic_density = 2000.0;
    let (x, _) = psf.xy(plan.fibers().start + 2, plan.wave[0]);
    o.bad_column = Some(x.round() as usize);
    simulate(psf, &o).expect("simulation").to_image()
}

/// [`synthetic_image`] with a masked amplifier region: no usable pixel from fiber 12 to the
/// right, above the rows of 6100 A.
fn masked_amplifier_image(psf: &GaussHermitePsf, plan: &Plan, seed: u64) -> Image {
    let mut image = synthetic_image(psf, plan, seed);
    let (x, y) = psf.xy(12, 6100.0);
    image
        .ivar
        .slice_mut(ndarray::s![y as usize.., x as usize..])
        .fill(0.0);
    image
}

/// The options of these tests: PSF error 0.01 as gpu_specter's default.
fn solve_options(regularize: f64, model: bool) -> SolveOptions {
    SolveOptions {
        regularize,
        psferr: 0.01,
        model,
        reject_outliers: None,
    }
}

/// The CPU reference's results for every patch of `input`'s plan.
fn cpu_results(input: FrameInput<'_>) -> Vec<PatchResult> {
    CpuBackend::new(0)
        .unwrap()
        .extract(input, &input.plan.patches, &Progress::silent())
        .unwrap()
}

/// The GPU's and the CPU reference's results for every patch of `input`'s plan.
fn solve_both(
    gpu: &mut CudaBackend,
    input: FrameInput<'_>,
) -> (Vec<PatchResult>, Vec<PatchResult>) {
    let cpu = cpu_results(input);
    let g = gpu
        .extract(input, &input.plan.patches, &Progress::silent())
        .unwrap();
    (g, cpu)
}

fn assert_agree(gpu: &[PatchResult], cpu: &[PatchResult]) {
    assert_eq!(gpu.len(), cpu.len());
    for (g, c) in gpu.iter().zip(cpu) {
        assert_eq!(g.patch, c.patch);
        assert_eq!((g.nfiber, g.nwave, g.ndiag), (c.nfiber, c.nwave, c.ndiag));
        match (&g.model, &c.model) {
            (Some(a), Some(b)) => {
                assert_eq!((&a.rows, &a.cols), (&b.rows, &b.cols));
                let scale = b.data.iter().fold(0f64, |m, v| m.max(v.abs()));
                for (x, y) in a.data.iter().zip(&b.data) {
                    assert!((x - y).abs() <= 1e-8 * scale, "model {x} vs {y}");
                }
            }
            (None, None) => {}
            _ => panic!("model present in one backend only (patch {})", c.patch),
        }
    }
    let a = agreement(gpu, cpu).expect("same patches");
    say(&format!("gpu vs cpu: {a}"));
    let failures = a.failures(1e-6);
    assert!(failures.is_empty(), "{failures:?}");
    // The README's figure for the flux (7.1e-10 sigma on a full frame), with the next decade
    // as the bound; ivar, resolution and chi2pix are held to 1e-6 above.
    assert!(
        a.max_dflux_sigma < FLUX_SIGMA_LIMIT,
        "GPU flux {:.3e} sigma from the CPU's",
        a.max_dflux_sigma
    );
}

/// Largest flux difference between the GPU and the CPU backends, in sigma.
const FLUX_SIGMA_LIMIT: f64 = 1e-9;

#[test]
#[ignore = "needs the NVRTC library: scripts/test runs it with the one of scripts/nvrtc-env"]
fn kernels_compile_without_a_gpu() {
    // NVRTC alone, no device: every source compiles into CUBIN holding its kernels for the
    // architectures of the DESI machines (A100, H100) and for sm_75, where the tensor-core
    // products take their shuffle fallback (the oldest architecture CUDA 13 still targets).
    for arch in ["sm_75", "sm_80", "sm_90"] {
        assert_kernels_compile(arch);
    }
    // scripts/test builds this binary with the same NVRTC on the loader's path, so build.rs
    // embedded the code of A100 and H100: byte for byte what NVRTC makes now. Under another
    // NVRTC (a GPU machine's CUDA) the embedded code is still a CUBIN holding every kernel.
    let built = cuda::built_in_archs();
    assert_eq!(
        built.iter().map(|a| a.0).collect::<Vec<_>>(),
        ["sm_80", "sm_90"],
        "this test binary must be built with NVRTC on hand (SPEX_NVRTC, or on the loader's \
         path as scripts/test does) and the default SPEX_KERNEL_ARCHS"
    );
    let version = cuda::nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
    let same_nvrtc = built.iter().all(|a| a.1 == version);
    for arch in ["sm_80", "sm_90"] {
        for (name, src, kernels) in cuda::SOURCES {
            let code = cuda::prebuilt(name, src, arch).expect("embedded at build time");
            assert_is_cubin_of(code, name, kernels, arch);
            if same_nvrtc {
                let now = cuda::compile(name, src, arch).unwrap_or_else(|e| panic!("{e}"));
                assert!(
                    code == now.as_slice(),
                    "{name} for {arch}: embedded code differs"
                );
            }
        }
    }
}

/// `code` is a CUBIN for `arch` that holds every kernel of source `name`.
fn assert_is_cubin_of(code: &[u8], name: &str, kernels: &[&str], arch: &str) {
    assert!(
        code.starts_with(b"\x7fELF"),
        "{name}: not a CUBIN for {arch}"
    );
    for k in kernels {
        assert!(
            code.windows(k.len()).any(|w| w == k.as_bytes()),
            "{name}: kernel {k} missing from the CUBIN for {arch}"
        );
    }
}

/// Every source compiles afresh (not from the kernel cache) into CUBIN for `arch`, holding
/// every kernel it defines.
fn assert_kernels_compile(arch: &str) {
    for (name, src, kernels) in cuda::SOURCES {
        let code = cuda::compile(name, src, arch).unwrap_or_else(|e| panic!("{e}"));
        assert_is_cubin_of(&code, name, kernels, arch);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn kernels_compile_with_nvrtc() {
    // For device 0's architecture.
    let d = backend().describe();
    say(&format!("compiling for {d}"));
    let (_, a) = d
        .rsplit_once("(sm_")
        .expect("the description names the architecture");
    let a = a.trim_end_matches(')');
    let (maj, min) = a.split_at(a.len() - 1);
    assert_kernels_compile(cuda::arch_name((
        maj.parse().unwrap(),
        min.parse().unwrap(),
    )));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn gpu_matches_cpu_reference() {
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
    let image = synthetic_image(&psf, &plan, 7);
    for (regularize, model) in [(0.0, true), (1e-3, false)] {
        let options = solve_options(regularize, model);
        let input = FrameInput::new(&plan, &psf, &image, &options);
        let (g, cpu) = solve_both(&mut gpu, input);
        assert!(cpu.iter().all(|r| r.status == PatchStatus::Ok));
        assert!(
            cpu.iter()
                .any(|r| r.pixmask_fraction.iter().any(|&v| v > 0.0)),
            "no masked pixel"
        );
        assert_agree(&g, &cpu);
        // a subset, in another order, in small waves
        let subset: Vec<_> = plan.patches.iter().rev().step_by(2).cloned().collect();
        gpu.set_max_wave(Some(3));
        let g2 = gpu.extract(input, &subset, &Progress::silent()).unwrap();
        gpu.set_max_wave(None);
        let c2: Vec<_> = subset.iter().map(|p| cpu[p.index].clone()).collect();
        assert_agree(&g2, &c2);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn a_backend_of_one_frame_leaves_its_uploads_pageable() {
    // A backend pins its upload buffers in the background during its first frame, for the
    // frames after it, unless told that it solves one frame: then nothing is pinned during
    // that frame, and a second frame (which the backend was told would not come) uploads
    // from pageable memory too, while it starts the pinning for a third.
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
    let image = synthetic_image(&psf, &plan, 5);
    let options = solve_options(0.0, false);
    let traces = spex::psf::TraceTable::new(&psf, plan.solved_fibers(), &plan.fullwave);
    let input = FrameInput::new(&plan, &psf, &image, &options).with_traces(Some(&traces));
    let pinned = |one_frame: bool| -> Vec<bool> {
        let mut gpu = backend();
        if one_frame {
            gpu.one_frame_only();
        }
        (0..3)
            .map(|_| {
                gpu.extract(input, &plan.patches, &Progress::silent())
                    .unwrap();
                // the pinning runs beside the frames: give it time to end
                std::thread::sleep(std::time::Duration::from_millis(200));
                !gpu.timings().pageable_upload
            })
            .collect()
    };
    let (told, untold) = (pinned(true), pinned(false));
    say(&format!(
        "frames uploaded from pinned memory: told {told:?}, untold {untold:?}"
    ));
    assert_eq!(told, [false, false, true]);
    assert_eq!(untold, [false, true, true]);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn a_first_frame_in_small_waves_copies_back_the_models_it_moved() {
    // A backend's first frame grows its buffer of model boxes wave by wave, moving the boxes
    // of the waves before; their copies back must read the boxes after the move.
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
    let image = synthetic_image(&psf, &plan, 11);
    let options = solve_options(0.0, true);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    gpu.set_max_wave(Some(2));
    let g = gpu
        .extract(input, &plan.patches, &Progress::silent())
        .unwrap();
    assert!(plan.patches.len() > 4, "several waves");
    assert_agree(&g, &cpu_results(input));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn every_route_matches_the_cpu_reference() {
    // The default (Schur route, polar decorrelation) is covered above; the Jacobi decorrelation
    // and the dense route must agree as well.
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
    let image = synthetic_image(&psf, &plan, 13);
    let options = solve_options(0.0, true);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let cpu = cpu_results(input);
    for (solve, route) in [
        (cuda::Solve::Dense, cuda::Route::Polar),
        (cuda::Solve::Dense, cuda::Route::Jacobi),
        (cuda::Solve::Schur, cuda::Route::Polar),
        (cuda::Solve::Schur, cuda::Route::Jacobi),
    ] {
        gpu.set_solve(solve);
        gpu.set_route(route);
        say(&format!("{solve:?} route, {route:?} decorrelation"));
        let g = gpu
            .extract(input, &plan.patches, &Progress::silent())
            .unwrap();
        assert_agree(&g, &cpu);
        let t = gpu.timings();
        match route {
            cuda::Route::Polar => assert!(t.polar_blocks > 0 && t.max_sweeps == 0),
            cuda::Route::Jacobi => assert!(t.polar_blocks == 0 && t.max_sweeps > 0),
        }
        assert_eq!(t.dense_route, solve == cuda::Solve::Dense);
        // in waves of five: each wave's results are unpacked while the next ones run
        gpu.set_max_wave(Some(5));
        let in_waves = gpu
            .extract(input, &plan.patches, &Progress::silent())
            .unwrap();
        gpu.set_max_wave(None);
        assert!(gpu.timings().waves > 2);
        assert_agree(&in_waves, &cpu);
    }
    gpu.set_solve(cuda::Solve::Schur);
    gpu.set_route(cuda::Route::Polar);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn waves_that_split_a_bundle_agree() {
    // Two bundles in waves of at most ten patches: a wave ends in the second bundle and the
    // next starts in it, so that the next takes that bundle's spots from the wave before
    // instead of evaluating them. The next call starts with the same bundle on other
    // wavelengths: it must evaluate its spots. icov starts as NaN: the assembly writes one
    // triangle only, and the Schur route's kernels must read nothing else.
    let mut gpu = backend();
    gpu.set_poison(true);
    let psf = psf();
    let options = solve_options(0.0, true);
    gpu.set_max_wave(Some(10));
    for (plan, seed) in [
        (PlanOptions::new(6000.0, 6100.0, 0.8, 0, 50), 17),
        (PlanOptions::new(6100.0, 6200.0, 0.8, 25, 25), 18),
    ] {
        let plan = Plan::new(plan).unwrap();
        let image = synthetic_image(&psf, &plan, seed);
        let input = FrameInput::new(&plan, &psf, &image, &options);
        let (g, cpu) = solve_both(&mut gpu, input);
        let t = gpu.timings();
        assert!(t.waves >= 2);
        assert_eq!((t.cpu_fallback, t.coupled), (0, 0));
        assert_agree(&g, &cpu);
    }
    gpu.set_max_wave(None);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn patches_off_the_ccd_agree() {
    // The CCD cropped at the rows of 6200 A: the patches of longer wavelengths have no pixels,
    // and the frame's waves of two leave them out: their results are made on the host.
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6400.0, 0.8, 0, 25)).unwrap();
    let mut image = synthetic_image(&psf, &plan, 21);
    let cut = psf.xy(0, 6200.0).1 as usize;
    image.pix = image.pix.slice(ndarray::s![..cut, ..]).to_owned();
    image.ivar = image.ivar.slice(ndarray::s![..cut, ..]).to_owned();
    image.nrows = cut;
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    gpu.set_max_wave(Some(2));
    // twice: the second call uploads through the buffers the first one let be pinned
    for _ in 0..2 {
        let (g, cpu) = solve_both(&mut gpu, input);
        let off = |r: &[PatchResult]| -> Vec<bool> {
            r.iter()
                .map(|r| r.status == PatchStatus::OffImage)
                .collect()
        };
        let (off_gpu, off_cpu) = (off(&g), off(&cpu));
        assert_eq!(off_gpu, off_cpu);
        let n = off_cpu.iter().filter(|&&o| o).count();
        assert!(
            n >= 10 && n < cpu.len(),
            "{n} of {} patches off the CCD",
            cpu.len()
        );
        assert_agree(&g, &cpu);
    }
    gpu.set_max_wave(None);
}

/// Solves two patches of `nwavestep` output bins (and 12 of padding on each side) per
/// sub-bundle of one bundle on the GPU, checks them against the CPU and returns the backend's
/// timings.
fn wide_patches_agree(gpu: &mut CudaBackend, nwavestep: usize, seed: u64) -> cuda::GpuTimings {
    let psf = psf();
    let wmax = 6000.0 + 0.8 * (2 * nwavestep - 1) as f64;
    let mut options = PlanOptions::new(6000.0, wmax, 0.8, 0, 25);
    options.layout.nwavestep = nwavestep;
    let plan = Plan::new(options).unwrap();
    assert_eq!(plan.nwavetot, nwavestep + 24);
    let image = synthetic_image(&psf, &plan, seed);
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let (g, cpu) = solve_both(gpu, input);
    assert_agree(&g, &cpu);
    let t = gpu.timings().clone();
    say(&format!(
        "blocks of {}: dense route {}, polar blocks {}, Jacobi sweeps at most {}, {} of {} patches on the CPU",
        plan.nwavetot,
        t.dense_route,
        t.polar_blocks,
        t.max_sweeps,
        t.cpu_fallback,
        plan.patches.len()
    ));
    assert_eq!(t.patches, plan.patches.len());
    t
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn blocks_beyond_the_tile_kernels_take_the_dense_and_jacobi_routes() {
    // Blocks of 114 bins, past the tile kernels' largest order (80): the default Schur and
    // polar routes give way to the dense route and the Jacobi decorrelation.
    let t = wide_patches_agree(&mut backend(), 90, 17);
    assert!(t.dense_route && t.polar_blocks == 0 && t.max_sweeps > 0 && t.cpu_fallback == 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn blocks_beyond_the_shared_memory_are_solved_on_the_cpu() {
    // Blocks of 118 bins, whose Jacobi decorrelation needs more shared memory than an H100
    // (or an A100) gives a block: the backend solves them with the CPU reference instead of
    // failing at the launch.
    let t = wide_patches_agree(&mut backend(), 94, 19);
    assert_eq!(t.cpu_fallback, t.patches);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn schur_route_sends_coupled_patches_to_the_reference() {
    // Walked in fiber order along the CCD, a patch's icov is block-tridiagonal up to the stamps'
    // tails (below 1e-12 relative, as the CPU backend measures): no patch goes to the
    // reference and the sweeps agree with it. In storage order (padding fibers first) a
    // padding fiber and its core neighbour sit two blocks apart, which showed as couplings of
    // 1e-4. A bound below every coupling sends every live patch to the reference.
    let mut gpu = backend();
    gpu.set_solve(cuda::Solve::Schur);
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6040.0, 0.8, 0, 25)).unwrap();
    let image = synthetic_image(&psf, &plan, 17);
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let (g, cpu) = solve_both(&mut gpu, input);
    let t = gpu.timings().clone();
    say(&format!(
        "{} of {} patches coupled (largest coupling {:.1e})",
        t.coupled,
        plan.patches.len(),
        t.max_coupling
    ));
    assert_eq!(t.coupled, 0, "largest coupling {:.1e}", t.max_coupling);
    assert!(t.max_coupling < 1e-12, "coupling {:.1e}", t.max_coupling);
    // the stamps (17 columns) of fibers two apart (about 15 columns) overlap: the check sees
    // their blocks, which band storage keeps for it
    assert!(
        t.max_coupling > 0.0,
        "no second-neighbour coupling measured"
    );
    assert_eq!(t.cpu_fallback, 0);
    assert_agree(&g, &cpu);
    gpu.set_coupling_max(-1.0);
    let all = gpu
        .extract(input, &plan.patches, &Progress::silent())
        .unwrap();
    let t = gpu.timings().clone();
    gpu.set_coupling_max(cuda::COUPLING_MAX);
    say(&format!("bound -1: {} patches to the reference", t.coupled));
    assert!(t.coupled > 0);
    assert_eq!(t.cpu_fallback, t.coupled);
    assert_agree(&all, &cpu);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn masked_patch_is_reported() {
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6040.0, 0.8, 0, 25)).unwrap();
    let mut image = synthetic_image(&psf, &plan, 3);
    image.ivar.iter_mut().for_each(|v| *v = 0.0);
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let (g, cpu) = solve_both(&mut gpu, input);
    for (a, b) in g.iter().zip(&cpu) {
        assert_eq!(a.status, PatchStatus::Masked);
        assert_eq!(b.status, PatchStatus::Masked);
        // gpu_specter's regularised solution, the same values as the CPU's
        assert!(a.flux.iter().chain(&a.chi2pix).all(|&v| v == 0.0));
        assert!(a.ivar.iter().all(|&v| v > 0.0));
        assert_eq!((&a.ivar, &a.resolution), (&b.ivar, &b.resolution));
        assert!(a.model.is_none());
        for (x, y) in a.pixmask_fraction.iter().zip(&b.pixmask_fraction) {
            assert!((x - y).abs() < 1e-12);
        }
    }
}

/// A masked amplifier region (from fiber 12 to the right, above the grid's middle): the bins
/// without any usable pixel get gpu_specter's regularised values (ivar 1e-15, resolution the
/// identity) on the GPU as on the CPU, and the other patches agree as everywhere else.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn masked_amplifier_bins_match_the_cpu() {
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6200.0, 0.8, 0, 25)).unwrap();
    let image = masked_amplifier_image(&psf, &plan, 4);
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let (g, cpu) = solve_both(&mut gpu, input);
    let masked = cpu
        .iter()
        .filter(|r| r.status == PatchStatus::Masked)
        .count();
    say(&format!(
        "{masked} of {} patches without a usable pixel",
        cpu.len()
    ));
    assert!(masked > 0);
    for (a, b) in g.iter().zip(&cpu) {
        assert_eq!(a.status, b.status);
        if b.status == PatchStatus::Masked {
            assert_eq!((&a.flux, &a.ivar), (&b.flux, &b.ivar));
            assert_eq!((&a.resolution, &a.chi2pix), (&b.resolution, &b.chi2pix));
        }
    }
    // Bins at the masked region's edge keep a few pixels and a covariance block of condition
    // up to ~1e9, where chi2pix (a ratio of sums over those pixels) moves by ~1e-6 between
    // the polar and eigen routes; it is held to 1e-5 there, everything else as elsewhere.
    let mut a = agreement(&g, &cpu).expect("same patches");
    say(&format!("gpu vs cpu: {a}"));
    assert!(
        a.max_chi2pix_rel < 1e-5,
        "chi2pix {:.3e}",
        a.max_chi2pix_rel
    );
    a.max_chi2pix_rel = 0.0;
    let failures = a.failures(1e-6);
    assert!(failures.is_empty(), "{failures:?}");
    assert!(
        a.max_dflux_sigma < FLUX_SIGMA_LIMIT,
        "{:.3e}",
        a.max_dflux_sigma
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn failed_factorisations_follow_the_cpu() {
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
    let mut image = synthetic_image(&psf, &plan, 5);
    // Negative weights on the core of a spot make icov indefinite while its fluxweight stays
    // above the regularisation floor: the factorisation fails, the retry with regularize 1e-4
    // fails too and the CPU reference takes over (eigendecomposition fallback).
    for (fiber, wave) in [(2, 6020.0), (17, 6070.0)] {
        let (x, y) = psf.xy(fiber, wave);
        for dy in -1i64..=1 {
            for dx in -1i64..=1 {
                let r = (y.round() as i64 + dy) as usize;
                let c = (x.round() as i64 + dx) as usize;
                image.ivar[[r, c]] *= -0.4;
            }
        }
    }
    // A NaN pixel under another patch: a non-finite solution, reported as such.
    let (x, y) = psf.xy(12, 6045.0);
    image.pix[[y.round() as usize, x.round() as usize]] = f32::NAN;
    let options = solve_options(0.0, false);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let (g, cpu) = solve_both(&mut gpu, input);
    let statuses: Vec<_> = cpu
        .iter()
        .map(|r| r.status)
        .filter(|s| *s != PatchStatus::Ok)
        .collect();
    say(&format!(
        "statuses other than Ok: {statuses:?}; GPU retried {}, CPU fallback {}",
        gpu.timings().retried,
        gpu.timings().cpu_fallback
    ));
    assert!(
        statuses.contains(&PatchStatus::NonFinite),
        "the NaN pixel went unnoticed"
    );
    assert!(
        gpu.timings().retried > 0,
        "the negative weights did not break any factorisation"
    );
    assert_agree(&g, &cpu);
}

/// An image on which exactly the regularised retry saves a patch: a faint, noisy frame (the
/// inverse variance of the synthetic image scaled by 1e-3, so that the retry's 1e-8 on the
/// diagonal is not negligible against icov and a patch it saves is well away from singular,
/// where the backends' rounding cannot tell them apart) whose pixel at
/// the centre of one spot gets the weight `t` times its own. Scanned on the CPU reference: `t`
/// is the middle of the longest run of steps where some patch is `Regularized` and none needs
/// the eigendecomposition, so both backends decide alike on it. Returns the image and `t`.
fn image_needing_the_retry(
    psf: &GaussHermitePsf,
    plan: &Plan,
    options: &SolveOptions,
) -> (Image, f32) {
    let mut image = synthetic_image(psf, plan, 5);
    image.ivar.iter_mut().for_each(|v| *v *= 1e-3);
    let fiber = plan.fibers().start + 7;
    let (x, y) = psf.xy(fiber, 6050.0);
    let (r, c) = (y.round() as usize, x.round() as usize);
    let own = image.ivar[[r, c]];
    let near: Vec<_> = plan
        .patches
        .iter()
        .filter(|p| p.padded_fibers.contains(&fiber))
        .cloned()
        .collect();
    let mut cpu = CpuBackend::new(0).unwrap();
    let grid: Vec<f32> = (0..=60).map(|k| -2.0 - 0.05 * k as f32).collect();
    let mut saved = Vec::new();
    for &t in &grid {
        image.ivar[[r, c]] = own * t;
        let input = FrameInput::new(plan, psf, &image, options);
        let st: Vec<_> = cpu
            .extract(input, &near, &Progress::silent())
            .unwrap()
            .iter()
            .map(|r| r.status)
            .collect();
        saved.push(
            st.contains(&PatchStatus::Regularized) && !st.contains(&PatchStatus::EigenFallback),
        );
    }
    let (mut best, mut run) = ((0, 0), 0);
    for (k, &ok) in saved.iter().enumerate() {
        run = if ok { run + 1 } else { 0 };
        if run > best.1 {
            best = (k + 1 - run, run);
        }
    }
    assert!(
        best.1 >= 3,
        "no weight in {:?} needs exactly the regularised retry: {saved:?}",
        (grid[0], grid[grid.len() - 1])
    );
    let t = grid[best.0 + best.1 / 2];
    image.ivar[[r, c]] = own * t;
    (image, t)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn regularised_retry_matches_the_cpu_on_both_routes() {
    // A patch whose icov is slightly indefinite: the first factorisation fails and the retry
    // with regularize 1e-4 succeeds on the device (no CPU fallback), after the failed patch is
    // assembled again over what the failed factorisation left.
    let mut gpu = backend();
    let psf = psf();
    let plan = Plan::new(PlanOptions::new(6000.0, 6100.0, 0.8, 0, 25)).unwrap();
    let options = solve_options(0.0, true);
    let (image, t) = image_needing_the_retry(&psf, &plan, &options);
    let input = FrameInput::new(&plan, &psf, &image, &options);
    let cpu = cpu_results(input);
    let regularized = cpu
        .iter()
        .filter(|r| r.status == PatchStatus::Regularized)
        .count();
    assert!(regularized > 0, "weight {t}: no patch needs the retry");
    for solve in [cuda::Solve::Schur, cuda::Solve::Dense] {
        gpu.set_solve(solve);
        let g = gpu
            .extract(input, &plan.patches, &Progress::silent())
            .unwrap();
        let tm = gpu.timings().clone();
        say(&format!(
            "{solve:?} route, weight {t}: {regularized} patches regularised on the CPU; GPU retried {}, CPU fallback {}",
            tm.retried, tm.cpu_fallback
        ));
        assert_eq!(tm.retried, regularized);
        assert_eq!(tm.cpu_fallback, 0);
        assert_agree(&g, &cpu);
    }
    // The Schur route retries on the device only as many patches per wave as its list
    // holds; with room for none, the failures go to the CPU reference, with the same results.
    gpu.set_solve(cuda::Solve::Schur);
    gpu.set_retry_capacity(0);
    let g = gpu
        .extract(input, &plan.patches, &Progress::silent())
        .unwrap();
    let tm = gpu.timings().clone();
    gpu.set_retry_capacity(32);
    assert_eq!(tm.retried, regularized);
    assert_eq!(tm.cpu_fallback, regularized);
    assert_agree(&g, &cpu);
}

// The decorrelation of single blocks, after the helpers it uses.
mod decorrelation;
