// Outlier rejection (`--reject-outliers`, src/backend/cuda/reject.rs): the outlier test, on
// the model boxes the finalize step projects (kernels/finalize.cu), which also flags the
// pixels the test looks at; the normal equations kept for the re-solves.

#include "common.cuh"

// Threads of a block of outlier_test: as many as a block takes. A test is a chain of passes
// over its box (the median's rounds, the pulls, each round of growth), and the last waves of
// a frame's re-solves hold a few dozen patches, a block each, whose test is the wave's
// latency: with 1024 threads instead of 256 the tests of a full-width frame took 1.18 ms
// instead of 1.91 (an H200; the first PSF's 500 x 801 frame of docs/benchmarks.md). Two
// blocks share an SM (32 registers, some spilled): with one, the tests of a full r frame
// took 4.32 ms instead of 4.02-4.05 (ncu, an H200), the block's barriers idling the SM.
#define SPEX_TEST_THREADS 1024

// Flags of `rejected` during a test (SPEX_REJECTED and SPEX_FRESH, kernels/common.cuh, are
// pixels rejected before it, which have weight zero): a pixel this pass grew into, one of its
// seeds, one it took for its contrast.
#define SPEX_NEW_OUTLIER 2
#define SPEX_SEED 3
#define SPEX_CONTRAST 4

// What the pass that finds the seeds saw besides them (bits of outlier_test's s_seen): a
// tested pixel below -nsigma, a pixel rejected by the test before (SPEX_FRESH). A patch with
// neither and no seed, most of them, has nothing left to flag or to count.
#define SPEX_SEEN_LOW 1
#define SPEX_SEEN_FRESH 2

// The key of a double in the total order of Rust's f64::total_cmp, as an unsigned integer.
__device__ __forceinline__ unsigned long long total_order_key(double v) {
    unsigned long long b = (unsigned long long)__double_as_longlong(v);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}

__device__ __forceinline__ double from_total_order_key(unsigned long long k) {
    unsigned long long b = (k >> 63) ? (k & 0x7fffffffffffffffull) : ~k;
    return __longlong_as_double((long long)b);
}

// The pixels of a box that a thread visits, strided by the block: a StridedWalk (row and
// column kept up to date without a division per pixel, which bound the test's passes) with
// the pixel's index.
struct PixelWalk : StridedWalk {
    int q;
    __device__ __forceinline__ explicit PixelWalk(int width)
        : StridedWalk(threadIdx.x, blockDim.x, width), q(threadIdx.x) {}
    __device__ __forceinline__ void next() {
        q += blockDim.x;
        StridedWalk::next();
    }
};

#define SPEX_FOR_PIXELS(t, px) for (PixelWalk px((t).width); px.q < (t).len; px.next())

// What the test of one patch reads: its box on the CCD and in the box arrays, the image.
struct TestedBox {
    const double* model;
    const unsigned char* core;
    unsigned char* rejected;
    const float* pix;
    const float* ivar;
    int r0, c0, width, len, sub_row0, sub_col0, sub_w;

    __device__ int height() const { return len / width; }
    __device__ size_t image_index(int r, int c) const {
        return (size_t)(r0 + r - sub_row0) * sub_w + (c0 + c - sub_col0);
    }
    // The pixel's weight at the start of the pass: 0 where rejected before.
    __device__ double weight(int q, int r, int c) const {
        return rejected[q] == SPEX_REJECTED || rejected[q] == SPEX_FRESH
                   ? 0.0
                   : (double)ivar[image_index(r, c)];
    }
    __device__ bool weighted(int q, int r, int c) const { return weight(q, r, c) > 0.0; }
    __device__ bool tested(int q, int r, int c) const { return core[q] && weighted(q, r, c); }
    // outliers::find_outliers' pull, with its operations in its order (no fused multiply-add).
    __device__ double pull(int q, int r, int c, double rn2, double psferr) const {
        double m = model[q], pm = __dmul_rn(psferr, m);
        double var = __dadd_rn(__dadd_rn(rn2, fmax(m, 0.0)), __dmul_rn(pm, pm));
        return ((double)pix[image_index(r, c)] - m) / sqrt(var);
    }
    // Whether the pass has taken q by growth (seeds included); not those of its contrast.
    __device__ bool taken(int q) const {
        return rejected[q] == SPEX_NEW_OUTLIER || rejected[q] == SPEX_SEED;
    }
    // Whether a pixel of the 8 around (r, c) (within the box) is taken.
    __device__ bool touches_taken(int r, int c) const {
        int h = height();
        for (int dr = -1; dr <= 1; dr++)
            for (int dc = -1; dc <= 1; dc++) {
                int rr = r + dr, cc = c + dc;
                if ((dr || dc) && rr >= 0 && cc >= 0 && cc < width && rr < h &&
                    taken(rr * width + cc))
                    return true;
            }
        return false;
    }
    // Whether a seed lies within `reach` rows and columns of (r, c).
    __device__ bool near_seed(int r, int c, int reach) const {
        int h = height();
        for (int rr = max(r - reach, 0); rr <= min(r + reach, h - 1); rr++)
            for (int cc = max(c - reach, 0); cc <= min(c + reach, width - 1); cc++)
                if (rejected[rr * width + cc] == SPEX_SEED) return true;
        return false;
    }
};

// The rules of a positive pass beyond the growth (outliers.rs' constants).
struct PassRules {
    double nsigma, grow_nsigma, sharp_nsigma, sharp_fraction, contrast_nsigma;
    int reach, edge;
};

// The median of the pulls of (r, c)'s neighbours (within the box) that `counts`, into
// `median`; false for none. outliers::median: sorted in the total order of f64::total_cmp, the
// mean of the middle two for an even count.
template <typename Counts>
__device__ bool neighbour_median(const TestedBox& t, int r, int c, double rn2, double psferr,
                                 Counts counts, double* median) {
    double v[8];
    unsigned long long k[8];
    int n = 0, h = t.height();
    for (int dr = -1; dr <= 1; dr++)
        for (int dc = -1; dc <= 1; dc++) {
            int rr = r + dr, cc = c + dc, x = rr * t.width + cc;
            if (!(dr || dc) || rr < 0 || cc < 0 || cc >= t.width || rr >= h ||
                !counts(x, rr, cc))
                continue;
            double pl = t.pull(x, rr, cc, rn2, psferr);
            unsigned long long key = total_order_key(pl);
            int i = n++;
            for (; i > 0 && k[i - 1] > key; i--) {
                k[i] = k[i - 1];
                v[i] = v[i - 1];
            }
            k[i] = key;
            v[i] = pl;
        }
    if (n == 0) return false;
    *median = (n & 1) ? v[n / 2] : __dmul_rn(__dadd_rn(v[n / 2 - 1], v[n / 2]), 0.5);
    return true;
}

// outliers::Pulls::sharp: an untested pixel (pull `pl`) that is a seed.
__device__ bool sharp(const TestedBox& t, int q, int r, int c, double pl, double rn2,
                      double psferr, const PassRules& rules) {
    int e = rules.edge;
    if (t.core[q] || pl <= rules.sharp_nsigma) return false;
    if (r < e || r + e >= t.height() || c < e || c + e >= t.width) return false;
    double m;
    auto weighted = [&](int x, int rr, int cc) { return t.weighted(x, rr, cc); };
    return neighbour_median(t, r, c, rn2, psferr, weighted, &m) &&
           m < __dmul_rn(rules.sharp_fraction, pl);
}

// Whether the pixel (q, r, c), not taken, joins the growth.
__device__ __forceinline__ bool grows_into(const TestedBox& t, int q, int r, int c, double rn2,
                                           double psferr, const PassRules& rules) {
    return t.weighted(q, r, c) && t.pull(q, r, c, rn2, psferr) > rules.grow_nsigma &&
           (t.core[q] || t.near_seed(r, c, rules.reach));
}

// What grows_into asks, a byte per pixel of a box of at most SPEX_MAP_PIXELS, in shared
// memory: `hot` from the pass that finds the seeds (HOT_UNTESTED or HOT_TESTED for a pixel
// with weight beyond grow_nsigma, 0 otherwise), `near` (nonzero within reach of a seed)
// once they are known. Each round of the growth then reads two bytes of shared memory
// where grows_into read the image, the model and the flags and looked around for a seed.
#define SPEX_HOT_UNTESTED 1
#define SPEX_HOT_TESTED 2
struct GrowthMaps {
    unsigned char* hot;
    unsigned char* near;

    __device__ bool joins(int q) const {
        return hot[q] == SPEX_HOT_TESTED || (hot[q] == SPEX_HOT_UNTESTED && near[q]);
    }
};

// Whether the tested pixel (q, r, c), next to a taken one, stands out of its own neighbours.
__device__ __forceinline__ bool stands_out(const TestedBox& t, int q, int r, int c, double rn2,
                                           double psferr, const PassRules& rules) {
    auto untaken = [&](int x, int rr, int cc) { return t.tested(x, rr, cc) && !t.taken(x); };
    double m;
    return neighbour_median(t, r, c, rn2, psferr, untaken, &m) &&
           __dsub_rn(t.pull(q, r, c, rn2, psferr), m) > rules.contrast_nsigma;
}

// Buckets of a round of the median's selection, SPEX_MEDIAN_BUCKETS / SPEX_TEST_THREADS a
// thread, and log2 of it.
#define SPEX_MEDIAN_BUCKETS 1024
#define SPEX_MEDIAN_BUCKET_BITS 10
// Most keys the median's last round ranks among themselves in shared memory.
#define SPEX_MEDIAN_CANDIDATES 256

// What the median's selection keeps between its rounds (in shared memory): the range of keys
// that holds the median, the median's rank among the keys within it, and how many they are.
struct MedianRange {
    unsigned long long lo, hi;
    unsigned int rank, count;
};

// The key of 1/ivar - max(model, 0) at q; false where the pixel has no weight.
__device__ __forceinline__ bool noise_key(const TestedBox& t, const PixelWalk& px,
                                          unsigned long long* key) {
    double iv = t.weight(px.q, px.row, px.col);
    if (!(iv > 0.0)) return false;
    *key = total_order_key(1.0 / iv - fmax(t.model[px.q], 0.0));
    return true;
}

// The sum of `v` over the threads of the block before this one, through the shared `warps`
// (one per warp; every warp of the block is whole).
__device__ unsigned int block_sum_before(unsigned int v, unsigned int* warps) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    unsigned int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warps[wid] = x;
    __syncthreads();
    unsigned int before = 0;
    for (int i = 0; i < wid; i++) before += warps[i];
    __syncthreads();
    return before + x - v;
}

// One round of the selection (lo < hi): the keys within the range counted in
// SPEX_MEDIAN_BUCKETS buckets of equal width, and the range narrowed to the bucket that holds
// the median (a bucket is a range of keys, so the order is kept).
__device__ void narrow(const TestedBox& t, MedianRange& r, unsigned int* hist,
                       unsigned int* warps) {
    unsigned long long lo = r.lo, hi = r.hi;
    int shift = max(64 - __clzll(hi - lo) - SPEX_MEDIAN_BUCKET_BITS, 0);
    for (int i = threadIdx.x; i < SPEX_MEDIAN_BUCKETS; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    SPEX_FOR_PIXELS(t, px) {
        unsigned long long key;
        if (noise_key(t, px, &key) && key >= lo && key <= hi)
            atomicAdd(&hist[(key - lo) >> shift], 1u);
    }
    __syncthreads();
    const int per = SPEX_MEDIAN_BUCKETS / SPEX_TEST_THREADS;
    unsigned int mine = 0;
    for (int i = 0; i < per; i++) mine += hist[threadIdx.x * per + i];
    unsigned int before = block_sum_before(mine, warps);
    unsigned int rank = r.rank;
    __syncthreads();
    if (rank >= before && rank < before + mine) {
        unsigned int left = rank - before;
        int d = threadIdx.x * per;
        while (left >= hist[d]) left -= hist[d++];
        unsigned long long width = (1ull << shift) - 1;
        unsigned long long from = lo + ((unsigned long long)d << shift);
        r.lo = from;
        r.hi = hi - from > width ? from + width : hi;
        r.rank = left;
        r.count = hist[d];
    }
    __syncthreads();
}

// The last round: the keys within the range (at most SPEX_MEDIAN_CANDIDATES) gathered in
// `keys`, and the one of the median's rank among them.
__device__ unsigned long long rank_in_range(const TestedBox& t, const MedianRange& r,
                                            unsigned long long* keys) {
    __shared__ unsigned int s_count;
    __shared__ unsigned long long s_key;
    if (threadIdx.x == 0) s_count = 0;
    __syncthreads();
    unsigned long long lo = r.lo, hi = r.hi;
    SPEX_FOR_PIXELS(t, px) {
        unsigned long long key;
        if (noise_key(t, px, &key) && key >= lo && key <= hi) keys[atomicAdd(&s_count, 1u)] = key;
    }
    __syncthreads();
    unsigned int count = s_count, rank = r.rank;
    for (unsigned int i = threadIdx.x; i < count; i += blockDim.x) {
        unsigned long long k = keys[i];
        unsigned int less = 0, same = 0;
        for (unsigned int j = 0; j < count; j++) {
            less += keys[j] < k;
            same += keys[j] == k;
        }
        // equal keys are equal values: every thread that finds the rank writes the same
        if (less <= rank && rank < less + same) s_key = k;
    }
    __syncthreads();
    return s_key;
}

// The median of 1/ivar - max(model, 0) over the box's pixels with weight (the element of rank
// n/2 in the total order, as select_nth_unstable_by), into `median`; false (in every thread)
// for a box without weight. A selection over the values' keys: their range, then rounds that
// narrow it to the bucket holding the median until a few keys are left, ranked in shared
// memory. A box's values mostly lie within a few binades of the read noise, so that one or
// two rounds isolate the median: 3-4 passes over the box where a radix selection by bytes
// took 9.
__device__ bool read_noise_median(const TestedBox& t, double* median) {
    __shared__ unsigned int hist[SPEX_MEDIAN_BUCKETS];
    __shared__ unsigned long long keys[SPEX_MEDIAN_CANDIDATES];
    __shared__ unsigned int warps[SPEX_TEST_THREADS / 32];
    __shared__ MedianRange s_range;
    __shared__ unsigned int s_n;
    if (threadIdx.x == 0) {
        s_range.lo = ~0ull;
        s_range.hi = 0;
        s_n = 0;
    }
    __syncthreads();
    unsigned int mine = 0;
    unsigned long long lo = ~0ull, hi = 0;
    SPEX_FOR_PIXELS(t, px) {
        unsigned long long key;
        if (!noise_key(t, px, &key)) continue;
        mine++;
        lo = min(lo, key);
        hi = max(hi, key);
    }
    atomicAdd(&s_n, mine);
    if (mine) {
        atomicMin(&s_range.lo, lo);
        atomicMax(&s_range.hi, hi);
    }
    __syncthreads();
    unsigned int n = s_n;
    if (n == 0) return false;
    if (threadIdx.x == 0) {
        s_range.rank = n / 2;
        s_range.count = n;
    }
    __syncthreads();
    while (s_range.count > SPEX_MEDIAN_CANDIDATES && s_range.lo != s_range.hi)
        narrow(t, s_range, hist, warps);
    unsigned long long key = s_range.lo == s_range.hi ? s_range.lo : rank_in_range(t, s_range, keys);
    *median = from_total_order_key(key);
    return true;
}

// Sum of `v` over the block through the shared `total`, which every thread reads after.
__device__ unsigned int block_count(unsigned int v, unsigned int* total) {
    if (threadIdx.x == 0) *total = 0;
    __syncthreads();
    atomicAdd(total, v);
    __syncthreads();
    unsigned int all = *total;
    __syncthreads();
    return all;
}

// Pixels taken by a pass that its growth keeps in a list (shared memory; `list_cap` of them,
// at most), and the box pixels a bitmap can mark as claimed; a pass with more, or a larger
// box, grows by rounds over the whole box instead.
#define SPEX_TAKEN_LIST 4096
#define SPEX_CLAIM_PIXELS 65536

// Bytes of outlier_test's dynamic shared memory (src/backend/cuda/reject.rs, TEST_SHARED):
// the list and bitmap above, then the growth's two maps (GrowthMaps) of a box of at most
// SPEX_MAP_PIXELS, 8192 (a full r frame's boxes hold 5700-7900); a larger box grows as before.
// Under the 48 KB a block has without asking, so that the SM keeps the rest of its memory as
// L1 for the model and the image: with 64 KB, and the SM's memory made shared to fit two
// blocks, a full r frame's tests took 2.86 ms instead of 2.38 (ncu, an H200).
#define SPEX_TEST_SHARED 40960
#define SPEX_MAP_PIXELS ((SPEX_TEST_SHARED - SPEX_TAKEN_LIST * 4 - SPEX_CLAIM_PIXELS / 8) / 2)

// A pass's taken pixels in the order they were taken (seeds first) and the bitmap of the
// pixels its growth has claimed, in shared memory.
struct Frontier {
    int* list;
    unsigned int cap;
    unsigned int* len;
    unsigned int* claimed;
    int* over;

    // Adds q to the list; past its end, marks the list as overflowed.
    __device__ void add(int q) const {
        unsigned int i = atomicAdd(len, 1u);
        if (i < cap)
            list[i] = q;
        else
            *over = 1;
    }
    // Whether this thread is the first to claim q.
    __device__ bool claim(int q) const {
        unsigned int bit = 1u << (q & 31);
        return !(atomicOr(&claimed[q >> 5], bit) & bit);
    }
};

// Neighbour k (0-7) of the box pixel p, as its row, column and index: false where it lies
// outside the box or has a flag already (rejected before, or taken by this pass).
__device__ __forceinline__ bool free_neighbour(const TestedBox& t, int p, int k, int* r, int* c,
                                               int* q) {
    int cell = k < 4 ? k : k + 1;
    *r = p / t.width + cell / 3 - 1;
    *c = p % t.width + cell % 3 - 1;
    *q = *r * t.width + *c;
    return *r >= 0 && *c >= 0 && *c < t.width && *r < t.height() && t.rejected[*q] == 0;
}

// Widens each nonzero byte of the `n` lines of `len` bytes, `stride` apart within a line and
// `step` between lines, to `reach` places on either side, in place: a thread per line walks
// it once, remembering where it last saw one (written `reach` places behind what it reads).
__device__ void widen_lines(unsigned char* map, int n, int len, int stride, int step,
                            int reach) {
    for (int line = threadIdx.x; line < n; line += blockDim.x) {
        unsigned char* v = map + line * step;
        int last = -2 * reach - 1;
        for (int i = 0; i < len + reach; i++) {
            if (i < len && v[i * stride]) last = i;
            int x = i - reach;
            if (x >= 0) v[x * stride] = last >= x - reach;
        }
    }
}

// Turns `near`, nonzero at the seeds, into the map of the pixels within `reach` rows and
// columns of a seed (what near_seed finds by looking around a pixel): along the rows, then
// along the columns.
__device__ void reach_of_seeds(const TestedBox& t, int reach, unsigned char* near) {
    int h = t.height();
    widen_lines(near, h, t.width, 1, t.width, reach);
    __syncthreads();
    widen_lines(near, t.width, h, t.width, 1, reach);
}

// The growth from the seeds in `f`, ring by ring: each round looks only at the 8 neighbours
// of the pixels the round before took, so that a pass costs the track's pixels, not the box
// times the rounds (with the walk without divisions, the test of a 650-patch wave took 468 us
// instead of 821 on an H200, docs/benchmarks.md). The same pixels as the rounds over the box
// (a closure does not depend on the order). False, in every thread, when the list overflowed
// (some taken pixels are not in it). With `maps` (hot given), a round reads them alone: the
// tests of a full r frame took 2.8 ms instead of 3.8 (ncu, an H200; with the early end of a
// patch without seeds, outlier_test's s_seen), where each round's longest chain was a thread
// evaluating a pixel and looking for a seed among the 17 x 17 around it.
__device__ bool grow_by_frontier(const TestedBox& t, double rn2, double psferr,
                                 const PassRules& rules, const Frontier& f,
                                 const GrowthMaps& maps) {
    __syncthreads();
    if (*f.over) return false;
    if (maps.hot) reach_of_seeds(t, rules.reach, maps.near);
    unsigned int from = 0;
    for (;;) {
        __syncthreads();
        unsigned int to = min(*f.len, f.cap);
        bool over = *f.over;
        __syncthreads();
        if (over) return false;
        if (from == to) return true;
        for (unsigned int i = threadIdx.x; i < 8 * (to - from); i += blockDim.x) {
            int r, c, q;
            if (!free_neighbour(t, f.list[from + i / 8], i % 8, &r, &c, &q)) continue;
            bool joins = maps.hot ? maps.joins(q) : grows_into(t, q, r, c, rn2, psferr, rules);
            if (joins && f.claim(q)) {
                t.rejected[q] = SPEX_NEW_OUTLIER;
                f.add(q);
            }
        }
        from = to;
    }
}

// The growth by rounds over the whole box until none joins, and the contrast rule over the
// whole box: where the frontier's list overflowed.
__device__ void grow_by_rounds(const TestedBox& t, double rn2, double psferr,
                               const PassRules& rules) {
    int joined;
    do {
        joined = 0;
        SPEX_FOR_PIXELS(t, px) {
            if (t.rejected[px.q] == 0 && t.touches_taken(px.row, px.col) &&
                grows_into(t, px.q, px.row, px.col, rn2, psferr, rules)) {
                t.rejected[px.q] = SPEX_NEW_OUTLIER;
                joined = 1;
            }
        }
    } while (__syncthreads_or(joined));
    SPEX_FOR_PIXELS(t, px) {
        if (t.rejected[px.q] == 0 && t.tested(px.q, px.row, px.col) && t.touches_taken(px.row, px.col) &&
            stands_out(t, px.q, px.row, px.col, rn2, psferr, rules))
            t.rejected[px.q] = SPEX_CONTRAST;
    }
    __syncthreads();
}

// The contrast rule over the neighbours of the listed taken pixels: each candidate is judged
// against the taken pixels alone (a pixel of the contrast does not count as taken), so that
// the threads' order, and a candidate met twice, do not matter.
__device__ void contrast_by_list(const TestedBox& t, double rn2, double psferr,
                                 const PassRules& rules, const Frontier& f) {
    unsigned int n = *f.len;
    for (unsigned int i = threadIdx.x; i < 8 * n; i += blockDim.x) {
        int r, c, q;
        if (!free_neighbour(t, f.list[i / 8], i % 8, &r, &c, &q)) continue;
        if (t.tested(q, r, c) && stands_out(t, q, r, c, rn2, psferr, rules))
            t.rejected[q] = SPEX_CONTRAST;
    }
    __syncthreads();
}

// One block per tested patch: outliers::find_outliers on its box (the same pixels), the
// outliers flagged in `rejected` for its next solve and counted in `counts[p]`; none for a
// patch flagged in `untested` (when given: a re-solve wave's patch whose solve is its last).
// The seeds (the tested pixels beyond nsigma and the sharp untested ones) grow into the
// 8-connected pixels beyond `grow_nsigma`; then the contrast rule takes the neighbours that
// stand out of theirs. Without a seed, the tested pixels below -nsigma are the outliers. A box
// of at most `map_cap` pixels (and SPEX_MAP_PIXELS) grows from its maps (GrowthMaps).
extern "C" __global__ void __launch_bounds__(SPEX_TEST_THREADS, 2) outlier_test(
    const double* __restrict__ model, const unsigned char* __restrict__ core,
    unsigned char* rejected, const int* __restrict__ boxes,
    const long long* __restrict__ boxoff, const float* __restrict__ pix,
    const float* __restrict__ ivar, int sub_row0, int sub_col0, int sub_w, double nsigma,
    double psferr, double grow_nsigma, double sharp_nsigma, double sharp_fraction,
    double contrast_nsigma, int reach, int edge, int list_cap, int map_cap,
    int* __restrict__ counts, const int* __restrict__ untested) {
    __shared__ unsigned int s_total, s_len, s_seen;
    __shared__ int s_over;
    // SPEX_TEST_SHARED bytes: the growth's list, bitmap and maps
    extern __shared__ int s_list[];
    unsigned int* s_claimed = (unsigned int*)(s_list + SPEX_TAKEN_LIST);
    unsigned char* s_maps = (unsigned char*)(s_claimed + SPEX_CLAIM_PIXELS / 32);
    int p = blockIdx.x;
    if (untested && untested[p]) {
        if (threadIdx.x == 0) counts[p] = 0;
        return;
    }
    int r0 = boxes[4 * p], r1 = boxes[4 * p + 1], c0 = boxes[4 * p + 2], c1 = boxes[4 * p + 3];
    size_t at = boxoff[p];
    TestedBox t{model + at, core + at, rejected + at, pix, ivar, r0, c0, c1 - c0,
                (r1 - r0) * (c1 - c0), sub_row0, sub_col0, sub_w};
    PassRules rules{nsigma, grow_nsigma, sharp_nsigma, sharp_fraction, contrast_nsigma, reach,
                    edge};
    Frontier f{s_list, (unsigned int)min(max(list_cap, 0), SPEX_TAKEN_LIST), &s_len, s_claimed,
               &s_over};
    double median;
    if (!read_noise_median(t, &median)) {
        if (threadIdx.x == 0) counts[p] = 0;
        return;
    }
    if (threadIdx.x == 0) {
        s_len = 0;
        s_seen = 0;
        s_over = t.len > SPEX_CLAIM_PIXELS;
    }
    for (int i = threadIdx.x; i < SPEX_CLAIM_PIXELS / 32; i += blockDim.x) s_claimed[i] = 0;
    __syncthreads();
    double rn2 = fmax(median, 0.0);
    GrowthMaps maps{nullptr, nullptr};
    if (t.len <= min(map_cap, SPEX_MAP_PIXELS))
        maps = GrowthMaps{s_maps, s_maps + SPEX_MAP_PIXELS};
    SPEX_FOR_PIXELS(t, px) {
        bool weighted = t.weighted(px.q, px.row, px.col);
        double pl = weighted ? t.pull(px.q, px.row, px.col, rn2, psferr) : 0.0;
        if (maps.hot)
            maps.hot[px.q] = !(weighted && pl > grow_nsigma) ? 0
                             : t.core[px.q]                  ? SPEX_HOT_TESTED
                                                             : SPEX_HOT_UNTESTED;
        if (t.rejected[px.q] == SPEX_FRESH) atomicOr(&s_seen, SPEX_SEEN_FRESH);
        bool seed = weighted && ((t.core[px.q] && pl > nsigma) ||
                                 sharp(t, px.q, px.row, px.col, pl, rn2, psferr, rules));
        if (maps.hot) maps.near[px.q] = seed;
        if (!weighted) continue;
        if (t.core[px.q] && pl < -nsigma) atomicOr(&s_seen, SPEX_SEEN_LOW);
        if (seed) {
            t.rejected[px.q] = SPEX_SEED;
            f.add(px.q);
        }
    }
    __syncthreads();
    if (s_len == 0 && s_seen == 0) {
        if (threadIdx.x == 0) counts[p] = 0;
        return;
    }
    if (s_len > 0) {
        if (grow_by_frontier(t, rn2, psferr, rules, f, maps))
            contrast_by_list(t, rn2, psferr, rules, f);
        else
            grow_by_rounds(t, rn2, psferr, rules);
    } else if (s_seen & SPEX_SEEN_LOW) {
        SPEX_FOR_PIXELS(t, px) {
            if (t.tested(px.q, px.row, px.col) && t.pull(px.q, px.row, px.col, rn2, psferr) < -nsigma)
                t.rejected[px.q] = SPEX_NEW_OUTLIER;
        }
        __syncthreads();
    }
    // the last test's outliers are in this solve's equations; this one's go to the next
    unsigned int mine = 0;
    for (int q = threadIdx.x; q < t.len; q += blockDim.x) {
        unsigned char r = t.rejected[q];
        if (r == SPEX_FRESH) {
            t.rejected[q] = SPEX_REJECTED;
        } else if (r > SPEX_REJECTED) {
            t.rejected[q] = SPEX_FRESH;
            mine++;
        }
    }
    unsigned int found = block_count(mine, &s_total);
    if (threadIdx.x == 0) counts[p] = (int)found;
}

// After a test, before its patches' equations are overwritten by the next wave: a slot of
// `kept` for each of the wave's `n` patches with outliers (counts[p] > 0), in the wave's
// order from the frame's count `next` on, -1 for the others and beyond `capacity` (those are
// assembled again). The order, not the device's timing, decides which patches get one. One
// block; each thread takes a run of consecutive patches.
extern "C" __global__ void __launch_bounds__(1024) kept_slots(const int* __restrict__ counts,
                                                              int n, int capacity,
                                                              int* __restrict__ next,
                                                              int* __restrict__ slots) {
    __shared__ unsigned int s_warps[32];
    int per = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    int lo = min(n, (int)threadIdx.x * per), hi = min(n, lo + per);
    unsigned int mine = 0;
    for (int i = lo; i < hi; i++) mine += counts[i] > 0;
    unsigned int before = block_sum_before(mine, s_warps);
    int base = *next;
    int at = base + (int)before;
    for (int i = lo; i < hi; i++) {
        bool with = counts[i] > 0;
        slots[i] = with && at < capacity ? at : -1;
        at += with;
    }
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) *next = at;
}

// Copies the normal equations of the wave's patch blockIdx.y, as its assembly left them
// (icov's regularised diagonal aside, which diag0 restores), into its slot of `kept` where it
// has one (kernels/common.cuh, KeptLayout), and lists there the pixels of its box the test
// just rejected (SPEX_FRESH), in any order: the downdate only asks whether a spot holds one.
// No kernel of the Schur route writes the equations after the assembly: its sweeps and the
// decorrelation have their own buffers.
extern "C" __global__ void keep_equations(const int* __restrict__ slots,
                                          const double* __restrict__ icov,
                                          const double* __restrict__ y,
                                          const double* __restrict__ fw,
                                          const double* __restrict__ diag0,
                                          const double* __restrict__ pixmask,
                                          const unsigned char* __restrict__ rejected,
                                          const int* __restrict__ boxes,
                                          const long long* __restrict__ boxoff, int m,
                                          int row_len, int nmask, double* __restrict__ kept) {
    __shared__ int s_len;
    int p = blockIdx.y, slot = slots[p];
    if (slot < 0) return;
    KeptLayout k{m, row_len, nmask};
    double* to = kept + (size_t)slot * k.size();
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) s_len = 0;
        __syncthreads();
        int width = boxes[4 * p + 3] - boxes[4 * p + 2];
        int len = (boxes[4 * p + 1] - boxes[4 * p]) * width;
        const unsigned char* flags = rejected + boxoff[p];
        for (int q = threadIdx.x; q < len; q += blockDim.x) {
            if (flags[q] != SPEX_FRESH) continue;
            int at = atomicAdd(&s_len, 1);
            if (at < SPEX_KEPT_LIST)
                to[k.fresh() + 1 + at] = (double)((q / width) << 16 | q % width);
        }
        __syncthreads();
        if (threadIdx.x == 0) to[k.fresh()] = (double)s_len;
    }
    size_t step = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const double* a = icov + (size_t)p * k.y();
    for (size_t i = first; i < k.y(); i += step) to[i] = a[i];
    for (size_t i = first; i < (size_t)m; i += step) {
        to[k.y() + i] = y[(size_t)p * m + i];
        to[k.fw() + i] = fw[(size_t)p * m + i];
        to[k.diag0() + i] = diag0[(size_t)p * m + i];
    }
    for (size_t i = first; i < (size_t)nmask; i += step)
        to[k.pixmask() + i] = pixmask[(size_t)p * nmask + i];
}
