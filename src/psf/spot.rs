//! Spot evaluation: pixel-integrated Gauss-Hermite spots of a block of fibers on a wavelength
//! grid, with the Hermite polynomials, Gaussian edge integrals and exponential they use.

use std::ops::Range;

use rayon::prelude::*;

use super::{Corners, GaussHermitePsf};

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

impl GaussHermitePsf {
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
