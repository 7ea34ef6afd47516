// Pieces of the CUDA flash attention shared by its implementations (attention.cu, attention_split.cu).
#pragma once
#include <cstdint>

namespace titan::cuda {

// Forward: out (B,T,nH,hd) and the row logsumexp lse (B,nH,T) of the causal GQA attention.
void flash_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                   int64_t T, int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start);
// D (B,nH,T) = rowwise dO . O
void flash_rowdot(float* D, const float* dout, const float* out, int64_t B, int64_t T, int64_t nH,
                  int64_t hd);
int64_t flash_saved_floats(int64_t B, int64_t T, int64_t nH);

}  // namespace titan::cuda
