// Small dense matrices in shared memory, as 8 x 8 tiles: products on FP64 tensor cores
// (mma.m8n8k4, sm_80 and later; shuffles elsewhere), Cholesky factorisation and triangular
// inversion. One warp per row tile: a block of N / 8 warps works on N x N matrices (N a
// multiple of 8, at most 8 SPEX_TILES) with leading dimension ld = N + 4, which makes the
// fragment loads free of bank conflicts.

#pragma once

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
// positive (or not finite). One barrier per column: the trailing update uses the unscaled
// column (an L D L^T sweep), the scaling by sqrt(d_j) comes once at the end.
__device__ bool cholesky_in_place(double* T, int ld, int n, int* flag) {
    int tid = threadIdx.x, nth = blockDim.x;
    int lane = tid & 31, warp = tid >> 5, nwarp = nth >> 5;
    if (tid == 0) *flag = 0;
    __syncthreads();
    for (int j = 0; j < n; ++j) {
        double inv = 1.0 / T[j * ld + j];
        for (int i = j + 1 + warp; i < n; i += nwarp) {
            double f = T[i * ld + j] * inv;
            for (int k = j + 1 + lane; k <= i; k += 32) T[i * ld + k] -= f * T[k * ld + j];
        }
        __syncthreads();
    }
    for (int idx = tid; idx < n * n; idx += nth) {
        int i = idx / n, j = idx % n;
        double d = T[j * ld + j];
        if (j == i && (!(d > 0.0) || !isfinite(d))) *flag = 1;
        if (j < i) T[i * ld + j] = T[i * ld + j] * rsqrt(fmax(d, 1e-300));
    }
    __syncthreads();
    for (int j = tid; j < n; j += nth) T[j * ld + j] = sqrt(fmax(T[j * ld + j], 1e-300));
    __syncthreads();
    return *flag == 0;
}

// X = L^-1 for the lower triangular L in T (rows swept from the top, each row scaled by its
// pivot at the end; X zero outside n x n).
__device__ void lower_inverse(const double* T, double* X, int ld, int n) {
    int tid = threadIdx.x, nth = blockDim.x;
    int lane = tid & 31, warp = tid >> 5, nwarp = nth >> 5;
    for (int idx = tid; idx < n * n; idx += nth) {
        int i = idx / n, j = idx % n;
        X[i * ld + j] = i == j ? 1.0 : 0.0;
    }
    __syncthreads();
    for (int k = 0; k < n; ++k) {
        double inv = 1.0 / T[k * ld + k];
        for (int i = k + 1 + warp; i < n; i += nwarp) {
            double f = T[i * ld + k] * inv;
            for (int j = lane; j <= k; j += 32) X[i * ld + j] -= f * X[k * ld + j];
        }
        __syncthreads();
    }
    for (int idx = tid; idx < n * n; idx += nth) {
        int i = idx / n, j = idx % n;
        X[i * ld + j] /= T[i * ld + i];
    }
    __syncthreads();
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

