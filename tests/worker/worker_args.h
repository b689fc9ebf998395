// sparsefill-worker's command line for the unit tests: parse_options on a list of arguments.
#pragma once
#include <string>
#include <vector>

#include "worker/options.h"

namespace sf::worker {

// The options after the program name; `required` puts --model, --batch and --out first.
inline Result<Options> parse_worker_args(const std::vector<std::string>& extra, bool required = true) {
  std::vector<std::string> a{"sparsefill-worker"};
  if (required) a.insert(a.end(), {"--model", "m.gguf", "--batch", "b.jsonl", "--out", "o"});
  a.insert(a.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (auto& s : a) argv.push_back(s.data());
  return parse_options(int(argv.size()), argv.data());
}

}  // namespace sf::worker
