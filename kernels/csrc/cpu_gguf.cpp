// Matmuls over a GGUF file's quantised blocks as stored (ggml's block layouts), for the CPU.
//
// `gguf_matmul`: y [M, N] = x [M, K] . W^T for the few rows of a decode step, where W [N, K] is
// kept as the file's bytes [N, K / QK * block bytes]: each block is unpacked into 256 floats in L1
// and multiplied into the M rows' accumulators at once, so the weight is read once per step at its
// stored size (4.5-8.5 bits a weight) instead of 32. `gguf_dequantize`: the same unpacking for a
// whole weight (fp32 or bf16), which prefill then runs through a GEMM (layers/gguf_weights.py).
//
// Types (ggml's ids): Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8 (blocks of 32), Q4_K 12, Q5_K 13,
// Q6_K 14 (super-blocks of 256). The unpacking follows ggml's reference dequantisation
// (ggml-quants.c), checked against the gguf package's in tests/unit/kernels/test_cpu_gguf.py.
// The vectors are GCC's generic vector type (AVX-512, AVX2 or plain scalar code under
// -march=native), as in cpu_gemv.cpp; the unpacking loops are plain loops GCC vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum_lanes(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(16 * sizeof(uint32_t))));

inline u8x16 bytes(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

typedef int32_t i32x16 __attribute__((vector_size(16 * sizeof(int32_t))));

// 16 small integers -> 16 floats. Through int32 (vpmovzxbd / vpmovsxbd, then vcvtdq2ps): GCC
// turns a direct byte -> float conversion into 16 scalar ones.
#ifdef __AVX512F__
inline vec to_float(u8x16 v) {
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)v));
}
inline vec to_float(i8x16 v) {
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)v));
}
#else
inline vec to_float(u8x16 v) {
  return __builtin_convertvector(__builtin_convertvector(v, i32x16), vec);
}
inline vec to_float(i8x16 v) {
  return __builtin_convertvector(__builtin_convertvector(v, i32x16), vec);
}
#endif

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ggml's 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The fifth bit of each of a Q5_0 / Q5_1 block's weights, 16 at a time: bit `first + lane` of
// qh, moved to 0x10.
inline u8x16 fifth_bits(uint32_t qh, int first) {
  const u32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const u32x16 bits = ((qh >> (lane + first)) & 1) << 4;
  return __builtin_convertvector(bits, u8x16);
}

// Each type: QK weights a block, B bytes a block, and `unpack` (block -> QK floats), written
// 16 weights at a time.
struct Q4_0 {
  static constexpr int QK = 32, B = 18;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b);
    const u8x16 q = bytes(b + 2);
    store(y, d * (to_float(q & 0xF) - 8.f));
    store(y + 16, d * (to_float(q >> 4) - 8.f));
  }
};

struct Q4_1 {
  static constexpr int QK = 32, B = 20;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b), m = half(b + 2);
    const u8x16 q = bytes(b + 4);
    store(y, d * to_float(q & 0xF) + m);
    store(y + 16, d * to_float(q >> 4) + m);
  }
};

struct Q5_0 {
  static constexpr int QK = 32, B = 22;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const u8x16 q = bytes(b + 6);
    store(y, d * (to_float((q & 0xF) | fifth_bits(qh, 0)) - 16.f));
    store(y + 16, d * (to_float((q >> 4) | fifth_bits(qh, 16)) - 16.f));
  }
};

struct Q5_1 {
  static constexpr int QK = 32, B = 24;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b), m = half(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const u8x16 q = bytes(b + 8);
    store(y, d * to_float((q & 0xF) | fifth_bits(qh, 0)) + m);
    store(y + 16, d * to_float((q >> 4) | fifth_bits(qh, 16)) + m);
  }
};

struct Q8_0 {
  static constexpr int QK = 32, B = 34;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b);
    i8x16 q[2];
    std::memcpy(q, b + 2, 32);
    store(y, d * to_float(q[0]));
    store(y + 16, d * to_float(q[1]));
  }
};

struct Q4_K {  // d, dmin (fp16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
  static constexpr int QK = 256, B = 144;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0; j < 4; ++j, q += 32, y += 64) {  // 64 weights: two sub-blocks
      int sc, m;
      scale_min_k4(2 * j, scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(2 * j + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      const u8x16 qa = bytes(q), qb = bytes(q + 16);
      store(y, d1 * to_float(qa & 0xF) - m1);
      store(y + 16, d1 * to_float(qb & 0xF) - m1);
      store(y + 32, d2 * to_float(qa >> 4) - m2);
      store(y + 48, d2 * to_float(qb >> 4) - m2);
    }
  }
};

struct Q5_K {  // d, dmin, 12 bytes of scales/mins, 32 bytes of fifth bits, 128 of nibbles
  static constexpr int QK = 256, B = 176;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const u8x16 ha = bytes(b + 16), hb = bytes(b + 32);
    const uint8_t* ql = b + 48;
    for (int j = 0; j < 4; ++j, ql += 32, y += 64) {
      int sc, m;
      scale_min_k4(2 * j, scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(2 * j + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      const int s1 = 2 * j, s2 = 2 * j + 1;
      const u8x16 qa = bytes(ql), qb = bytes(ql + 16);
      store(y, d1 * to_float((qa & 0xF) | (((ha >> s1) & 1) << 4)) - m1);
      store(y + 16, d1 * to_float((qb & 0xF) | (((hb >> s1) & 1) << 4)) - m1);
      store(y + 32, d2 * to_float((qa >> 4) | (((ha >> s2) & 1) << 4)) - m2);
      store(y + 48, d2 * to_float((qb >> 4) | (((hb >> s2) & 1) << 4)) - m2);
    }
  }
};

struct Q6_K {  // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (fp16)
  static constexpr int QK = 256, B = 210;
  static void unpack(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int n = 0; n < 2; ++n, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; l += 16) {  // 16 weights of each of four sub-blocks of 16
        const int is = l / 16;
        const u8x16 qa = bytes(ql + l), qb = bytes(ql + l + 32), h = bytes(qh + l);
        store(y + l, (d * sc[is]) * (to_float((qa & 0xF) | ((h & 3) << 4)) - 32.f));
        store(y + l + 32,
              (d * sc[is + 2]) * (to_float((qb & 0xF) | (((h >> 2) & 3) << 4)) - 32.f));
        store(y + l + 64, (d * sc[is + 4]) * (to_float((qa >> 4) | (((h >> 4) & 3) << 4)) - 32.f));
        store(y + l + 96, (d * sc[is + 6]) * (to_float((qb >> 4) | (((h >> 6) & 3) << 4)) - 32.f));
      }
    }
  }
};

constexpr int kMaxRows = 4;  // x rows per pass over the weight (more: another pass)
constexpr int64_t kRowsPerTask = 4;

// Rows [n0, n1) of y for M <= kMaxRows rows of x.
template <typename T, int M>
void matmul_rows(const float* x, const uint8_t* w, float* y, int64_t K, int64_t N,
                 int64_t ldx, int64_t n0, int64_t n1) {
  const int64_t blocks = K / T::QK, row_bytes = blocks * T::B;
  alignas(64) float buf[T::QK];
  for (int64_t n = n0; n < n1; ++n) {
    vec acc[M] = {};
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      T::unpack(wr + b * T::B, buf);
      const float* xb = x + b * T::QK;
      for (int i = 0; i < T::QK; i += kLanes) {
        const vec wv = load(buf + i);
        for (int m = 0; m < M; ++m) acc[m] += load(xb + m * ldx + i) * wv;
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = sum_lanes(acc[m]);
  }
}

template <typename T>
void matmul(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kRowsPerTask, n1 = std::min(t1 * kRowsPerTask, N);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N;
      switch (std::min<int64_t>(M - m0, kMaxRows)) {
        case 1: matmul_rows<T, 1>(xm, w, ym, K, N, K, n0, n1); break;
        case 2: matmul_rows<T, 2>(xm, w, ym, K, N, K, n0, n1); break;
        case 3: matmul_rows<T, 3>(xm, w, ym, K, N, K, n0, n1); break;
        default: matmul_rows<T, 4>(xm, w, ym, K, N, K, n0, n1); break;
      }
    }
  });
}

template <typename T, typename Out>
void dequantize(const uint8_t* w, Out* y, int64_t K, int64_t N) {
  const int64_t blocks = K / T::QK;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float buf[T::QK];
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* src = w + (n * blocks + b) * T::B;
        Out* dst = y + n * K + b * T::QK;
        if constexpr (std::is_same_v<Out, float>) {
          T::unpack(src, dst);
        } else {
          T::unpack(src, buf);
          for (int i = 0; i < T::QK; ++i) dst[i] = static_cast<Out>(buf[i]);
        }
      }
    }
  });
}

// Runs BODY with T bound to the block struct of ggml type id `type`.
#define GGUF_DISPATCH(type, BODY)                                              \
  switch (type) {                                                              \
    case 2: { using T = Q4_0; BODY; } break;                                   \
    case 3: { using T = Q4_1; BODY; } break;                                   \
    case 6: { using T = Q5_0; BODY; } break;                                   \
    case 7: { using T = Q5_1; BODY; } break;                                   \
    case 8: { using T = Q8_0; BODY; } break;                                   \
    case 12: { using T = Q4_K; BODY; } break;                                  \
    case 13: { using T = Q5_K; BODY; } break;                                  \
    case 14: { using T = Q6_K; BODY; } break;                                  \
    default: TORCH_CHECK(false, "gguf: unsupported ggml type ", type);         \
  }

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t K) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "gguf blocks must be a contiguous uint8 [N, row bytes] tensor");
  GGUF_DISPATCH(type, {
    TORCH_CHECK(K % T::QK == 0, "gguf: K=", K, " is not a multiple of the block size ", T::QK);
    TORCH_CHECK(blocks.size(1) == K / T::QK * T::B, "gguf: rows of ", blocks.size(1),
                " bytes do not hold K=", K, " weights of type ", type);
  });
}

at::Tensor gguf_matmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "gguf_matmul: x [M, K] fp32");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = blocks.size(0);
  check_blocks(blocks, type, K);
  const auto x = x_in.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  GGUF_DISPATCH(type, matmul<T>(xp, wp, yp, M, K, N));
  return y;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t K,
                           at::ScalarType dtype) {
  check_blocks(blocks, type, K);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gguf_dequantize: fp32 or bf16");
  const int64_t N = blocks.size(0);
  auto y = at::empty({N, K}, blocks.options().dtype(dtype));
  if (N == 0) return y;
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    float* yp = y.data_ptr<float>();
    GGUF_DISPATCH(type, (dequantize<T, float>(wp, yp, K, N)));
  } else {
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    GGUF_DISPATCH(type, (dequantize<T, c10::BFloat16>(wp, yp, K, N)));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("gguf_matmul(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int K, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) {
  m.impl("gguf_matmul", gguf_matmul);
  m.impl("gguf_dequantize", gguf_dequantize);
}
