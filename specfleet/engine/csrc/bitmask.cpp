// Structured output's mask (specfleet/engine/guides.py `mask_rows`): each row's logits set to -inf wherever xgrammar's
// bitmask of that row has the token's bit clear (bit j of word w: token 32 w + j), in place, in one pass. torch's
// unpacking takes a handful of small operations a row, each costing more to dispatch than this loop.
#include <cstdint>
#include <limits>

// logits [rows, vocab] float32, bitmask [rows, words] int32 with words >= ceil(vocab / 32).
extern "C" void specfleet_mask_bits(float* logits, int64_t rows, int64_t vocab, const int32_t* bitmask, int64_t words) {
  const float blocked = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * vocab;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask + r * words);
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      const uint32_t word = bits[w];
      if (word == 0xFFFFFFFFu) continue;  // every token of the word allowed
      const int64_t end = (w + 1) * 32 < vocab ? 32 : vocab - w * 32;
      for (int64_t j = 0; j < end; ++j) {
        if (!((word >> j) & 1u)) row[w * 32 + j] = blocked;
      }
    }
  }
}
