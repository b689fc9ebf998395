// `sparsefill eval`: one attention mode against dense on the real model, side by side in one
// process, at several lengths: attention recall, output relative error, next-token KL,
// perplexity, passkey retrieval, density, estimation/attention/prefill time. Writes JSON plus a
// markdown table with the same stem.
#include <boost/json.hpp>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/file_io.h"
#include "common/thread_pool.h"
#include "common/timing.h"
#include "tools/cli/cli.h"
#include "tools/eval/quality.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"

namespace sf::cli {
namespace {

std::string safe_name(const std::string& mode) {
  std::string s;
  for (char c : mode) s += (std::isalnum(static_cast<unsigned char>(c)) || c == '-') ? c : '_';
  return s;
}

boost::json::array to_json(const std::vector<double>& v) {
  boost::json::array a;
  for (double x : v) a.push_back(x);
  return a;
}
boost::json::array to_json(const std::vector<int>& v) {
  boost::json::array a;
  for (int x : v) a.push_back(x);
  return a;
}

boost::json::object record_json(const eval::EvalRecord& r) {
  boost::json::object o;
  o["mode"] = r.mode;
  o["seq_len"] = r.seq_len;
  o["density"] = r.density;
  o["attention_recall"] = r.attention_recall;
  o["min_head_recall"] = r.min_head_recall;
  o["attention_recall_held_out"] = r.attention_recall_held_out;
  o["min_head_recall_held_out"] = r.min_head_recall_held_out;
  o["attention_recall_last_block"] = r.attention_recall_last_block;
  o["recall_per_layer"] = to_json(r.recall_per_layer);
  o["density_per_layer"] = to_json(r.density_per_layer);
  o["ppl_dense"] = r.ppl_dense;
  o["ppl_sparse"] = r.ppl_sparse;
  o["ppl_ratio"] = r.ppl_ratio;
  o["ppl_tail_dense"] = r.ppl_tail_dense;
  o["ppl_tail_sparse"] = r.ppl_tail_sparse;
  o["ppl_tail_ratio"] = r.ppl_tail_ratio;
  o["ppl_ratio_by_quarter"] = to_json(r.ppl_ratio_by_quarter);
  o["kl_mean"] = r.kl_mean;
  o["kl_max"] = r.kl_max;
  o["output_rel_error"] = r.output_rel_error;
  o["top1_agreement"] = r.top1_agreement;
  o["estimate_s"] = r.estimate_s;
  o["attention_s"] = r.attention_s;
  o["dense_attention_s"] = r.dense_attention_s;
  o["prefill_s"] = r.prefill_s;
  o["dense_prefill_s"] = r.dense_prefill_s;
  o["speedup"] = r.speedup;
  o["passkey_accuracy"] = r.passkey_accuracy;
  o["dense_passkey_accuracy"] = r.dense_passkey_accuracy;
  o["passkey_format_level"] = r.passkey_level;
  o["passkey_format"] = r.passkey_format;
  o["passkey_prompt_tokens"] = r.passkey_prompt_tokens;
  o["passkey_dense_hit_sparse_miss"] = r.passkey_dense_hit_sparse_miss;
  o["passkey_sparse_hit_dense_miss"] = r.passkey_sparse_hit_dense_miss;
  o["passkey_bar_met"] = r.passkey_bar_met;
  o["passkey_prompts_below_dense_below"] = r.passkey_prompts_below_dense_below;
  boost::json::array ladder;
  for (const auto& t : r.passkey_ladder) {
    boost::json::object x;
    x["level"] = t.level;
    x["dense_accuracy"] = t.dense_accuracy;
    ladder.push_back(std::move(x));
  }
  o["passkey_format_ladder"] = std::move(ladder);
  o["passkey_depths"] = to_json(r.passkey_depths);
  o["passkey_dense_hits_per_depth"] = to_json(r.passkey_dense_hits);
  o["passkey_sparse_hits_per_depth"] = to_json(r.passkey_sparse_hits);
  boost::json::array fails;
  for (const auto& f : r.passkey_failures) fails.push_back(boost::json::string(f));
  o["passkey_misses"] = std::move(fails);
  return o;
}

std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

std::string quarters(const std::vector<double>& q) {
  std::string s;
  for (double x : q) {
    if (!s.empty()) s += " / ";
    s += fmt("%.3f", x);
  }
  return s.empty() ? "-" : s;
}

std::string markdown(const std::string& mode, const std::string& date, const std::string& commit,
                     const std::string& device, const std::string& command, const std::string& doc,
                     const std::vector<eval::EvalRecord>& recs, int passkey_trials, size_t doc_tokens) {
  std::string s = "# sparsefill eval: " + mode + "\n\n";
  s += "- date: " + date + "\n- git commit: " + commit + "\n- device: " + device + " (CPU; times are side-by-side "
       "ratios, absolute CPU times mean little)\n- command: `" + command + "`\n- document: " + doc +
       " (comma-separated files joined by a blank line; " + std::to_string(doc_tokens) +
       " tokens; repeated when shorter than the length, then truncated)\n\n";
  s += "| seq_len | density | recall (mean) | min head recall | recall held out (min head) | recall last block | ppl ratio | ppl ratio (last 255 targets) | ppl ratio by quarter | KL mean | KL max | "
       "logit rel err | top-1 agree | passkey sparse | passkey dense | format | estimate s | attention s | "
       "dense attention s | prefill s | dense prefill s | speedup |\n";
  s += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : recs) {
    s += "| " + std::to_string(r.seq_len) + " | " + fmt("%.3f", r.density) + " | " + fmt("%.4f", r.attention_recall) +
         " | " + fmt("%.3f", r.min_head_recall) + " | " + fmt("%.4f", r.attention_recall_held_out) + " (" +
         fmt("%.3f", r.min_head_recall_held_out) + ") | " + fmt("%.4f", r.attention_recall_last_block) +
         " | " + fmt("%.4f", r.ppl_ratio) + " | " +
         fmt("%.4f", r.ppl_tail_ratio) + " | " + quarters(r.ppl_ratio_by_quarter) + " | " + fmt("%.2e", r.kl_mean) + " | " + fmt("%.2e", r.kl_max) + " | " +
         fmt("%.4f", r.output_rel_error) + " | " + fmt("%.3f", r.top1_agreement) + " | " +
         fmt("%.2f", r.passkey_accuracy) + " | " + fmt("%.2f", r.dense_passkey_accuracy) + " | L" +
         std::to_string(r.passkey_level) + " | " + fmt("%.3f", r.estimate_s) + " | " + fmt("%.3f", r.attention_s) +
         " | " + fmt("%.3f", r.dense_attention_s) + " | " + fmt("%.3f", r.prefill_s) + " | " +
         fmt("%.3f", r.dense_prefill_s) + " | " + fmt("%.2fx", r.speedup) + " |\n";
  }
  s += "\nDefinitions: density = fraction of causal query-key pairs the sparse kernel computes (all layers and "
       "heads). recall = dense softmax mass on the keys the index selects, per sampled query row (last 64 rows "
       "plus 64 random rows per layer, per-row causal clipping), averaged over rows, heads and layers; computed "
       "on the sparse run's own q and k. recall held out = the random rows only: the last 64 are the rows the "
       "vertical-slash and adaptive estimators score themselves, so recall last block measures the index on "
       "rows it was fitted to. ppl ratio = perplexity of the sparse prefill / dense over all positions "
       "of the document (and over the last 255 targets, and over each quarter of the positions in order). KL = KL(dense || sparse) of the next-token distributions of the "
       "last 256 positions. logit rel err = ||logits_sparse - logits_dense||_2 / ||logits_dense||_2 over the "
       "last 256 positions. Passkey: " + std::to_string(passkey_trials) +
       " trial(s) x 10 depths per length; the prompt prefill runs in the mode under test, the ~10 decoded tokens "
       "use dense attention over that cache; the format level (L0 hardest .. L3 easiest) is the first at which "
       "dense reached 0.8, or L3 when none did (see passkey_format and passkey_ladder in the JSON).\n";
  for (const auto& r : recs)
    if (!r.passkey_format.empty())
      s += "\nPasskey format at " + std::to_string(r.seq_len) + ": " + r.passkey_format + ".\n";
  return s;
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  auto args_r = parse_args(argc, argv, 2,
                           {"model", "attention", "lengths", "document", "passkey-trials", "passkey-level", "out",
                            "reps", "seed", "dump-nll"},
                           {"no-passkey"});
  if (!args_r.is_ok()) return fail(args_r.status());
  const Args& a = args_r.value();
  const std::string mode = a.get("attention", "");
  if (mode.empty()) return fail(SF_ERR(kInvalidArgument, "--attention MODE is required"));
  auto lengths = parse_length_list(a.get("lengths", "2048,4096,8192"));
  if (!lengths.is_ok()) return fail(lengths.status());
  auto trials = a.get_int("passkey-trials", 1, 1, 100);
  if (!trials.is_ok()) return fail(trials.status());
  auto level = a.get_int("passkey-level", 0, 0, eval::kPasskeyLevels - 1);
  if (!level.is_ok()) return fail(level.status());
  auto reps = a.get_int("reps", 1, 1, 20);
  if (!reps.is_ok()) return fail(reps.status());
  auto seed = a.get_int("seed", int64_t(eval::EvalSettings{}.seed), 0, INT64_MAX);
  if (!seed.is_ok()) return fail(seed.status());
  // Default: two original held-out essays, together longer than 8K tokens, so no length up to
  // the model's context repeats text (a repeat turns the tail into a copy task).
  const std::string doc_path =
      a.get("document", std::string(SF_SOURCE_DIR) + "/data/long_document.txt," + std::string(SF_SOURCE_DIR) +
                            "/data/long_document_2.txt");
  auto text = read_text_files(doc_path, "document");
  if (!text.is_ok()) return fail(text.status());
  const std::string out_path =
      a.get("out", std::string(SF_SOURCE_DIR) + "/bench/results/eval-" + safe_name(mode) + ".json");
  // The markdown summary goes beside the JSON, with its extension replaced by .md.
  if (std::filesystem::path(out_path).extension() == ".md")
    return fail(SF_ERR(kInvalidArgument, "--out '" + out_path +
                                             "' ends in .md, the markdown summary's name; give "
                                             "the JSON's (FILE.json)"));
  if (Status st = check_output_file(out_path, "--out"); !st.is_ok()) return fail(st);
  // The NLL dumps are written during the first length's run: a path that cannot take them fails
  // before the model loads.
  if (a.has("dump-nll"))
    if (Status st = check_output_file(a.get("dump-nll") + "-" + std::to_string(lengths.value()[0]) +
                                          ".tsv",
                                      "--dump-nll");
        !st.is_ok())
      return fail(st);

  const std::string model_path = resolve_model(a.get("model", "default"));
  auto em = eval::load_eval_model(model_path);
  if (!em.is_ok()) return fail(em.status());
  const model::Tokenizer* tok = &em->tok;
  const model::Model& m = em->m;
  const auto& cfg = m.config();
  for (int64_t L : lengths.value())
    if (L > cfg.max_context)
      return fail(SF_ERR(kOutOfRange, "--lengths: " + std::to_string(L) + " exceeds the model context of " +
                                          std::to_string(cfg.max_context)));
  auto sc = model::sparse_config_for_mode(mode, cfg.n_layers, cfg.n_heads);
  if (!sc.is_ok()) return fail(sc.status());
  const std::vector<int32_t> doc = tok->encode(text.value(), true, false);
  if (doc.empty()) return fail(SF_ERR(kInvalidArgument, "the document '" + doc_path + "' has no tokens"));

  std::printf("eval %s on %s (%zu tokens), lengths", mode.c_str(), doc_path.c_str(), doc.size());
  for (int64_t L : lengths.value()) std::printf(" %lld", static_cast<long long>(L));
  std::printf("\n");
  // A sparse mode below its dense_below runs dense: its record would read density 1 unexplained.
  if (!model::sparse_config_is_dense(sc.value()))
    for (int64_t L : lengths.value())
      if (L < sc->dense_below)
        std::printf("note: length %lld is below this mode's dense_below (%lld): it runs dense there\n",
                    static_cast<long long>(L), static_cast<long long>(sc->dense_below));
  std::fflush(stdout);
  {  // warm-up: page in weights, start thread pools
    std::vector<int32_t> w(doc.begin(), doc.begin() + std::min<size_t>(doc.size(), 128));
    auto r = model::prefill(m, w, {});
    if (!r.is_ok()) return fail(r.status());
  }
  std::vector<eval::EvalRecord> recs;
  boost::json::array jrecs;
  for (int64_t L : lengths.value()) {
    eval::EvalSettings s;
    s.seq_len = L;
    s.passkey_trials = trials.value();
    s.passkey_level = level.value();
    s.timing_reps = reps.value();
    s.do_passkey = !a.has("no-passkey");
    s.seed = uint64_t(seed.value());
    if (a.has("dump-nll")) s.nll_dump_path = a.get("dump-nll") + "-" + std::to_string(L) + ".tsv";
    const auto t0 = std::chrono::steady_clock::now();
    auto r = eval::evaluate(m, *tok, doc, &sc.value(), mode, s);
    if (!r.is_ok()) return fail(r.status());
    const double dt = sf::seconds_since(t0);
    const auto& e = r.value();
    std::printf("L=%lld density %.3f recall %.4f (min head %.3f; held out %.4f, min head %.3f; last "
                "block %.4f) ppl_ratio %.4f (tail %.4f) kl %.2e rel_err %.4f "
                "passkey %.2f/dense %.2f (L%d) prefill %.2fs dense %.2fs speedup %.2fx est %.2fs attn %.2fs "
                "[%.0fs]\n",
                static_cast<long long>(L), e.density, e.attention_recall, e.min_head_recall,
                e.attention_recall_held_out, e.min_head_recall_held_out, e.attention_recall_last_block,
                e.ppl_ratio,
                e.ppl_tail_ratio, e.kl_mean, e.output_rel_error, e.passkey_accuracy, e.dense_passkey_accuracy,
                e.passkey_level, e.prefill_s, e.dense_prefill_s, e.speedup, e.estimate_s, e.attention_s, dt);
    if (e.passkey_accuracy >= 0)
      std::printf("  passkey per prompt: %d found by dense only, %d by sparse only%s%s\n",
                  e.passkey_dense_hit_sparse_miss, e.passkey_sparse_hit_dense_miss,
                  e.passkey_bar_met ? "" : "; dense never reached the bar, the easiest format kept",
                  e.passkey_prompts_below_dense_below > 0
                      ? "; some prompts are shorter than dense_below: they ran dense in both runs"
                      : "");
    if (!e.ppl_ratio_by_quarter.empty())
      std::printf("  ppl ratio by quarter of positions: %.4f %.4f %.4f %.4f\n", e.ppl_ratio_by_quarter[0],
                  e.ppl_ratio_by_quarter[1], e.ppl_ratio_by_quarter[2], e.ppl_ratio_by_quarter[3]);
    std::fflush(stdout);
    jrecs.push_back(record_json(e));
    recs.push_back(e);
  }

  boost::json::object out;
  out["benchmark"] = "eval";
  out["mode"] = mode;
  out["config_source"] = sc->source;
  out["dense_below"] = sc->dense_below;
  out["date"] = now_iso8601();
  out["git_commit"] = git_commit();
  out["command"] = shell_quote_args(argc, argv);
  boost::json::object dev = cpu_device_json();
  out["device"] = std::move(dev);
  boost::json::object mo;
  mo["path"] = model_path;
  mo["name"] = cfg.name;
  mo["n_layers"] = cfg.n_layers;
  mo["n_heads"] = cfg.n_heads;
  mo["n_kv_heads"] = cfg.n_kv_heads;
  out["model"] = std::move(mo);
  out["document"] = doc_path;
  out["document_tokens"] = int64_t(doc.size());
  boost::json::object defs;
  defs["density"] = "fraction of causal query-key pairs computed by the sparse kernel (SparseIndex::pairs), all "
                    "layers and heads, as reported by the forward";
  defs["attention_recall"] = "dense softmax mass on the keys the index selects, per sampled query row (last 64 rows "
                             "+ 64 random rows per layer, fixed seed), clipped causally per row; mean over rows, "
                             "heads and layers; on the sparse run's own q/k. attention_recall_held_out / "
                             "min_head_recall_held_out: the random rows only (the last 64 are the rows the "
                             "vertical-slash and adaptive estimators score themselves); "
                             "attention_recall_last_block: the last 64 only";
  defs["ppl_ratio"] = "perplexity (exp mean NLL over all next-token positions of the document) sparse / dense; "
                      "ppl_tail_ratio: the same over the last 255 targets (logit rows L-256 .. L-2; the "
                      "last logit row has no target)";
  defs["kl_mean"] = "mean over the last 256 positions of KL(dense || sparse) of next-token distributions (nats)";
  defs["output_rel_error"] = "||logits_sparse - logits_dense||_2 / ||logits_dense||_2 over the last 256 positions";
  defs["timing"] = "prefill_s / dense_prefill_s: whole prefill (last-position logits, no KV kept), dense and sparse "
                   "alternated in one process, best of --reps; estimate_s and attention_s are the sparse run's";
  defs["passkey"] = "10 depths (0%..90%) x trials; prompt prefill in the mode under test, greedy continuation with "
                    "dense decode; the format gets easier (levels 0..3) until dense reaches 0.8";
  out["definitions"] = std::move(defs);
  out["records"] = std::move(jrecs);
  if (Status st = write_file_atomic(out_path, boost::json::serialize(out) + "\n"); !st.is_ok())
    return fail(st);
  const std::string md_path = std::filesystem::path(out_path).replace_extension(".md").string();
  if (Status st = write_file_atomic(
          md_path, markdown(mode, out["date"].as_string().c_str(), out["git_commit"].as_string().c_str(),
                            cpu_name(), out["command"].as_string().c_str(), doc_path, recs, trials.value(),
                            doc.size()));
      !st.is_ok())
    return fail(st);
  std::printf("wrote %s and %s\n", out_path.c_str(), md_path.c_str());
  return 0;
}

}  // namespace sf::cli
