// PyTorch binding of the CUDA vocabulary pass, the only source here that includes PyTorch headers: argument
// checks, device guard and current stream, and the op registry torch.ops.grpo_kernels.{token_logprobs_fwd,
// token_logprobs_bwd, grpo_loss_fwd} with CUDA and Meta (shape-only, for fake tensors) kernels.
// Python-side launchers with the Triton backend's signatures: grpo_kernels/kernels/cuda/launchers.py.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "kernels.h"

namespace grpo_kernels {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using FwdOutputs = std::tuple<Tensor, Tensor, Tensor>;                    // logp, lse, entropy ([0] if not asked)
using LossOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;  // logp, lse, entropy, loss, dlogp

DType dtype_of(const Tensor& logits, const char* op) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, op, ": logits dtype must be float32, float16 or bfloat16, got ", logits.scalar_type());
  }
  return DType::kFloat32;  // not reached
}

void check_logits(const Tensor& logits, const char* op) {
  TORCH_CHECK_VALUE(logits.dim() == 3 && logits.size(2) >= 1, op, ": logits must be [B, T, V] with V >= 1, got ",
                    logits.sizes());
  TORCH_CHECK_VALUE(logits.stride(2) == 1 || logits.size(2) == 1, op,
                    ": logits must have last stride 1 (make them contiguous in V), got strides ", logits.strides());
  dtype_of(logits, op);
}

// A per-token [B, T] tensor of `dtype` on the logits' device; contiguous unless it comes with its own strides.
void check_tokens(const Tensor& x, const char* name, at::ScalarType dtype, const Tensor& logits, const char* op,
                  bool contiguous = true) {
  const int64_t B = logits.size(0), T = logits.size(1);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) == B && x.size(1) == T, op, ": ", name, " must be [B, T] = [", B, ", ",
                    T, "], got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.device() == logits.device(), op, ": ", name, " must be on ", logits.device(),
                    " like the logits, got ", x.device());
  TORCH_CHECK_VALUE(!contiguous || x.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", x.strides());
}

void check_optional(const OptionalTensor& x, const char* name, const Tensor& logits, const char* op,
                    bool contiguous = true) {
  if (x.has_value()) check_tokens(*x, name, at::kFloat, logits, op, contiguous);
}

void check_common(const Tensor& logits, const Tensor& targets, const Tensor& mask, double temperature,
                  double logit_scale, std::optional<double> softcap, const char* op) {
  check_logits(logits, op);
  check_tokens(targets, "targets", at::kLong, logits, op);
  check_tokens(mask, "mask", at::kBool, logits, op);
  TORCH_CHECK_VALUE(temperature > 0.0, op, ": temperature must be > 0, got ", temperature);
  TORCH_CHECK_VALUE(logit_scale > 0.0, op, ": logit_scale must be > 0, got ", logit_scale);
  TORCH_CHECK_VALUE(!softcap.has_value() || *softcap > 0.0, op, ": softcap must be > 0 or None, got ",
                    softcap.value_or(0.0));
}

LogitMap logit_map(double temperature, double logit_scale, std::optional<double> softcap) {
  return make_logit_map(temperature, logit_scale, softcap.has_value(), softcap.value_or(1.0));
}

template <typename T>
const T* ptr_or_null(const OptionalTensor& x) {
  return x.has_value() ? x->data_ptr<T>() : nullptr;
}

Tensor token_tensor(const Tensor& logits, bool present = true) {  // [B, T] float32, or [0] when absent
  const auto options = logits.options().dtype(at::kFloat);
  return present ? at::empty({logits.size(0), logits.size(1)}, options) : at::empty({0}, options);
}

cudaStream_t current_stream(const Tensor& logits) {
  return c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

TokenLogprobsFwdParams fwd_params(const Tensor& logits, const Tensor& targets, const Tensor& mask, LogitMap map,
                                  const Tensor& logp, const Tensor& lse, const Tensor& entropy, bool with_entropy) {
  TokenLogprobsFwdParams p;
  p.dtype = dtype_of(logits, "grpo_kernels");
  p.B = logits.size(0);
  p.T = logits.size(1);
  p.V = logits.size(2);
  p.logits = logits.data_ptr();
  p.stride_b = logits.stride(0);
  p.stride_t = logits.stride(1);
  p.targets = targets.data_ptr<int64_t>();
  p.mask = mask.data_ptr<bool>();
  p.map = map;
  p.logp = logp.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.entropy = with_entropy ? entropy.data_ptr<float>() : nullptr;
  return p;
}

FwdOutputs token_logprobs_fwd_cuda(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                   double temperature, bool with_entropy, double logit_scale,
                                   std::optional<double> softcap) {
  constexpr const char* op = "grpo_kernels::token_logprobs_fwd";
  check_common(logits, targets, mask, temperature, logit_scale, softcap, op);
  const c10::cuda::CUDAGuard guard(logits.device());
  Tensor logp = token_tensor(logits), lse = token_tensor(logits), entropy = token_tensor(logits, with_entropy);
  const LogitMap map = logit_map(temperature, logit_scale, softcap);
  const TokenLogprobsFwdParams p = fwd_params(logits, targets, mask, map, logp, lse, entropy, with_entropy);
  check_launch(token_logprobs_fwd(p, current_stream(logits)), op);
  return {logp, lse, entropy};
}

void token_logprobs_bwd_cuda(const Tensor& logits, const Tensor& targets, const Tensor& mask, const Tensor& lse,
                             const OptionalTensor& entropy, const OptionalTensor& grad_logp,
                             const OptionalTensor& grad_entropy, double temperature, double logit_scale,
                             std::optional<double> softcap, at::Tensor& out) {
  constexpr const char* op = "grpo_kernels::token_logprobs_bwd";
  check_common(logits, targets, mask, temperature, logit_scale, softcap, op);
  check_tokens(lse, "lse", at::kFloat, logits, op);
  check_optional(entropy, "entropy", logits, op);
  check_optional(grad_logp, "grad_logp", logits, op);
  check_optional(grad_entropy, "grad_entropy", logits, op);
  TORCH_CHECK_VALUE(!grad_entropy.has_value() || entropy.has_value(), op, ": grad_entropy needs the entropy");
  TORCH_CHECK_VALUE(out.sizes() == logits.sizes(), op, ": out must be ", logits.sizes(), " like the logits, got ",
                    out.sizes());
  TORCH_CHECK_TYPE(out.scalar_type() == logits.scalar_type(), op, ": out must be ", logits.scalar_type(),
                   " like the logits, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.device() == logits.device(), op, ": out must be on ", logits.device(), ", got ",
                    out.device());
  TORCH_CHECK_VALUE(out.stride(2) == 1 || out.size(2) == 1, op, ": out must have last stride 1, got strides ",
                    out.strides());
  const c10::cuda::CUDAGuard guard(logits.device());
  TokenLogprobsBwdParams p;
  p.dtype = dtype_of(logits, op);
  p.B = logits.size(0);
  p.T = logits.size(1);
  p.V = logits.size(2);
  p.logits = logits.data_ptr();
  p.stride_b = logits.stride(0);
  p.stride_t = logits.stride(1);
  p.out = out.data_ptr();
  p.out_stride_b = out.stride(0);
  p.out_stride_t = out.stride(1);
  p.targets = targets.data_ptr<int64_t>();
  p.mask = mask.data_ptr<bool>();
  p.lse = lse.data_ptr<float>();
  p.entropy = ptr_or_null<float>(entropy);
  p.grad_logp = ptr_or_null<float>(grad_logp);
  p.grad_entropy = ptr_or_null<float>(grad_entropy);
  p.map = logit_map(temperature, logit_scale, softcap);
  check_launch(token_logprobs_bwd(p, current_stream(logits)), op);
}

// The in-place backward: dL/dlogits written over the logits (the schema declares them mutated, Tensor(a!)).
void token_logprobs_bwd_inplace_cuda(at::Tensor& logits, const Tensor& targets, const Tensor& mask, const Tensor& lse,
                                     const OptionalTensor& entropy, const OptionalTensor& grad_logp,
                                     const OptionalTensor& grad_entropy, double temperature, double logit_scale,
                                     std::optional<double> softcap) {
  token_logprobs_bwd_cuda(logits, targets, mask, lse, entropy, grad_logp, grad_entropy, temperature, logit_scale,
                          softcap, logits);
}

Policy policy_of(c10::string_view name, const char* op) {
  if (name == "clip") return Policy::kClip;
  if (name == "cispo") return Policy::kCispo;
  if (name == "sapo") return Policy::kSapo;
  if (name == "gpg") return Policy::kGpg;
  TORCH_CHECK_VALUE(false, op, ": policy must be one of clip, cispo, sapo, gpg, got ", std::string(name));
  return Policy::kClip;  // not reached
}

KlKind kl_kind_of(c10::string_view name, const char* op) {
  if (name == "k1") return KlKind::kK1;
  if (name == "k2") return KlKind::kK2;
  if (name == "k3") return KlKind::kK3;
  if (name == "low_var_kl") return KlKind::kLowVarKl;
  TORCH_CHECK_VALUE(false, op, ": kl_estimator must be one of k1, k2, k3, low_var_kl, got ", std::string(name));
  return KlKind::kK3;  // not reached
}

LossOutputs grpo_loss_fwd_cuda(const Tensor& logits, const Tensor& targets, const Tensor& mask, const Tensor& weights,
                               const Tensor& advantages, const OptionalTensor& old_logp,
                               const OptionalTensor& ref_logp, const OptionalTensor& is_ratio,
                               c10::string_view policy, double eps_low, double eps_high, std::optional<double> delta,
                               std::optional<double> clip_ratio_c, bool cispo_two_sided, double beta,
                               c10::string_view kl_estimator, bool bias_correction, double tau_pos, double tau_neg,
                               double temperature, bool with_entropy, double logit_scale,
                               std::optional<double> softcap) {
  constexpr const char* op = "grpo_kernels::grpo_loss_fwd";
  check_common(logits, targets, mask, temperature, logit_scale, softcap, op);
  check_tokens(weights, "weights", at::kFloat, logits, op);
  check_tokens(advantages, "advantages", at::kFloat, logits, op, /*contiguous=*/false);
  check_optional(old_logp, "old_logp", logits, op);
  check_optional(ref_logp, "ref_logp", logits, op);
  check_optional(is_ratio, "is_ratio", logits, op, /*contiguous=*/false);
  TORCH_CHECK_VALUE(beta == 0.0 || ref_logp.has_value(), op, ": beta = ", beta, " != 0 needs ref_logp");
  TokenLoss loss;
  loss.policy = policy_of(policy, op);
  loss.eps_low = static_cast<float>(eps_low);
  loss.eps_high = static_cast<float>(eps_high);
  loss.has_delta = delta.has_value();
  loss.delta = static_cast<float>(delta.value_or(1.0));
  loss.has_dual_clip = clip_ratio_c.has_value();
  loss.clip_ratio_c = static_cast<float>(clip_ratio_c.value_or(1.0));
  loss.cispo_two_sided = cispo_two_sided;
  loss.has_kl = beta != 0.0;
  loss.beta = static_cast<float>(beta);
  loss.kl_kind = kl_kind_of(kl_estimator, op);
  loss.bias_correction = bias_correction;
  loss.tau_pos = static_cast<float>(tau_pos);
  loss.tau_neg = static_cast<float>(tau_neg);

  const c10::cuda::CUDAGuard guard(logits.device());
  Tensor logp = token_tensor(logits), lse = token_tensor(logits), entropy = token_tensor(logits, with_entropy);
  Tensor token_loss = token_tensor(logits), dlogp = token_tensor(logits);
  GrpoLossFwdParams p;
  p.vocab = fwd_params(logits, targets, mask, logit_map(temperature, logit_scale, softcap), logp, lse, entropy,
                       with_entropy);
  p.weights = weights.data_ptr<float>();
  p.advantages = advantages.data_ptr<float>();
  p.adv_stride_b = advantages.stride(0);
  p.adv_stride_t = advantages.stride(1);
  p.old_logp = ptr_or_null<float>(old_logp);
  p.ref_logp = ptr_or_null<float>(ref_logp);
  p.is_ratio = ptr_or_null<float>(is_ratio);
  p.is_stride_b = is_ratio.has_value() ? is_ratio->stride(0) : 0;
  p.is_stride_t = is_ratio.has_value() ? is_ratio->stride(1) : 0;
  p.loss = loss;
  p.token_loss = token_loss.data_ptr<float>();
  p.dlogp = dlogp.data_ptr<float>();
  check_launch(grpo_loss_fwd(p, current_stream(logits)), op);
  return {logp, lse, entropy, token_loss, dlogp};
}

// Meta kernels: output shapes and dtypes only (torch.compile / FakeTensor tracing).

FwdOutputs token_logprobs_fwd_meta(const Tensor& logits, const Tensor&, const Tensor&, double, bool with_entropy,
                                   double, std::optional<double>) {
  return {token_tensor(logits), token_tensor(logits), token_tensor(logits, with_entropy)};
}

void token_logprobs_bwd_meta(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                             const OptionalTensor&, const OptionalTensor&, double, double, std::optional<double>,
                             at::Tensor&) {}

void token_logprobs_bwd_inplace_meta(at::Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                                     const OptionalTensor&, const OptionalTensor&, double, double,
                                     std::optional<double>) {}

LossOutputs grpo_loss_fwd_meta(const Tensor& logits, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, c10::string_view,
                               double, double, std::optional<double>, std::optional<double>, bool, double,
                               c10::string_view, bool, double, double, double, bool with_entropy, double,
                               std::optional<double>) {
  return {token_tensor(logits), token_tensor(logits), token_tensor(logits, with_entropy), token_tensor(logits),
          token_tensor(logits)};
}

}  // namespace
}  // namespace grpo_kernels

TORCH_LIBRARY(grpo_kernels, m) {
  m.def("token_logprobs_fwd(Tensor logits, Tensor targets, Tensor mask, float temperature, bool with_entropy,"
        " float logit_scale, float? softcap) -> (Tensor, Tensor, Tensor)");
  m.def("token_logprobs_bwd(Tensor logits, Tensor targets, Tensor mask, Tensor lse, Tensor? entropy,"
        " Tensor? grad_logp, Tensor? grad_entropy, float temperature, float logit_scale, float? softcap,"
        " Tensor(a!) out) -> ()");
  m.def("token_logprobs_bwd_inplace(Tensor(a!) logits, Tensor targets, Tensor mask, Tensor lse, Tensor? entropy,"
        " Tensor? grad_logp, Tensor? grad_entropy, float temperature, float logit_scale, float? softcap) -> ()");
  m.def("grpo_loss_fwd(Tensor logits, Tensor targets, Tensor mask, Tensor weights, Tensor advantages,"
        " Tensor? old_logp, Tensor? ref_logp, Tensor? is_ratio, str policy, float eps_low, float eps_high,"
        " float? delta, float? clip_ratio_c, bool cispo_two_sided, float beta, str kl_estimator,"
        " bool bias_correction, float tau_pos, float tau_neg, float temperature, bool with_entropy,"
        " float logit_scale, float? softcap) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(grpo_kernels, CUDA, m) {
  m.impl("token_logprobs_fwd", &grpo_kernels::token_logprobs_fwd_cuda);
  m.impl("token_logprobs_bwd", &grpo_kernels::token_logprobs_bwd_cuda);
  m.impl("token_logprobs_bwd_inplace", &grpo_kernels::token_logprobs_bwd_inplace_cuda);
  m.impl("grpo_loss_fwd", &grpo_kernels::grpo_loss_fwd_cuda);
}

TORCH_LIBRARY_IMPL(grpo_kernels, Meta, m) {
  m.impl("token_logprobs_fwd", &grpo_kernels::token_logprobs_fwd_meta);
  m.impl("token_logprobs_bwd", &grpo_kernels::token_logprobs_bwd_meta);
  m.impl("token_logprobs_bwd_inplace", &grpo_kernels::token_logprobs_bwd_inplace_meta);
  m.impl("grpo_loss_fwd", &grpo_kernels::grpo_loss_fwd_meta);
}

// `import grpo_kernels._C` loads this library, which runs the registrations above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
