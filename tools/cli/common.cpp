#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <optional>
#include <string_view>
#include <thread>

#include "common/thread_pool.h"
#include "tools/cli/cli.h"
#include "worker/model/model.h"

namespace sf::cli {

void print_usage(FILE* to) {
  std::fprintf(to,
               "usage: sparsefill <command> [options]   (sparsefill --help, or sparsefill <command> --help)\n"
               "  prefill  --model PATH|default (--prompt-file F | --prompt TEXT | --prompt-tokens F)\n"
               "           [--export-kv DIR [--retention POLICY] [--importance lse|estimator]\n"
               "            [--kv-dtype auto|f32|bf16|int8|int4|HIGH+LOW]] [--force]\n"
               "           [--allow-long] [--chunk N] [--tokenizer gguf|hf] [--print-tokens]\n"
               "           [--attention dense|a-shape|vertical-slash|block-sparse|moa|adaptive|adaptive-vs|adaptive-block|config:FILE]\n"
               "           [--device cpu|cuda] [--dump-attention LAYER:FILE.safetensors]\n"
               "           [--kv-pool host=BYTES,disk=DIR[:BYTES] | --kv-pool device=BYTES,host=BYTES[,disk=DIR[:BYTES]]\n"
               "            [--metrics-file F.prom]]\n"
               "           (sizes: 4096, 64K, 64M, 2G; device= needs --device cuda)\n"
               "  bench    prefill [--model PATH|default] [--lengths 512,2048,8192] [--reps 3] [--document F]\n"
               "           [--out FILE.json]\n"
               "  bench    attention [--lengths 8192,32768] [--sparse-lengths 32768] [--dtypes fp32,bf16] [--reps N]\n"
               "           [--blocks K] [--modes M[,M..]] [--mainloops L[,L..]] [--inputs FILE.safetensors]\n"
               "           [--sdpa PEER.json] [--seed S] [--heads 32 --kv-heads 8 --head-dim 128]\n"
               "           [--host-estimate-max N] [--dense-ours-max N] [--sparse-memory-gb G] [--cp-sizes 2,4,8]\n"
               "           [--planted-rope-base B] [--planted-diag-logit X] [--out FILE.json]\n"
               "           [--seed S --dump-inputs PREFIX]  (writes PREFIX-<L>.safetensors, the planted q/k/v, and stops)\n"
               "  inspect  --model PATH|default\n"
               "  eval     --model PATH|default --attention MODE [--lengths 2048,4096,8192] [--document F[,F2..]]\n"
               "           [--passkey-trials N] [--passkey-level 0-3] [--reps N] [--seed S] [--no-passkey]\n"
               "           [--dump-nll PREFIX] [--out FILE.json (default bench/results/eval-MODE.json in the source tree)]\n"
               "  eval     --retention full|streaming|snapkv|adakv|pyramid|layerwise|moa[:config=F[,sink=S]][,...]\n"
               "           [--budget 0.1,0.25,0.5] [--span 1[,N...]] [--kv-dtype ENC[,ENC..]] [--kv-ref-dtype ENC]\n"
               "           [--decode full|psa[-avg][+gqa]:EPS[:verifyN[:MARGIN]][,...]] [--psa EPS|MODE[,...]]\n"
               "           [--length 8192] [--tokens 64] [--obs-window 32] [--windows K] [--document F]\n"
               "           [--passkey-trials N] [--passkey-depths D] [--passkey-level 0-3] [--no-passkey]\n"
               "           [--out-dir DIR (default bench/results in the source tree)] [--name SUFFIX]\n"
               "  search   --model PATH|default --calib F[,F2..] --target-density D --out configs/NAME.json [--length L]\n"
               "           [--allocation global|uniform] [--patterns a-shape,vertical-slash,block-sparse,adaptive-vs]\n"
               "           [--rows N] [--spread-rows N] [--segment-rows N] [--dense-below N] [--seed S]\n"
               "           [--objective log-recall|recall] [--share-group]\n"
               "  moa-profile --out FILE.json [--model PATH|default] [--document F[,F2..]] [--lengths 2048,4096,8192]\n"
               "           [--density 0.25] [--sink 64] [--step 64] [--obs-window 32]\n");
}


Result<Args> parse_args(int argc, char** argv, int first, const std::vector<std::string>& valued,
                        const std::vector<std::string>& flags) {
  SF_ASSIGN(Args a, ::sf::parse_args(argc, argv, first, valued, flags));
  if (a.help) {  // the usage of every command on stdout, exit 0, before anything else is checked
    print_usage(stdout);
    std::exit(0);
  }
  return a;
}

std::string resolve_model(const std::string& m) { return model::resolve_model_path(m, SF_SOURCE_DIR); }

Result<std::string> read_text_files(const std::string& list, const char* what) {
  std::string all;
  SF_ASSIGN(const std::vector<std::string> items, parse_list(list, std::string("the ") + what + " list"));
  for (const std::string& item : items) {
    SF_ASSIGN(std::string text, read_file(item, what));
    if (!all.empty()) all += "\n\n";
    all += text;
  }
  if (all.empty()) return SF_ERR(kInvalidArgument, std::string("the ") + what + " '" + list + "' is empty");
  return all;
}

namespace {
std::string run_capture(const char* cmd) {
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    std::array<char, 256> b{};
    while (fgets(b.data(), int(b.size()), p)) out += b.data();
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}
}  // namespace

std::string git_commit() {
  // A copy of the tree whose .git is not its own (the GPU hosts get such a copy) names its
  // commit through SF_SOURCE_COMMIT (bench/gpu/run.sh reads it from .source-commit).
  if (const char* e = std::getenv("SF_SOURCE_COMMIT"); e && *e) return std::string(e) + " (SF_SOURCE_COMMIT)";
  std::string c = run_capture(("git -C '" + std::string(SF_SOURCE_DIR) + "' rev-parse HEAD 2>/dev/null").c_str());
  if (c.empty()) return "unknown";
  if (!run_capture(("git -C '" + std::string(SF_SOURCE_DIR) + "' status --porcelain --untracked-files=no 2>/dev/null").c_str()).empty())
    c += "-dirty";
  return c;
}


Result<std::vector<std::string>> parse_list(const std::string& s, const std::string& what) {
  if (s.empty()) return SF_ERR(kInvalidArgument, what + " is empty");
  std::vector<std::string> out;
  for (size_t b = 0;;) {
    const size_t e = s.find(',', b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (out.back().empty())
      return SF_ERR(kInvalidArgument, what + ": '" + s + "' has an empty item");
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

Result<std::vector<int64_t>> parse_int_list(const std::string& s, const std::string& what,
                                            int64_t lo, bool allow_empty) {
  std::vector<int64_t> v;
  if (s.empty() && allow_empty) return v;
  SF_ASSIGN(const std::vector<std::string> items, parse_list(s, what));
  for (const std::string& item : items) {
    int64_t x = 0;
    if (!whole_int(item, &x) || x < lo)
      return SF_ERR(kInvalidArgument,
                    what + ": '" + item + "' is not an integer >= " + std::to_string(lo));
    v.push_back(x);
  }
  return v;
}

Result<std::vector<int64_t>> parse_length_list(const std::string& s) {
  return parse_int_list(s, "--lengths", 256);
}

int fail(const Status& st) {
  std::fprintf(stderr, "error: %s\n", st.message().c_str());
  return 1;
}

boost::json::object cpu_device_json() {
  boost::json::object dev;
  dev["kind"] = "cpu";
  dev["name"] = cpu_name();
  dev["hardware_threads"] = int(std::thread::hardware_concurrency());
  dev["sf_threads"] = num_threads();
  return dev;
}

std::string shell_quote_args(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i == 0) {
      auto p = a.rfind('/');
      a = p == std::string::npos ? a : a.substr(p + 1);
    }
    if (i) s += ' ';
    // Quoted unless every character is safe unquoted, so the recorded command runs as given.
    const bool safe = !a.empty() && std::all_of(a.begin(), a.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("_./=:,+@%-", c) != nullptr;
    });
    if (safe) {
      s += a;
    } else {
      s += '\'';
      for (char c : a) s += c == '\'' ? std::string("'\\''") : std::string(1, c);
      s += '\'';
    }
  }
  return s;
}

}  // namespace sf::cli
