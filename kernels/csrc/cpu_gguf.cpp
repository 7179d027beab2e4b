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
#include <vector>

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
inline void put(uint8_t* p, u8x16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef uint8_t u8x32 __attribute__((vector_size(32)));
inline u8x32 bytes32(const uint8_t* p) {
  u8x32 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void put32(uint8_t* p, u8x32 v) { std::memcpy(p, &v, sizeof(v)); }

// v in n consecutive floats (the int8 path's scale of each int32 lane: 4 weights).
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
inline void lanes8(float* p, float v) {
  const f32x8 x = f32x8{} + v;
  std::memcpy(p, &x, sizeof(x));
}
inline void lanes4(float* p, float v) {
  const f32x4 x = f32x4{} + v;
  std::memcpy(p, &x, sizeof(x));
}

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

// Each type: QK weights a block, B bytes a block, `unpack` (block -> QK floats), written 16
// weights at a time, and `q8` (block -> QK unsigned codes c; w = s * c + o with s given for each
// 4 weights (QK / 4 floats: one per int32 lane of the int8 path below) and o per 16).
struct Q4_0 {
  static constexpr int QK = 32, B = 18;
  static void unpack(const uint8_t* b, float* y) {
    const float d = half(b);
    const u8x16 q = bytes(b + 2);
    store(y, d * (to_float(q & 0xF) - 8.f));
    store(y + 16, d * (to_float(q >> 4) - 8.f));
  }
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {
    const float d = half(b);
    const u8x16 q = bytes(b + 2);
    put(c, q & 0xF);
    put(c + 16, q >> 4);
    lanes8(s, d);
    o[0] = o[1] = -8.f * d;
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
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {
    const float d = half(b), m = half(b + 2);
    const u8x16 q = bytes(b + 4);
    put(c, q & 0xF);
    put(c + 16, q >> 4);
    lanes8(s, d);
    o[0] = o[1] = m;
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
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {
    const float d = half(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const u8x16 q = bytes(b + 6);
    put(c, (q & 0xF) | fifth_bits(qh, 0));
    put(c + 16, (q >> 4) | fifth_bits(qh, 16));
    lanes8(s, d);
    o[0] = o[1] = -16.f * d;
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
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {
    const float d = half(b), m = half(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const u8x16 q = bytes(b + 8);
    put(c, (q & 0xF) | fifth_bits(qh, 0));
    put(c + 16, (q >> 4) | fifth_bits(qh, 16));
    lanes8(s, d);
    o[0] = o[1] = m;
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
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {  // codes w + 128
    const float d = half(b);
    put32(c, bytes32(b + 2) ^ 0x80);
    lanes8(s, d);
    o[0] = o[1] = -128.f * d;
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
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0; j < 4; ++j, q += 32, c += 64, s += 16, o += 4) {
      int sc, m;
      scale_min_k4(2 * j, scales, &sc, &m);
      lanes8(s, d * sc);
      o[0] = o[1] = -dmin * m;
      scale_min_k4(2 * j + 1, scales, &sc, &m);
      lanes8(s + 8, d * sc);
      o[2] = o[3] = -dmin * m;
      const u8x32 v = bytes32(q);
      put32(c, v & 0xF);
      put32(c + 32, v >> 4);
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
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const u8x32 h = bytes32(b + 16);
    const uint8_t* ql = b + 48;
    for (int j = 0; j < 4; ++j, ql += 32, c += 64, s += 16, o += 4) {
      int sc, m;
      scale_min_k4(2 * j, scales, &sc, &m);
      lanes8(s, d * sc);
      o[0] = o[1] = -dmin * m;
      scale_min_k4(2 * j + 1, scales, &sc, &m);
      lanes8(s + 8, d * sc);
      o[2] = o[3] = -dmin * m;
      const u8x32 v = bytes32(ql);
      put32(c, (v & 0xF) | (((h >> (2 * j)) & 1) << 4));
      put32(c + 32, (v >> 4) | (((h >> (2 * j + 1)) & 1) << 4));
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
  static void q8(const uint8_t* b, uint8_t* c, float* s, float* o) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int g = 0; g < 16; ++g) {  // group g of 16 weights has scale sc[g]
      lanes4(s + 4 * g, d * sc[g]);
      o[g] = -32.f * d * sc[g];
    }
    for (int n = 0; n < 2; ++n, c += 128, ql += 64, qh += 32) {
      const u8x32 qa = bytes32(ql), qb = bytes32(ql + 32), h = bytes32(qh);
      put32(c, (qa & 0xF) | ((h & 3) << 4));
      put32(c + 32, (qb & 0xF) | (((h >> 2) & 3) << 4));
      put32(c + 64, (qa >> 4) | (((h >> 4) & 3) << 4));
      put32(c + 96, (qb >> 4) | (((h >> 6) & 3) << 4));
    }
  }
};

constexpr int kMaxRows = 4;  // x rows per pass over the weight (more: another pass)
constexpr int64_t kRowsPerTask = 4;

// Every kernel below takes up to kMaxRows rows of x a pass, its row count a template argument
// (the accumulators stay in registers): `run(R, m0)` for rows [m0, m0 + R) of M, R a
// std::integral_constant (decltype(R)::value in a template argument).
template <typename Run>
inline void row_tiles(int64_t M, const Run& run) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    switch (std::min<int64_t>(M - m0, kMaxRows)) {
      case 1: run(std::integral_constant<int, 1>{}, m0); break;
      case 2: run(std::integral_constant<int, 2>{}, m0); break;
      case 3: run(std::integral_constant<int, 3>{}, m0); break;
      default: run(std::integral_constant<int, kMaxRows>{}, m0); break;
    }
  }
}

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
    row_tiles(M, [&](auto R, int64_t m0) {
      matmul_rows<T, decltype(R)::value>(x + m0 * K, w, y + m0 * N, K, N, K, n0, n1);
    });
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
#ifdef __AVX512BF16__  // 16 at a time (round to nearest even, as c10::BFloat16)
          for (int i = 0; i < T::QK; i += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(buf + i)));
#else
          for (int i = 0; i < T::QK; ++i) dst[i] = static_cast<Out>(buf[i]);
#endif
        }
      }
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The int8 path (`gguf_matmul_q8`, `int8_matmul_q8`): the rows of x are quantised once per call
// to int8 in blocks of 32 (d = max |x| / 127, as llama.cpp's Q8_0 activations), and each weight
// row is unpacked into unsigned codes with w = s * c + o per group of 16. A row's dot product is
// then sum over groups of s * d * (c . q) + o * (d * sum q): c . q is one VNNI instruction
// (vpdpbusd: unsigned bytes x signed bytes, 64 pairs into 16 int32 lanes) per 64 weights, in
// place of 64 byte -> float conversions and FMAs. Q8_0's signed weights become unsigned codes
// w + 128 with o = -128 s: exact, as the offset uses the same quantised sums. The codes of
// four weight rows (a tile, in L1) meet up to four rows of x at a time, so a batch's rows read
// each weight once.
#define SHOAL_Q8 1

// Rows of x [M, K] (contiguous, K % 32 == 0) quantised to int8 per block of 32 (d = max |x| /
// 127, as llama.cpp's Q8_0 activations) into q [M * K]: the one per-32 quantiser, whose callers
// keep what their kernels need of each block i through `block(i, d, sum of the first 16 codes,
// sum of the last 16)` (QuantX below, Quant32 for the packed per-32 kernels).
template <typename Block>
void quantize_per_32(const float* x, int64_t M, int64_t K, int8_t* q, const Block& block) {
  for (int64_t i = 0; i < M * K / 32; ++i) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * i), v1 = _mm512_loadu_ps(x + 32 * i + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * i), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * i + 16), _mm512_cvtsepi32_epi8(q1));
    block(i, amax / 127.f, _mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1));
  }
}

// x [M, K] quantised per 32 for the unpacking kernels: q int8 [M, K]; lane [M, K / 4], the
// block's d for each int32 lane of a vpdpbusd (4 values); gsum [M, K / 16], d * the sum of q
// over each group of 16.
struct QuantX {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;
  std::vector<float> lane, gsum;
};

QuantX quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantX r;
  r.M = M;
  r.K = K;
  r.q.resize(M * K);
  r.lane.resize(M * K / 4);
  r.gsum.resize(M * K / 16);
  quantize_per_32(x, M, K, r.q.data(), [&](int64_t i, float d, int32_t lo, int32_t hi) {
    _mm256_storeu_ps(r.lane.data() + 8 * i, _mm256_set1_ps(d));
    r.gsum[2 * i] = d * static_cast<float>(lo);
    r.gsum[2 * i + 1] = d * static_cast<float>(hi);
  });
  return r;
}

// y[m0 + r, n + w] for R rows of x and W unpacked weight rows: codes c [W, K], scales s [W, K / 4]
// (one per int32 lane), offsets o [W, K / 16].
// RowScale: s is one scale for the whole row (Shoal's int8), applied once at the end.
template <int R, int W, bool RowScale>
void dot_tile(const uint8_t* c, const float* s, const float* o, const QuantX& x, int64_t m0,
              float* y, int64_t N, int64_t n) {
  const int64_t K = x.K, G = K / 16;
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  const int8_t* xq = x.q.data() + m0 * K;
  const float* xl = x.lane.data() + m0 * (K / 4);
  for (int64_t k = 0; k < K; k += 64) {
    __m512i a[W];
    __m512 sv[W];
    for (int w = 0; w < W; ++w) {
      a[w] = _mm512_loadu_si512(c + w * K + k);
      if constexpr (!RowScale) sv[w] = _mm512_loadu_ps(s + w * (K / 4) + k / 4);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq + r * K + k);
      const __m512 dx = _mm512_loadu_ps(xl + r * (K / 4) + k / 4);
      for (int w = 0; w < W; ++w) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a[w], xv);
        const __m512 scale = RowScale ? dx : _mm512_mul_ps(sv[w], dx);
        acc[r][w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][w]);
      }
    }
  }
  if constexpr (RowScale)
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_mul_ps(acc[r][w], _mm512_set1_ps(s[w * (K / 4)]));
  for (int64_t g = 0; g < G; g += 16) {  // the offsets: o . gsum (G % 4 == 0)
    const __mmask16 mask = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512 gs = _mm512_maskz_loadu_ps(mask, x.gsum.data() + (m0 + r) * G + g);
      for (int w = 0; w < W; ++w)
        acc[r][w] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, o + w * G + g), gs, acc[r][w]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) y[(m0 + r) * N + n + w] = _mm512_reduce_add_ps(acc[r][w]);
}

template <int W, bool RowScale>
void dot_rows(const uint8_t* c, const float* s, const float* o, const QuantX& x, float* y,
              int64_t N, int64_t n) {
  row_tiles(x.M, [&](auto R, int64_t m0) {
    dot_tile<decltype(R)::value, W, RowScale>(c, s, o, x, m0, y, N, n);
  });
}

constexpr int kTile = 4;  // weight rows unpacked together

// y [M, N] over N weight rows, `unpack(n, k0, k1, c, s, o)` giving weights [k0, k1) of row n
// (codes c, lane scales s, offsets o: the row's buffers, from its start).
template <bool RowScale = false, typename Unpack>
void matmul_q8(const Unpack& unpack, const QuantX& x, float* y, int64_t N) {
  const int64_t K = x.K, G = K / 16;
  at::parallel_for(0, (N + kTile - 1) / kTile, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> c(kTile * K);
    std::vector<float> s(kTile * K / 4), o(kTile * G);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, rows = std::min<int64_t>(kTile, N - n0);
      for (int64_t i = 0; i < rows; ++i)
        unpack(n0 + i, 0, K, c.data() + i * K, s.data() + i * K / 4, o.data() + i * G);
      if (rows == kTile) {
        dot_rows<kTile, RowScale>(c.data(), s.data(), o.data(), x, y, N, n0);
      } else {
        for (int64_t i = 0; i < rows; ++i)
          dot_rows<1, RowScale>(c.data() + i * K, s.data() + i * K / 4, o.data() + i * G, x, y, N, n0 + i);
      }
    }
  });
}

template <typename T>
void gguf_q8(const uint8_t* w, const QuantX& x, float* y, int64_t N) {
  const int64_t K = x.K, row_bytes = K / T::QK * T::B;
  constexpr int groups = T::QK / 16;
  matmul_q8([&](int64_t n, int64_t k0, int64_t k1, uint8_t* c, float* s, float* o) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = k0 / T::QK; b < k1 / T::QK; ++b)
      T::q8(row + b * T::B, c + b * T::QK, s + b * T::QK / 4, o + b * groups);
  }, x, y, N);
}

// The K-quants' one-row / few-row path (`gguf_matmul_q8k`, Q4_K and Q6_K): llama.cpp's way of
// reading a super-block at the bandwidth. The rows of x are quantised once per call per
// super-block of 256 (one float d each, as ggml's Q8_K), and a super-block's integer dot
// products are scaled by its 6- or 8-bit sub-block scales in the integer domain (vpmaddwd), so
// a super-block costs one int -> float conversion and one FMA per row of x instead of the
// per-32 path's one a 64 weights (gguf_matmul_q8 above, still reachable for comparison).
// The blocks are read as stored (no repacking): each 64-byte load of nibbles meets activations
// stored in the order the load's low and high nibbles hold their weights.
//
// The integer sums stay in range: a vpdpbusd lane (4 products) is at most 4 * 63 * 127 = 32004
// in magnitude (Q6_K's codes), so it is a valid int16 for vpmaddwd against the (scale, 0) pairs.
struct QuantK {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;     // [M, K], each 256 in the weight type's order
  std::vector<float> d;      // [M, K / 256]
  std::vector<int16_t> s16;  // [M, K / 16]: sums of q over each 16 weights (natural order)
  std::vector<int16_t> s32;  // [M, K / 32]
};

// Where weights 16g..16g+15 of a super-block go in q. Q4_K: a 64-byte load of the nibbles of
// 128 weights holds weights 0..31 and 64..95 in its low nibbles, 32..63 and 96..127 in its high
// ones (ggml's layout), so q holds each 128 as [0..31, 64..95, 32..63, 96..127]. Q6_K: natural.
inline int position(bool q4k, int g) {
  if (!q4k) return 16 * g;
  const int w = 16 * g, c = (w % 128) / 32;
  return (w / 128) * 128 + (c % 2) * 64 + (c / 2) * 32 + w % 32;
}

QuantK quantize_k(const float* x, int64_t M, int64_t K, bool q4k) {
  QuantK r;
  r.M = M;
  r.K = K;
  r.q.resize(M * K);
  r.d.resize(M * K / 256);
  r.s16.resize(M * K / 16);
  r.s32.resize(M * K / 32);
  for (int64_t i = 0; i < M * K / 256; ++i) {  // rows are contiguous and K % 256 == 0
    const float* xs = x + 256 * i;
    __m512 amax = _mm512_setzero_ps();
    for (int g = 0; g < 16; ++g) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xs + 16 * g)));
    const float a = _mm512_reduce_max_ps(amax);
    const __m512 id = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
    r.d[i] = a / 127.f;
    int16_t* s16 = r.s16.data() + 16 * i;
    for (int g = 0; g < 16; ++g) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + 16 * g), id));
      s16[g] = static_cast<int16_t>(_mm512_reduce_add_epi32(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + 256 * i + position(q4k, g)),
                       _mm512_cvtsepi32_epi8(v));
    }
    for (int j = 0; j < 8; ++j) r.s32[8 * i + j] = static_cast<int16_t>(s16[2 * j] + s16[2 * j + 1]);
  }
  return r;
}

inline __m512i lanes_of(int a, int b) {  // int32 lanes 0-7 = a, 8-15 = b
  return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b));
}

// Row n of a Q4_K weight against rows [m0, m0 + R) of x.
template <int R>
void q4k_row(const uint8_t* w, const QuantK& x, int64_t m0, float* y, int64_t N, int64_t n) {
  const int64_t SB = x.K / 256;
  __m512 acc[R];
  __m128 accm[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    accm[r] = _mm_setzero_ps();
  }
  const __m512i nib = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  // sub-block scales of each load's low / high nibbles (lanes 0-7, 8-15; see position())
  const __m512i i0 = lanes_of(0, 2), i1 = lanes_of(1, 3), i2 = lanes_of(4, 6), i3 = lanes_of(5, 7);
  for (int64_t b = 0; b < SB; ++b, w += 144) {
    const float d = half(w), dmin = half(w + 2);
    uint32_t a, m, c;  // ggml's 12 bytes of 6-bit scales and mins -> 8 bytes of each
    std::memcpy(&a, w + 4, 4);
    std::memcpy(&m, w + 8, 4);
    std::memcpy(&c, w + 12, 4);
    const uint64_t scales = (a & 0x3f3f3f3fu) |
        static_cast<uint64_t>((c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t mins = (m & 0x3f3f3f3fu) |
        static_cast<uint64_t>(((c >> 4) & 0x0f0f0f0fu) | (((m >> 6) & 0x03030303u) << 4)) << 32;
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scales)));
    const __m512i s0 = _mm512_permutexvar_epi32(i0, sc), s1 = _mm512_permutexvar_epi32(i1, sc);
    const __m512i s2 = _mm512_permutexvar_epi32(i2, sc), s3 = _mm512_permutexvar_epi32(i3, sc);
    const __m128i mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(mins)));
    const __m512i w0 = _mm512_loadu_si512(w + 16), w1 = _mm512_loadu_si512(w + 80);
    const __m512i l0 = _mm512_and_si512(w0, nib), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), nib);
    const __m512i l1 = _mm512_and_si512(w1, nib), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), nib);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * SB + b;
      const int8_t* q = x.q.data() + 256 * at;
      const __m512i p0 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, l0, _mm512_loadu_si512(q)), s0);
      const __m512i p1 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, h0, _mm512_loadu_si512(q + 64)), s1);
      const __m512i p2 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, l1, _mm512_loadu_si512(q + 128)), s2);
      const __m512i p3 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, h1, _mm512_loadu_si512(q + 192)), s3);
      const __m512i p = _mm512_add_epi32(_mm512_add_epi32(p0, p1), _mm512_add_epi32(p2, p3));
      const float dx = x.d[at];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * dx), acc[r]);
      const __m128i ms = _mm_madd_epi16(mn, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.s32.data() + 8 * at)));
      accm[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(ms), _mm_set1_ps(dmin * dx), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 t = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    y[(m0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(t);
  }
}

// Row n of a Q6_K weight: w = d * sc * (q - 32), q in 0..63; the -32 comes off as 32 * (the
// scales . the sums of x over each 16).
template <int R>
void q6k_row(const uint8_t* w, const QuantK& x, int64_t m0, float* y, int64_t N, int64_t n) {
  const int64_t SB = x.K / 256;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  const __m512i hi2 = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
  // the 16 groups' scales: each 128-bit lane of a load is one group of 16
  const __m512i i0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(4));
  const __m512i i2 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));
  const __m512i i3 = _mm512_add_epi32(i0, _mm512_set1_epi32(12));
  for (int64_t b = 0; b < SB; ++b, w += 210) {
    const float d = half(w + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
    const __m512i sc = _mm512_cvtepu16_epi32(sc16);  // (scale, 0) int16 pairs
    const __m512i s[4] = {_mm512_permutexvar_epi32(i0, sc), _mm512_permutexvar_epi32(i1, sc),
                          _mm512_permutexvar_epi32(i2, sc), _mm512_permutexvar_epi32(i3, sc)};
    __m512i lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {  // 128 weights: ql 64 bytes, qh 32
      const __m512i ql = _mm512_loadu_si512(w + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
      // bytes 0-31 take their fifth and sixth bits from qh bits 0-1 (low nibbles) and 4-5
      // (high), bytes 32-63 from bits 2-3 and 6-7
      const __m512i hs = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      lo[h] = _mm512_or_si512(_mm512_and_si512(ql, nib), _mm512_slli_epi16(_mm512_and_si512(hs, two), 4));
      hi[h] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nib), _mm512_and_si512(hs, hi2));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * SB + b;
      const int8_t* q = x.q.data() + 256 * at;
      const __m512i p0 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, lo[0], _mm512_loadu_si512(q)), s[0]);
      const __m512i p1 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, hi[0], _mm512_loadu_si512(q + 64)), s[1]);
      const __m512i p2 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, lo[1], _mm512_loadu_si512(q + 128)), s[2]);
      const __m512i p3 = _mm512_madd_epi16(_mm512_dpbusd_epi32(zero, hi[1], _mm512_loadu_si512(q + 192)), s[3]);
      const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.s16.data() + 16 * at)));
      const __m512i p = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_add_epi32(p0, p1), _mm512_add_epi32(p2, p3)),
          _mm512_slli_epi32(_mm512_zextsi256_si512(off), 5));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * x.d[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]);
}

// y [M, N] over N weight rows of `row_bytes` as stored: `row(R, w_row, m0, n)` (row_tiles).
template <typename Row>
void matmul_q8k(const uint8_t* w, int64_t row_bytes, const QuantK& x, float* y, int64_t N,
                const Row& row) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)  // a row's passes after the first read it from L1
      row_tiles(x.M, [&](auto R, int64_t m0) { row(R, w + n * row_bytes, m0, n); });
  });
}

// Q4_K repacked at load (`gguf_repack`, `gguf_matmul_packed`): 16 weight rows interleaved, so
// each vpdpbusd lane belongs to one output row and meets 4 activations broadcast to all lanes.
// A sub-block's 32 weights then sum in one int32 lane before its scale is applied (one vpmulld
// per 16 rows' sub-block, not one vpmaddwd a 64 weights), the 6-bit scales and mins are bytes
// already, and 16 rows' results come out as one vector: about a third of the vector work a
// super-block of the stored layout needs (gguf_matmul_q8k). Activations: per 256, natural order.
//
// A group of 16 rows, each super-block (2368 bytes, 148 a row; 144 stored):
//   0 d[16] fp16, 32 dmin[16] fp16, 64 scales[8 sub-blocks][16 rows],
//   192 mins[4 pairs of sub-blocks][16 rows][2], 320 nibbles[32 chunks][16 rows][4 bytes]
//   (chunk c: bytes 4c..4c+3 of the row's 128, as stored). Rows past N are zeros.
constexpr int kGroup = 16;
constexpr int64_t kQ4KPacked = 2368;

inline void q4k_scales(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 8; ++j) {
    int s, n;
    scale_min_k4(j, q, &s, &n);
    sc[j] = static_cast<uint8_t>(s);
    m[j] = static_cast<uint8_t>(n);
  }
}

void repack_q4k(const uint8_t* w, uint8_t* out, int64_t N, int64_t SB) {
  const int64_t row_bytes = SB * 144;
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < SB; ++b) {
        uint8_t* p = out + (g * SB + b) * kQ4KPacked;
        for (int r = 0; r < kGroup && g * kGroup + r < N; ++r) {
          const uint8_t* src = w + (g * kGroup + r) * row_bytes + b * 144;
          std::memcpy(p + 2 * r, src, 2);
          std::memcpy(p + 32 + 2 * r, src + 2, 2);
          uint8_t sc[8], m[8];
          q4k_scales(src + 4, sc, m);
          for (int j = 0; j < 8; ++j) {
            p[64 + 16 * j + r] = sc[j];
            p[192 + 32 * (j / 2) + 2 * r + j % 2] = m[j];
          }
          for (int c = 0; c < 32; ++c) std::memcpy(p + 320 + 64 * c + 4 * r, src + 16 + 4 * c, 4);
        }
      }
  });
}

void unrepack_q4k(const uint8_t* p0, uint8_t* w, int64_t N, int64_t SB) {
  const int64_t row_bytes = SB * 144;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < SB; ++b) {
        const uint8_t* p = p0 + ((n / kGroup) * SB + b) * kQ4KPacked;
        const int r = n % kGroup;
        uint8_t* dst = w + n * row_bytes + b * 144;
        std::memcpy(dst, p + 2 * r, 2);
        std::memcpy(dst + 2, p + 32 + 2 * r, 2);
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; ++j) {
          sc[j] = p[64 + 16 * j + r];
          m[j] = p[192 + 32 * (j / 2) + 2 * r + j % 2];
        }
        uint8_t* q = dst + 4;  // ggml's 6-bit packing (scale_min_k4 read backwards)
        for (int j = 0; j < 4; ++j) {
          q[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
          q[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
          q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
        }
        for (int c = 0; c < 32; ++c) std::memcpy(dst + 16 + 4 * c, p + 320 + 64 * c + 4 * r, 4);
      }
  });
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Group g (rows 16g..) of a packed Q4_K weight against rows [m0, m0 + R) of x.
template <int R>
void q4k_group(const uint8_t* p, const QuantK& x, int64_t m0, float* y, int64_t N, int64_t g) {
  const int64_t SB = x.K / 256;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < SB; ++b, p += kQ4KPacked) {
    __m512i isum[R], msum[R];
    for (int r = 0; r < R; ++r) isum[r] = msum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles of bytes 32j..) and 2j + 1
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(p + 320 + 64 * (8 * j + c));
        const __m512i l = _mm512_and_si512(v, nib), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q.data() + 256 * ((m0 + r) * SB + b) + 64 * j + 4 * c;
          lo[r] = _mm512_dpbusd_epi32(lo[r], l, bcast4(q));
          hi[r] = _mm512_dpbusd_epi32(hi[r], h, bcast4(q + 32));
        }
      }
      const __m512i sa = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64 + 32 * j)));
      const __m512i sb = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 80 + 32 * j)));
      for (int r = 0; r < R; ++r)
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], sa),
                                                             _mm512_mullo_epi32(hi[r], sb)));
    }
    for (int i = 0; i < 4; ++i) {  // mins: (m_2i, m_2i+1) . (sum x over 2i, 2i + 1)
      const __m512i mm = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 192 + 32 * i)));
      for (int r = 0; r < R; ++r) {
        int32_t sums;
        std::memcpy(&sums, x.s32.data() + 8 * ((m0 + r) * SB + b) + 2 * i, 4);
        msum[r] = _mm512_add_epi32(msum[r], _mm512_madd_epi16(mm, _mm512_set1_epi32(sums)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + r) * SB + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[r]), _mm512_mul_ps(dmin, dx), acc[r]);
    }
  }
  const int64_t n0 = g * kGroup;
  const __mmask16 mask = N - n0 >= kGroup ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, acc[r]);
}

// Q6_K packed the same way (3360 bytes a group's super-block, 210 a row as stored):
//   0 d[16] fp16, 32 scales[16 groups of 16][16 rows] int8, 288 [2 halves][8 chunks] of
//   (ql chunk c, ql chunk c + 8, qh chunk c of the half)[16 rows][4]: the three 64-byte
//   vectors one step of the loop reads, in the order it reads them. The -32 of each code
//   starts each group's sums as -32 * (the sum of x over the group): nothing in the loop.
constexpr int64_t kQ6KPacked = 3360;

void repack_q6k(const uint8_t* w, uint8_t* out, int64_t N, int64_t SB, bool back) {
  const int64_t row_bytes = SB * 210;
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < SB; ++b) {
        uint8_t* p = out + (g * SB + b) * kQ6KPacked;
        for (int r = 0; r < kGroup && g * kGroup + r < N; ++r) {
          uint8_t* src = const_cast<uint8_t*>(w) + (g * kGroup + r) * row_bytes + b * 210;
          // (to, from, bytes): packed <- stored, or back
          auto move = [&](uint8_t* packed, uint8_t* stored, int bytes) {
            back ? std::memcpy(stored, packed, bytes) : std::memcpy(packed, stored, bytes);
          };
          move(p + 2 * r, src + 208, 2);
          for (int j = 0; j < 16; ++j) move(p + 32 + 16 * j + r, src + 192 + j, 1);
          for (int c = 0; c < 32; ++c)  // ql: half c / 16, step c % 8, vector (c % 16) / 8
            move(p + 288 + 192 * (8 * (c / 16) + c % 8) + 64 * ((c % 16) / 8) + 4 * r, src + 4 * c, 4);
          for (int c = 0; c < 16; ++c)  // qh: half c / 8, step c % 8, vector 2
            move(p + 288 + 192 * c + 128 + 4 * r, src + 128 + 4 * c, 4);
        }
      }
  });
}

template <int R>
void q6k_group(const uint8_t* p, const QuantK& x, int64_t m0, float* y, int64_t N, int64_t g) {
  const int64_t SB = x.K / 256;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), b03 = _mm512_set1_epi8(0x03);
  const __m512i b0c = _mm512_set1_epi8(0x0C), b30 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < SB; ++b, p += kQ6KPacked) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int n = 0; n < 2; ++n)
      for (int u = 0; u < 2; ++u) {  // groups 8n + u + 2k, k = 0..3 (weights 128n + 32k + ...)
        __m512i s[R][4];
        for (int r = 0; r < R; ++r) {
          const int16_t* sums = x.s16.data() + 16 * ((m0 + r) * SB + b);
          for (int k = 0; k < 4; ++k) s[r][k] = _mm512_set1_epi32(-32 * sums[8 * n + u + 2 * k]);
        }
        for (int cc = 0; cc < 4; ++cc) {
          const int c = 4 * u + cc;
          const uint8_t* v = p + 288 + 192 * (8 * n + c);
          const __m512i A = _mm512_loadu_si512(v), B = _mm512_loadu_si512(v + 64);
          const __m512i H = _mm512_loadu_si512(v + 128);
          const __m512i w0 = _mm512_or_si512(_mm512_and_si512(A, nib),
                                             _mm512_slli_epi16(_mm512_and_si512(H, b03), 4));
          const __m512i w1 = _mm512_or_si512(_mm512_and_si512(B, nib),
                                             _mm512_slli_epi16(_mm512_and_si512(H, b0c), 2));
          const __m512i w2 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), nib),
                                             _mm512_and_si512(H, b30));
          const __m512i w3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(B, 4), nib),
                                             _mm512_and_si512(_mm512_srli_epi16(H, 2), b30));
          for (int r = 0; r < R; ++r) {
            const int8_t* q = x.q.data() + 256 * ((m0 + r) * SB + b) + 128 * n + 4 * c;
            s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, bcast4(q));
            s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, bcast4(q + 32));
            s[r][2] = _mm512_dpbusd_epi32(s[r][2], w2, bcast4(q + 64));
            s[r][3] = _mm512_dpbusd_epi32(s[r][3], w3, bcast4(q + 96));
          }
        }
        for (int k = 0; k < 4; ++k) {
          const __m512i sc = _mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * (8 * n + u + 2 * k))));
          for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(s[r][k], sc));
        }
      }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                               _mm512_mul_ps(d, _mm512_set1_ps(x.d[(m0 + r) * SB + b])), acc[r]);
  }
  const int64_t n0 = g * kGroup;
  const __mmask16 mask = N - n0 >= kGroup ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, acc[r]);
}

// Q8_0 packed the same way (544 bytes a group's block of 32, 34 a row as stored):
//   0 d[16] fp16, 32 codes[8 chunks][16 rows][4] stored as w + 128 (vpdpbusd's unsigned side);
// each block's sums start at -128 * (the sum of x over the block). Activations per 256 where K
// is a multiple of it, else per 32 (q80_group32).
constexpr int64_t kQ80Packed = 544;

void repack_q80(const uint8_t* w, uint8_t* out, int64_t N, int64_t blocks, bool back) {
  const int64_t row_bytes = blocks * 34;
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* p = out + (g * blocks + b) * kQ80Packed;
        for (int r = 0; r < kGroup && g * kGroup + r < N; ++r) {
          uint8_t* src = const_cast<uint8_t*>(w) + (g * kGroup + r) * row_bytes + b * 34;
          if (back) {
            std::memcpy(src, p + 2 * r, 2);
            for (int i = 0; i < 32; ++i) src[2 + i] = p[32 + 64 * (i / 4) + 4 * r + i % 4] ^ 0x80;
          } else {
            std::memcpy(p + 2 * r, src, 2);
            for (int i = 0; i < 32; ++i) p[32 + 64 * (i / 4) + 4 * r + i % 4] = src[2 + i] ^ 0x80;
          }
        }
      }
  });
}

template <int R>
void q80_group(const uint8_t* p, const QuantK& x, int64_t m0, float* y, int64_t N, int64_t g) {
  const int64_t blocks = x.K / 32, SB = x.K / 256;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, p += kQ80Packed) {
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_set1_epi32(-128 * x.s32[(m0 + r) * (x.K / 32) + b]);
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(p + 32 + 64 * c);
      for (int r = 0; r < R; ++r)
        s[r] = _mm512_dpbusd_epi32(s[r], v, bcast4(x.q.data() + (m0 + r) * x.K + 32 * b + 4 * c));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]),
                               _mm512_mul_ps(d, _mm512_set1_ps(x.d[(m0 + r) * SB + b / 8])), acc[r]);
  }
  const int64_t n0 = g * kGroup;
  const __mmask16 mask = N - n0 >= kGroup ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, acc[r]);
}

// Q4_1 packed the same way (320 bytes a group's block of 32, 20 a row as stored):
//   0 d[16] fp16, 32 m[16] fp16, 64 nibbles[4 chunks][16 rows][4 bytes] (chunk c: bytes
//   4c..4c+3 of the row's 16, as stored: low nibbles weights 4c.., high 16 + 4c..).
// w = d * q + m, so a row's block is d * dx * (q . xq) + m * dx * (sum of xq): the activations
// are quantised per 32 (Quant32: Q4_1's blocks are 32 wide and SmolLM2's K = 576 is no multiple
// of 256), with dx * their sum kept per block. K a multiple of 32.
constexpr int64_t kQ41Packed = 320;

void repack_q41(const uint8_t* w, uint8_t* out, int64_t N, int64_t blocks, bool back) {
  const int64_t row_bytes = blocks * 20;
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* p = out + (g * blocks + b) * kQ41Packed;
        for (int r = 0; r < kGroup && g * kGroup + r < N; ++r) {
          uint8_t* src = const_cast<uint8_t*>(w) + (g * kGroup + r) * row_bytes + b * 20;
          auto move = [&](uint8_t* packed, uint8_t* stored, int bytes) {
            back ? std::memcpy(stored, packed, bytes) : std::memcpy(packed, stored, bytes);
          };
          move(p + 2 * r, src, 2);
          move(p + 32 + 2 * r, src + 2, 2);
          for (int c = 0; c < 4; ++c) move(p + 64 + 64 * c + 4 * r, src + 4 + 4 * c, 4);
        }
      }
  });
}

// x [M, K] quantised per 32 (quantize_per_32) for the packed per-32 kernels: q int8 [M, K],
// d [M, K / 32], ds = d * the sum of q [M, K / 32].
struct Quant32 {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds;
};

Quant32 quantize_32(const float* x, int64_t M, int64_t K) {
  Quant32 r;
  r.M = M;
  r.K = K;
  r.q.resize(M * K);
  r.d.resize(M * K / 32);
  r.ds.resize(M * K / 32);
  quantize_per_32(x, M, K, r.q.data(), [&](int64_t i, float d, int32_t lo, int32_t hi) {
    r.d[i] = d;
    r.ds[i] = d * static_cast<float>(lo + hi);
  });
  return r;
}

template <int R>
void q41_group(const uint8_t* p, const Quant32& x, int64_t m0, float* y, int64_t N, int64_t g) {
  const int64_t blocks = x.K / 32;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, p += kQ41Packed) {
    __m512i lo[R], hi[R];  // two chains: low and high nibbles
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(p + 64 + 64 * c);
      const __m512i l = _mm512_and_si512(v, nib), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x.q.data() + (m0 + r) * x.K + 32 * b + 4 * c;
        lo[r] = _mm512_dpbusd_epi32(lo[r], l, bcast4(q));
        hi[r] = _mm512_dpbusd_epi32(hi[r], h, bcast4(q + 16));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * blocks + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo[r], hi[r])),
                               _mm512_mul_ps(d, _mm512_set1_ps(x.d[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.ds[at]), acc[r]);
    }
  }
  const int64_t n0 = g * kGroup;
  const __mmask16 mask = N - n0 >= kGroup ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, acc[r]);
}

// Q8_0 packed, activations per 32 (Quant32): for K no multiple of 256 (SmolLM2's LM head, K =
// 576). A block is d * dx * (c . xq) - 128 * d * (dx * the sum of xq), c = w + 128.
template <int R>
void q80_group32(const uint8_t* p, const Quant32& x, int64_t m0, float* y, int64_t N, int64_t g) {
  const int64_t blocks = x.K / 32;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, p += kQ80Packed) {
    __m512i s[R][2];  // two chains
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(p + 32 + 64 * c);
      for (int r = 0; r < R; ++r)
        s[r][c % 2] = _mm512_dpbusd_epi32(s[r][c % 2], v, bcast4(x.q.data() + (m0 + r) * x.K + 32 * b + 4 * c));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * blocks + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[r][0], s[r][1])),
                               _mm512_mul_ps(d, _mm512_set1_ps(x.d[at])), acc[r]);
      acc[r] = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f * x.ds[at]), acc[r]);
    }
  }
  const int64_t n0 = g * kGroup;
  const __mmask16 mask = N - n0 >= kGroup ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, acc[r]);
}

// y [M, N] over a packed weight of ceil(N / 16) groups of `group_bytes`: `group(R, p, m0, g)`
// for group g at p (row_tiles).
template <typename Group>
void matmul_packed(const uint8_t* w, int64_t group_bytes, int64_t M, int64_t N,
                   const Group& group) {
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)  // a group's passes after the first read it from cache
      row_tiles(M, [&](auto R, int64_t m0) { group(R, w + g * group_bytes, m0, g); });
  });
}
#endif  // AVX512 VNNI

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

// Into `out` [N, K] (fp32 or bf16, contiguous): a caller's reused buffer, so a large weight's
// unpacking does not pay a fresh allocation's page faults each step (~10 ms for 33 MB here).
void gguf_dequantize_into(const at::Tensor& blocks, int64_t type, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == blocks.size(0),
              "gguf_dequantize: out must be a contiguous [N, K] tensor");
  const int64_t K = out.size(1), N = out.size(0);
  check_blocks(blocks, type, K);
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "gguf_dequantize: fp32 or bf16");
  if (N == 0) return;
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  if (out.scalar_type() == at::kFloat) {
    float* yp = out.data_ptr<float>();
    GGUF_DISPATCH(type, (dequantize<T, float>(wp, yp, K, N)));
  } else {
    c10::BFloat16* yp = out.data_ptr<c10::BFloat16>();
    GGUF_DISPATCH(type, (dequantize<T, c10::BFloat16>(wp, yp, K, N)));
  }
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t K,
                           at::ScalarType dtype) {
  check_blocks(blocks, type, K);
  auto y = at::empty({blocks.size(0), K}, blocks.options().dtype(dtype));
  gguf_dequantize_into(blocks, type, y);
  return y;
}

#ifdef SHOAL_Q8
void check_q8_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K,
              "q8 matmul: x [M, K] fp32");
  TORCH_CHECK(K % 64 == 0, "q8 matmul: K=", K, " is not a multiple of 64");
}

at::Tensor gguf_matmul_q8(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type) {
  const int64_t K = x_in.size(-1), N = blocks.size(0);
  check_q8_x(x_in, K);
  check_blocks(blocks, type, K);
  const auto x = x_in.contiguous();
  auto y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const QuantX xq = quantize_rows(x.data_ptr<float>(), x.size(0), K);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  GGUF_DISPATCH(type, gguf_q8<T>(wp, xq, y.data_ptr<float>(), N));
  return y;
}

// Q4_K (12) and Q6_K (14) only: activations quantised per 256 (see QuantK).
at::Tensor gguf_matmul_q8k(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(type == 12 || type == 14, "gguf_matmul_q8k: Q4_K (12) or Q6_K (14), not ", type);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "gguf_matmul_q8k: x [M, K] fp32");
  const int64_t K = x_in.size(1), N = blocks.size(0);
  check_blocks(blocks, type, K);
  const auto x = x_in.contiguous();
  auto y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const QuantK xq = quantize_k(x.data_ptr<float>(), x.size(0), K, type == 12);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (type == 12)
    matmul_q8k(wp, blocks.size(1), xq, yp, N, [&](auto R, const uint8_t* w, int64_t m0, int64_t n) {
      q4k_row<decltype(R)::value>(w, xq, m0, yp, N, n);
    });
  else
    matmul_q8k(wp, blocks.size(1), xq, yp, N, [&](auto R, const uint8_t* w, int64_t m0, int64_t n) {
      q6k_row<decltype(R)::value>(w, xq, m0, yp, N, n);
    });
  return y;
}

// The packed layouts (Q4_K, Q6_K, Q8_0, Q4_1): `gguf_repack` blocks [N, row bytes] ->
// [ceil(N / 16), K / 256 * 2368 or 3360, K / 32 * 544 or 320]; `gguf_unrepack` back (exact: every stored bit is kept), for the paths that
// unpack the weight; `gguf_matmul_packed` y [M, N].
// Per block of the packed layout (a super-block of 256; Q8_0: a block of 32) and as stored.
int64_t packed_bytes(int64_t type) {
  TORCH_CHECK(type == 12 || type == 14 || type == 8 || type == 3,
              "gguf packed layout: Q4_K (12), Q6_K (14), Q8_0 (8) or Q4_1 (3), not ", type);
  return type == 12 ? kQ4KPacked : type == 14 ? kQ6KPacked : type == 8 ? kQ80Packed : kQ41Packed;
}

int64_t stored_bytes(int64_t type) {
  return type == 12 ? 144 : type == 14 ? 210 : type == 8 ? 34 : 20;
}
int64_t block_weights(int64_t type) { return type == 8 || type == 3 ? 32 : 256; }

at::Tensor gguf_repack(const at::Tensor& blocks, int64_t type) {
  const int64_t per = packed_bytes(type), N = blocks.size(0), bytes = stored_bytes(type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
              blocks.size(1) % bytes == 0, "gguf_repack: contiguous uint8 [N, K / 256 * ", bytes, "]");
  const int64_t SB = blocks.size(1) / bytes;
  auto out = at::zeros({(N + kGroup - 1) / kGroup, SB * per}, blocks.options());
  if (type == 12) repack_q4k(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), N, SB);
  else if (type == 14) repack_q6k(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), N, SB, false);
  else if (type == 8) repack_q80(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), N, SB, false);
  else repack_q41(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), N, SB, false);
  return out;
}

void check_packed(const at::Tensor& packed, int64_t type, int64_t N) {
  const int64_t per = packed_bytes(type);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == (N + kGroup - 1) / kGroup && packed.size(1) % per == 0,
              "gguf packed: contiguous uint8 [ceil(N / 16), K / 256 * ", per, "]");
}

at::Tensor gguf_unrepack(const at::Tensor& packed, int64_t type, int64_t N) {
  check_packed(packed, type, N);
  const int64_t SB = packed.size(1) / packed_bytes(type);
  auto out = at::empty({N, SB * stored_bytes(type)}, packed.options());
  if (type == 12) unrepack_q4k(packed.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), N, SB);
  else if (type == 14) repack_q6k(out.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), N, SB, true);
  else if (type == 8) repack_q80(out.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), N, SB, true);
  else repack_q41(out.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), N, SB, true);
  return out;
}

at::Tensor gguf_matmul_packed(const at::Tensor& x_in, const at::Tensor& packed, int64_t type,
                              int64_t N) {
  check_packed(packed, type, N);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat &&
              x_in.size(1) == packed.size(1) / packed_bytes(type) * block_weights(type),
              "gguf_matmul_packed: x [M, K] fp32, K the packed weight's");
  const int64_t K = x_in.size(1);
  const auto x = x_in.contiguous();
  auto y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t group_bytes = packed.size(1), M = x.size(0);
  float* yp = y.data_ptr<float>();
  if (type == 3 || (type == 8 && K % 256 != 0)) {
    const Quant32 xq = quantize_32(x.data_ptr<float>(), M, K);
    if (type == 3)
      matmul_packed(wp, group_bytes, M, N, [&](auto R, const uint8_t* p, int64_t m0, int64_t g) {
        q41_group<decltype(R)::value>(p, xq, m0, yp, N, g);
      });
    else
      matmul_packed(wp, group_bytes, M, N, [&](auto R, const uint8_t* p, int64_t m0, int64_t g) {
        q80_group32<decltype(R)::value>(p, xq, m0, yp, N, g);
      });
    return y;
  }
  const QuantK xq = quantize_k(x.data_ptr<float>(), M, K, false);
  if (type == 12)
    matmul_packed(wp, group_bytes, M, N, [&](auto R, const uint8_t* p, int64_t m0, int64_t g) {
      q4k_group<decltype(R)::value>(p, xq, m0, yp, N, g);
    });
  else if (type == 14)
    matmul_packed(wp, group_bytes, M, N, [&](auto R, const uint8_t* p, int64_t m0, int64_t g) {
      q6k_group<decltype(R)::value>(p, xq, m0, yp, N, g);
    });
  else
    matmul_packed(wp, group_bytes, M, N, [&](auto R, const uint8_t* p, int64_t m0, int64_t g) {
      q80_group<decltype(R)::value>(p, xq, m0, yp, N, g);
    });
  return y;
}

// Shoal's own int8 (one scale per output row, w = scale * q, q in -127..127).
at::Tensor int8_matmul_q8(const at::Tensor& x_in, const at::Tensor& qweight,
                          const at::Tensor& scale_in) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "int8_matmul_q8: qweight contiguous int8 [N, K]");
  const int64_t K = qweight.size(1), N = qweight.size(0);
  check_q8_x(x_in, K);
  const auto scale = scale_in.to(at::kFloat).contiguous();
  TORCH_CHECK(scale.numel() == N, "int8_matmul_q8: scale [N]");
  const auto x = x_in.contiguous();
  auto y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const QuantX xq = quantize_rows(x.data_ptr<float>(), x.size(0), K);
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  matmul_q8<true>([&](int64_t n, int64_t k0, int64_t k1, uint8_t* c, float* s, float* o) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(wp + n * K);
    for (int64_t k = k0; k < k1; k += 32) put32(c + k, bytes32(row + k) ^ 0x80);
    std::fill(s + k0 / 4, s + k1 / 4, sp[n]);
    std::fill(o + k0 / 16, o + k1 / 16, -128.f * sp[n]);
  }, xq, y.data_ptr<float>(), N);
  return y;
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("gguf_matmul(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int K, ScalarType dtype) -> Tensor");
  m.def("gguf_dequantize_into(Tensor blocks, int type, Tensor(a!) out) -> ()");
#ifdef SHOAL_Q8
  m.def("gguf_matmul_q8(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("int8_matmul_q8(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
  m.def("gguf_matmul_q8k(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("gguf_repack(Tensor blocks, int type) -> Tensor");
  m.def("gguf_unrepack(Tensor packed, int type, int N) -> Tensor");
  m.def("gguf_matmul_packed(Tensor x, Tensor packed, int type, int N) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) {
  m.impl("gguf_matmul", gguf_matmul);
  m.impl("gguf_dequantize", gguf_dequantize);
  m.impl("gguf_dequantize_into", gguf_dequantize_into);
#ifdef SHOAL_Q8
  m.impl("gguf_matmul_q8", gguf_matmul_q8);
  m.impl("int8_matmul_q8", int8_matmul_q8);
  m.impl("gguf_matmul_q8k", gguf_matmul_q8k);
  m.impl("gguf_repack", gguf_repack);
  m.impl("gguf_unrepack", gguf_unrepack);
  m.impl("gguf_matmul_packed", gguf_matmul_packed);
#endif
}
