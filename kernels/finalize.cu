// Steps 6-8 of the solve: the model A x of each patch on its pixel box, chi2pix of the core
// bins against the model of the deconvolved flux, and the optional model image of the core.

#include "common.cuh"

// One block per (column, patch): adds column j of A times x[j] into the patch's box image
// `model[boxoff[p] + (row - row0) * width + col - col0]`. Columns with x[j] == 0 are skipped.
// Where `core` is given (outlier rejection's first solve), the columns the outlier test looks
// at (`tested_column`) also flag the box pixels where their spot is positive: a kernel of its
// own, walking the same spots, took 0.47 ms of a full-width frame.
extern "C" __global__ void project_f64(const double* __restrict__ spots,
                                       const int* __restrict__ corners,
                                       const int* __restrict__ colspot,
                                       const int* __restrict__ boxes,
                                       const long long* __restrict__ boxoff,
                                       const double* __restrict__ x, int m, int nx, int ny,
                                       double* __restrict__ model,
                                       unsigned char* __restrict__ core, int nwavetot,
                                       int ncore, int wavepad) {
    int j = blockIdx.x, p = blockIdx.y;
    int sid = colspot[(size_t)p * m + j];
    double xj = x[(size_t)p * m + j];
    bool flag = core && tested_column(j, m, nwavetot, ncore, wavepad);
    if (sid < 0 || (xj == 0.0 && !flag)) return;
    int r0 = boxes[4 * p], r1 = boxes[4 * p + 1], c0 = boxes[4 * p + 2], c1 = boxes[4 * p + 3];
    int w = c1 - c0;
    int xc = corners[2 * sid], yc = corners[2 * sid + 1];
    const double* a = spots + (size_t)sid * nx * ny;
    double* out = model + boxoff[p];
    StridedWalk px(threadIdx.x, blockDim.x, nx);
    for (int s = threadIdx.x; s < nx * ny; s += blockDim.x, px.next()) {
        int rr = yc + px.row, cc = xc + px.col;
        if (rr >= r0 && rr < r1 && cc >= c0 && cc < c1) {
            size_t q = (size_t)(rr - r0) * w + (cc - c0);
            if (xj != 0.0) atomicAdd(out + q, a[s] * xj);
            if (flag && a[s] > 0.0) core[boxoff[p] + q] = 1;
        }
    }
}

// Core bins whose chi2pix one block of chi2pix_f64 computes, a warp each.
#define SPEX_CHI2_BINS 8

// One warp per (core bin, patch), SPEX_CHI2_BINS bins to a block: chi2pix = sum A (p -
// model)^2 w / sum A [w > 0] over the spot's pixels in the box, w = 1 / ((psferr model +
// 1e-32)^2 + 1/ivar) where ivar > 0, a pixel flagged in `rejected` (null unless outliers are
// rejected) counting as ivar 0, as in the assembly. (A block of 64 threads per bin took
// 2.27 ms a full frame on an H100 against 2.02.) A patch whose outlier test found any
// (`outliers[p] > 0`; null: no test ran) gets zeros: it is solved again, and its chi2pix
// comes from its last solve.
extern "C" __global__ void chi2pix_f64(const double* __restrict__ spots,
                                       const int* __restrict__ corners,
                                       const int* __restrict__ colspot,
                                       const int* __restrict__ boxes,
                                       const long long* __restrict__ boxoff,
                                       const double* __restrict__ model,
                                       const float* __restrict__ pix,
                                       const float* __restrict__ ivar,
                                       const unsigned char* __restrict__ rejected,
                                       int sub_row0,
                                       int sub_col0, int sub_w, const int* __restrict__ nkeep,
                                       int m, int nx, int ny, int nwavetot, int ncore,
                                       int wavepad, int nwavestep, double psferr,
                                       const int* __restrict__ outliers,
                                       double* __restrict__ chi2) {
    int lane = threadIdx.x % SPEX_WARP;
    int cj = blockIdx.x * SPEX_CHI2_BINS + threadIdx.x / SPEX_WARP, p = blockIdx.y;
    if (cj >= ncore * nwavestep) return;
    int c = cj / nwavestep, j = cj % nwavestep;
    size_t o = ((size_t)p * ncore + c) * nwavestep + j;
    if (j >= nkeep[p] || (outliers && outliers[p] > 0)) {
        if (lane == 0) chi2[o] = 0.0;
        return;
    }
    int nblk = m / nwavetot;
    int col = (nblk - ncore + c) * nwavetot + wavepad + j;
    int sid = colspot[(size_t)p * m + col];
    int r0 = boxes[4 * p], r1 = boxes[4 * p + 1], c0 = boxes[4 * p + 2], c1 = boxes[4 * p + 3];
    int w = c1 - c0;
    int xc = corners[2 * sid], yc = corners[2 * sid + 1];
    const double* a = spots + (size_t)sid * nx * ny;
    const double* mod = model + boxoff[p];
    double num = 0.0, den = 0.0;
    for (StridedWalk px(lane, SPEX_WARP, nx); px.row < ny; px.next()) {
        int s = px.row * nx + px.col, rr = yc + px.row, cc = xc + px.col;
        if (rr >= r0 && rr < r1 && cc >= c0 && cc < c1) {
            size_t k = (size_t)(rr - sub_row0) * sub_w + (cc - sub_col0);
            double iv = rejected_pixel(rejected, boxoff, p, rr - r0, cc - c0, w)
                            ? 0.0
                            : (double)ivar[k];
            if (iv > 0.0) {
                double mv = mod[(size_t)(rr - r0) * w + (cc - c0)];
                double e = psferr * mv + 1e-32;
                double wt = 1.0 / (e * e + 1.0 / iv);
                double dd = (double)pix[k] - mv;
                num += a[s] * dd * dd * wt;
                if (wt > 0.0) den += a[s];
            }
        }
    }
    num = warp_sum(num);
    den = warp_sum(den);
    if (lane == 0) chi2[o] = den > 0.0 ? num / den : 0.0;
}
