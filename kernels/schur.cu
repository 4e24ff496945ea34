// Steps 2-3 of the solve by per-fiber Schur complements: a patch's icov is block-tridiagonal
// in fiber order (neighbouring fibers couple through their stamps' overlap, second neighbours
// only through stamp tails, ~1e-14 relative), so two block sweeps give what the extraction
// needs without the full inverse:
// - from the left, Sigma_0 = A_00 and, with Sigma_k = L L^T, W = A_{k+1,k} L^-T, z = L^-1 r_k:
//   Sigma_{k+1} = A_{k+1,k+1} - W W^T and r_{k+1} = y_{k+1} - W z; from the right the mirror;
// - for every block b, S_b = A_bb - (W W^T from the left) - (from the right) is the Schur
//   complement of the block, S_b = C_bb^-1 with C = icov^-1, and
//   xflux_b = S_b^-1 (y_b - (W z from the left) - (from the right)).
// The sweeps store those contributions and the combine kernel sums them: the vectors in
// u[p][dir][k] (n), the matrices only for the core fibers, straight into the buffers where the
// combine leaves S_b (from the left) and its factor (from the right). Only the core fibers
// need S_b: a patch's other fibers are padding fibers at its ends, and a padding fiber e needs
// only its flux, which its block row gives once its one neighbour c has its own:
// x_e = A_ee^-1 (y_e - A_ec x_c). So neither sweep steps onto a padding fiber at its far end,
// which saves a step in each direction on most patches. The second-neighbour blocks the
// sweeps drop are measured per patch, so that the host can send a patch whose coupling is not
// negligible to the dense route.
//
// A patch's blocks are stored padding fibers first, then the core (and empty leading blocks
// where it has fewer fibers than the widest patch), which is not their order along the CCD:
// the sweeps and the coupling check walk the blocks in fiber order, taken from the column
// table (a block's first spot index grows with its fiber; empty blocks, -1, come first and
// couple to nothing).
//
// icov comes in band storage (kernels/common.cuh): each fiber block's rows hold the block
// itself (its upper half), its coupling to the next fiber along the CCD and to the one after.
// A coupling block lies in the rows of the fiber that comes first along the CCD: a sweep from
// the left reads it as it is, one from the right transposed. Blocks are read row-wise,
// consecutive threads at consecutive addresses, and written transposed or mirrored into
// shared memory (a sweep's coupling blocks are copied as stored, asynchronously, and
// transposed in shared memory where needed).

#include "common.cuh"
#include "tiles.cuh"

// Slot `slot` of fiber block b's rows in patch p's band-stored icov (rows band_row(n) apart):
// 0 the diagonal block, 1 the coupling to the next fiber along the CCD, 2 to the one after.
__device__ __forceinline__ const double* band_block(const double* icov, size_t p, int m, int n,
                                                    int b, int slot) {
    return icov + (p * m + (size_t)b * n) * band_row(n) + (size_t)slot * n;
}

// Diagonal block (b, b) of patch p's icov into D (n x n, leading dimension ld), both halves:
// the stored half j >= i read row-wise, each element also written to its mirror (i, j) ->
// (j, i). Every D[i][j] (i, j < n) is written by exactly one thread; nothing else of D.
// (Batching these loads, as polar.cu does, made the sweeps slower: they wait on shared
// memory and barriers, not on these loads.)
__device__ void load_diagonal_block(const double* icov, size_t p, int m, int n, int b, double* D,
                                    int ld) {
    const double* a = band_block(icov, p, m, n, b, 0);
    int lda = band_row(n);
    for_each_element(n, n, [&](int i, int j) {
        if (j < i) return;
        D[i * ld + j] = a[(size_t)i * lda + j];
        D[j * ld + i] = a[(size_t)i * lda + j];
    });
}

// D <- A - D for the n x n symmetric block A of which `a` holds the upper half (rows lda
// apart); the thread of (i, j), j >= i, updates both (i, j) and (j, i).
__device__ void subtract_from_block(const double* a, int lda, double* D, int ld, int n) {
    for_each_element(n, n, [&](int i, int j) {
        if (j < i) return;
        double v = a[i * lda + j];
        D[i * ld + j] = v - D[i * ld + j];
        if (j != i) D[j * ld + i] = v - D[j * ld + i];
    });
}

// Slot `slot` of fiber block b's rows in patch p's icov (n x n, as stored; of a diagonal
// block, slot 0, only the stored upper half) into D (leading dimension ld), without waiting
// for it: asynchronous copies on sm_80 and later, which `copy_wait` completes for the calling
// thread (a barrier then shows D to the block); plain ones before.
__device__ __forceinline__ void copy_block_async(const double* icov, size_t p, int m, int n,
                                                 int b, int slot, double* D, int ld) {
    const double* src = band_block(icov, p, m, n, b, slot);
    int lda = band_row(n);
    for_each_element(n, n, [&](int a, int c) {
        if (slot == 0 && c < a) return;
#if __CUDA_ARCH__ >= 800
        unsigned dst = (unsigned)__cvta_generic_to_shared(D + a * ld + c);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst),
                     "l"(src + (size_t)a * lda + c));
#else
        D[a * ld + c] = src[(size_t)a * lda + c];
#endif
    });
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits for the calling thread's copies of copy_block_async.
__device__ __forceinline__ void copy_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::);
#endif
}

// One block per (patch, direction): blockIdx.y = 0 sweeps from the left, 1 from the right, over
// the nb fiber blocks of order n in fiber order (`colspot`, m per patch), the last ncore of
// them in storage order being the core. A sweep starts at its end's first fiber and stops
// short of the other end where that is a padding fiber: the complement of a padding fiber at
// an end is never needed (schur_end_flux_f64 gives its flux), and empty blocks couple to
// nothing. A core block's update W W^T goes to `upd[dir]`'s block (p ncore + c) n^2 (c its
// index in the core), zero where the sweep starts on it. Where a sweep starts on a padding
// fiber, its first step's factor chol(A_ee) goes to `ends[(2 p + dir) n^2]` for
// schur_end_flux_f64. `info[p]` is set to 1 when a Sigma is not positive definite;
// direction 0 also writes `coupling[p]`, the largest |A_ij| / sqrt(A_ii A_jj) over blocks two
// fibers apart (band slot 2). Blocks three or more fibers apart are not stored: where their
// spots (nx columns wide, corners `corners[2 sid]`) could overlap, the coupling is +inf, which
// sends the patch to the dense solve on the CPU (DESI's stamps reach two fibers, not three).
//
// Shared memory (dynamic): S[N ld] (Sigma, then W W^T), W[N ld] ([W; z^T]^T), r[n],
// red[32], ord[nb]; N = n + 1 rounded up to 8, ld = N + 4; 4 N threads.
//
// Registers: at most 96, so that two blocks of 320 threads (n <= 79) share an SM as their
// shared memory allows (left to the compiler, it takes ~128). Capped, it spilled nothing on
// sm_80 and sm_90 until it stored the first step's factor (20 bytes on sm_90, about 0.1 ms per
// frame on an H100, where schur_end_flux_f64 factorising A_ee itself took 0.9 ms more); with
// band storage and the core updates stored apart it spills 40 bytes on sm_90, none on sm_80.
extern "C" __global__ void SPEX_MAX_REGS(96) schur_sweep_f64(const double* __restrict__ icov,
                                           const double* __restrict__ y,
                                           const int* __restrict__ patch_ids,
                                           const int* __restrict__ colspot,
                                           const int* __restrict__ corners, int nx, int m, int n,
                                           int nb, int ncore, double* __restrict__ upd_left,
                                           double* __restrict__ upd_right,
                                           double* __restrict__ ends, double* __restrict__ u,
                                           int* __restrict__ info, double* __restrict__ coupling) {
    extern __shared__ double sm[];
    SPEX_PHASE_START
    int N = (n + 8) / 8 * 8, ld = N + 4;
    double* S = sm;
    double* W = S + N * ld;
    double* r = W + N * ld;
    double* red = r + n;
    int* ord = (int*)(red + 32);
    int tid = threadIdx.x, nth = blockDim.x;
    int dir = blockIdx.y;
    int pid = patch_of(patch_ids, blockIdx.x);
    if (pid < 0) return;
    size_t p = pid;
    const double* yp = y + p * m;
    // ord[k]: the block at position k along the CCD (a stable sort by first spot index), the
    // nempty empty blocks first
    int key = -1;
    if (tid < nb) {
        const int* cs = colspot + p * m;
        int pos = 0;
        key = cs[tid * n];
        for (int b = 0; b < nb; ++b) {
            int kb = cs[b * n];
            pos += kb < key || (kb == key && b < tid);
        }
        ord[pos] = tid;
    }
    int nempty = __syncthreads_count(tid < nb && key < 0);
    // This direction's start k0 and number of steps: from its end's first fiber to the other
    // end, or to the fiber before it where that is a padding fiber. Kept in shared memory, and
    // read from there: held in registers across the steps, they made the kernel spill more.
    __shared__ int steps[3];  // k0, steps, whether k0 is a padding fiber
    if (tid == 0) {
        int first = min(nempty, nb - 1), last = nb - 1;
        bool first_pad = ord[first] < nb - ncore, last_pad = ord[last] < nb - ncore;
        steps[0] = dir == 0 ? first : last;
        steps[1] = last - first - ((dir == 0 ? last_pad : first_pad) && last > first ? 1 : 0);
        steps[2] = dir == 0 ? first_pad : last_pad;
    }

    if (dir == 0 && nb > 2) {
        // 1 / sqrt of icov's diagonal in W (free until the sweep starts), then the CCD columns
        // of each block's spot corners, lowest and highest: two blocks whose corners are nx
        // or more columns apart have no overlapping spots (an empty block has none: its range
        // is empty)
        int* xr = (int*)(W + nb * n);
        int lane = tid & 31, warp = tid >> 5, nwarp = nth >> 5, lda = band_row(n);
        for (int i = tid; i < nb * n; i += nth)
            W[i] = rsqrt(fmax(band_block(icov, p, m, n, i / n, 0)[(size_t)(i % n) * (lda + 1)], 1e-300));
        for (int b = warp; b < nb; b += nwarp) {
            int lo = 1 << 28, hi = -(1 << 28);
            for (int w = lane; w < n; w += 32) {
                int sid = colspot[p * m + (size_t)b * n + w];
                if (sid >= 0) {
                    lo = min(lo, corners[2 * sid]);
                    hi = max(hi, corners[2 * sid]);
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
                hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
            }
            if (lane == 0) {
                xr[2 * b] = lo;
                xr[2 * b + 1] = hi;
            }
        }
        __syncthreads();
        // fibers two apart along the CCD (positions k, k + 2, empty blocks first) through the
        // first one's rows, slot 2: a warp per row, a lane per column, several rows' loads in
        // flight
        double worst = 0.0;
#pragma unroll 4
        for (int row = warp; row < max(nb - 2 - nempty, 0) * n; row += nwarp) {
            int k = nempty + row / n, i = row % n;
            int e = ord[k], l = ord[k + 2];
            const double* a = band_block(icov, p, m, n, e, 2) + (size_t)i * lda;
            double wi = W[e * n + i];
            for (int j = lane; j < n; j += 32) worst = fmax(worst, fabs(a[j]) * wi * W[l * n + j]);
        }
        // fibers three or more apart, not stored
        for (int q = tid; q < nb * nb; q += nth) {
            int k = q / nb, l = q % nb;
            if (k < nempty || l < k + 3) continue;
            int e = ord[k], f = ord[l];
            if (xr[2 * f] - xr[2 * e + 1] < nx && xr[2 * e] - xr[2 * f + 1] < nx) worst = __longlong_as_double(0x7ff0000000000000LL);  // +inf
        }
        worst = block_max(worst, red);
        if (tid == 0) coupling[p] = worst;
    } else if (dir == 0 && tid == 0) {
        coupling[p] = 0.0;
    }
    SPEX_PHASE(16);
    __syncthreads();
    int k = steps[0], bk = ord[k];
    // the first coupling block on its way into W while the first Sigma is set up and factorised
    if (steps[1] > 0) {
        int b1 = ord[dir == 0 ? k + 1 : k - 1];
        copy_block_async(icov, p, m, n, dir == 0 ? bk : b1, 1, W, ld);
    }
    for_each_element(N, ld, [&](int i, int j) {
        if (i >= n || j >= n) S[i * ld + j] = 0.0;
    });
    load_diagonal_block(icov, p, m, n, bk, S, ld);
    if (bk >= nb - ncore) {
        double* U0 = (dir == 0 ? upd_left : upd_right) + (p * ncore + bk - (nb - ncore)) * n * n;
        for (int idx = tid; idx < n * n; idx += nth) U0[idx] = 0.0;
    }
    for (int i = tid; i < n; i += nth) {
        r[i] = yp[(size_t)bk * n + i];
        u[((p * 2 + dir) * nb + bk) * n + i] = 0.0;
    }
    __syncthreads();
    SPEX_PHASE(17);
    double acc[SPEX_TILES][2];
    for (int s = 0; s < steps[1]; ++s) {
        int kn = dir == 0 ? k + 1 : k - 1, bn = ord[kn];
        if (!cholesky_in_place(S, ld, n)) {
            copy_wait();
            if (tid == 0) info[p] = 1;
            return;
        }
        if (s == 0 && steps[2]) {
            double* L = ends + (p * 2 + dir) * n * n;
            for_each_element(n, n, [&](int i, int j) { L[i * n + j] = j <= i ? S[i * ld + j] : 0.0; });
        }
        SPEX_PHASE(18);
        // V = [A_{kn,k}; r^T]^T in W (n rows, n + 1 columns; icov is symmetric, so row j of V
        // is row j of A_{k,kn}), then V <- L^-1 V, so that V^T = [W; z^T]. A_{k,kn} came as
        // stored (copy_block_async, queued a step earlier) in the rows of the fiber first along
        // the CCD: V itself from the left, its transpose from the right.
        copy_wait();
        __syncthreads();
        if (dir == 1)
            for_each_element(n, n, [&](int a, int c) {
                if (a >= c) return;
                double t = W[a * ld + c];
                W[a * ld + c] = W[c * ld + a];
                W[c * ld + a] = t;
            });
        for_each_element(N, ld, [&](int j, int i) {
            if (j < n && i < n) return;
            W[j * ld + i] = (j < n && i == n) ? r[j] : 0.0;
        });
        __syncthreads();
        SPEX_PHASE(19);
        lower_solve(S, W, ld, n, n + 1);
        SPEX_PHASE(20);
        // S <- V^T V: columns 0..n-1 the update W W^T of Sigma, column n that of r, W z
        tile_row_tn(W, W, ld, N, acc);
        store_rows(S, ld, N, acc);
        __syncthreads();
        // W is free: the next diagonal block comes in while this step's U is stored
        copy_block_async(icov, p, m, n, bn, 0, W, ld);
        SPEX_PHASE(21);
        size_t o = (p * 2 + dir) * nb + bn;
        if (bn >= nb - ncore) {
            double* U = (dir == 0 ? upd_left : upd_right) + (p * ncore + bn - (nb - ncore)) * n * n;
            for_each_element(n, n, [&](int i, int j) { U[i * n + j] = S[i * ld + j]; });
        }
        for (int i = tid; i < n; i += nth) {
            double g = S[i * ld + n];
            u[o * n + i] = g;
            r[i] = yp[(size_t)bn * n + i] - g;
        }
        copy_wait();
        __syncthreads();
        SPEX_PHASE(22);
        subtract_from_block(W, ld, S, ld, n);
        for (int i = tid; i < N; i += nth) S[i * ld + n] = 0.0;
        __syncthreads();
        // and the next step's coupling block while the next Sigma is factorised
        if (s + 1 < steps[1]) {
            int bnn = ord[dir == 0 ? kn + 1 : kn - 1];
            copy_block_async(icov, p, m, n, dir == 0 ? bn : bnn, 1, W, ld);
        }
        SPEX_PHASE(23);
        k = kn;
        bk = bn;
    }
}

// One block per (fiber block b, patch): S_b and xflux_b of the core fibers from the sweeps'
// contributions; the other blocks are padding fibers at the ends of the patch
// (schur_end_flux_f64 gives their flux) or empty (flux zero, written here). Block (p ncore +
// c) n^2 (c the index in the core) of `sblocks` holds the update from the left and of
// `factors` that from the right; S_b replaces the first (row-major) for the decorrelation, its
// Cholesky factor G (lower, zero above the diagonal) the second, so that the polar kernel need
// not factorise S_b again; xflux goes to `x[p * m + b * n]`. `info[p]` is set to 1 when S_b
// is not positive definite.
//
// Shared memory (dynamic): T[N ld] (only its n x n block is written before the factorisation,
// which reads nothing else), v[n]; N = n rounded up to 8, ld = N + 4; 4 N threads.
// Registers: at most 48 (some 66 bytes spill), so that four blocks share an SM as their
// shared memory allows, instead of three at 64 (the combine takes 0.7 ms less per frame on an
// H100).
extern "C" __global__ void SPEX_MAX_REGS(48) schur_combine_f64(
    const double* __restrict__ icov, const double* __restrict__ y,
    const int* __restrict__ patch_ids, const int* __restrict__ colspot, int m, int n, int nb,
    int ncore, const double* __restrict__ u, double* sblocks, double* factors,
    double* __restrict__ x, int* __restrict__ info) {
    extern __shared__ double sm[];
    SPEX_PHASE_START
    int N = (n + 7) / 8 * 8, ld = N + 4;
    double* T = sm;
    double* v = T + N * ld;
    int tid = threadIdx.x, nth = blockDim.x;
    int b = blockIdx.x;
    int pid = patch_of(patch_ids, blockIdx.y);
    if (pid < 0) return;
    size_t p = pid;
    int c = b - (nb - ncore);
    if (c < 0) {
        if (colspot[p * m + (size_t)b * n] < 0)
            for (int i = tid; i < n; i += nth) x[p * m + (size_t)b * n + i] = 0.0;
        return;
    }
    // each element of the updates is read, then overwritten, by one thread
    double* so = sblocks + (p * ncore + c) * n * n;
    double* fo = factors + (p * ncore + c) * n * n;
    load_diagonal_block(icov, p, m, n, b, T, ld);
    __syncthreads();
    for_each_element(n, n, [&](int i, int j) {
        double s = T[i * ld + j] - so[i * n + j] - fo[i * n + j];
        T[i * ld + j] = s;
        so[i * n + j] = s;
    });
    for (int i = tid; i < n; i += nth)
        v[i] = y[p * m + (size_t)b * n + i] - u[((p * 2 + 0) * nb + b) * n + i] -
               u[((p * 2 + 1) * nb + b) * n + i];
    __syncthreads();
    SPEX_PHASE(32);
    if (!cholesky_in_place(T, ld, n)) {
        if (tid == 0) info[p] = 1;
        return;
    }
    for_each_element(n, n, [&](int i, int j) { fo[i * n + j] = j <= i ? T[i * ld + j] : 0.0; });
    SPEX_PHASE(33);
    // v <- L^-T L^-1 v
    cholesky_solve_vector(T, v, ld, n);
    for (int i = tid; i < n; i += nth) x[p * m + (size_t)b * n + i] = v[i];
    SPEX_PHASE(34);
}

// One block per (patch, end): blockIdx.y = 0 the first fiber along the CCD, 1 the last. Where
// that fiber e is not core, its flux from the block row of e in the block-tridiagonal system
// the sweeps solve, x_e = A_ee^-1 (y_e - A_ec x_c), with c its one neighbour (whose flux the
// combine gave), A_ee = L L^T the factor that the sweep starting at e left in
// `factors[(2 p + dir) n^2]` (and checked).
//
// Shared memory (dynamic): T[N ld], v[n]; N = n rounded up to 8, ld = N + 4; 4 N threads.
extern "C" __global__ void schur_end_flux_f64(const double* __restrict__ icov,
                                              const double* __restrict__ y,
                                              const int* __restrict__ patch_ids,
                                              const int* __restrict__ colspot, int m, int n,
                                              int nb, int ncore,
                                              const double* __restrict__ factors,
                                              double* __restrict__ x) {
    extern __shared__ double sm[];
    __shared__ int ends[2];
    int ld = (n + 7) / 8 * 8 + 4;
    double* T = sm;
    double* v = T + ((n + 7) / 8 * 8) * ld;
    int tid = threadIdx.x, nth = blockDim.x, dir = blockIdx.y;
    int pid = patch_of(patch_ids, blockIdx.x);
    if (pid < 0) return;
    size_t p = pid;
    const int* cs = colspot + p * m;
    // the end fiber e and its neighbour c (-1 where there is none), in storage order
    if (tid == 0) {
        int e = -1, c = -1, ke = 0, kc = 0;
        for (int b = 0; b < nb; ++b) {
            int kb = cs[b * n];
            if (kb < 0) continue;
            bool before_e = e < 0 || (dir == 0 ? kb < ke : kb > ke);
            bool before_c = c < 0 || (dir == 0 ? kb < kc : kb > kc);
            if (before_e) {
                c = e;
                kc = ke;
                e = b;
                ke = kb;
            } else if (before_c) {
                c = b;
                kc = kb;
            }
        }
        ends[0] = e;
        ends[1] = c;
    }
    __syncthreads();
    int e = ends[0], c = ends[1];
    if (e < 0 || e >= nb - ncore) return;
    load_block(factors + (p * 2 + dir) * n * n, n, n,
               [&](int i, int j, double a) { T[i * ld + j] = a; });
    // v = y_e - A_ec x_c, a warp per row; A_ec as stored in the first fiber's rows (e's from
    // the left end, c's from the right)
    int lane = tid & 31, warp = tid >> 5, nwarp = nth >> 5, lda = band_row(n);
    for (int i = warp; i < n; i += nwarp) {
        double s = 0.0;
        if (c >= 0)
            for (int j = lane; j < n; j += 32) {
                double a = dir == 0 ? band_block(icov, p, m, n, e, 1)[(size_t)i * lda + j]
                                    : band_block(icov, p, m, n, c, 1)[(size_t)j * lda + i];
                s += a * x[p * m + (size_t)c * n + j];
            }
        s = warp_sum(s);
        if (lane == 0) v[i] = y[p * m + (size_t)e * n + i] - s;
    }
    __syncthreads();
    cholesky_solve_vector(T, v, ld, n);
    for (int i = tid; i < n; i += nth) x[p * m + (size_t)e * n + i] = v[i];
}

// The retry list of a wave (DESIGN step 2), drawn up on the device so that the host need not
// wait for the sweeps' verdicts: the first `capacity` patches, in order, whose sweeps failed
// (`info`) and that have weight (`masked` 0) go to `ids`, padded with -1, and their verdicts
// are cleared for the second sweep; every patch's first verdict is kept in `first`. Failures
// beyond the capacity keep their verdict, which sends them to the CPU reference. One block of
// whole warps.
extern "C" __global__ void schur_retry_list(int* __restrict__ info, const int* __restrict__ masked,
                                            int n, int capacity, int* __restrict__ first,
                                            int* __restrict__ ids) {
    __shared__ int counts[32];
    __shared__ int base;
    int tid = threadIdx.x, lane = tid % SPEX_WARP, warp = tid / SPEX_WARP;
    int nwarp = blockDim.x / SPEX_WARP;
    if (tid == 0) base = 0;
    __syncthreads();
    for (int start = 0; start < n; start += blockDim.x) {
        int p = start + tid;
        int v = p < n ? info[p] : 0;
        bool failed = p < n && v != 0 && masked[p] == 0;
        if (p < n) first[p] = v;
        unsigned ballot = __ballot_sync(0xffffffffu, failed);
        if (lane == 0) counts[warp] = __popc(ballot);
        __syncthreads();
        int pos = base + __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) pos += counts[w];
        if (failed && pos < capacity) {
            ids[pos] = p;
            info[p] = 0;
        }
        __syncthreads();
        if (tid == 0)
            for (int w = 0; w < nwarp; ++w) base += counts[w];
        __syncthreads();
    }
    for (int i = base + tid; i < capacity; i += blockDim.x) ids[i] = -1;
}
