// sparsefill CLI: prefill, bench, inspect, eval, search, moa-profile.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "tools/cli/cli.h"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: sparsefill <command> [options]\n"
               "  prefill  --model PATH|default (--prompt-file F | --prompt TEXT) [--export-kv DIR [--retention POLICY]\n"
               "           [--importance lse|estimator]] [--force]\n"
               "           [--allow-long] [--chunk N] [--tokenizer gguf|hf] [--print-tokens]\n"
               "           [--attention dense|a-shape|vertical-slash|block-sparse|moa|adaptive|config:FILE]\n"
               "           [--device cpu|cuda] [--kv-pool host=BYTES,disk=DIR[:BYTES]]  (sizes: 4096, 64K, 64M, 2G)\n"
               "  bench    prefill [--model PATH|default] [--lengths 512,2048,8192] [--out FILE.json]\n"
               "  bench    attention [--lengths 8192,32768] [--sparse-lengths 32768] [--dtypes fp32,bf16] [--reps N] [--blocks K]\n"
               "           [--sdpa PEER.json] [--seed S] [--heads 32 --kv-heads 8 --head-dim 128] [--out FILE.json]\n"
               "  inspect  --model PATH|default\n"
               "  eval     --model PATH|default --attention MODE [--lengths 2048,4096,8192] [--document F[,F2..]]\n"
               "           [--passkey-trials N] [--passkey-level 0-3] [--reps N] [--no-passkey] [--dump-nll PREFIX] --out FILE.json\n"
               "  eval     --retention full|streaming|snapkv|adakv|pyramid|layerwise|moa[:config=F[,sink=S]][,...]\n"
               "           [--budget 0.1,0.25,0.5] [--span 1[,N...]]\n"
               "           [--decode full|psa[-avg][+gqa]:EPS[,...]] [--psa EPS|psa[-avg][+gqa]:EPS[,...]] [--length 8192] [--tokens 64]\n"
               "           [--windows K] [--passkey-trials N]\n"
               "           [--passkey-depths D] [--passkey-level 0-3] [--no-passkey] [--out-dir DIR] [--name SUFFIX]\n"
               "  search   --model PATH|default --calib F[,F2..] --target-density D --out configs/NAME.json [--length L]\n"
               "           [--allocation global|uniform] [--patterns a-shape,vertical-slash,block-sparse] [--rows N] [--spread-rows N] [--segment-rows N]\n           [--objective log-recall|recall] [--share-group]\n"
               "  moa-profile --out FILE.json [--model PATH|default] [--document F[,F2..]] [--lengths 2048,4096,8192]\n"
               "           [--density 0.25] [--sink 64] [--step 64] [--obs-window 32]\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "prefill") return sf::cli::cmd_prefill(argc, argv);
    if (cmd == "bench") return sf::cli::cmd_bench(argc, argv);
    if (cmd == "inspect") return sf::cli::cmd_inspect(argc, argv);
    if (cmd == "eval") {
      // KV retention evaluation lives in cmd_retention_eval.cpp.
      for (int i = 2; i < argc; ++i)
        if (!std::strcmp(argv[i], "--retention")) return sf::cli::cmd_retention_eval(argc, argv);
      return sf::cli::cmd_eval(argc, argv);
    }
    if (cmd == "search") return sf::cli::cmd_search(argc, argv);
    if (cmd == "moa-profile") return sf::cli::cmd_moa_profile(argc, argv);
  } catch (const std::exception& e) {  // process edge: nothing escapes as a crash
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "error: unknown command '%s'\n", cmd.c_str());
  usage();
  return 2;
}
