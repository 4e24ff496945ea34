// Step 4 of the solve for one core fiber block per thread block, by eigendecomposition: the
// symmetric inverse square root Q = C^(-1/2) of its covariance block C (nwavetot x nwavetot),
// or the square root Q = S^(1/2) of S = C^-1 (`from_cov` = 0), by a cyclic Jacobi eigensolver
// in shared memory, its eigenvalues clipped as the CPU
// reference clips them, then the outputs of outputs.cuh. The polar route (polar.cu) is the
// main one; this kernel takes the blocks it gives up on (a covariance block that is not
// numerically positive definite, or an iteration that does not converge).
//
// Jacobi, parallel ordering: each round applies n/2 disjoint rotations (a round-robin
// tournament of the indices), A <- J^T A J and V <- V J. A rotation touches only the rows and
// columns of its pair, so the update of A splits into independent 2x2 blocks (one per pair of
// pairs) and needs no second buffer. Jacobi is accurate to the rounding of each eigenvalue
// relative to the norm and converges quadratically; sweeps stop when no rotation was needed.

#include "common.cuh"
#include "outputs.cuh"

#define SPEX_JACOBI_MAX_SWEEPS 20

// Rotations are skipped where |a_pq| <= tol sqrt(a_pp a_qq): that leaves a relative
// perturbation of C near tol.
//
// `qout`, when not null, receives Q itself (for the residual checks of the tests).
// `only_failed`, when not null, limits the work to the blocks whose entry is negative (the
// polar kernel's verdict); the others return at once.
//
// Shared memory (dynamic): A[n n], V[n n], cos and sin [npair each], d[n], rowsum[n],
// red[32], then ints: pairs [2 npair], flag [2], triangle table [npair (npair + 1)] shorts.
extern "C" __global__ void decorrelate_f64(
    const double* __restrict__ cblocks, const double* __restrict__ xflux,
    const int* __restrict__ nkeep, int from_cov, int n, int m, int ncore, int wavepad,
    int nwavestep, int ndiag, double eigen_clip, double tol, double* __restrict__ flux, double* __restrict__ ivar,
    double* __restrict__ resolution, double* __restrict__ fluxcol, int* __restrict__ sweeps_out,
    double* __restrict__ qout, const int* __restrict__ only_failed,
    const int* __restrict__ skip) {
    extern __shared__ double sm[];
    if (only_failed && only_failed[blockIdx.x] >= 0) return;
    // `skip` (when given): nonzero for a patch left out, solved again for its outliers
    if (skip && skip[blockIdx.x / ncore]) return;
    // Threads form a (npair, ny) grid: x picks a pair (a column pair of A, a column pair of
    // V), y strides over rows; no integer division in the inner loops.
    int n2 = n + (n & 1);
    int npair = n2 / 2;
    int ntri = npair * (npair + 1) / 2;
    int tid = threadIdx.y * blockDim.x + threadIdx.x;
    int nthreads = blockDim.x * blockDim.y;
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
    unsigned short* tri = (unsigned short*)(flag + 2);  // (kr, kc), kr <= kc

    int blk = blockIdx.x;  // patch * ncore + core fiber
    const double* C = cblocks + (size_t)blk * n * n;
    for (int i = tid; i < n * n; i += nthreads) {
        A[i] = C[i];
        V[i] = (i / n == i % n) ? 1.0 : 0.0;
    }
    if (tid == 0) {
        int t = 0;
        for (int kr = 0; kr < npair; ++kr)
            for (int kc = kr; kc < npair; ++kc) {
                tri[2 * t] = (unsigned short)kr;
                tri[2 * t + 1] = (unsigned short)kc;
                ++t;
            }
    }
    __syncthreads();

    int sweep = 0;
    for (; sweep < SPEX_JACOBI_MAX_SWEEPS; ++sweep) {
        if (tid == 0) *flag = 0;
        __syncthreads();
        for (int r = 0; r < n2 - 1; ++r) {
            // the pairs of this round (a round-robin tournament) and their rotations
            if (tid < npair) {
                int k = tid, a, b;
                if (k == 0) {
                    a = r;
                    b = n2 - 1;
                } else {
                    a = r + k;
                    if (a >= n2 - 1) a -= n2 - 1;
                    b = r - k;
                    if (b < 0) b += n2 - 1;
                }
                int pp = min(a, b), qq = max(a, b);
                double cc = 1.0, ss = 0.0;
                if (qq < n) {
                    double apq = A[pp * n + qq];
                    double app = A[pp * n + pp], aqq = A[qq * n + qq];
                    if (fabs(apq) > tol * sqrt(fabs(app * aqq)) && fabs(apq) > 1e-300) {
                        double theta = (aqq - app) / (2.0 * apq);
                        double t = 1.0 / (fabs(theta) + sqrt(theta * theta + 1.0));
                        if (theta < 0.0) t = -t;
                        cc = rsqrt(t * t + 1.0);
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
            // A <- J^T A J on the upper triangle of 2x2 blocks, mirrored into the lower one
            for (int t = tid; t < ntri; t += nthreads) {
                int kr = tri[2 * t], kc = tri[2 * t + 1];
                double sr = rs[kr], scl = rs[kc];
                if (sr == 0.0 && scl == 0.0) continue;
                int pr = rp[kr], qr = rq[kr], pc = rp[kc], qc = rq[kc];
                double cr = rc[kr], ccl = rc[kc];
                bool vq_r = qr < n, vq_c = qc < n;
                double app = A[pr * n + pc];
                double apq = vq_c ? A[pr * n + qc] : 0.0;
                double aqp = vq_r ? A[qr * n + pc] : 0.0;
                double aqq = (vq_r && vq_c) ? A[qr * n + qc] : 0.0;
                double tpp = cr * app - sr * aqp, tpq = cr * apq - sr * aqq;
                double tqp = sr * app + cr * aqp, tqq = sr * apq + cr * aqq;
                double npp = ccl * tpp - scl * tpq, npq = scl * tpp + ccl * tpq;
                double nqp = ccl * tqp - scl * tqq, nqq = scl * tqp + ccl * tqq;
                if (kr == kc) {
                    A[pr * n + pr] = npp;
                    if (vq_r) {
                        A[qr * n + qr] = nqq;
                        A[pr * n + qr] = 0.0;
                        A[qr * n + pr] = 0.0;
                    }
                } else {
                    A[pr * n + pc] = npp;
                    A[pc * n + pr] = npp;
                    if (vq_c) {
                        A[pr * n + qc] = npq;
                        A[qc * n + pr] = npq;
                    }
                    if (vq_r) {
                        A[qr * n + pc] = nqp;
                        A[pc * n + qr] = nqp;
                    }
                    if (vq_r && vq_c) {
                        A[qr * n + qc] = nqq;
                        A[qc * n + qr] = nqq;
                    }
                }
            }
            // V <- V J
            if (threadIdx.x < npair) {
                int k = threadIdx.x;
                double s = rs[k];
                if (s != 0.0) {
                    int pp = rp[k], qq = rq[k];
                    double cc = rc[k];
                    for (int i = threadIdx.y; i < n; i += blockDim.y) {
                        double vp = V[i * n + pp], vq = V[i * n + qq];
                        V[i * n + pp] = cc * vp - s * vq;
                        V[i * n + qq] = s * vp + cc * vq;
                    }
                }
            }
            __syncthreads();
        }
        if (*flag == 0) break;
        __syncthreads();
    }

    // Eigenvalues clipped at eigen_clip of the largest, then their inverse square roots (a
    // serial extremum: the block need not be a whole number of warps). For S = C^-1 the same
    // clip of C's eigenvalues 1/lambda bounds lambda from above by lambda_min / eigen_clip
    // (lambda_min the smallest positive one), which also replaces the others.
    if (tid == 0) {
        double mx = A[0], mn = 1e308;
        for (int i = 0; i < n; ++i) {
            double v = A[i * n + i];
            mx = fmax(mx, v);
            if (v > 0.0) mn = fmin(mn, v);
        }
        red[0] = from_cov ? mx * eigen_clip : mn / eigen_clip;
    }
    __syncthreads();
    double bound = red[0];
    for (int i = tid; i < n; i += nthreads) {
        double v = A[i * n + i];
        d[i] = from_cov ? 1.0 / sqrt(fmax(v, bound)) : sqrt(v > 0.0 && v < bound ? v : bound);
    }
    __syncthreads();
    // Q = V diag(d) V^T into A
    for (int idx = tid; idx < n * n; idx += nthreads) {
        int i = idx / n, k = idx % n;
        double s = 0.0;
        for (int l = 0; l < n; ++l) s += V[i * n + l] * d[l] * V[k * n + l];
        A[idx] = s;
    }
    __syncthreads();
    if (qout) {
        for (int idx = tid; idx < n * n; idx += nthreads) qout[(size_t)blk * n * n + idx] = A[idx];
    }
    write_decorrelated(A, n, n, rowsum, blk, tid, nthreads, xflux, nkeep, m, ncore, wavepad,
                       nwavestep, ndiag, flux, ivar, resolution, fluxcol);
    if (tid == 0 && sweeps_out) sweeps_out[blk] = sweep;
}
