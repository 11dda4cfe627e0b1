// Vocabulary pass in CUDA C++ (the `cuda` backend; vocab/token_logprobs_triton.py is the same algorithm).
//
// Forward: one online pass over each row of transformed logits z (logit scale, soft-cap, temperature: LogitMap;
// running max, sum-exp and entropy sum, common.cuh), then the target's log-prob; grpo_loss_fwd also forms the
// token-level loss and dL/dlogp in its epilogue. Backward: one pass writing (g (onehot - q) - g_H q (log q + H))
// dz/dx, in place when `out` is the logits. Every kernel is specialised on kSoftcap (the tanh and its derivative
// only where a soft-cap is set) and on kEntropy (the entropy sum forward, its gradient backward, only when asked).
// Per element the exponentials are fast intrinsics (common.cuh fast_exp).
//
// Layout: one warp per row for V <= kWarpRowMaxV (8 rows per block), else one 512-thread block per row; the
// grid is 1-D, sized to the resident blocks, and strides over rows (no 65535 limit, 64-bit offsets). Loads and
// stores are 16-byte packs after a scalar head up to the row's first 16-byte boundary. float32 accumulation
// for bf16, fp16 and fp32 logits. Rows the mask drops are not read. These sizes are untuned (no GPU yet).
#include <type_traits>

#include "common.cuh"

namespace grpo_kernels {
namespace {

constexpr int64_t kWarpRowMaxV = 4096;
constexpr int kWarpRowsPerBlock = 8;
constexpr int kRowBlockThreads = 512;

// kThreads threads share a row: a warp (kThreads = 32) or the whole block.
template <int kThreads>
struct RowGroup {
  static_assert(kThreads % 32 == 0, "a row is worked on by whole warps");
  static constexpr int kRowsPerBlock = kThreads == 32 ? kWarpRowsPerBlock : 1;
  static constexpr int kBlockThreads = kThreads * kRowsPerBlock;
  static constexpr int kWarps = kThreads / 32;

  __device__ static int lane() { return kThreads == 32 ? static_cast<int>(threadIdx.x & 31) : threadIdx.x; }
  __device__ static int64_t first_row() {
    return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (kThreads == 32 ? threadIdx.x / 32 : 0);
  }
  __device__ static int64_t row_step() { return static_cast<int64_t>(gridDim.x) * kRowsPerBlock; }
};

// This thread's state over its share of one row: scalar head, 16-byte packs (two loads in flight), scalar tail.
template <typename T, int kThreads, bool kSoftcap, bool kEntropy>
__device__ LseState row_partial(const T* row, int64_t V, const LogitMap& map, int lane) {
  constexpr int kN = Pack<T>::kN;
  LseState st = lse_init();
  const int64_t head = unaligned_head(row, V);
  if (lane < head) {
    const float z[1] = {map_logit<kSoftcap>(to_float(row[lane]), map)};
    lse_fold<kEntropy>(st, z);
  }
  const Pack<T>* body = reinterpret_cast<const Pack<T>*>(row + head);
  const int64_t packs = (V - head) / kN;
  int64_t i = lane;
  for (; i + kThreads < packs; i += 2 * kThreads) {
    const Pack<T> a = body[i];
    const Pack<T> b = body[i + kThreads];
    float za[kN], zb[kN];
    unpack<kSoftcap>(a, map, za);
    unpack<kSoftcap>(b, map, zb);
    lse_fold<kEntropy>(st, za);
    lse_fold<kEntropy>(st, zb);
  }
  if (i < packs) {
    const Pack<T> a = body[i];  // a register copy: one 16-byte load, not kN narrow ones
    float z[kN];
    unpack<kSoftcap>(a, map, z);
    lse_fold<kEntropy>(st, z);
  }
  for (int64_t c = head + packs * kN + lane; c < V; c += kThreads) {
    const float z[1] = {map_logit<kSoftcap>(to_float(row[c]), map)};
    lse_fold<kEntropy>(st, z);
  }
  return st;
}

// Forward over rows; with kFused the token-level loss epilogue too.
template <typename T, int kThreads, bool kSoftcap, bool kEntropy, bool kFused>
__device__ void vocab_fwd_rows(const GrpoLossFwdParams& p) {
  using G = RowGroup<kThreads>;
  __shared__ LseState scratch[G::kWarps];
  const TokenLogprobsFwdParams& v = p.vocab;
  const T* logits = static_cast<const T*>(v.logits);
  const int64_t rows = v.B * v.T;
  const int lane = G::lane();
  for (int64_t row = G::first_row(); row < rows; row += G::row_step()) {
    float logp = 0.0f, lse = 0.0f, entropy = 0.0f;
    TokenLossValue token = {0.0f, 0.0f};
    if (v.mask[row]) {  // the same for every thread of the row, so group_merge's barriers are reached by all
      const int64_t b = row / v.T, t = row - b * v.T;
      const T* r = logits + b * v.stride_b + t * v.stride_t;
      LseState st = row_partial<T, kThreads, kSoftcap, kEntropy>(r, v.V, v.map, lane);
      st = group_merge<kThreads>(st, scratch);
      if (lane == 0) {
        lse = lse_value(st);
        if constexpr (kEntropy) entropy = lse_entropy(st);
        logp = map_logit<kSoftcap>(to_float(r[v.targets[row]]), v.map) - lse;
        if constexpr (kFused) {
          const float adv = p.advantages[b * p.adv_stride_b + t * p.adv_stride_t];
          const bool has_old = p.old_logp != nullptr;
          const float old_logp = has_old ? p.old_logp[row] : 0.0f;
          const float ref_logp = p.loss.has_kl ? p.ref_logp[row] : 0.0f;
          const float is_weight = p.is_ratio != nullptr ? p.is_ratio[b * p.is_stride_b + t * p.is_stride_t] : 1.0f;
          token = token_loss(p.loss, logp, adv, has_old, old_logp, ref_logp, is_weight, p.weights[row]);
        }
      }
    }
    if (lane == 0) {
      v.logp[row] = logp;
      v.lse[row] = lse;
      if constexpr (kEntropy) v.entropy[row] = entropy;
      if constexpr (kFused) {
        p.token_loss[row] = token.loss;
        p.dlogp[row] = token.dlogp;
      }
    }
  }
}

template <typename T, int kThreads, bool kSoftcap, bool kEntropy>
__global__ void __launch_bounds__(RowGroup<kThreads>::kBlockThreads)
    token_logprobs_fwd_kernel(const GrpoLossFwdParams p) {
  vocab_fwd_rows<T, kThreads, kSoftcap, kEntropy, false>(p);
}

template <typename T, int kThreads, bool kSoftcap, bool kEntropy>
__global__ void __launch_bounds__(RowGroup<kThreads>::kBlockThreads) grpo_loss_fwd_kernel(const GrpoLossFwdParams p) {
  vocab_fwd_rows<T, kThreads, kSoftcap, kEntropy, true>(p);
}

// out[c] = f(in[c], c) over one row, in place when in == out: each element is read and written by one thread.
template <typename T, int kThreads, typename F>
__device__ void map_row(const T* in, T* out, int64_t V, int lane, F f) {
  constexpr int kN = Pack<T>::kN;
  const auto apply = [&](const Pack<T>& src, int64_t col0) {
    const T* e = reinterpret_cast<const T*>(&src.raw);
    Pack<T> dst;
    T* d = reinterpret_cast<T*>(&dst.raw);
#pragma unroll
    for (int k = 0; k < kN; ++k) d[k] = from_float<T>(f(to_float(e[k]), col0 + k));
    return dst;
  };
  const int64_t head = unaligned_head(in, V);
  if ((reinterpret_cast<uintptr_t>(in) & 15) != (reinterpret_cast<uintptr_t>(out) & 15)) {  // no common packing
    for (int64_t c = lane; c < V; c += kThreads) out[c] = from_float<T>(f(to_float(in[c]), c));
    return;
  }
  if (lane < head) out[lane] = from_float<T>(f(to_float(in[lane]), lane));
  const Pack<T>* src = reinterpret_cast<const Pack<T>*>(in + head);
  Pack<T>* dst = reinterpret_cast<Pack<T>*>(out + head);
  const int64_t packs = (V - head) / kN;
  int64_t i = lane;
  for (; i + kThreads < packs; i += 2 * kThreads) {
    const Pack<T> a = src[i];
    const Pack<T> b = src[i + kThreads];
    dst[i] = apply(a, head + i * kN);
    dst[i + kThreads] = apply(b, head + (i + kThreads) * kN);
  }
  if (i < packs) {
    const Pack<T> a = src[i];
    dst[i] = apply(a, head + i * kN);
  }
  for (int64_t c = head + packs * kN + lane; c < V; c += kThreads) out[c] = from_float<T>(f(to_float(in[c]), c));
}

// out[0, V) = 0 without reading anything (a row the mask drops).
template <typename T, int kThreads>
__device__ void zero_row(T* out, int64_t V, int lane) {
  constexpr int kN = Pack<T>::kN;
  const int64_t head = unaligned_head(out, V);
  if (lane < head) out[lane] = from_float<T>(0.0f);
  Pack<T>* dst = reinterpret_cast<Pack<T>*>(out + head);
  const int64_t packs = (V - head) / kN;
  for (int64_t i = lane; i < packs; i += kThreads) dst[i].raw = make_uint4(0u, 0u, 0u, 0u);  // 0.0 in every dtype
  for (int64_t c = head + packs * kN + lane; c < V; c += kThreads) out[c] = from_float<T>(0.0f);
}

template <typename T, int kThreads, bool kSoftcap, bool kEntropy>
__global__ void __launch_bounds__(RowGroup<kThreads>::kBlockThreads)
    token_logprobs_bwd_kernel(const TokenLogprobsBwdParams p) {
  using G = RowGroup<kThreads>;
  const T* logits = static_cast<const T*>(p.logits);
  T* out = static_cast<T*>(p.out);
  const int64_t rows = p.B * p.T;
  const int lane = G::lane();
  for (int64_t row = G::first_row(); row < rows; row += G::row_step()) {
    const int64_t b = row / p.T, t = row - b * p.T;
    const T* in_row = logits + b * p.stride_b + t * p.stride_t;
    T* out_row = out + b * p.out_stride_b + t * p.out_stride_t;
    if (!p.mask[row]) {
      zero_row<T, kThreads>(out_row, p.V, lane);
      continue;
    }
    const float lse = p.lse[row];
    const int64_t target = p.targets[row];
    const float g = p.grad_logp != nullptr ? p.grad_logp[row] : 0.0f;
    const float g_h = kEntropy ? p.grad_entropy[row] : 0.0f;
    const float h = kEntropy ? p.entropy[row] : 0.0f;
    const LogitMap map = p.map;
    map_row<T, kThreads>(in_row, out_row, p.V, lane, [=](float x, int64_t c) {
      return logit_grad<kSoftcap, kEntropy>(x, c == target, lse, g, g_h, h, map);
    });
  }
}

// Launch over `rows` with as many blocks as fit on the device at once (fewer when there are fewer rows).
template <int kThreads, typename Params>
cudaError_t launch(void (*kernel)(Params), const Params& p, int64_t rows, cudaStream_t stream) {
  using G = RowGroup<kThreads>;
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, G::kBlockThreads, 0);
  if (err != cudaSuccess) return err;
  const int64_t needed = (rows + G::kRowsPerBlock - 1) / G::kRowsPerBlock;
  const int64_t resident = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  const unsigned grid = static_cast<unsigned>(needed < resident ? needed : resident);
  kernel<<<grid, G::kBlockThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Call f(T*{}, std::integral_constant<int, kThreads>{}, std::bool_constant<kSoftcap>{},
// std::bool_constant<kEntropy>{}) for the logits' dtype, the row layout V warrants, whether a soft-cap is set and
// whether the entropy (forward) or its gradient (backward) is asked.
template <typename F>
cudaError_t dispatch(DType dtype, int64_t V, bool softcap, bool entropy, F&& f) {
  const auto by_entropy = [&](auto tag, auto threads, auto cap) {
    if (entropy) return f(tag, threads, cap, std::true_type{});
    return f(tag, threads, cap, std::false_type{});
  };
  const auto by_cap = [&](auto tag, auto threads) {
    if (softcap) return by_entropy(tag, threads, std::true_type{});
    return by_entropy(tag, threads, std::false_type{});
  };
  const auto by_width = [&](auto tag) {
    if (V <= kWarpRowMaxV) return by_cap(tag, std::integral_constant<int, 32>{});
    return by_cap(tag, std::integral_constant<int, kRowBlockThreads>{});
  };
  switch (dtype) {
    case DType::kFloat32:
      return by_width(static_cast<float*>(nullptr));
    case DType::kFloat16:
      return by_width(static_cast<__half*>(nullptr));
    case DType::kBFloat16:
      return by_width(static_cast<__nv_bfloat16*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t token_logprobs_fwd(const TokenLogprobsFwdParams& params, cudaStream_t stream) {
  const int64_t rows = params.B * params.T;
  if (rows == 0) return cudaSuccess;
  GrpoLossFwdParams p;
  p.vocab = params;
  const bool entropy = params.entropy != nullptr;
  return dispatch(params.dtype, params.V, params.map.softcap, entropy, [&](auto tag, auto threads, auto cap, auto ent) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kThreads = decltype(threads)::value;
    return launch<kThreads>(token_logprobs_fwd_kernel<T, kThreads, decltype(cap)::value, decltype(ent)::value>, p,
                            rows, stream);
  });
}

cudaError_t grpo_loss_fwd(const GrpoLossFwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.vocab.B * p.vocab.T;
  if (rows == 0) return cudaSuccess;
  const bool entropy = p.vocab.entropy != nullptr;
  return dispatch(p.vocab.dtype, p.vocab.V, p.vocab.map.softcap, entropy, [&](auto tag, auto threads, auto cap,
                                                                              auto ent) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kThreads = decltype(threads)::value;
    return launch<kThreads>(grpo_loss_fwd_kernel<T, kThreads, decltype(cap)::value, decltype(ent)::value>, p, rows,
                            stream);
  });
}

cudaError_t token_logprobs_bwd(const TokenLogprobsBwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.B * p.T;
  if (rows == 0) return cudaSuccess;
  const bool entropy = p.grad_entropy != nullptr;  // bindings.cpp: grad_entropy comes with the entropy
  return dispatch(p.dtype, p.V, p.map.softcap, entropy, [&](auto tag, auto threads, auto cap, auto ent) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kThreads = decltype(threads)::value;
    return launch<kThreads>(token_logprobs_bwd_kernel<T, kThreads, decltype(cap)::value, decltype(ent)::value>, p,
                            rows, stream);
  });
}

}  // namespace grpo_kernels
