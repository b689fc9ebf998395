#include "worker/request_resume.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "worker/job_comm.h"

namespace sf::worker {

ResumeState resume_state(const Options& o, runtime::GridComms& g, const runtime::BatchRequest& r,
                         const std::string& fingerprint) {
  // 1 complete, 0 compute, -1 failed: one broadcast carries the leader's answer.
  int32_t state = g.leader() && runtime::request_complete(o.out, r.id, fingerprint) ? 1 : 0;
  if (g.leader() && state == 0) {
    const std::string why = runtime::request_stale_reason(o.out, r.id, fingerprint);
    std::error_code ec;
    const std::string summary = runtime::request_dir(o.out, r.id) + ".json";
    std::filesystem::remove(summary, ec);
    if (!ec && !why.empty())
      std::printf("[group %d] %s: %s; computed again\n", g.group, r.id.c_str(), why.c_str());
    if (ec) {
      state = -1;
      std::fprintf(stderr,
                   "%s:%lld: request '%s' failed: cannot remove its old summary '%s' before "
                   "replacing its export: %s\n",
                   o.batch.c_str(), static_cast<long long>(r.line), r.id.c_str(), summary.c_str(),
                   ec.message().c_str());
    }
  }
  if (Status st = g.group_comm->bcast(&state, 1, DType::kI32, 0); !st.is_ok()) end_job(st);
  return state > 0 ? ResumeState::kComplete : state < 0 ? ResumeState::kFailed : ResumeState::kCompute;
}

}  // namespace sf::worker
