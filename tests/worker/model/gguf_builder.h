// Builds small GGUF v3 files in memory for loader tests (independent of the reader's code).
#pragma once
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "worker/model/model.h"

namespace sf::testing {

class GgufBuilder {
 public:
  void kv_string(const std::string& k, const std::string& v) { key(k, 8); str(meta_, v); ++n_kv_; }
  void kv_u32(const std::string& k, uint32_t v) { key(k, 4); pod(meta_, v); ++n_kv_; }
  void kv_u64(const std::string& k, uint64_t v) { key(k, 10); pod(meta_, v); ++n_kv_; }
  void kv_f32(const std::string& k, float v) { key(k, 6); pod(meta_, v); ++n_kv_; }
  void kv_bool(const std::string& k, bool v) { key(k, 7); pod(meta_, uint8_t(v)); ++n_kv_; }
  // F32 tensor; dims in ggml order (dims[0] contiguous).
  void tensor_f32(const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& data) {
    tensor_raw(name, dims, 0, data.data(), data.size() * 4);
  }
  void tensor_raw(const std::string& name, std::vector<uint64_t> dims, uint32_t type, const void* p, size_t n) {
    str(infos_, name);
    pod(infos_, uint32_t(dims.size()));
    for (auto d : dims) pod(infos_, d);
    pod(infos_, type);
    pod(infos_, uint64_t(data_.size()));
    data_.insert(data_.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    while (data_.size() % 32) data_.push_back(0);
    ++n_tensors_;
  }
  std::vector<uint8_t> build() const {
    std::vector<uint8_t> out;
    pod(out, uint32_t(0x46554747));
    pod(out, uint32_t(3));
    pod(out, n_tensors_);
    pod(out, n_kv_);
    out.insert(out.end(), meta_.begin(), meta_.end());
    out.insert(out.end(), infos_.begin(), infos_.end());
    while (out.size() % 32) out.push_back(0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

 private:
  template <typename T>
  static void pod(std::vector<uint8_t>& b, T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  static void str(std::vector<uint8_t>& b, const std::string& s) {
    pod(b, uint64_t(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  }
  void key(const std::string& k, uint32_t type) {
    str(meta_, k);
    pod(meta_, type);
  }
  std::vector<uint8_t> meta_, infos_, data_;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
};

// A Llama model's metadata and F32 tensors (tied embeddings: no output.weight). qk, when given,
// maps a Q or K weight and its head count to the rows the GGUF stores (e.g. llama.cpp's permute).
using QkRows = std::function<std::vector<float>(const model::OwnedTensor&, int heads)>;
inline void add_llama(GgufBuilder& b, const model::Model& m, const std::string& name,
                      const QkRows& qk = nullptr) {
  const model::ModelConfig& cfg = m.config();
  const model::ModelWeights& w = m.weights();
  b.kv_string("general.architecture", "llama");
  b.kv_string("general.name", name);
  b.kv_u32("llama.block_count", uint32_t(cfg.n_layers));
  b.kv_u32("llama.embedding_length", uint32_t(cfg.hidden));
  b.kv_u32("llama.attention.head_count", uint32_t(cfg.n_heads));
  b.kv_u32("llama.attention.head_count_kv", uint32_t(cfg.n_kv_heads));
  b.kv_u32("llama.feed_forward_length", uint32_t(cfg.intermediate));
  b.kv_u32("llama.context_length", 4096);
  b.kv_f32("llama.rope.freq_base", cfg.rope.theta);
  b.kv_f32("llama.attention.layer_norm_rms_epsilon", cfg.rms_eps);
  auto dims = [](const model::OwnedTensor& t) {
    return t.shape.size() == 1 ? std::vector<uint64_t>{uint64_t(t.shape[0])}
                               : std::vector<uint64_t>{uint64_t(t.shape[1]), uint64_t(t.shape[0])};
  };
  auto rows = [&](const model::OwnedTensor& t, int heads) { return qk ? qk(t, heads) : t.data; };
  b.tensor_f32("token_embd.weight", dims(w.tok_embd), w.tok_embd.data);
  b.tensor_f32("output_norm.weight", dims(w.out_norm), w.out_norm.data);
  for (int l = 0; l < cfg.n_layers; ++l) {
    const auto& L = w.layers[size_t(l)];
    const std::string p = "blk." + std::to_string(l) + ".";
    b.tensor_f32(p + "attn_norm.weight", dims(L.attn_norm), L.attn_norm.data);
    b.tensor_f32(p + "attn_q.weight", dims(L.wq), rows(L.wq, cfg.n_heads));
    b.tensor_f32(p + "attn_k.weight", dims(L.wk), rows(L.wk, cfg.n_kv_heads));
    b.tensor_f32(p + "attn_v.weight", dims(L.wv), L.wv.data);
    b.tensor_f32(p + "attn_output.weight", dims(L.wo), L.wo.data);
    b.tensor_f32(p + "ffn_norm.weight", dims(L.ffn_norm), L.ffn_norm.data);
    b.tensor_f32(p + "ffn_gate.weight", dims(L.w_gate), L.w_gate.data);
    b.tensor_f32(p + "ffn_up.weight", dims(L.w_up), L.w_up.data);
    b.tensor_f32(p + "ffn_down.weight", dims(L.w_down), L.w_down.data);
  }
}

// m written as a Llama GGUF (F32 tensors, no tokenizer) at path, for tests that run a binary on
// a model of their own (nothing has to travel to a GPU host). Returns path.
inline std::string write_llama_gguf(const std::string& path, const model::Model& m,
                                    const std::string& name) {
  GgufBuilder b;
  add_llama(b, m, name);
  const auto bytes = b.build();
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return path;
}

}  // namespace sf::testing
