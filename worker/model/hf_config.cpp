#include "worker/model/hf_config.h"

#include <algorithm>
#include <boost/json.hpp>
#include <climits>
#include <cmath>
#include <filesystem>
#include <optional>
#include <set>

#include "common/mapped_file.h"

namespace sf::model {
namespace {

namespace json = boost::json;

// config.json is a few KB and an index a few MB even for the largest checkpoints.
constexpr size_t kMaxJsonBytes = 64u << 20;

const char* kind_name(const json::value& v) {
  switch (v.kind()) {
    case json::kind::null:
      return "null";
    case json::kind::bool_:
      return "a boolean";
    case json::kind::int64:
    case json::kind::uint64:
      return "an integer";
    case json::kind::double_:
      return "a float";
    case json::kind::string:
      return "a string";
    case json::kind::array:
      return "an array";
    case json::kind::object:
      return "an object";
  }
  return "?";
}

Result<json::value> parse_json(std::string_view text, const std::string& where) {
  SF_ENSURE(text.size() <= kMaxJsonBytes, kInvalidArgument,
            where + ": " + std::to_string(text.size()) + " bytes exceeds the 64 MB limit");
  try {
    boost::system::error_code ec;
    json::parse_options opt;
    opt.max_depth = 16;
    json::value v = json::parse(json::string_view(text.data(), text.size()), ec, {}, opt);
    if (ec) return SF_ERR(kCorrupt, where + ": not valid JSON: " + ec.message());
    if (!v.is_object()) return SF_ERR(kCorrupt, where + ": top level is not a JSON object");
    return v;
  } catch (const std::exception& e) {
    return SF_ERR(kResourceExhausted, where + ": parsing failed: " + e.what());
  }
}

// Typed field access on one JSON object; every message names the file and the field. A JSON null
// counts as absent (HF writes null for "use the default").
class Fields {
 public:
  Fields(const json::object& o, std::string where) : o_(o), where_(std::move(where)) {}

  const json::value* get(std::string_view key) const {
    const json::value* v = o_.if_contains(json::string_view(key.data(), key.size()));
    return (v && !v->is_null()) ? v : nullptr;
  }
  Status missing(std::string_view key) const {
    return SF_ERR(kCorrupt, where_ + ": missing field '" + std::string(key) + "'");
  }
  Status wrong(std::string_view key, const json::value& v, const char* want) const {
    return SF_ERR(kCorrupt, where_ + ": field '" + std::string(key) + "' must be " + want +
                                ", got " + kind_name(v));
  }

  // A positive integer that fits int. Integral floats ("4096.0") are accepted.
  Result<int> positive_int(std::string_view key, std::optional<int> dflt = std::nullopt) const {
    const json::value* v = get(key);
    if (!v) {
      if (dflt) return *dflt;
      return missing(key);
    }
    int64_t n = 0;
    if (v->is_int64()) {
      n = v->get_int64();
    } else if (v->is_uint64()) {
      n = v->get_uint64() > uint64_t(INT_MAX) ? int64_t(INT_MAX) + 1 : int64_t(v->get_uint64());
    } else if (v->is_double() && std::isfinite(v->get_double()) &&
               v->get_double() == std::floor(v->get_double()) &&
               std::fabs(v->get_double()) < 1e15) {
      n = int64_t(v->get_double());
    } else {
      return wrong(key, *v, "a positive integer");
    }
    if (n <= 0 || n > INT_MAX)
      return SF_ERR(kCorrupt, where_ + ": field '" + std::string(key) +
                                  "' must be a positive integer below 2^31, got " +
                                  std::to_string(n));
    return int(n);
  }
  Result<double> number(std::string_view key, std::optional<double> dflt = std::nullopt) const {
    const json::value* v = get(key);
    if (!v) {
      if (dflt) return *dflt;
      return missing(key);
    }
    double d = 0;
    if (v->is_double())
      d = v->get_double();
    else if (v->is_int64())
      d = double(v->get_int64());
    else if (v->is_uint64())
      d = double(v->get_uint64());
    else
      return wrong(key, *v, "a number");
    if (!std::isfinite(d)) return wrong(key, *v, "a finite number");
    return d;
  }
  Result<bool> boolean(std::string_view key, bool dflt) const {
    const json::value* v = get(key);
    if (!v) return dflt;
    if (!v->is_bool()) return wrong(key, *v, "a boolean");
    return v->get_bool();
  }
  Result<std::string> string(std::string_view key,
                             std::optional<std::string> dflt = std::nullopt) const {
    const json::value* v = get(key);
    if (!v) {
      if (dflt) return *dflt;
      return missing(key);
    }
    if (!v->is_string()) return wrong(key, *v, "a string");
    return std::string(v->get_string().data(), v->get_string().size());
  }
  const std::string& where() const { return where_; }

 private:
  const json::object& o_;
  std::string where_;
};

Status unsupported(const std::string& where, const std::string& what) {
  return SF_ERR(kUnsupported, where + ": " + what);
}

Status read_rope_scaling(const Fields& f, const json::value& v, ModelConfig* c) {
  const std::string where = f.where() + ": rope_scaling";
  if (!v.is_object()) return f.wrong("rope_scaling", v, "an object or null");
  const Fields rs(v.get_object(), where);
  // transformers accepts the older key "type" for "rope_type".
  std::string type;
  if (rs.get("rope_type")) {
    SF_ASSIGN(type, rs.string("rope_type"));
  } else if (rs.get("type")) {
    SF_ASSIGN(type, rs.string("type"));
  } else {
    return rs.missing("rope_type");
  }
  if (type == "default") return Status::ok();
  if (type != "llama3")
    return unsupported(where, "rope_type '" + type + "' is not supported (only 'llama3')");
  SF_ASSIGN(double factor, rs.number("factor"));
  SF_ASSIGN(double low, rs.number("low_freq_factor"));
  SF_ASSIGN(double high, rs.number("high_freq_factor"));
  SF_ASSIGN(int orig, rs.positive_int("original_max_position_embeddings"));
  SF_ENSURE(factor > 0, kCorrupt, where + ": factor must be positive");
  SF_ENSURE(low > 0, kCorrupt, where + ": low_freq_factor must be positive");
  SF_ENSURE(high > low, kCorrupt, where + ": high_freq_factor must exceed low_freq_factor");
  c->rope.scaling_factor = float(factor);
  c->rope.low_freq_factor = float(low);
  c->rope.high_freq_factor = float(high);
  c->rope.original_max_pos = orig;
  return Status::ok();
}

Result<std::string> read_text(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    return SF_ERR(kNotFound, what + " '" + path + "' not found");
  SF_ASSIGN(MappedFile m, MappedFile::open(path));
  SF_ENSURE(m.bytes().size <= kMaxJsonBytes, kInvalidArgument,
            what + " '" + path + "' exceeds the 64 MB limit");
  return std::string(reinterpret_cast<const char*>(m.bytes().data), m.bytes().size);
}

}  // namespace

Result<ModelConfig> config_from_hf_json(std::string_view json_text, const std::string& name) {
  const std::string where = "config.json '" + name + "'";
  SF_ASSIGN(json::value root, parse_json(json_text, where));
  const Fields f(root.get_object(), where);
  ModelConfig c;
  c.name = name;

  // The class name in "architectures" decides; "model_type" is the fallback.
  std::string arch;
  if (const json::value* a = f.get("architectures")) {
    if (!a->is_array() || a->get_array().empty() || !a->get_array()[0].is_string())
      return f.wrong("architectures", *a, "a non-empty array of strings");
    arch = std::string(a->get_array()[0].get_string());
  } else if (f.get("model_type")) {
    SF_ASSIGN(arch, f.string("model_type"));
  } else {
    return f.missing("architectures");
  }
  Result<Arch> ar = arch_from_string(arch);
  if (!ar.is_ok()) return SF_ERR(kUnsupported, where + ": " + ar.status().message());
  c.arch = *ar;

  if (f.get("quantization_config"))
    return unsupported(where, "quantized checkpoints (quantization_config) are not supported");
  SF_ASSIGN(std::string act, f.string("hidden_act", "silu"));
  if (act != "silu")
    return unsupported(where, "hidden_act '" + act + "' is not supported (only 'silu')");

  SF_ASSIGN(c.hidden, f.positive_int("hidden_size"));
  SF_ASSIGN(c.intermediate, f.positive_int("intermediate_size"));
  SF_ASSIGN(c.n_layers, f.positive_int("num_hidden_layers"));
  SF_ASSIGN(c.n_heads, f.positive_int("num_attention_heads"));
  SF_ASSIGN(c.n_kv_heads, f.positive_int("num_key_value_heads", c.n_heads));
  SF_ASSIGN(c.vocab, f.positive_int("vocab_size"));
  SF_ASSIGN(c.max_context, f.positive_int("max_position_embeddings"));
  if (f.get("head_dim")) {
    SF_ASSIGN(c.head_dim, f.positive_int("head_dim"));
  } else {
    SF_ENSURE(c.hidden % c.n_heads == 0, kCorrupt,
              where + ": hidden_size (" + std::to_string(c.hidden) +
                  ") is not divisible by num_attention_heads (" + std::to_string(c.n_heads) +
                  ") and no head_dim is given");
    c.head_dim = c.hidden / c.n_heads;
  }
  SF_ENSURE(c.n_heads % c.n_kv_heads == 0, kCorrupt,
            where + ": num_key_value_heads (" + std::to_string(c.n_kv_heads) +
                ") must divide num_attention_heads (" + std::to_string(c.n_heads) + ")");
  SF_ASSIGN(double eps, f.number("rms_norm_eps", 1e-6));  // transformers' default
  SF_ENSURE(eps > 0, kCorrupt, where + ": rms_norm_eps must be positive");
  c.rms_eps = float(eps);
  SF_ASSIGN(double theta, f.number("rope_theta", 10000.0));
  SF_ENSURE(theta > 0, kCorrupt, where + ": rope_theta must be positive");
  c.rope.theta = float(theta);
  c.rope.neox = true;  // HF checkpoints keep q/k unpermuted and rotate halves
  if (const json::value* rs = f.get("rope_scaling")) SF_TRY(read_rope_scaling(f, *rs, &c));
  SF_ASSIGN(double partial, f.number("partial_rotary_factor", 1.0));
  if (partial != 1.0) return unsupported(where, "partial_rotary_factor != 1 is not supported");
  SF_ASSIGN(c.tied_embeddings, f.boolean("tie_word_embeddings", false));

  SF_ASSIGN(bool mlp_bias, f.boolean("mlp_bias", false));
  if (mlp_bias) return unsupported(where, "mlp_bias=true is not supported");
  if (c.arch == Arch::kQwen2) {
    c.qkv_bias = true;  // Qwen2 has biases on q/k/v (not on o_proj) by construction
    SF_ASSIGN(bool sw, f.boolean("use_sliding_window", false));
    if (sw) return unsupported(where, "use_sliding_window=true is not supported");
  } else {
    // Llama's attention_bias puts biases on q/k/v *and* o_proj; the forward has no o_proj bias.
    SF_ASSIGN(bool bias, f.boolean("attention_bias", false));
    if (bias) return unsupported(where, "attention_bias=true (bias on o_proj) is not supported");
  }
  if (c.arch == Arch::kMistral) {
    // transformers defaults an absent sliding_window to 4096, but released Mistral configs always
    // state it (null from v0.2 on); a stated window would be silently ignored by the forward.
    if (f.get("sliding_window")) {
      SF_ASSIGN(int w, f.positive_int("sliding_window"));
      return unsupported(where, "sliding_window=" + std::to_string(w) +
                                    " is not supported (attention would differ beyond it)");
    }
  }
  Status st = c.validate();
  if (!st.is_ok()) return SF_ERR(kCorrupt, where + ": " + st.message());
  return c;
}

Result<ModelConfig> config_from_hf_dir(const std::string& dir) {
  const std::string path = dir + "/config.json";
  SF_ASSIGN(std::string text, read_text(path, "config"));
  std::string name = std::filesystem::path(dir).lexically_normal().filename().string();
  if (name.empty())
    name = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
  if (name.empty()) name = dir;
  return config_from_hf_json(text, name);
}

Result<std::vector<std::string>> hf_shard_files(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string index = dir + "/model.safetensors.index.json";
  std::error_code ec;
  if (!fs::exists(index, ec)) {
    const std::string single = dir + "/model.safetensors";
    if (fs::is_regular_file(single, ec)) return std::vector<std::string>{single};
    return SF_ERR(kNotFound,
                  "'" + dir + "' has neither model.safetensors.index.json nor model.safetensors");
  }
  SF_ASSIGN(std::string text, read_text(index, "safetensors index"));
  const std::string where = "safetensors index '" + index + "'";
  SF_ASSIGN(json::value root, parse_json(text, where));
  const json::value* wm = root.get_object().if_contains("weight_map");
  if (!wm) return SF_ERR(kCorrupt, where + ": missing field 'weight_map'");
  if (!wm->is_object()) return SF_ERR(kCorrupt, where + ": field 'weight_map' is not an object");
  SF_ENSURE(!wm->get_object().empty(), kCorrupt, where + ": weight_map is empty");
  std::set<std::string> files;
  for (const auto& kv : wm->get_object()) {
    const std::string tensor(kv.key().data(), kv.key().size());
    if (!kv.value().is_string())
      return SF_ERR(kCorrupt, where + ": weight_map entry for '" + tensor + "' is not a string");
    const std::string file(kv.value().get_string().data(), kv.value().get_string().size());
    // Shards must sit beside the index: no directories, no way out of dir.
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
        file.find('\\') != std::string::npos || file.find('\0') != std::string::npos)
      return SF_ERR(kCorrupt, where + ": weight_map entry for '" + tensor + "' names '" + file +
                                  "', which is not a plain file name");
    files.insert(file);
  }
  std::vector<std::string> out;
  for (const std::string& f : files) {
    const std::string p = dir + "/" + f;
    if (!fs::is_regular_file(p, ec))
      return SF_ERR(kNotFound, where + ": shard '" + f + "' not found in '" + dir + "'");
    out.push_back(p);
  }
  return out;
}

}  // namespace sf::model
