// Attention of one layer for every session of a pass in one call, over the KV pool as it lies (consecutive blocks
// or scattered ones), and RMSNorm with the residual add before it: the small operations of a CPU pass, whose
// arithmetic is tiny beside what torch spends dispatching them (specfleet/engine/cpu_kernels.py).
//
// Each query row sums over its own visible positions in ascending order, in float32, with a softmax taken after
// every score is known: its result depends on its query and the keys and values it sees, never on the other rows,
// sessions or how many there are, so batching cannot change a request's logits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// One vector register's floats: 16 where the CPU has AVX-512, else 8 (AVX2's width; two NEON registers).
#ifdef __AVX512F__
constexpr int64_t LANES = 16;
#else
constexpr int64_t LANES = 8;
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
typedef int32_t ivec __attribute__((vector_size(4 * LANES)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

constexpr int64_t MAX_HEAD_DIM = 256;
// Query rows of one key head attended together (a session's new tokens and the query heads of one key head): a
// context's keys and values are read from memory once for all of them, not once a row.
constexpr int64_t TILE = 8;
constexpr float HIDDEN = -std::numeric_limits<float>::infinity();

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// The lanes summed as a tree: lane i with i + LANES / 2, then with i + 4, i + 2, i + 1 (`sums` sums each of LANES
// vectors in the same order).
inline float lanes_sum(vec v) {
  f32x4 four;
#ifdef __AVX512F__
  f32x8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const f32x8 eight = lo + hi;
  std::memcpy(&four, &eight, sizeof four);
  f32x4 upper;
  std::memcpy(&upper, reinterpret_cast<const char*>(&eight) + sizeof four, sizeof upper);
#else
  std::memcpy(&four, &v, sizeof four);
  f32x4 upper;
  std::memcpy(&upper, reinterpret_cast<const char*>(&v) + sizeof four, sizeof upper);
#endif
  four += upper;
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// Lane j of the result: the sum of v[j]'s lanes, in `lanes_sum`'s order, for LANES vectors at once.
inline vec sums(const vec* v) {
#ifdef __AVX512F__
  vec eight[8];
  for (int k = 0; k < 8; ++k)  // lanes 0-7: v[2k]'s i + (i + 8); lanes 8-15: v[2k + 1]'s
    eight[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec* from = eight;
#else
  const vec* from = v;
#endif
  vec four[4], two[2];
  for (int k = 0; k < 4; ++k)  // groups of 4 lanes: i + (i + 4), each group one vector of v
#ifdef __AVX512F__
    four[k] = __builtin_shufflevector(from[2 * k], from[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
              __builtin_shufflevector(from[2 * k], from[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
#else
    four[k] = __builtin_shufflevector(from[2 * k], from[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(from[2 * k], from[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
  for (int k = 0; k < 2; ++k)  // pairs of lanes: i + (i + 2)
#ifdef __AVX512F__
    two[k] = __builtin_shufflevector(four[2 * k], four[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
             __builtin_shufflevector(four[2 * k], four[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(two[0], two[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(two[0], two[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    two[k] = __builtin_shufflevector(four[2 * k], four[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
             __builtin_shufflevector(four[2 * k], four[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(two[0], two[1], 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(two[0], two[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// exp(x) for x <= 0, within about a unit in the last place (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
// polynomial in r, times 2^n); exactly 0 below -87 (exp(-inf) included), where float32 has no normal value left.
inline vec exp_lanes(vec x) {
  const ivec gone = x < -87.0f;
  x = gone ? -87.0f : x;
  const vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vec r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec y = p * r * r + r + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return gone ? 0.0f : y * scale;
}

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

// Attention of `count` (at most T) query rows over the same positions of one key head, whose keys and values start
// at k and val: row u's query at qs[u], its result at outs[u], the new positions it sees marked by seens[u] (or all
// where null), none at or past `total`; padded is total rounded up to LANES, and scores holds T * padded floats.
// The rows are a session's new tokens times the query heads of one key head (grouped-query attention): each key and
// value is read once for all of them, each row's arithmetic the same as alone. T = 1 keeps a single row's loops free
// of the tile's.
template <int64_t T>
void attend_rows(int64_t count, const float* const* qs, float* const* outs, const uint8_t* const* seens, const float* k, const float* val,
                 const int64_t* where, int64_t cached, int64_t total, int64_t padded, int64_t head_dim, float scale, float* scores) {
  if (T == 1) count = 1;
  const int64_t vectors = head_dim / LANES;
  vec query[T][MAX_HEAD_DIM / LANES];
  for (int64_t u = 0; u < count; ++u)
    for (int64_t v = 0; v < vectors; ++v) query[u][v] = load(qs[u] + v * LANES);
  // Scores, LANES positions at a time; then the positions each row does not see hidden.
  for (int64_t t0 = 0; t0 < padded; t0 += LANES) {
    vec dots[T][LANES];
    for (int64_t j = 0; j < LANES; ++j) {
      const float* key = k + where[t0 + j] * head_dim;
      for (int64_t u = 0; u < count; ++u) {
        vec acc = query[u][0] * load(key);
        for (int64_t v = 1; v < vectors; ++v) acc += query[u][v] * load(key + v * LANES);
        dots[u][j] = acc;
      }
    }
    for (int64_t u = 0; u < count; ++u) store(scores + u * padded + t0, sums(dots[u]) * scale);
  }
  float inverse[T];
  for (int64_t u = 0; u < count; ++u) {
    float* s = scores + u * padded;
    const uint8_t* seen = seens[u];
    for (int64_t t = cached; t < padded; ++t)
      if (t >= total || (seen && !seen[t - cached])) s[t] = HIDDEN;
    vec top = HIDDEN - vec{};
    for (int64_t t0 = 0; t0 < padded; t0 += LANES) top = vmax(top, load(s + t0));
    float most = top[0];
    for (int64_t j = 1; j < LANES; ++j) most = std::max(most, top[j]);
    vec sum = {};
    for (int64_t t0 = 0; t0 < padded; t0 += LANES) {
      const vec p = exp_lanes(load(s + t0) - most);
      store(s + t0, p);
      sum += p;
    }
    inverse[u] = 1.0f / lanes_sum(sum);
  }
  // Every cached position is seen, and its weight is seldom 0 (an underflow): added without a test; a new position
  // may be hidden (weight 0, skipped). Adding 0 times a finite value leaves a sum as it is, bit for bit.
  vec acc[T][MAX_HEAD_DIM / LANES] = {};
  for (int64_t t = 0; t < cached; ++t) {
    const float* value = val + where[t] * head_dim;
    for (int64_t u = 0; u < count; ++u) {
      const float p = scores[u * padded + t];
      for (int64_t v = 0; v < vectors; ++v) acc[u][v] += p * load(value + v * LANES);
    }
  }
  for (int64_t t = cached; t < total; ++t) {
    const float* value = val + where[t] * head_dim;
    for (int64_t u = 0; u < count; ++u) {
      const float p = scores[u * padded + t];
      if (p == 0.0f) continue;  // hidden
      for (int64_t v = 0; v < vectors; ++v) acc[u][v] += p * load(value + v * LANES);
    }
  }
  for (int64_t u = 0; u < count; ++u)
    for (int64_t v = 0; v < vectors; ++v) store(outs[u] + v * LANES, acc[u][v] * inverse[u]);
}

}  // namespace

// Where one pass's sessions lie and what their new tokens see (`cpu_kernels.AttendPlan` fills it once a pass): the
// KV pool's shape, session b's cached and new lengths, where its positions lie on the pool's token axis (from
// starts[b], or at indices[b][t] where starts[b] < 0) and its new tokens' visibility among themselves (masks[b],
// uint8 [n, n], or null: all visible).
struct Pass {
  int64_t batch, width, heads, kv_heads, head_dim, capacity;
  const int64_t* kv_lens;
  const int64_t* new_lens;
  const int64_t* starts;
  const int64_t* const* indices;
  const uint8_t* const* masks;
  float scale;
};

// out[b, i, h, :] for session b's new token i and query head h: softmax(q . K^T * scale) V over the positions t of
// [0, kv_lens[b] + new_lens[b]) that row sees: every cached one (t < kv_lens[b]) and the new ones row i of masks[b]
// marks. pool_layer is one layer of the pool, [2, kv_heads, capacity, head_dim]: keys, then values; query head h
// reads key head h / (heads / kv_heads). q's rows are head_dim contiguous floats at b * q_b + h * q_h + i * q_n.
// Rows i >= new_lens[b] of out are zeroed.
// head_dim is a multiple of 16, at most MAX_HEAD_DIM (`cpu_kernels.attend` checks).
extern "C" void specfleet_attend(const Pass* pass, const float* q, int64_t q_b, int64_t q_h, int64_t q_n, const float* pool_layer, float* out) {
  const int64_t batch = pass->batch, width = pass->width, heads = pass->heads, kv_heads = pass->kv_heads, head_dim = pass->head_dim;
  const int64_t capacity = pass->capacity, *kv_lens = pass->kv_lens, *new_lens = pass->new_lens, *starts = pass->starts;
  const int64_t* const* indices = pass->indices;
  const uint8_t* const* masks = pass->masks;
  const float scale = pass->scale, *keys = pool_layer, *values = pool_layer + kv_heads * capacity * head_dim;
  const int64_t group = heads / kv_heads;
  std::vector<float> scores;
  std::vector<int64_t> where, sees;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t cached = kv_lens[b], n = new_lens[b], total = cached + n, padded = (total + LANES - 1) / LANES * LANES;
    scores.resize(TILE * padded);
    where.resize(padded);
    for (int64_t t = 0; t < padded; ++t) where[t] = t >= total ? where[0] : starts[b] >= 0 ? starts[b] + t : indices[b][t];
    for (int64_t i = n; i < width; ++i) std::memset(out + (b * width + i) * heads * head_dim, 0, heads * head_dim * sizeof(float));
    // How far each new token sees: past its last visible new position nothing is visible to it (a prompt's chunk is
    // causal, a tree's node sees ancestors before it), so a tile of rows stops at the furthest any of them sees. The
    // positions it skips would each add a weight of exactly 0: the result is the same, bit for bit.
    sees.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      sees[i] = cached;
      for (int64_t j = n - 1; j >= 0; --j)
        if (!masks[b] || masks[b][i * n + j]) {
          sees[i] = cached + j + 1;
          break;
        }
    }
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      const float* k = keys + kv * capacity * head_dim;
      const float* val = values + kv * capacity * head_dim;
      // The session's rows of this key head (each new token's query heads of its group), TILE at a time.
      for (int64_t first = 0, count = 0; first < n * group; first += count) {
        count = std::min(TILE, n * group - first);
        const float* qs[TILE];
        float* outs[TILE];
        const uint8_t* seens[TILE];
        int64_t seen_to = cached;
        for (int64_t u = 0; u < count; ++u) {
          const int64_t i = (first + u) / group, h = kv * group + (first + u) % group;
          qs[u] = q + b * q_b + h * q_h + i * q_n;
          outs[u] = out + ((b * width + i) * heads + h) * head_dim;
          seens[u] = masks[b] ? masks[b] + i * n : nullptr;
          seen_to = std::max(seen_to, sees[i]);
        }
        const int64_t span = (seen_to + LANES - 1) / LANES * LANES;
        if (count == 1)
          attend_rows<1>(1, qs, outs, seens, k, val, where.data(), cached, seen_to, span, head_dim, scale, scores.data());
        else
          attend_rows<TILE>(count, qs, outs, seens, k, val, where.data(), cached, seen_to, span, head_dim, scale, scores.data());
      }
    }
  }
}

// For each of `rows` rows of `width` floats: x += delta (where delta is not null), then
// out = x / sqrt(mean(x^2) + eps) * weight.
extern "C" void specfleet_add_rms_norm(float* x, const float* delta, const float* weight, float* out, int64_t rows, int64_t width,
                                       float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * width;
    if (delta)
      for (int64_t d = 0; d < width; ++d) xr[d] += delta[r * width + d];
    vec acc = {};
    int64_t d = 0;
    for (; d + LANES <= width; d += LANES) acc += load(xr + d) * load(xr + d);
    float squares = lanes_sum(acc);
    for (; d < width; ++d) squares += xr[d] * xr[d];
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
    float* o = out + r * width;
    for (d = 0; d < width; ++d) o[d] = xr[d] * inverse * weight[d];
  }
}

// Each new token's query, key and value heads from its row of qkv ([batch * width, (heads + 2 kv_heads) head_dim]),
// q and k rotated by RoPE at positions[row] (x * cos + roll(x, head_dim / 2) * sin, the model's sin with its first
// half negated: llama._rotate), the query into q_out [batch * width, heads, head_dim] and the key and value into the
// pool layer's halves at the token's place (as `specfleet_attend` reads them). Padding rows (token i >= new_lens[b])
// rotate their query and write nothing.
extern "C" void specfleet_rope_write(const Pass* pass, const float* qkv, const int64_t* positions, const float* cos, const float* sin, float* q_out,
                                     float* pool_layer) {
  const int64_t batch = pass->batch, width = pass->width, heads = pass->heads, kv_heads = pass->kv_heads, head_dim = pass->head_dim;
  const int64_t capacity = pass->capacity, *kv_lens = pass->kv_lens, *new_lens = pass->new_lens, *starts = pass->starts;
  const int64_t* const* indices = pass->indices;
  float *keys = pool_layer, *values = pool_layer + kv_heads * capacity * head_dim;
  const int64_t half = head_dim / 2, stride = (heads + 2 * kv_heads) * head_dim;
  auto rotate = [&](const float* x, const float* c, const float* s, float* y) {
    for (int64_t d = 0; d < head_dim; ++d) y[d] = x[d] * c[d] + x[(d + half) % head_dim] * s[d];
  };
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < width; ++i) {
      const int64_t row = b * width + i;
      const float* x = qkv + row * stride;
      const float* c = cos + positions[row] * head_dim;
      const float* s = sin + positions[row] * head_dim;
      for (int64_t h = 0; h < heads; ++h) rotate(x + h * head_dim, c, s, q_out + (row * heads + h) * head_dim);
      if (i >= new_lens[b]) continue;
      const int64_t t = kv_lens[b] + i, at = starts[b] >= 0 ? starts[b] + t : indices[b][t];
      for (int64_t g = 0; g < kv_heads; ++g) {
        rotate(x + (heads + g) * head_dim, c, s, keys + (g * capacity + at) * head_dim);
        std::memcpy(values + (g * capacity + at) * head_dim, x + (heads + kv_heads + g) * head_dim, head_dim * sizeof(float));
      }
    }
  }
}

// out[r, j] = silu(gate) * up for gate = gate_up[r, j], up = gate_up[r, inter + j]: the MLP's gate.
extern "C" void specfleet_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int64_t j = 0; j < inter; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}
