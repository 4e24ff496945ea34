// Step 4 of the solve for one core fiber block per thread block: the symmetric inverse square
// root Q = C^(-1/2) of its covariance block C (nwavetot x nwavetot) by a cyclic Jacobi
// eigensolver in shared memory, then R = Q / rowsum, ivar = rowsum^2, flux = R xflux and the
// resolution diagonals, exactly as `backend::cpu::solve_patch`.
//
// Jacobi, parallel ordering: each round applies n/2 disjoint rotations (a round-robin
// tournament of the indices), A <- J^T A J and V <- V J. A rotation touches only the rows and
// columns of its pair, so the update of A splits into independent 2x2 blocks (one per pair of
// pairs) and needs no second buffer. Jacobi is accurate to the rounding of each eigenvalue
// relative to the norm and converges quadratically; sweeps stop when no rotation was needed.

#include "common.cuh"

#define SPEX_JACOBI_MAX_SWEEPS 20

// `qout`, when not null, receives Q itself (for the residual checks of the tests).
//
// Shared memory (dynamic): A[n n], V[n n], cs[2 npair], pq[2 npair] (as ints in doubles'
// room), d[n], rowsum[n], red[32], flags.
extern "C" __global__ void decorrelate_f64(
    const double* __restrict__ cblocks, const double* __restrict__ xflux,
    const int* __restrict__ nkeep, int n, int m, int ncore, int wavepad, int nwavestep, int ndiag,
    double eigen_clip, double* __restrict__ flux, double* __restrict__ ivar,
    double* __restrict__ resolution, double* __restrict__ fluxcol, int* __restrict__ sweeps_out,
    double* __restrict__ qout) {
    extern __shared__ double sm[];
    int n2 = n + (n & 1);
    int npair = n2 / 2;
    double* A = sm;
    double* V = A + n * n;
    double* rc = V + n * n;        // cos
    double* rs = rc + npair;       // sin
    double* d = rs + npair;        // eigenvalues, then their inverse square roots
    double* rowsum = d + n;
    double* red = rowsum + n;
    int* rp = (int*)(red + 32);
    int* rq = rp + npair;
    int* flag = rq + npair;

    int blk = blockIdx.x;  // patch * ncore + core fiber
    int p = blk / ncore, c = blk % ncore;
    const double* C = cblocks + (size_t)blk * n * n;
    for (int i = threadIdx.x; i < n * n; i += blockDim.x) {
        A[i] = C[i];
        V[i] = (i / n == i % n) ? 1.0 : 0.0;
    }
    __syncthreads();

    int sweep = 0;
    for (; sweep < SPEX_JACOBI_MAX_SWEEPS; ++sweep) {
        if (threadIdx.x == 0) *flag = 0;
        __syncthreads();
        for (int r = 0; r < n2 - 1; ++r) {
            // the pairs of this round and their rotations
            for (int k = threadIdx.x; k < npair; k += blockDim.x) {
                int a, b;
                if (k == 0) {
                    a = r;
                    b = n2 - 1;
                } else {
                    a = (r + k) % (n2 - 1);
                    b = (r - k + n2 - 1) % (n2 - 1);
                }
                int pp = min(a, b), qq = max(a, b);
                double cc = 1.0, ss = 0.0;
                if (qq < n) {
                    double apq = A[pp * n + qq];
                    double app = A[pp * n + pp], aqq = A[qq * n + qq];
                    if (fabs(apq) > 1e-300 && fabs(apq) > 1e-16 * sqrt(fabs(app * aqq))) {
                        double theta = (aqq - app) / (2.0 * apq);
                        double t = 1.0 / (fabs(theta) + sqrt(theta * theta + 1.0));
                        if (theta < 0.0) t = -t;
                        cc = 1.0 / sqrt(t * t + 1.0);
                        ss = t * cc;
                        *flag = 1;
                    }
                }
                rp[k] = pp;
                rq[k] = qq;
                rc[k] = cc;
                rs[k] = ss;
            }
            __syncthreads();
            // A <- J^T A J in independent 2x2 blocks (pair kr of rows, pair kc of columns)
            for (int idx = threadIdx.x; idx < npair * npair; idx += blockDim.x) {
                int kr = idx / npair, kc = idx % npair;
                int pr = rp[kr], qr = rq[kr], pc = rp[kc], qc = rq[kc];
                double cr = rc[kr], sr = rs[kr], ccl = rc[kc], scl = rs[kc];
                if (sr == 0.0 && scl == 0.0) continue;
                bool vq_r = qr < n, vq_c = qc < n;
                double app = A[pr * n + pc];
                double apq = vq_c ? A[pr * n + qc] : 0.0;
                double aqp = vq_r ? A[qr * n + pc] : 0.0;
                double aqq = (vq_r && vq_c) ? A[qr * n + qc] : 0.0;
                // rows
                double tpp = cr * app - sr * aqp, tpq = cr * apq - sr * aqq;
                double tqp = sr * app + cr * aqp, tqq = sr * apq + cr * aqq;
                // columns
                double npp = ccl * tpp - scl * tpq, npq = scl * tpp + ccl * tpq;
                double nqp = ccl * tqp - scl * tqq, nqq = scl * tqp + ccl * tqq;
                if (kr == kc) {
                    npq = 0.0;
                    nqp = 0.0;
                }
                A[pr * n + pc] = npp;
                if (vq_c) A[pr * n + qc] = npq;
                if (vq_r) A[qr * n + pc] = nqp;
                if (vq_r && vq_c) A[qr * n + qc] = nqq;
            }
            // V <- V J
            for (int idx = threadIdx.x; idx < n * npair; idx += blockDim.x) {
                int i = idx / npair, k = idx % npair;
                double s = rs[k];
                if (s == 0.0) continue;
                int pp = rp[k], qq = rq[k];
                double cc = rc[k];
                double vp = V[i * n + pp], vq = V[i * n + qq];
                V[i * n + pp] = cc * vp - s * vq;
                V[i * n + qq] = s * vp + cc * vq;
            }
            __syncthreads();
        }
        if (*flag == 0) break;
        __syncthreads();
    }

    // eigenvalues clipped at eigen_clip of the largest, then their inverse square roots
    double mx = -1e308;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmax(mx, A[i * n + i]);
    mx = block_max(mx, red);
    double floor_v = mx * eigen_clip;
    for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = 1.0 / sqrt(fmax(A[i * n + i], floor_v));
    __syncthreads();
    // Q = V diag(d) V^T into A
    for (int idx = threadIdx.x; idx < n * n; idx += blockDim.x) {
        int i = idx / n, k = idx % n;
        double s = 0.0;
        for (int l = 0; l < n; ++l) s += V[i * n + l] * d[l] * V[k * n + l];
        A[idx] = s;
    }
    __syncthreads();
    if (qout) {
        for (int idx = threadIdx.x; idx < n * n; idx += blockDim.x) qout[(size_t)blk * n * n + idx] = A[idx];
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        double s = 0.0;
        for (int k = 0; k < n; ++k) s += A[i * n + k];
        rowsum[i] = s;
    }
    __syncthreads();

    int nblk = m / n;
    int b = nblk - ncore + c;
    const double* xb = xflux + (size_t)p * m + (size_t)b * n;
    int nk = nkeep[p];
    int nd = 2 * ndiag + 1;
    size_t o = ((size_t)p * ncore + c) * nwavestep;
    for (int j = threadIdx.x; j < nwavestep; j += blockDim.x) {
        int row = wavepad + j;
        double norm = rowsum[row];
        double f = 0.0;
        for (int k = 0; k < n; ++k) f += A[row * n + k] * xb[k];
        f /= norm;
        flux[o + j] = f;
        ivar[o + j] = norm * norm;
        fluxcol[(size_t)p * m + (size_t)b * n + row] = j < nk ? f : 0.0;
        for (int k = 0; k < nd; ++k) {
            int rr = row + k - ndiag;
            double v = 0.0;
            if (rr >= 0 && rr < n) v = A[rr * n + row] / rowsum[rr];
            resolution[(((size_t)p * ncore + c) * nd + k) * nwavestep + j] = v;
        }
    }
    if (threadIdx.x == 0 && sweeps_out) sweeps_out[blk] = sweep;
}
