// A Llama-style bfloat16 decoder stack in one call: for each layer, the same kernels in the same
// order as the Python layer loop (engine/models/blocks.py, decoder.py) runs them one ctypes call at
// a time, so the result is the same bits, without a Python round trip per kernel:
//
//   qkv = x W_qkv; RoPE on q|k; K, V into the cache; o = attention(q) W_o;
//   h += o; x = norm(h); h += down(silu(gate) * up)(x); x = next_norm(h)
//
// The linears and the attention are called through the function pointers the caller took from
// this library (the AMX or AVX-512 linear its DenseLinear chose, or the int8 / int4 VNNI linear of a
// quantized weight; the paged attention), so the choices made per weight at load time hold here too.
// Every linear kernel takes (x, packed weight, aux, y, rows, n, k, threads), aux being the bias
// (dense, null for none) or the scales (quantized), so one pointer type calls them all.
#include <cstdint>

extern "C" {
void pdserve_add_rms_norm_bf16(uint16_t* out, uint16_t* residual, const uint16_t* delta, const uint16_t* weight,
                               int64_t rows, int64_t hidden, float eps, int num_threads);
void pdserve_silu_mul_bf16(uint16_t* out, const uint16_t* gate_up, int64_t rows, int64_t inter, int num_threads);
void pdserve_rope_bf16(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t rows, int64_t heads,
                       int64_t head_dim, int64_t row_stride, int num_threads);
void pdserve_write_kv(char* cache, int64_t plane_bytes, const char* k, int64_t k_stride, const char* v,
                      int64_t v_stride, const int64_t* slots, int64_t T, int64_t row_bytes);
}

namespace {

using LinearFn = void (*)(const uint16_t*, const void*, const void*, uint16_t*, int64_t, int64_t, int64_t, int);
using AttentionFn = void (*)(void*, const void*, const void*, const void*, const int32_t*, const int32_t*,
                             const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                             int64_t, float, int);

struct Linear {  // y [M, n] = x [M, k] W^T (+ bias), W packed as its Python linear packs it
  LinearFn fn;
  const void* packed;
  const void* aux;  // the bias (null: none) or the scales, as fn takes them
  int64_t n, k;
  void operator()(const uint16_t* x, uint16_t* y, int64_t M, int threads) const {
    fn(x, packed, aux, y, M, n, k, threads);
  }
};

}  // namespace

extern "C" {

// One layer's weights, fixed from load time (engine/models/decoder_stack.py builds them).
struct PdserveStackLayer {
  Linear qkv, o, gate_up, down;
  const uint16_t* post_norm;  // [hidden]
  const uint16_t* next_norm;  // [hidden]: the next layer's input norm, or the model's final norm
  AttentionFn attention;
  float scale, softcap;
  int64_t window;
};

// One step: the shapes, the residual stream and the normed input (both updated in place), the
// rotary tables, the attention metadata and the scratch buffers, all bfloat16 unless named.
struct PdserveStackStep {
  int64_t rows, hidden, heads, kv_heads, head_dim, inter;
  int64_t num_seqs, block_size, max_blocks;
  int64_t plane_bytes;  // bytes from a layer's K plane to its V plane
  float eps;
  int threads;
  char* const* caches;          // [num_layers]: layer i's cache [2, blocks, block_size, kv_heads, head_dim]
  uint16_t* h;                  // [rows, hidden] residual stream
  uint16_t* x;                  // [rows, hidden] the first layer's normed input; on return the stack's output
  const uint16_t* cos;          // [rows, head_dim]
  const uint16_t* sin;          // [rows, head_dim]
  const int64_t* slots;         // [rows] slot mapping
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  const int32_t* context_lens;  // [num_seqs]
  const int32_t* query_start;   // [num_seqs + 1]
  uint16_t* qkv;                // [rows, (heads + 2 kv_heads) head_dim]
  uint16_t* attn;               // [rows, heads head_dim]
  uint16_t* proj;               // [rows, hidden]
  uint16_t* gate_up;            // [rows, 2 inter]
  uint16_t* act;                // [rows, inter]
};

void pdserve_decoder_stack_bf16(const PdserveStackLayer* layers, int64_t num_layers, const PdserveStackStep* s) {
  const int64_t qkv_n = (s->heads + 2 * s->kv_heads) * s->head_dim;
  const int64_t kv_off = s->heads * s->head_dim;
  const int64_t row_bytes = s->kv_heads * s->head_dim * 2;
  for (int64_t i = 0; i < num_layers; ++i) {
    const PdserveStackLayer& L = layers[i];
    char* cache = s->caches[i];
    L.qkv(s->x, s->qkv, s->rows, s->threads);
    pdserve_rope_bf16(s->qkv, s->cos, s->sin, s->rows, s->heads + s->kv_heads, s->head_dim, qkv_n, s->threads);
    const uint16_t* k = s->qkv + kv_off;
    const uint16_t* v = k + s->kv_heads * s->head_dim;
    pdserve_write_kv(cache, s->plane_bytes, reinterpret_cast<const char*>(k), qkv_n * 2,
                     reinterpret_cast<const char*>(v), qkv_n * 2, s->slots, s->rows, row_bytes);
    L.attention(s->attn, s->qkv, cache, cache + s->plane_bytes, s->block_tables, s->context_lens, s->query_start,
                s->num_seqs, s->heads, s->kv_heads, s->head_dim, s->block_size, s->max_blocks, qkv_n, L.scale,
                L.window, L.softcap, s->threads);
    L.o(s->attn, s->proj, s->rows, s->threads);
    pdserve_add_rms_norm_bf16(s->x, s->h, s->proj, L.post_norm, s->rows, s->hidden, s->eps, s->threads);
    L.gate_up(s->x, s->gate_up, s->rows, s->threads);
    pdserve_silu_mul_bf16(s->act, s->gate_up, s->rows, s->inter, s->threads);
    L.down(s->act, s->proj, s->rows, s->threads);
    pdserve_add_rms_norm_bf16(s->x, s->h, s->proj, L.next_norm, s->rows, s->hidden, s->eps, s->threads);
  }
}

}  // extern "C"
