// y = x W^T (+ b) for steps of one or two rows (a single stream's decode), fp32, W in its plain
// row-major [N, K] layout.
//
// Why: at batch 1 a step reads every weight once and does two flops per weight, so it is bound by
// memory bandwidth. oneDNN's packed kernels, built for many rows, read SmolLM2's 538 MB at ~22
// GB/s here, and torch's F.linear (MKL sgemv) at ~11; plain dot products over contiguous rows,
// eight rows at a time across the threads, stream them at 25-28 GB/s, near what a plain sum
// over the same bytes reaches (docs/figures.md). From three rows on, oneDNN's GEMM wins.
//
// The vectors are GCC's generic vector type, so the same code compiles to AVX-512, AVX2 or NEON
// under -march=native; `a * b + c` becomes an FMA there (GCC contracts by default).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int kLanes = 16;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));  // an unaligned load
  return v;
}

inline float sum_lanes(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Rows [n0, n1) of y [M, N] = x [M, K] . w [N, K]^T, R weight rows at a time: R * M
// accumulators stay in registers while the R rows stream past once.
template <int M, int R>
void rows(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    vec acc[M][R] = {};
    const float* wr = w + n * K;
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      vec wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load(wr + r * K + k);
      for (int m = 0; m < M; ++m) {
        const vec xv = load(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int r = 0; r < R; ++r) {
        float s = sum_lanes(acc[m][r]);
        for (int64_t t = k; t < K; ++t) s += x[m * K + t] * wr[r * K + t];
        y[m * N + n + r] = bias == nullptr ? s : s + bias[n + r];
      }
    }
  }
  for (; n < n1; ++n) {  // the last rows of the range, one at a time
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t t = 0; t < K; ++t) s += x[m * K + t] * w[n * K + t];
      y[m * N + n] = bias == nullptr ? s : s + bias[n];
    }
  }
}

constexpr int64_t kBlock = 8;  // weight rows per parallel task unit

at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
              "gemv takes x [M, K] and weight [N, K]");
  TORCH_CHECK(x_in.size(0) <= 2, "gemv takes one or two rows");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "gemv is float32");
  TORCH_CHECK(weight.is_contiguous(), "gemv needs a contiguous weight");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "bias must be [N]");
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Contiguous row ranges, one per thread: each streams its own part of the weight.
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kBlock, n1 = std::min(b1 * kBlock, N);
    if (M == 1) {
      rows<1, 8>(xp, wp, bp, yp, K, N, n0, n1);
    } else {
      rows<2, 8>(xp, wp, bp, yp, K, N, n0, n1);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) {
  m.impl("gemv", gemv);
}
