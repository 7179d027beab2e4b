// Paged attention and the KV-cache write on CPU, reading the paged cache in place.
//
// Built at first use by torch.utils.cpp_extension (kernels/cpu_ops.py) with the machine's g++
// and cached; registered as torch.ops.shoal_cpu.*. Same contract as the torch reference in
// paged_attention.py: varlen queries (decodes and prefill chunks in one call), causal, GQA,
// optional sliding window (a query at position p sees keys (p - window, p]), optional logit
// soft-cap (softcap > 0: a scaled score s becomes softcap * tanh(s / softcap), Gemma 2), optional
// attention sinks (gpt-oss: one logit per query head in the softmax's denominator, no value;
// folded in once after the keys, as one more term of the online softmax).
//
// One task = up to kTile consecutive query tokens of one sequence x one KV head: the rows of
// that task (tokens x the query heads sharing the KV head) walk the sequence's blocks once, in
// the block table's order, with an fp32 online softmax; blocks before the first row's window
// are never touched. Tasks run in parallel on torch's intra-op threads. Chunks longer than
// max_q_len (> 0) are skipped: cpu_ops.py runs them through SDPA, which wins on long prompts.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kTile = 8;  // query tokens of a prefill chunk that share one pass over keys

struct Task {
  int64_t seq, token, num_tokens, kv_head;
};

template <typename scalar_t>
void attend(const Task& task, const scalar_t* q, int64_t q_stride_t, int64_t q_stride_h,
            const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* table,
            int64_t first_pos, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
            int64_t group, int64_t window, float scale, float softcap, const float* sinks,
            scalar_t* out,
            int64_t out_stride_t, std::vector<float>& buf) {
  const int64_t rows = task.num_tokens * group;
  const int64_t D = head_dim;
  buf.resize(rows * D * 2 + rows * 2 + rows * block_size);
  float* qf = buf.data();            // [rows, D] scaled queries
  float* acc = qf + rows * D;        // [rows, D] unnormalised outputs
  float* run_max = acc + rows * D;   // [rows]
  float* run_sum = run_max + rows;   // [rows]
  float* scores = run_sum + rows;    // [rows, block_size]
  for (int64_t i = 0; i < task.num_tokens; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* src = q + (task.token + i) * q_stride_t + (task.kv_head * group + g) * q_stride_h;
      float* dst = qf + (i * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  }
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(run_max, run_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(run_sum, run_sum + rows, 0.f);
  const int64_t last_pos = first_pos + task.num_tokens - 1;  // position of the task's last query
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t row_stride = num_kv_heads * D;  // between consecutive tokens of a block
  for (int64_t b = lo / block_size; b <= last_pos / block_size; ++b) {
    const int64_t block = table[b];
    const int64_t base = b * block_size;
    const scalar_t* kb = k_cache + (block * block_size * num_kv_heads + task.kv_head) * D;
    const scalar_t* vb = v_cache + (block * block_size * num_kv_heads + task.kv_head) * D;
    for (int64_t i = 0; i < task.num_tokens; ++i) {
      const int64_t pos = first_pos + i;
      const int64_t k_lo = std::max<int64_t>(window > 0 ? pos - window + 1 : 0, base);
      const int64_t k_hi = std::min<int64_t>(pos, base + block_size - 1);
      if (k_lo > k_hi) continue;  // no visible key of this row in this block
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        const float* qr = qf + r * D;
        float* sr = scores + r * block_size;
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t kp = k_lo; kp <= k_hi; ++kp) {
          const scalar_t* kr = kb + (kp - base) * row_stride;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * static_cast<float>(kr[d]);
          if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);  // Gemma 2's soft-cap
          sr[kp - base] = dot;
          block_max = std::max(block_max, dot);
        }
        const float new_max = std::max(run_max[r], block_max);
        const float correction = std::exp(run_max[r] - new_max);  // 0 on the first block
        float* ar = acc + r * D;
        float sum = run_sum[r] * correction;
        for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
        for (int64_t kp = k_lo; kp <= k_hi; ++kp) {
          const float p = std::exp(sr[kp - base] - new_max);
          sum += p;
          const scalar_t* vr = vb + (kp - base) * row_stride;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += p * static_cast<float>(vr[d]);
        }
        run_max[r] = new_max;
        run_sum[r] = sum;
      }
    }
  }
  for (int64_t i = 0; i < task.num_tokens; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      float inv = 1.f / run_sum[r];
      if (sinks != nullptr) {  // exp(s) / (sum + exp(sink)), both rescaled to the larger max
        const float sink = sinks[task.kv_head * group + g];
        const float m = std::max(run_max[r], sink);
        const float keep = std::exp(run_max[r] - m);
        inv = keep / (run_sum[r] * keep + std::exp(sink - m));
      }
      scalar_t* dst = out + (task.token + i) * out_stride_t + (task.kv_head * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * D + d] * inv);
    }
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, int64_t window, int64_t max_q_len, double softcap,
                           const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [tokens, heads, head_dim] with dense heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "KV caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, seq_lens and query_start_loc must be int32");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto starts = query_start_loc.contiguous();
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0);
  const int64_t group = num_heads / num_kv_heads;
  at::Tensor sinks_f;  // [num_heads] float32, or undefined
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, "sinks must be [num_heads]");
    sinks_f = sinks->to(at::kFloat).contiguous();
  }
  const float* sinks_p = sinks_f.defined() ? sinks_f.data_ptr<float>() : nullptr;
  const int64_t num_seqs = lens.size(0);
  const int32_t* lens_p = lens.data_ptr<int32_t>();
  const int32_t* starts_p = starts.data_ptr<int32_t>();
  std::vector<Task> tasks;
  std::vector<int64_t> first_pos;  // per task: position of its first query
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts_p[s + 1] - starts_p[s];
    if (max_q_len > 0 && q_len > max_q_len) continue;  // left to the caller (rows unwritten)
    const int64_t seq_start = lens_p[s] - q_len;  // position of the sequence's first query
    for (int64_t t = 0; t < q_len; t += kTile) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tasks.push_back({s, starts_p[s] + t, std::min(kTile, q_len - t), h});
        first_pos.push_back(seq_start + t);
      }
    }
  }
  auto out = at::empty({q.size(0), num_heads, head_dim}, q.options());
  const int64_t table_stride = tables.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* q_p = q.data_ptr<scalar_t>();
    const scalar_t* k_p = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_p = v_cache.data_ptr<scalar_t>();
    scalar_t* out_p = out.data_ptr<scalar_t>();
    const int32_t* table_p = tables.data_ptr<int32_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        attend<scalar_t>(task, q_p, q.stride(0), q.stride(1), k_p, v_p,
                         table_p + task.seq * table_stride, first_pos[i], block_size,
                         num_kv_heads, head_dim, group, window, static_cast<float>(scale),
                         static_cast<float>(softcap), sinks_p, out_p,
                         num_heads * head_dim, buf);
      }
    });
  });
  return out;
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == k.size(0));
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3));
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2));
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "reshape_and_cache", [&] {
    const auto kc = k.to(k_cache.scalar_type()), vc = v.to(k_cache.scalar_type());
    const scalar_t* k_p = kc.data_ptr<scalar_t>();
    const scalar_t* v_p = vc.data_ptr<scalar_t>();
    scalar_t* kc_p = k_cache.data_ptr<scalar_t>();
    scalar_t* vc_p = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < k.size(0); ++t) {
      const int64_t slot = slot_p[t];
      if (slot < 0) continue;
      std::copy(k_p + t * kc.stride(0), k_p + t * kc.stride(0) + row, kc_p + slot * row);
      std::copy(v_p + t * vc.stride(0), v_p + t * vc.stride(0) + row, vc_p + slot * row);
    }
  });
}

}  // namespace

TORCH_LIBRARY(shoal_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int window, int max_q_len, "
        "float softcap, Tensor? sinks) -> Tensor");
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
