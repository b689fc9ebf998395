// `sparsefill eval --retention POLICIES --budget FRACTIONS`: quality of KV retention policies and
// of PSA decode attention against the full KV cache, on the real model (issue 4, "Evaluation").
// One prefill of the document (with importance scores) is shared by every policy and budget;
// each configuration pages the retained cache (decode::PagedKvCache::from_prefill) and decodes
// on CPU with the reference decode session. Writes bench/results/retention-<policy>.json.
// moa takes per-head spans from a config (kvstore::moa_config_load) and scales them per budget.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <boost/json.hpp>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <unistd.h>

#include "common/args.h"
#include "common/file_io.h"
#include "common/timing.h"
#include "decode/decode_session.h"
#include "kvstore/kv_export.h"
#include "kvstore/kv_quant.h"
#include "kvstore/retention.h"
#include "tools/cli/cli.h"
#include "tools/eval/quality.h"
#include "worker/model/model.h"

namespace sf::cli {
namespace {

// An option's value refused by a shared parser: the error names the option given.
Status named(const char* option, const Status& st) {
  return Status(st.code(), std::string(option) + ": " + st.message());
}

// "0.25" or "25%", in (0, 1].
Result<double> parse_fraction(const std::string& s) {
  std::string v = s;
  double mul = 1;
  if (!v.empty() && v.back() == '%') {
    v.pop_back();
    mul = 0.01;
  }
  double x = 0;
  const bool number = whole_number(v, &x);
  x *= mul;
  if (!number || !(x > 0 && x <= 1))
    return SF_ERR(kOutOfRange,
                  "--budget '" + s +
                      "' out of range: a fraction of the full KV bytes in (0, 1] (or 1%-100%)");
  return x;
}

// --retention entries: a comma-separated list where moa's own "key=value" parameters
// (moa:config=FILE,sink=S) stay with it: a piece with '=' and no ':' continues the previous entry.
Result<std::vector<std::string>> split_policies(const std::string& s) {
  std::vector<std::string> out;
  SF_ASSIGN(const std::vector<std::string> items, parse_list(s, "--retention"));
  for (auto& x : items)
    if (!out.empty() && x.find('=') != std::string::npos && x.find(':') == std::string::npos)
      out.back() += "," + x;
    else
      out.push_back(x);
  return out;
}

// The spans bare `moa` uses: the shipped config of the default model.
std::string default_moa_config() {
  return std::string(SF_SOURCE_DIR) + "/configs/smollm2-135m-instruct-moa.json";
}

// A policy name, or moa's spec; *moa receives moa's spans (scaled per budget later).
Result<kvstore::RetentionKind> parse_kind(const std::string& s, kvstore::RetentionPolicy* moa) {
  using K = kvstore::RetentionKind;
  if (s == "full") return K::kFull;
  if (s == "streaming") return K::kStreaming;
  if (s == "snapkv") return K::kSnapKV;
  if (s == "adakv") return K::kAdaKV;
  if (s == "pyramid") return K::kPyramid;
  if (s == "layerwise") return K::kLayerwise;
  if (s == "moa" || s.rfind("moa:", 0) == 0) {
    auto p =
        s == "moa" ? kvstore::moa_config_load(default_moa_config()) : kvstore::retention_parse(s);
    if (!p.is_ok()) return p.status();
    *moa = std::move(p).value();
    return K::kMoA;
  }
  return SF_ERR(kInvalidArgument,
                "--retention '" + s +
                    "' is not full, streaming, snapkv, adakv, pyramid, layerwise or "
                    "moa[:config=FILE[,sink=S]]");
}

std::vector<double> log_softmax(const std::vector<float>& z) {
  const float mx = *std::max_element(z.begin(), z.end());
  double s = 0;
  for (float x : z) s += std::exp(double(x) - mx);
  const double lz = double(mx) + std::log(s);
  std::vector<double> out(z.size());
  for (size_t i = 0; i < z.size(); ++i) out[i] = double(z[i]) - lz;
  return out;
}

int32_t argmax(const std::vector<float>& z) {
  return int32_t(std::max_element(z.begin(), z.end()) - z.begin());
}

struct Config {
  kvstore::RetentionKind kind;
  double budget;
  std::string decode_spec;
  const kvstore::RetentionPolicy* moa = nullptr;  // moa: the config's spans, before scaling
  int span = 1;                                   // snapkv, adakv, pyramid: RetentionPolicy::span
  kvstore::KvEncoding enc = kvstore::KvEncoding::kF32;  // how the kept K/V are stored
  // Two tiers (--kv-dtype HIGH+LOW[:SHARE]): the low tier's encoding, and the share of the
  // budget's bytes the high tier takes (the policy's top tokens); the low tier spends the rest.
  std::optional<kvstore::KvEncoding> low = std::nullopt;
  double high_share = 0.5;
};

// "int8", or "int8+int4:0.50" for two tiers.
std::string enc_name(const Config& c) {
  if (!c.low) return kvstore::kv_encoding_name(c.enc);
  char b[32];
  std::snprintf(b, sizeof b, ":%.2f", c.high_share);
  return kvstore::kv_encodings_name({c.enc, c.low}) + b;
}

struct Measure {
  std::string params;
  kvstore::RetentionPolicy moa;  // moa: the scaled spans the document prompt used
  int64_t kv_bytes_full = 0;
  // Per window: kept K/V bytes (they round per block, and adakv / moa keep per-prompt counts, so
  // windows differ) and kept tokens / all (layer, KV head, token).
  std::vector<int64_t> kv_bytes;
  std::vector<double> kept_frac;
  std::vector<double> low_frac;  // two tiers: low-tier tokens / all (layer, KV head, token)
  std::vector<double> greedy, forced, kl;  // per window
  std::vector<int64_t> first_div;           // per window: first differing token (1-based), -1
  std::vector<double> div_gap;              // full-KV top-2 log-prob gap there, -1 if none
  int64_t blocks_visited = 0, blocks_total = 0;
  int64_t kv_blocks_loaded = 0, kv_blocks_total = 0;
  double mass_sum = 0, mass_min = 1;  // psa: captured softmax mass over (layer, head, step)
  int64_t mass_n = 0, mass_below = 0;
  // psa guard: teacher-forced steps and re-runs; the free-running run's blocks and re-runs.
  int64_t steps = 0, guard_steps = 0;
  int64_t fr_blocks_visited = 0, fr_blocks_total = 0, fr_steps = 0, fr_guard_steps = 0;
  // psa verified drafts (psa-avg:EPS:verifyN), free-running run: blocks computed, drafts run
  // and accepted, verification passes.
  int64_t fr_blocks_computed = 0, fr_draft_steps = 0, fr_draft_accepted = 0, fr_passes = 0;
  std::vector<double> fr_seconds;  // per window: the free-running generation's wall time
  int passkey_hits = 0, passkey_n = 0;
};

// The retained, paged cache of one prefill under one configuration. The budget is a fraction
// of the full cache's bytes in `ref` (the reference encoding): a narrower c.enc keeps more tokens
// for the same bytes.
Result<decode::DecodeSession> session_for(const model::Model& m, const model::PrefillResult& pr,
                                          const kvstore::ImportanceScores& imp, const Config& c,
                                          kvstore::KvEncoding ref, Measure* me,
                                          bool measure_mass = false) {
  const model::ModelConfig& mc = m.config();
  const int64_t N = pr.kv.n_tokens;
  // Bytes of every token of a head in an encoding.
  auto all_bytes = [&](kvstore::KvEncoding e) {
    return double(kvstore::kv_encoded_bytes(e, N, mc.head_dim));
  };
  const double full = all_bytes(ref) * mc.n_layers * mc.n_kv_heads;
  // The fraction of the prompt's tokens a share of the budget buys in an encoding; the total is
  // shrunk below while the kept bytes (which round per block) exceed the budget.
  auto buys = [&](kvstore::KvEncoding e, double share) {
    return share * c.budget * all_bytes(ref) / all_bytes(e);
  };
  // Two tiers: the high tier's fraction, the rest of the bytes buying low-tier tokens (the shrink
  // below trims only the low tier, so the high one keeps SHARE of the budget's bytes).
  double high = c.low ? buys(c.enc, c.high_share) : 0;
  double tokens = c.low ? high + buys(*c.low, 1 - c.high_share) : buys(c.enc, 1);
  if (c.low && tokens > 1) {
    // Every token fits with bytes to spare: they go to the high tier (the split whose bytes are
    // the budget with every token kept: high x HIGH + (1 - high) x LOW = budget; a hair under,
    // as the kept counts round per head and the key groups per 64 tokens).
    const double b_hi = all_bytes(c.enc), b_lo = all_bytes(*c.low);
    // (min/max, not std::clamp: high itself may pass 1 here, and clamp's bounds must be ordered)
    high = std::min(1.0, std::max(high, (c.budget * all_bytes(ref) - b_lo) / (b_hi - b_lo) *
                                            (1 - 5e-3)));
  }
  tokens = std::min(1.0, tokens);
  kvstore::RetentionPolicy pol;
  kvstore::Retention ret;
  for (int tries = 0;; ++tries) {
    if (c.kind == kvstore::RetentionKind::kMoA) {
      // Scaled per prompt: spans grow with N, so the same budget needs a prompt-specific factor.
      SF_ASSIGN(pol, kvstore::retention_moa_scaled(*c.moa, tokens, mc.n_layers, mc.n_kv_heads, N));
    } else if (c.kind != kvstore::RetentionKind::kFull) {
      // The kept window covers the scores' observation window (--obs-window), as SnapKV's does.
      SF_ASSIGN(pol, kvstore::retention_for_fraction(c.kind, tokens, mc.n_layers, N,
                                                     std::max<int64_t>(32, imp.window)));
      pol.span = c.span;
      if (c.low) {
        if (!kvstore::retention_uses_span(c.kind))
          return SF_ERR(kInvalidArgument, std::string("--kv-dtype with two tiers needs a scored "
                                                      "policy (snapkv, adakv, pyramid), not ") +
                                              kvstore::retention_kind_name(c.kind));
        if (pol.budget <= pol.window)
          return SF_ERR(kOutOfRange, "two tiers at budget " + std::to_string(c.budget) +
                                         ": the budget buys no tokens beyond the window");
        pol.high = std::clamp<int64_t>(std::llround(high * double(N)), pol.window, pol.budget - 1);
      }
    }
    SF_ASSIGN(ret, kvstore::retention_apply(pol, mc.n_layers, mc.n_kv_heads, N, &imp));
    const double bytes = double(kvstore::kv_bytes(ret, mc.head_dim, c.enc, c.low));
    if (c.kind == kvstore::RetentionKind::kFull || bytes <= c.budget * full) break;
    if (tries == 4) {
      std::fprintf(stderr,
                   "warning: %s at budget %.3f in %s keeps %.6f of the bytes, over the budget "
                   "by %.2g after five shrinks (rounding to whole tokens and blocks)\n",
                   kvstore::retention_kind_name(c.kind), c.budget, enc_name(c).c_str(),
                   bytes / full, bytes / full - c.budget);
      break;
    }
    tokens *= c.budget * full / bytes * (1 - 1e-4);
  }
  SF_ASSIGN(decode::DecodeAttnParams ap, decode::decode_attn_parse(c.decode_spec));
  ap.measure_mass = measure_mass;
  SF_ASSIGN(decode::PagedKvCache cache,
            decode::PagedKvCache::from_prefill(pr.kv, ret, c.enc, c.low));
  if (me) {
    me->params = ret.params;
    me->kv_bytes.push_back(kvstore::kv_bytes(ret, mc.head_dim, c.enc, c.low));
    if (ret.has_low()) {
      int64_t n_low = 0;
      for (const auto& lo : ret.low) n_low += int64_t(lo.size());
      me->low_frac.push_back(double(n_low) / (double(N) * mc.n_layers * mc.n_kv_heads));
    }
    me->kv_bytes_full = int64_t(full);
    me->kept_frac.push_back(double(ret.kept_total()) / (double(N) * mc.n_layers * mc.n_kv_heads));
    if (c.kind == kvstore::RetentionKind::kMoA) me->moa = pol;
  }
  return decode::DecodeSession(m, std::move(cache), N, ap);
}

}  // namespace

int cmd_retention_eval(int argc, char** argv) {
  auto args_r =
      parse_args(argc, argv, 2,
                 {"model", "retention", "budget", "decode", "length", "document", "tokens",
                  "passkey-trials", "passkey-depths", "passkey-level", "out-dir", "name", "psa",
                  "obs-window", "windows", "span", "kv-dtype", "kv-ref-dtype"},
                 {"no-passkey"});
  if (!args_r.is_ok()) return fail(args_r.status());
  const Args& a = args_r.value();
  if (!a.has("retention"))
    return fail(SF_ERR(kInvalidArgument, "--retention POLICY[,POLICY...] is required"));
  std::vector<kvstore::RetentionKind> kinds;
  kvstore::RetentionPolicy moa;
  auto policies = split_policies(a.get("retention"));
  if (!policies.is_ok()) return fail(policies.status());
  for (const auto& s : policies.value()) {
    auto k = parse_kind(s, &moa);
    if (!k.is_ok()) return fail(k.status());
    if (std::find(kinds.begin(), kinds.end(), k.value()) != kinds.end())
      return fail(SF_ERR(kInvalidArgument, "--retention: '" + s + "' names a policy twice"));
    kinds.push_back(k.value());
  }
  // Every list option: an empty one or an empty item is an error (not a run of nothing that
  // rewrites its results file with no records).
  std::map<std::string, std::vector<std::string>> lists;
  for (const auto& [k, def] : {std::pair<std::string, std::string>{"budget", "0.1,0.25,0.5"},
                               {"span", "1"}, {"kv-dtype", "f32"}, {"decode", "full"}, {"psa", ""}}) {
    if (k == "psa" && !a.has(k)) continue;
    auto l = parse_list(a.get(k, def), "--" + k);
    if (!l.is_ok()) return fail(l.status());
    lists[k] = std::move(l).value();
  }
  std::vector<double> budgets;
  for (const auto& s : lists["budget"]) {
    auto f = parse_fraction(s);
    if (!f.is_ok()) return fail(f.status());
    budgets.push_back(f.value());
  }
  // --span N,...: each snapkv, adakv and pyramid configuration once per span.
  std::vector<int> spans;
  for (const auto& s : lists["span"]) {
    int64_t x = 0;
    if (!whole_int(s, &x) || x < 1 || x > kvstore::kRetentionMaxSpan)
      return fail(SF_ERR(kOutOfRange, "--span '" + s + "' must be an integer in [1, " +
                                          std::to_string(kvstore::kRetentionMaxSpan) + "]"));
    spans.push_back(int(x));
  }
  // --kv-dtype ENC,...: every configuration once per encoding of the kept K/V; --kv-ref-dtype:
  // the encoding of the full cache that budgets and kv_bytes_full are measured against.
  // HIGH+LOW[:SHARE]: two tiers, the high one taking SHARE (default 0.5) of the bytes.
  struct EncChoice {
    kvstore::KvEncodings e;
    double share = 0.5;
  };
  std::vector<EncChoice> encs;
  for (const auto& s : lists["kv-dtype"]) {
    const size_t colon = s.find(':');
    auto e = kvstore::kv_encodings_parse(s.substr(0, colon));
    if (!e.is_ok()) return fail(named("--kv-dtype", e.status()));
    EncChoice ch{e.value()};
    if (colon != std::string::npos) {
      const std::string v = s.substr(colon + 1);
      if (!ch.e.low || !whole_number(v, &ch.share) || !(ch.share > 0 && ch.share < 1))
        return fail(SF_ERR(kOutOfRange, "--kv-dtype '" + s +
                                            "': SHARE is for two tiers (HIGH+LOW:SHARE), in (0, 1)"));
    }
    encs.push_back(ch);
  }
  auto ref_r = kvstore::kv_encoding_parse(a.get("kv-ref-dtype", "f32"));
  if (!ref_r.is_ok()) return fail(named("--kv-ref-dtype", ref_r.status()));
  const kvstore::KvEncoding ref_enc = ref_r.value();
  const std::vector<std::string> decodes = lists["decode"];
  // --psa EPS,...: PSA decode over the full cache, recorded with the full policy. An entry may be
  // a whole decode spec (psa-avg:EPS).
  std::vector<std::string> psa_specs;
  if (a.has("psa"))
    for (const auto& e : lists["psa"])  // EPS, or a whole spec (psa-avg:EPS)
      psa_specs.push_back(e.rfind("psa", 0) == 0 ? e : "psa:" + e);
  for (const auto& d : decodes) {
    auto p = decode::decode_attn_parse(d);
    if (!p.is_ok()) return fail(named("--decode", p.status()));
  }
  for (const auto& d : psa_specs) {
    auto p = decode::decode_attn_parse(d);
    if (!p.is_ok()) return fail(named("--psa", p.status()));
  }
  // PSA decodes the full cache in a one-tier encoding (its configs are added per such encoding).
  if (!psa_specs.empty() &&
      std::none_of(encs.begin(), encs.end(), [](const EncChoice& ec) { return !ec.e.low; }))
    return fail(SF_ERR(kInvalidArgument,
                       "--psa decodes the full cache in a one-tier --kv-dtype; every --kv-dtype "
                       "given is two-tier (add one, e.g. --kv-dtype int8+int4,int8)"));
  auto int_opt = [&](const char* k, long def, long lo, long hi, long* out) -> Status {
    const std::string v = a.get(k, std::to_string(def));
    int64_t x = 0;
    if (!whole_int(v, &x) || x < lo || x > hi)
      return SF_ERR(kOutOfRange, std::string("--") + k + " '" + v + "' must be an integer in [" +
                                     std::to_string(lo) + ", " + std::to_string(hi) + "]");
    *out = x;
    return Status::ok();
  };
  long obs = 0, length = 0, T = 0, trials = 0, depths = 0, level = 0, n_windows = 0;
  for (auto [k, def, lo, hi, out] :
       {std::tuple{"length", 8192L, 256L, 1L << 20, &length},
        std::tuple{"tokens", 64L, 1L, 4096L, &T},
        std::tuple{"passkey-trials", 1L, 1L, 100L, &trials},
        std::tuple{"passkey-depths", 5L, 1L, 100L, &depths},
        std::tuple{"passkey-level", 3L, 0L, long(eval::kPasskeyLevels - 1), &level},
        std::tuple{"obs-window", 32L, 1L, 4096L, &obs},
        std::tuple{"windows", 1L, 1L, 64L, &n_windows}}) {
    Status st = int_opt(k, def, lo, hi, out);
    if (!st.is_ok()) return fail(st);
  }
  // The results' directory and names, and the text, before the minutes of prefill and decode.
  // --name becomes part of a file name: no path separators.
  if (a.has("name")) {
    const std::string n = a.get("name");
    if (n.empty() || n.size() > 64 ||
        !std::all_of(n.begin(), n.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
        }) ||
        n[0] == '.')
      return fail(SF_ERR(kInvalidArgument, "--name '" + n + "': 1-64 characters of [A-Za-z0-9._-], not starting with '.'"));
  }
  const std::string out_dir = a.get("out-dir", std::string(SF_SOURCE_DIR) + "/bench/results");
  {
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    if (ec || !std::filesystem::is_directory(out_dir, ec))
      return fail(SF_ERR(kIo, "--out-dir '" + out_dir + "' cannot be created: " +
                                  (ec ? ec.message() : std::string("not a directory"))));
    // The results are written after the whole run: a directory that takes no file fails now.
    if (::access(out_dir.c_str(), W_OK | X_OK) != 0)
      return fail(SF_ERR(kInvalidArgument, "--out-dir '" + out_dir +
                                               "' is not writable: " + std::strerror(errno)));
  }
  // The held-out evaluation text (data/README.md): two essays, 10K tokens, so an 8K prompt does
  // not repeat itself (a repeated text turns the continuation into verbatim copying of the
  // earlier copy, which any eviction breaks).
  const std::string doc_path =
      a.get("document", std::string(SF_SOURCE_DIR) + "/data/long_document.txt," +
                            std::string(SF_SOURCE_DIR) + "/data/long_document_2.txt");
  auto text = read_text_files(doc_path, "document");
  if (!text.is_ok()) return fail(text.status());

  const std::string model_path = resolve_model(a.get("model", "default"));
  auto em = eval::load_eval_model(model_path);
  if (!em.is_ok()) return fail(em.status());
  const model::Tokenizer* tok = &em->tok;
  const model::Model& m = em->m;
  if (m.config().max_context > 0 && length > m.config().max_context)
    return fail(SF_ERR(kOutOfRange, "--length " + std::to_string(length) + " exceeds the model context of " +
                                        std::to_string(m.config().max_context)));
  // A moa config for another model fails here, not after the prefill.
  if (Status st =
          kvstore::retention_check_geometry(moa, m.config().n_layers, m.config().n_kv_heads);
      !st.is_ok())
    return fail(st);
  const auto doc_all = tok->encode(text.value(), true, false);
  if (doc_all.empty())
    return fail(SF_ERR(kInvalidArgument, "the document '" + doc_path + "' has no tokens"));

  std::vector<Config> configs;
  for (const EncChoice& ec : encs)
    for (auto k : kinds)
      for (const auto& d : decodes) {
        const auto enc = ec.e.high;
        if (ec.e.low && !kvstore::retention_uses_span(k))
          return fail(SF_ERR(kInvalidArgument,
                             "--kv-dtype " + kvstore::kv_encodings_name(ec.e) +
                                 ": two tiers need a scored policy (snapkv, adakv, pyramid), not " +
                                 kvstore::retention_kind_name(k)));
        if (k == kvstore::RetentionKind::kFull)
          configs.push_back({k, 1.0, d, nullptr, 1, enc});
        else
          for (double b : budgets) {
            for (int sp : kvstore::retention_uses_span(k) ? spans : std::vector<int>{1})
              configs.push_back({k, b, d, &moa, sp, enc, ec.e.low, ec.share});
          }
      }
  if (std::find(kinds.begin(), kinds.end(), kvstore::RetentionKind::kFull) == kinds.end() &&
      !psa_specs.empty())
    kinds.push_back(kvstore::RetentionKind::kFull);
  for (const EncChoice& ec : encs)
    if (!ec.e.low)
      for (const auto& d : psa_specs)
        configs.push_back({kvstore::RetentionKind::kFull, 1.0, d, nullptr, 1, ec.e.high});
  std::vector<Measure> res(configs.size());

  // 1) The document: for each window (a prompt of `length` tokens starting at its offset),
  //    importance during prefill, the full-KV greedy continuation, then each configuration
  //    free-running and teacher-forced on that continuation. One continuation is a small sample
  //    (a single near-tie decides the free-running score), so windows are averaged.
  model::PrefillOptions po;
  po.importance_window = int(obs);  // SnapKV observation window
  po.importance_pool = 7;
  const int64_t slack = std::max<int64_t>(0, int64_t(doc_all.size()) - length);
  std::vector<int64_t> starts;
  for (long w = 0; w < n_windows; ++w)
    starts.push_back(n_windows > 1 ? slack * w / (n_windows - 1) : 0);
  if (n_windows > 1 && slack < n_windows - 1)
    return fail(SF_ERR(kInvalidArgument,
                       "--windows " + std::to_string(n_windows) + ": the document has " +
                           std::to_string(doc_all.size()) + " tokens, too few for that many " +
                           std::to_string(length) + "-token windows"));
  double prefill_s = 0, importance_s = 0;
  for (size_t wi = 0; wi < starts.size(); ++wi) {
    // A later window keeps the document's BOS (when the tokenizer adds one) in front.
    const int64_t bos = tok->spec().add_bos && doc_all[0] == tok->bos_id() ? 1 : 0;
    std::vector<int32_t> doc(doc_all.begin(), doc_all.begin() + bos);
    if (slack > 0)
      doc.insert(doc.end(), doc_all.begin() + starts[wi] + bos,
                 doc_all.begin() + starts[wi] + length);
    else
      doc = eval::fit_tokens(doc_all, length);
    auto pr = model::prefill(m, doc, po);
    if (!pr.is_ok()) return fail(pr.status());
    std::printf("window %zu (tokens %ld..%ld): prefill %.1f s (importance pass %.2f s)\n", wi,
                long(starts[wi]), long(starts[wi] + length), pr->seconds, pr->importance_s);
    prefill_s += pr->seconds / double(starts.size());
    importance_s += pr->importance_s / double(starts.size());
    kvstore::ImportanceScores imp{
        m.config().n_layers, m.config().n_kv_heads, pr->kv.n_tokens, int(obs), 7, pr->importance};
    std::vector<int32_t> ref{pr->first_token};
    std::vector<std::vector<double>> ref_lp;
    {
      auto s = session_for(m, pr.value(), imp, {kvstore::RetentionKind::kFull, 1.0, "full"},
                           ref_enc, nullptr);
      if (!s.is_ok()) return fail(s.status());
      std::vector<float> z;
      for (long i = 0; i < T; ++i) {
        Status st = s->step(ref.back(), &z);
        if (!st.is_ok()) return fail(st);
        ref.push_back(argmax(z));
        ref_lp.push_back(log_softmax(z));
      }
    }
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const Config& c = configs[ci];
      Measure& me = res[ci];
      auto s = session_for(m, pr.value(), imp, c, ref_enc, &me, /*measure_mass=*/true);
      if (!s.is_ok()) return fail(s.status());
      std::vector<float> z;
      double kl = 0;
      int forced = 0;
      for (long i = 0; i < T; ++i) {  // teacher-forced on the full-KV continuation
        Status st = s->step(ref[size_t(i)], &z);
        if (!st.is_ok()) return fail(st);
        forced += argmax(z) == ref[size_t(i) + 1];
        const auto lp = log_softmax(z);
        double k = 0;
        for (size_t j = 0; j < lp.size(); ++j)
          k += std::exp(ref_lp[size_t(i)][j]) * (ref_lp[size_t(i)][j] - lp[j]);
        kl += k;
      }
      const auto& st = s->stats();
      me.blocks_visited += st.blocks_visited;
      me.blocks_total += st.blocks_total;
      me.kv_blocks_loaded += st.kv_blocks_loaded;
      me.kv_blocks_total += st.kv_blocks_total;
      me.mass_sum += st.mass_sum;
      me.mass_n += st.mass_n;
      me.mass_below += st.mass_below_eps;
      me.mass_min = std::min(me.mass_min, st.mass_min);
      me.steps += st.steps;
      me.guard_steps += st.guard_steps;
      auto s2 = session_for(m, pr.value(), imp, c, ref_enc, nullptr);
      if (!s2.is_ok()) return fail(s2.status());
      const auto g0 = std::chrono::steady_clock::now();
      auto g = s2->generate_greedy(pr->first_token, int(T) + 1);  // free-running
      if (!g.is_ok()) return fail(g.status());
      me.fr_seconds.push_back(sf::seconds_since(g0));
      me.fr_blocks_visited += s2->stats().blocks_visited;
      me.fr_blocks_total += s2->stats().blocks_total;
      me.fr_steps += s2->stats().steps;
      me.fr_guard_steps += s2->stats().guard_steps;
      me.fr_blocks_computed += s2->stats().blocks_computed;
      me.fr_draft_steps += s2->stats().draft_steps;
      me.fr_draft_accepted += s2->stats().draft_accepted;
      me.fr_passes += s2->stats().verify_passes;
      if (s2->stats().verify_passes > 0) {
        const auto& v = s2->stats();
        std::printf("  verified free-running: blocks read %.3f, computed %.3f; %ld drafts, %ld "
                    "accepted, %ld passes\n",
                    double(v.blocks_visited) / double(v.blocks_total),
                    double(v.blocks_computed) / double(v.blocks_total), long(v.draft_steps),
                    long(v.draft_accepted), long(v.verify_passes));
      }
      int same = 0;
      for (long i = 1; i <= T; ++i) same += g.value()[size_t(i)] == ref[size_t(i)];
      me.greedy.push_back(double(same) / double(T));
      // Where the free-running tokens first leave the full-KV ones, and how close the full-KV
      // model's own top two were there (a near-tie flips under any perturbation).
      long first = -1;
      for (long i = 1; i <= T && first < 0; ++i)
        if (g.value()[size_t(i)] != ref[size_t(i)]) first = i;
      double gap = -1;
      if (first > 0) {
        std::vector<double> lp = ref_lp[size_t(first - 1)];
        std::partial_sort(lp.begin(), lp.begin() + 2, lp.end(), std::greater<>());
        gap = lp[0] - lp[1];
      }
      me.first_div.push_back(first);
      me.div_gap.push_back(gap);
      me.forced.push_back(double(forced) / double(T));
      me.kl.push_back(kl / double(T));
      std::printf(
          "%-10s %-5.2f %-15s span %-3d %-4s kv %.3f (tokens %.3f)  greedy_match %.3f (forced "
          "%.3f)  kl %.5f  blocks %.3f (kv %.3f)  mass %.4f (min %.4f, below eps %.3f)\n",
          kvstore::retention_kind_name(c.kind), c.budget, c.decode_spec.c_str(), c.span,
          enc_name(c).c_str(), double(me.kv_bytes.back()) / double(me.kv_bytes_full),
          me.kept_frac.back(), me.greedy.back(), me.forced.back(), me.kl.back(),
          st.blocks_total ? double(st.blocks_visited) / double(st.blocks_total) : 1.0,
          st.kv_blocks_total ? double(st.kv_blocks_loaded) / double(st.kv_blocks_total) : 1.0,
          st.mass_n ? st.mass_sum / double(st.mass_n) : 1.0, st.mass_min,
          st.mass_n ? double(st.mass_below_eps) / double(st.mass_n) : 0.0);
      std::fflush(stdout);
    }
  }

  // 2) Passkey retrieval: one prefill per prompt, shared by the dense answer and every config.
  int dense_hits = 0, n_prompts = 0;
  if (!a.has("no-passkey")) {
    for (long tr = 0; tr < trials; ++tr) {
      auto prompts =
          eval::passkey_prompts(*tok, length, int(level), int(depths), int(tr), 20261122);
      if (!prompts.is_ok()) return fail(prompts.status());
      for (const auto& p : prompts.value()) {
        auto ppr = model::prefill(m, p.ids, po);
        if (!ppr.is_ok()) return fail(ppr.status());
        kvstore::ImportanceScores pimp{
            m.config().n_layers, m.config().n_kv_heads, ppr->kv.n_tokens, int(obs), 7,
            ppr->importance};
        // The decoded answer goes to the log: a miss shows whether the key was lost whole
        // or in part.
        std::string said;
        auto answer = [&](const Config& c) -> Result<bool> {
          SF_ASSIGN(auto s, session_for(m, ppr.value(), pimp, c, ref_enc, nullptr));
          SF_ASSIGN(auto g, s.generate_greedy(ppr->first_token, 10));
          said = tok->decode(g);
          for (char& ch : said)
            if (ch == '\n') ch = ' ';
          return said.find(p.key) != std::string::npos;
        };
        auto d = answer({kvstore::RetentionKind::kFull, 1.0, "full"});
        if (!d.is_ok()) return fail(d.status());
        dense_hits += d.value();
        ++n_prompts;
        std::printf("passkey depth %.2f key %s: dense %s (\"%s\")\n", p.depth, p.key.c_str(),
                    d.value() ? "found" : "missed", said.c_str());
        for (size_t ci = 0; ci < configs.size(); ++ci) {
          auto h = answer(configs[ci]);
          if (!h.is_ok()) return fail(h.status());
          res[ci].passkey_hits += h.value();
          res[ci].passkey_n += 1;
          std::printf("  %-10s %-5.2f %-15s span %-3d %-4s %s (\"%s\")\n",
                      kvstore::retention_kind_name(configs[ci].kind), configs[ci].budget,
                      configs[ci].decode_spec.c_str(), configs[ci].span,
                      enc_name(configs[ci]).c_str(), h.value() ? "found" : "missed",
                      said.c_str());
        }
        std::fflush(stdout);
      }
    }
  }

  // 3) One results file per policy.
  namespace json = boost::json;
  for (auto k : kinds) {
    json::object o;
    o["device"] = json::object{{"cpu", cpu_name()}};
    o["date"] = now_iso8601();
    o["git_commit"] = git_commit();
    o["command"] = shell_quote_args(argc, argv);
    o["model"] = model_path;
    o["document"] = doc_path;
    o["prompt_tokens"] = length;
    o["obs_window"] = obs;
    o["document_tokens"] = int64_t(doc_all.size());
    o["prefill_seconds"] = prefill_s;
    o["importance_seconds"] = importance_s;
    o["windows"] = json::value_from(starts);
    o["continuation_tokens"] = T;
    o["passkey"] = json::object{
        {"trials", trials},     {"depths", depths},
        {"level", level},       {"format", eval::passkey_format_description(int(level))},
        {"prompts", n_prompts}, {"new_tokens", 10}};
    o["definitions"] = json::object{
        {"budget",
         "requested fraction of the full cache's KV bytes, the full cache stored in "
         "kv_ref_dtype"},
        {"kv_bytes",
         "bytes of the kept keys and values stored in kv_dtype (int8/int4: with their F16 "
         "scales and zeros, keys per channel per 64 kept tokens, values per token), the "
         "largest over the windows (kv_bytes_per_window keeps each); kv_bytes_full: every "
         "token in kv_ref_dtype"},
        {"kv_kept_frac", "kept tokens / all (layer, KV head, token), mean over the windows"},
        {"kv_dtype_low",
         "two tiers only: the low tier's encoding; kv_high_share: the share of the budget's "
         "bytes the high tier (the policy's top tokens, kv_dtype) was given; kv_low_frac: "
         "low-tier tokens / all (layer, KV head, token)"},
        {"windows", "start offsets of the prompts (each prompt_tokens long) in the document"},
        {"greedy_match_64",
         "fraction of the next N greedy tokens (free-running) equal position by position to the "
         "full-KV continuation, mean over the windows (per window in _per_window)"},
        {"greedy_match_forced_64",
         "fraction of N steps, fed the full-KV continuation, whose argmax equals the full-KV next "
         "token"},
        {"kl_mean_64",
         "mean KL(full || policy) of next-token distributions over those teacher-forced steps, "
         "nats, mean over the windows"},
        {"first_divergence_per_window",
         "1-based index of the first free-running token that differs from the full-KV "
         "continuation (-1: none); dense_top2_gap_at_divergence: the full-KV model's log-prob "
         "gap between its top two tokens at that step, nats"},
        {"psa_mass_mean",
         "teacher-forced steps: true softmax mass of the visited blocks / all blocks, mean over "
         "(layer, query head, step); _min the smallest, _below_eps_frac the share under eps"},
        {"span",
         "snapkv, adakv, pyramid: a position also takes the best importance of the span - 1 "
         "positions before it, so a scored token is kept with those after it (1: plain)"},
        {"blocks_visited_frac",
         "decode attention blocks visited / available, over query heads, layers, steps and "
         "windows (1 for full; with a psa guard, a step run again in full adds all its blocks "
         "to the visited ones); with verified drafts (psa...:verifyN) it is the free-running "
         "run's, whose tokens greedy_match_64 scores: drafts' visits plus each verification "
         "pass's blocks once (a pass reads a block once for all its tokens) / the blocks full "
         "decode visits for the tokens kept, and blocks_visited_frac_forced_draft is the "
         "teacher-forced draft's alone"},
        {"blocks_computed_frac_free_running",
         "verified drafts: drafts' visits plus each pass's blocks per token (the attention's "
         "arithmetic rather than its reads) / the blocks full decode visits for the tokens kept"},
        {"decode_s_free_running",
         "wall seconds of the free-running generation on this host's CPU threads, mean over the "
         "windows (the cache already paged; nothing else measured in it)"},
        {"draft_accept_frac",
         "verified drafts, free-running: drafted tokens the full-attention pass kept / drafted "
         "tokens; tokens_per_pass: tokens kept / verification passes"},
        {"guard_steps_frac",
         "psa with a guard margin (psa-avg:EPS:MARGIN): steps whose top two logits were closer "
         "than MARGIN nats and so were run again with full attention / steps, teacher-forced; "
         "_free_running the same over the free-running run, whose blocks visited / available "
         "is blocks_visited_frac_free_running"},
        {"kv_blocks_loaded_frac",
         "blocks any query head of a KV head visited / available, over KV heads, layers, steps "
         "and windows: the reads of a kernel that loads a block once for its KV head's query "
         "heads (psa +gqa: equal to blocks_visited_frac); teacher-forced, so with verified "
         "drafts the draft's alone"},
        {"psa_verify_draft",
         "verified drafts (psa...:verifyN): N, the most tokens a draft runs before a "
         "full-attention pass verifies it (a MARGIN may stop it earlier at a near-tie)"},
        {"importance",
         "SnapKV column sums of the last obs_window queries' softmax from the "
         "prefill LSE, max-pooled with kernel 7"}};
    if (k == kvstore::RetentionKind::kMoA) {
      json::object& d = o["definitions"].as_object();
      d["moa_spans"] =
          "per layer and KV head, span = alpha + beta * N recent tokens kept besides the sink";
      d["moa_scale"] =
          "factor on the config's alpha and beta (beta capped at 1): the largest whose kept "
          "tokens on the document prompt are at most the budget";
    }
    json::array recs;
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      if (configs[ci].kind != k) continue;
      const Measure& me = res[ci];
      json::object r;
      r["policy"] = kvstore::retention_kind_name(k);
      r["params"] = me.params;
      r["budget"] = configs[ci].budget;
      r["decode"] = configs[ci].decode_spec;
      r["span"] = configs[ci].span;
      auto mean = [](const std::vector<double>& v) {
        double t = 0;
        for (double x : v) t += x;
        return v.empty() ? 0.0 : t / double(v.size());
      };
      r["kv_bytes"] = me.kv_bytes.empty()
                          ? int64_t(0)
                          : *std::max_element(me.kv_bytes.begin(), me.kv_bytes.end());
      r["kv_bytes_per_window"] = json::value_from(me.kv_bytes);
      r["kv_bytes_full"] = me.kv_bytes_full;
      r["kv_dtype"] = kvstore::kv_encoding_name(configs[ci].enc);
      if (configs[ci].low) {
        r["kv_dtype_low"] = kvstore::kv_encoding_name(*configs[ci].low);
        r["kv_high_share"] = configs[ci].high_share;
        r["kv_low_frac"] = mean(me.low_frac);
      }
      r["kv_ref_dtype"] = kvstore::kv_encoding_name(ref_enc);
      r["kv_kept_frac"] = mean(me.kept_frac);
      r["greedy_match_64"] = mean(me.greedy);
      r["greedy_match_forced_64"] = mean(me.forced);
      r["greedy_match_64_per_window"] = json::value_from(me.greedy);
      r["kl_mean_64_per_window"] = json::value_from(me.kl);
      r["first_divergence_per_window"] = json::value_from(me.first_div);
      r["dense_top2_gap_at_divergence"] = json::value_from(me.div_gap);
      r["kl_mean_64"] = mean(me.kl);
      r["decode_s_free_running"] = mean(me.fr_seconds);
      r["passkey_accuracy"] = me.passkey_n ? double(me.passkey_hits) / me.passkey_n : -1.0;
      r["dense_passkey_accuracy"] = n_prompts ? double(dense_hits) / n_prompts : -1.0;
      auto dp = decode::decode_attn_parse(configs[ci].decode_spec).value();
      if (dp.mode == decode::DecodeAttnMode::kPsa) {
        r["psa_eps"] = dp.eps;
        r["psa_mass_mean"] = me.mass_n ? me.mass_sum / double(me.mass_n) : 1.0;
        r["psa_mass_min"] = me.mass_min;
        r["psa_mass_below_eps_frac"] = me.mass_n ? double(me.mass_below) / double(me.mass_n) : 0.0;
        if (dp.guard_margin > 0 && dp.verify_draft == 0) {
          r["psa_guard_margin"] = dp.guard_margin;
          r["guard_steps_frac"] = me.steps ? double(me.guard_steps) / double(me.steps) : 0.0;
          r["guard_steps_frac_free_running"] =
              me.fr_steps ? double(me.fr_guard_steps) / double(me.fr_steps) : 0.0;
          r["blocks_visited_frac_free_running"] =
              me.fr_blocks_total ? double(me.fr_blocks_visited) / double(me.fr_blocks_total) : 1.0;
        }
      }
      r["blocks_visited_frac"] =
          me.blocks_total ? double(me.blocks_visited) / double(me.blocks_total) : 1.0;
      if (dp.mode == decode::DecodeAttnMode::kPsa && dp.verify_draft > 0) {
        const auto frac = [](int64_t a, int64_t b) { return b ? double(a) / double(b) : 1.0; };
        r["psa_verify_draft"] = dp.verify_draft;
        r["blocks_visited_frac_forced_draft"] = r["blocks_visited_frac"];
        r["blocks_visited_frac"] = frac(me.fr_blocks_visited, me.fr_blocks_total);
        r["blocks_computed_frac_free_running"] = frac(me.fr_blocks_computed, me.fr_blocks_total);
        r["draft_accept_frac"] = frac(me.fr_draft_accepted, me.fr_draft_steps);
        r["tokens_per_pass"] = me.fr_passes ? double(me.fr_steps) / double(me.fr_passes) : 0.0;
      }
      r["kv_blocks_loaded_frac"] =
          me.kv_blocks_total ? double(me.kv_blocks_loaded) / double(me.kv_blocks_total) : 1.0;
      if (k == kvstore::RetentionKind::kMoA) {
        // The spans the document prompt kept (passkey prompts re-solve the scale for their N).
        json::array spans;
        for (const auto& layer : me.moa.moa) {
          json::array heads;
          for (const auto& sp : layer)
            heads.push_back(json::object{{"alpha", sp.alpha}, {"beta", sp.beta}});
          spans.push_back(std::move(heads));
        }
        r["moa_config"] = me.moa.moa_config;
        r["moa_sink"] = me.moa.moa_sink;
        r["moa_scale"] = me.moa.moa_scale;
        r["moa_spans"] = std::move(spans);
      }
      recs.push_back(std::move(r));
    }
    o["records"] = std::move(recs);
    std::string name = kvstore::retention_kind_name(k);
    if (a.has("name")) name += "-" + a.get("name");
    const std::string path = out_dir + "/retention-" + name + ".json";
    if (Status st = write_file_atomic(path, json::serialize(o) + "\n"); !st.is_ok()) return fail(st);
    std::printf("wrote %s\n", path.c_str());
  }
  return 0;
}

}  // namespace sf::cli
