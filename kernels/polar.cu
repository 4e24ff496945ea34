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
// [l, 1], l = 1 / (||A||_F ||A^-1||_2) (the 2-norm estimated by power steps), which the first
// step tightens where the block is well-conditioned (`rescale_first_step`). A step X <- a X
// (3 I - a^2 X^T X) / 2 with a = sqrt(3 / (1 + l + l^2)) maps [l, 1] into [l', 1], l' = a l
// (3 - a^2 l^2) / 2, and the measured ||X^T X - I||_F = e < 1 gives a second bound,
// sqrt((1 - e) / (1 + e)) after dividing X by sqrt(1 + e); the larger bound is used. The
// block stops one step after e < tol. A block whose covariance is not numerically positive
// definite, or that does not converge in `max_iter` steps, gets a negative verdict and is left
// to the Jacobi kernel.
//
// Layout: N = n rounded up to 8, one warp per 8-row tile (N / 8 warps, N <= 8 SPEX_TILES); two
// N x N matrices in shared memory with leading dimension N + 4 (conflict-free fragment
// loads), zero outside n x n; the triangular factor A is parked in global memory (`pbuf`)
// while they iterate, or, when `factored`, read back transposed from the combine's G that
// `pbuf` already holds.

#include "common.cuh"
#include "outputs.cuh"
#include "tiles.cuh"

// Sum of a[i] b[i] over i < n by one warp, the same value bit for bit in every lane and in
// every warp that calls it on the same data (fixed partial sums, xor butterfly).
__device__ __forceinline__ double warp_dot(const double* a, const double* b, int n) {
    double s = 0.0;
    for (int i = threadIdx.x & 31; i < n; i += 32) s += a[i] * b[i];
    return warp_sum(s);
}

// An estimate of the 2-norm of the lower triangular n x n matrix M, ||M v|| after a few power
// steps on M^T M from the all-ones direction. It comes from below, so the bound l it gives the
// iteration may be optimistic; that only slows the blocks where it is, and their convergence
// test still decides. `v`, `w`: n doubles each. Each product runs four threads to a row (or
// column) of M, with two shuffles to sum them, and ends in a barrier: the block needs at least
// 4 n threads. The norms are summed by every warp for itself, so every thread returns the same
// estimate.
//
// Each power step costs about 6000 cycles of a block that takes some 330000 (two products, two
// barriers, two sums). Four of them, rather than six, left the step counts of a frame's blocks
// as they were and made the polar kernel 0.37 ms faster per full frame on an H100 (kernel
// harness); three added a step to some blocks.
#define SPEX_POLAR_POWER_STEPS 4
__device__ double lower_norm2(const double* M, int ld, int n, double* v, double* w) {
    int tid = threadIdx.x, nth = blockDim.x;
    int row = tid >> 2, q = tid & 3;
    for (int i = tid; i < n; i += nth) v[i] = rsqrt((double)n);
    __syncthreads();
    for (int it = 0; it < SPEX_POLAR_POWER_STEPS; ++it) {
        double inv = 1.0;
        if (it > 0) {
            double len2 = warp_dot(v, v, n);
            inv = len2 > 0.0 ? rsqrt(len2) : 0.0;
        }
        double s = 0.0;
        if (row < n)
            for (int k = q; k <= row; k += 4) s += M[row * ld + k] * v[k];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (row < n && q == 0) w[row] = s * inv;
        __syncthreads();
        s = 0.0;
        if (row < n)
            for (int i = row + q; i < n; i += 4) s += M[i * ld + row] * w[i];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (row < n && q == 0) v[row] = s;
        __syncthreads();
    }
    return sqrt(warp_dot(w, w, n));
}

// The first step's rescaling applies to blocks whose bound l is at least this, i.e. cond(C)
// up to about 1e5: all of them on a frame without masked bins. The worse-conditioned ones
// keep the plain first step, whose rounding the accuracy test against an extended-precision
// reference has measured (rescaled, a block of cond(C) = 2e7 came out 1.7e-10 sigma off
// instead of 5.6e-11).
#define SPEX_POLAR_RESCALE_MIN_L 1e-3

// The first step's rescaling: with M = X^T X in `acc` (this warp's row tile, in the
// products' layout of tiles.cuh), gamma = the largest absolute row sum of M is at least its
// largest eigenvalue (Gershgorin), and at most 1 since X = A / ||A||_F. X / sqrt(gamma) then
// still has every singular value at most 1, and the lower bound `l` grows by 1 / sqrt(gamma):
// the Frobenius norm overestimates the 2-norm by up to sqrt(n), so this saves one or two
// steps. `acc` becomes M / gamma; returns the factor 1 / sqrt(gamma) that the step's
// polynomial applies to X, 1 when there is nothing to gain.
__device__ __forceinline__ double rescale_first_step(double (&acc)[SPEX_TILES][2], int N, int n,
                                                     double* red, double& l) {
    // a lane holds parts of two rows, acc_row(0) and acc_row(1); the lanes of one t share them
    double rs[2] = {0.0, 0.0};
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J)
#pragma unroll
        for (int q = 0; q < 2; ++q)
            if (J < N / 8 && acc_row(q) < n && acc_col(J) < n) rs[q] += fabs(acc[J][q]);
#pragma unroll
    for (int q = 0; q < 2; ++q)
        for (int o = 4; o < 32; o <<= 1) rs[q] += __shfl_xor_sync(0xffffffffu, rs[q], o);
    // a margin for the rounding of the product
    double gamma = block_max(fmax(rs[0], rs[1]), red) * (1.0 + 1e-12);
    if (!(gamma > 0.0 && gamma < 1.0)) return 1.0;
    double inv = 1.0 / gamma;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J)
#pragma unroll
        for (int q = 0; q < 2; ++q) acc[J][q] *= inv;
    double xs = sqrt(inv);
    l = fmin(l * xs, 1.0);
    return xs;
}

// `blocks`: C (from_cov != 0) or S, n x n each, row-major, one per (patch, core fiber).
// `factored` (S only): `pbuf` already holds each block's Cholesky factor G (S = G G^T, lower,
// row-major, zero above the diagonal), which the Schur combine computed anyway; the kernel then
// starts from it instead of factorising S again, and leaves it in place.
// `iters_out[blk]`: the number of steps, or -1 (not positive definite) or -2 (no convergence).
// `pbuf`: n x n doubles per block of scratch. `qout`, when not null, receives Q.
//
// Shared memory (dynamic): X[N ld], T[N ld], rowsum[n], v[n], red[32]. Registers: at most
// 96 (~13 words spill), so that two blocks share an SM as their shared memory allows; left
// to the compiler it takes 133, one block fits, and a full frame's decorrelation takes 48 ms
// instead of 41 on an H100.
extern "C" __global__ void SPEX_MAX_REGS(96) polar_f64(
    const double* __restrict__ blocks, int from_cov, int factored, const double* __restrict__ xflux,
    const int* __restrict__ nkeep, int n, int m, int ncore, int wavepad, int nwavestep,
    int ndiag, double tol, int max_iter, double* __restrict__ pbuf, double* __restrict__ flux,
    double* __restrict__ ivar, double* __restrict__ resolution, double* __restrict__ fluxcol,
    int* __restrict__ iters_out, double* __restrict__ qout,
    const int* __restrict__ skip) {
    extern __shared__ double sm[];
    // `skip` (when given): nonzero for a patch left out, solved again for its outliers
    if (skip && skip[blockIdx.x / ncore]) return;
    SPEX_PHASE_START
    int N = (n + 7) / 8 * 8, ld = N + 4;
    double* X = sm;
    double* T = X + N * ld;
    double* rowsum = T + N * ld;
    double* v = rowsum + n;
    double* red = v + n;
    int tid = threadIdx.x, nth = blockDim.x;
    int blk = blockIdx.x;
    const double* src = blocks + (size_t)blk * n * n;
    double* P = pbuf + (size_t)blk * n * n;

    load_block(factored ? P : src, n, n, [&](int i, int j, double v) { T[i * ld + j] = v; });
    for_each_element(N, ld, [&](int i, int j) {
        if (i >= n || j >= n) T[i * ld + j] = 0.0;
        X[i * ld + j] = 0.0;
    });
    __syncthreads();
    if (!factored && !cholesky_in_place(T, ld, n)) {
        if (tid == 0) iters_out[blk] = -1;
        return;
    }
    SPEX_PHASE(0);
    lower_inverse(T, X, ld, n);
    SPEX_PHASE(1);
    double norm_a, norm_ainv;
    if (from_cov) {
        // A = L^-1 (in X), A^-1 = L
        norm_a = frobenius(X, ld, n, true, red);
        norm_ainv = lower_norm2(T, ld, n, rowsum, v);
        for_each_element(n, n, [&](int i, int j) { P[i * n + j] = j <= i ? X[i * ld + j] : 0.0; });
        __syncthreads();
        double s = 1.0 / norm_a;
        for_each_element(N, ld, [&](int i, int j) {
            X[i * ld + j] = (i < n && j <= i) ? X[i * ld + j] * s : 0.0;
        });
    } else {
        // A = G^T, A^-1 = G^-T (G^-1 in X)
        norm_a = frobenius(T, ld, n, true, red);
        norm_ainv = lower_norm2(X, ld, n, rowsum, v);
        if (!factored)
            for_each_element(n, n, [&](int i, int j) { P[i * n + j] = j >= i ? T[j * ld + i] : 0.0; });
        __syncthreads();
        double s = 1.0 / norm_a;
        for_each_element(N, ld, [&](int i, int j) {
            X[i * ld + j] = (j < n && i <= j) ? T[j * ld + i] * s : 0.0;
        });
    }
    __syncthreads();

    SPEX_PHASE(2);
    double acc[SPEX_TILES][2];
    double l = 1.0 / (norm_a * norm_ainv);
    int verdict = -2;
    for (int it = 1; it <= max_iter && isfinite(l); ++it) {
        // X^T X in registers (this warp's row tile), its distance to I, then M into T
        tile_row_tn(X, X, ld, N, acc);
        SPEX_PHASE(3);
        double xs = 1.0;
        if (it == 1 && l >= SPEX_POLAR_RESCALE_MIN_L) xs = rescale_first_step(acc, N, n, red, l);
        double e = 0.0;
#pragma unroll
        for (int J = 0; J < SPEX_TILES; ++J)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                int r = acc_row(q), c = acc_col(J);
                if (J < N / 8 && r < n && c < n) {
                    double d = acc[J][q] - (r == c ? 1.0 : 0.0);
                    e += d * d;
                }
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
        SPEX_PHASE(4);
        double a = sqrt(3.0 / (1.0 + l + l * l));
        double b = a / s;
        // M = 1.5 b I - 0.5 b^3 X^T X (zero outside n x n), then X <- X M
        double c1 = 1.5 * b * xs, c3 = -0.5 * b * b * b * xs;
#pragma unroll
        for (int J = 0; J < SPEX_TILES; ++J)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                int r = acc_row(q), c = acc_col(J);
                acc[J][q] = (r < n && c < n) ? c3 * acc[J][q] + (r == c ? c1 : 0.0) : 0.0;
            }
        store_rows(T, ld, N, acc);
        __syncthreads();
        tile_row_nn(X, T, ld, N, acc);
        __syncwarp();
        store_rows(X, ld, N, acc);
        __syncthreads();
        SPEX_PHASE(5);
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
    // A into T: parked as it is, or given as G (A = G^T)
    load_block(P, n, n, [&](int i, int j, double v) {
        if (factored)
            T[j * ld + i] = v;
        else
            T[i * ld + j] = v;
    });
    for_each_element(N, ld, [&](int i, int j) {
        if (i >= n || j >= n) T[i * ld + j] = 0.0;
    });
    __syncthreads();
    tile_row_tn(X, T, ld, N, acc);
    __syncwarp();
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J)
        if (J < N / 8) {
            X[acc_col(J) * ld + acc_row(0)] = acc[J][0];
            X[acc_col(J) * ld + acc_row(1)] = acc[J][1];
        }
    __syncthreads();
    for_each_element(n, n, [&](int i, int j) { T[i * ld + j] = 0.5 * (X[i * ld + j] + X[j * ld + i]); });
    __syncthreads();
    SPEX_PHASE(6);
    if (qout) {
        for (int idx = tid; idx < n * n; idx += nth)
            qout[(size_t)blk * n * n + idx] = T[(idx / n) * ld + idx % n];
    }
    write_decorrelated(T, ld, n, rowsum, blk, tid, nth, xflux, nkeep, m, ncore, wavepad,
                       nwavestep, ndiag, flux, ivar, resolution, fluxcol);
    SPEX_PHASE(7);
    if (tid == 0) iters_out[blk] = verdict;
}
