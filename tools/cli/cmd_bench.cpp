// `sparsefill bench prefill`: CPU prefill tokens/s beside the machine's sgemm ceiling, measured
// in the same run through the same BLAS, written as JSON to bench/results/.
#include <cblas.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "common/file_io.h"
#include "common/thread_pool.h"
#include "tools/cli/cli.h"
#include "worker/model/gguf.h"
#include "worker/model/model.h"
#include "worker/model/tokenizer.h"

namespace sf::cli {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best of reps: the ceiling is what the BLAS can reach on this machine right now.
double sgemm_gflops(int m, int n, int k, int reps) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> a(size_t(m) * k), b(size_t(n) * k), c(size_t(m) * n);
  for (auto& x : a) x = u(rng);
  for (auto& x : b) x = u(rng);
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {
    const double t0 = now_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f, a.data(), k, b.data(), k, 0.f, c.data(), n);
    const double dt = now_s() - t0;
    if (r > 0) best = std::min(best, dt);  // first call warms up threads and pages
  }
  return 2.0 * m * n * k / best / 1e9;
}

// FLOPs of one prefill of S tokens as the forward computes them (causal attention counted as
// the triangle actually evaluated by the reference kernel rounded to 64-row blocks is ignored:
// we count the exact causal triangle, the standard convention).
double prefill_flops(const model::ModelConfig& c, int64_t S) {
  const double H = c.hidden, qd = double(c.n_heads) * c.head_dim, kvd = double(c.n_kv_heads) * c.head_dim;
  const double lin = 2.0 * S * (H * qd + 2 * H * kvd + qd * H + 3 * H * c.intermediate);
  const double attn = 2.0 * 2.0 * c.n_heads * c.head_dim * (double(S) * (S + 1) / 2);
  return c.n_layers * (lin + attn) + 2.0 * H * c.vocab;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[2]) == "attention") return cmd_bench_attention(argc, argv);
  if (argc < 3 || std::string(argv[2]) != "prefill") {
    std::fprintf(stderr, "error: usage: sparsefill bench prefill [--model M] [--lengths 512,2048,8192] [--out F] [--reps N] | bench attention [...]\n");
    return 2;
  }
  auto args_r = parse_args(argc, argv, 3, {"model", "lengths", "out", "reps", "document"}, {});
  if (!args_r.is_ok()) return fail(args_r.status());
  const Args& a = args_r.value();
  const std::string model_path = resolve_model(a.get("model", "default"));
  auto lengths_r = parse_int_list(a.get("lengths", "512,2048,8192"), "--lengths", 1);
  if (!lengths_r.is_ok()) return fail(lengths_r.status());
  const std::vector<int64_t> lengths = std::move(lengths_r).value();
  auto reps_r = a.get_int("reps", 3, 1, 100000);
  if (!reps_r.is_ok()) return fail(reps_r.status());
  const int reps = int(reps_r.value());
  if (a.has("out")) {
    if (Status st = check_output_file(a.get("out"), "--out"); !st.is_ok()) return fail(st);
  }
  // The benchmark's text: a --document that cannot be read is an error, never random tokens.
  const std::string doc_path = a.get("document", std::string(SF_SOURCE_DIR) + "/data/long_document.txt");
  auto doc_text = read_file(doc_path, "document");
  if (a.has("document") && !doc_text.is_ok()) return fail(doc_text.status());

  auto mr = model::Model::load(model_path);
  if (!mr.is_ok()) return fail(mr.status());
  const model::Model& m = mr.value();
  const auto& cfg = m.config();
  for (int64_t L : lengths)
    if (cfg.max_context > 0 && L > cfg.max_context)
      return fail(SF_ERR(kOutOfRange, "--lengths: " + std::to_string(L) + " exceeds the model context of " +
                                          std::to_string(cfg.max_context)));

  // Real text tokens (the bundled document, repeated if needed), never zeros.
  std::vector<int32_t> doc;
  std::string doc_source = !doc_text.is_ok() ? "random token ids (the bundled document could not be read: " +
                                                   doc_text.status().message() + ")"
                                             : "random token ids (the model has no GGUF tokenizer)";
  if (m.format() == model::ModelFormat::kGguf && doc_text.is_ok()) {
    auto g = model::GgufFile::open(model_path);
    auto spec = g.is_ok() ? model::tokenizer_spec_from_gguf(g.value(), model::TokenizerCompat::kGguf) : Result<model::TokenizerSpec>(g.status());
    if (spec.is_ok()) {
      auto tok = model::Tokenizer::create(std::move(spec).value());
      if (tok.is_ok()) doc = tok->encode(doc_text.value(), true, false);
    }
    if (!doc.empty()) doc_source = doc_path;
  }
  if (doc.empty() && a.has("document"))
    return fail(SF_ERR(kUnsupported, "--document needs a model with a GGUF tokenizer"));
  if (doc.empty()) {
    std::mt19937 rng(1);
    for (int i = 0; i < 4096; ++i) doc.push_back(int32_t(rng() % uint32_t(cfg.vocab)));
  }

  // The ceiling is the BLAS at its best on this machine: its own threads on every core (the
  // forward itself drives single-threaded BLAS calls from sparsefill's pool).
  const int blas_threads_run = openblas_get_num_threads();
  openblas_set_num_threads(num_threads());
  const double ceiling = sgemm_gflops(2048, 2048, 2048, 5);
  const double ceiling_model = sgemm_gflops(512, cfg.intermediate, cfg.hidden, 5);
  openblas_set_num_threads(blas_threads_run);
  std::printf("sgemm ceiling: %.1f GFLOP/s (2048^3), %.1f GFLOP/s (512x%dx%d, the model's MLP shape)\n", ceiling,
              ceiling_model, cfg.intermediate, cfg.hidden);

  boost::json::array recs;
  {  // warm-up: page in weights, start thread pools
    std::vector<int32_t> w(doc.begin(), doc.begin() + std::min<size_t>(doc.size(), 128));
    auto r = model::prefill(m, w, {});
    if (!r.is_ok()) return fail(r.status());
  }
  for (int64_t L : lengths) {
    std::vector<int32_t> ids;
    while (int64_t(ids.size()) < L) ids.insert(ids.end(), doc.begin(), doc.end());
    ids.resize(size_t(L));
    model::PrefillOptions opt;
    opt.keep_kv = false;
    std::vector<double> ts;
    const int n_rep = L >= 8192 ? 1 : reps;
    for (int r = 0; r < n_rep; ++r) {
      auto pr = model::prefill(m, ids, opt);
      if (!pr.is_ok()) return fail(pr.status());
      ts.push_back(pr->seconds);
    }
    std::sort(ts.begin(), ts.end());
    const double t = ts[ts.size() / 2];
    const double fl = prefill_flops(cfg, L);
    const double gf = fl / t / 1e9;
    std::printf("prefill %6lld tokens: %8.3f s  %8.1f tokens/s  %7.1f GFLOP/s  %.2f of sgemm ceiling\n",
                static_cast<long long>(L), t, double(L) / t, gf, gf / ceiling);
    boost::json::object o;
    o["seq_len"] = L;
    o["prefill_s"] = t;
    o["reps"] = n_rep;
    o["tokens_per_s"] = double(L) / t;
    o["gflop"] = fl / 1e9;
    o["achieved_gflops"] = gf;
    o["ratio_to_sgemm_ceiling"] = gf / ceiling;
    recs.push_back(std::move(o));
  }

  boost::json::object out;
  out["benchmark"] = "prefill-cpu";
  out["date"] = now_iso8601();
  out["git_commit"] = git_commit();
  out["command"] = shell_quote_args(argc, argv);
  boost::json::object dev = cpu_device_json();
  dev["blas"] = openblas_get_config();
  dev["blas_threads_ceiling"] = num_threads();
  dev["blas_threads_in_forward"] = 1;
  out["device"] = std::move(dev);
  boost::json::object mo;
  mo["path"] = model_path;
  mo["name"] = cfg.name;
  mo["n_layers"] = cfg.n_layers;
  mo["hidden"] = cfg.hidden;
  mo["dtype"] = "F32 (dequantized at load)";
  out["model"] = std::move(mo);
  out["sgemm_gflops_2048"] = ceiling;
  out["sgemm_gflops_model_shape"] = ceiling_model;
  out["document"] = doc_source;  // the prompts' text, repeated to each length
  out["records"] = std::move(recs);
  const std::string js = boost::json::serialize(out);
  if (a.has("out")) {
    if (Status st = write_file_atomic(a.get("out"), js + "\n"); !st.is_ok()) return fail(st);
    std::printf("wrote %s\n", a.get("out").c_str());
  } else {
    std::printf("%s\n", js.c_str());
  }
  return 0;
}

}  // namespace sf::cli
