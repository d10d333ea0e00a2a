// Linear layers with 4-bit or 8-bit weights for the few rows of a decode step, multiplied in
// integers: y = x @ W.T + b, float32 in and out.
//
// Each row of x is quantized per group of 32 inputs to int8 with its own scale
// (s = max|x| / 127), as llama.cpp's Q8 activations are, so that AVX512-VNNI's vpdpbusd
// (unsigned bytes times signed bytes, summed in fours into int32 lanes) multiplies them in
// integers. A few rows of x share each load of the weights; the output rows are split across
// torch's threads.
//
// Two builds, chosen by the compiler's target (-march=native): AVX512-VNNI (with AVX512
// F/BW/VL), or else AVX2 with FMA and F16C, as llama.cpp multiplies Q4_1 by Q8 there: for
// vpdpbusd, vpmaddubsw (unsigned times signed bytes, pairs summed into int16) then vpmaddwd
// by ones (pairs of int16 summed into int32), in the same lanes, on the same weight layouts,
// giving the same integer sums (the float sums only in another order). Neither:
// dot_linear_supported() is false and the Python side runs torch's kernels.
//
// int4_linear: W [out, in] on GGUF's Q4_1 grid: each group of 32 inputs of a row has a scale d
// and a minimum m (float16), weight = d * q + m with q in 0..15. A row's groups go in blocks
// of kLanes, one group per 32-bit lane of a 256-bit vector: one vpdpbusd takes 4 weights of
// each of the block's groups, so eight of them sum each group's 32 products in its own lane
// and one multiply-add per block applies the groups' scales. In a block of L groups (L < 8
// only in a row's last block) chunk j = 0..3 holds, for each group, 4 bytes whose low nibbles
// are its q[8j .. 8j + 3] and high nibbles its q[8j + 4 .. 8j + 7] (Int4DotLinear.quantize in
// engine/models/quantized_linear.py); x is laid out per block to match. Per output and group:
//   sum_i (d q_i + m) x_i  ~=  d s sum_i q_i xq_i  +  m sum_i x_i,
// with sum_i x_i from the float32 activations. The rounding errors of xq would meet q's mean
// (~7.5) there, so the kernel adds back d * 8 * sum_i (x_i - s xq_i): as if the products were
// of q - 8, centred as the weights are.
//
// int8_linear: W = w_scale[o] * q with q in -127..127 per output row (symmetric), stored as
// q + 128 (unsigned). Per output:  w_scale * (sum_g s_g sum_i (q_i + 128) xq_i  -  C),
// C = 128 sum_g s_g sum_i xq_i, which depends on x alone. (AVX2 multiplies q itself: see its
// rows_of.)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define PDCLUSTER_DOT_LINEAR 1
#define PDCLUSTER_DOT_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDCLUSTER_DOT_LINEAR 1
#define PDCLUSTER_DOT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;           // inputs sharing one activation scale (and weight scale)
constexpr int64_t kGroupsPerBlock = 16;  // int8: groups whose scales one vector holds
constexpr int64_t kLanes = 8;            // int4: groups per block, one per 32-bit lane
constexpr int64_t kRowsPerPass = 4;      // rows of x sharing each load of the weights
constexpr float kMidpoint = 8.f;         // the middle of a 4-bit q's range 0..15
constexpr float kInt8Offset = 128.f;     // int8 weights are stored as q + this

// The rows of x quantized per group: q [n, in]; per group [n, in / kGroup] its scale, its
// float32 sum and kMidpoint * the sum of its rounding errors; per row [n] int8_linear's
// C = kInt8Offset * sum_g scale_g * sum_i q_i.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum, correction, int8_offset;
  std::vector<int8_t> blocked;  // q as the int4 kernel reads it (`block_rows`), where it does
};

QuantizedRows quantize_rows(const float* x, int64_t n, int64_t in) {
  const int64_t groups = n * (in / kGroup);
  QuantizedRows rows{std::vector<int8_t>(n * in), std::vector<float>(groups),
                     std::vector<float>(groups), std::vector<float>(groups),
                     std::vector<float>(n, 0.f), {}};
  for (int64_t g = 0; g < groups; ++g) {
    const float* src = x + g * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      amax = std::max(amax, std::abs(src[i]));
      sum += src[i];
    }
    const float scale = amax / 127.f;
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    float error = 0.f, q_sum = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float q = std::nearbyint(src[i] * inverse);
      rows.q[g * kGroup + i] = static_cast<int8_t>(q);
      error += src[i] - scale * q;
      q_sum += q;
    }
    rows.scale[g] = scale;
    rows.sum[g] = sum;
    rows.correction[g] = kMidpoint * error;
    rows.int8_offset[g / (in / kGroup)] += kInt8Offset * scale * q_sum;
  }
  return rows;
}

#ifdef PDCLUSTER_DOT_LINEAR

// The weights of one format; `rows_of` computes its outputs [begin, end) for x rows
// r0 .. r0 + NR.
struct Int4Weights {
  const uint8_t* packed;  // [out, in / 2]
  const uint16_t* scales;  // [out, 2, groups] float16: d, then m
};

struct Int8Weights {
  const uint8_t* q;       // [out, in]: q + 128
  const float* w_scale;   // [out]
};

#ifdef PDCLUSTER_DOT_VNNI

// Lanes 0-7 of a vpdpbusd over two groups belong to the first group, lanes 8-15 to the second:
// pair_lanes[p] picks scale 2p, then 2p + 1, out of a vector of kGroupsPerBlock scales.
struct PairLanes {
  __m512i lanes[kGroupsPerBlock / 2];
  PairLanes() {
    for (int p = 0; p < kGroupsPerBlock / 2; ++p) {
      lanes[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
    }
  }
};

inline __mmask16 block_mask(int64_t num) { return static_cast<__mmask16>((1u << num) - 1); }

#endif  // PDCLUSTER_DOT_VNNI

// x's int8 rows as the int4 kernel reads them: per row and block, for k = 0..7 the 4 bytes
// xq[4k .. 4k + 3] of each of the block's kLanes groups (zeros past a row's last group).
std::vector<int8_t> block_rows(const QuantizedRows& x, int64_t n, int64_t in) {
  const int64_t groups = in / kGroup, blocks = (groups + kLanes - 1) / kLanes;
  std::vector<int8_t> out(n * blocks * kLanes * kGroup, 0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      int8_t* block = out.data() + (r * blocks + g / kLanes) * kLanes * kGroup;
      for (int64_t k = 0; k < kGroup / 4; ++k) {
        std::copy_n(x.q.data() + r * in + g * kGroup + 4 * k, 4,
                    block + (k * kLanes + g % kLanes) * 4);
      }
    }
  }
  return out;
}

inline float sum_of(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

#ifdef PDCLUSTER_DOT_VNNI

template <int NR>
void rows_of(const Int4Weights& w, const QuantizedRows& x, int64_t r0, int64_t in,
             int64_t begin, int64_t end, float* acc_out) {
  const int64_t groups = in / kGroup, blocks = (groups + kLanes - 1) / kLanes;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* packed = w.packed + o * (in / 2);
    const uint16_t* d = w.scales + o * 2 * groups;
    const uint16_t* m = d + groups;
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g0 = b * kLanes, num = std::min(kLanes, groups - g0);
      const __mmask8 mask = static_cast<__mmask8>((1u << num) - 1);
      const uint8_t* chunks = packed + g0 * kGroup / 2;  // 4 chunks of num x 4 bytes
      __m256i dot[NR];
      for (int r = 0; r < NR; ++r) dot[r] = _mm256_setzero_si256();
      for (int64_t j = 0; j < 4; ++j) {
        const __m256i v = _mm256_maskz_loadu_epi32(mask, chunks + j * num * 4);
        const __m256i lo = _mm256_and_si256(v, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        for (int r = 0; r < NR; ++r) {
          const int8_t* xb = x.blocked.data() + ((r0 + r) * blocks + b) * kLanes * kGroup;
          const __m256i* xk = reinterpret_cast<const __m256i*>(xb) + 2 * j;
          dot[r] = _mm256_dpbusd_epi32(dot[r], lo, _mm256_loadu_si256(xk));
          dot[r] = _mm256_dpbusd_epi32(dot[r], hi, _mm256_loadu_si256(xk + 1));
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask, d + g0));
      const __m256 mw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask, m + g0));
      for (int r = 0; r < NR; ++r) {
        const int64_t at = (r0 + r) * groups + g0;
        const __m256 ds = _mm256_mul_ps(dw, _mm256_maskz_loadu_ps(mask, x.scale.data() + at));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), ds, acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_maskz_loadu_ps(mask, x.sum.data() + at), acc[r]);
        acc[r] = _mm256_fmadd_ps(dw, _mm256_maskz_loadu_ps(mask, x.correction.data() + at),
                                 acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) acc_out[r * (end - begin) + (o - begin)] = sum_of(acc[r]);
  }
}

template <int NR>
void rows_of(const Int8Weights& w, const QuantizedRows& x, int64_t r0, int64_t in,
             int64_t begin, int64_t end, float* acc_out) {
  const int64_t groups = in / kGroup;
  const PairLanes pairs;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* q = w.q + o * in;
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += kGroupsPerBlock) {
      const int64_t num = std::min(kGroupsPerBlock, groups - g0);
      const __mmask16 mask = block_mask(num);
      __m512 s[NR];
      for (int r = 0; r < NR; ++r) {
        s[r] = _mm512_maskz_loadu_ps(mask, x.scale.data() + (r0 + r) * groups + g0);
      }
      for (int64_t p = 0; p < num / 2; ++p) {
        const int64_t first = g0 + 2 * p;
        const __m512i wq = _mm512_loadu_si512(q + first * kGroup);
        for (int r = 0; r < NR; ++r) {
          const __m512i xq = _mm512_loadu_si512(x.q.data() + (r0 + r) * in + first * kGroup);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                   _mm512_permutexvar_ps(pairs.lanes[p], s[r]), acc[r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) acc_out[r * (end - begin) + (o - begin)] =
        w.w_scale[o] * (_mm512_reduce_add_ps(acc[r]) - x.int8_offset[r0 + r]);
  }
}

#endif  // PDCLUSTER_DOT_VNNI

#ifdef PDCLUSTER_DOT_AVX2

// AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes and sums adjacent
// pairs into saturating int16 lanes, vpmaddwd by ones then sums adjacent int16 pairs into
// int32. With 4-bit weights (0..15) and int8 activations (-127..127) a pair is at most
// 2 * 15 * 127 = 3810, so a block's 8 vpmaddubsw (32 products per group, 4 per 32-bit lane)
// add up in int16 (|sum| <= 30480) before one vpmaddwd: no saturation, the same integers as
// vpdpbusd's.

// The first `num` (1..8) 32-bit lanes on, for AVX2's masked loads.
inline __m256i lane_mask(int64_t num) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(num)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// `num` float16 values from `p` as float32, zeros past them (no 16-bit masked load in AVX2).
inline __m256 load_halves(const uint16_t* p, int64_t num) {
  if (num == kLanes) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t part[kLanes] = {};
  std::copy_n(p, num, part);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(part)));
}

template <int NR>
void rows_of(const Int4Weights& w, const QuantizedRows& x, int64_t r0, int64_t in,
             int64_t begin, int64_t end, float* acc_out) {
  const int64_t groups = in / kGroup, blocks = (groups + kLanes - 1) / kLanes;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t tail = groups - (blocks - 1) * kLanes;  // groups of a row's last block
  const __m256i tail_mask = lane_mask(tail);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* packed = w.packed + o * (in / 2);
    const uint16_t* d = w.scales + o * 2 * groups;
    const uint16_t* m = d + groups;
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g0 = b * kLanes, num = std::min(kLanes, groups - g0);
      const bool full = num == kLanes;
      const uint8_t* chunks = packed + g0 * kGroup / 2;  // 4 chunks of num x 4 bytes
      __m256i dot[NR];
      for (int r = 0; r < NR; ++r) dot[r] = _mm256_setzero_si256();
      for (int64_t j = 0; j < 4; ++j) {
        const uint8_t* chunk = chunks + j * num * 4;
        const __m256i v =
            full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk))
                 : _mm256_maskload_epi32(reinterpret_cast<const int*>(chunk), tail_mask);
        const __m256i lo = _mm256_and_si256(v, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        for (int r = 0; r < NR; ++r) {
          const int8_t* xb = x.blocked.data() + ((r0 + r) * blocks + b) * kLanes * kGroup;
          const __m256i* xk = reinterpret_cast<const __m256i*>(xb) + 2 * j;
          dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xk)));
          dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xk + 1)));
        }
      }
      const __m256 dw = load_halves(d + g0, num);
      const __m256 mw = load_halves(m + g0, num);
      for (int r = 0; r < NR; ++r) {
        const int64_t at = (r0 + r) * groups + g0;
        __m256 scale, sum, correction;
        if (full) {
          scale = _mm256_loadu_ps(x.scale.data() + at);
          sum = _mm256_loadu_ps(x.sum.data() + at);
          correction = _mm256_loadu_ps(x.correction.data() + at);
        } else {
          scale = _mm256_maskload_ps(x.scale.data() + at, tail_mask);
          sum = _mm256_maskload_ps(x.sum.data() + at, tail_mask);
          correction = _mm256_maskload_ps(x.correction.data() + at, tail_mask);
        }
        const __m256i dot32 = _mm256_madd_epi16(dot[r], ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32), _mm256_mul_ps(dw, scale), acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, sum, acc[r]);
        acc[r] = _mm256_fmadd_ps(dw, correction, acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) acc_out[r * (end - begin) + (o - begin)] = sum_of(acc[r]);
  }
}

// int8 weights: vpmaddubsw's unsigned operand cannot be the stored q + 128 (a pair of
// 255 * 127 products saturates int16), so, as llama.cpp's mul_sum_i8_pairs, it multiplies
// |q| (q = stored ^ 0x80, -127..127) by xq with q's sign (vpsignb): pairs of at most
// 2 * 127 * 127 = 32258, exact. That is sum_i q_i xq_i itself, so int8_linear's C is not
// subtracted here: the same sum as the AVX-512 path's in exact arithmetic.
template <int NR>
void rows_of(const Int8Weights& w, const QuantizedRows& x, int64_t r0, int64_t in,
             int64_t begin, int64_t end, float* acc_out) {
  const int64_t groups = in / kGroup;
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* q = w.q + o * in;
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i wq = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroup)), offset);
      const __m256i magnitude = _mm256_sign_epi8(wq, wq);
      for (int r = 0; r < NR; ++r) {
        const __m256i xq = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.q.data() + (r0 + r) * in + g * kGroup));
        const __m256i dot = _mm256_madd_epi16(
            _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, wq)), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_set1_ps(x.scale[(r0 + r) * groups + g]), acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      acc_out[r * (end - begin) + (o - begin)] = w.w_scale[o] * sum_of(acc[r]);
    }
  }
}

#endif  // PDCLUSTER_DOT_AVX2

// y[r, o] for every row of x: passes of kRowsPerPass rows (then the rest), output rows split
// across threads.
template <typename Weights>
void dot_linear(const Weights& w, const QuantizedRows& x, int64_t n, int64_t in,
                int64_t out_features, const float* bias, float* y) {
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> part(kRowsPerPass * (end - begin));
    for (int64_t r0 = 0; r0 < n; r0 += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, n - r0);
      switch (rows) {
        case 4: rows_of<4>(w, x, r0, in, begin, end, part.data()); break;
        case 3: rows_of<3>(w, x, r0, in, begin, end, part.data()); break;
        case 2: rows_of<2>(w, x, r0, in, begin, end, part.data()); break;
        default: rows_of<1>(w, x, r0, in, begin, end, part.data()); break;
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = begin; o < end; ++o) {
          y[(r0 + r) * out_features + o] =
              part[r * (end - begin) + (o - begin)] + (bias ? bias[o] : 0.f);
        }
      }
    }
  });
}

#endif

// Checks x [N, in] (in a multiple of `in_multiple`) and the bias, and returns y [N, out]
// computed by `run(x's quantized rows, bias, y)`.
template <typename Run>
torch::Tensor checked(const torch::Tensor& x, int64_t in_multiple, int64_t out_features,
                      const c10::optional<torch::Tensor>& bias, Run run) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [N, in]");
  TORCH_CHECK(x.size(1) % in_multiple == 0, "in_features must be a multiple of ", in_multiple);
  const float* bias_ptr = nullptr;
  torch::Tensor bias_contiguous;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == out_features,
                "bias must be float32 [out]");
    bias_contiguous = bias->contiguous();
    bias_ptr = bias_contiguous.data_ptr<float>();
  }
  auto y = torch::empty({x.size(0), out_features}, x.options());
  const auto xc = x.contiguous();
  QuantizedRows rows = quantize_rows(xc.data_ptr<float>(), x.size(0), x.size(1));
  run(rows, bias_ptr, y.data_ptr<float>());
  return y;
}

}  // namespace

bool dot_linear_supported() {
#ifdef PDCLUSTER_DOT_LINEAR
  return true;
#else
  return false;
#endif
}

// x [N, in] float32, packed [out, in / 2] uint8, scales [out, 2, in / 32] float16 (d then m),
// bias [out] float32 or None -> y [N, out] float32
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(dot_linear_supported(), "int4_linear needs a CPU with AVX2 or AVX512-VNNI");
  const int64_t in = x.size(-1), out_features = packed.size(0);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 &&
                  packed.is_contiguous() && packed.size(1) == in / 2,
              "packed must be contiguous uint8 [out, in / 2]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                  scales.numel() == out_features * 2 * (in / kGroup),
              "scales must be contiguous float16 [out, 2, in / 32]");
  return checked(x, kGroup, out_features, bias, [&](QuantizedRows& rows, const float* b, float* y) {
#ifdef PDCLUSTER_DOT_LINEAR
    rows.blocked = block_rows(rows, x.size(0), in);
    const Int4Weights w{packed.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>())};
    dot_linear(w, rows, x.size(0), in, out_features, b, y);
#endif
  });
}

// x [N, in] float32, q [out, in] uint8 (int8 weight + 128), w_scale [out] float32,
// bias [out] float32 or None -> y [N, out] float32
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& w_scale, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(dot_linear_supported(), "int8_linear needs a CPU with AVX2 or AVX512-VNNI");
  const int64_t in = x.size(-1), out_features = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8 && q.is_contiguous() &&
                  q.size(1) == in,
              "q must be contiguous uint8 [out, in]");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.is_contiguous() &&
                  w_scale.numel() == out_features,
              "w_scale must be contiguous float32 [out]");
  return checked(x, 2 * kGroup, out_features, bias, [&](QuantizedRows& rows, const float* b, float* y) {
#ifdef PDCLUSTER_DOT_LINEAR
    const Int8Weights w{q.data_ptr<uint8_t>(), w_scale.data_ptr<float>()};
    dot_linear(w, rows, x.size(0), in, out_features, b, y);
#endif
  });
}
