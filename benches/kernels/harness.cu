// Timing harness of the tile kernels (kernels/schur.cu, kernels/polar.cu) on synthetic patches
// shaped like DESI's, for a GPU machine with the CUDA toolkit and no Rust: scripts/kernel-bench
// builds it with nvcc and runs it. It times the Schur sweeps, their combine and the polar
// decorrelation of a whole frame's worth of patches (4700 by default) the way the CUDA backend
// launches them, and with SPEX_PHASE_CLOCK defined it also says where each kernel's cycles go
// (the SPEX_PHASE marks of the kernels). Its outputs (flux, ivar, resolution of the first
// patches) go to a file, so that two versions of the kernels can be compared bit for bit.
//
// The patches: 7 fibers of 74 bins, Gaussian spots (11 x 17 stamps) on a trace 7.3 px apart
// in x and 1.37 px per bin in y, random pixel weights with a few masked pixels, icov = A^T W A
// with desispec's regularisation. Eight distinct patches are built on the host and repeated.
//
//     harness PATCHES REPEATS OUT.bin       time, and write the outputs
//     harness --compare A.bin B.bin         largest differences of two output files
//     harness --mma-rate                    throughput of the FP64 tensor-core shapes

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "polar.cu"
#include "schur.cu"

static void check(cudaError_t e, const char* what, int line) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "harness: %s (line %d): %s\n", what, line, cudaGetErrorString(e));
        std::exit(1);
    }
}
#define CK(x) check((x), #x, __LINE__)

// DESI's patch: 7 fiber blocks of 74 bins (50 output bins, 12 of padding each side), 5 core.
struct Shape {
    int nb = 7, n = 74, ncore = 5, wavepad = 12, nws = 50, ndiag = 5;
    int m() const { return nb * n; }
};

// Spots of 11 x 17 pixels.
const int SPOT_NX = 17, SPOT_NY = 11;

// The spot id of column j of a patch: fiber block f = j / n is stored as DESI's patches are,
// padding first, core last, but lies along the CCD at fiber ccd(f): the first padding fiber
// left of the core, the second right of it.
static int spot_id(const Shape& sh, int j) {
    int f = j / sh.n, w = j % sh.n;
    int ccd = f == 0 ? 0 : f == 1 ? sh.nb - 1 : f - 1;
    return ccd * sh.n + w;
}

// Centre of the spot of spot id j (fiber j / n along the CCD, bin j % n) and its lower-left
// corner.
static void spot_place(const Shape& sh, int j, double& xc, double& yc, int& cx, int& cy) {
    int f = j / sh.n, w = j % sh.n;
    xc = 7.3 * f + 15.0 + 0.2 * std::sin(0.1 * w + f);
    yc = 1.37 * w + 12.0;
    cx = (int)std::floor(xc - SPOT_NX / 2 + 0.5);
    cy = (int)std::floor(yc - SPOT_NY / 2 + 0.5);
}

// The fiber block after block b along the CCD, -1 for the last: the block whose first spot id
// is the next larger (as kernels/common.cuh's next_fiber_spot finds it).
static int next_block_host(const Shape& sh, int b) {
    int key = spot_id(sh, b * sh.n), best = -1;
    for (int c = 0; c < sh.nb; ++c) {
        int kc = spot_id(sh, c * sh.n);
        if (kc > key && (best < 0 || kc < spot_id(sh, best * sh.n))) best = c;
    }
    return best;
}

// The band storage of a patch's icov (kernels/common.cuh) from its dense m x m matrix; slots
// of fibers that do not exist are zero.
static void to_band(const Shape& sh, const double* dense, double* band) {
    const int n = sh.n, m = sh.m(), row = SPEX_BAND_BLOCKS * n;
    for (int b = 0; b < sh.nb; ++b) {
        int t = b;
        for (int slot = 0; slot < SPEX_BAND_BLOCKS; ++slot) {
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n; ++j)
                    band[(size_t)(b * n + i) * row + slot * n + j] =
                        t >= 0 ? dense[(size_t)(b * n + i) * m + t * n + j] : 0.0;
            if (t >= 0) t = next_block_host(sh, t);
        }
    }
}

// One synthetic patch: icov (m x m, both triangles) and y.
static void make_patch(unsigned seed, const Shape& sh, double* icov, double* y) {
    const int nx = SPOT_NX, ny = SPOT_NY, m = sh.m();
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    int width = (int)(7.3 * sh.nb) + 40, height = (int)(1.37 * sh.n) + 30;
    std::vector<double> ivar((size_t)width * height), pix((size_t)width * height);
    for (size_t k = 0; k < ivar.size(); ++k) {
        ivar[k] = uni(rng) < 0.002 ? 0.0 : 1.0 / (4.0 + 2.0 * uni(rng));
        pix[k] = 10.0 * uni(rng);
    }
    std::vector<double> spot((size_t)m * nx * ny);
    std::vector<int> cx(m), cy(m);
    for (int f = 0; f < sh.nb; ++f)
        for (int w = 0; w < sh.n; ++w) {
            int j = f * sh.n + w;
            double xc, yc, sx = 1.0 + 0.05 * f, sy = 1.1;
            spot_place(sh, spot_id(sh, j), xc, yc, cx[j], cy[j]);
            double sum = 0.0;
            double* a = &spot[(size_t)j * nx * ny];
            for (int iy = 0; iy < ny; ++iy)
                for (int ix = 0; ix < nx; ++ix) {
                    double dx = (cx[j] + ix - xc) / sx, dy = (cy[j] + iy - yc) / sy;
                    a[iy * nx + ix] = std::exp(-0.5 * (dx * dx + dy * dy));
                    sum += a[iy * nx + ix];
                }
            for (int k = 0; k < nx * ny; ++k) a[k] /= sum;
        }
    std::vector<double> fw(m, 0.0);
    for (int j1 = 0; j1 < m; ++j1) {
        const double* a1 = &spot[(size_t)j1 * nx * ny];
        double sy = 0.0;
        for (int iy = 0; iy < ny; ++iy)
            for (int ix = 0; ix < nx; ++ix) {
                size_t k = (size_t)(cy[j1] + iy) * width + cx[j1] + ix;
                fw[j1] += a1[iy * nx + ix] * ivar[k];
                sy += a1[iy * nx + ix] * ivar[k] * pix[k];
            }
        y[j1] = sy;
        for (int j2 = j1; j2 < m; ++j2) {
            int dx = cx[j2] - cx[j1], dy = cy[j2] - cy[j1];
            double s = 0.0;
            if (std::abs(dx) < nx && std::abs(dy) < ny) {
                const double* a2 = &spot[(size_t)j2 * nx * ny];
                for (int iy = std::max(dy, 0); iy < std::min(ny + dy, ny); ++iy)
                    for (int ix = std::max(dx, 0); ix < std::min(nx + dx, nx); ++ix) {
                        size_t k = (size_t)(cy[j1] + iy) * width + cx[j1] + ix;
                        s += a1[iy * nx + ix] * a2[(iy - dy) * nx + ix - dx] * ivar[k];
                    }
            }
            icov[(size_t)j1 * m + j2] = s;
            icov[(size_t)j2 * m + j1] = s;
        }
    }
    double mx = *std::max_element(fw.begin(), fw.end()), minweight = 1e-4 * mx;
    for (int j = 0; j < m; ++j) {
        double alpha = fw[j] < minweight ? minweight - fw[j] : 0.0;
        icov[(size_t)j * m + j] += alpha * alpha + 1e-15;
    }
}

template <typename T>
static T* device_alloc(size_t count) {
    T* p = nullptr;
    CK(cudaMalloc(&p, count * sizeof(T)));
    return p;
}

// Median of the times of `repeats` launches of `body` (after one unmeasured), milliseconds.
template <typename F>
static double median_ms(int repeats, F body) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    body();
    CK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int r = 0; r < repeats; ++r) {
        CK(cudaEventRecord(a));
        body();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// Device buffers of one run.
struct Buffers {
    double *icov, *y, *ends, *u, *sblocks, *x, *coupling, *pbuf, *flux, *ivar, *res, *fluxcol;
    // the sweeps' updates of the core blocks, which the combine overwrites with the complements
    // and their factors: restored before each timed combine
    double *left, *right;
    int *colspot, *corners, *info, *steps, *nkeep;
};

static Buffers allocate(const Shape& sh, int patches) {
    size_t P = patches, m = sh.m(), n = sh.n, nb = sh.nb, nblk = P * sh.ncore;
    Buffers b;
    b.icov = device_alloc<double>(P * m * SPEX_BAND_BLOCKS * n);
    b.y = device_alloc<double>(P * m);
    b.ends = device_alloc<double>(P * 2 * n * n);
    b.u = device_alloc<double>(P * 2 * nb * n);
    b.sblocks = device_alloc<double>(nblk * n * n);
    b.x = device_alloc<double>(P * m);
    b.coupling = device_alloc<double>(P);
    b.pbuf = device_alloc<double>(nblk * n * n);
    b.left = device_alloc<double>(nblk * n * n);
    b.right = device_alloc<double>(nblk * n * n);
    b.flux = device_alloc<double>(nblk * sh.nws);
    b.ivar = device_alloc<double>(nblk * sh.nws);
    b.res = device_alloc<double>(nblk * sh.nws * (2 * sh.ndiag + 1));
    b.fluxcol = device_alloc<double>(P * m);
    b.colspot = device_alloc<int>(P * m);
    b.corners = device_alloc<int>(2 * m);
    b.info = device_alloc<int>(P);
    b.steps = device_alloc<int>(nblk);
    b.nkeep = device_alloc<int>(P);
    return b;
}

// Eight distinct patches, repeated over all `patches`.
static void fill(const Shape& sh, int patches, const Buffers& b) {
    const int distinct = 8;
    size_t m = sh.m();
    size_t per = m * SPEX_BAND_BLOCKS * sh.n;
    std::vector<double> icov(distinct * per), y(distinct * m);
#pragma omp parallel for
    for (int i = 0; i < distinct; ++i) {
        std::vector<double> dense(m * m);
        make_patch(1234 + i, sh, dense.data(), &y[i * m]);
        to_band(sh, dense.data(), &icov[i * per]);
    }
    for (int p = 0; p < patches; ++p) {
        int i = p % distinct;
        CK(cudaMemcpy(b.icov + p * per, &icov[i * per], per * 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b.y + p * m, &y[i * m], m * 8, cudaMemcpyHostToDevice));
    }
    std::vector<int> colspot(patches * m), nkeep(patches, sh.nws);
    for (size_t k = 0; k < colspot.size(); ++k) colspot[k] = spot_id(sh, (int)(k % m));
    CK(cudaMemcpy(b.colspot, colspot.data(), colspot.size() * 4, cudaMemcpyHostToDevice));
    // every patch has the same spot places
    std::vector<int> corners(2 * m);
    for (size_t j = 0; j < m; ++j) {
        double xc, yc;
        spot_place(sh, (int)j, xc, yc, corners[2 * j], corners[2 * j + 1]);
    }
    CK(cudaMemcpy(b.corners, corners.data(), corners.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b.nkeep, nkeep.data(), nkeep.size() * 4, cudaMemcpyHostToDevice));
}

// The launches of src/backend/cuda/schur.rs and launchers.rs, for `patches` patches.
struct Launches {
    Shape sh;
    int patches;
    Buffers b;
    // the combine hands its factors of S_b to the polar kernel through pbuf, as the CUDA
    // backend does on the Schur route
    int factored = 1;
    int big() const { return (sh.n + 1 + 7) / 8 * 8; }
    int tiles() const { return (sh.n + 7) / 8 * 8; }
    size_t sweep_smem() const { return (2 * big() * (big() + 4) + sh.n + 32) * 8 + 4 * sh.nb; }
    size_t combine_smem() const { return (tiles() * (tiles() + 4) + sh.n) * 8; }
    size_t polar_smem() const { return (2 * tiles() * (tiles() + 4) + 2 * sh.n + 32) * 8; }

    void attributes() const {
        CK(cudaFuncSetAttribute(schur_sweep_f64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)sweep_smem()));
        CK(cudaFuncSetAttribute(schur_combine_f64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)combine_smem()));
        CK(cudaFuncSetAttribute(schur_end_flux_f64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)combine_smem()));
        CK(cudaFuncSetAttribute(polar_f64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)polar_smem()));
    }
    void sweep() const {
        CK(cudaMemset(b.info, 0, patches * 4));
        schur_sweep_f64<<<dim3(patches, 2, 1), 4 * big(), sweep_smem()>>>(
            b.icov, b.y, nullptr, b.colspot, b.corners, SPOT_NX, sh.m(), sh.n, sh.nb, sh.ncore,
            b.sblocks, b.pbuf, b.ends, b.u, b.info, b.coupling);
    }
    // the sweeps' updates (in sblocks and pbuf) kept aside, and put back
    size_t update_bytes() const { return (size_t)patches * sh.ncore * sh.n * sh.n * 8; }
    void keep_updates() const {
        CK(cudaMemcpy(b.left, b.sblocks, update_bytes(), cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(b.right, b.pbuf, update_bytes(), cudaMemcpyDeviceToDevice));
    }
    void restore_updates() const {
        CK(cudaMemcpyAsync(b.sblocks, b.left, update_bytes(), cudaMemcpyDeviceToDevice));
        CK(cudaMemcpyAsync(b.pbuf, b.right, update_bytes(), cudaMemcpyDeviceToDevice));
    }
    void combine() const {
        schur_combine_f64<<<dim3(sh.nb, patches, 1), 4 * tiles(), combine_smem()>>>(
            b.icov, b.y, nullptr, b.colspot, sh.m(), sh.n, sh.nb, sh.ncore, b.u, b.sblocks,
            b.pbuf, b.x, b.info);
    }
    void end_flux() const {
        schur_end_flux_f64<<<dim3(patches, 2, 1), 4 * tiles(), combine_smem()>>>(
            b.icov, b.y, nullptr, b.colspot, sh.m(), sh.n, sh.nb, sh.ncore, b.ends, b.x);
    }
    void polar() const {
        int count = patches * sh.ncore;
        CK(cudaMemset(b.steps, 0, count * 4));
        polar_f64<<<count, 4 * tiles(), polar_smem()>>>(
            b.sblocks, 0, factored, b.x, b.nkeep, sh.n, sh.m(), sh.ncore, sh.wavepad, sh.nws, sh.ndiag,
            1e-7, 40, b.pbuf, b.flux, b.ivar, b.res, b.fluxcol, b.steps, nullptr, nullptr);
    }
};

#ifdef SPEX_PHASE_CLOCK
static void print_phases(const char* kernel, const char* const* names, int first, int count,
                         double blocks, double clock_khz) {
    unsigned long long c[64];
    CK(cudaMemcpyFromSymbol(c, spex_phase_cycles, sizeof c));
    double total = 0.0;
    for (int k = first; k < first + count; ++k) total += (double)c[k];
    std::printf("%s, cycles per block (thread 0):\n", kernel);
    for (int k = first; k < first + count; ++k)
        std::printf("  %-28s %9.0f  %5.1f%%  (%.1f us)\n", names[k - first], c[k] / blocks,
                    100.0 * c[k] / total, c[k] / blocks / clock_khz * 1e3);
}
#endif

static std::vector<double> read_file(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f) {
        std::fprintf(stderr, "harness: cannot open %s\n", path);
        std::exit(1);
    }
    std::vector<double> v;
    double d;
    while (std::fread(&d, 8, 1, f) == 1) v.push_back(d);
    std::fclose(f);
    return v;
}

// Largest flux difference in units of sigma, largest relative ivar and absolute resolution
// differences of two output files (flux, ivar, resolution of the same blocks).
static int compare(const char* pa, const char* pb) {
    std::vector<double> a = read_file(pa), b = read_file(pb);
    if (a.size() != b.size() || a.size() < 3) {
        std::fprintf(stderr, "harness: %s and %s differ in length\n", pa, pb);
        return 1;
    }
    size_t nflux = (size_t)a[0];
    double df = 0.0, di = 0.0, dr = 0.0;
    for (size_t k = 0; k < nflux; ++k) {
        double fa = a[1 + k], fb = b[1 + k], ia = a[1 + nflux + k], ib = b[1 + nflux + k];
        double sig = ia > 0.0 ? 1.0 / std::sqrt(ia) : 1.0;
        df = std::max(df, std::fabs(fa - fb) / sig);
        di = std::max(di, std::fabs(ia - ib) / std::max(std::fabs(ia), 1e-300));
    }
    for (size_t k = 1 + 2 * nflux; k < a.size(); ++k) dr = std::max(dr, std::fabs(a[k] - b[k]));
    std::printf("outputs: flux %.2e sigma, ivar %.2e relative, resolution %.2e\n", df, di, dr);
    return 0;
}


// Throughput of the FP64 tensor-core shapes: every warp runs `iters` rounds of four
// independent accumulations, so that the pipe rather than latency decides. SHAPE: 0 m8n8k4
// (sm_80's shape), 1 m16n8k4, 2 m16n8k8, 3 m16n8k16 (sm_90's).
template <int SHAPE>
__global__ void mma_rate_kernel(int iters, double* out) {
    double a[8], b[4], c[4][4] = {};
    for (int i = 0; i < 8; ++i) a[i] = 1.0 + 1e-3 * (threadIdx.x + i);
    for (int i = 0; i < 4; ++i) b[i] = 1.0 - 1e-3 * i;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#if __CUDA_ARCH__ >= 900
            if (SHAPE == 0) {
                mma8x8x4(c[j][0], c[j][1], a[0], b[0]);
            } else if (SHAPE == 1) {
                asm volatile(
                    "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
                    "{%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                    : "+d"(c[j][0]), "+d"(c[j][1]), "+d"(c[j][2]), "+d"(c[j][3])
                    : "d"(a[0]), "d"(a[1]), "d"(b[0]));
            } else if (SHAPE == 2) {
                asm volatile(
                    "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                    : "+d"(c[j][0]), "+d"(c[j][1]), "+d"(c[j][2]), "+d"(c[j][3])
                    : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
            } else {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
                    : "+d"(c[j][0]), "+d"(c[j][1]), "+d"(c[j][2]), "+d"(c[j][3])
                    : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]),
                      "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
            }
#endif
        }
    }
    double s = 0.0;
    for (int j = 0; j < 4; ++j)
        for (int q = 0; q < 4; ++q) s += c[j][q];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

static int mma_rate() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int threads = 256, iters = 2000, blocks = sms * 8;
    double* out = device_alloc<double>((size_t)blocks * threads);
    const char* names[] = {"m8n8k4", "m16n8k4", "m16n8k8", "m16n8k16"};
    const double flops[] = {2.0 * 8 * 8 * 4, 2.0 * 16 * 8 * 4, 2.0 * 16 * 8 * 8, 2.0 * 16 * 8 * 16};
    void (*kernels[])(int, double*) = {mma_rate_kernel<0>, mma_rate_kernel<1>, mma_rate_kernel<2>,
                                       mma_rate_kernel<3>};
    for (int shape = 0; shape < 4; ++shape) {
        double ms = median_ms(5, [&] { kernels[shape]<<<blocks, threads>>>(iters, out); });
        double total = flops[shape] * 4.0 * iters * (threads / 32) * blocks;
        std::printf("%-9s %7.2f ms  %6.1f TFLOP/s\n", names[shape], ms, total / ms / 1e9);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "--mma-rate") return mma_rate();
    if (argc == 4 && std::string(argv[1]) == "--compare") return compare(argv[2], argv[3]);
    if (argc != 4) {
        std::fprintf(stderr, "usage: harness PATCHES REPEATS OUT.bin | --compare A.bin B.bin\n");
        return 2;
    }
    Launches l;
    l.patches = std::atoi(argv[1]);
    int repeats = std::atoi(argv[2]);
    l.b = allocate(l.sh, l.patches);
    fill(l.sh, l.patches, l.b);
    l.attributes();
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));

    double t_sweep = median_ms(repeats, [&] { l.sweep(); });
    // the combine consumes the sweeps' updates: each launch gets them back first, and the
    // copies are timed alone and taken off
    l.keep_updates();
    double t_restore = median_ms(repeats, [&] { l.restore_updates(); });
    double t_combine = median_ms(repeats, [&] {
        l.restore_updates();
        l.combine();
    }) - t_restore;
    double t_end = median_ms(repeats, [&] { l.end_flux(); });
    double t_polar = median_ms(repeats, [&] { l.polar(); });
    std::vector<int> info(l.patches), steps(l.patches * l.sh.ncore);
    CK(cudaMemcpy(info.data(), l.b.info, info.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(steps.data(), l.b.steps, steps.size() * 4, cudaMemcpyDeviceToHost));
    int failed = (int)std::count_if(info.begin(), info.end(), [](int i) { return i != 0; });
    std::vector<int> sorted = steps;
    std::sort(sorted.begin(), sorted.end());

#ifdef SPEX_PHASE_CLOCK
    const char* polar_names[] = {"load + Cholesky", "L^-1",       "norms, X0",
                                 "X^T X",           "scalars",    "X M",
                                 "Q = U^T A",       "outputs"};
    const char* sweep_names[] = {"order, coupling", "first block", "Cholesky", "load V",
                                 "L^-1 V",          "V^T V",       "store U",  "next block"};
    const char* combine_names[] = {"S_b", "Cholesky", "xflux"};
    CK(cudaMemset(l.b.info, 0, l.patches * 4));
    unsigned long long zero[64] = {0};
    CK(cudaMemcpyToSymbol(spex_phase_cycles, zero, sizeof zero));
    l.sweep();
    l.combine();
    l.end_flux();
    l.polar();
    CK(cudaDeviceSynchronize());
    print_phases("schur_sweep_f64", sweep_names, 16, 8, 2.0 * l.patches, clock_khz);
    print_phases("schur_combine_f64", combine_names, 32, 3, (double)l.sh.nb * l.patches,
                 clock_khz);
    print_phases("polar_f64", polar_names, 0, 8, (double)l.patches * l.sh.ncore, clock_khz);
#endif

    // flux, ivar and resolution of the first 16 patches
    size_t nblk = std::min(l.patches, 16) * l.sh.ncore, per = nblk * l.sh.nws;
    size_t nres = per * (2 * l.sh.ndiag + 1);
    std::vector<double> out(1 + 2 * per + nres);
    out[0] = (double)per;
    CK(cudaMemcpy(&out[1], l.b.flux, per * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&out[1 + per], l.b.ivar, per * 8, cudaMemcpyDeviceToHost));
    // resolution is [block][diag][bin]: the first blocks are contiguous
    CK(cudaMemcpy(&out[1 + 2 * per], l.b.res, nres * 8, cudaMemcpyDeviceToHost));
    FILE* f = std::fopen(argv[3], "wb");
    if (!f || std::fwrite(out.data(), 8, out.size(), f) != out.size()) {
        std::fprintf(stderr, "harness: cannot write %s\n", argv[3]);
        return 1;
    }
    std::fclose(f);

    std::printf(
        "patches %d: sweeps %.2f ms, combine %.2f ms, end flux %.2f ms, polar %.2f ms (median of "
        "%d)\n",
        l.patches, t_sweep, t_combine, t_end, t_polar, repeats);
    std::printf("failed sweeps %d; polar steps min %d median %d max %d\n", failed, sorted.front(),
                sorted[sorted.size() / 2], sorted.back());
    return 0;
}
