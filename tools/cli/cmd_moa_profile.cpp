// sparsefill moa-profile: per layer and KV head MoA spans (alpha + beta * N recent tokens) for KV
// retention, profiled on calibration text (kvstore/moa_profile.h says how). For each prompt
// length it prefills the document's first N tokens with SnapKV importance (unpooled column sums
// of the last `--obs-window` queries' softmax), turns every head's scores into the share of its
// mass kept at each span, gives the heads spans under `--density` of the prompt's KV by the
// greedy, then fits each head's spans across the lengths. The config it writes is what
// `moa:config=FILE` reads; eval scales it to each budget.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <boost/json.hpp>

#include "common/file_io.h"
#include "kvstore/moa_profile.h"
#include "tools/cli/cli.h"
#include "tools/eval/quality.h"
#include "worker/model/model.h"

namespace sf::cli {

int cmd_moa_profile(int argc, char** argv) {
  auto args_r = parse_args(argc, argv, 2,
                           {"model", "document", "lengths", "density", "sink", "step",
                            "obs-window", "out"},
                           {});
  if (!args_r.is_ok()) return fail(args_r.status());
  const Args& a = args_r.value();
  if (!a.has("out")) return fail(SF_ERR(kInvalidArgument, "--out FILE.json is required"));
  if (Status st = check_output_file(a.get("out"), "--out"); !st.is_ok()) return fail(st);
  auto lengths_r = parse_length_list(a.get("lengths", "2048,4096,8192"));
  if (!lengths_r.is_ok()) return fail(lengths_r.status());
  std::vector<int64_t> lengths = lengths_r.value();
  std::sort(lengths.begin(), lengths.end());
  if (std::adjacent_find(lengths.begin(), lengths.end()) != lengths.end())
    return fail(SF_ERR(kInvalidArgument, "--lengths names a length twice"));
  auto density_r = a.get_double("density", 0.25, 0, 1);
  auto sink_r = a.get_int("sink", 64, 0, INT32_MAX);
  auto step_r = a.get_int("step", 64, 1, INT32_MAX);
  auto obs_r = a.get_int("obs-window", 32, 1, 1 << 20);
  if (!density_r.is_ok()) return fail(density_r.status());
  if (!sink_r.is_ok()) return fail(sink_r.status());
  if (!step_r.is_ok()) return fail(step_r.status());
  if (!obs_r.is_ok()) return fail(obs_r.status());
  const double density = density_r.value();
  const int64_t sink = sink_r.value(), step = step_r.value();
  const int obs = int(obs_r.value());
  if (!(density > 0 && density < 1))
    return fail(SF_ERR(kInvalidArgument, "--density must be in (0, 1)"));
  if (sink < 0 || step <= 0 || obs <= 0 || sink + step >= lengths.front())
    return fail(SF_ERR(kInvalidArgument,
                       "--sink >= 0, --step > 0 and --obs-window > 0, with sink + step below the "
                       "shortest length"));
  // Each head keeps floor(density x N) tokens: the sink plus at least one step of span.
  if (int64_t(density * double(lengths.front())) < sink + step)
    return fail(SF_ERR(kInvalidArgument,
                       "--density " + a.get("density", "0.25") + " keeps " +
                           std::to_string(int64_t(density * double(lengths.front()))) +
                           " tokens a head at the shortest length " + std::to_string(lengths.front()) +
                           ", fewer than --sink + --step (" + std::to_string(sink + step) +
                           "): raise --density or the shortest --lengths, or lower --sink or --step"));
  // Calibration text, held out from eval's documents (data/README.md); read before the load.
  const std::string doc_path =
      a.get("document", std::string(SF_SOURCE_DIR) + "/data/calibration_document.txt," +
                            std::string(SF_SOURCE_DIR) + "/data/calibration_document_2.txt");
  auto text = read_text_files(doc_path, "document");
  if (!text.is_ok()) return fail(text.status());

  const std::string model_path = resolve_model(a.get("model", "default"));
  auto em = eval::load_eval_model(model_path);
  if (!em.is_ok()) return fail(em.status());
  const model::Tokenizer* tok = &em->tok;
  const model::Model& m = em->m;
  const model::ModelConfig& cfg = m.config();
  if (cfg.max_context > 0 && lengths.back() > cfg.max_context)
    return fail(SF_ERR(kOutOfRange, "--lengths: " + std::to_string(lengths.back()) +
                                        " exceeds the model context of " + std::to_string(cfg.max_context)));
  const auto doc = tok->encode(text.value(), true, false);
  // A repeated text would teach heads to attend to the earlier copy.
  if (int64_t(doc.size()) < lengths.back())
    return fail(SF_ERR(kInvalidArgument, "the document has " + std::to_string(doc.size()) +
                                             " tokens, fewer than the longest length " +
                                             std::to_string(lengths.back())));

  const int L = cfg.n_layers, Hkv = cfg.n_kv_heads;
  const size_t H = size_t(L) * size_t(Hkv);
  std::vector<std::vector<int64_t>> spans(H);  // [head][length]
  boost::json::array per_length;
  for (int64_t N : lengths) {
    const std::vector<int32_t> prompt(doc.begin(), doc.begin() + N);
    model::PrefillOptions po;
    po.importance_window = obs;
    po.importance_pool = 1;  // the mass itself, not SnapKV's max-pooled selection score
    auto pr = model::prefill(m, prompt, po);
    if (!pr.is_ok()) return fail(pr.status());
    std::vector<std::vector<double>> curves(H);
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < Hkv; ++h)
        curves[size_t(l) * size_t(Hkv) + size_t(h)] = kvstore::moa_mass_curve(
            pr->importance[size_t(l)].data() + size_t(h) * size_t(N), N, sink, step);
    const int64_t kept = int64_t(density * double(N)) * int64_t(H);
    auto al = kvstore::moa_allocate(curves, step, kept - int64_t(H) * sink, step);
    if (!al.is_ok()) return fail(al.status());
    double mass = 0, uniform = 0;
    int full = 0;
    const int64_t even = ((kept / int64_t(H) - sink) / step);  // every head alike, in steps
    for (size_t i = 0; i < H; ++i) {
      const int64_t at = al.value()[i] / step;
      mass += curves[i][size_t(at)];
      uniform += curves[i][size_t(std::min<int64_t>(even, int64_t(curves[i].size()) - 1))];
      full += at == int64_t(curves[i].size()) - 1;
      spans[i].push_back(al.value()[i]);
    }
    std::printf(
        "length %lld: prefill %.1f s; spans keep %.4f of the window's mass on average (one "
        "span for every head: %.4f); %d of %zu heads keep the whole prompt\n",
        static_cast<long long>(N), pr->seconds, mass / double(H), uniform / double(H), full, H);
    boost::json::object o;
    o["length"] = N;
    o["mass_kept"] = mass / double(H);
    o["mass_kept_uniform_spans"] = uniform / double(H);
    o["heads_whole_prompt"] = full;
    per_length.push_back(std::move(o));
  }

  boost::json::array layers;
  for (int l = 0; l < L; ++l) {
    boost::json::array heads;
    for (int h = 0; h < Hkv; ++h) {
      const kvstore::MoaSpan f = kvstore::moa_fit(lengths, spans[size_t(l) * size_t(Hkv) + size_t(h)]);
      boost::json::object sp;
      sp["alpha"] = std::round(f.alpha * 100) / 100;
      sp["beta"] = std::round(f.beta * 1e6) / 1e6;
      heads.push_back(std::move(sp));
    }
    layers.push_back(std::move(heads));
  }
  boost::json::object profile;
  profile["command"] = shell_quote_args(argc, argv);
  profile["commit"] = git_commit();
  profile["date"] = now_iso8601();
  profile["document"] = doc_path;
  profile["density"] = density;
  profile["step"] = step;
  profile["obs_window"] = obs;
  profile["measure"] =
      "share of the observation window's attention mass (unpooled SnapKV column sums) within the "
      "sink plus the span, every head weighted alike; spans by a greedy over each head's upper "
      "concave envelope at each length, then alpha + beta * N by least squares across lengths";
  profile["lengths"] = std::move(per_length);
  boost::json::object root;
  root["format"] = "sparsefill-moa-retention";
  root["model"] = cfg.name;
  root["n_layers"] = L;
  root["n_kv_heads"] = Hkv;
  root["sink"] = sink;
  root["layers"] = std::move(layers);
  root["profile"] = std::move(profile);
  const std::string out = a.get("out");
  // What is written must load as a retention config: checked before it replaces anything.
  const std::string json_text = boost::json::serialize(root) + "\n";
  if (auto back = kvstore::moa_config_parse(json_text, out); !back.is_ok()) return fail(back.status());
  if (Status st = write_file_atomic(out, json_text); !st.is_ok()) return fail(st);
  std::printf("wrote %s (%d layers x %d KV heads)\n", out.c_str(), L, Hkv);
  return 0;
}

}  // namespace sf::cli
