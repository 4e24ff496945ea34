// Spot evaluation: pixel-integrated Gauss-Hermite spots of every (fiber, wavelength) of a
// chunk. Same arithmetic as
// `psf::pixel_gauss_hermite` and `SpotWork::eval`: clipped at zero, normalised to unit sum.

#include "common.cuh"

#define SPEX_MAXDEG 21
#define SPEX_MAXEDGE 130

// Edge values of one axis: erf(t/sqrt2) and He_k(t) phi(t) for k < deg at the n + 1 pixel
// edges, then the pixel integrals pgh[k * n + i]; by the calling warp (lane `lane`).
__device__ void axis_pgh(double center, double sigma, int deg, int n, double* erfv, double* ghv,
                         double* pgh, int lane) {
    double frac = fmod(center + 0.5, 1.0);
    if (frac < 0.0) frac += 1.0;
    frac -= 0.5;
    double half = (double)(n / 2);
    for (int e = lane; e <= n; e += SPEX_WARP) {
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
    __syncwarp();
    StridedWalk at(lane, SPEX_WARP, n);
    for (int idx = lane; idx < (deg + 1) * n; idx += SPEX_WARP, at.next()) {
        int k = at.row, i = at.col;
        pgh[idx] = k == 0 ? 0.5 * (erfv[i + 1] - erfv[i])
                          : ghv[(k - 1) * (n + 1) + i] - ghv[(k - 1) * (n + 1) + i + 1];
    }
}

// Legendre series sum_k c[k] P_k(u) (same recurrence as `psf::Legendre::eval`).
__device__ double legendre(const double* c, int ncoef, double u) {
    double p0 = 1.0, p1 = u;
    double sum = c[0];
    if (ncoef > 1) sum += c[1] * u;
    for (int k = 2; k < ncoef; ++k) {
        double kf = (double)k;
        double p2 = ((2.0 * kf - 1.0) * u * p1 - (kf - 1.0) * p0) / kf;
        sum += c[k] * p2;
        p0 = p1;
        p1 = p2;
    }
    return sum;
}

// One warp per spot `sid = fiber slot * nwave + wave index`, from `first` on (a spot is a few hundred pixels:
// a block of its own left most of its threads idle at its barriers). The trace position comes
// from the host (`xy`, so that the host's corners and the spot agree to the bit); GHSIGX,
// GHSIGY and the GH-i-j are evaluated here from their Legendre coefficients
// `coef[(fiber slot * nparam + param) * ncoef + k]` on the PSF table's domain.
// Dynamic shared memory: the arrays below for each warp, as `launchers::spots` sizes them.
extern "C" __global__ void spots_f64(const double* __restrict__ xy, const double* __restrict__ coef,
                                     const double* __restrict__ waves, int first, int nspot,
                                     int nwave,
                                     int ncoef, double wavemin, double wavemax, int ghdegx,
                                     int ghdegy, int nx, int ny, double* __restrict__ out) {
    extern __shared__ double smem[];
    int lane = threadIdx.x % SPEX_WARP, warp = threadIdx.x / SPEX_WARP;
    int sid = first + blockIdx.x * (blockDim.x / SPEX_WARP) + warp;
    if (sid >= nspot) return;
    int ngx = ghdegx + 1, ngy = ghdegy + 1;
    int nparam = 2 + ngx * ngy;
    int per_warp = (nx + 1) * (1 + ghdegx) + ngx * nx + (ny + 1) * (1 + ghdegy) + ngy * ny +
                   ngx * ny + nparam;
    double* erfx = smem + (size_t)warp * per_warp;  // nx + 1
    double* ghx = erfx + (nx + 1);                  // ghdegx * (nx + 1)
    double* pghx = ghx + ghdegx * (nx + 1);         // ngx * nx
    double* erfy = pghx + ngx * nx;                 // ny + 1
    double* ghy = erfy + (ny + 1);                  // ghdegy * (ny + 1)
    double* pghy = ghy + ghdegy * (ny + 1);         // ngy * ny
    double* tmp = pghy + ngy * ny;                  // ngx * ny
    double* par = tmp + ngx * ny;                   // nparam: sigx, sigy, GH-i-j

    int fslot = sid / nwave, w = sid % nwave;
    double u = (waves[w] - wavemin) * (2.0 / (wavemax - wavemin)) - 1.0;
    for (int i = lane; i < nparam; i += SPEX_WARP)
        par[i] = legendre(coef + ((size_t)fslot * nparam + i) * ncoef, ncoef, u);
    __syncwarp();
    const double* coefgh = par + 2;
    axis_pgh(xy[2 * sid], par[0], ghdegx, nx, erfx, ghx, pghx, lane);
    axis_pgh(xy[2 * sid + 1], par[1], ghdegy, ny, erfy, ghy, pghy, lane);
    __syncwarp();
    StridedWalk at(lane, SPEX_WARP, ny);
    for (int idx = lane; idx < ngx * ny; idx += SPEX_WARP, at.next()) {
        int i = at.row, iy = at.col;
        double s = 0.0;
        for (int j = 0; j < ngy; ++j) s += coefgh[i * ngy + j] * pghy[j * ny + iy];
        tmp[idx] = s;
    }
    __syncwarp();
    int size = nx * ny;
    double* o = out + (size_t)sid * size;
    double total = 0.0;
    StridedWalk px(lane, SPEX_WARP, nx);
    for (int s = lane; s < size; s += SPEX_WARP, px.next()) {
        int iy = px.row, ix = px.col;
        double v = 0.0;
        for (int i = 0; i < ngx; ++i) v += tmp[i * ny + iy] * pghx[i * nx + ix];
        v = fmax(v, 0.0);
        o[s] = v;
        total += v;
    }
    total = warp_sum(total);
    if (total > 0.0) {
        double inv = 1.0 / total;
        for (int s = lane; s < size; s += SPEX_WARP) o[s] *= inv;
    }
}
