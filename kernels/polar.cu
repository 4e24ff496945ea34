// Step 4 of the solve by the polar route, one core fiber block per thread block: the inverse
// square root Q = C^(-1/2) of a covariance block as the symmetric polar factor of a triangular
// factor, by a scaled Newton-Schulz iteration on FP64 tensor cores, then the outputs of
// outputs.cuh.
//
// With S = C^-1 and any A such that A^T A = S, the polar decomposition A = U H has
// H = (A^T A)^(1/2) = S^(1/2) = Q, so Q = U^T A. Two starting points:
// - from C (`from_cov`): C = L L^T, A = L^-1 (then A^-1 = L);
// - from S (a Schur complement): S = G G^T, A = G^T.
// cond(A) = sqrt(cond(C)), so the iteration converges in about a dozen steps even for the
// blocks with masked bins (cond(C) up to 1e10), and it uses matrix products only, which is
// what makes it accurate: it never forms eigenvectors of nearly equal eigenvalues.
//
// Iteration (Chen and Chow's scaling): with X = A / ||A||_F, every singular value of X lies in
// [l, 1], l = 1 / (||A||_F ||A^-1||_F). A step X <- a X (3 I - a^2 X^T X) / 2 with
// a = sqrt(3 / (1 + l + l^2)) maps [l, 1] into [l', 1], l' = a l (3 - a^2 l^2) / 2, and the
// measured ||X^T X - I||_F = e < 1 gives a second bound, sqrt((1 - e) / (1 + e)) after
// dividing X by sqrt(1 + e); the larger bound is used. The block stops one step after
// e < tol. A block whose covariance is not numerically positive definite, or that does not
// converge in `max_iter` steps, gets a negative verdict and is left to the Jacobi kernel.
//
// Layout: N = n rounded up to 8, one warp per 8-row tile (N / 8 warps, N <= 8 SPEX_TILES); two
// N x N matrices in shared memory with leading dimension N + 4 (conflict-free fragment
// loads), zero outside n x n; the triangular factor A is parked in global memory (`pbuf`)
// while they iterate.

#include "common.cuh"
#include "outputs.cuh"

#define SPEX_TILES 14

// c (8 x 8, two per lane) += a (8 x 4) b (4 x 8) for one warp. Lane l holds a[l/4][l%4],
// b[l%4][l/4] and c[l/4][2 (l%4) + {0, 1}].
__device__ __forceinline__ void mma8x8x4(double& c0, double& c1, double a, double b) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
                 : "+d"(c0), "+d"(c1)
                 : "d"(a), "d"(b));
#else
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k = 0; k < 4; ++k) {
        double ak = __shfl_sync(0xffffffffu, a, g * 4 + k);
        double b0 = __shfl_sync(0xffffffffu, b, 2 * t * 4 + k);
        double b1 = __shfl_sync(0xffffffffu, b, (2 * t + 1) * 4 + k);
        c0 += ak * b0;
        c1 += ak * b1;
    }
#endif
}

// Row tile I (= this warp) of Y^T B: acc[J] = sum_k Y[k][8I + g] B[k][8J + 2t + {0, 1}].
__device__ __forceinline__ void tile_row_tn(const double* Y, const double* B, int ld, int N,
                                            double (&acc)[SPEX_TILES][2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, I = threadIdx.x >> 5;
    int nt = N / 8;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J) acc[J][0] = acc[J][1] = 0.0;
    for (int k0 = 0; k0 < N; k0 += 4) {
        double a = Y[(k0 + t) * ld + 8 * I + g];
#pragma unroll
        for (int J = 0; J < SPEX_TILES; ++J)
            if (J < nt) mma8x8x4(acc[J][0], acc[J][1], a, B[(k0 + t) * ld + 8 * J + g]);
    }
}

// Row tile I of Y B: acc[J] = sum_k Y[8I + g][k] B[k][8J + 2t + {0, 1}].
__device__ __forceinline__ void tile_row_nn(const double* Y, const double* B, int ld, int N,
                                            double (&acc)[SPEX_TILES][2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, I = threadIdx.x >> 5;
    int nt = N / 8;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J) acc[J][0] = acc[J][1] = 0.0;
    for (int k0 = 0; k0 < N; k0 += 4) {
        double a = Y[(8 * I + g) * ld + k0 + t];
#pragma unroll
        for (int J = 0; J < SPEX_TILES; ++J)
            if (J < nt) mma8x8x4(acc[J][0], acc[J][1], a, B[(k0 + t) * ld + 8 * J + g]);
    }
}

// Stores row tile I of a product into D (D[8I + g][8J + 2t + {0, 1}]).
__device__ __forceinline__ void store_rows(double* D, int ld, int N,
                                           const double (&acc)[SPEX_TILES][2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, I = threadIdx.x >> 5;
    int nt = N / 8;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J)
        if (J < nt) {
            double2 v = make_double2(acc[J][0], acc[J][1]);
            *reinterpret_cast<double2*>(D + (8 * I + g) * ld + 8 * J + 2 * t) = v;
        }
}

// Cholesky factor of the n x n block in T (lower triangle, in place); false when a pivot is not
// positive (or not finite).
__device__ bool cholesky_in_place(double* T, int ld, int n, int* flag) {
    int tid = threadIdx.x, nth = blockDim.x;
    if (tid == 0) *flag = 0;
    __syncthreads();
    for (int j = 0; j < n; ++j) {
        if (tid == 0) {
            double d = T[j * ld + j];
            if (!(d > 0.0) || !isfinite(d)) *flag = 1;
            T[j * ld + j] = sqrt(fmax(d, 1e-300));
        }
        __syncthreads();
        double djj = T[j * ld + j];
        for (int i = j + 1 + tid; i < n; i += nth) T[i * ld + j] /= djj;
        __syncthreads();
        int r = n - j - 1;
        for (int idx = tid; idx < r * r; idx += nth) {
            int i = j + 1 + idx / r, k = j + 1 + idx % r;
            if (k <= i) T[i * ld + k] -= T[i * ld + j] * T[k * ld + j];
        }
        __syncthreads();
    }
    return *flag == 0;
}

// X = L^-1 for the lower triangular L in T (rows swept from the top; X zero outside n x n).
__device__ void lower_inverse(const double* T, double* X, int ld, int n) {
    int tid = threadIdx.x, nth = blockDim.x;
    for (int idx = tid; idx < n * n; idx += nth) {
        int i = idx / n, j = idx % n;
        X[i * ld + j] = i == j ? 1.0 : 0.0;
    }
    __syncthreads();
    for (int k = 0; k < n; ++k) {
        double inv = 1.0 / T[k * ld + k];
        for (int j = tid; j <= k; j += nth) X[k * ld + j] *= inv;
        __syncthreads();
        int w = k + 1;
        for (int idx = tid; idx < (n - k - 1) * w; idx += nth) {
            int i = k + 1 + idx / w, j = idx % w;
            X[i * ld + j] -= T[i * ld + k] * X[k * ld + j];
        }
        __syncthreads();
    }
}

// Frobenius norm of the n x n block of M (lower triangle only when `lower`).
__device__ double frobenius(const double* M, int ld, int n, bool lower, double* red) {
    double s = 0.0;
    for (int idx = threadIdx.x; idx < n * n; idx += blockDim.x) {
        int i = idx / n, j = idx % n;
        if (!lower || j <= i) s += M[i * ld + j] * M[i * ld + j];
    }
    return sqrt(block_sum(s, red));
}

// `blocks`: C (from_cov != 0) or S, n x n each, row-major, one per (patch, core fiber).
// `iters_out[blk]`: the number of steps, or -1 (not positive definite) or -2 (no convergence).
// `pbuf`: n x n doubles per block of scratch. `qout`, when not null, receives Q.
//
// Shared memory (dynamic): X[N ld], T[N ld], rowsum[n], red[32], flag.
extern "C" __global__ void polar_f64(
    const double* __restrict__ blocks, int from_cov, const double* __restrict__ xflux,
    const int* __restrict__ nkeep, int n, int m, int ncore, int wavepad, int nwavestep,
    int ndiag, double tol, int max_iter, double* __restrict__ pbuf, double* __restrict__ flux,
    double* __restrict__ ivar, double* __restrict__ resolution, double* __restrict__ fluxcol,
    int* __restrict__ iters_out, double* __restrict__ qout) {
    extern __shared__ double sm[];
    int N = (n + 7) / 8 * 8, ld = N + 4;
    double* X = sm;
    double* T = X + N * ld;
    double* rowsum = T + N * ld;
    double* red = rowsum + n;
    int* flag = (int*)(red + 32);
    int tid = threadIdx.x, nth = blockDim.x;
    int blk = blockIdx.x;
    const double* src = blocks + (size_t)blk * n * n;
    double* P = pbuf + (size_t)blk * n * n;

    for (int idx = tid; idx < N * ld; idx += nth) {
        int i = idx / ld, j = idx % ld;
        T[idx] = (i < n && j < n) ? src[i * n + j] : 0.0;
        X[idx] = 0.0;
    }
    __syncthreads();
    if (!cholesky_in_place(T, ld, n, flag)) {
        if (tid == 0) iters_out[blk] = -1;
        return;
    }
    lower_inverse(T, X, ld, n);
    double norm_a, norm_ainv;
    if (from_cov) {
        // A = L^-1 (in X), A^-1 = L
        norm_a = frobenius(X, ld, n, true, red);
        norm_ainv = frobenius(T, ld, n, true, red);
        for (int idx = tid; idx < n * n; idx += nth) {
            int i = idx / n, j = idx % n;
            P[idx] = j <= i ? X[i * ld + j] : 0.0;
        }
        __syncthreads();
        double s = 1.0 / norm_a;
        for (int idx = tid; idx < N * ld; idx += nth) {
            int i = idx / ld, j = idx % ld;
            X[idx] = (i < n && j <= i) ? X[idx] * s : 0.0;
        }
    } else {
        // A = G^T, A^-1 = G^-T (G^-1 in X)
        norm_a = frobenius(T, ld, n, true, red);
        norm_ainv = frobenius(X, ld, n, true, red);
        for (int idx = tid; idx < n * n; idx += nth) {
            int i = idx / n, j = idx % n;
            P[idx] = j >= i ? T[j * ld + i] : 0.0;
        }
        __syncthreads();
        double s = 1.0 / norm_a;
        for (int idx = tid; idx < N * ld; idx += nth) {
            int i = idx / ld, j = idx % ld;
            X[idx] = (j < n && i <= j) ? T[j * ld + i] * s : 0.0;
        }
    }
    __syncthreads();

    double acc[SPEX_TILES][2];
    double l = 1.0 / (norm_a * norm_ainv);
    int verdict = -2;
    for (int it = 1; it <= max_iter && isfinite(l); ++it) {
        // T = X^T X
        tile_row_tn(X, X, ld, N, acc);
        store_rows(T, ld, N, acc);
        __syncthreads();
        double e = 0.0;
        for (int idx = tid; idx < n * n; idx += nth) {
            int i = idx / n, j = idx % n;
            double v = T[i * ld + j] - (i == j ? 1.0 : 0.0);
            e += v * v;
        }
        e = sqrt(block_sum(e, red));
        if (!isfinite(e)) break;
        double s = 1.0;
        if (e < 1.0) {
            double lb = sqrt((1.0 - e) / (1.0 + e));
            if (lb > l) {
                l = lb;
                s = sqrt(1.0 + e);
            }
        }
        l = fmin(l, 1.0);
        double a = sqrt(3.0 / (1.0 + l + l * l));
        double b = a / s;
        // T <- M = 1.5 b I - 0.5 b^3 T, then X <- X M
        double c1 = 1.5 * b, c3 = -0.5 * b * b * b;
        for (int idx = tid; idx < N * N; idx += nth) {
            int i = idx / N, j = idx % N;
            T[i * ld + j] = (i < n && j < n) ? c3 * T[i * ld + j] + (i == j ? c1 : 0.0) : 0.0;
        }
        __syncthreads();
        tile_row_nn(X, T, ld, N, acc);
        __syncwarp();
        store_rows(X, ld, N, acc);
        __syncthreads();
        l = 0.5 * a * l * (3.0 - a * a * l * l);
        if (e < tol) {
            verdict = it;
            break;
        }
    }
    if (verdict < 0) {
        if (tid == 0) iters_out[blk] = verdict;
        return;
    }

    // Q^T = (U^T A)^T into X (warp I writes the column tile I that only it reads), then Q
    // symmetrised into T.
    for (int idx = tid; idx < N * ld; idx += nth) {
        int i = idx / ld, j = idx % ld;
        T[idx] = (i < n && j < n) ? P[i * n + j] : 0.0;
    }
    __syncthreads();
    tile_row_tn(X, T, ld, N, acc);
    __syncwarp();
    {
        int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, I = threadIdx.x >> 5;
#pragma unroll
        for (int J = 0; J < SPEX_TILES; ++J)
            if (J < N / 8) {
                X[(8 * J + 2 * t) * ld + 8 * I + g] = acc[J][0];
                X[(8 * J + 2 * t + 1) * ld + 8 * I + g] = acc[J][1];
            }
    }
    __syncthreads();
    for (int idx = tid; idx < n * n; idx += nth) {
        int i = idx / n, j = idx % n;
        T[i * ld + j] = 0.5 * (X[i * ld + j] + X[j * ld + i]);
    }
    __syncthreads();
    if (qout) {
        for (int idx = tid; idx < n * n; idx += nth)
            qout[(size_t)blk * n * n + idx] = T[(idx / n) * ld + idx % n];
    }
    write_decorrelated(T, ld, n, rowsum, blk, tid, nth, xflux, nkeep, m, ncore, wavepad,
                       nwavestep, ndiag, flux, ivar, resolution, fluxcol);
    if (tid == 0) iters_out[blk] = verdict;
}
