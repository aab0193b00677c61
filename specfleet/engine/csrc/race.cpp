// The exponential race's winner of each row over the whole vocabulary (specfleet/engine/sampling.py: `race` of
// `race_noise`): argmax over v of p(v) / E(key, v), E = -log(u), u from splitmix64 of key + (v + 1) * golden, the
// same bits and the same double arithmetic as the tensor form, in one pass over the row without temporaries.
//
// -log(u) >= 1 - u, so a token whose p / (1 - u) falls short of the best score so far cannot win, and only the few
// that might take the logarithm: a row costs V hashes and a handful of logarithms, where the tensor form writes a
// dozen [rows, V] int64 temporaries and takes V logarithms (docs/benchmarks/verify-overhead.md).
#include <cmath>
#include <cstdint>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;
constexpr uint64_t MIX1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t MIX2 = 0x94D049BB133111EBull;
// -log(u) and 1 - u are each within a rounding of their true values: a token is passed over only where its bound
// falls short of the best score by more than that.
constexpr double MARGIN = 1.0 - 1e-12;

inline double uniform(uint64_t key, int64_t id) {
  uint64_t x = key + static_cast<uint64_t>(id + 1) * GOLDEN;
  x = (x ^ (x >> 30)) * MIX1;
  x = (x ^ (x >> 27)) * MIX2;
  x = x ^ (x >> 31);
  // 53 random bits, centred in their interval: strictly inside (0, 1).
  return (static_cast<double>(x >> 11) + 0.5) * 0x1p-53;
}

}  // namespace

// probs [rows, vocab] float32, keys [rows]: winners [rows]. Ties go to the lower id, as torch's argmax gives them.
extern "C" void specfleet_race(const float* probs, int64_t rows, int64_t vocab, const int64_t* keys, int64_t* winners) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = probs + r * vocab;
    const uint64_t key = static_cast<uint64_t>(keys[r]);
    double best = 0.0;
    int64_t winner = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      const double mass = p[v];
      if (!(mass > 0.0)) continue;  // a score of 0 never beats the best
      const double u = uniform(key, v);
      if (mass < best * (1.0 - u) * MARGIN) continue;
      const double score = mass / -std::log(u);
      if (score > best) {
        best = score;
        winner = v;
      }
    }
    winners[r] = winner;
  }
}
