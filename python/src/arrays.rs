//! gpu_specter's `extract_frame` on numpy arrays: the image in memory, a PSF read by spex,
//! the frame's arrays back. The pixels are copied once, into the arrays the library owns
//! (the mask applied on the way); the results become numpy arrays without a copy.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use numpy::{IntoPyArray, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use spex::backend::{self, Backend, BackendKind};
use spex::image::{Image, MaskRule};
use spex::pipeline::{self, ExtractRequest, Inputs, Timings};
use spex::plan::PatchLayout;
use spex::psf::GaussHermitePsf;

use crate::errors::spex_error;
use crate::timing::{phase_ends, Phases};

/// desispec's `extractmaskval`: the MASK bits that reject a pixel.
const EXTRACT_MASK_BITS: u32 = 767;

/// A Gauss-Hermite PSF read by spex, to extract several images with one read.
#[pyclass(module = "spex", frozen)]
pub struct Psf {
    inner: Arc<GaussHermitePsf>,
}

#[pymethods]
impl Psf {
    /// Reads a GAUSS-HERMITE PSF file.
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let psf = py
            .detach(|| GaussHermitePsf::read(&path))
            .map_err(spex_error)?;
        Ok(Psf {
            inner: Arc::new(psf),
        })
    }

    /// Number of fibers.
    #[getter]
    fn nfiber(&self) -> usize {
        self.inner.nfiber
    }

    /// The file it was read from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path.clone()
    }
}

/// The options of one in-memory extraction, in gpu_specter's names.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct Options {
    bundlesize: usize,
    specmin: usize,
    nspec: usize,
    wavelength: Option<(f64, f64, f64)>,
    nwavestep: usize,
    nsubbundles: usize,
    regularize: f64,
    psferr: Option<f64>,
    wavepad: usize,
    wavepad_frac: f64,
    pixpad_frac: f64,
    /// `None`: the GPU when one is usable, else the CPU.
    gpu: Option<bool>,
}

/// Extracts `image` (with `ivar`, and `mask` whose bits of desispec's `extractmaskval`
/// reject a pixel) with `psf`; returns gpu_specter's frame dictionary and the start and end of
/// each phase ("solve", "assemble") on the wall clock.
#[pyfunction]
#[pyo3(signature = (image, ivar, mask, psf, options))]
pub fn extract_arrays<'py>(
    py: Python<'py>,
    image: PyReadonlyArray2<'py, f32>,
    ivar: PyReadonlyArray2<'py, f32>,
    mask: Option<PyReadonlyArray2<'py, i32>>,
    psf: &Bound<'py, Psf>,
    options: Options,
) -> PyResult<(Bound<'py, PyDict>, Phases)> {
    let request = request(&psf.get().inner.path, &options);
    request.validate_options().map_err(spex_error)?;
    let mask_view = mask.as_ref().map(|m| m.as_slice()).transpose()?;
    let image = Image::from_arrays(
        "(array)",
        image.as_array().to_owned(),
        ivar.as_array().to_owned(),
        mask_view,
        MaskRule::Bits(EXTRACT_MASK_BITS),
    )
    .map_err(spex_error)?;
    let psf = Arc::clone(&psf.get().inner);
    let mut timings = Timings::default();
    let (frame, _) = py
        .detach(|| {
            let inputs = Inputs {
                psf: (*psf).clone(),
                image,
                heliocor: 1.0,
                traces: None,
            };
            // a GPU backend kept open by an earlier call, or one opened (and kept) for this one
            let mut backend = open_backend(options.gpu)?;
            backend.one_frame_only();
            pipeline::extract_in_memory_timed(&request, &inputs, backend.as_mut(), &mut timings)
        })
        .map_err(spex_error)?;
    let ends = phase_ends(&timings, SystemTime::now());
    let out = PyDict::new(py);
    out.set_item("wave", frame.wave.into_pyarray(py))?;
    out.set_item("specflux", frame.flux.into_pyarray(py))?;
    out.set_item("specivar", frame.ivar.into_pyarray(py))?;
    out.set_item("specmask", frame.mask.into_pyarray(py))?;
    out.set_item("Rdiags", frame.resolution.into_pyarray(py))?;
    out.set_item("pixmask_fraction", frame.pixmask_fraction.into_pyarray(py))?;
    out.set_item("chi2pix", frame.chi2pix.into_pyarray(py))?;
    out.set_item("modelimage", py.None())?;
    Ok((out, ends))
}

/// The request the program would build for these options (nothing is read or written).
fn request(psf: &std::path::Path, o: &Options) -> ExtractRequest {
    let mut r = ExtractRequest::new("(array)", psf, "(memory)");
    r.wavelength = o.wavelength;
    r.specmin = o.specmin;
    r.nspec = Some(o.nspec);
    r.regularize = o.regularize;
    r.psferr = o.psferr;
    r.mask_rule = MaskRule::Bits(EXTRACT_MASK_BITS);
    r.layout = PatchLayout {
        bundlesize: o.bundlesize,
        nsubbundles: o.nsubbundles,
        nwavestep: o.nwavestep,
        wavepad: o.wavepad,
        wavepad_frac: o.wavepad_frac,
        pixpad_frac: o.pixpad_frac,
    };
    r
}

/// The backend of `gpu`: the first CUDA device (required when `Some(true)`), else the CPU on
/// every core available.
fn open_backend(gpu: Option<bool>) -> spex::Result<Box<dyn Backend>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    match gpu {
        Some(false) => backend::create(BackendKind::Cpu, threads, 0),
        Some(true) => backend::create(BackendKind::Cuda, threads, 0),
        None => match backend::cuda::device_count() {
            Ok(n) if n > 0 => backend::create(BackendKind::Cuda, threads, 0)
                .or_else(|_| backend::create(BackendKind::Cpu, threads, 0)),
            _ => backend::create(BackendKind::Cpu, threads, 0),
        },
    }
}
