// RMSNorm (with the residual add fused in) and neox-style rotary embedding on CPU, one pass each;
// SiLU(gate) * up as one call.
//
// Same contract and arithmetic order as the torch references (rms_norm.py, rotary.py): float32
// math, `weight * (x * rsqrt(mean(x^2) + eps))`, `[x1 * cos - x2 * sin, x2 * cos + x1 * sin]`.
// Why: in plain torch each is 6-8 small ops (temporaries, dispatch) per layer; at batch 1 those
// cost SmolLM2 about as much as a fifth of its weight reads per token (issue 13). Rows run in
// parallel on torch's intra-op threads only when a step has many tokens: at batch 1 a parallel
// region costs more than the work. Built with cpu_attention.cpp into one library (cpu_ops.py).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGrainElems = 1 << 16;  // elements per parallel task (a task below it is serial)

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / row_elems); }

template <typename scalar_t>
void norm_row(const scalar_t* x, const scalar_t* res, const scalar_t* w, scalar_t* out,
              scalar_t* res_out, int64_t n, float eps, float* tmp) {
  float sumsq = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    scalar_t v = x[i];
    if (res != nullptr) {
      v = static_cast<scalar_t>(static_cast<float>(v) + static_cast<float>(res[i]));
      res_out[i] = v;  // x + residual, in the model's dtype (as torch's `x + residual`)
    }
    tmp[i] = static_cast<float>(v);
    sumsq += tmp[i] * tmp[i];
  }
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) *
                                   static_cast<float>(static_cast<scalar_t>(tmp[i] * inv)));
  }
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in,
                                        const at::Tensor& weight_in, double eps) {
  // x [..., hidden]: tokens, or tokens x heads (Qwen3's q/k norms)
  TORCH_CHECK(x_in.dim() >= 1, "rms_norm takes [..., hidden]");
  const auto x = x_in.contiguous();
  const auto weight = weight_in.to(x.scalar_type()).contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  TORCH_CHECK(weight.numel() == n, "rms_norm weight must be [hidden]");
  auto out = at::empty_like(x);
  at::Tensor residual, res_out;
  if (residual_in.has_value()) {
    residual = residual_in->to(x.scalar_type()).contiguous();
    TORCH_CHECK(residual.sizes() == x.sizes(), "residual must match x");
    res_out = at::empty_like(x);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* x_p = x.data_ptr<scalar_t>();
    const scalar_t* w_p = weight.data_ptr<scalar_t>();
    const scalar_t* r_p = residual.defined() ? residual.data_ptr<scalar_t>() : nullptr;
    scalar_t* o_p = out.data_ptr<scalar_t>();
    scalar_t* ro_p = res_out.defined() ? res_out.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(n);
      for (int64_t r = begin; r < end; ++r) {
        norm_row<scalar_t>(x_p + r * n, r_p ? r_p + r * n : nullptr, w_p, o_p + r * n,
                           ro_p ? ro_p + r * n : nullptr, n, static_cast<float>(eps), tmp.data());
      }
    });
  });
  return {out, res_out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(x, c10::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  return norm(x, residual, weight, eps);
}

// No FMA contraction here: the rotation then equals the torch reference (and transformers) bit
// for bit in fp32, as rotary.py's does.
template <typename scalar_t>
__attribute__((optimize("fp-contract=off"))) void rotate_heads(const scalar_t* src, int64_t stride_h, int64_t heads, int64_t half,
                  const scalar_t* cos, const scalar_t* sin, scalar_t* dst) {
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* x = src + h * stride_h;
    scalar_t* o = dst + h * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const scalar_t x1 = x[i], x2 = x[i + half];
      o[i] = x1 * cos[i] - x2 * sin[i];
      o[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& positions_in,
                                                const at::Tensor& cos_sin_in) {
  // q [T, H, D], k [T, Hk, D]: rows may be strided views of a packed qkv (last dim contiguous).
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "rotary takes [num_tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(cos_sin_in.size(1) == D && k.size(2) == D, "cos_sin must be [max_position, head_dim]");
  const auto positions = positions_in.to(at::kLong).contiguous();
  const auto cos_sin = cos_sin_in.to(q.scalar_type()).contiguous();
  auto q_out = at::empty({T, q.size(1), D}, q.options());
  auto k_out = at::empty({T, k.size(1), D}, k.options());
  const int64_t max_pos = cos_sin.size(0);
  const int64_t* pos_p = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos_p[t] >= 0 && pos_p[t] < max_pos, "position out of the rotary cache");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "apply_rotary", [&] {
    const scalar_t* cs_p = cos_sin.data_ptr<scalar_t>();
    const scalar_t* q_p = q.data_ptr<scalar_t>();
    const scalar_t* k_p = k.data_ptr<scalar_t>();
    scalar_t* qo_p = q_out.data_ptr<scalar_t>();
    scalar_t* ko_p = k_out.data_ptr<scalar_t>();
    const int64_t row = (q.size(1) + k.size(1)) * D;
    at::parallel_for(0, T, grain_rows(row), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* cos = cs_p + pos_p[t] * D;
        const scalar_t* sin = cos + half;
        rotate_heads<scalar_t>(q_p + t * q.stride(0), q.stride(1), q.size(1), half, cos, sin,
                               qo_p + t * q.size(1) * D);
        rotate_heads<scalar_t>(k_p + t * k.stride(0), k.stride(1), k.size(1), half, cos, sin,
                               ko_p + t * k.size(1) * D);
      }
    });
  });
  return {q_out, k_out};
}

// SiLU(gate) * up over a packed gate_up [..., 2 * inter]: torch's own silu and mul kernels on
// the same views as `gate, up = x.chunk(2, -1); F.silu(gate) * up` (the same bits), called from
// here so that the chain costs one Python dispatch instead of four (chunk, silu, mul and the
// chunk's views): ~5 us a layer at batch 1 (issue 31).
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul takes [..., 2 * inter]");
  const int64_t inter = x.size(-1) / 2;
  auto out = at::silu(x.narrow(-1, 0, inter));
  out.mul_(x.narrow(-1, inter, inter));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("apply_rotary(Tensor q, Tensor k, Tensor positions, Tensor cos_sin) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("apply_rotary", &apply_rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
