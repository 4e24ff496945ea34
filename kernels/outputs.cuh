// The outputs of step 4 from the inverse square root Q = C^(-1/2) of a core fiber block,
// shared by the decorrelation kernels (polar.cu, decorrelate.cu): R = Q / rowsum,
// ivar = rowsum^2, flux = R xflux and the resolution diagonals, exactly as
// `backend::cpu::solve_patch`.

#pragma once

// Q: n x n in shared memory with leading dimension `ld`; `rowsum`: n doubles of shared memory.
// `blk` = patch * ncore + core fiber. Threads `tid` of `nthreads` share the work; the caller's
// block is synchronised on entry and on exit.
__device__ void write_decorrelated(const double* Q, int ld, int n, double* rowsum, int blk,
                                   int tid, int nthreads, const double* __restrict__ xflux,
                                   const int* __restrict__ nkeep, int m, int ncore, int wavepad,
                                   int nwavestep, int ndiag, double* __restrict__ flux,
                                   double* __restrict__ ivar, double* __restrict__ resolution,
                                   double* __restrict__ fluxcol) {
    for (int i = tid; i < n; i += nthreads) {
        double s = 0.0;
        for (int k = 0; k < n; ++k) s += Q[i * ld + k];
        rowsum[i] = s;
    }
    __syncthreads();
    int p = blk / ncore, c = blk % ncore;
    int nblk = m / n;
    int b = nblk - ncore + c;
    const double* xb = xflux + (size_t)p * m + (size_t)b * n;
    // Every core bin goes into the model, also those past the last output bin (`nkeep`
    // bounds only what the host keeps), as in gpu_specter's model image.
    (void)nkeep;
    int nd = 2 * ndiag + 1;
    size_t o = ((size_t)p * ncore + c) * nwavestep;
    for (int j = tid; j < nwavestep; j += nthreads) {
        int row = wavepad + j;
        double norm = rowsum[row];
        double f = 0.0;
        for (int k = 0; k < n; ++k) f += Q[row * ld + k] * xb[k];
        f /= norm;
        flux[o + j] = f;
        ivar[o + j] = norm * norm;
        fluxcol[(size_t)p * m + (size_t)b * n + row] = f;
        for (int k = 0; k < nd; ++k) {
            int rr = row + k - ndiag;
            double v = 0.0;
            if (rr >= 0 && rr < n) v = Q[rr * ld + row] / rowsum[rr];
            resolution[(((size_t)p * ncore + c) * nd + k) * nwavestep + j] = v;
        }
    }
    __syncthreads();
}
