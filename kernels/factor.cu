// Helpers around the batched Cholesky factorisation (cuSOLVER) and the triangular solves
// (cuBLAS) that give the core blocks of icov^-1.

#include "common.cuh"

// `count` identity matrices of order n, back to back (the right-hand side of L22 X = I).
extern "C" __global__ void eye_f64(double* __restrict__ x, int n, long long count) {
    long long total = (long long)n * n * count;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long e = i % ((long long)n * n);
        x[i] = (e / n == e % n) ? 1.0 : 0.0;
    }
}
