// CPU run of common.cuh's host-device functions, for tests/test_cuda_build.py (which compares the output with
// the float64 oracle). Built with a host compiler only: g++ -std=c++17 -DGRPO_KERNELS_HOST_TEST -I csrc ...
//
// Reads lines from stdin, writes one line per input line:
//   row V temperature logit_scale softcap target g g_h head x_0 .. x_{V-1}    (softcap 0: none)
//     -> row lse logp entropy lse_plain grad_0 .. grad_{V-1} grad_plain_0 .. grad_plain_{V-1}
//     The raw logits x go through the logit map (make_logit_map, map_logit); the row is split as a kernel
//     splits it over kLanes lanes: `head` scalar elements (a misaligned start),
//     packs of kPack elements strided over the lanes, a scalar tail; the lanes' states are merged by the
//     xor butterfly of warp_merge. The gradient is that of g * logp + g_h * entropy. lse_plain and grad_plain are
//     the kernels' instantiations without the entropy (kEntropy = false): the lse, and the gradient of g * logp.
//   loss policy kl_kind has_kl beta eps_low eps_high has_delta delta has_dual_clip clip_ratio_c cispo_two_sided
//        bias_correction tau_pos tau_neg logp adv has_old old_logp ref_logp is_weight weight
//     -> loss loss dlogp
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "common.cuh"

using namespace grpo_kernels;

namespace {

constexpr int kLanes = 8;
constexpr int kPack = 4;

void print(float x) { std::printf(" %.9g", x); }

// The next number on stdin; strtof also reads inf, -inf and nan, which operator>> does not.
float next_float() {
  std::string token;
  std::cin >> token;
  return std::strtof(token.c_str(), nullptr);
}

int64_t next_int() {
  std::string token;
  std::cin >> token;
  return std::strtoll(token.c_str(), nullptr, 10);
}

// The row's merged state, folded as a kernel folds it (see the top of the file).
template <bool kEntropy>
LseState row_state(const std::vector<float>& z, int64_t head) {
  const int64_t V = static_cast<int64_t>(z.size());
  std::vector<LseState> lanes(kLanes, lse_init());
  for (int lane = 0; lane < kLanes; ++lane) {
    LseState& st = lanes[lane];
    if (lane < head) {
      const float one[1] = {z[lane]};
      lse_fold<kEntropy>(st, one);
    }
    const int64_t packs = (V - head) / kPack;
    for (int64_t i = lane; i < packs; i += kLanes) {
      float pack[kPack];
      for (int k = 0; k < kPack; ++k) pack[k] = z[head + i * kPack + k];
      lse_fold<kEntropy>(st, pack);
    }
    for (int64_t c = head + packs * kPack + lane; c < V; c += kLanes) {
      const float one[1] = {z[c]};
      lse_fold<kEntropy>(st, one);
    }
  }
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) {  // warp_merge's butterfly
    std::vector<LseState> next(kLanes);
    for (int lane = 0; lane < kLanes; ++lane) next[lane] = lse_merge(lanes[lane], lanes[lane ^ offset]);
    lanes = next;
  }
  return lanes[0];
}

template <bool kSoftcap>
void run_row(int64_t V, const LogitMap& map, int64_t target, float g, float g_h, int64_t head,
             const std::vector<float>& x) {
  std::vector<float> z(V);
  for (int64_t c = 0; c < V; ++c) z[c] = map_logit<kSoftcap>(x[c], map);
  head = head < V ? head : V;
  const LseState st = row_state<true>(z, head);
  const float lse = lse_value(st);
  const float entropy = lse_entropy(st);
  const float lse_plain = lse_value(row_state<false>(z, head));
  std::printf("row");
  print(lse);
  print(z[target] - lse);
  print(entropy);
  print(lse_plain);
  for (int64_t c = 0; c < V; ++c) print(logit_grad<kSoftcap, true>(x[c], c == target, lse, g, g_h, entropy, map));
  for (int64_t c = 0; c < V; ++c) print(logit_grad<kSoftcap, false>(x[c], c == target, lse_plain, g, 0.0f, 0.0f, map));
  std::printf("\n");
}

void run_row() {
  const int64_t V = next_int();
  const double temperature = next_float(), logit_scale = next_float(), softcap = next_float();
  const int64_t target = next_int();
  const float g = next_float(), g_h = next_float();
  const int64_t head = next_int();
  std::vector<float> x(V);
  for (auto& v : x) v = next_float();
  const LogitMap map = make_logit_map(temperature, logit_scale, softcap > 0.0, softcap);
  if (map.softcap) {
    run_row<true>(V, map, target, g, g_h, head, x);
  } else {
    run_row<false>(V, map, target, g, g_h, head, x);
  }
}

void run_loss() {
  TokenLoss o;
  o.policy = static_cast<Policy>(next_int());
  o.kl_kind = static_cast<KlKind>(next_int());
  o.has_kl = next_int() != 0;
  o.beta = next_float();
  o.eps_low = next_float();
  o.eps_high = next_float();
  o.has_delta = next_int() != 0;
  o.delta = next_float();
  o.has_dual_clip = next_int() != 0;
  o.clip_ratio_c = next_float();
  o.cispo_two_sided = next_int() != 0;
  o.bias_correction = next_int() != 0;
  o.tau_pos = next_float();
  o.tau_neg = next_float();
  const float logp = next_float(), adv = next_float();
  const bool has_old = next_int() != 0;
  const float old_logp = next_float(), ref_logp = next_float(), is_weight = next_float(), weight = next_float();
  const TokenLossValue v = token_loss(o, logp, adv, has_old, old_logp, ref_logp, is_weight, weight);
  std::printf("loss");
  print(v.loss);
  print(v.dlogp);
  std::printf("\n");
}

}  // namespace

int main() {
  std::string kind;
  while (std::cin >> kind) {
    if (kind == "row") {
      run_row();
    } else if (kind == "loss") {
      run_loss();
    } else {
      std::fprintf(stderr, "unknown line kind %s\n", kind.c_str());
      return 1;
    }
  }
  return 0;
}
