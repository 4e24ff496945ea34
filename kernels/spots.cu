// Spot evaluation: pixel-integrated Gauss-Hermite spots of every (fiber, wavelength) of a
// wave. Same arithmetic as
// `psf::pixel_gauss_hermite` and `SpotWork::eval`: clipped at zero, normalised to unit sum.

#include "common.cuh"

#define SPEX_MAXDEG 21
#define SPEX_MAXEDGE 130

// One axis of a spot: its pixels, its Gauss-Hermite degree, what maps a pixel edge to t (the
// middle pixel, where the center falls within its pixel, the width), and its arrays in shared
// memory (edge values, then pixel integrals).
struct Axis {
    int n, deg;
    double half, frac, sigma;
    double *erfv, *ghv, *pgh;
};

__device__ Axis make_axis(double center, double sigma, int deg, int n, double* erfv, double* ghv,
                          double* pgh) {
    double frac = fmod(center + 0.5, 1.0);
    if (frac < 0.0) frac += 1.0;
    frac -= 0.5;
    return Axis{n, deg, (double)(n / 2), frac, sigma, erfv, ghv, pgh};
}

// erf(t/sqrt2) and He_k(t) phi(t) for k < deg at edge e of axis a.
__device__ __forceinline__ void axis_edge(const Axis& a, int e) {
    double t = ((double)e - a.half - 0.5 - a.frac) / a.sigma;
    a.erfv[e] = erf(t * 0.70710678118654752440);
    double phi = exp(-0.5 * t * t) * 0.39894228040143267794;
    double h0 = 1.0, h1 = t;
    if (a.deg >= 1) a.ghv[0 * (a.n + 1) + e] = h0 * phi;
    if (a.deg >= 2) a.ghv[1 * (a.n + 1) + e] = h1 * phi;
    for (int k = 2; k < a.deg; ++k) {
        double h2 = t * h1 - (double)(k - 1) * h0;
        a.ghv[k * (a.n + 1) + e] = h2 * phi;
        h0 = h1;
        h1 = h2;
    }
}

// Edge values of both axes, x's on the first nx + 1 lanes and y's on the next ny + 1 (the two
// axes in turn left half of the lanes idle at the erf and exp), then each axis's pixel
// integrals pgh[k * n + i]; by the calling warp (lane `lane`).
__device__ void axes_pgh(const Axis& ax, const Axis& ay, int lane) {
    for (int e = lane; e < ax.n + ay.n + 2; e += SPEX_WARP) {
        bool onx = e <= ax.n;
        Axis a = onx ? ax : ay;
        axis_edge(a, onx ? e : e - ax.n - 1);
    }
    __syncwarp();
    for (const Axis* a : {&ax, &ay}) {
        int n = a->n;
        StridedWalk at(lane, SPEX_WARP, n);
        for (int idx = lane; idx < (a->deg + 1) * n; idx += SPEX_WARP, at.next()) {
            int k = at.row, i = at.col;
            a->pgh[idx] = k == 0 ? 0.5 * (a->erfv[i + 1] - a->erfv[i])
                                 : a->ghv[(k - 1) * (n + 1) + i] - a->ghv[(k - 1) * (n + 1) + i + 1];
        }
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
    Axis ax = make_axis(xy[2 * sid], par[0], ghdegx, nx, erfx, ghx, pghx);
    Axis ay = make_axis(xy[2 * sid + 1], par[1], ghdegy, ny, erfy, ghy, pghy);
    axes_pgh(ax, ay, lane);
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
