//! The linear system of one patch: its projection matrix restricted to the patch's pixel box
//! and the normal equations `icov x = y` (DESIGN "Solve of one patch", step 1), stored as the
//! fiber blocks that the Schur-complement sweeps use.
//!
//! Fibers sit about 7 pixels apart and their spots are about 17 pixels wide, so `icov` is
//! block-tridiagonal in the fibers' order along the CCD: a fiber couples to its neighbours
//! (about 1.5e-4 relative) and, through the tails of the spots only, to its second neighbours
//! (below 1e-13). The blocks of neighbouring fibers are kept; any other coupling is kept aside
//! so that the solve can measure what dropping it costs and take the dense route instead.

use std::cell::RefCell;

use faer::Mat;
use ndarray::s;

use crate::extract::PatchGeometry;
use crate::image::Image;
use crate::psf::Spots;

thread_local! {
    /// The weighted columns of the patch being assembled (under a megabyte), kept by each
    /// thread from patch to patch: a fresh buffer was zeroed for every patch, and with the
    /// system's allocator also faulted in page by page, where only the columns of spots cut
    /// by the box need zeros.
    static WEIGHTED: RefCell<Vec<f64>> = const { RefCell::new(Vec::new()) };
}

/// The projection matrix of a patch restricted to its pixel box, with the box's pixels.
///
/// A column is its spot, read in place from the bundle's table: every loop over a column
/// runs over the rows and columns of the spot that fall in the box ([`Self::for_rows`]), and
/// the weighted columns of the normal equations are zero outside it.
pub(super) struct PatchSystem<'a> {
    pub geom: PatchGeometry,
    ny: usize,
    nx: usize,
    spots: &'a Spots,
    /// Per column: CCD corner (x, y).
    corner: Vec<(i64, i64)>,
    /// Box pixels and weights, `[row][col]` of the box.
    pub pix: Vec<f64>,
    pub ivar: Vec<f64>,
}

/// The normal equations of a patch, by fiber block.
///
/// Unknowns keep the order of [`PatchGeometry`] (padding fibers first); `order` lists the
/// blocks in the fibers' order along the CCD, the order of the block-tridiagonal structure.
#[derive(Clone, Debug)]
pub struct NormalEquations {
    /// Bins per fiber block.
    pub nt: usize,
    /// `order[k]`: the block (index in [`PatchGeometry::block_fibers`]) at position `k` along
    /// the CCD.
    pub order: Vec<usize>,
    /// `A_kk` at each position, full symmetric.
    pub diag: Vec<Mat<f64>>,
    /// `A_{k+1,k}`: rows are the bins of position `k + 1`, columns those of position `k`.
    pub sub: Vec<Mat<f64>>,
    /// Couplings of blocks further apart: (unknown, unknown, value), each pair once.
    pub far: Vec<(usize, usize, f64)>,
    /// Whether `far` holds upper bounds of `|a_ij|` instead of the couplings
    /// ([`PatchSystem::normal_equations_bounded`]): enough to show that the sweeps may drop
    /// them, not for the dense route, which needs the exact ones.
    pub far_bounded: bool,
    /// `A^T W p`.
    pub y: Vec<f64>,
    /// `A^T W 1`.
    pub fluxweight: Vec<f64>,
}

impl NormalEquations {
    /// Number of unknowns.
    pub fn nunknowns(&self) -> usize {
        self.y.len()
    }

    /// The whole `icov` in the order of the unknowns, for the dense route.
    pub fn dense(&self) -> Mat<f64> {
        let nt = self.nt;
        let m = self.nunknowns();
        let mut icov = Mat::<f64>::zeros(m, m);
        for (k, &b) in self.order.iter().enumerate() {
            let o = b * nt;
            icov.as_mut()
                .submatrix_mut(o, o, nt, nt)
                .copy_from(&self.diag[k]);
        }
        for (k, s) in self.sub.iter().enumerate() {
            let (r, c) = (self.order[k + 1] * nt, self.order[k] * nt);
            icov.as_mut().submatrix_mut(r, c, nt, nt).copy_from(s);
            icov.as_mut()
                .submatrix_mut(c, r, nt, nt)
                .copy_from(s.transpose());
        }
        for &(i, j, v) in &self.far {
            icov[(i, j)] = v;
            icov[(j, i)] = v;
        }
        icov
    }

    /// The largest coupling beyond neighbouring fibers relative to the diagonal,
    /// `max |a_ij| / sqrt(a_ii a_jj)`, with the diagonal as regularised by `prior`.
    pub fn far_coupling(&self, prior: &[f64]) -> f64 {
        let nt = self.nt;
        let mut pos = vec![0; self.order.len()];
        for (k, &b) in self.order.iter().enumerate() {
            pos[b] = k;
        }
        let diag = |j: usize| self.diag[pos[j / nt]][(j % nt, j % nt)] + prior[j];
        self.far
            .iter()
            .map(|&(i, j, v)| v.abs() / (diag(i) * diag(j)).sqrt())
            .fold(0.0, f64::max)
    }
}

/// The diagonal prior of step 2 (`alpha^2 + 1e-15` per unknown, `alpha = minweight -
/// fluxweight` where `fluxweight < minweight = 1e-4 max(fluxweight)`, else `regularize`);
/// `None` when no pixel constrains the patch.
pub fn prior(fluxweight: &[f64], regularize: f64) -> Option<Vec<f64>> {
    let maxw = fluxweight.iter().cloned().fold(0.0, f64::max);
    if !(maxw > 0.0) {
        return None;
    }
    let minweight = 1e-4 * maxw;
    Some(
        fluxweight
            .iter()
            .map(|&fw| {
                let alpha = if fw < minweight {
                    minweight - fw
                } else {
                    regularize
                };
                alpha * alpha + 1e-15
            })
            .collect(),
    )
}

impl<'a> PatchSystem<'a> {
    #[inline(always)]
    pub fn new(geom: PatchGeometry, spots: &'a Spots, image: &Image) -> Self {
        let (ny, nx) = (spots.corners.ny, spots.corners.nx);
        let m = geom.nunknowns();
        let mut corner = Vec::with_capacity(m);
        for &f in &geom.block_fibers {
            for w in 0..geom.nwavetot {
                let (xc, yc) = spots.corners.corner(f, geom.wave0 + w);
                corner.push((xc as i64, yc as i64));
            }
        }
        let window = s![geom.rows.clone(), geom.cols.clone()];
        // A sliced view iterates in logical (row-major) order: the patch's pixels, row by row.
        let pix = image.pix.slice(window).iter().map(|&v| v as f64).collect();
        let ivar = image.ivar.slice(window).iter().map(|&v| v as f64).collect();
        PatchSystem {
            geom,
            ny,
            nx,
            spots,
            corner,
            pix,
            ivar,
        }
    }

    pub fn m(&self) -> usize {
        self.corner.len()
    }

    /// The spot of column `j`, `ny * nx`; only its part inside the box belongs to the patch.
    pub fn column(&self, j: usize) -> &'a [f64] {
        let nt = self.geom.nwavetot;
        let f = self.geom.block_fibers[j / nt];
        self.spots.spot(f, self.geom.wave0 + j % nt)
    }

    /// Whether column `j`'s whole spot lies inside the box.
    #[inline(always)]
    fn inside(&self, j: usize) -> bool {
        let (xc, yc) = self.corner[j];
        let (rows, cols) = (&self.geom.rows, &self.geom.cols);
        rows.start as i64 <= yc
            && yc + self.ny as i64 <= rows.end as i64
            && cols.start as i64 <= xc
            && xc + self.nx as i64 <= cols.end as i64
    }

    /// Calls `f(spot offset, box offset, length)` for every row of column `j`'s spot inside
    /// the box: the pixels `spot[s..s + len]` lie at `box[p..p + len]`.
    #[inline(always)]
    pub fn for_rows(&self, j: usize, mut f: impl FnMut(usize, usize, usize)) {
        let (xc, yc) = self.corner[j];
        let (r0, c0) = (self.geom.rows.start as i64, self.geom.cols.start as i64);
        let w = self.geom.cols.len() as i64;
        let ylo = (r0 - yc).max(0);
        let yhi = (self.geom.rows.end as i64 - yc).min(self.ny as i64);
        let xlo = (c0 - xc).max(0);
        let xhi = (self.geom.cols.end as i64 - xc).min(self.nx as i64);
        if xhi <= xlo {
            return;
        }
        let len = (xhi - xlo) as usize;
        for iy in ylo..yhi {
            let s = (iy * self.nx as i64 + xlo) as usize;
            let p = ((yc + iy - r0) * w + xc + xlo - c0) as usize;
            f(s, p, len);
        }
    }

    /// `icov = A^T W A` by fiber block, `y = A^T W p`, `fluxweight = A^T W 1`.
    #[inline(always)]
    pub fn normal_equations(&self) -> NormalEquations {
        self.assemble(false)
    }

    /// [`Self::normal_equations`] with upper bounds of the couplings beyond neighbouring
    /// fibers in place of their values (`far_bounded`), the same bits otherwise. Those
    /// couplings come from the overlap of the spots' outermost columns; summing them exactly
    /// took about a tenth of a patch solve, for values the sweeps drop. The bound of a pair
    /// is `2 sum_c colsum|W a_1|(c) colmax|a_2|(c - dx)` over the columns the two spots share
    /// (twice the bound of the exact sum, for its rounding).
    #[inline(always)]
    pub fn normal_equations_bounded(&self) -> NormalEquations {
        self.assemble(true)
    }

    #[inline(always)]
    fn assemble(&self, bound_far: bool) -> NormalEquations {
        let size = self.m() * self.ny * self.nx;
        WEIGHTED.with_borrow_mut(|ws| {
            if ws.len() < size {
                ws.resize(size, 0.0);
            }
            self.assemble_from(bound_far, ws)
        })
    }

    /// [`Self::assemble`] with a buffer of at least `m ny nx` values for the weighted columns.
    #[inline(always)]
    fn assemble_from(&self, bound_far: bool, ws: &mut [f64]) -> NormalEquations {
        let m = self.m();
        let nt = self.geom.nwavetot;
        let nb = self.geom.block_fibers.len();
        let size = self.ny * self.nx;
        let (ny, nx) = (self.ny as i64, self.nx as i64);
        let mut order: Vec<usize> = (0..nb).collect();
        order.sort_by_key(|&b| self.geom.block_fibers[b]);
        let mut pos = vec![0; nb];
        for (k, &b) in order.iter().enumerate() {
            pos[b] = k;
        }

        // weighted columns ws = W a, over the spot's own frame, zero outside the box
        let mut y = vec![0.0; m];
        let mut fluxweight = vec![0.0; m];
        // per column and spot column: sum of |W a| and largest |a| over the rows in the box
        let (mut colsum, mut colmax) = if bound_far {
            (vec![0.0; m * self.nx], vec![0.0; m * self.nx])
        } else {
            (Vec::new(), Vec::new())
        };
        for j in 0..m {
            let col = self.column(j);
            let out = &mut ws[j * size..(j + 1) * size];
            if !self.inside(j) {
                out.fill(0.0);
            }
            let (mut sy, mut sw) = (0.0, 0.0);
            self.for_rows(j, |s, p, len| {
                let out = &mut out[s..s + len];
                let ivar = &self.ivar[p..p + len];
                for ((o, &a), &iv) in out.iter_mut().zip(&col[s..s + len]).zip(ivar) {
                    *o = a * iv;
                }
                sy += dot(out, &self.pix[p..p + len]);
                sw += out.iter().sum::<f64>();
                if bound_far {
                    let c0 = j * self.nx + s % self.nx;
                    let sums = &mut colsum[c0..c0 + len];
                    for (t, &o) in sums.iter_mut().zip(out.iter()) {
                        *t += o.abs();
                    }
                    let maxs = &mut colmax[c0..c0 + len];
                    for (t, &a) in maxs.iter_mut().zip(&col[s..s + len]) {
                        *t = f64::max(*t, a.abs());
                    }
                }
            });
            y[j] = sy;
            fluxweight[j] = sw;
        }

        let mut ne = NormalEquations {
            nt,
            order,
            diag: vec![Mat::zeros(nt, nt); nb],
            sub: vec![Mat::zeros(nt, nt); nb.saturating_sub(1)],
            far: Vec::new(),
            far_bounded: bound_far,
            y,
            fluxweight,
        };
        // The rows of a fiber's spots grow with the bin: the bins of block b2 that can overlap
        // a spot at row y1 form one window, found by bisection.
        let ycs: Vec<Vec<i64>> = (0..nb)
            .map(|b| (0..nt).map(|w| self.corner[b * nt + w].1).collect())
            .collect();
        let sorted: Vec<bool> = ycs
            .iter()
            .map(|v| v.windows(2).all(|p| p[0] <= p[1]))
            .collect();
        for j1 in 0..m {
            let (b1, w1) = (j1 / nt, j1 % nt);
            let (x1, y1) = self.corner[j1];
            let ws1 = &ws[j1 * size..(j1 + 1) * size];
            for b2 in b1..nb {
                let (lo, hi) = if sorted[b2] {
                    (
                        ycs[b2].partition_point(|&v| v <= y1 - ny),
                        ycs[b2].partition_point(|&v| v < y1 + ny),
                    )
                } else {
                    (0, nt)
                };
                let lo = if b2 == b1 { lo.max(w1) } else { lo };
                for w2 in lo..hi.max(lo) {
                    let j2 = b2 * nt + w2;
                    let (x2, y2) = self.corner[j2];
                    let (dx, dy) = (x2 - x1, y2 - y1);
                    if dx.abs() >= nx || dy.abs() >= ny {
                        continue;
                    }
                    let (k1, k2) = (pos[b1], pos[b2]);
                    if bound_far && k1.abs_diff(k2) > 1 {
                        let (c1, c2) = (j1 * self.nx, j2 * self.nx);
                        let v = far_bound(&colsum[c1..c1 + self.nx], &colmax[c2..c2 + self.nx], dx);
                        if v != 0.0 {
                            ne.far.push((j1, j2, v));
                        }
                        continue;
                    }
                    let v = overlap(ws1, self.column(j2), nx, ny, dx, dy);
                    if k1 == k2 {
                        ne.diag[k1][(w1, w2)] = v;
                        ne.diag[k1][(w2, w1)] = v;
                    } else if k2 == k1 + 1 {
                        ne.sub[k1][(w2, w1)] = v;
                    } else if k1 == k2 + 1 {
                        ne.sub[k2][(w1, w2)] = v;
                    } else if v != 0.0 {
                        ne.far.push((j1, j2, v));
                    }
                }
            }
        }
        ne
    }

    /// `A x` over the box.
    #[inline(always)]
    pub fn project(&self, x: &[f64], columns: impl Iterator<Item = usize>) -> Vec<f64> {
        let mut model = vec![0.0; self.pix.len()];
        for j in columns {
            if x[j] == 0.0 {
                continue;
            }
            let col = self.column(j);
            self.for_rows(j, |s, p, len| {
                for (m, &a) in model[p..p + len].iter_mut().zip(&col[s..s + len]) {
                    *m += a * x[j];
                }
            });
        }
        model
    }
}

/// An upper bound of `|overlap(w1, a2, dx, dy)|` from the column sums of `|w1|` and the
/// column maxima of `|a2|` (see [`PatchSystem::normal_equations_bounded`]).
#[inline(always)]
fn far_bound(colsum1: &[f64], colmax2: &[f64], dx: i64) -> f64 {
    let nx = colsum1.len() as i64;
    let (lo, hi) = (dx.max(0), (nx + dx).min(nx));
    let sum: f64 = (lo..hi)
        .map(|c| colsum1[c as usize] * colmax2[(c - dx) as usize])
        .sum();
    2.0 * sum
}

/// `sum w1[s] a2[s - (dy nx + dx)]` over the overlap of two spots, the second one `(dx, dy)`
/// pixels from the first; both are `ny x nx`, row-major.
#[inline(always)]
fn overlap(w1: &[f64], a2: &[f64], nx: i64, ny: i64, dx: i64, dy: i64) -> f64 {
    let (ylo, yhi) = (dy.max(0), (ny + dy).min(ny));
    if dx == 0 {
        // whole rows on both sides: one contiguous run
        let (o1, o2) = ((ylo * nx) as usize, ((ylo - dy) * nx) as usize);
        let len = ((yhi - ylo) * nx) as usize;
        return dot(&w1[o1..o1 + len], &a2[o2..o2 + len]);
    }
    // rows shorter than the spot's: every row adds into the same partial sums, which are
    // added up once (a neighbouring fiber's spot overlaps a few columns of eight rows or so)
    let (xlo, xhi) = (dx.max(0), (nx + dx).min(nx));
    let len = (xhi - xlo) as usize;
    let mut acc = [0.0f64; 8];
    for iy in ylo..yhi {
        let o1 = (iy * nx + xlo) as usize;
        let o2 = ((iy - dy) * nx + xlo - dx) as usize;
        accumulate(&mut acc, &w1[o1..o1 + len], &a2[o2..o2 + len]);
    }
    total(acc)
}

/// A dot product in a fixed order (eight interleaved partial sums, products rounded before
/// they are added), so that it vectorises and gives the same bits on every machine.
#[inline(always)]
pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 8];
    accumulate(&mut acc, a, b);
    total(acc)
}

/// The products of `a` and `b` added into the partial sums of [`dot`].
#[inline(always)]
fn accumulate(acc: &mut [f64; 8], a: &[f64], b: &[f64]) {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in ar.iter().zip(br).enumerate() {
        acc[i] += x * y;
    }
}

/// The partial sums of [`dot`] added in a fixed order.
#[inline(always)]
pub(super) fn total(acc: [f64; 8]) -> f64 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}
