#include "worker/model/sparse_config.h"

#include <boost/json.hpp>
#include <cmath>
#include <filesystem>

#include "common/file_io.h"

namespace sf::model {
namespace json = boost::json;
using kernels::HeadPattern;
using kernels::Pattern;

namespace {

HeadPattern defaults_for(Pattern p) {
  HeadPattern h;
  h.pattern = p;
  return h;  // HeadPattern's member defaults are the seeds' (MInference vertical 1000 / slash 6096)
}

Status field_err(int l, int h, const std::string& field, const std::string& what) {
  return SF_ERR(kInvalidArgument, "sparse config: layer " + std::to_string(l) + " head " + std::to_string(h) +
                                      ": field '" + field + "' " + what);
}

}  // namespace

Result<SparseConfig> sparse_config_for_mode(const std::string& mode, int n_layers, int n_heads) {
  if (mode.rfind("config:", 0) == 0) return sparse_config_load(mode.substr(7), n_layers, n_heads);
  Pattern p;
  if (mode == "adaptive") {
    p = Pattern::kAdaptiveVS;
  } else {
    auto r = kernels::pattern_from_string(mode);
    if (!r.is_ok())
      return SF_ERR(kInvalidArgument, "unknown attention mode '" + mode +
                                          "' (dense, a-shape, vertical-slash, block-sparse, moa, adaptive, "
                                          "adaptive-block, config:FILE)");
    p = r.value();
  }
  SparseConfig c;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.source = "mode:" + mode;
  c.layers.assign(size_t(n_layers), std::vector<HeadPattern>(size_t(n_heads), defaults_for(p)));
  return c;
}

bool sparse_config_is_dense(const SparseConfig& c) {
  for (const auto& l : c.layers)
    for (const auto& h : l)
      if (h.pattern != Pattern::kDense) return false;
  return true;
}

Result<SparseConfig> sparse_config_parse(const std::string& text, int n_layers, int n_heads, const std::string& origin) {
  boost::system::error_code ec;
  json::parse_options po;
  po.max_depth = 16;
  json::value v = json::parse(text, ec, {}, po);
  if (ec) return SF_ERR(kInvalidArgument, "sparse config '" + origin + "': invalid JSON: " + ec.message());
  if (!v.is_object()) return SF_ERR(kInvalidArgument, "sparse config '" + origin + "': top level must be an object");
  const json::object& o = v.as_object();
  SparseConfig c;
  c.source = origin;
  auto get_int = [&](const json::object& ob, const char* k, int64_t* out) -> bool {
    const json::value* x = ob.if_contains(k);
    if (!x) return false;
    if (x->is_int64()) { *out = x->as_int64(); return true; }
    if (x->is_uint64()) { *out = int64_t(x->as_uint64()); return true; }
    // Bounded first: converting a double past int64 (1e19) is undefined.
    if (x->is_double() && std::floor(x->as_double()) == x->as_double() &&
        std::fabs(x->as_double()) < 4.6e18) {
      *out = int64_t(x->as_double());
      return true;
    }
    *out = INT64_MIN;  // wrong type: reported by caller
    return true;
  };
  auto get_num = [&](const json::object& ob, const char* k, double* out) -> int {
    const json::value* x = ob.if_contains(k);
    if (!x) return 0;
    if (x->is_number()) { *out = x->to_number<double>(); return 1; }
    return -1;
  };
  if (const json::value* m = o.if_contains("model"); m && m->is_string()) c.model = std::string(m->as_string());
  int64_t nl = -1, nh = -1;
  get_int(o, "n_layers", &nl);
  get_int(o, "n_heads", &nh);
  if (nl != n_layers || nh != n_heads)
    return SF_ERR(kInvalidArgument, "sparse config '" + origin + "': it is for " + std::to_string(nl) + " layers x " +
                                        std::to_string(nh) + " heads, the model has " + std::to_string(n_layers) +
                                        " x " + std::to_string(n_heads));
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  int64_t db = c.dense_below;
  if (get_int(o, "dense_below", &db)) {
    if (db < 0) return SF_ERR(kInvalidArgument, "sparse config '" + origin + "': field 'dense_below' must be >= 0");
    c.dense_below = db;
  }
  double td = 0;
  if (get_num(o, "target_density", &td) == 1) c.target_density = td;
  const json::value* layers = o.if_contains("layers");
  if (!layers || !layers->is_array() || int64_t(layers->as_array().size()) != n_layers)
    return SF_ERR(kInvalidArgument, "sparse config '" + origin + "': field 'layers' must be an array of " +
                                        std::to_string(n_layers) + " layers");
  c.layers.resize(size_t(n_layers));
  for (int l = 0; l < n_layers; ++l) {
    const json::value& lv = layers->as_array()[size_t(l)];
    if (!lv.is_array() || int64_t(lv.as_array().size()) != n_heads)
      return SF_ERR(kInvalidArgument, "sparse config '" + origin + "': layer " + std::to_string(l) + " must list " +
                                          std::to_string(n_heads) + " heads");
    for (int h = 0; h < n_heads; ++h) {
      const json::value& hv = lv.as_array()[size_t(h)];
      if (!hv.is_object()) return field_err(l, h, "(head)", "must be an object");
      const json::object& ho = hv.as_object();
      const json::value* pv = ho.if_contains("pattern");
      if (!pv || !pv->is_string()) return field_err(l, h, "pattern", "is missing or not a string");
      auto pr = kernels::pattern_from_string(std::string(pv->as_string()));
      if (!pr.is_ok()) return field_err(l, h, "pattern", "has unknown value '" + std::string(pv->as_string()) + "'");
      HeadPattern hp = defaults_for(pr.value());
      // Absent means 0 here, not HeadPattern's 32: configs written before that default changed
      // omit the field and must keep selecting what they selected (the writer always writes it).
      hp.tail_block_min = 0;
      struct IntField { const char* name; int64_t* dst; };
      for (IntField f : {IntField{"sink", &hp.sink},
                         {"local", &hp.local},
                         {"n_vertical", &hp.n_vertical},
                         {"n_slash", &hp.n_slash},
                         {"n_blocks", &hp.n_blocks},
                         {"min_budget", &hp.min_budget},
                         {"max_budget", &hp.max_budget},
                         {"spread_rows", &hp.spread_rows},
                         {"segment_rows", &hp.segment_rows},
                         {"last_block_rows", &hp.last_block_rows},
                         {"share_group", &hp.share_group},
                         {"tail_block_min", &hp.tail_block_min},
                         {"vs_cover", &hp.vs_cover}}) {
        int64_t x = 0;
        if (!get_int(ho, f.name, &x)) continue;
        if (x == INT64_MIN) return field_err(l, h, f.name, "must be an integer");
        if (x < 0) return field_err(l, h, f.name, "must be >= 0 (got " + std::to_string(x) + ")");
        *f.dst = x;
      }
      struct NumField { const char* name; double* dst; };
      for (NumField f : {NumField{"alpha", &hp.alpha}, {"beta", &hp.beta}, {"gamma", &hp.gamma}, {"score", &hp.score}}) {
        const int r = get_num(ho, f.name, f.dst);
        if (r < 0) return field_err(l, h, f.name, "must be a number");
      }
      if (hp.alpha < 0 || hp.beta < 0) return field_err(l, h, hp.alpha < 0 ? "alpha" : "beta", "must be >= 0");
      if (!(hp.gamma > 0 && hp.gamma <= 1)) return field_err(l, h, "gamma", "must be in (0, 1]");
      if (hp.min_budget > hp.max_budget) return field_err(l, h, "min_budget", "exceeds max_budget");
      if (hp.segment_rows % kernels::kSparseBlock != 0)
        return field_err(l, h, "segment_rows", "must be a multiple of 64 (got " + std::to_string(hp.segment_rows) + ")");
      if (hp.last_block_rows > 1) return field_err(l, h, "last_block_rows", "must be 0 or 1");
      if (hp.last_block_rows != 0 && hp.pattern != Pattern::kAdaptiveBlock)
        return field_err(l, h, "last_block_rows", "applies to adaptive-block only");
      if (hp.share_group > 1) return field_err(l, h, "share_group", "must be 0 or 1");
      if (hp.tail_block_min >= kernels::kSparseBlock)
        return field_err(l, h, "tail_block_min", "must be in [0, 63]");
      if (hp.vs_cover > 1) return field_err(l, h, "vs_cover", "must be 0 or 1");
      if (hp.vs_cover != 0 && hp.pattern != Pattern::kAdaptiveVS)
        return field_err(l, h, "vs_cover", "applies to adaptive-vs only");
      // Everything the estimator checks at its first call, so a file it would refuse fails here,
      // not at the first layer of a prefill.
      if (Status st = kernels::check_pattern(hp, size_t(h)); !st.is_ok())
        return SF_ERR(kInvalidArgument, "sparse config '" + origin + "': layer " + std::to_string(l) +
                                            ": " + st.message());
      c.layers[size_t(l)].push_back(hp);
    }
  }
  return c;
}

Result<SparseConfig> sparse_config_load(const std::string& path, int n_layers, int n_heads) {
  SF_ASSIGN(const std::string text, read_file(path, "sparse config"));
  return sparse_config_parse(text, n_layers, n_heads, path);
}

Status sparse_config_save(const SparseConfig& c, const std::string& path) {
  json::object o;
  o["format"] = "sparsefill-pattern-config";
  o["model"] = c.model;
  o["n_layers"] = c.n_layers;
  o["n_heads"] = c.n_heads;
  o["dense_below"] = c.dense_below;
  o["target_density"] = c.target_density;
  json::array layers;
  for (const auto& l : c.layers) {
    json::array heads;
    for (const auto& h : l) {
      json::object ho;
      ho["pattern"] = kernels::pattern_name(h.pattern);
      ho["sink"] = h.sink;
      ho["local"] = h.local;
      switch (h.pattern) {
        case Pattern::kVerticalSlash: ho["n_vertical"] = h.n_vertical; ho["n_slash"] = h.n_slash; break;
        case Pattern::kBlockSparse: ho["n_blocks"] = h.n_blocks; break;
        case Pattern::kMoA: ho["alpha"] = h.alpha; ho["beta"] = h.beta; break;
        case Pattern::kAdaptiveVS: case Pattern::kAdaptiveBlock:
          ho["gamma"] = h.gamma; ho["min_budget"] = h.min_budget; ho["max_budget"] = h.max_budget; break;
        default: break;
      }
      if (h.spread_rows != 0) ho["spread_rows"] = h.spread_rows;
      if (h.segment_rows != 0) ho["segment_rows"] = h.segment_rows;
      if (h.last_block_rows != 0) ho["last_block_rows"] = h.last_block_rows;
      if (h.share_group != 0) ho["share_group"] = h.share_group;
      ho["tail_block_min"] = h.tail_block_min;
      if (h.vs_cover != 0) ho["vs_cover"] = h.vs_cover;
      ho["score"] = h.score;
      heads.push_back(std::move(ho));
    }
    layers.push_back(std::move(heads));
  }
  o["layers"] = std::move(layers);
  return write_file_atomic(path, json::serialize(o) + "\n");
}

}  // namespace sf::model
