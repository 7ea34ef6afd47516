// cuDNN's fused scaled-dot-product attention (the SDPA graph of cudnn-frontend) on bf16 tensors read
// through row strides: causal, GQA, scale hd^-0.5, f32 softmax statistics (the row logsumexp) saved for
// the backward. Graphs are built once per shape and direction and cached; one workspace, grown when a graph
// needs more. Every call runs on cuda_stream().
//
// Layout: element (b, t, h, d) of q lies at q[(b*T + t) * ldq + h*hd + d] (likewise k/v with ldk/ldv over
// nKV heads, o/dout with ldo over nH heads), so q, k and v may be column ranges of one fused QKV row
// (ldq = ldk = ldv = (nH + 2 nKV) hd) and need no permute copy. stats is (B, nH, T) f32, contiguous.
// dq/dk/dv are written (not accumulated) with the strides of q/k/v.
//
// Without cuDNN (a build without cudnn-frontend's headers, or the CUDA emulator, which cannot run cuDNN)
// the cached "graph" is a stand-in that runs the device's own bf16 attention kernels (attention_bf16.cu)
// behind the same interface, so the call site, the strides and the cache are exercised everywhere.
#pragma once
#include <cstdint>

#include "kernels/ops.h"

namespace titan::cuda {

// The shape and row strides of attention_bf16 (kernels/ops.h).
using SdpaShape = AttentionBf16Shape;

// false (after one log line naming the reason, once per shape) when cuDNN cannot run this shape here
// (no GPU support for it, an unsupported head dim or cuDNN version); the caller then runs its own kernels.
bool sdpa_forward(const SdpaShape& s, uint16_t* o, float* stats, const uint16_t* q, const uint16_t* k,
                  const uint16_t* v);
bool sdpa_backward(const SdpaShape& s, uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                   const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                   const float* stats);

// Which engine sdpa_* runs in this build: "cudnn" or "stand-in" (own kernels behind the same interface).
const char* sdpa_engine();
// Graphs built so far (forward and backward; a cache hit builds none): tests check the caching with it.
int64_t sdpa_graphs_built();

// The own kernels the stand-in runs (attention_bf16.cu): the same contract as sdpa_forward/backward.
void sdpa_own_forward(const SdpaShape& s, uint16_t* o, float* stats, const uint16_t* q, const uint16_t* k,
                      const uint16_t* v);
void sdpa_own_backward(const SdpaShape& s, uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                       const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                       const float* stats);

}  // namespace titan::cuda
