// sparsefill CLI: prefill, bench, inspect, eval, search, moa-profile.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <exception>
#include <string>

#include "tools/cli/cli.h"

namespace {

void usage(FILE* to) {
  std::fprintf(to,
               "usage: sparsefill <command> [options]   (sparsefill --help, or sparsefill <command> --help)\n"
               "  prefill  --model PATH|default (--prompt-file F | --prompt TEXT | --prompt-tokens F)\n"
               "           [--export-kv DIR [--retention POLICY] [--importance lse|estimator]\n"
               "            [--kv-dtype f32|bf16|int8|int4|HIGH+LOW]] [--force]\n"
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  // --help anywhere an option can stand: the usage on stdout, exit 0 (one text serves every
  // command). After a valued option it is that option's value (--prompt -h), not a request.
  static const char* const kFlags[] = {"--force", "--allow-long", "--print-tokens", "--no-passkey",
                                       "--share-group", "--help", "-h"};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-h") && std::strcmp(argv[i], "--help")) continue;
    const char* prev = argv[i - 1];
    const bool after_flag = std::any_of(std::begin(kFlags), std::end(kFlags),
                                        [&](const char* f) { return !std::strcmp(prev, f); });
    // "--key=value" is complete: what follows it is not its value.
    if (i <= 2 || std::strncmp(prev, "--", 2) != 0 || after_flag || std::strchr(prev, '=')) {
      usage(stdout);
      return 0;
    }
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "prefill") return sf::cli::cmd_prefill(argc, argv);
    if (cmd == "bench") return sf::cli::cmd_bench(argc, argv);
    if (cmd == "inspect") return sf::cli::cmd_inspect(argc, argv);
    if (cmd == "eval") {
      // KV retention evaluation lives in cmd_retention_eval.cpp.
      for (int i = 2; i < argc; ++i)
        if (!std::strcmp(argv[i], "--retention") || !std::strncmp(argv[i], "--retention=", 12))
          return sf::cli::cmd_retention_eval(argc, argv);
      return sf::cli::cmd_eval(argc, argv);
    }
    if (cmd == "search") return sf::cli::cmd_search(argc, argv);
    if (cmd == "moa-profile") return sf::cli::cmd_moa_profile(argc, argv);
  } catch (const std::exception& e) {  // process edge: nothing escapes as a crash
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "error: unknown command '%s'\n", cmd.c_str());
  usage(stderr);
  return 2;
}
