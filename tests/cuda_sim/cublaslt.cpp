// The CUDA emulator's cuBLASLt: the subset src/device/cuda/matmul.cu uses (column-major D = alpha op(A)
// op(B) + beta C with f32 or bf16 A and B, f32 C and D (or bf16 C and D with bf16 A and B: the f32 result
// rounded to nearest even), f32 compute and scale, host alpha and beta), on the CPU's BLAS. bf16 operands are
// widened to f32 exactly; products and sums are f32, as CUBLAS_COMPUTE_32F. Arguments are checked as the
// library does (INVALID_VALUE or NOT_SUPPORTED, with the reason on stderr), and every matrix must lie in
// device memory for the extent its layout names.
#include <cblas.h>
#include <cublasLt.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "cuda_sim.h"

struct cublasLtContext {
  int live = 1;
};

namespace {

struct Desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
};
struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
struct Preference {
  size_t max_workspace = 0;
};

cublasStatus_t reject(cublasStatus_t s, const char* what) {
  std::fprintf(stderr, "CUDA emulator: cuBLASLt: %s\n", what);
  return s;
}

size_t element_bytes(cudaDataType_t t) {
  return t == CUDA_R_32F ? 4 : t == CUDA_R_16BF ? 2 : 0;
}

// The matrix as f32, column-major with leading dimension rows (bf16 widened exactly).
std::vector<float> to_f32(const void* p, const Layout& l) {
  std::vector<float> out(l.rows * l.cols);
  for (uint64_t c = 0; c < l.cols; ++c)
    for (uint64_t r = 0; r < l.rows; ++r) {
      const uint64_t i = c * l.ld + r;
      if (l.type == CUDA_R_32F) {
        out[c * l.rows + r] = static_cast<const float*>(p)[i];
      } else {
        const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
        std::memcpy(&out[c * l.rows + r], &bits, 4);
      }
    }
  return out;
}

bool in_device(const void* p, const Layout& l) {
  const uint64_t n = l.cols == 0 ? 0 : (l.cols - 1) * l.ld + l.rows;
  return titan::cuda_sim::is_device_range(p, n * element_bytes(l.type));
}

void run_matmul(const Layout& la, const Layout& lb, const Layout& lc, const Layout& ld, bool ta, bool tb,
                uint64_t m, uint64_t n, uint64_t k, float a, const void* A, const void* B, float b,
                const void* C, void* D);

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(new Desc{compute, scale});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete reinterpret_cast<Desc*>(desc);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  auto* d = reinterpret_cast<Desc*>(desc);
  if (attr == CUBLASLT_MATMUL_DESC_TRANSA || attr == CUBLASLT_MATMUL_DESC_TRANSB) {
    if (!buf || bytes != sizeof(int32_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "TRANSA/TRANSB size");
    const auto op = *static_cast<const cublasOperation_t*>(buf);
    if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return reject(CUBLAS_STATUS_NOT_SUPPORTED, "transpose kind");
    (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->ta : d->tb) = op;
    return CUBLAS_STATUS_SUCCESS;
  }
  return reject(CUBLAS_STATUS_NOT_SUPPORTED, "matmul attribute the emulator does not model");
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (element_bytes(type) == 0) return reject(CUBLAS_STATUS_NOT_SUPPORTED, "matrix type (f32 and bf16 only)");
  if (ld < static_cast<int64_t>(rows) || ld < 1)
    return reject(CUBLAS_STATUS_INVALID_VALUE, "leading dimension below the row count");
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete reinterpret_cast<Layout*>(layout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(new Preference);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete reinterpret_cast<Preference*>(pref);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t bytes) {
  if (!buf) return reject(CUBLAS_STATUS_INVALID_VALUE, "preference value is null");
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (bytes != sizeof(uint64_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "workspace size type");
    reinterpret_cast<Preference*>(pref)->max_workspace = *static_cast<const uint64_t*>(buf);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (bytes != sizeof(uint32_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "preference attribute size");
  return CUBLAS_STATUS_SUCCESS;  // alignments: every emulated algorithm takes any alignment
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                              cublasLtMatrixLayout_t, cublasLtMatmulPreference_t,
                                              int requested, cublasLtMatmulHeuristicResult_t results[],
                                              int* returned) {
  if (requested < 1 || !results || !returned) return reject(CUBLAS_STATUS_INVALID_VALUE, "heuristic query");
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t a_layout, const void* B,
                              cublasLtMatrixLayout_t b_layout, const void* beta, const void* C,
                              cublasLtMatrixLayout_t c_layout, void* D, cublasLtMatrixLayout_t d_layout,
                              const cublasLtMatmulAlgo_t*, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  if (!handle || !desc || !a_layout || !b_layout || !c_layout || !d_layout || !alpha || !beta)
    return reject(CUBLAS_STATUS_INVALID_VALUE, "null handle, descriptor, alpha or beta");
  const Desc& op = *reinterpret_cast<const Desc*>(desc);
  const Layout &la = *reinterpret_cast<const Layout*>(a_layout),
               &lb = *reinterpret_cast<const Layout*>(b_layout),
               &lc = *reinterpret_cast<const Layout*>(c_layout),
               &ld = *reinterpret_cast<const Layout*>(d_layout);
  if (op.compute != CUBLAS_COMPUTE_32F || op.scale != CUDA_R_32F)
    return reject(CUBLAS_STATUS_NOT_SUPPORTED, "compute/scale type (the emulator models 32F only)");
  // (cuBLASLt's 32F-compute combinations: f32 in, f32 out; bf16 in, f32 or bf16 out)
  if (la.type != lb.type || lc.type != ld.type ||
      (ld.type == CUDA_R_16BF ? la.type != CUDA_R_16BF : ld.type != CUDA_R_32F))
    return reject(CUBLAS_STATUS_NOT_SUPPORTED,
                  "type combination (A = B in f32 or bf16, C = D in f32, or in bf16 with bf16 A and B)");
  const bool ta = op.ta == CUBLAS_OP_T, tb = op.tb == CUBLAS_OP_T;
  const uint64_t m = ta ? la.cols : la.rows, k = ta ? la.rows : la.cols;
  const uint64_t kb = tb ? lb.cols : lb.rows, n = tb ? lb.rows : lb.cols;
  if (k != kb || ld.rows != m || ld.cols != n || lc.rows != m || lc.cols != n)
    return reject(CUBLAS_STATUS_INVALID_VALUE, "shapes of op(A), op(B), C and D disagree");
  if (titan::cuda_sim::is_device_range(alpha, 0) || titan::cuda_sim::is_device_range(beta, 0))
    return reject(CUBLAS_STATUS_INVALID_VALUE, "alpha/beta in device memory under the host pointer mode");
  if (!in_device(A, la) || !in_device(B, lb) || !in_device(C, lc) || !in_device(D, ld))
    return reject(CUBLAS_STATUS_INVALID_VALUE,
                  "a matrix extends outside device memory (pointer or ld wrong)");
  if (workspace_bytes && !titan::cuda_sim::is_device_range(workspace, workspace_bytes))
    return reject(CUBLAS_STATUS_INVALID_VALUE, "workspace outside device memory");
  if (C != D && (lc.ld != ld.ld)) return reject(CUBLAS_STATUS_NOT_SUPPORTED, "C != D with different layouts");
  const float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  // The product, by value (under stream capture it runs when the graph is launched; the descriptors and
  // the host alpha/beta are taken now, as cuBLASLt's captured kernels take them).
  auto product = [la, lb, lc, ld, ta, tb, m, n, k, a, b, A, B, C, D] {
    run_matmul(la, lb, lc, ld, ta, tb, m, n, k, a, A, B, b, C, D);
  };
  if (titan::cuda_sim::record_if_capturing(stream, product)) return CUBLAS_STATUS_SUCCESS;
  product();
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"

namespace {

void run_matmul(const Layout& la, const Layout& lb, const Layout& lc, const Layout& ld, bool ta, bool tb,
                uint64_t m, uint64_t n, uint64_t k, float a, const void* A, const void* B, float b,
                const void* C, void* D) {
  if (ld.type == CUDA_R_16BF) {
    // bf16 D: the f32 result (C widened when beta reads it), rounded to the nearest bf16 (ties to even).
    std::vector<float> acc = b != 0.0f ? to_f32(C, lc) : std::vector<float>(m * n, 0.0f);
    if (k > 0) {
      const std::vector<float> fa = to_f32(A, la), fb = to_f32(B, lb);
      cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(m),
                  int(n), int(k), a, fa.data(), int(la.rows), fb.data(), int(lb.rows), b, acc.data(), int(m));
    } else {
      for (float& x : acc) x *= b;
    }
    auto* d16 = static_cast<uint16_t*>(D);
    for (uint64_t j = 0; j < n; ++j)
      for (uint64_t i = 0; i < m; ++i) d16[j * ld.ld + i] = titan::f32_to_bf16(acc[j * m + i]);
    return;
  }
  auto* d = static_cast<float*>(D);
  if (C != D && b != 0.0f)
    for (uint64_t j = 0; j < n; ++j)
      std::memcpy(d + j * ld.ld, static_cast<const float*>(C) + j * lc.ld, 4 * m);
  if (k == 0) {
    for (uint64_t j = 0; j < n; ++j)
      for (uint64_t i = 0; i < m; ++i) d[j * ld.ld + i] = b == 0.0f ? 0.0f : b * d[j * ld.ld + i];
    return;
  }
  const std::vector<float> fa = to_f32(A, la), fb = to_f32(B, lb);
  cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(m), int(n),
              int(k), a, fa.data(), int(la.rows), fb.data(), int(lb.rows), b, d, int(ld.ld));
}

}  // namespace
