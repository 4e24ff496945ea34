// Shared helpers of the spex kernels. Every kernel works in f64 and on batches of patches.
//
// Conventions shared with the host (src/backend/cuda/solve.rs):
// - a spot id `sid` indexes `spots[sid * ny * nx ...]` (row-major ny x nx) and
//   `corners[2 sid], corners[2 sid + 1]` (CCD column and row of its lower-left pixel);
// - a patch has `m` unknowns; `colspot[p * m + j]` is the spot of column j or -1 for a
//   column of an unused padding block (a zero column);
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

// The patch a block works on: an entry of `patch_ids` when given, else the block's own index.
// A list built on the device (the retry's) is padded with -1: blocks given -1 have nothing to
// do and return at once.
__device__ __forceinline__ int patch_of(const int* patch_ids, int i) {
    return patch_ids ? patch_ids[i] : i;
}
