// Spot evaluation: pixel-integrated Gauss-Hermite spots from per-spot parameters
// `[x, y, sigx, sigy, GH-i-j...]` (the host evaluates the Legendre series). Same arithmetic as
// `psf::pixel_gauss_hermite` and `SpotWork::eval`: clipped at zero, normalised to unit sum.

#include "common.cuh"

#define SPEX_MAXDEG 21
#define SPEX_MAXEDGE 130

// Edge values of one axis: erf(t/sqrt2) and He_k(t) phi(t) for k < deg at the n + 1 pixel
// edges, then the pixel integrals pgh[k * n + i].
__device__ void axis_pgh(double center, double sigma, int deg, int n, double* erfv, double* ghv,
                         double* pgh) {
    double frac = fmod(center + 0.5, 1.0);
    if (frac < 0.0) frac += 1.0;
    frac -= 0.5;
    double half = (double)(n / 2);
    for (int e = threadIdx.x; e <= n; e += blockDim.x) {
        double t = ((double)e - half - 0.5 - frac) / sigma;
        erfv[e] = erf(t * 0.70710678118654752440);
        double phi = exp(-0.5 * t * t) * 0.39894228040143267794;
        double h0 = 1.0, h1 = t;
        if (deg >= 1) ghv[0 * (n + 1) + e] = h0 * phi;
        if (deg >= 2) ghv[1 * (n + 1) + e] = h1 * phi;
        for (int k = 2; k < deg; ++k) {
            double h2 = t * h1 - (double)(k - 1) * h0;
            ghv[k * (n + 1) + e] = h2 * phi;
            h0 = h1;
            h1 = h2;
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < (deg + 1) * n; idx += blockDim.x) {
        int k = idx / n, i = idx % n;
        pgh[idx] = k == 0 ? 0.5 * (erfv[i + 1] - erfv[i])
                          : ghv[(k - 1) * (n + 1) + i] - ghv[(k - 1) * (n + 1) + i + 1];
    }
}

// One block per spot. Dynamic shared memory: see `spots_smem_doubles` on the host.
extern "C" __global__ void spots_f64(const double* __restrict__ params, int nspot, int stride,
                                     int ghdegx, int ghdegy, int nx, int ny,
                                     double* __restrict__ out) {
    extern __shared__ double sm[];
    int sid = blockIdx.x;
    if (sid >= nspot) return;
    int ngx = ghdegx + 1, ngy = ghdegy + 1;
    double* erfx = sm;                         // nx + 1
    double* ghx = erfx + (nx + 1);             // ghdegx * (nx + 1)
    double* pghx = ghx + ghdegx * (nx + 1);    // ngx * nx
    double* erfy = pghx + ngx * nx;            // ny + 1
    double* ghy = erfy + (ny + 1);             // ghdegy * (ny + 1)
    double* pghy = ghy + ghdegy * (ny + 1);    // ngy * ny
    double* tmp = pghy + ngy * ny;             // ngx * ny
    double* coef = tmp + ngx * ny;             // ngx * ngy
    double* red = coef + ngx * ngy;            // 32

    const double* p = params + (size_t)sid * stride;
    for (int i = threadIdx.x; i < ngx * ngy; i += blockDim.x) coef[i] = p[4 + i];
    axis_pgh(p[0], p[2], ghdegx, nx, erfx, ghx, pghx);
    axis_pgh(p[1], p[3], ghdegy, ny, erfy, ghy, pghy);
    __syncthreads();
    for (int idx = threadIdx.x; idx < ngx * ny; idx += blockDim.x) {
        int i = idx / ny, iy = idx % ny;
        double s = 0.0;
        for (int j = 0; j < ngy; ++j) s += coef[i * ngy + j] * pghy[j * ny + iy];
        tmp[idx] = s;
    }
    __syncthreads();
    int size = nx * ny;
    double* o = out + (size_t)sid * size;
    double total = 0.0;
    for (int s = threadIdx.x; s < size; s += blockDim.x) {
        int iy = s / nx, ix = s % nx;
        double v = 0.0;
        for (int i = 0; i < ngx; ++i) v += tmp[i * ny + iy] * pghx[i * nx + ix];
        v = fmax(v, 0.0);
        o[s] = v;
        total += v;
    }
    total = block_sum(total, red);
    if (total > 0.0) {
        double inv = 1.0 / total;
        for (int s = threadIdx.x; s < size; s += blockDim.x) o[s] *= inv;
    }
}
