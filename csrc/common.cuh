// Shared pieces of the CUDA vocabulary pass.
//
// Host and device (GK_HD; a CPU test, csrc/tests/epilogue_test.cpp, runs them against the float64 oracle):
//   the logit transform (scale, soft-cap, temperature), LseState and its fold / merge (online max, sum-exp and
//   entropy sum), the logit gradient of one element,
//   the token-level loss epilogue (a transcription of vocab/grpo_loss_triton.py, itself of losses/).
// Device only (under nvcc): dtype conversion, 16-byte packs, warp-shuffle and block reductions of an LseState.
//
// Per element, the exponentials and the soft-cap's reciprocal are the fast intrinsics on the device (fast_exp:
// __expf, one MUFU.EX2 after a multiply by log2 e, within 2 + 1.17|x| ulp, so ~2 ulp for the terms that carry the
// sums; fast_div: __fdividef), and the accurate expf / division on the host, so the CPU test checks the same formulas
// with exact primitives. Once-per-row logs (lse, entropy) and the epilogue keep the accurate logf / expf. Whether
// the entropy (or its gradient) is computed is a template parameter: no per-element test.
#pragma once

#include <math.h>  // expf, logf, fmaxf, ... in the global namespace, for host and device

#include <cstdint>

#include "kernels.h"

#if defined(__CUDACC__)
#define GK_HD __host__ __device__ __forceinline__
#else
#define GK_HD inline
#endif
#if defined(__CUDA_ARCH__)
#define GK_UNROLL _Pragma("unroll")
#else
#define GK_UNROLL
#endif

namespace grpo_kernels {

constexpr float kFloat32Lowest = -3.4028234663852886e38f;  // running-max start: finite, so no inf - inf
constexpr float kExpFloor = -256.0f;  // e^x is 0 in float32 below it: x clamped there keeps 0 * x finite at -inf
constexpr float kLogRatioClamp = 20.0f;                    // |log ratio| and |ref - logp| bound (losses/terms.py)
constexpr float kLowVarKlClamp = 10.0f;                    // low_var_kl: k3 clamped to +-10

GK_HD float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return expf(x);
#endif
}

GK_HD float fast_div(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fdividef(x, y);
#else
  return x / y;
#endif
}

// (tanh y, sech^2 y) from one exponential: tanh|y| = (1 - e) / (1 + e), sech^2 y = 4e / (1 + e)^2, e = e^(-2|y|);
// sech^2 keeps its relative precision where 1 - tanh^2 y would cancel (|y| >~ 4). +-inf give +-1 and 0.
struct TanhSech2 {
  float tanh;
  float sech2;
};

GK_HD TanhSech2 tanh_sech2(float y) {
  const float e = fast_exp(-2.0f * fabsf(y));
  const float r = fast_div(1.0f, 1.0f + e);
  return {copysignf((1.0f - e) * r, y), 4.0f * e * r * r};
}

// ---------------------------------------------------------------------------------------------------------------
// The logit transform (kernels.h LogitMap), specialised on kSoftcap so the plain pass keeps its one multiply.

template <bool kSoftcap>
GK_HD float map_logit(float x, const LogitMap& map) {
  if constexpr (kSoftcap) {
    return map.b * tanh_sech2(map.a * x).tanh;
  } else {
    return map.a * x;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Online log-sum-exp with entropy. Over the values z seen so far: m = max z, s = sum e^(z - m),
// t = sum e^(z - m) (z - m). Then lse = m + log s and H = -sum q log q = log s - t / s.

struct LseState {
  float m;
  float s;
  float t;
};

GK_HD LseState lse_init() { return {kFloat32Lowest, 0.0f, 0.0f}; }

// Fold N more values (already transformed: map_logit): one rescale per N values, N exps; the entropy sum t only
// with kEntropy.
template <bool kEntropy, int N>
GK_HD void lse_fold(LseState& st, const float (&z)[N]) {
  float m_new = st.m;
GK_UNROLL
  for (int i = 0; i < N; ++i) m_new = fmaxf(m_new, z[i]);
  float s = 0.0f, t = 0.0f;
GK_UNROLL
  for (int i = 0; i < N; ++i) {
    const float d = z[i] - m_new;
    const float e = fast_exp(d);
    s += e;
    if constexpr (kEntropy) t = fmaf(e, fmaxf(d, kExpFloor), t);  // 0 * log 0 = 0 for -inf logits
  }
  const float dm = st.m - m_new;
  const float scale = fast_exp(dm);
  if constexpr (kEntropy) {  // sum e^(z - m_new)(z - m_new) over the old values = scale * (t + s * (m - m_new))
    st.t = fmaf(scale, fmaf(st.s, fmaxf(dm, kExpFloor), st.t), t);
  }
  st.s = fmaf(st.s, scale, s);
  st.m = m_new;
}

// The state of the union of two disjoint sets of values (commutative, associative up to rounding).
GK_HD LseState lse_merge(const LseState& a, const LseState& b) {
  const float m = fmaxf(a.m, b.m);
  const float ea = fast_exp(a.m - m);
  const float eb = fast_exp(b.m - m);
  LseState r;
  r.m = m;
  r.s = a.s * ea + b.s * eb;
  r.t = (a.s > 0.0f ? ea * (a.t + a.s * (a.m - m)) : 0.0f) + (b.s > 0.0f ? eb * (b.t + b.s * (b.m - m)) : 0.0f);
  return r;
}

GK_HD float lse_value(const LseState& st) { return st.m + logf(st.s); }

GK_HD float lse_entropy(const LseState& st) { return logf(st.s) - st.t / st.s; }

// dL/dx for one raw logit x of a row with log-sum-exp `lse` (of z = map_logit(x)):
//   (g * (onehot - q) - g_h * q * (log q + H)) * dz/dx,  q = e^(z - lse);  0 * log 0 = 0;
//   dz/dx = a, or a * b * sech^2(a * x) with soft-capping (tanh_sech2).
// The entropy term only with kEntropy (a gradient of the entropy is given).
template <bool kSoftcap, bool kEntropy>
GK_HD float logit_grad(float x, bool is_target, float lse, float g, float g_h, float h, const LogitMap& map) {
  float z = map.a * x, slope = map.a;
  if constexpr (kSoftcap) {
    const TanhSech2 th = tanh_sech2(z);
    slope *= map.b * th.sech2;
    z = map.b * th.tanh;
  }
  const float log_q = z - lse;
  const float q = fast_exp(log_q);
  float grad = (is_target ? g : 0.0f) - g * q;
  if constexpr (kEntropy) grad -= g_h * q * (fmaxf(log_q, kExpFloor) + h);
  return grad * slope;
}

// ---------------------------------------------------------------------------------------------------------------
// Token-level loss epilogue: the weighted loss of one token and its derivative w.r.t. logp.

struct TokenLossValue {
  float loss;
  float dlogp;
};

GK_HD float clampf(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

// e^d - 1 - d without cancellation: its Taylor series (to d^9/9!) for |d| < 0.5, the direct form beyond.
GK_HD float k3_of(float d) {
  if (fabsf(d) >= 0.5f) return expf(d) - 1.0f - d;
  float series = 1.0f / 40320.0f + d / 362880.0f;
  series = 1.0f / 5040.0f + d * series;
  series = 1.0f / 720.0f + d * series;
  series = 1.0f / 120.0f + d * series;
  series = 1.0f / 24.0f + d * series;
  series = 1.0f / 6.0f + d * series;
  series = 0.5f + d * series;
  return d * d * series;
}

// logp: the token's log-prob; old_logp is read only with has_old, ref_logp only with o.has_kl;
// is_weight 1 when there is none; weight the normaliser's per-token weight.
GK_HD TokenLossValue token_loss(const TokenLoss& o, float logp, float adv, bool has_old, float old_logp,
                                float ref_logp, float is_weight, float weight) {
  // rho = exp(clamp(logp - old, +-20)); d rho / d logp = rho inside the clamp, 0 outside (on-policy: rho = 1)
  float ratio = 1.0f, d_ratio = 1.0f;
  if (has_old) {
    const float log_ratio = logp - old_logp;
    ratio = expf(clampf(log_ratio, -kLogRatioClamp, kLogRatioClamp));
    d_ratio = fabsf(log_ratio) <= kLogRatioClamp ? ratio : 0.0f;
  }
  float loss = 0.0f, dlogp = 0.0f;
  switch (o.policy) {
    case Policy::kClip: {  // -min(r1 A, clip(rho) A), r1 = min(rho, delta); torch.min splits the gradient on ties
      const float lo = 1.0f - o.eps_low, hi = 1.0f + o.eps_high;
      const float clipped = clampf(ratio, lo, hi);
      const float d_clipped = (ratio >= lo && ratio <= hi) ? d_ratio : 0.0f;
      float capped = ratio, d_capped = d_ratio;
      if (o.has_delta) {
        capped = fminf(ratio, o.delta);
        d_capped = ratio <= o.delta ? d_ratio : 0.0f;
      }
      const float s1 = capped * adv, s2 = clipped * adv;
      loss = -fminf(s1, s2);
      const float d_min = s1 < s2 ? d_capped : (s2 < s1 ? d_clipped : 0.5f * (d_capped + d_clipped));
      dlogp = -adv * d_min;
      if (o.has_dual_clip && adv < 0.0f && loss > -adv * o.clip_ratio_c) {  // the floor carries no gradient
        loss = -adv * o.clip_ratio_c;
        dlogp = 0.0f;
      }
      break;
    }
    case Policy::kCispo: {  // -sg(w) A logp, w = min(rho, eps_high) or clip(rho, 1 - eps_low, 1 + eps_high)
      const float w = o.cispo_two_sided ? clampf(ratio, 1.0f - o.eps_low, 1.0f + o.eps_high) : fminf(ratio, o.eps_high);
      loss = -w * adv * logp;
      dlogp = -w * adv;
      break;
    }
    case Policy::kSapo: {  // -sigmoid(tau (rho - 1)) 4 / tau A
      const float tau = adv > 0.0f ? o.tau_pos : o.tau_neg;
      const float gate = 1.0f / (1.0f + expf(-tau * (ratio - 1.0f)));
      loss = -gate * 4.0f / tau * adv;
      dlogp = -adv * 4.0f * gate * (1.0f - gate) * d_ratio;
      break;
    }
    case Policy::kGpg:  // -A logp
    default:
      loss = -adv * logp;
      dlogp = -adv;
      break;
  }
  loss *= is_weight;
  dlogp *= is_weight;
  if (o.has_kl) {  // beta * KL estimator of d = ref - logp (losses/kl.py)
    const float d = ref_logp - logp;
    float kl, d_kl;
    if (o.kl_kind == KlKind::kK1) {  // k1 = -d
      kl = -d;
      d_kl = 1.0f;
    } else if (o.kl_kind == KlKind::kK2) {  // k2 = d^2 / 2
      kl = 0.5f * d * d;
      d_kl = -d;
    } else {  // k3 = expm1(d) - d, d clamped to +-20; d k3 / d logp = -expm1(d) = -(k3 + d)
      const float d_c = clampf(d, -kLogRatioClamp, kLogRatioClamp);
      kl = k3_of(d_c);
      d_kl = fabsf(d) <= kLogRatioClamp ? -(kl + d_c) : 0.0f;
      if (o.kl_kind == KlKind::kLowVarKl) {
        d_kl = fabsf(kl) <= kLowVarKlClamp ? d_kl : 0.0f;
        kl = clampf(kl, -kLowVarKlClamp, kLowVarKlClamp);
      }
    }
    if (o.bias_correction) {  // KL * rho, rho not detached
      d_kl = d_kl * ratio + kl * d_ratio;
      kl *= ratio;
    }
    loss += o.beta * kl;
    dlogp += o.beta * d_kl;
  }
  return {loss * weight, dlogp * weight};
}

}  // namespace grpo_kernels

// ---------------------------------------------------------------------------------------------------------------
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace grpo_kernels {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// 16 bytes of T: the unit of every vectorized load and store.
template <typename T>
struct Pack {
  static constexpr int kN = 16 / sizeof(T);
  uint4 raw;
};

template <bool kSoftcap, typename T>
__device__ __forceinline__ void unpack(const Pack<T>& p, const LogitMap& map, float (&z)[Pack<T>::kN]) {
  const T* e = reinterpret_cast<const T*>(&p.raw);
#pragma unroll
  for (int i = 0; i < Pack<T>::kN; ++i) z[i] = map_logit<kSoftcap>(to_float(e[i]), map);
}

// Elements of `row` before its first 16-byte boundary (at most V): the scalar head before the packed body.
template <typename T>
__device__ __forceinline__ int64_t unaligned_head(const T* row, int64_t V) {
  const int64_t bytes = static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(row) & 15)) & 15);
  const int64_t head = bytes / static_cast<int64_t>(sizeof(T));
  return head < V ? head : V;
}

__device__ __forceinline__ LseState warp_merge(LseState st) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    LseState other;
    other.m = __shfl_xor_sync(kFullMask, st.m, offset);
    other.s = __shfl_xor_sync(kFullMask, st.s, offset);
    other.t = __shfl_xor_sync(kFullMask, st.t, offset);
    st = lse_merge(st, other);
  }
  return st;
}

// Merge the states of the kThreads threads working on one row (a warp, or the whole block); the result is
// valid in the row's thread 0. With a whole block, every thread must call it (it synchronises twice, so
// `scratch` may be reused by the next row).
template <int kThreads>
__device__ __forceinline__ LseState group_merge(LseState st, LseState* scratch) {
  st = warp_merge(st);
  if constexpr (kThreads > 32) {
    constexpr int kWarps = kThreads / 32;
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) scratch[warp] = st;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int w = 1; w < kWarps; ++w) st = lse_merge(st, scratch[w]);
    }
    __syncthreads();
  }
  return st;
}

}  // namespace grpo_kernels
#endif  // __CUDACC__
