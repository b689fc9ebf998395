#include "worker/job_identity.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "common/checksum.h"
#include "worker/options.h"

namespace sf::worker {

namespace fs = std::filesystem;

std::string policy_string(const kvstore::RetentionPolicy& p) {
  std::string s = std::string(kvstore::retention_kind_name(p.kind)) + ":" +
                  kvstore::retention_params(p) + ";sink=" + std::to_string(p.moa_sink);
  char buf[64];
  for (const auto& layer : p.moa)
    for (const auto& sp : layer) {
      std::snprintf(buf, sizeof buf, ";%.17g,%.17g", sp.alpha, sp.beta);
      s += buf;
    }
  return s;
}
int64_t policy_fingerprint(const kvstore::RetentionPolicy& p) {
  const std::string s = policy_string(p);
  return int64_t(xxh64_bytes(s.data(), s.size()) & 0x7fffffffffffffffULL);
}

namespace {

// A file's identity without reading it all: its size and the XXH64 of its first and last MiB
// (a GGUF's header and tensor table are at its start; a requantized or retrained checkpoint of one
// name and geometry differs there or in its size). "" when it cannot be read.
std::string file_identity(const fs::path& p) {
  std::error_code ec;
  const auto size = fs::file_size(p, ec);
  std::ifstream f(p, std::ios::binary);
  if (ec || !f) return "";
  const std::streamsize mib = 1 << 20;
  std::string head(size_t(std::min<uintmax_t>(size, uintmax_t(mib))), '\0'), tail = head;
  f.read(head.data(), std::streamsize(head.size()));
  f.seekg(std::streamoff(size - tail.size()));
  f.read(tail.data(), std::streamsize(tail.size()));
  return std::to_string(size) + ":" + hex64(xxh64_bytes(head.data(), head.size())) + ":" +
         hex64(xxh64_bytes(tail.data(), tail.size()));
}

}  // namespace

// The model's weights as the fingerprint sees them: its file, or a Hugging Face directory's
// config.json and *.safetensors in name order.
std::string model_identity(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return file_identity(path);
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(path, ec))
    if (e.is_regular_file() && (e.path().extension() == ".safetensors" ||
                                e.path().filename() == "config.json"))
      files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string s;
  for (const auto& f : files) s += f.filename().string() + "=" + file_identity(f) + ";";
  return s;
}

// A synthetic model's weights as the fingerprint names them: the shape, layers and seed, and the
// version of DeviceModel::synthetic's drawing (raise it when the drawing changes, so a resume
// does not keep exports of other weights).
std::string synthetic_identity(const model::SyntheticModelSpec& s) {
  return "synthetic-v1:llama3-8b:" + std::to_string(s.config.n_layers) + ":" +
         std::to_string(s.seed);
}

// What a request's export depends on, as 16 hex digits that stay the same across builds: the
// tokens, the retention (moa spans included) and the encodings, then `job`, the job's part: the
// model's compatibility hash and weights (model_identity), --device, the grid and the
// sparsity-aware CP flags (per-chunk estimation and the device's BF16 sums differ with them),
// the attention (a config file by its contents), the export layout and, on GPUs, the linear
// chunk (cuBLASLt picks its algorithm per GEMM shape, so the bytes move with the chunk; the CPU's
// GEMMs give each row the same sums at any chunk); and bf16 host K/V where they change the bytes
// (host_bf16). Resume skips a request only when its summary holds the same one.
std::string job_identity(const Options& o, const std::string& model_compat) {
  std::string job = "model=" + model_compat + ";weights=" +
                    (o.synthetic ? synthetic_identity(*o.synthetic) : model_identity(o.model)) +
                    ";device=" + o.device + ";tp=" + std::to_string(o.tp) +
                    ";cp=" + std::to_string(o.cp) +
                    ";cp_estimate=" + std::to_string(int(o.cp_estimate)) +
                    ";selective_kv=" + std::to_string(int(o.selective_kv)) +
                    ";attention=" + o.attention + ";export=" + o.export_mode;
  if (o.device == "cuda") job += ";chunk=" + std::to_string(o.chunk);
  if (o.attention.rfind("config:", 0) == 0) {
    std::ifstream f(o.attention.substr(7), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    job += ";attention_file=" + hex64(xxh64_bytes(text.data(), text.size()));
  }
  return job;
}

std::string request_fingerprint(const std::vector<int32_t>& tokens,
                                const kvstore::RetentionPolicy& policy,
                                const kvstore::KvEncodings& encs, const std::string& job,
                                bool host_bf16) {
  // bf16 host K/V change the bytes of an export that is not plain bf16, so only those name them.
  const std::string s =
      "tokens=" + hex64(xxh64_bytes(tokens.data(), tokens.size() * sizeof(int32_t))) +
      ";n=" + std::to_string(tokens.size()) + ";retention=" + policy_string(policy) +
      ";kv=" + kvstore::kv_encodings_name(encs) + (host_bf16 && !plain_bf16(encs) ? ";kv_host=bf16" : "") +
      ";" + job;
  return hex64(xxh64_bytes(s.data(), s.size()));
}

}  // namespace sf::worker
