// Outlier rejection (`--reject-outliers`, src/backend/cuda/reject.rs): the pixels of each
// patch's box that the outlier test looks at. The test itself runs on the host, on the model
// boxes the finalize step projects (kernels/finalize.cu).

#include "common.cuh"

// One block per (column, patch), as project_f64: flags the box pixels where the spot of a
// tested column is positive. The tested columns are the core fibers' bins but the outer half
// of the wavelength padding on each side (`tested_columns` in src/backend/cpu/reject.rs); the
// core fibers are the last `ncore` blocks of `nwavetot` columns.
extern "C" __global__ void core_pixels(const double* __restrict__ spots,
                                       const int* __restrict__ corners,
                                       const int* __restrict__ colspot,
                                       const int* __restrict__ boxes,
                                       const long long* __restrict__ boxoff, int m, int nx,
                                       int ny, int nwavetot, int ncore, int wavepad,
                                       unsigned char* __restrict__ core) {
    int j = blockIdx.x, p = blockIdx.y;
    int nblk = m / nwavetot, b = j / nwavetot, w = j % nwavetot;
    if (b < nblk - ncore || w < wavepad / 2 || w >= nwavetot - wavepad / 2) return;
    int sid = colspot[(size_t)p * m + j];
    if (sid < 0) return;
    int r0 = boxes[4 * p], r1 = boxes[4 * p + 1], c0 = boxes[4 * p + 2], c1 = boxes[4 * p + 3];
    int width = c1 - c0;
    int xc = corners[2 * sid], yc = corners[2 * sid + 1];
    const double* a = spots + (size_t)sid * nx * ny;
    unsigned char* out = core + boxoff[p];
    StridedWalk px(threadIdx.x, blockDim.x, nx);
    for (int s = threadIdx.x; s < nx * ny; s += blockDim.x, px.next()) {
        int rr = yc + px.row, cc = xc + px.col;
        if (a[s] > 0.0 && rr >= r0 && rr < r1 && cc >= c0 && cc < c1)
            out[(size_t)(rr - r0) * width + (cc - c0)] = 1;
    }
}
