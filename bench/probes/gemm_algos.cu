// Does cuBLAS's default GEMM leave speed on the table for Quiver's shapes? For each
// y[m, n] = x[m, k] · W[n, k]ᵀ (bf16 operands, f32 output and accumulation, as `blas.rs` calls
// it) this times cublasGemmEx's default against every algorithm cublasLt's heuristic offers
// (up to 32), on weights rotated over enough copies that none is served from L2.
//
// Built and run on the GPU machine: nvcc -O2 -arch=sm_90 gemm_algos.cu -lcublasLt -lcublas
// Output: one line per (shape, m): default µs, best Lt µs, the best's index, the bytes-bound
// and FLOP-bound µs (from the bandwidth and peak given in argv: TB/s, TFLOP/s).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <functional>

#define CK(x) do { auto e = (x); if (e != 0) { fprintf(stderr, "%s:%d %s = %d\n", __FILE__, __LINE__, #x, (int)e); exit(1); } } while (0)

struct Shape { const char* name; int n, k; };

static float time_it(cudaStream_t s, int reps, const std::function<void(int)>& f) {
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 3; ++i) f(i);
    cudaEventRecord(a, s);
    for (int i = 0; i < reps; ++i) f(i);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a); cudaEventDestroy(b);
    return ms * 1000.f / reps;
}

int main(int argc, char** argv) {
    const double tbs = argc > 1 ? atof(argv[1]) : 3.0, tflops = argc > 2 ? atof(argv[2]) : 790.0;
    std::vector<Shape> shapes = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336}, {"lm_head", 128256, 4096}};
    std::vector<int> ms = {16, 64, 128, 256, 512, 2048};
    cudaStream_t s; CK(cudaStreamCreate(&s));
    cublasHandle_t h; CK(cublasCreate(&h)); CK(cublasSetStream(h, s));
    cublasLtHandle_t lt; CK(cublasLtCreate(&lt));
    size_t ws_bytes = 64 << 20; void* ws; CK(cudaMalloc(&ws, ws_bytes));
    CK(cublasSetWorkspace(h, ws, ws_bytes));
    printf("%-8s %5s %10s %10s %5s %8s %10s %10s\n", "shape", "m", "default", "best_lt", "algo", "gain", "bytes_us", "flops_us");
    for (auto& sh : shapes) {
        const size_t wbytes = (size_t)sh.n * sh.k * 2;
        const int copies = std::max<size_t>(2, (size_t)(400u << 20) / wbytes + 1);
        std::vector<void*> w(copies);
        for (auto& p : w) { CK(cudaMalloc(&p, wbytes)); CK(cudaMemset(p, 0x3c, wbytes)); }
        for (int m : ms) {
            if (sh.n == 128256 && m > 256) continue;
            void *x, *y;
            CK(cudaMalloc(&x, (size_t)m * sh.k * 2)); CK(cudaMemset(x, 0x3c, (size_t)m * sh.k * 2));
            CK(cudaMalloc(&y, (size_t)m * sh.n * 4));
            const float one = 1.f, zero = 0.f;
            // Column-major: yᵀ (n×m) = Wᵀ-op · xᵀ, W stored [n][k] → op T with ld k.
            auto dflt = [&](int i) {
                CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, m, sh.k, &one, w[i % copies], CUDA_R_16BF, sh.k, x, CUDA_R_16BF, sh.k, &zero, y, CUDA_R_32F, sh.n,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            };
            const int reps = 30;
            const float t_def = time_it(s, reps, dflt);
            cublasLtMatmulDesc_t op; CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
            CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
            CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
            cublasLtMatrixLayout_t la, lb, lc;
            CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, sh.k, sh.n, sh.k));
            CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, sh.k, m, sh.k));
            CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, sh.n, m, sh.n));
            cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
            CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
            cublasLtMatmulHeuristicResult_t res[32]; int got = 0;
            CK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 32, res, &got));
            float best = 1e30f; int bi = -1;
            for (int a = 0; a < got; ++a) {
                if (res[a].state != CUBLAS_STATUS_SUCCESS) continue;
                bool ok = true;
                auto run = [&](int i) {
                    auto e = cublasLtMatmul(lt, op, &one, w[i % copies], la, x, lb, &zero, y, lc, y, lc, &res[a].algo, ws, ws_bytes, s);
                    if (e != CUBLAS_STATUS_SUCCESS) ok = false;
                };
                const float t = time_it(s, reps, run);
                if (ok && t < best) { best = t; bi = a; }
            }
            const double bytes = (double)sh.n * sh.k * 2 + (double)m * sh.k * 2 + (double)m * sh.n * 4;
            const double flops = 2.0 * m * sh.n * sh.k;
            printf("%-8s %5d %10.2f %10.2f %5d %8.3f %10.2f %10.2f\n", sh.name, m, t_def, best, bi, t_def / best, bytes / (tbs * 1e6), flops / (tflops * 1e6));
            fflush(stdout);
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatmulDescDestroy(op);
            cudaFree(x); cudaFree(y);
        }
        for (auto p : w) cudaFree(p);
    }
    return 0;
}
