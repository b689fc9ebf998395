// The identities a worker job compares: a retention policy's fingerprint (every rank must hold
// the same spans), a model's weights without reading them all, and a request's export
// fingerprint, which resume checks before it skips a request.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kvstore/kv_quant.h"
#include "kvstore/retention.h"
#include "worker/model/config.h"

namespace sf::worker {

struct Options;

// A retention policy as text (moa spans included), and as a number every rank can compare: a
// moa config is read from each rank's own filesystem, so two ranks may hold different spans
// under the same spec.
std::string policy_string(const kvstore::RetentionPolicy& p);
int64_t policy_fingerprint(const kvstore::RetentionPolicy& p);

// The model's weights as the fingerprint sees them: a file's size and the XXH64 of its first and
// last MiB, or a Hugging Face directory's config.json and *.safetensors in name order.
std::string model_identity(const std::string& path);
// A synthetic model's: its shape, layers, seed and the version of its drawing.
std::string synthetic_identity(const model::SyntheticModelSpec& s);

// The job's part of every request's fingerprint: the model (model_compat, the export spec's
// compatibility hash, and the weights' identity) and the options that change what a prefill
// computes (device, grid, sparsity-aware CP, attention with its config file's contents, export
// mode). Read on each rank's host, so the ranks compare it before computing anything.
std::string job_identity(const Options& o, const std::string& model_compat);

// What a request's export depends on, as 16 hex digits (the definition says what goes in).
std::string request_fingerprint(const std::vector<int32_t>& tokens,
                                const kvstore::RetentionPolicy& policy,
                                const kvstore::KvEncodings& encs, const std::string& job,
                                bool host_bf16);

}  // namespace sf::worker
