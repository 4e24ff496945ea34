// Sparse assembly of the normal equations of each patch: icov = A^T W A, y = A^T W p,
// fluxweight = A^T W 1, the diagonal of icov before regularisation, and the masked fraction
// of each core spot. A is never formed: each column is a spot at its corner, and two columns
// interact only where their spots overlap.
//
// icov is symmetric, so only one triangle is stored, densely for the dense route or as the
// band of fiber blocks the Schur route reads (kernels/common.cuh, `band`). The entries a
// kernel does not write (dense: j2 < j1 of row j1; band: those left of the diagonal in a
// diagonal block, and slots of fibers that do not exist) are read by no kernel either (they
// hold whatever an earlier wave, or cuSOLVER's potrsBatched, which uses that triangle as
// workspace, left there).

#include "common.cuh"

// Lanes that share one overlap: a half-warp.
#define SPEX_HALF 16

// The share of lane `lane` (< SPEX_HALF) of the sum of w[k] b[k - off] over the rows
// [ylo, yhi) and columns [xlo, xhi) of an nx-wide spot, k = row nx + column: the elements
// t = lane + SPEX_HALF i of the overlap in row-major order, stepped with SPEX_HALF = sy ow + sx
// so that no element pays an integer division.
__device__ __forceinline__ double overlap_sum(const double* w, const double* b, int off, int nx,
                                              int ylo, int yhi, int xlo, int xhi, int lane) {
    int ow = xhi - xlo;
    // floor(a / ow) for a <= SPEX_HALF by a float product: exact, as a / ow is at least 1 / (2 ow)
    // away from the next integer once 0.5 is added to a.
    float rinv = 1.0f / (float)ow;
    int qy = (int)(((float)lane + 0.5f) * rinv), sy = (int)(((float)SPEX_HALF + 0.5f) * rinv);
    int sx = SPEX_HALF - sy * ow;
    int iy = ylo + qy, ix = xlo + lane - qy * ow;
    int k = iy * nx + ix, step = sy * nx + sx, wrap = nx - ow;
    double sum = 0.0;
    while (iy < yhi) {
        sum += w[k] * b[k - off];
        ix += sx;
        iy += sy;
        k += step;
        if (ix >= xhi) {
            ix -= ow;
            iy += 1;
            k += wrap;
        }
    }
    return sum;
}

// Column j1's overlaps with the columns of its patch that row j1 stores: entry t in [lo, hi)
// of the row `icol` is the column of spot `spot(t)` (zero where the spots do not overlap or
// the column is empty, spot -1); `w1` is j1's weighted spot, (x1, y1) its corner. The warp
// screens 32 entries at once (a ballot of the overlapping ones), then computes the overlaps
// two at a time, one per half-warp (half the reduction steps per overlap), each stored by the
// lane that holds it. Entry `tdiag` is the diagonal, which also goes to `diag0`. Where
// `from` is given (a downdate: w1 holds only the pixels a test rejected since), each entry is
// `from`'s less the overlap, and the diagonal `d0_from` less it.
template <typename Spot>
__device__ __forceinline__ void overlap_columns(const double* __restrict__ spots,
                                                const int* __restrict__ corners,
                                                const double* w1, int x1, int y1, int nx, int ny,
                                                int tdiag, int lo, int hi, Spot spot,
                                                double* icol, double* diag0,
                                                const double* from, double d0_from, int lane) {
    int size = nx * ny;
    int half = lane / SPEX_HALF, hl = lane % SPEX_HALF;
    for (int g = lo; g < hi; g += SPEX_WARP) {
        int t = g + lane;
        bool mine = t < hi;
        int sid2 = mine ? spot(t) : -1;
        int dx = 0, dy = 0;
        bool hit = false;
        if (sid2 >= 0) {
            dx = corners[2 * sid2] - x1;
            dy = corners[2 * sid2 + 1] - y1;
            hit = dx < nx && dx > -nx && dy < ny && dy > -ny;
        }
        if (mine && !hit) icol[t] = from ? from[t] : 0.0;
        unsigned mask = __ballot_sync(0xffffffffu, hit);
        while (mask) {
            int b0 = __ffs(mask) - 1;
            mask &= mask - 1;
            int b1 = mask ? __ffs(mask) - 1 : -1;
            mask &= mask - 1;
            int b = half ? b1 : b0;
            int s2 = __shfl_sync(0xffffffffu, sid2, max(b, 0));
            int ddx = __shfl_sync(0xffffffffu, dx, max(b, 0));
            int ddy = __shfl_sync(0xffffffffu, dy, max(b, 0));
            double sum = 0.0;
            if (b >= 0) {
                const double* a2 = spots + (size_t)s2 * size;
                int ylo = max(ddy, 0), yhi = min(ny + ddy, ny);
                int xlo = max(ddx, 0), xhi = min(nx + ddx, nx);
                sum = overlap_sum(w1, a2, ddy * nx + ddx, nx, ylo, yhi, xlo, xhi, hl);
            }
            for (int o = SPEX_HALF / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (hl == 0 && b >= 0) {
                icol[g + b] = from ? from[g + b] - sum : sum;
                if (g + b == tdiag) *diag0 = from ? d0_from - sum : sum;
            }
        }
    }
}

// The column tables of `npatch` patches, `nb` blocks of `n` columns each: column b n + w of
// patch p is the spot first[p nb + b] + w, or -1 (no spot) where first[p nb + b] is -1. The
// host uploads a block's first spot only (7 values per patch of DESI's instead of 518).
extern "C" __global__ void column_table(const int* __restrict__ first, int nb, int n, int npatch,
                                        int* __restrict__ colspot) {
    size_t total = (size_t)npatch * nb * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        int f = first[i / n];
        colspot[i] = f < 0 ? -1 : f + (int)(i % n);
    }
}

// One warp per (column j1, patch), SPEX_COLUMNS consecutive columns to a block: writes row j1
// of icov's stored triangle, dense or band (`band`, kernels/common.cuh). The warps of a block
// share no data and meet at no barrier, but neighbouring columns overlap nearly the same
// spots, so that the partner spots one warp loads are often still in L1 for the others. (A
// block of four warps per column, with its sums and weighted spot shared behind a barrier,
// took 12.7 ms per full frame on an H100 against 11.6; eight columns to a block take the
// same as four.)
//
// Shared memory (dynamic): w1[ny nx] (weighted spot) per warp.
//
// `rejected` (null unless outliers are rejected): a flag per pixel of each patch's box, at
// `boxoff`; a flagged pixel has weight zero in that patch only (boxes overlap, and the image
// is shared).
//
// `Kept` (a downdate, kernel `downdate_f64`): the patch starts from the equations it kept
// after its last test (its slot of `kept`, `kept_slots[p]`, kernels/common.cuh KeptLayout)
// and subtracts the terms of the pixels that test rejected (SPEX_FRESH) alone: the columns
// whose spots lost none (the slot lists those pixels) copy their row as kept. Without it
// (`assemble_f64`) a patch that has a slot is left to the downdate.
//
// Blocks of 128 threads, 12 per SM, which caps the kernel at 40 registers: the kernel waits
// on L1 (Nsight Compute: 92% of its throughput), and at the 32 registers of 16 blocks per SM
// it spilled (68 million local-memory requests in one 784-patch assembly) and took 11.6 ms per
// full frame on an H100 against 11.1; at 48 registers, 10 blocks, it took 11.4.
#define SPEX_COLUMNS 4
#define SPEX_ASSEMBLY_ARGS                                                                       \
    const double *__restrict__ spots, const int *__restrict__ corners,                          \
        const int *__restrict__ colspot, const int *__restrict__ boxes,                          \
        const int *__restrict__ patch_ids, const float *__restrict__ pix,                        \
        const float *__restrict__ ivar, const long long *__restrict__ boxoff,                    \
        const unsigned char *__restrict__ rejected, int sub_row0, int sub_col0, int sub_w, int m, \
        int nx, int ny, int nwavetot, int ncore, int wavepad, int nwavestep, int band,           \
        double *__restrict__ icov, double *__restrict__ y, double *__restrict__ fw,              \
        double *__restrict__ diag0, double *__restrict__ pixmask,                                \
        const int *__restrict__ kept_slots, const double *__restrict__ kept
#define SPEX_ASSEMBLY_PASS                                                                       \
    spots, corners, colspot, boxes, patch_ids, pix, ivar, boxoff, rejected, sub_row0, sub_col0, \
        sub_w, m, nx, ny, nwavetot, ncore, wavepad, nwavestep, band, icov, y, fw, diag0,          \
        pixmask, kept_slots, kept

// Where column j1's masked weight goes among a patch's pixmask values (core columns of the
// kept bins), -1 for a column of a padding fiber or bin.
__device__ __forceinline__ int pixmask_index(int j1, int m, int nwavetot, int ncore, int wavepad,
                                             int nwavestep) {
    int c = j1 / nwavetot - (m / nwavetot - ncore), j = j1 % nwavetot - wavepad;
    return c >= 0 && j >= 0 && j < nwavestep ? c * nwavestep + j : -1;
}

// Whether a pixel of the kept list of the pixels rejected since (row << 16 | column within the
// box, kernels/reject.cu keep_equations) lies in the spot whose corner is (x, y) in box
// coordinates; true where the list overflowed. For the calling warp.
__device__ __forceinline__ bool spot_lost_pixels(const double* list, int x, int y, int nx, int ny,
                                                 int lane) {
    int len = (int)list[0];
    if (len > SPEX_KEPT_LIST) return true;
    bool hit = false;
    for (int i = lane; i < len; i += SPEX_WARP) {
        int e = (int)list[1 + i], r = e >> 16, c = e & 0xffff;
        hit |= r >= y && r < y + ny && c >= x && c < x + nx;
    }
    return __any_sync(0xffffffffu, hit);
}

template <bool Kept>
__device__ __forceinline__ void assemble_column(SPEX_ASSEMBLY_ARGS) {
    extern __shared__ double sm[];
    int size = nx * ny;
    int lane = threadIdx.x % SPEX_WARP, warp = threadIdx.x / SPEX_WARP;
    double* w1 = sm + warp * size;

    int j1 = blockIdx.x * SPEX_COLUMNS + warp;
    int p = patch_of(patch_ids, blockIdx.y);
    if (p < 0 || j1 >= m) return;
    int slot = kept_slots ? kept_slots[p] : -1;
    if (Kept != (slot >= 0)) return;
    const int* cs = colspot + (size_t)p * m;
    int row_len = icov_row_len(band, m, nwavetot);
    double* icol = icov + ((size_t)p * m + j1) * row_len;
    KeptLayout kl{m, row_len, ncore * nwavestep};
    const double* base = Kept ? kept + (size_t)slot * kl.size() : nullptr;
    int sid1 = cs[j1];
    if (sid1 < 0) {
        for (int j2 = band ? lane : j1 + lane; j2 < row_len; j2 += SPEX_WARP) icol[j2] = 0.0;
        if (lane == 0) {
            y[(size_t)p * m + j1] = 0.0;
            fw[(size_t)p * m + j1] = 0.0;
            diag0[(size_t)p * m + j1] = 0.0;
        }
        return;
    }
    int r0 = boxes[4 * p], r1 = boxes[4 * p + 1], c0 = boxes[4 * p + 2], c1 = boxes[4 * p + 3];
    int x1 = corners[2 * sid1], y1 = corners[2 * sid1 + 1];
    const double* a1 = spots + (size_t)sid1 * size;
    if (Kept && !spot_lost_pixels(base + kl.fresh(), x1 - c0, y1 - r0, nx, ny, lane)) {
        // no pixel of this column's spot was rejected since: all as kept
        const double* from = base + (size_t)j1 * row_len;
        for (int t = lane; t < row_len; t += SPEX_WARP) icol[t] = from[t];
        if (lane == 0) {
            size_t at = (size_t)p * m + j1;
            y[at] = base[kl.y() + j1];
            fw[at] = base[kl.fw() + j1];
            diag0[at] = base[kl.diag0() + j1];
            int pm = pixmask_index(j1, m, nwavetot, ncore, wavepad, nwavestep);
            if (pm >= 0) pixmask[(size_t)p * kl.nmask + pm] = base[kl.pixmask() + pm];
        }
        return;
    }

    double sy = 0.0, sw = 0.0, smask = 0.0;
    StridedWalk px(lane, SPEX_WARP, nx);
    for (int s = lane; s < size; s += SPEX_WARP, px.next()) {
        int iy = px.row, ix = px.col;
        int rr = y1 + iy, cc = x1 + ix;
        double w = 0.0;
        if (rr >= r0 && rr < r1 && cc >= c0 && cc < c1) {
            size_t k = (size_t)(rr - sub_row0) * sub_w + (cc - sub_col0);
            unsigned char f = rejected_flag(rejected, boxoff, p, rr - r0, cc - c0, c1 - c0);
            // a downdate weighs the pixels rejected since the kept equations alone
            double iv = (Kept ? f == SPEX_FRESH : f == 0) ? (double)ivar[k] : 0.0;
            double a = a1[s];
            w = a * iv;
            sy += w * (double)pix[k];
            sw += w;
            if ((iv == 0.0) != Kept) smask += a;
        }
        w1[s] = w;
    }
    sy = warp_sum(sy);
    sw = warp_sum(sw);
    smask = warp_sum(smask);
    if (lane == 0) {
        size_t at = (size_t)p * m + j1;
        y[at] = Kept ? base[kl.y() + j1] - sy : sy;
        fw[at] = Kept ? base[kl.fw() + j1] - sw : sw;
        int pm = pixmask_index(j1, m, nwavetot, ncore, wavepad, nwavestep);
        if (pm >= 0)
            pixmask[(size_t)p * kl.nmask + pm] = Kept ? base[kl.pixmask() + pm] + smask : smask;
    }
    // the weighted spot, to every lane of the warp
    __syncwarp();

    double* d0 = diag0 + (size_t)p * m + j1;
    const double* from = Kept ? base + (size_t)j1 * row_len : nullptr;
    double d0_from = Kept ? base[kl.diag0() + j1] : 0.0;
    if (!band) {
        overlap_columns(spots, corners, w1, x1, y1, nx, ny, j1, j1, m,
                        [&](int t) { return cs[t]; }, icol, d0, from, d0_from, lane);
        return;
    }
    // band: the rest of j1's own block, then the blocks of the next two fibers along the CCD,
    // one run of entries (those of fibers that do not exist are left out); a block's spots
    // are consecutive, from its first
    int n = nwavetot, nb = m / n;
    int own = cs[(j1 / n) * n];
    int next = next_fiber_spot(cs, n, nb, own, lane);
    int after = next_fiber_spot(cs, n, nb, next, lane);
    int hi = next < 0 ? n : after < 0 ? 2 * n : 3 * n;
    overlap_columns(spots, corners, w1, x1, y1, nx, ny, j1 % n, j1 % n, hi,
                    [&](int t) {
                        int slot = t >= n ? (t >= 2 * n ? 2 : 1) : 0;
                        return (slot == 0 ? own : slot == 1 ? next : after) + t - slot * n;
                    },
                    icol, d0, from, d0_from, lane);
}

extern "C" __global__ void __launch_bounds__(SPEX_COLUMNS* SPEX_WARP, 12)
    assemble_f64(SPEX_ASSEMBLY_ARGS) {
    assemble_column<false>(SPEX_ASSEMBLY_PASS);
}

extern "C" __global__ void __launch_bounds__(SPEX_COLUMNS* SPEX_WARP, 12)
    downdate_f64(SPEX_ASSEMBLY_ARGS) {
    assemble_column<true>(SPEX_ASSEMBLY_PASS);
}

// Step 2 of the solve, one block per patch: icov += diag(alpha^2 + 1e-15) from the
// unregularised diagonal, alpha = minweight - fluxweight where fluxweight < minweight
// (minweight = 1e-4 max fluxweight), else `reg`. A patch without any weight is flagged in
// `masked` and its diagonal set to 1 so that the batched factorisation stays defined. Only the
// diagonal is touched, which lies in the stored triangle (dense or band, `band`, blocks of n).
extern "C" __global__ void regularize_f64(double* __restrict__ icov, const double* __restrict__ fw,
                                          const double* __restrict__ diag0,
                                          const int* __restrict__ patch_ids, int m, int n,
                                          int band, double reg, int* __restrict__ masked) {
    __shared__ double red[32];
    int p = patch_of(patch_ids, blockIdx.x);
    if (p < 0) return;
    const double* f = fw + (size_t)p * m;
    double mx = 0.0;
    for (int j = threadIdx.x; j < m; j += blockDim.x) mx = fmax(mx, f[j]);
    mx = block_max(mx, red);
    int row_len = icov_row_len(band, m, n);
    double* a = icov + (size_t)p * m * row_len;
    // the diagonal element of row j
    auto at = [&](int j) -> double& { return a[(size_t)j * row_len + (band ? j % n : j)]; };
    if (!(mx > 0.0)) {
        for (int j = threadIdx.x; j < m; j += blockDim.x) at(j) = 1.0;
        if (threadIdx.x == 0) masked[p] = 1;
        return;
    }
    double minweight = 1e-4 * mx;
    for (int j = threadIdx.x; j < m; j += blockDim.x) {
        double alpha = f[j] < minweight ? minweight - f[j] : reg;
        at(j) = diag0[(size_t)p * m + j] + (alpha * alpha + 1e-15);
    }
    if (threadIdx.x == 0) masked[p] = 0;
}
