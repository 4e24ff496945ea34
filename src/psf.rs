//! The Gauss-Hermite PSF of DESI (specex `PSFTYPE = GAUSS-HERMITE`, `PSFVER = 3`): reading
//! and validating the file, evaluating its Legendre-parameterised traces and shape
//! parameters, and pixel-integrated spots.
//!
//! A spot of fiber `f` at wavelength `w` is `ny = 2 HSIZEY + 1` rows by `nx = 2 HSIZEX + 1`
//! columns whose lower-left pixel on the CCD is `(floor(X - HSIZEX + 0.5), floor(Y - HSIZEY +
//! 0.5))`. Its value is `sum_ij GH-i-j pGHy[j][iy] pGHx[i][ix]`, clipped at zero and normalised
//! to unit sum, where `pGH` are Gauss-Hermite functions integrated over each pixel. The TAIL*
//! parameters are not used (as in gpu_specter): a PSF whose TAILAMP is not zero gets a
//! warning when it is read.

use std::ops::Range;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fits::Fits;

/// Default fractional PSF error for chi2pix when the PSF does not give `PSFERR`.
pub const DEFAULT_PSFERR: f64 = 0.01;

/// A set of Legendre series, one per fiber, over a wavelength domain.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Legendre {
    pub wavemin: f64,
    pub wavemax: f64,
    /// Number of coefficients per fiber (degree + 1).
    pub ncoef: usize,
    /// Coefficients `[fiber][k]`.
    pub coeff: Vec<f64>,
}

impl Legendre {
    /// Evaluates the series of `fiber` at wavelength `w`:
    /// `sum_k c[fiber][k] P_k(u)`, `u = 2 (w - wavemin) / (wavemax - wavemin) - 1`.
    pub fn eval(&self, fiber: usize, w: f64) -> f64 {
        let u = (w - self.wavemin) * (2.0 / (self.wavemax - self.wavemin)) - 1.0;
        let c = &self.coeff[fiber * self.ncoef..(fiber + 1) * self.ncoef];
        let (mut p0, mut p1) = (1.0, u);
        let mut sum = c[0];
        if self.ncoef > 1 {
            sum += c[1] * u;
        }
        for (k, &ck) in c.iter().enumerate().skip(2) {
            // (k) P_k = (2k - 1) u P_{k-1} - (k - 1) P_{k-2}
            let kf = k as f64;
            let p2 = ((2.0 * kf - 1.0) * u * p1 - (kf - 1.0) * p0) / kf;
            sum += ck * p2;
            p0 = p1;
            p1 = p2;
        }
        sum
    }

    /// [`Legendre::eval`] of `fiber` at every wavelength of `waves`, into `out`, bit for bit:
    /// each value takes the same operations in the same order, but `LANES` wavelengths go
    /// through the recurrence together, so that their divisions are in flight at once (and
    /// in SIMD registers) instead of one dependent division after another.
    pub fn eval_many(&self, fiber: usize, waves: &[f64], out: &mut [f64]) {
        pulp::Arch::new().dispatch(EvalMany {
            series: self,
            fiber,
            waves,
            out,
        })
    }
}

/// Wavelengths evaluated together by [`Legendre::eval_many`].
const LANES: usize = 8;

/// [`Legendre::eval_many`] as a SIMD operation.
struct EvalMany<'a> {
    series: &'a Legendre,
    fiber: usize,
    waves: &'a [f64],
    out: &'a mut [f64],
}

impl pulp::WithSimd for EvalMany<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let l = self.series;
        let c = &l.coeff[self.fiber * l.ncoef..(self.fiber + 1) * l.ncoef];
        let scale = 2.0 / (l.wavemax - l.wavemin);
        let mut waves = self.waves.chunks_exact(LANES);
        let mut outs = self.out.chunks_exact_mut(LANES);
        for (w, o) in (&mut waves).zip(&mut outs) {
            let mut u = [0.0; LANES];
            for (u, &w) in u.iter_mut().zip(w) {
                *u = (w - l.wavemin) * scale - 1.0;
            }
            let (mut p0, mut p1) = ([1.0; LANES], u);
            let mut sum = [c[0]; LANES];
            if l.ncoef > 1 {
                for (s, &u) in sum.iter_mut().zip(&u) {
                    *s += c[1] * u;
                }
            }
            for (k, &ck) in c.iter().enumerate().skip(2) {
                let kf = k as f64;
                for i in 0..LANES {
                    let p2 = ((2.0 * kf - 1.0) * u[i] * p1[i] - (kf - 1.0) * p0[i]) / kf;
                    sum[i] += ck * p2;
                    p0[i] = p1[i];
                    p1[i] = p2;
                }
            }
            o.copy_from_slice(&sum);
        }
        for (&w, o) in waves.remainder().iter().zip(outs.into_remainder()) {
            *o = l.eval(self.fiber, w);
        }
    }
}

/// Legendre polynomials `P_0..P_deg` at `u`.
pub fn legendre_values(u: f64, deg: usize, out: &mut [f64]) {
    out[0] = 1.0;
    if deg >= 1 {
        out[1] = u;
    }
    for k in 2..=deg {
        let kf = k as f64;
        out[k] = ((2.0 * kf - 1.0) * u * out[k - 1] - (kf - 1.0) * out[k - 2]) / kf;
    }
}

/// Probabilists' Hermite polynomials `He_0..He_deg` at `t`.
#[inline]
pub fn hermite_values(t: f64, deg: usize, out: &mut [f64]) {
    out[0] = 1.0;
    if deg >= 1 {
        out[1] = t;
    }
    for k in 2..=deg {
        out[k] = t * out[k - 1] - (k - 1) as f64 * out[k - 2];
    }
}

/// The shape parameters of one spot: centre, Gaussian widths and the Gauss-Hermite
/// coefficients `gh[i * (ghdegy + 1) + j]` of `GH-i-j`.
#[derive(Clone, Debug, PartialEq)]
pub struct SpotParams {
    pub x: f64,
    pub y: f64,
    pub sigx: f64,
    pub sigy: f64,
    pub gh: Vec<f64>,
}

/// Largest spot half size (HSIZEX, HSIZEY) accepted; DESI PSFs use 8 and 5.
const MAX_HSIZE: usize = 64;

/// Largest Gauss-Hermite degree accepted; DESI PSFs use 6.
const MAX_GHDEG: usize = 20;

/// A Gauss-Hermite PSF as read from a specex file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GaussHermitePsf {
    pub path: PathBuf,
    /// Number of fibers described (FIBERMAX - FIBERMIN + 1).
    pub nfiber: usize,
    pub hsizex: usize,
    pub hsizey: usize,
    pub ghdegx: usize,
    pub ghdegy: usize,
    pub legdeg: usize,
    /// CCD size (columns, rows) the PSF was fitted on.
    pub npix_x: usize,
    pub npix_y: usize,
    /// `PSFERR` of the file, if any.
    pub psferr: Option<f64>,
    /// The PSF's own IN_PSF keyword (the PSF it was derived from), carried into the frame as
    /// ORIG_PSF.
    pub orig_psf: Option<String>,
    /// Largest |coefficient| of TAILAMP (0 when the table has no TAILAMP): the amplitude of
    /// the power-law tails that spex does not model.
    pub tail_amplitude: f64,
    pub xtrace: Legendre,
    pub ytrace: Legendre,
    /// `GHSIGX`, `GHSIGY` and the `GH-i-j`, on the PSF table's wavelength domain.
    pub ghsigx: Legendre,
    pub ghsigy: Legendre,
    pub gh: Vec<Legendre>,
}

impl GaussHermitePsf {
    /// Reads and validates a PSF file.
    pub fn read(path: &Path) -> Result<Self> {
        let mut fits = Fits::open(path)?;
        let bad = |message: String| Error::Psf {
            path: path.into(),
            message,
        };

        fits.move_to("PSF")?;
        if let Some(kind) = fits.key_str("PSFTYPE")? {
            if kind.trim() != "GAUSS-HERMITE" {
                return Err(bad(format!(
                    "PSFTYPE is {kind:?}; spex reads GAUSS-HERMITE PSFs"
                )));
            }
        }
        let wavemin = fits.require_f64("WAVEMIN")?;
        let wavemax = fits.require_f64("WAVEMAX")?;
        let key = |fits: &mut Fits, k: &str| -> Result<usize> {
            let v = fits.require_i64(k)?;
            usize::try_from(v).map_err(|_| bad(format!("{k} = {v} is negative")))
        };
        let legdeg = key(&mut fits, "LEGDEG")?;
        let ghdegx = key(&mut fits, "GHDEGX")?;
        let ghdegy = key(&mut fits, "GHDEGY")?;
        let hsizex = key(&mut fits, "HSIZEX")?;
        let hsizey = key(&mut fits, "HSIZEY")?;
        let npix_x = key(&mut fits, "NPIX_X")?;
        let npix_y = key(&mut fits, "NPIX_Y")?;
        let psferr = fits.key_f64("PSFERR")?;
        let orig_psf = fits.key_str("IN_PSF")?;
        // Bounds first: the degrees size the parameter lookups below.
        if ghdegx > MAX_GHDEG || ghdegy > MAX_GHDEG {
            return Err(bad(format!(
                "Gauss-Hermite degrees {ghdegx}, {ghdegy} above {MAX_GHDEG}"
            )));
        }

        let names = fits.column_str("PARAM")?;
        let (repeat, coeff) = fits.column::<f64>("COEFF")?;
        let ncoef = legdeg + 1;
        if repeat == 0 || repeat % ncoef != 0 {
            return Err(bad(format!(
                "COEFF has {repeat} values per row, not a multiple of LEGDEG+1 = {ncoef}"
            )));
        }
        let nfiber = repeat / ncoef;
        let param = |name: &str| -> Result<Legendre> {
            let row = names
                .iter()
                .position(|n| n.trim() == name)
                .ok_or_else(|| bad(format!("parameter {name} missing from the PSF table")))?;
            Ok(Legendre {
                wavemin,
                wavemax,
                ncoef,
                coeff: coeff[row * repeat..(row + 1) * repeat].to_vec(),
            })
        };
        let tail_amplitude = names
            .iter()
            .any(|n| n.trim() == "TAILAMP")
            .then(|| param("TAILAMP"))
            .transpose()?
            .map_or(0.0, |t| {
                t.coeff.iter().fold(0.0, |m, c| f64::max(m, c.abs()))
            });
        if tail_amplitude != 0.0 {
            tracing::warn!(
                "{}: TAILAMP is not zero (up to {tail_amplitude:.3e}); PSF tails are not modelled",
                path.display()
            );
        }
        let ghsigx = param("GHSIGX")?;
        let ghsigy = param("GHSIGY")?;
        let mut gh = Vec::with_capacity((ghdegx + 1) * (ghdegy + 1));
        for i in 0..=ghdegx {
            for j in 0..=ghdegy {
                gh.push(param(&format!("GH-{i}-{j}"))?);
            }
        }

        let mut trace = |name: &str| -> Result<Legendre> {
            fits.move_to(name)?;
            let wmin = fits.require_f64("WAVEMIN")?;
            let wmax = fits.require_f64("WAVEMAX")?;
            let (shape, data) = fits.read_image::<f64>()?;
            if shape.len() != 2 || shape[0] != nfiber || shape[1] == 0 {
                return Err(bad(format!(
                    "{name} has shape {shape:?}, expected [{nfiber}, ncoef]"
                )));
            }
            Ok(Legendre {
                wavemin: wmin,
                wavemax: wmax,
                ncoef: shape[1],
                coeff: data,
            })
        };
        let xtrace = trace("XTRACE")?;
        let ytrace = trace("YTRACE")?;

        let psf = GaussHermitePsf {
            path: path.into(),
            nfiber,
            hsizex,
            hsizey,
            ghdegx,
            ghdegy,
            legdeg,
            npix_x,
            npix_y,
            psferr,
            orig_psf,
            tail_amplitude,
            xtrace,
            ytrace,
            ghsigx,
            ghsigy,
            gh,
        };
        psf.validate()?;
        Ok(psf)
    }

    /// Checks what the model relies on, whether the PSF comes from its file or from another
    /// rank: spot sizes, degrees, one series per Gauss-Hermite term, and finite coefficients
    /// for every fiber on a non-empty wavelength domain.
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Error::Psf {
            path: self.path.clone(),
            message,
        };
        let (hx, hy) = (self.hsizex, self.hsizey);
        if !(1..=MAX_HSIZE).contains(&hx) || !(1..=MAX_HSIZE).contains(&hy) {
            return Err(bad(format!(
                "spot half sizes HSIZEX {hx}, HSIZEY {hy} out of range 1..{MAX_HSIZE}"
            )));
        }
        if self.ghdegx > MAX_GHDEG || self.ghdegy > MAX_GHDEG {
            return Err(bad(format!(
                "Gauss-Hermite degrees {}, {} above {MAX_GHDEG}",
                self.ghdegx, self.ghdegy
            )));
        }
        if self.gh.len() != self.ngh() {
            return Err(bad(format!(
                "{} Gauss-Hermite terms for degrees {}, {}",
                self.gh.len(),
                self.ghdegx,
                self.ghdegy
            )));
        }
        if self.nfiber == 0 {
            return Err(bad("no fibers".into()));
        }
        let named = [
            ("XTRACE".to_string(), &self.xtrace),
            ("YTRACE".to_string(), &self.ytrace),
            ("GHSIGX".to_string(), &self.ghsigx),
            ("GHSIGY".to_string(), &self.ghsigy),
        ];
        let gh = self.gh.iter().enumerate().map(|(k, l)| {
            let (i, j) = (k / (self.ghdegy + 1), k % (self.ghdegy + 1));
            (format!("GH-{i}-{j}"), l)
        });
        for (name, l) in named.into_iter().chain(gh) {
            if !(l.wavemax > l.wavemin) {
                return Err(bad(format!(
                    "{name} WAVEMAX {} <= WAVEMIN {}",
                    l.wavemax, l.wavemin
                )));
            }
            if l.ncoef == 0 || l.coeff.len() != self.nfiber * l.ncoef {
                return Err(bad(format!(
                    "{name} has {} coefficients for {} fibers of degree {}",
                    l.coeff.len(),
                    self.nfiber,
                    l.ncoef as i64 - 1
                )));
            }
            if l.coeff.iter().any(|v| !v.is_finite()) {
                return Err(bad(format!("{name} has non-finite coefficients")));
            }
        }
        Ok(())
    }

    /// Spot size (ny, nx).
    pub fn spot_shape(&self) -> (usize, usize) {
        (2 * self.hsizey + 1, 2 * self.hsizex + 1)
    }

    /// Number of Gauss-Hermite coefficients per spot.
    pub fn ngh(&self) -> usize {
        (self.ghdegx + 1) * (self.ghdegy + 1)
    }

    /// Wavelength domain on which every parameter (traces included) is defined.
    pub fn wave_domain(&self) -> (f64, f64) {
        let lo = self
            .ghsigx
            .wavemin
            .max(self.xtrace.wavemin)
            .max(self.ytrace.wavemin);
        let hi = self
            .ghsigx
            .wavemax
            .min(self.xtrace.wavemax)
            .min(self.ytrace.wavemax);
        (lo, hi)
    }

    /// The PSF table's own wavelength domain (WAVEMIN, WAVEMAX of the PSF HDU).
    pub fn param_domain(&self) -> (f64, f64) {
        (self.ghsigx.wavemin, self.ghsigx.wavemax)
    }

    /// CCD position (x, y) of fiber `fiber` at wavelength `w`.
    pub fn xy(&self, fiber: usize, w: f64) -> (f64, f64) {
        (self.xtrace.eval(fiber, w), self.ytrace.eval(fiber, w))
    }

    /// [`Self::xy`] of `fiber` at every wavelength of `waves`, as x and y columns (bit for
    /// bit, several wavelengths at a time).
    pub fn trace(&self, fiber: usize, waves: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let mut x = vec![0.0; waves.len()];
        let mut y = vec![0.0; waves.len()];
        self.xtrace.eval_many(fiber, waves, &mut x);
        self.ytrace.eval_many(fiber, waves, &mut y);
        (x, y)
    }

    /// The spot parameters of fiber `fiber` at wavelength `w`.
    pub fn params(&self, fiber: usize, w: f64) -> SpotParams {
        let (x, y) = self.xy(fiber, w);
        SpotParams {
            x,
            y,
            sigx: self.ghsigx.eval(fiber, w),
            sigy: self.ghsigy.eval(fiber, w),
            gh: self.gh.iter().map(|l| l.eval(fiber, w)).collect(),
        }
    }

    /// Lower-left CCD corners of the spots of `fibers` at every wavelength of `waves`, without
    /// evaluating the spots (enough to lay out patches).
    pub fn corners(&self, fibers: Range<usize>, waves: &[f64]) -> Corners {
        let (ny, nx) = self.spot_shape();
        let mut xc = Vec::with_capacity(fibers.len() * waves.len());
        let mut yc = Vec::with_capacity(fibers.len() * waves.len());
        for fiber in fibers.clone() {
            let (xs, ys) = self.trace(fiber, waves);
            for (&x, &y) in xs.iter().zip(&ys) {
                let (cx, cy) = self.corner_of(x, y);
                xc.push(cx);
                yc.push(cy);
            }
        }
        Corners {
            fibers,
            nwave: waves.len(),
            ny,
            nx,
            xc,
            yc,
        }
    }

    /// Lower-left corner of a spot centred at (x, y): the extra 0.5 is because x, y refer to
    /// pixel centres.
    pub fn corner_of(&self, x: f64, y: f64) -> (i32, i32) {
        (
            (x - self.hsizex as f64 + 0.5).floor() as i32,
            (y - self.hsizey as f64 + 0.5).floor() as i32,
        )
    }

    /// Evaluates the spots of `fibers` at every wavelength of `waves`.
    pub fn spots(&self, fibers: Range<usize>, waves: &[f64]) -> Spots {
        let mut spots = Spots::default();
        self.spots_into(fibers, waves, &mut spots);
        spots
    }

    /// [`Self::spots`] into the buffers of `spots`, which keep their memory: a backend that
    /// evaluates bundle after bundle maps and zeroes the pages of its largest table once,
    /// not once per bundle. Every value is written, so the previous contents do not matter.
    pub fn spots_into(&self, fibers: Range<usize>, waves: &[f64], spots: &mut Spots) {
        let (ny, nx) = self.spot_shape();
        let nfiber = fibers.len();
        let nwave = waves.len();
        let size = ny * nx;
        spots.data.resize(nfiber * nwave * size, 0.0);
        let c = &mut spots.corners;
        c.xc.resize(nfiber * nwave, 0);
        c.yc.resize(nfiber * nwave, 0);
        (c.nwave, c.ny, c.nx) = (nwave, ny, nx);
        c.fibers = fibers.clone();
        spots
            .data
            .par_chunks_mut(nwave * size)
            .zip(c.xc.par_chunks_mut(nwave).zip(c.yc.par_chunks_mut(nwave)))
            .enumerate()
            .for_each(|(i, (data, (xc, yc)))| {
                pulp::Arch::new().dispatch(FiberSpots {
                    psf: self,
                    fiber: fibers.start + i,
                    waves,
                    data,
                    xc,
                    yc,
                })
            });
    }
}

/// The spots of one fiber at every wavelength, as a SIMD operation: the products of
/// [`SpotWork::eval`] then use the machine's widest vectors. They are plain products and
/// sums in a fixed order, so the spots have the same bits under any instruction set.
struct FiberSpots<'a> {
    psf: &'a GaussHermitePsf,
    fiber: usize,
    waves: &'a [f64],
    data: &'a mut [f64],
    xc: &'a mut [i32],
    yc: &'a mut [i32],
}

impl pulp::WithSimd for FiberSpots<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let psf = self.psf;
        let (ny, nx) = psf.spot_shape();
        let size = ny * nx;
        let mut work = SpotWork::new(psf);
        for (iw, &w) in self.waves.iter().enumerate() {
            let (x, y) = work.params(psf, self.fiber, w);
            work.eval(psf, x, y, &mut self.data[iw * size..(iw + 1) * size]);
            (self.xc[iw], self.yc[iw]) = psf.corner_of(x, y);
        }
    }
}

/// Scratch space for evaluating one spot at a time.
struct SpotWork {
    pghx: Vec<f64>,
    pghy: Vec<f64>,
    tmp: Vec<f64>,
    /// The widths and the Gauss-Hermite coefficients of the spot, as in [`SpotParams`].
    sigx: f64,
    sigy: f64,
    gh: Vec<f64>,
}

impl SpotWork {
    fn new(psf: &GaussHermitePsf) -> Self {
        let (ny, nx) = psf.spot_shape();
        SpotWork {
            pghx: vec![0.0; (psf.ghdegx + 1) * nx],
            pghy: vec![0.0; (psf.ghdegy + 1) * ny],
            tmp: vec![0.0; (psf.ghdegx + 1) * ny],
            sigx: 0.0,
            sigy: 0.0,
            gh: vec![0.0; psf.gh.len()],
        }
    }

    /// The spot parameters of [`GaussHermitePsf::params`] into the scratch space, without
    /// allocating; returns the centre (x, y).
    fn params(&mut self, psf: &GaussHermitePsf, fiber: usize, w: f64) -> (f64, f64) {
        self.sigx = psf.ghsigx.eval(fiber, w);
        self.sigy = psf.ghsigy.eval(fiber, w);
        for (g, l) in self.gh.iter_mut().zip(&psf.gh) {
            *g = l.eval(fiber, w);
        }
        psf.xy(fiber, w)
    }

    /// Writes the normalised spot centred at (x, y) into `out` (`ny * nx`, row-major), from
    /// the parameters of the last [`Self::params`].
    ///
    /// Both products run along rows so that they vectorise; every value is still summed in
    /// the order of the Gauss-Hermite degree, from zero, as a scalar loop over the degree
    /// would, which keeps the spots' bits.
    #[inline(always)]
    fn eval(&mut self, psf: &GaussHermitePsf, x: f64, y: f64, out: &mut [f64]) {
        let (ny, nx) = psf.spot_shape();
        let (ngx, ngy) = (psf.ghdegx + 1, psf.ghdegy + 1);
        pixel_gauss_hermite(x, self.sigx, psf.ghdegx, nx, &mut self.pghx);
        pixel_gauss_hermite(y, self.sigy, psf.ghdegy, ny, &mut self.pghy);
        // tmp[i][iy] = sum_j GH-i-j pGHy[j][iy]
        for (i, t) in self.tmp.chunks_exact_mut(ny).enumerate().take(ngx) {
            t.fill(0.0);
            for (&g, py) in self.gh[i * ngy..(i + 1) * ngy]
                .iter()
                .zip(self.pghy.chunks_exact(ny))
            {
                for (t, &py) in t.iter_mut().zip(py) {
                    *t += g * py;
                }
            }
        }
        // out[iy][ix] = max(0, sum_i tmp[i][iy] pGHx[i][ix])
        let mut total = 0.0;
        for (iy, row) in out.chunks_exact_mut(nx).enumerate().take(ny) {
            row.fill(0.0);
            for (i, px) in self.pghx.chunks_exact(nx).enumerate().take(ngx) {
                let t = self.tmp[i * ny + iy];
                for (o, &px) in row.iter_mut().zip(px) {
                    *o += t * px;
                }
            }
            for o in row.iter_mut() {
                *o = o.max(0.0);
                total += *o;
            }
        }
        if total > 0.0 {
            let inv = 1.0 / total;
            out.iter_mut().for_each(|v| *v *= inv);
        }
    }
}

/// Pixel edges evaluated together by [`pixel_gauss_hermite`].
const EDGE_LANES: usize = 8;

/// Pixel-integrated Gauss-Hermite functions of degrees `0..=deg` over the `n` pixels of a spot
/// centred at `center` with width `sigma`, written as `out[k * n + i]`.
///
/// Degree 0 is the Gaussian's integral over the pixel (a difference of erf); for `k >= 1` the
/// integral of `He_k(t) phi(t)` is `-He_{k-1}(t) phi(t)`, so the pixel value is the difference
/// of that antiderivative at the pixel edges. The edges go through [`gauss_edge`] eight at a
/// time, branch-free, so that they vectorise; the erf at an edge is kept as a whole number
/// and a remainder, so that the difference of two edges in the same tail is that of their
/// `erfc`, without the cancellation of `erf(b) - erf(a)` near 1.
#[inline(always)]
pub fn pixel_gauss_hermite(center: f64, sigma: f64, deg: usize, n: usize, out: &mut [f64]) {
    let frac = (center + 0.5).rem_euclid(1.0) - 0.5;
    let half = (n / 2) as f64;
    let norm = 1.0 / (2.0 * std::f64::consts::PI).sqrt();
    let (mut prev_whole, mut prev_part) = (0.0, 0.0);
    let mut prev_gh = [0.0f64; 24];
    for e0 in (0..=n).step_by(EDGE_LANES) {
        let mut t = [0.0; EDGE_LANES];
        for (l, t) in t.iter_mut().enumerate() {
            *t = ((e0 + l) as f64 - half - 0.5 - frac) / sigma;
        }
        let (mut whole, mut part, mut phi) =
            ([0.0; EDGE_LANES], [0.0; EDGE_LANES], [0.0; EDGE_LANES]);
        for l in 0..EDGE_LANES {
            let g = gauss_edge(t[l]);
            (whole[l], part[l], phi[l]) = (g.whole, g.part, g.gauss * norm);
        }
        // gh[k][l] = He_k(t_l) phi(t_l), the recurrence of `hermite_values`
        let mut gh = [[0.0f64; EDGE_LANES]; 24];
        let (mut h0, mut h1) = ([1.0; EDGE_LANES], t);
        for k in 0..deg {
            let h = if k == 0 { h0 } else { h1 };
            for l in 0..EDGE_LANES {
                gh[k][l] = h[l] * phi[l];
            }
            if k >= 1 {
                let km = k as f64;
                for l in 0..EDGE_LANES {
                    let next = t[l] * h1[l] - km * h0[l];
                    (h0[l], h1[l]) = (h1[l], next);
                }
            }
        }
        for l in 0..EDGE_LANES.min(n + 1 - e0) {
            if e0 + l > 0 {
                let i = e0 + l - 1;
                out[i] = 0.5 * ((whole[l] - prev_whole) + (part[l] - prev_part));
                for k in 1..=deg {
                    out[k * n + i] = prev_gh[k - 1] - gh[k - 1][l];
                }
            }
            (prev_whole, prev_part) = (whole[l], part[l]);
            for k in 0..deg {
                prev_gh[k] = gh[k][l];
            }
        }
    }
}

/// The Gaussian at a pixel edge `t` (in units of its width): `exp(-t^2 / 2)` and
/// `erf(t / sqrt 2) = whole + part`, with `whole` -1, 0 or 1.
#[derive(Clone, Copy, Debug)]
pub struct GaussEdge {
    pub gauss: f64,
    pub whole: f64,
    pub part: f64,
}

/// [`GaussEdge`] at `t`, branch-free (every range is evaluated and one selected) so that a
/// loop over edges vectorises, in pure Rust: the same values on every platform.
///
/// `erf` follows W. J. Cody's rational Chebyshev approximations (Math. Comp. 23, 1969; the
/// coefficients of his CALERF): `erf(x) = x A(x^2) / B(x^2)` for `|x| <= 0.46875`, and
/// `erfc(|x|) = exp(-x^2) C(|x|) / D(|x|)` up to 4, `exp(-x^2) (1/sqrt(pi) - P(z) / Q(z)) / |x|`
/// with `z = 1 / x^2` beyond. Their `exp(-x^2)` is the Gaussian itself, which the pixel
/// integrals need anyway ([`exp_nonpositive`] of `-t^2 / 2`), so an edge takes one
/// exponential where `libm::erf` takes up to two of its own besides.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cody's coefficients as published
pub fn gauss_edge(t: f64) -> GaussEdge {
    const A: [f64; 5] = [
        3.16112374387056560e00,
        1.13864154151050156e02,
        3.77485237685302021e02,
        3.20937758913846947e03,
        1.85777706184603153e-1,
    ];
    const B: [f64; 4] = [
        2.36012909523441209e01,
        2.44024637934444173e02,
        1.28261652607737228e03,
        2.84423683343917062e03,
    ];
    const C: [f64; 9] = [
        5.64188496988670089e-1,
        8.88314979438837594e00,
        6.61191906371416295e01,
        2.98635138197400131e02,
        8.81952221241769090e02,
        1.71204761263407058e03,
        2.05107837782607147e03,
        1.23033935479799725e03,
        2.15311535474403846e-8,
    ];
    const D: [f64; 8] = [
        1.57449261107098347e01,
        1.17693950891312499e02,
        5.37181101862009858e02,
        1.62138957456669019e03,
        3.29079923573345963e03,
        4.36261909014324716e03,
        3.43936767414372164e03,
        1.23033935480374942e03,
    ];
    const P: [f64; 6] = [
        3.05326634961232344e-1,
        3.60344899949804439e-1,
        1.25781726111229246e-1,
        1.60837851487422766e-2,
        6.58749161529837803e-4,
        1.63153871373020978e-2,
    ];
    const Q: [f64; 5] = [
        2.56852019228982242e00,
        1.87295284992346047e00,
        5.27905102951428412e-1,
        6.05183413124413191e-2,
        2.33520497626869185e-3,
    ];
    const FRAC_1_SQRT_PI: f64 = 0.564_189_583_547_756_3;
    const THRESH: f64 = 0.46875;
    let gauss = exp_nonpositive(-0.5 * t * t);
    let x = t * std::f64::consts::FRAC_1_SQRT_2;
    let y = x.abs();
    // |x| <= 0.46875: erf itself
    let z = y * y;
    let (mut num, mut den) = (A[4] * z, z);
    for i in 0..3 {
        num = (num + A[i]) * z;
        den = (den + B[i]) * z;
    }
    let small = x * (num + A[3]) / (den + B[3]);
    // 0.46875 < |x| <= 4: erfc(|x|)
    let (mut num, mut den) = (C[8] * y, y);
    for i in 0..7 {
        num = (num + C[i]) * y;
        den = (den + D[i]) * y;
    }
    let middle = gauss * (num + C[7]) / (den + D[7]);
    // |x| > 4: erfc(|x|) (`yl` keeps the unused lanes finite)
    let yl = y.max(4.0);
    let z = 1.0 / (yl * yl);
    let (mut num, mut den) = (P[5] * z, z);
    for i in 0..4 {
        num = (num + P[i]) * z;
        den = (den + Q[i]) * z;
    }
    let large = gauss * (FRAC_1_SQRT_PI - z * (num + P[4]) / (den + Q[4])) / yl;
    let erfc = if y > 4.0 { large } else { middle };
    let sign = if x < 0.0 { -1.0 } else { 1.0 };
    let (whole, part) = if y <= THRESH {
        (0.0, small)
    } else {
        (sign, -sign * erfc)
    };
    GaussEdge { gauss, whole, part }
}

/// `exp(y)` for `y <= 0`, branch-free and in pure Rust: `2^k exp(r)` with `k` the nearest
/// integer to `y / ln 2`, `r = y - k ln 2` (within `ln 2 / 2`) and `exp(r)` its Taylor
/// polynomial of degree 13 (truncation below 6e-18 relative), within an ulp or two of the
/// exponential. Below -700 (`exp(y) < 1e-304`) it returns `exp(-700)`, and 0 below -745.
#[inline(always)]
pub fn exp_nonpositive(y: f64) -> f64 {
    // ln 2 split as fdlibm does: the high part's last 32 bits are zero, so `k LN2_HI` is exact
    const LN2_HI: f64 = 0.6931471803691238;
    const LN2_LO: f64 = 1.9082149292705877e-10;
    // 1.5 * 2^52: adding it rounds to an integer, which its low bits then hold
    const ROUND: f64 = 6755399441055744.0;
    const TAYLOR: [f64; 14] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
        1.0 / 40320.0,
        1.0 / 362880.0,
        1.0 / 3628800.0,
        1.0 / 39916800.0,
        1.0 / 479001600.0,
        1.0 / 6227020800.0,
    ];
    let tiny = y < -745.0;
    let y = y.max(-700.0);
    let kr = y.mul_add(std::f64::consts::LOG2_E, ROUND);
    let k = kr - ROUND;
    let r = (-k).mul_add(LN2_HI, y);
    let r = (-k).mul_add(LN2_LO, r);
    let mut p = TAYLOR[13];
    for &c in TAYLOR[..13].iter().rev() {
        p = p.mul_add(r, c);
    }
    // 2^k from its exponent bits (k >= -1010: a normal number)
    let ki = kr.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f64::from_bits(ki.wrapping_add(1023) << 52);
    if tiny {
        0.0
    } else {
        p * scale
    }
}

/// CCD corners of the spots of a block of fibers on a wavelength grid.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Corners {
    /// Absolute fiber numbers covered.
    pub fibers: Range<usize>,
    pub nwave: usize,
    /// Spot size.
    pub ny: usize,
    pub nx: usize,
    /// Lower-left corner column and row of each spot, `[fiber][wave]`, fiber relative to
    /// `fibers.start`.
    pub xc: Vec<i32>,
    pub yc: Vec<i32>,
}

impl Corners {
    /// Lower-left corner (column, row) of the spot of relative fiber `f` at wavelength index `w`.
    #[inline]
    pub fn corner(&self, f: usize, w: usize) -> (i32, i32) {
        let i = f * self.nwave + w;
        (self.xc[i], self.yc[i])
    }
}

/// Spots of a block of fibers on a wavelength grid, with their CCD corners.
#[derive(Clone, Debug, Default)]
pub struct Spots {
    pub corners: Corners,
    /// `[fiber][wave][ny][nx]`, fiber relative to `corners.fibers.start`.
    pub data: Vec<f64>,
}

impl Spots {
    /// The spot of relative fiber `f` at wavelength index `w`.
    #[inline]
    pub fn spot(&self, f: usize, w: usize) -> &[f64] {
        let c = &self.corners;
        let size = c.ny * c.nx;
        let i = f * c.nwave + w;
        &self.data[i * size..(i + 1) * size]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name)
    }

    #[test]
    fn legendre_matches_closed_forms() {
        let mut p = [0.0; 5];
        for &u in &[-1.0, -0.3, 0.0, 0.7, 1.0] {
            legendre_values(u, 4, &mut p);
            let expect = [
                1.0,
                u,
                0.5 * (3.0 * u * u - 1.0),
                0.5 * (5.0 * u * u * u - 3.0 * u),
                (35.0 * u.powi(4) - 30.0 * u * u + 3.0) / 8.0,
            ];
            for (a, b) in p.iter().zip(expect) {
                assert!((a - b).abs() < 1e-14, "P at {u}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn legendre_series_uses_its_own_domain() {
        let l = Legendre {
            wavemin: 5000.0,
            wavemax: 7000.0,
            ncoef: 3,
            coeff: vec![1.0, 2.0, 3.0],
        };
        // u = 0 at the centre: 1 + 0 + 3 * (-1/2)
        assert!((l.eval(0, 6000.0) - (1.0 - 1.5)).abs() < 1e-14);
        // u = 1 at wavemax: 1 + 2 + 3
        assert!((l.eval(0, 7000.0) - 6.0).abs() < 1e-13);
    }

    #[test]
    fn batched_traces_are_the_scalar_ones_bit_for_bit() {
        let psf = GaussHermitePsf::read(&data("psf-r0-00067784.fits")).unwrap();
        // a grid whose length is not a multiple of the lanes, and a single wavelength
        let waves: Vec<f64> = (0..2331).map(|i| 5760.0 + 0.8 * i as f64).collect();
        for fiber in [0, 251, 499] {
            for grid in [&waves[..], &waves[7..8]] {
                let (x, y) = psf.trace(fiber, grid);
                for (i, &w) in grid.iter().enumerate() {
                    let (ex, ey) = psf.xy(fiber, w);
                    assert_eq!(x[i].to_bits(), ex.to_bits(), "x of fiber {fiber} at {w}");
                    assert_eq!(y[i].to_bits(), ey.to_bits(), "y of fiber {fiber} at {w}");
                }
            }
        }
    }

    #[test]
    fn hermite_matches_closed_forms() {
        let mut h = [0.0; 5];
        for &t in &[-2.0, -0.5, 0.0, 1.3] {
            hermite_values(t, 4, &mut h);
            let expect = [
                1.0,
                t,
                t * t - 1.0,
                t.powi(3) - 3.0 * t,
                t.powi(4) - 6.0 * t * t + 3.0,
            ];
            for (a, b) in h.iter().zip(expect) {
                assert!((a - b).abs() < 1e-13);
            }
        }
    }

    /// Simpson integration of He_k(t) phi(t) over [a, b].
    fn integrate(k: usize, a: f64, b: f64) -> f64 {
        let n = 2000;
        let h = (b - a) / n as f64;
        let mut herm = [0.0; 24];
        let f = |t: f64, herm: &mut [f64]| {
            hermite_values(t, k, herm);
            herm[k] * (-0.5 * t * t).exp() / (2.0 * std::f64::consts::PI).sqrt()
        };
        let mut s = f(a, &mut herm) + f(b, &mut herm);
        for i in 1..n {
            let w = if i % 2 == 1 { 4.0 } else { 2.0 };
            s += w * f(a + i as f64 * h, &mut herm);
        }
        s * h / 3.0
    }

    /// The branch-free exponential is within two ulps of the correctly rounded one.
    #[test]
    fn exponential_is_accurate() {
        for i in 0..=200_000 {
            let y = -745.0 * (i as f64 / 200_000.0).powi(2);
            let (got, expect) = (exp_nonpositive(y), libm::exp(y));
            if y >= -700.0 {
                assert!(
                    (got - expect).abs() <= 2.0 * f64::EPSILON * expect,
                    "exp({y}) = {got:e} vs {expect:e}"
                );
            } else {
                assert!(got <= 1e-304);
            }
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-800.0), 0.0);
    }

    /// erf at the edges agrees with libm's to a few units of 1e-16, and the remainder in the
    /// tails is erfc to a relative accuracy that only the rounding of `t^2` limits.
    #[test]
    fn gaussian_edges_match_libm() {
        for i in -40_000..=40_000 {
            let t = i as f64 * 1e-3;
            let x = t * std::f64::consts::FRAC_1_SQRT_2;
            let g = gauss_edge(t);
            let erf = libm::erf(x);
            assert!(
                (g.whole + g.part - erf).abs() <= 2.0 * f64::EPSILON,
                "erf({x}): {} + {} vs {erf}",
                g.whole,
                g.part
            );
            let gauss = libm::exp(-0.5 * t * t);
            assert!(
                (g.gauss - gauss).abs() <= 2.0 * f64::EPSILON * gauss || g.gauss < 1e-303,
                "gauss({t})"
            );
            // (beyond |x| = 26 the Gaussian is held at exp(-700))
            if g.whole != 0.0 && x.abs() < 26.0 {
                let erfc = libm::erfc(x.abs());
                let tol = 8.0 * f64::EPSILON * (1.0 + x * x) * erfc;
                assert!(
                    (g.whole * -g.part - erfc).abs() <= tol,
                    "erfc({}): {:e} vs {erfc:e}",
                    x.abs(),
                    -g.whole * g.part
                );
            }
        }
    }

    #[test]
    fn pixel_integrals_match_numerical_integration() {
        let (n, deg, sigma, center) = (11, 6, 1.1, 1234.37);
        let mut out = vec![0.0; (deg + 1) * n];
        pixel_gauss_hermite(center, sigma, deg, n, &mut out);
        let frac = (center + 0.5f64).rem_euclid(1.0) - 0.5;
        for k in 0..=deg {
            for i in 0..n {
                let lo = (i as f64 - (n / 2) as f64 - 0.5 - frac) / sigma;
                let hi = lo + 1.0 / sigma;
                // pixel integral in t of He_k phi, per unit t; degree 0 is the Gaussian's mass
                let expect = integrate(k, lo, hi);
                let got = out[k * n + i];
                // d/dt(-He_{k-1} phi) = He_k phi, so degree k >= 1 values are integrals of He_k phi
                assert!(
                    (got - expect).abs() < 1e-10,
                    "k={k} i={i}: {got} vs {expect}"
                );
            }
        }
    }

    #[test]
    fn real_psfs_read_with_their_shapes() {
        let a = GaussHermitePsf::read(&data("psf-r0-00067784.fits")).unwrap();
        assert_eq!(
            (a.nfiber, a.legdeg, a.hsizex, a.hsizey, a.ghdegx, a.ghdegy),
            (500, 1, 8, 5, 6, 6)
        );
        assert_eq!((a.npix_x, a.npix_y), (4114, 4128));
        assert_eq!(a.psferr, None);
        let b = GaussHermitePsf::read(&data("psf-r0-00051060.fits")).unwrap();
        assert_eq!((b.nfiber, b.legdeg), (500, 3));
        let (lo, hi) = b.wave_domain();
        assert!(lo < 5800.0 && hi > 7600.0);
    }

    #[test]
    fn spots_are_normalised_nonnegative_and_centred() {
        let psf = GaussHermitePsf::read(&data("psf-r0-00051060.fits")).unwrap();
        let waves = [5800.0, 6500.3, 7600.0];
        let spots = psf.spots(10..13, &waves);
        for f in 0..3 {
            for (w, &wave) in waves.iter().enumerate() {
                let s = spots.spot(f, w);
                let sum: f64 = s.iter().sum();
                assert!((sum - 1.0).abs() < 1e-12);
                assert!(s.iter().all(|&v| v >= 0.0));
                // the centroid lies within half a pixel of the trace
                let (nx, ny) = (spots.corners.nx, spots.corners.ny);
                let (xc, yc) = spots.corners.corner(f, w);
                let cx: f64 = (0..ny * nx)
                    .map(|i| s[i] * (xc as f64 + (i % nx) as f64))
                    .sum();
                let cy: f64 = (0..ny * nx)
                    .map(|i| s[i] * (yc as f64 + (i / nx) as f64))
                    .sum();
                let (x, y) = psf.xy(10 + f, wave);
                assert!(
                    (cx - x).abs() < 0.5 && (cy - y).abs() < 0.5,
                    "centroid ({cx}, {cy}) vs trace ({x}, {y})"
                );
            }
        }
        assert_eq!(psf.corners(10..13, &waves), spots.corners);
    }

    /// Log lines written while `f` runs, captured by a subscriber of this thread only.
    fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let out = tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        (out, text)
    }

    #[test]
    fn psf_with_tails_gets_one_warning() {
        let (psf, log) = logged(|| GaussHermitePsf::read(&data("psf-r0-00067784.fits")));
        let psf = psf.unwrap();
        assert_eq!(psf.tail_amplitude, 0.0);
        assert!(!log.contains("TAILAMP"), "{log}");
        assert_eq!(
            psf.orig_psf.as_deref(),
            Some("SPECPROD/calibnight/20201214/psfnight-r0-20201214.fits")
        );

        // The same PSF with a tail amplitude on one fiber.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("psf-tails.fits");
        std::fs::copy(data("psf-r0-00067784.fits"), &path).unwrap();
        let row = {
            let mut f = Fits::open(&path).unwrap();
            f.move_to("PSF").unwrap();
            let names = f.column_str("PARAM").unwrap();
            names.iter().position(|n| n.trim() == "TAILAMP").unwrap()
        };
        {
            let mut f = fitsio::FitsFile::edit(&path).unwrap();
            let hdu = f.hdu("PSF").unwrap();
            hdu.write_col_range(&mut f, "COEFF", &[0.02f64], &(row..row + 1))
                .unwrap();
        }
        let (psf, log) = logged(|| GaussHermitePsf::read(&path));
        assert_eq!(psf.unwrap().tail_amplitude, 0.02);
        assert_eq!(log.matches("tails are not modelled").count(), 1, "{log}");
        assert!(log.contains("WARN"), "{log}");
    }

    #[test]
    fn missing_or_wrong_files_are_reported_by_name() {
        let err = GaussHermitePsf::read(Path::new("/nonexistent/psf.fits")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/psf.fits"));
        // a preproc image has no PSF HDU
        let err = GaussHermitePsf::read(&data("preproc-bundle0.fits")).unwrap_err();
        assert!(err.to_string().contains("PSF"), "{err}");
    }
}
