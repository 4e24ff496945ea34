//! Trace evaluation: the Legendre series of a PSF (traces and shape parameters) at any
//! wavelength, a spot's parameters, and the CCD corners of spots, enough to lay out patches.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::{GaussHermitePsf, SpotParams};

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

impl GaussHermitePsf {
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
