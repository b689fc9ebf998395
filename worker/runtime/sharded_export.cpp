#include "worker/runtime/sharded_export.h"

#include <filesystem>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace sf::runtime {
namespace fs = std::filesystem;

Status export_sharded(GridComms& g, const std::string& dir, const kvstore::KvExportSpec& spec,
                      const model::KvCache& local) {
  comm::Communicator& c = *g.group_comm;
  auto bcast_str = [&](std::string* str) -> Status {
    int64_t n = int64_t(str->size());
    SF_TRY(c.bcast(&n, 1, DType::kI64, 0));
    str->resize(size_t(n));
    return c.bcast(str->data(), n, DType::kU8, 0);
  };
  std::string tmp;
  Status opened = Status::ok();
  if (g.leader()) {
    auto t = kvstore::begin_export(dir, /*force=*/true);
    if (t.is_ok())
      tmp = t.value();
    else
      opened = t.status();
  }
  SF_TRY(bcast_str(&tmp));
  if (tmp.empty()) return g.leader() ? opened : SF_ERR(kIo, "the leader could not open the export");

  // This rank's part: its CP chunks (merged when adjacent) of its TP slice's KV heads.
  kvstore::KvShardPart part;
  for (const TokenRange& p : cp_rank_pieces(spec.n_tokens, g.shape.cp, g.cp_rank))
    part.tokens.push_back({p.begin, p.end});
  part.n_kv_heads = local.n_kv_heads;
  part.kv_head0 = g.tp_rank * local.n_kv_heads;
  part.rank = c.rank();
  part.file_tag = ".r" + std::to_string(c.rank());
  // What goes to the leader: "ok" and one entry per line, or "error" and the message.
  std::string mine = "ok";
  if (!part.tokens.empty()) {
    auto e = kvstore::export_kv_shards(
        tmp, spec, part, [&](int l, bool v) { return (v ? local.v : local.k)[size_t(l)].data(); });
    if (!e.is_ok()) {
      mine = "error\nrank " + std::to_string(c.rank()) + ": " + e.status().message();
    } else {
      for (const std::string& x : e.value()) mine += "\n" + x;
    }
  }
  const int n = c.size();
  std::vector<int64_t> lens(static_cast<size_t>(n));
  const int64_t my_len = int64_t(mine.size());
  SF_TRY(c.all_gather(&my_len, lens.data(), 1, DType::kI64));
  int64_t total = 0;
  for (int64_t x : lens) total += x;
  std::string all(size_t(total), '\0');
  SF_TRY(c.all_gatherv(mine.data(), my_len, all.data(), lens, DType::kU8));
  Status st = Status::ok();
  if (g.leader()) {
    std::vector<std::string> entries;
    int64_t off = 0;
    for (int r = 0; r < n && st.is_ok(); ++r) {
      std::istringstream in(all.substr(size_t(off), size_t(lens[size_t(r)])));
      off += lens[size_t(r)];
      std::string line;
      std::getline(in, line);
      if (line != "ok") {
        std::string msg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        st = SF_ERR(kIo, "sharded export: " + msg);
        break;
      }
      while (std::getline(in, line)) entries.push_back(line);
    }
    if (st.is_ok()) {
      st = kvstore::export_kv_manifest(tmp, spec, entries);
      if (st.code() == Code::kNotFound)  // a shard the leader cannot see
        st = SF_ERR(kIo, "sharded export: " + st.message() +
                             " as the group leader sees it (--out must be on a filesystem every "
                             "rank of the group shares; --export gathered writes everything "
                             "from the leader)");
    }
    if (st.is_ok()) st = kvstore::finish_export(tmp, dir);
    if (!st.is_ok()) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  // Every rank learns the outcome (the leader's message).
  std::string msg = st.is_ok() ? std::string() : st.message();
  SF_TRY(bcast_str(&msg));
  return msg.empty() ? Status::ok() : SF_ERR(kIo, msg);
}

}  // namespace sf::runtime
