// y = x W^T for float32 activations x [M, K] and a weight W [N, K] whose values are bfloat16, read from memory as
// bfloat16 and widened to float32 in registers (exact: a bfloat16 is a float32's upper half), summed in float32.
//
// A decode or verify pass on a CPU reads every weight once for a few rows, so it runs at the speed memory delivers
// the weights; half the bytes is up to twice the speed, with float32 arithmetic (specfleet/engine/cpu_kernels.py).
//
// W is packed by `cpu_kernels.pack_bf16` as [ceil(N / BLOCK)][K][BLOCK]: a block of BLOCK output columns is one
// contiguous stream over K. Each output is summed over k = 0..K-1 in order, from its own row of x alone, so a row's
// result does not depend on the other rows of the call or on how many there are.
//
// Two forms of one sweep: 16-float vectors where the CPU has AVX-512, their tiles sized for its 32 registers, and
// 8-float vectors elsewhere, their tiles sized for AVX2's 16 (NEON's 32 of 4 floats hold them too). AVX-512's tiles
// spill on AVX2, and run several times slower there than a float32 matmul reading twice the bytes.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;  // output columns a block computes: two vectors of 16 floats, or four of 8

#ifdef __AVX512F__

// GCC and Clang vector types: one register of 16 floats.
typedef float f32x16 __attribute__((vector_size(64)));

constexpr int ROWS = 12;  // rows of x one sweep of a block over K serves, their sums held in registers

// 16 bfloat16s as the float32s they are: each one's bits become the upper half of a float32's, by one
// zero-extending load and a shift.
inline f32x16 widen(const uint16_t* bits) {
  return (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)bits)), 16));
}

// Rows [0, M) of x against blocks [0, B) from `blocks` on: output columns [n0, n0 + B * BLOCK) of those rows of y.
// With few rows, several blocks at once give the core independent sums to interleave (one sum's multiply-adds
// wait on each other); every output is still summed over k in order.
template <int M, int B>
void sweep(const float* x, int64_t K, const uint16_t* blocks, float* y, int64_t N, int64_t n0) {
  f32x16 sums[M][2 * B] = {};
  for (int64_t k = 0; k < K; ++k) {
    f32x16 w[2 * B];
    for (int b = 0; b < B; ++b) {
      w[2 * b] = widen(blocks + (b * K + k) * BLOCK);
      w[2 * b + 1] = widen(blocks + (b * K + k) * BLOCK + 16);
    }
    for (int m = 0; m < M; ++m) {
      const float xk = x[m * K + k];
      for (int j = 0; j < 2 * B; ++j) sums[m][j] += xk * w[j];
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t start = n0 + b * BLOCK, width = std::min(BLOCK, N - start);
    for (int m = 0; m < M; ++m) std::memcpy(y + m * N + start, &sums[m][2 * b], width * sizeof(float));
  }
}

// Every block, B at a time, then the rest one by one.
template <int M, int B>
void columns(const float* x, const uint16_t* w, float* y, int64_t N, int64_t K) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  int64_t b = 0;
  for (; b + B <= blocks; b += B) sweep<M, B>(x, K, w + b * K * BLOCK, y, N, b * BLOCK);
  for (; b < blocks; ++b) sweep<M, 1>(x, K, w + b * K * BLOCK, y, N, b * BLOCK);
}

using Sweep = void (*)(const float*, int64_t, const uint16_t*, float*, int64_t, int64_t);

template <int... R>
constexpr std::array<Sweep, sizeof...(R) + 1> one_block(std::integer_sequence<int, R...>) {
  return {nullptr, &sweep<R + 1, 1>...};
}

// SWEEPS[r]: r rows against one block.
constexpr auto SWEEPS = one_block(std::make_integer_sequence<int, ROWS>{});

void linear(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 1) return columns<1, 4>(x, w, y, N, K);
  if (M == 2) return columns<2, 2>(x, w, y, N, K);
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    // Every row of the call against this block while it is in cache: the weight comes from memory once. The rows
    // split into sweeps of at most ROWS, as even as they go.
    const int64_t sweeps = (M + ROWS - 1) / ROWS;
    for (int64_t i = 0, m = 0; i < sweeps; ++i) {
      const int64_t rows = (M - m) / (sweeps - i);
      SWEEPS[rows](x + m * K, K, w + b * K * BLOCK, y + m * N, N, b * BLOCK);
      m += rows;
    }
  }
}

#else

// GCC and Clang vector types of 8 lanes: one AVX2 register, two of NEON or SSE.
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

constexpr int64_t HALF = 16;  // columns of half a block: one `widen`, an even and an odd vector
// Rows one sweep of a half block over K serves: 12 sums, with the half block's 2 weights, a broadcast of x and
// `widen`'s mask, fill AVX2's 16 registers (a whole block for 3 rows holds its 3 broadcasts too and spills).
constexpr int ROWS = 6;

constexpr bool WORDS_LITTLE = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
constexpr uint32_t UPPER = 0xFFFF0000u;

// 16 bfloat16s as the float32s they are, in two vectors: `even` holds columns 0, 2, .., 14, `odd` 1, 3, .., 15.
// Each 32-bit word holds two bfloat16s; a shift makes its first one a float32's upper half and a mask the second,
// so no shuffle widens them (AVX2 zero-extends only 8 halves at a time, each a shuffle).
inline void widen(const uint16_t* bits, f32x8& even, f32x8& odd) {
  u32x8 word;
  std::memcpy(&word, bits, sizeof word);
  even = (f32x8)(WORDS_LITTLE ? word << 16 : word & UPPER);
  odd = (f32x8)(WORDS_LITTLE ? word & UPPER : word << 16);
}

// sum + x * w, rounded once where the CPU multiplies and adds in one instruction (every sweep alike).
inline f32x8 madd(f32x8 sum, float x, f32x8 w) {
#ifdef __FMA__
  return _mm256_fmadd_ps(_mm256_set1_ps(x), w, sum);
#else
  return sum + x * w;
#endif
}

// A half block's 16 columns in order, from `widen`'s even and odd ones.
inline void interleave(f32x8 even, f32x8 odd, float* columns) {
#ifdef __clang__
  const f32x8 low = __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11);
  const f32x8 high = __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15);
#else
  const f32x8 low = __builtin_shuffle(even, odd, i32x8{0, 8, 1, 9, 2, 10, 3, 11});
  const f32x8 high = __builtin_shuffle(even, odd, i32x8{4, 12, 5, 13, 6, 14, 7, 15});
#endif
  std::memcpy(columns, &low, sizeof low);
  std::memcpy(columns + 8, &high, sizeof high);
}

// Rows [0, M) of x against H half blocks from `half` on (one, or whole blocks): output columns [n0, n0 + H * HALF)
// of those rows of y, those below N. With few rows, several half blocks at once give the core independent sums to
// interleave (one sum's multiply-adds wait on each other); every output is still summed over k in order.
template <int M, int H>
void sweep(const float* x, int64_t K, const uint16_t* half, float* y, int64_t N, int64_t n0) {
  f32x8 sums[M][2 * H] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int h = 0; h < H; ++h) {
      f32x8 even, odd;
      widen(half + ((h / 2) * K + k) * BLOCK + (h % 2) * HALF, even, odd);
      for (int m = 0; m < M; ++m) {
        const float xk = x[m * K + k];
        sums[m][2 * h] = madd(sums[m][2 * h], xk, even);
        sums[m][2 * h + 1] = madd(sums[m][2 * h + 1], xk, odd);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t start = n0 + h * HALF, width = std::min(HALF, N - start);
    if (width <= 0) break;
    for (int m = 0; m < M; ++m) {
      float row[HALF];
      interleave(sums[m][2 * h], sums[m][2 * h + 1], row);
      std::memcpy(y + m * N + start, row, width * sizeof(float));
    }
  }
}

using Sweep = void (*)(const float*, int64_t, const uint16_t*, float*, int64_t, int64_t);

template <int... R>
constexpr std::array<Sweep, sizeof...(R) + 1> one_half(std::integer_sequence<int, R...>) {
  return {nullptr, &sweep<R + 1, 1>...};
}

// SWEEPS[r]: r rows against one half block.
constexpr auto SWEEPS = one_half(std::make_integer_sequence<int, ROWS>{});

void linear(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  if (M == 1) {
    // Two blocks at a time (8 sums: one row's multiply-adds would otherwise wait on each other), then the last.
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) sweep<1, 4>(x, K, w + b * K * BLOCK, y, N, b * BLOCK);
    if (b < blocks) sweep<1, 2>(x, K, w + b * K * BLOCK, y, N, b * BLOCK);
    return;
  }
  if (M == 2) {
    // One block at a time: 8 sums (a whole block of 3 rows or more spills its broadcasts of x).
    for (int64_t b = 0; b < blocks; ++b) sweep<2, 2>(x, K, w + b * K * BLOCK, y, N, b * BLOCK);
    return;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t h = 0; h < 2 && b * BLOCK + h * HALF < N; ++h) {
      // Every row of the call against this half block while it is in cache: the weight comes from memory once.
      // The rows split into sweeps of at most ROWS, as even as they go.
      const int64_t sweeps = (M + ROWS - 1) / ROWS;
      for (int64_t i = 0, m = 0; i < sweeps; ++i) {
        const int64_t rows = (M - m) / (sweeps - i);
        SWEEPS[rows](x + m * K, K, w + b * K * BLOCK + h * HALF, y + m * N, N, b * BLOCK + h * HALF);
        m += rows;
      }
    }
  }
}

#endif

}  // namespace

extern "C" void specfleet_linear_bf16(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  linear(x, w, y, M, N, K);
}
