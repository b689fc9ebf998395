// A batch's lines against the job: tokenized, their ids inside the vocabulary, their length
// within the model's context, their retention budgets against the prompt, and their encodings
// against the job's host K/V. Every rank runs the same checks on the same text, so each rank
// reaches the same lines (a moa config read on one host is the exception the job agrees over).
#pragma once
#include <vector>

#include "worker/model/config.h"
#include "worker/model/tokenizer.h"
#include "worker/options.h"
#include "worker/runtime/batch.h"

namespace sf::worker {

// The requests of `bf` that pass, in file order; each one that does not becomes a BadLine in
// bf.bad with the reason a user reads. `tok` may be null (a model without tokenizer support):
// prompts given as text are then bad lines. Lines given as text are tokenized in place. Ids may
// still repeat: the job settles them once its ranks agree on the lines (runtime::first_of_each_id
// after agree_requests), so a line refused anywhere leaves its id to a corrected later line.
std::vector<runtime::BatchRequest> check_requests(runtime::BatchFile& bf,
                                                  const model::ModelConfig& cfg,
                                                  const model::Tokenizer* tok, const Options& o);

}  // namespace sf::worker
