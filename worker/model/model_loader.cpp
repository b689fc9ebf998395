// Loading weights from GGUF or Hugging Face safetensors into fp32 OwnedTensors.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include "common/log.h"
#include "common/safetensors.h"
#include "common/thread_pool.h"
#include "worker/model/gguf.h"
#include "worker/model/hf_config.h"
#include "worker/model/model.h"

namespace sf::model {

TensorView OwnedTensor::view() const {
  TensorView v;
  v.data = const_cast<float*>(data.data());
  v.dtype = DType::kF32;
  v.ndim = int(shape.size());
  int64_t s = 1;
  for (int k = v.ndim - 1; k >= 0; --k) {
    v.shape[size_t(k)] = shape[size_t(k)];
    v.stride[size_t(k)] = s;
    s *= shape[size_t(k)];
  }
  return v;
}

namespace {

std::string key(const std::string& arch, const char* suffix) { return arch + "." + suffix; }

Result<ModelConfig> config_from_gguf(const GgufFile& g) {
  ModelConfig c;
  SF_ASSIGN(std::string arch, g.get_string("general.architecture"));
  if (arch != "llama" && arch != "mistral" && arch != "qwen2")
    return SF_ERR(kUnsupported, "unknown architecture '" + arch + "' (supported: llama, mistral, qwen2)");
  SF_ASSIGN(c.arch, arch_from_string(arch));
  if (auto n = g.get_string("general.name"); n.is_ok()) c.name = n.value();
  SF_ASSIGN(int64_t layers, g.get_int(key(arch, "block_count")));
  SF_ASSIGN(int64_t hidden, g.get_int(key(arch, "embedding_length")));
  SF_ASSIGN(int64_t heads, g.get_int(key(arch, "attention.head_count")));
  SF_ASSIGN(int64_t ffn, g.get_int(key(arch, "feed_forward_length")));
  int64_t kv_heads = heads;
  if (auto r = g.get_int(key(arch, "attention.head_count_kv")); r.is_ok()) kv_heads = r.value();
  int64_t ctx = 2048;
  if (auto r = g.get_int(key(arch, "context_length")); r.is_ok()) ctx = r.value();
  if (auto r = g.get_float(key(arch, "rope.freq_base")); r.is_ok()) c.rope.theta = float(r.value());
  if (auto r = g.get_float(key(arch, "attention.layer_norm_rms_epsilon")); r.is_ok()) c.rms_eps = float(r.value());
  // Range-check before narrowing so a hostile header can't wrap these into small positives.
  auto fits = [](int64_t v) { return v > 0 && v < (1 << 24); };
  if (!fits(layers) || !fits(hidden) || !fits(heads) || !fits(kv_heads) || !fits(ffn) || !fits(ctx))
    return SF_ERR(kCorrupt, "gguf: model dimensions out of range");
  c.n_layers = int(layers);
  c.hidden = int(hidden);
  c.n_heads = int(heads);
  c.n_kv_heads = int(kv_heads);
  c.intermediate = int(ffn);
  c.max_context = int(ctx);
  c.head_dim = c.n_heads > 0 ? c.hidden / c.n_heads : 0;
  if (auto r = g.get_int(key(arch, "attention.key_length")); r.is_ok() && fits(r.value())) c.head_dim = int(r.value());
  const GgufTensorInfo* emb = g.find_tensor("token_embd.weight");
  if (!emb || emb->dims.size() != 2) return SF_ERR(kCorrupt, "gguf: tensor 'token_embd.weight' missing or not 2-D");
  c.vocab = int(emb->dims[1]);
  c.tied_embeddings = g.find_tensor("output.weight") == nullptr;
  c.qkv_bias = g.find_tensor("blk.0.attn_q.bias") != nullptr;
  // llama.cpp permutes Q/K rows of llama/mistral for adjacent-pair rotation; qwen2 keeps halves.
  c.rope.neox = c.arch == Arch::kQwen2;
  if (auto r = g.get_int(key(arch, "rope.dimension_count")); r.is_ok() && r.value() != c.head_dim) {
    // Checked before narrowing: 2^32 + 64 must not become a partial rotation of 64 (validate()
    // then checks it against head_dim).
    if (r.value() != 0 && !fits(r.value()))  // (0: the whole head, as before)
      return SF_ERR(kCorrupt, "gguf: rope.dimension_count " + std::to_string(r.value()) + " out of range");
    c.rope.rot_dim = int(r.value());
  }
  // The forward applies one RoPE scaling, Llama-3's (its rope_freqs.weight tensor, which the
  // loader reads). A linearly scaled or YaRN model would rotate with unscaled frequencies,
  // silently wrong past its original context, so it is refused, as the HF path refuses it.
  std::string scaling = "none";
  double factor = 1.0;
  if (auto r = g.get_string(key(arch, "rope.scaling.type")); r.is_ok()) scaling = r.value();
  if (auto r = g.get_float(key(arch, "rope.scaling.factor")); r.is_ok()) factor = r.value();
  if (auto r = g.get_float(key(arch, "rope.scale_linear")); r.is_ok() && r.value() != 1.0) {
    scaling = "linear";
    factor = r.value();
  }
  if (scaling != "none" && factor != 1.0 && factor != 0.0)
    return SF_ERR(kUnsupported, "gguf: RoPE scaling '" + scaling + "' (factor " +
                                    std::to_string(factor) +
                                    ") is not supported (only Llama-3's rope_freqs)");
  if (c.name.empty()) c.name = arch;
  SF_TRY(c.validate());
  return c;
}

// Dequantizes a GGUF tensor into fp32 with the expected row-major shape (ggml dims reversed).
Status gguf_tensor(const GgufFile& g, const std::string& name, std::vector<int64_t> shape, OwnedTensor* out,
                   bool optional = false) {
  const GgufTensorInfo* t = g.find_tensor(name);
  if (!t) {
    if (optional) return Status::ok();
    return SF_ERR(kCorrupt, "gguf: tensor '" + name + "' missing");
  }
  std::vector<int64_t> got(t->dims.rbegin(), t->dims.rend());
  if (got != shape) {
    std::string gs, ws;
    for (auto d : got) gs += std::to_string(d) + ",";
    for (auto d : shape) ws += std::to_string(d) + ",";
    return SF_ERR(kCorrupt, "gguf: tensor '" + name + "' has shape [" + gs + "] but the config implies [" + ws + "]");
  }
  if (ggml_row_bytes(t->type, t->dims[0]) == 0)
    return SF_ERR(kUnsupported, "gguf: tensor '" + name + "' has unsupported type " + ggml_type_name(t->type));
  out->shape = shape;
  out->data.resize(size_t(t->numel()));
  const uint64_t row = t->dims[0];
  const uint64_t rows = t->numel() / row;
  const uint64_t rb = ggml_row_bytes(t->type, row);
  Status first_err;
  parallel_for(size_t(rows), [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      Status st = dequantize_row(t->type, t->data + r * rb, row, out->data.data() + r * row);
      if (!st.is_ok()) first_err = st;  // unreachable for checked types; kept for safety
    }
  }, 64);
  return first_err;
}

}  // namespace

Status load_gguf(const std::string& path, Model* m) {
  SF_ASSIGN(GgufFile g, GgufFile::open(path));
  SF_ASSIGN(m->cfg_, config_from_gguf(g));
  const ModelConfig& c = m->cfg_;
  const int64_t H = c.hidden, qd = int64_t(c.n_heads) * c.head_dim, kvd = int64_t(c.n_kv_heads) * c.head_dim;
  ModelWeights& w = m->w_;
  SF_TRY(gguf_tensor(g, "token_embd.weight", {c.vocab, H}, &w.tok_embd));
  SF_TRY(gguf_tensor(g, "output_norm.weight", {H}, &w.out_norm));
  SF_TRY(gguf_tensor(g, "output.weight", {c.vocab, H}, &w.lm_head, /*optional=*/true));
  // One divisor per rotated pair: rot_dim / 2 (llama.cpp writes n_rot / 2), the whole head's
  // half when every channel rotates.
  SF_TRY(gguf_tensor(g, "rope_freqs.weight", {(c.rope.rot_dim > 0 ? c.rope.rot_dim : c.head_dim) / 2},
                     &w.rope_freqs, true));
  w.layers.resize(size_t(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights& L = w.layers[size_t(l)];
    SF_TRY(gguf_tensor(g, p + "attn_norm.weight", {H}, &L.attn_norm));
    SF_TRY(gguf_tensor(g, p + "attn_q.weight", {qd, H}, &L.wq));
    SF_TRY(gguf_tensor(g, p + "attn_k.weight", {kvd, H}, &L.wk));
    SF_TRY(gguf_tensor(g, p + "attn_v.weight", {kvd, H}, &L.wv));
    SF_TRY(gguf_tensor(g, p + "attn_output.weight", {H, qd}, &L.wo));
    if (c.qkv_bias) {
      SF_TRY(gguf_tensor(g, p + "attn_q.bias", {qd}, &L.bq));
      SF_TRY(gguf_tensor(g, p + "attn_k.bias", {kvd}, &L.bk));
      SF_TRY(gguf_tensor(g, p + "attn_v.bias", {kvd}, &L.bv));
    }
    SF_TRY(gguf_tensor(g, p + "ffn_norm.weight", {H}, &L.ffn_norm));
    SF_TRY(gguf_tensor(g, p + "ffn_gate.weight", {c.intermediate, H}, &L.w_gate));
    SF_TRY(gguf_tensor(g, p + "ffn_up.weight", {c.intermediate, H}, &L.w_up));
    SF_TRY(gguf_tensor(g, p + "ffn_down.weight", {H, c.intermediate}, &L.w_down));
    // Biases the forward does not apply (a Llama with attention_bias or mlp_bias converted by
    // llama.cpp keeps them as optional tensors): refused, as the HF path refuses those configs,
    // rather than dropped into wrong logits. Q/K/V biases are all or none across layers.
    for (const char* b : {"attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"})
      if (g.find_tensor(p + b))
        return SF_ERR(kUnsupported, "gguf: tensor '" + p + b +
                                        "' is a bias the forward does not apply (only Q/K/V "
                                        "biases are supported)");
    if (!c.qkv_bias && g.find_tensor(p + "attn_q.bias"))
      return SF_ERR(kCorrupt, "gguf: tensor '" + p + "attn_q.bias' present, but layer 0 has none");
  }
  m->format_ = ModelFormat::kGguf;
  return Status::ok();
}

namespace {

Status st_tensor(const std::vector<SafetensorsFile>& files, const std::string& name, std::vector<int64_t> shape,
                 OwnedTensor* out, bool optional = false) {
  for (const auto& f : files) {
    const SafetensorsTensor* t = f.find(name);
    if (!t) continue;
    if (t->shape != shape) return SF_ERR(kCorrupt, "safetensors: tensor '" + name + "' shape does not match config");
    int64_t n = 1;
    for (auto d : shape) n *= d;
    out->shape = shape;
    out->data.resize(size_t(n));
    const uint8_t* src = t->data;
    if (t->dtype == "F32") {
      std::memcpy(out->data.data(), src, size_t(n) * 4);
    } else if (t->dtype == "F16" || t->dtype == "BF16") {
      const bool bf = t->dtype == "BF16";
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out->data[size_t(i)] = bf ? bf16_to_f32(h) : f16_to_f32(h);
      }
    } else {
      return SF_ERR(kUnsupported, "safetensors: tensor '" + name + "' dtype " + t->dtype + " (F32/F16/BF16 supported)");
    }
    return Status::ok();
  }
  if (optional) return Status::ok();
  return SF_ERR(kCorrupt, "safetensors: tensor '" + name + "' missing");
}

}  // namespace

Status load_safetensors(const std::string& dir, Model* m) {
  SF_ASSIGN(m->cfg_, config_from_hf_dir(dir));
  SF_ASSIGN(std::vector<std::string> shard_paths, hf_shard_files(dir));
  std::vector<SafetensorsFile> files;
  for (const auto& p : shard_paths) {
    SF_ASSIGN(SafetensorsFile f, SafetensorsFile::open(p));
    files.push_back(std::move(f));
  }
  const ModelConfig& c = m->cfg_;
  const int64_t H = c.hidden, qd = int64_t(c.n_heads) * c.head_dim, kvd = int64_t(c.n_kv_heads) * c.head_dim;
  ModelWeights& w = m->w_;
  SF_TRY(st_tensor(files, "model.embed_tokens.weight", {c.vocab, H}, &w.tok_embd));
  SF_TRY(st_tensor(files, "model.norm.weight", {H}, &w.out_norm));
  if (!c.tied_embeddings) SF_TRY(st_tensor(files, "lm_head.weight", {c.vocab, H}, &w.lm_head));
  w.layers.resize(size_t(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& L = w.layers[size_t(l)];
    SF_TRY(st_tensor(files, p + "input_layernorm.weight", {H}, &L.attn_norm));
    SF_TRY(st_tensor(files, p + "self_attn.q_proj.weight", {qd, H}, &L.wq));
    SF_TRY(st_tensor(files, p + "self_attn.k_proj.weight", {kvd, H}, &L.wk));
    SF_TRY(st_tensor(files, p + "self_attn.v_proj.weight", {kvd, H}, &L.wv));
    SF_TRY(st_tensor(files, p + "self_attn.o_proj.weight", {H, qd}, &L.wo));
    if (c.qkv_bias) {
      SF_TRY(st_tensor(files, p + "self_attn.q_proj.bias", {qd}, &L.bq));
      SF_TRY(st_tensor(files, p + "self_attn.k_proj.bias", {kvd}, &L.bk));
      SF_TRY(st_tensor(files, p + "self_attn.v_proj.bias", {kvd}, &L.bv));
    }
    SF_TRY(st_tensor(files, p + "post_attention_layernorm.weight", {H}, &L.ffn_norm));
    SF_TRY(st_tensor(files, p + "mlp.gate_proj.weight", {c.intermediate, H}, &L.w_gate));
    SF_TRY(st_tensor(files, p + "mlp.up_proj.weight", {c.intermediate, H}, &L.w_up));
    SF_TRY(st_tensor(files, p + "mlp.down_proj.weight", {H, c.intermediate}, &L.w_down));
  }
  m->format_ = ModelFormat::kSafetensors;
  return Status::ok();
}

Result<Model> Model::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) return SF_ERR(kNotFound, "model '" + path + "' does not exist");
  Model m;
  m.path_ = path;
  if (fs::is_directory(path, ec)) {
    SF_TRY(load_safetensors(path, &m));
  } else {
    SF_TRY(load_gguf(path, &m));
  }
  SF_LOG(kInfo, "model", "loaded " << m.cfg_.name << " (" << arch_name(m.cfg_.arch) << ", " << m.cfg_.n_layers
                                   << " layers, hidden " << m.cfg_.hidden << ", " << m.cfg_.n_heads << "/"
                                   << m.cfg_.n_kv_heads << " heads)");
  return m;
}

Result<Model> Model::shape_only(const ModelConfig& cfg, std::string path) {
  SF_TRY(cfg.validate());
  Model m;
  m.cfg_ = cfg;
  m.path_ = std::move(path);
  return m;
}

Result<Model> Model::synthetic(const ModelConfig& cfg, uint64_t seed) {
  SF_TRY(cfg.validate());
  Model m;
  m.cfg_ = cfg;
  m.path_ = "synthetic:" + std::to_string(seed);
  std::mt19937_64 rng(seed);
  // Scaled so activations stay O(1) through depth: std 1/sqrt(fan_in).
  auto fill = [&](OwnedTensor* t, std::vector<int64_t> shape, float stdv, float mean = 0.f) {
    t->shape = shape;
    int64_t n = 1;
    for (auto d : shape) n *= d;
    t->data.resize(size_t(n));
    std::normal_distribution<float> nd(mean, stdv);
    for (auto& x : t->data) x = nd(rng);
  };
  const int64_t H = cfg.hidden, qd = int64_t(cfg.n_heads) * cfg.head_dim, kvd = int64_t(cfg.n_kv_heads) * cfg.head_dim;
  fill(&m.w_.tok_embd, {cfg.vocab, H}, 1.f);
  fill(&m.w_.out_norm, {H}, 0.1f, 1.f);
  if (!cfg.tied_embeddings) fill(&m.w_.lm_head, {cfg.vocab, H}, 1.f / std::sqrt(float(H)));
  m.w_.layers.resize(size_t(cfg.n_layers));
  for (auto& L : m.w_.layers) {
    fill(&L.attn_norm, {H}, 0.1f, 1.f);
    fill(&L.wq, {qd, H}, 1.f / std::sqrt(float(H)));
    fill(&L.wk, {kvd, H}, 1.f / std::sqrt(float(H)));
    fill(&L.wv, {kvd, H}, 1.f / std::sqrt(float(H)));
    fill(&L.wo, {H, qd}, 1.f / std::sqrt(float(qd)));
    if (cfg.qkv_bias) {
      fill(&L.bq, {qd}, 0.1f);
      fill(&L.bk, {kvd}, 0.1f);
      fill(&L.bv, {kvd}, 0.1f);
    }
    fill(&L.ffn_norm, {H}, 0.1f, 1.f);
    fill(&L.w_gate, {cfg.intermediate, H}, 1.f / std::sqrt(float(H)));
    fill(&L.w_up, {cfg.intermediate, H}, 1.f / std::sqrt(float(H)));
    fill(&L.w_down, {H, cfg.intermediate}, 1.f / std::sqrt(float(cfg.intermediate)));
  }
  return m;
}

std::string resolve_model_path(const std::string& m, const std::string& source_dir) {
  if (m != "default") return m;
  if (const char* e = std::getenv("SF_MODEL"); e && *e) return e;  // empty: unset
  return source_dir + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace sf::model
