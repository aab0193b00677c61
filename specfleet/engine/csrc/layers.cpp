// Every decoder layer of a CPU pass in one call: the norms, projections, RoPE with the KV write, attention and the
// MLP of each layer in turn, through the same kernels `llama.forward` calls one by one (csrc/bf16_linear.cpp,
// csrc/attention.cpp), in the same order on the same rows. A pass of a few rows otherwise spends about as long in
// Python between those calls as in them (specfleet/engine/cpu_pass.py).
//
// The projections run on the pass's real rows ([rows, ...]: a ragged pass's padding left out), RoPE and attention
// on the padded [batch * width] layout the pass's `Pass` describes, as llama.forward's `_real_rows` and `_padded` do.
#include <cstdint>
#include <cstring>
#include <vector>

struct Pass;  // csrc/attention.cpp's: where the pass's sessions lie

extern "C" {
void specfleet_linear_bf16(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K);
void specfleet_attend(const Pass* pass, const float* q, int64_t q_b, int64_t q_h, int64_t q_n, const float* pool_layer, float* out);
void specfleet_add_rms_norm(float* x, const float* delta, const float* weight, float* out, int64_t rows, int64_t width, float eps);
void specfleet_rope_write(const Pass* pass, const float* qkv, const int64_t* positions, const float* cos, const float* sin, float* q_out,
                          float* pool_layer);
void specfleet_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* out);
}

// One layer's weights: norms float32, projections packed bfloat16 (`cpu_kernels.pack_bf16`), biases float32 or null.
struct LayerWeights {
  const float* input_norm;
  const uint16_t* qkv;
  const float* qkv_bias;
  const uint16_t* out;
  const float* out_bias;
  const float* mlp_norm;
  const uint16_t* gate_up;
  const uint16_t* down;
};

// The model's constant part (`cpu_pass.prepare`).
struct Layers {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter;
  float eps;
  const LayerWeights* weights;
  const float* norm;  // the final norm, before the output layer
  const float* cos;   // RoPE tables [positions, head_dim]
  const float* sin;
};

namespace {

// y [rows, n] = x [rows, k] W^T (+ bias): `CpuWeight`'s bfloat16 path, its bias added after the product as torch adds it.
void project(const float* x, const uint16_t* w, const float* bias, float* y, int64_t rows, int64_t n, int64_t k) {
  specfleet_linear_bf16(x, w, y, rows, n, k);
  if (bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) y[r * n + j] += bias[j];
}

}  // namespace

// x [rows, hidden]: the residual stream after the embedding, updated in place; h [rows, hidden]: its input norm on
// entry, the final norm's output on return (with logits; otherwise left as the last layer's MLP norm).
// row_index [rows]: each real row's place b * width + i in the padded layout, or null where no row pads. pool: the KV
// pool, layer_floats floats a layer.
extern "C" void specfleet_layers(const Layers* m, const Pass* pass, int64_t batch, int64_t width, int64_t rows, const int64_t* row_index,
                                 const int64_t* positions, float* pool, int64_t layer_floats, float* x, float* h, int32_t logits) {
  const int64_t E = m->hidden, H = m->heads, D = m->head_dim, I = m->inter, padded = batch * width;
  const int64_t qkv_width = (H + 2 * m->kv_heads) * D, attn_width = H * D;
  std::vector<float> qkv(rows * qkv_width), q(padded * attn_width), attn(padded * attn_width), delta(rows * E);
  std::vector<float> qkv_padded(row_index ? padded * qkv_width : 0), attn_rows(row_index ? rows * attn_width : 0);
  std::vector<float> gate_up(rows * 2 * I), gated(rows * I);
  for (int64_t i = 0; i < m->layers; ++i) {
    const LayerWeights& w = m->weights[i];
    float* pool_layer = pool + i * layer_floats;
    project(h, w.qkv, w.qkv_bias, qkv.data(), rows, qkv_width, E);
    const float* laid = qkv.data();
    if (row_index) {  // padding rows zero, as `_padded` leaves them
      std::memset(qkv_padded.data(), 0, qkv_padded.size() * sizeof(float));
      for (int64_t r = 0; r < rows; ++r) std::memcpy(&qkv_padded[row_index[r] * qkv_width], &qkv[r * qkv_width], qkv_width * sizeof(float));
      laid = qkv_padded.data();
    }
    specfleet_rope_write(pass, laid, positions, m->cos, m->sin, q.data(), pool_layer);
    // q is [batch, width, heads, D]; attention reads it as [batch, heads, width, D] (strides of that view).
    specfleet_attend(pass, q.data(), width * attn_width, D, attn_width, pool_layer, attn.data());
    const float* attended = attn.data();
    if (row_index) {
      for (int64_t r = 0; r < rows; ++r) std::memcpy(&attn_rows[r * attn_width], &attn[row_index[r] * attn_width], attn_width * sizeof(float));
      attended = attn_rows.data();
    }
    project(attended, w.out, w.out_bias, delta.data(), rows, E, attn_width);
    specfleet_add_rms_norm(x, delta.data(), w.mlp_norm, h, rows, E, m->eps);
    project(h, w.gate_up, nullptr, gate_up.data(), rows, 2 * I, E);
    specfleet_silu_mul(gate_up.data(), rows, I, gated.data());
    project(gated.data(), w.down, nullptr, delta.data(), rows, E, I);
    const float* following = i + 1 < m->layers ? m->weights[i + 1].input_norm : logits ? m->norm : nullptr;
    if (following) {
      specfleet_add_rms_norm(x, delta.data(), following, h, rows, E, m->eps);
    } else {
      for (int64_t j = 0; j < rows * E; ++j) x[j] += delta[j];
    }
  }
}
