// Small dense matrices in shared memory, as 8 x 8 tiles: products on FP64 tensor cores
// (mma.m16n8k4 on sm_90, two mma.m8n8k4 on sm_80, shuffles elsewhere), and a blocked Cholesky
// factorisation, triangular solves and inversion with one block barrier per 8-wide panel or
// none. One warp per row tile: a block of N / 8 warps works on N x N matrices (N a multiple of
// 8, at most 8 SPEX_TILES) with leading dimension ld = N + 4, which makes the fragment loads
// free of bank conflicts.
//
// sm_90 runs m8n8k4 at half the rate of its m16n8k* shapes (33 against 67 TFLOP/s on an
// H100), so the products and the triangular solves' updates go through m16n8k4: two 8 x 8
// tiles that share one operand in one instruction. The Cholesky factorisation's updates stay
// on m8n8k4: its panel sweeps, not its updates, take its time, and m16n8k4 needs more
// registers than the Schur combine's cap leaves.

#pragma once

// Most row tiles: N <= 80, which DESI's patches (74 bins, 75 with the sweeps' extra column)
// fit. A larger bound unrolls more and costs registers (spills under the caps below) and
// compile time; larger blocks take the dense and Jacobi routes (TILE_MAX_ORDER on the host).
#define SPEX_TILES 10

// A cap on a kernel's registers per thread: two blocks of 320 threads (10 warps, N <= 80)
// share an SM only at 96 or fewer, as their shared memory allows. NVRTC before 12.4 has no
// __maxnreg__, and the kernels then take what the compiler gives them.
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4)
#define SPEX_MAX_REGS(n) __maxnreg__(n)
#else
#define SPEX_MAX_REGS(n)
#endif

// The lane, read from %laneid so that the compiler recomputes it where it is needed instead
// of keeping every lane-derived index of the unrolled routines below live across the
// callers' loops (which cost the sweep kernel ~30 registers).
__device__ __forceinline__ int lane_id() {
#ifdef __CUDA_ARCH__
    int l;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
#else
    return threadIdx.x & 31;
#endif
}

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

// Two 8 x 8 products with one right operand: (c0, c1) += a0 b and (c2, c3) += a1 b, each in
// mma8x8x4's layout (a0 and a1 as its a); on sm_90 one m16n8k4 whose upper half is the first
// and lower half the second.
__device__ __forceinline__ void mma16x8x4(double& c0, double& c1, double& c2, double& c3, double a0,
                                          double a1, double b) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%0, %1, %2, %3};\n"
        : "+d"(c0), "+d"(c1), "+d"(c2), "+d"(c3)
        : "d"(a0), "d"(a1), "d"(b));
#else
    mma8x8x4(c0, c1, a0, b);
    mma8x8x4(c2, c3, a1, b);
#endif
}

// The products below leave row tile I (= this warp) of C in registers, transposed: lane
// (g, t) = (l / 4, l % 4) holds C[8I + 2t + q][8J + g] in acc[J][q]. They compute C^T = B^T Y
// (or B^T Y^T), so that two column tiles J, J + 1 of C share the warp's operand and take one
// m16n8k4. These give an element's row and column.
__device__ __forceinline__ int acc_row(int q) {
    int lane = threadIdx.x & 31;
    return 8 * (threadIdx.x >> 5) + 2 * (lane & 3) + q;
}
__device__ __forceinline__ int acc_col(int J) { return 8 * J + ((threadIdx.x & 31) >> 2); }

// acc[J], acc[J + 1] += B[k0 + t][8J + g (+ 8)] b over the four k of one step: the column
// tiles J < nt of one product step, b being this lane's element of the warp's operand.
__device__ __forceinline__ void tile_row_step(const double* B, int ld, int nt, int k0, double b,
                                              double (&acc)[SPEX_TILES][2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const double* row = B + (k0 + t) * ld + g;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; J += 2)
        if (J < nt) {
            double a0 = row[8 * J], a1 = J + 1 < nt ? row[8 * J + 8] : 0.0;
            mma16x8x4(acc[J][0], acc[J][1], acc[J + 1][0], acc[J + 1][1], a0, a1, b);
        }
}

// Row tile I of Y^T B: acc[J][q] = sum_k Y[k][8I + 2t + q] B[k][8J + g].
__device__ __forceinline__ void tile_row_tn(const double* Y, const double* B, int ld, int N,
                                            double (&acc)[SPEX_TILES][2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, I = threadIdx.x >> 5;
    int nt = N / 8;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J) acc[J][0] = acc[J][1] = 0.0;
    for (int k0 = 0; k0 < N; k0 += 4) tile_row_step(B, ld, nt, k0, Y[(k0 + t) * ld + 8 * I + g], acc);
}

// Row tile I of Y B: acc[J][q] = sum_k Y[8I + 2t + q][k] B[k][8J + g].
__device__ __forceinline__ void tile_row_nn(const double* Y, const double* B, int ld, int N,
                                            double (&acc)[SPEX_TILES][2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, I = threadIdx.x >> 5;
    int nt = N / 8;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J) acc[J][0] = acc[J][1] = 0.0;
    for (int k0 = 0; k0 < N; k0 += 4) tile_row_step(B, ld, nt, k0, Y[(8 * I + g) * ld + k0 + t], acc);
}

// Stores row tile I of a product into D (D[acc_row(q)][acc_col(J)] = acc[J][q]).
__device__ __forceinline__ void store_rows(double* D, int ld, int N,
                                           const double (&acc)[SPEX_TILES][2]) {
    int nt = N / 8;
#pragma unroll
    for (int J = 0; J < SPEX_TILES; ++J)
        if (J < nt) {
            D[acc_row(0) * ld + acc_col(J)] = acc[J][0];
            D[acc_row(1) * ld + acc_col(J)] = acc[J][1];
        }
}

// The blocked factorisation and substitutions below work in 8-wide panels on the tiles
// (tile (I, J): rows 8I.., columns 8J..; nt = ceil(n / 8) tiles per side hold the n x n
// block). Inside a panel a warp works on its own tiles and talks through shuffles and
// __syncwarp; block barriers separate panels only.

// Tile (I, J) of T in the accumulator layout (lane (g, t) holds row g, columns 2t, 2t + 1),
// read as zero outside the n x n block whatever T holds there.
__device__ __forceinline__ void load_tile(const double* T, int ld, int n, int I, int J,
                                          double& c0, double& c1) {
    int lane = lane_id(), g = lane >> 2, t = lane & 3;
    int i = 8 * I + g, j = 8 * J + 2 * t;
    c0 = (i < n && j < n) ? T[i * ld + j] : 0.0;
    c1 = (i < n && j + 1 < n) ? T[i * ld + j + 1] : 0.0;
}

// Stores an accumulator-layout tile into tile (I, J) of T; with `lower`, only the elements on
// or below the tile's diagonal (for the diagonal tiles of a factor).
__device__ __forceinline__ void store_tile(double* T, int ld, int I, int J, double c0, double c1,
                                           bool lower) {
    int lane = lane_id(), g = lane >> 2, t = lane & 3;
    double* d = T + (8 * I + g) * ld + 8 * J + 2 * t;
    if (!lower || 2 * t <= g) d[0] = c0;
    if (!lower || 2 * t + 1 <= g) d[1] = c1;
}

// c -= L_Iq L_Jq^T for the tiles (I, q) and (J, q) of L: one warp, two MMA steps.
__device__ __forceinline__ void minus_outer(const double* L, int ld, int I, int J, int q,
                                            double& c0, double& c1) {
    int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int k0 = 0; k0 < 8; k0 += 4) {
        double a = L[(8 * I + g) * ld + 8 * q + k0 + t];
        double b = L[(8 * J + g) * ld + 8 * q + k0 + t];
        mma8x8x4(c0, c1, -a, b);
    }
}

// One panel of the factorisation in one warp, in the accumulator layout: the diagonal tile D
// (d0, d1) and a tile A below it (a0, a1) are swept column by column as in the unblocked
// L D L^T (unscaled columns; column j is component j & 1 of the lanes t = j / 2, and each
// step shuffles from them the pivot D_jj, D_gj and A_gj of the lane's row and D_kj of its two
// columns k), then column j is scaled at once: D becomes L_pp (zero above the diagonal) and
// A the panel's tile of L. Columns from `cols` on (padding, past n) are skipped and come out
// zero. Returns false when a pivot of a live column is not positive or not finite.
//
// The 74 columns of a DESI block are swept one after the other, so each step's latency adds
// up: its one reciprocal square root also gives the multipliers' 1 / pivot, as its square, and
// the diagonal, as pivot times it corrected by one Newton step. With a division and a square
// root per column, the Schur sweeps took 13.0 ms per full frame on an H100 instead of 12.0,
// the combine 4.6 instead of 4.0 and the polar kernel 15.2 instead of 14.7 (kernel harness).
// The diagonal needs its Newton step: uncorrected, the flux of a block of condition 1.9e7
// came out 1.0e-10 sigma from the extended-precision reference instead of 4.1e-11 (5.5e-11
// with the division and square root, 5.0e-11 with the multiplier corrected too).
__device__ __forceinline__ bool panel_sweep(double& d0, double& d1, double& a0, double& a1,
                                            int cols) {
    int lane = lane_id(), g = lane >> 2, t = lane & 3;
    bool ok = true;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        int src = j >> 1;
        double dj = (j & 1) ? d1 : d0, aj = (j & 1) ? a1 : a0;
        double piv = __shfl_sync(0xffffffffu, dj, 4 * j + src);
        double dgj = __shfl_sync(0xffffffffu, dj, 4 * g + src);
        double agj = __shfl_sync(0xffffffffu, aj, 4 * g + src);
        double dk0 = __shfl_sync(0xffffffffu, dj, 8 * t + src);
        double dk1 = __shfl_sync(0xffffffffu, dj, 8 * t + 4 + src);
        bool on = j < cols;
        ok = ok && (!on || (piv > 0.0 && isfinite(piv)));
        double rs = on ? rsqrt(fmax(piv, 1e-300)) : 0.0;
        double inv = on ? rs * rs : 0.0;
        double fd = dgj * inv, fa = agj * inv;
        int k0 = 2 * t, k1 = 2 * t + 1;
        if (k0 > j && k0 <= g) d0 -= fd * dk0;
        if (k1 > j && k1 <= g) d1 -= fd * dk1;
        if (k0 > j) a0 -= fa * dk0;
        if (k1 > j) a1 -= fa * dk1;
        if (t == src) {
            // piv rs to within rounding of sqrt(piv) by one Newton step
            double diag = on ? piv * rs : 0.0;
            diag = on ? fma(0.5 * rs, fma(-diag, diag, piv), diag) : 0.0;
            double l = g > j ? dj * rs : (g == j ? diag : 0.0);
            if (j & 1) {
                d1 = l;
                a1 *= rs;
            } else {
                d0 = l;
                a0 *= rs;
            }
        }
    }
    return ok;
}

// Cholesky factor of the n x n block in T (lower triangle, in place); false, on every thread,
// when a pivot is not positive or not finite. Reads only the lower n x n block (T may hold
// anything elsewhere), and leaves zero in the rows and columns >= n of the lower tiles; the
// tiles above the diagonal are not touched. Any number of warps; warp w owns row tiles w,
// w + nwarp, ...
//
// Right-looking with the trailing update one panel late, so that one barrier per panel
// suffices (nt barriers in all). Phase p (tile indices, warp W owning row tile I >= p):
// - W reads tile (p, p) and L_{p,p-1} and factors D = A_pp - L_{p,p-1} L_{p,p-1}^T in
//   registers (every such warp the same, bit for bit);
// - for I > p, W also forms A_Ip - L_{I,p-1} L_{p,p-1}^T, sweeps it with D (panel_sweep) and
//   stores L_Ip over tile (I, p), then applies panel p - 1 to its tiles (I, J), p < J <= I,
//   in place; for I = p, W keeps L_pp in registers and stores it at the start of phase p + 1
//   (other warps read tile (p, p) during phase p), or at once in the last phase;
// - one barrier (__syncthreads_or, which also tells every thread about a failed pivot).
// Writes in phase p: tile (p-1, p-1), tiles (I, J) with p <= J <= I, I > p, each by its
// owner; reads of other warps' tiles: (p, p) and column p - 1, which nobody writes then.
__device__ bool cholesky_in_place(double* T, int ld, int n) {
    int warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    int nt = (n + 7) / 8;
    double h0 = 0.0, h1 = 0.0;  // L_pp of the warp owning row tile p, for phase p + 1
    for (int p = 0; p < nt; ++p) {
        if (p > 0 && (p - 1) % nwarp == warp) store_tile(T, ld, p - 1, p - 1, h0, h1, true);
        bool ok = true;
        for (int I = warp; I < nt; I += nwarp) {
            if (I < p) continue;
            double d0, d1, a0 = 0.0, a1 = 0.0;
            load_tile(T, ld, n, p, p, d0, d1);
            if (p > 0) minus_outer(T, ld, p, p, p - 1, d0, d1);
            if (I > p) {
                load_tile(T, ld, n, I, p, a0, a1);
                if (p > 0) minus_outer(T, ld, I, p, p - 1, a0, a1);
            }
            ok = panel_sweep(d0, d1, a0, a1, n - 8 * p) && ok;
            if (I > p) {
                store_tile(T, ld, I, p, a0, a1, false);
                for (int J = p + 1; p > 0 && J <= I; ++J) {
                    load_tile(T, ld, n, I, J, a0, a1);
                    minus_outer(T, ld, I, J, p - 1, a0, a1);
                    store_tile(T, ld, I, J, a0, a1, false);
                }
            } else {
                h0 = d0;
                h1 = d1;
                if (p == nt - 1) store_tile(T, ld, p, p, h0, h1, true);
            }
        }
        if (__syncthreads_or(!ok)) return false;
    }
    return true;
}

// X <- L^-1 X on column tile J of X, from row panel p0 on (the rows above it are zero or
// already solved), for the lower L of cholesky_in_place; one warp, no block barrier. Per
// panel p, in the accumulator layout (lane (g, t) holds row g, columns 2t, 2t + 1 of tile
// (p, J)): for r = 0..7 the lanes of row r scale it by 1 / L_rr, and the lanes of the rows
// below take it by shuffles and subtract L_gr times it; then the lanes store tile (p, J),
// each its own elements, and the warp subtracts L_Ip X_pJ from every tile (I, J) below by MMA.
// Rows >= n come out zero (their pivot is taken as infinite), whatever finite values they held.
__device__ void solve_column_tile(const double* L, double* X, int ld, int n, int J, int p0) {
    int lane = lane_id(), g = lane >> 2, t = lane & 3;
    int nt = (n + 7) / 8;
    for (int p = p0; p < nt; ++p) {
        double* Xp = X + (8 * p + g) * ld + 8 * J + 2 * t;
        const double* Lg = L + (8 * p + g) * ld + 8 * p;
        double c0 = Xp[0], c1 = Xp[1];
        double inv = 8 * p + g < n ? 1.0 / Lg[g] : 0.0;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            if (g == r) {
                c0 *= inv;
                c1 *= inv;
            }
            double x0 = __shfl_sync(0xffffffffu, c0, 4 * r + t);
            double x1 = __shfl_sync(0xffffffffu, c1, 4 * r + t);
            if (g > r) {
                double l = Lg[r];
                c0 -= l * x0;
                c1 -= l * x1;
            }
        }
        Xp[0] = c0;
        Xp[1] = c1;
        __syncwarp();
        // tiles I and I + 1 share X_pJ: one m16n8k4 per step for both
        for (int I = p + 1; I < nt; I += 2) {
            bool pair = I + 1 < nt;
            double* Xi = X + (8 * I + g) * ld + 8 * J + 2 * t;
            double e0 = Xi[0], e1 = Xi[1], f0 = 0.0, f1 = 0.0;
            if (pair) {
                f0 = Xi[8 * ld];
                f1 = Xi[8 * ld + 1];
            }
#pragma unroll
            for (int k0 = 0; k0 < 8; k0 += 4) {
                const double* Li = L + (8 * I + g) * ld + 8 * p + k0 + t;
                double a0 = Li[0], a1 = pair ? Li[8 * ld] : 0.0;
                double b = X[(8 * p + k0 + t) * ld + 8 * J + g];
                mma16x8x4(e0, e1, f0, f1, -a0, -a1, b);
            }
            Xi[0] = e0;
            Xi[1] = e1;
            if (pair) {
                Xi[8 * ld] = f0;
                Xi[8 * ld + 1] = f1;
            }
        }
        __syncwarp();
    }
}

// X <- L^-1 X for the n x n lower L of cholesky_in_place (in L) and the right-hand sides in
// the first `ncol` columns of X (rows up to 8 ceil(n / 8); the rows >= n come out zero):
// each warp solves whole column tiles on its own, so one barrier, at the end. The caller
// orders the writes of L and X before the call.
__device__ void lower_solve(const double* L, double* X, int ld, int n, int ncol) {
    int warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    for (int J = warp; 8 * J < ncol; J += nwarp) solve_column_tile(L, X, ld, n, J, 0);
    __syncthreads();
}

// X = L^-1 for the lower L of cholesky_in_place in T (X zero outside the lower n x n block,
// over its first 8 ceil(n / 8) rows and columns): warp w writes the identity into its
// column tiles J and solves them from panel J on (L^-1 is lower triangular); one barrier.
__device__ void lower_inverse(const double* T, double* X, int ld, int n) {
    int lane = lane_id(), warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    int nt = (n + 7) / 8;
    for (int J = warp; J < nt; J += nwarp) {
        for (int idx = lane; idx < 64 * nt; idx += 32) {
            int i = idx >> 3, j = 8 * J + (idx & 7);
            X[i * ld + j] = (i == j && i < n) ? 1.0 : 0.0;
        }
        __syncwarp();
        solve_column_tile(T, X, ld, n, J, J);
    }
    __syncthreads();
}

// Calls f(i, j) for every element of a rows x cols block, a warp per row and a lane per
// column: no integer division per element, and consecutive lanes at consecutive addresses.
template <typename F>
__device__ __forceinline__ void for_each_element(int rows, int cols, F f) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    for (int i = warp; i < rows; i += nwarp)
        for (int j = lane; j < cols; j += 32) f(i, j);
}

// Entries of a vector per lane when one warp holds it whole (N <= 8 SPEX_TILES).
#define SPEX_VEC_PER_LANE ((8 * SPEX_TILES + 31) / 32)

// v <- L^-T L^-1 v (n entries) for the lower L of cholesky_in_place, which also becomes the
// upper triangle of the block (mirrored, so that both substitutions read rows of it). The
// block mirrors L, then warp 0 substitutes alone: lane l holds v[l + 32 q] in registers, and
// each column costs one shuffle, which hands its solved entry to every lane, and one update
// per lane, without barriers (by panels, with two barriers each, the solve took 40% of the
// Schur combine). The caller orders the writes of L and v before the call; the result is in
// v for every thread on return.
__device__ void cholesky_solve_vector(double* L, double* v, int ld, int n) {
    for_each_element(n, n, [&](int i, int j) {
        if (j > i) L[i * ld + j] = L[j * ld + i];
    });
    __syncthreads();
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        double x[SPEX_VEC_PER_LANE], inv[SPEX_VEC_PER_LANE];
#pragma unroll
        for (int q = 0; q < SPEX_VEC_PER_LANE; ++q) {
            int i = lane + 32 * q;
            x[q] = i < n ? v[i] : 0.0;
            inv[q] = i < n ? 1.0 / L[i * ld + i] : 0.0;
        }
        // L y = v: y_j to every lane, which subtracts L_ij y_j (row j of the mirror, i > j)
#pragma unroll
        for (int q = 0; q < SPEX_VEC_PER_LANE; ++q)
            for (int jj = 0; jj < 32 && 32 * q + jj < n; ++jj) {
                int j = 32 * q + jj;
                double yj = __shfl_sync(0xffffffffu, x[q] * inv[q], jj);
                if (lane == jj) x[q] = yj;
                const double* row = L + j * ld;
#pragma unroll
                for (int r = q; r < SPEX_VEC_PER_LANE; ++r) {
                    int i = lane + 32 * r;
                    if (i > j && i < n) x[r] -= row[i] * yj;
                }
            }
        // L^T x = y: x_j to every lane, which subtracts L_ji x_j (row j of L, i < j)
#pragma unroll
        for (int q = SPEX_VEC_PER_LANE - 1; q >= 0; --q)
            for (int jj = 31; jj >= 0; --jj) {
                int j = 32 * q + jj;
                if (j >= n) continue;
                double xj = __shfl_sync(0xffffffffu, x[q] * inv[q], jj);
                if (lane == jj) x[q] = xj;
                const double* row = L + j * ld;
#pragma unroll
                for (int r = 0; r <= q; ++r) {
                    int i = lane + 32 * r;
                    if (i < j) x[r] -= row[i] * xj;
                }
            }
#pragma unroll
        for (int q = 0; q < SPEX_VEC_PER_LANE; ++q)
            if (lane + 32 * q < n) v[lane + 32 * q] = x[q];
    }
    __syncthreads();
}

// Loads of a block from global memory in flight per thread before the first is stored.
#define SPEX_LOADS 8

// Reads the n x n block at src (row-major, rows `stride` apart) and calls put(i, j, value)
// for each element: every thread first issues SPEX_LOADS loads, then stores them, so that a
// block's load costs a few memory latencies instead of one per element a thread handles.
template <typename F>
__device__ __forceinline__ void load_block(const double* __restrict__ src, size_t stride, int n,
                                           F put) {
    int nth = blockDim.x, count = n * n;
    for (int base = threadIdx.x; base < count; base += SPEX_LOADS * nth) {
        double r[SPEX_LOADS];
#pragma unroll
        for (int u = 0; u < SPEX_LOADS; ++u) {
            int idx = base + u * nth;
            if (idx < count) {
                int i = idx / n;
                r[u] = src[i * stride + (idx - i * n)];
            }
        }
#pragma unroll
        for (int u = 0; u < SPEX_LOADS; ++u) {
            int idx = base + u * nth;
            if (idx < count) {
                int i = idx / n;
                put(i, idx - i * n, r[u]);
            }
        }
    }
}

// Frobenius norm of the n x n block of M (lower triangle only when `lower`).
__device__ double frobenius(const double* M, int ld, int n, bool lower, double* red) {
    double s = 0.0;
    for_each_element(n, n, [&](int i, int j) {
        if (!lower || j <= i) s += M[i * ld + j] * M[i * ld + j];
    });
    return sqrt(block_sum(s, red));
}

