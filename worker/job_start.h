// The worker job's start-up steps (worker_main.cpp's run(), before the first request), each
// collective over the world. Every rank reaches the same outcome: a step that fails returns the
// job's exit (JobExit) on every rank alike, and a communication failure ends the job at once
// (end_job), since ranks may then be stuck in a collective.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/model/tokenizer.h"
#include "worker/options.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/grid.h"

namespace sf::worker {

// How the job ends when a start-up step fails: the exit code and the message, printed once
// (rank 0) or by every rank (a rank's own failure, such as a model it cannot load).
struct JobExit {
  int code = 0;
  std::string message;
  bool every_rank = false;
};

// Options are parsed on every rank; a --retention moa config is read on each rank's host, so one
// rank may fail where the others do not, or read other spans, and an MPMD launch may pass other
// flags: all are agreed before going on. Exit 2 (with the usage on rank 0) on any difference.
std::optional<JobExit> agree_options(comm::Communicator& world, const Result<Options>& opts);

// Before any rank spends minutes loading the model (or takes a GPU): one job an output directory
// (rank 0 creates --out and holds its lock until the process ends; under it, what a killed job
// left half written goes), then each group leader's --metrics-file writable and an earlier job's
// removed. Exit 2 on any rank's failure. Nothing is written for a dry run.
std::optional<JobExit> claim_output(comm::Communicator& world, const Options& o,
                                    const runtime::GridShape& shape, int n_groups);

// The batch file, read on rank 0 and broadcast (other hosts need no copy). Exit 2 if rank 0
// cannot read it.
std::optional<JobExit> read_batch(comm::Communicator& world, const Options& o, std::string* text);

// Every rank loads the model (or its shape, for --model synthetic:...); one rank's failure is
// every rank's, printed by each (exit 1). The wait gets ten times the deadline: loading takes
// each rank a different time. SF_WORKER_FAULT=load:R fails world rank R's load.
std::optional<JobExit> load_model(comm::Communicator& world, const Options& o,
                                  bool fault_load, Result<model::Model>* out);

// The model against the options: it divides by --tp, the retention's geometry fits, and a sparse
// --attention builds its config (a config file is read on each rank's host). Then every rank
// holds the same weights and config (the job identity's hash). Exit 2 otherwise.
std::optional<JobExit> check_model(comm::Communicator& world, const Options& o,
                                   const model::Model& m, const std::string& job,
                                   std::optional<model::SparseConfig>* sparse);

// The GGUF's tokenizer, when the model has weights from a GGUF (prompts given as text need it).
// None for other models; none with *why set when the GGUF's tokenizer cannot be built (an
// unsupported pre-tokenizer, a corrupt vocabulary), so the job can say why prompts are refused.
std::optional<model::Tokenizer> load_tokenizer(const Options& o, const model::Model& m,
                                               std::string* why);

// A line's own retention may name a moa config, read on each rank's host: keeps only the lines
// every rank accepted with the same policy (the others join bf->bad), so every group sees the
// same requests.
void agree_requests(comm::Communicator& world, runtime::BatchFile* bf,
                    std::vector<runtime::BatchRequest>* good);

}  // namespace sf::worker
