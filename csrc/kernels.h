// Parameters and launchers of the CUDA vocabulary pass: plain pointers, sizes and strides, no PyTorch types.
//
// A [B, T, V] tensor of logits (or of their gradient) has its element (b, t, v) at
// data + b * stride_b + t * stride_t + v (the last stride is 1). Per-token arrays ([B, T]: targets, mask, logp,
// lse, ...) are contiguous, indexed by row = b * T + t, unless they come with their own strides.
#pragma once

#include <cstdint>

namespace grpo_kernels {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };  // of the logits; compute is float32

enum class Policy : int32_t { kClip = 0, kCispo = 1, kSapo = 2, kGpg = 3 };  // vocab/grpo_loss_triton.EPILOGUES
enum class KlKind : int32_t { kK1 = 0, kK2 = 1, kK3 = 2, kLowVarKl = 3 };   // vocab/grpo_loss_triton.KL_KINDS

// The logits the softmax sees, from raw logits x: z = b * tanh(a * x) with soft-capping, else z = a * x.
// With logit scale s, soft-cap c and temperature T (TRL's order: scale, cap, temperature): a = s / c, b = c / T
// when capped, else a = s / T (and b unused). make_logit_map builds it.
struct LogitMap {
  float a = 1.0f;
  float b = 1.0f;
  bool softcap = false;
};

inline LogitMap make_logit_map(double temperature, double logit_scale, bool has_softcap, double softcap) {
  LogitMap map;
  map.softcap = has_softcap;
  map.a = static_cast<float>(has_softcap ? logit_scale / softcap : logit_scale / temperature);
  map.b = static_cast<float>(has_softcap ? softcap / temperature : 1.0);
  return map;
}

// The fused token-level loss (vocab/function.py TokenEpilogue): the policy kind and its hyperparameters.
struct TokenLoss {
  Policy policy = Policy::kClip;
  float eps_low = 0.2f;
  float eps_high = 0.2f;        // clip: 1 + eps_high bound; cispo one-sided: the absolute cap of the IS weight
  bool has_delta = false;       // clip: cap `delta` on the unclipped ratio
  float delta = 1.0f;
  bool has_dual_clip = false;   // clip: loss capped at -A * clip_ratio_c where A < 0
  float clip_ratio_c = 3.0f;
  bool cispo_two_sided = false;
  bool has_kl = false;          // beta != 0: + beta * KL estimator of d = ref - logp
  float beta = 0.0f;
  KlKind kl_kind = KlKind::kK3;
  bool bias_correction = false; // KL * ratio (ratio not detached)
  float tau_pos = 1.0f;         // sapo gate temperatures
  float tau_neg = 1.05f;
};

struct TokenLogprobsFwdParams {
  DType dtype = DType::kFloat32;
  int64_t B = 0, T = 0, V = 0;
  const void* logits = nullptr;
  int64_t stride_b = 0, stride_t = 0;
  const int64_t* targets = nullptr;  // [B, T], read only where mask is set
  const bool* mask = nullptr;        // [B, T]; rows where it is false are not read and give 0
  LogitMap map;                      // raw logits -> the softmax's z
  float* logp = nullptr;             // [B, T] out
  float* lse = nullptr;              // [B, T] out: logsumexp(z)
  float* entropy = nullptr;          // [B, T] out, or null when not asked
};

struct TokenLogprobsBwdParams {
  DType dtype = DType::kFloat32;
  int64_t B = 0, T = 0, V = 0;
  const void* logits = nullptr;
  int64_t stride_b = 0, stride_t = 0;
  void* out = nullptr;               // dL/dlogits, the logits' dtype; may be `logits` itself (in-place)
  int64_t out_stride_b = 0, out_stride_t = 0;
  const int64_t* targets = nullptr;
  const bool* mask = nullptr;        // rows where it is false get 0
  const float* lse = nullptr;        // [B, T] from the forward
  const float* entropy = nullptr;    // [B, T], needed with grad_entropy
  const float* grad_logp = nullptr;  // [B, T] or null (0)
  const float* grad_entropy = nullptr;  // [B, T] or null (0)
  LogitMap map;                      // raw logits -> the softmax's z, as in the forward
};

struct GrpoLossFwdParams {
  TokenLogprobsFwdParams vocab;        // the pass itself (logp, lse, entropy out)
  const float* weights = nullptr;      // [B, T] per-token weight (normaliser x token/sequence weights)
  const float* advantages = nullptr;   // [B, T] view: stride_t 0 for one value per sequence
  int64_t adv_stride_b = 0, adv_stride_t = 0;
  const float* old_logp = nullptr;     // [B, T] or null (on-policy: ratio 1)
  const float* ref_logp = nullptr;     // [B, T], needed when loss.has_kl
  const float* is_ratio = nullptr;     // [B, T] view or null
  int64_t is_stride_b = 0, is_stride_t = 0;
  TokenLoss loss;
  float* token_loss = nullptr;         // [B, T] out: weighted per-token loss
  float* dlogp = nullptr;              // [B, T] out: its derivative w.r.t. logp
};

}  // namespace grpo_kernels

// The CPU test of common.cuh's host-device functions (csrc/tests/epilogue_test.cpp) defines
// GRPO_KERNELS_HOST_TEST and needs no CUDA header; everything else sees the launchers.
#ifndef GRPO_KERNELS_HOST_TEST
#include <cuda_runtime_api.h>

namespace grpo_kernels {

// Each launches on `stream` and returns the launch's error (cudaSuccess when B * T == 0: nothing to do).
cudaError_t token_logprobs_fwd(const TokenLogprobsFwdParams& p, cudaStream_t stream);
cudaError_t token_logprobs_bwd(const TokenLogprobsBwdParams& p, cudaStream_t stream);
cudaError_t grpo_loss_fwd(const GrpoLossFwdParams& p, cudaStream_t stream);

}  // namespace grpo_kernels
#endif
