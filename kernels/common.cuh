// Shared helpers of the spex kernels. Every kernel works in f64 and on batches of patches.
//
// Conventions shared with the host (src/backend/cuda/solve.rs):
// - a spot id `sid` indexes `spots[sid * ny * nx ...]` (row-major ny x nx) and
//   `corners[2 sid], corners[2 sid + 1]` (CCD column and row of its lower-left pixel);
// - a patch has `m` unknowns; `colspot[p * m + j]` is the spot of column j or -1 for a
//   column of an unused padding block (a zero column); a fiber block's columns have
//   consecutive spots (one fiber, consecutive wavelengths);
// - `boxes[4 p ..]` = row0, row1, col0, col1 of the patch's pixel box on the CCD;
// - the pixels of the CCD region on the device start at (sub_row0, sub_col0), `sub_w` wide.

#pragma once

// The block reductions below assume 1-D blocks of a whole number of warps.

#define SPEX_WARP 32

// Phase clocks for the kernel harness (benches/kernels): with SPEX_PHASE_CLOCK defined, thread 0
// of every block adds the cycles since its previous mark to spex_phase_cycles[k], so that the
// harness can say where a kernel's time goes; without it the marks compile to nothing.
#ifdef SPEX_PHASE_CLOCK
__device__ unsigned long long spex_phase_cycles[64];
#define SPEX_PHASE_START long long spex_phase_t = clock64();
#define SPEX_PHASE(k)                                                                     \
    do {                                                                                  \
        if (threadIdx.x == 0) {                                                           \
            long long spex_now = clock64();                                               \
            atomicAdd(&spex_phase_cycles[k], (unsigned long long)(spex_now - spex_phase_t)); \
            spex_phase_t = spex_now;                                                      \
        }                                                                                 \
    } while (0)
#else
#define SPEX_PHASE_START
#define SPEX_PHASE(k)
#endif

// Sum of `v` over the block; every thread gets the result. `scratch` holds one double per warp.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
    for (int o = SPEX_WARP / 2; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x % SPEX_WARP, warp = threadIdx.x / SPEX_WARP;
    int nwarp = (blockDim.x + SPEX_WARP - 1) / SPEX_WARP;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < nwarp; ++w) t += scratch[w];
    __syncthreads();
    return t;
}

// Maximum of `v` over the block; every thread gets the result.
__device__ __forceinline__ double block_max(double v, double* scratch) {
    for (int o = SPEX_WARP / 2; o > 0; o >>= 1) v = fmax(v, __shfl_down_sync(0xffffffffu, v, o));
    int lane = threadIdx.x % SPEX_WARP, warp = threadIdx.x / SPEX_WARP;
    int nwarp = (blockDim.x + SPEX_WARP - 1) / SPEX_WARP;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = scratch[0];
    for (int w = 1; w < nwarp; ++w) t = fmax(t, scratch[w]);
    __syncthreads();
    return t;
}

__device__ __forceinline__ double warp_sum(double v) {
    for (int o = SPEX_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Row and column of the elements first, first + stride, ... of a row-major array `width`
// wide, stepped with one integer division at the start instead of one per element (the
// divisions by a run-time width cost the spot and chi2pix kernels more instructions than
// their arithmetic): `next()` moves to the following element.
struct StridedWalk {
    int row, col, srow, scol, width;
    __device__ __forceinline__ StridedWalk(int first, int stride, int width_) : width(width_) {
        row = first / width;
        col = first - row * width;
        srow = stride / width;
        scol = stride - srow * width;
    }
    __device__ __forceinline__ void next() {
        col += scol;
        row += srow;
        if (col >= width) {
            col -= width;
            row += 1;
        }
    }
};

// The patch a block works on: an entry of `patch_ids` when given, else the block's own index.
// A list built on the device (the retry's) is padded with -1: blocks given -1 have nothing to
// do and return at once.
__device__ __forceinline__ int patch_of(const int* patch_ids, int i) {
    return patch_ids ? patch_ids[i] : i;
}

// Whether outlier rejection gave pixel (row, col) of patch p's box, `width` wide, weight zero:
// `rejected` holds a flag per pixel of every box, patch p's from `boxoff[p]` on; null when
// outliers are not rejected.
__device__ __forceinline__ unsigned char rejected_flag(const unsigned char* rejected,
                                                      const long long* boxoff, int p, int row,
                                                      int col, int width) {
    return rejected ? rejected[boxoff[p] + (size_t)row * width + col] : 0;
}

__device__ __forceinline__ bool rejected_pixel(const unsigned char* rejected,
                                               const long long* boxoff, int p, int row, int col,
                                               int width) {
    return rejected_flag(rejected, boxoff, p, row, col, width) != 0;
}

// Whether column j of a patch is one the outlier test looks at: the core fibers' bins but the
// outer half of the wavelength padding on each side (`tested_columns` in
// src/backend/cpu/reject.rs); the core fibers are the last `ncore` blocks of `nwavetot`
// columns of the m.
__device__ __forceinline__ bool tested_column(int j, int m, int nwavetot, int ncore,
                                              int wavepad) {
    int w = j % nwavetot;
    return j / nwavetot >= m / nwavetot - ncore && w >= wavepad / 2 &&
           w < nwavetot - wavepad / 2;
}

// Flags of a rejected pixel between tests (kernels/reject.cu has those within a test):
// rejected by the last test (SPEX_FRESH), whose terms a patch's next solve subtracts from its
// kept normal equations, or by one before it (SPEX_REJECTED). Any flag is weight zero.
#define SPEX_REJECTED 1
#define SPEX_FRESH 5

// Where a slot of the normal equations kept for a patch's next solve (`reject::kept`) holds
// each part: icov's stored rows (m x row_len), y, fluxweight and diag0 (m each), the masked
// weight of each core spot (nmask = ncore x nwavestep), as the assembly wrote them; then the
// pixels the test rejected, their number and up to SPEX_KEPT_LIST of them (row << 16 |
// column within the box; a longer list is not kept, and every column is downdated).
#define SPEX_KEPT_LIST 512
struct KeptLayout {
    int m, row_len, nmask;
    __device__ size_t y() const { return (size_t)m * row_len; }
    __device__ size_t fw() const { return y() + m; }
    __device__ size_t diag0() const { return y() + 2 * (size_t)m; }
    __device__ size_t pixmask() const { return y() + 3 * (size_t)m; }
    __device__ size_t fresh() const { return pixmask() + nmask; }
    __device__ size_t size() const { return fresh() + 1 + SPEX_KEPT_LIST; }
};

// icov's storage, written by kernels/assemble.cu. Only one triangle of the symmetric matrix is
// stored, each overlap computed once.
// - Dense (`band` 0, the dense route, for cuSOLVER): a patch's m x m matrix row-major, of row
//   j1 the entries j2 >= j1 (cuSOLVER's column-major lower triangle).
// - Band (`band` 1, the Schur route): a patch's block-tridiagonal part in fiber order along
//   the CCD, which is all the sweeps use, and the second neighbours' blocks, which the
//   coupling check measures. Row j1, of fiber block b, holds SPEX_BAND_BLOCKS blocks of n
//   entries: slot 0 block b itself (only its entries j2 >= j1), slot 1 the block of the next
//   fiber along the CCD, slot 2 the one after it (slots of fibers that do not exist are not
//   written). A patch takes SPEX_BAND_BLOCKS n m doubles instead of m^2, a quarter at DESI's
//   7 fibers. Element (R, C) of a block row is at row R, column slot * n + C % n.
#define SPEX_BAND_BLOCKS 3

// Doubles per row of a patch's band-stored icov (blocks of n).
__device__ __forceinline__ int band_row(int n) { return SPEX_BAND_BLOCKS * n; }

// Doubles per stored row of a patch's icov: m dense, band_row(n) in band storage.
__device__ __forceinline__ int icov_row_len(int band, int m, int n) {
    return band ? band_row(n) : m;
}

// The first spot of the fiber block that follows the block whose first spot is `key` along
// the CCD, -1 where there is none, for the calling warp (every lane gets it; nb <= 32): of the
// nb blocks of n columns of a patch (column table `cs`), the next larger first spot (spot
// indices grow with the fiber; empty blocks, -1, follow nothing and nothing follows them).
__device__ __forceinline__ int next_fiber_spot(const int* cs, int n, int nb, int key, int lane) {
    int kc = lane < nb ? cs[lane * n] : -1;
    int cand = key >= 0 && kc > key ? kc : 0x7fffffff;
    for (int o = SPEX_WARP / 2; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, o));
    return cand == 0x7fffffff ? -1 : cand;
}
