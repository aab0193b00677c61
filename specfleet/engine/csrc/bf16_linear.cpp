// y = x W^T for float32 activations x [M, K] and a weight W [N, K] whose values are bfloat16, read from memory as
// bfloat16 and widened to float32 in registers (exact: a bfloat16 is a float32's upper half), summed in float32.
//
// A decode or verify pass on a CPU reads every weight once for a few rows, so it runs at the speed memory delivers
// the weights; half the bytes is up to twice the speed, with float32 arithmetic (specfleet/engine/cpu_kernels.py).
//
// W is packed by `cpu_kernels.pack_bf16` as [ceil(N / BLOCK)][K][BLOCK]: a block of BLOCK output columns is one
// contiguous stream over K. Each output is summed over k = 0..K-1 in order, from its own row of x alone, so a row's
// result does not depend on the other rows of the call or on how many there are.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// GCC and Clang vector types: one register of 16 floats where the CPU has 512-bit vectors, split where it has fewer.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int64_t BLOCK = 32;  // output columns a block computes: two vectors of 16 floats
constexpr int ROWS = 12;        // rows of x one sweep of a block over K serves, their sums held in registers

// 16 bfloat16s as the float32s they are: each one's bits become the upper half of a float32's.
inline f32x16 widen(const uint16_t* bits) {
#ifdef __AVX512F__
  // One zero-extending load and a shift (the generic form below compiles to several shuffles).
  return (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)bits)), 16));
#else
  u16x16 half;
  std::memcpy(&half, bits, sizeof half);
  const u32x16 word = __builtin_convertvector(half, u32x16) << 16;
  f32x16 value;
  std::memcpy(&value, &word, sizeof value);
  return value;
#endif
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

}  // namespace

extern "C" void specfleet_linear_bf16(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
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
