// GEMMs on cuBLASLt. "matmul": f32 operands, f32 compute (CUBLAS_COMPUTE_32F: no TF32, so results
// match the CPU's f32 GEMMs to rounding). "matmul_bf16": operands rounded to bf16 (nearest even) into
// scratch, or read from a weight's registered bf16 image (converted once per forward by the model), bf16 x
// bf16 products accumulated in f32, f32 output; the same math as the CPU bf16 engines.
//
// Row-major X (r, c) is column-major X^T (c, r); cuBLASLt is column-major, so (ops.h shapes)
//   out  = inp W^T          -> out^T (OC,N)  = op_T(W (C,OC)) * inp^T (C,N)
//   dinp += dout W          -> dinp^T (C,N)  = W (C,OC) * dout^T (OC,N)
//   dW (+)= dout^T inp      -> dW^T (C,OC)   = inp^T (C,N) * op_T(dout^T (OC,N))
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "device/cuda/cuda_common.cuh"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

// Largest power of two (<= 256) dividing the address: cuBLASLt's heuristic assumes 256-byte aligned
// operands unless told, and sub-matrices (an expert's rows) are not.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) fail("cuBLASLt error ", static_cast<int>(s), " in ", what);
}

constexpr size_t kWorkspaceBytes = 32ull << 20;

struct Lt {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::mutex mu;
  // Algorithm per problem: the heuristic query costs more than a small GEMM.
  std::map<std::tuple<int, int, int, int, int64_t, int64_t, int64_t, bool, uint32_t, uint32_t, uint32_t>,
           cublasLtMatmulHeuristicResult_t>
      algos;
};
Lt& lt() {
  static Lt* l = [] {
    auto* x = new Lt;
    check_lt(cublasLtCreate(&x->handle), "cublasLtCreate");
    TITAN_CUDA_CHECK(cudaMalloc(&x->workspace, kWorkspaceBytes));
    return x;
  }();
  return *l;
}

}  // namespace

// D (m,n) = alpha op(A) op(B) + beta D, column-major, A/B of `ab_type` (f32 or bf16), D of `d_type` (f32,
// or bf16 with beta = 0: the f32 accumulators rounded to bf16 by the epilogue).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
          int64_t ldb, void* D, int64_t ldd, float beta, cudaDataType_t ab_type, float alpha = 1.0f,
          cudaDataType_t d_type = CUDA_R_32F) {
  if (m == 0 || n == 0) return;
  const size_t d_bytes = d_type == CUDA_R_16BF ? 2 : 4;
  if (k == 0) {  // empty sum: D = beta D
    if (beta == 0.0f) TITAN_CUDA_CHECK(cudaMemsetAsync(D, 0, d_bytes * (ldd * (n - 1) + m), cuda_stream()));
    return;
  }
  Lt& L = lt();
  cublasLtMatmulDesc_t op;
  check_lt(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), "TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), "TRANSB");
  cublasLtMatrixLayout_t la, lb, ld;
  check_lt(cublasLtMatrixLayoutCreate(&la, ab_type, ta ? k : m, ta ? m : k, lda), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&lb, ab_type, tb ? n : k, tb ? k : n, ldb), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&ld, d_type, m, n, ldd), "layout D");
  cublasLtMatmulHeuristicResult_t algo{};
  {
    std::lock_guard<std::mutex> g(L.mu);
    const uint32_t al_a = alignment(A), al_b = alignment(B), al_d = alignment(D);
    auto key =
        std::make_tuple(int(ab_type), int(d_type), int(ta), int(tb), m, n, k, beta != 0.0f, al_a, al_b, al_d);
    auto it = L.algos.find(key);
    if (it == L.algos.end()) {
      cublasLtMatmulPreference_t pref;
      check_lt(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
      size_t ws = kWorkspaceBytes;
      check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                    sizeof(ws)),
               "workspace");
      for (auto [attr, al] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a},
                              std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b},
                              std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_d},
                              std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_d}})
        check_lt(cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al)), "alignment");
      int found = 0;
      check_lt(cublasLtMatmulAlgoGetHeuristic(L.handle, op, la, lb, ld, ld, pref, 1, &algo, &found),
               "AlgoGetHeuristic");
      cublasLtMatmulPreferenceDestroy(pref);
      TITAN_CHECK(found > 0, "cuBLASLt has no algorithm for a ", m, "x", n, "x", k, " GEMM");
      it = L.algos.emplace(key, algo).first;
    }
    algo = it->second;
  }
  check_lt(cublasLtMatmul(L.handle, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &algo.algo, L.workspace,
                          kWorkspaceBytes, cuda_stream()),
           "cublasLtMatmul");
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
}

namespace {

template <class T>
void matmul_forward_t(float* out, const T* inp, const T* w, int64_t N, int64_t C, int64_t OC,
                      cudaDataType_t t) {
  gemm(true, false, OC, N, C, w, C, inp, C, out, OC, 0.0f, t);
}

template <class T>
void matmul_backward_t(float* dinp, float* dw, const T* dout, const T* inp, const T* w, int64_t N, int64_t C,
                       int64_t OC, bool accumulate_dw, cudaDataType_t t) {
  if (dinp) gemm(false, false, C, N, OC, w, C, dout, OC, dinp, C, 1.0f, t);
  if (dw) gemm(false, true, C, OC, N, inp, C, dout, OC, dw, C, accumulate_dw ? 1.0f : 0.0f, t);
}

void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  matmul_forward_t(out, inp, w, N, C, OC, CUDA_R_32F);
}
void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                     int64_t C, int64_t OC, bool accumulate_dw) {
  matmul_backward_t(dinp, dw, dout, inp, w, N, C, OC, accumulate_dw, CUDA_R_32F);
}

// ---- bf16 ----------------------------------------------------------------------------------------------
__global__ void to_bf16_kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

struct Bf16Copy : Scratch<__nv_bfloat16> {
  Bf16Copy(const float* src, int64_t n) : Scratch<__nv_bfloat16>(n) {
    if (n == 0) return;
    launch(to_bf16_kernel, blocks_for(n, 256), 256, 0, p, src, n);
  }
};

// The bf16 values of [x, x + n): the registered bf16 image holding them (a model converts each weight once
// per forward, ops.h register_bf16_image), else a conversion into scratch.
struct Bf16Operand {
  std::optional<Bf16Copy> copy;
  const __nv_bfloat16* p;
  Bf16Operand(const float* x, int64_t n) {
    if (const uint16_t* image = find_bf16_image(x, n)) {
      p = reinterpret_cast<const __nv_bfloat16*>(image);
    } else {
      copy.emplace(x, n);
      p = copy->p;
    }
  }
};

void matmul_bf16_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  Bf16Operand bi(inp, N * C), bw(w, OC * C);
  matmul_forward_t(out, bi.p, bw.p, N, C, OC, CUDA_R_16BF);
}
// The output written as bf16 by cuBLASLt's epilogue (no f32 output, no conversion pass); the input as f32
// (converted) or bf16 bits (as they are).
void matmul_bf16_forward_bf16_output(uint16_t* out16, const float* inp, const float* w, int64_t N, int64_t C,
                                     int64_t OC) {
  Bf16Operand bi(inp, N * C), bw(w, OC * C);
  gemm(true, false, OC, N, C, bw.p, C, bi.p, C, out16, OC, 0.0f, CUDA_R_16BF, 1.0f, CUDA_R_16BF);
}
void matmul_bf16_forward_bf16_io(uint16_t* out16, const uint16_t* inp16, const float* w, int64_t N, int64_t C,
                                 int64_t OC) {
  Bf16Operand bw(w, OC * C);
  gemm(true, false, OC, N, C, bw.p, C, inp16, C, out16, OC, 0.0f, CUDA_R_16BF, 1.0f, CUDA_R_16BF);
}
// bd: the output gradient's bf16 values; bi: the input's, read only for dw (null when dw is).
void matmul_bf16_backward_bf16_grad(float* dinp, float* dw, const __nv_bfloat16* bd, const __nv_bfloat16* bi,
                                    const float* w, int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  if (dinp) {
    Bf16Operand bw(w, OC * C);
    gemm(false, false, C, N, OC, bw.p, C, bd, OC, dinp, C, 1.0f, CUDA_R_16BF);
  }
  if (dw) gemm(false, true, C, OC, N, bi, C, bd, OC, dw, C, accumulate_dw ? 1.0f : 0.0f, CUDA_R_16BF);
}
void matmul_bf16_backward_bf16(float* dinp, float* dw, const float* dout, const __nv_bfloat16* bi,
                               const float* w, int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  Bf16Copy bd(dout, N * OC);
  matmul_bf16_backward_bf16_grad(dinp, dw, bd.p, bi, w, N, C, OC, accumulate_dw);
}
void matmul_bf16_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                          int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  std::optional<Bf16Operand> bi;
  if (dw) bi.emplace(inp, N * C);
  matmul_bf16_backward_bf16(dinp, dw, dout, dw ? bi->p : nullptr, w, N, C, OC, accumulate_dw);
}

// The bf16-input variants: the input's bits go to cuBLASLt as they are (no conversion pass).
void matmul_bf16_forward_bf16_input(float* out, const uint16_t* inp16, const float* w, int64_t N, int64_t C,
                                    int64_t OC) {
  Bf16Operand bw(w, OC * C);
  matmul_forward_t(out, reinterpret_cast<const __nv_bfloat16*>(inp16), bw.p, N, C, OC, CUDA_R_16BF);
}
void matmul_bf16_backward_bf16_input(float* dinp, float* dw, const float* dout, const uint16_t* inp16,
                                     const float* w, int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  matmul_bf16_backward_bf16(dinp, dw, dout, reinterpret_cast<const __nv_bfloat16*>(inp16), w, N, C, OC,
                            accumulate_dw);
}

// Both bf16: the output gradient's and the input's bits go to cuBLASLt as they are.
void matmul_bf16_backward_bf16_io(float* dinp, float* dw, const uint16_t* dout16, const uint16_t* inp16,
                                  const float* w, int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  matmul_bf16_backward_bf16_grad(dinp, dw, reinterpret_cast<const __nv_bfloat16*>(dout16),
                                 reinterpret_cast<const __nv_bfloat16*>(inp16), w, N, C, OC, accumulate_dw);
}

}  // namespace

void gemm_f32_or_bf16(bool bf16, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A,
                      int64_t lda, const float* B, int64_t ldb, float* D, int64_t ldd, float beta) {
  if (!bf16) return gemm(ta, tb, m, n, k, A, lda, B, ldb, D, ldd, beta, CUDA_R_32F);
  // A is (ta ? m : k) columns... its elements: lda * (ta ? m : k) with the last column short; convert the
  // span that is read.
  const int64_t a_cols = ta ? m : k, a_rows = ta ? k : m, b_cols = tb ? k : n, b_rows = tb ? n : k;
  Bf16Operand a(A, a_cols == 0 ? 0 : lda * (a_cols - 1) + a_rows),
      b(B, b_cols == 0 ? 0 : ldb * (b_cols - 1) + b_rows);
  gemm(ta, tb, m, n, k, a.p, lda, b.p, ldb, D, ldd, beta, CUDA_R_16BF);
}

namespace {

// Row-major C (M,N) = alpha op(A) op(B) + beta C is column-major C^T (N,M) = alpha op(B)^T op(A)^T.
void gemm_rowmajor(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm(tb, ta, N, M, K, B, ldb, A, lda, C, ldc, beta, CUDA_R_32F, alpha);
}

const MatmulKernels kMatmul{matmul_forward, matmul_backward};
const GemmKernels kGemm{gemm_rowmajor};
TITAN_REGISTER_KERNEL(GemmKernels, CUDA, "cublaslt", kGemm, 10);
const MatmulBf16Kernels kMatmulBf16{matmul_bf16_forward,
                                    matmul_bf16_backward,
                                    matmul_bf16_forward_bf16_input,
                                    matmul_bf16_backward_bf16_input,
                                    matmul_bf16_forward_bf16_output,
                                    matmul_bf16_forward_bf16_io,
                                    matmul_bf16_backward_bf16_io};
TITAN_REGISTER_KERNEL(MatmulKernels, CUDA, "cublaslt", kMatmul, 10);
TITAN_REGISTER_KERNEL(MatmulBf16Kernels, CUDA, "cublaslt", kMatmulBf16, 10);

}  // namespace
}  // namespace titan::cuda
