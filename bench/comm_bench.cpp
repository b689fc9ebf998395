// NCCL all-gather bandwidth at the sizes of a CP rank's K (or V) per layer (issue 5): the device
// CP exchange's Communicator::all_gatherv (a grouped ncclBroadcast per rank; here with the last
// rank one 64-token row block short, as zigzag chunks of a prompt not divisible by 2 x CP are)
// against Communicator::all_gather (one ncclAllGather, equal blocks), on device buffers.
//
//   mpirun -np N sf_bench_comm [--mib 100,400,800] [--reps 5] [--out R.json]
//
// One rank per GPU. Each size: a warm-up, then --reps timed calls (host wall time until the
// communicator's wait returns), median reported. Data: each rank's rank-dependent ramp, checked
// once after the timed calls on every rank, so a fast wrong gather cannot pass as a bandwidth.
// Prints (rank 0) one JSON record per (size, path): bytes received per rank, median seconds,
// GB/s; --out writes them with the device, driver, date, commit and command.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/mpi_world.h"
#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "common/args.h"
#include "common/text.h"
#include "common/timing.h"

#if SF_HAVE_NCCL
#include <cuda_runtime.h>
#endif

namespace sf {
namespace {

struct BenchArgs {
  std::vector<int64_t> mib{100, 400, 800};
  int reps = 5;
  std::string out;
};

// Through the project's one option parser (common/args.h): unknown or repeated options and
// values that are not whole numbers in range are errors naming the option.
Result<BenchArgs> parse(int argc, char** argv) {
  SF_ASSIGN(const Args args, parse_args(argc, argv, 1, {"mib", "reps", "out"}, {}));
  BenchArgs a;
  if (args.has("mib")) {
    a.mib.clear();
    std::stringstream ss(args.get("mib"));
    for (std::string x; std::getline(ss, x, ',');) {
      int64_t m = 0;
      if (!whole_int(x, &m) || m < 1 || m > 16384)
        return SF_ERR(kInvalidArgument, "--mib: '" + x + "' is not a whole number in [1, 16384]");
      a.mib.push_back(m);
    }
  }
  SF_ASSIGN(const int64_t reps, args.get_int("reps", a.reps, 1, 1000));
  a.reps = int(reps);
  a.out = args.get("out");
  if (a.mib.empty()) return SF_ERR(kInvalidArgument, "--mib: no sizes");
  return a;
}

#if SF_HAVE_NCCL
// One size, one path: the median seconds of reps calls, and whether the last call's data
// (every rank's ramp, in rank order) arrived intact.
Result<std::pair<double, bool>> time_gather(comm::Communicator& c, const std::vector<int64_t>& counts,
                                            uint16_t* send, uint16_t* recv, int reps) {
  const int me = c.rank();
  int64_t total = 0;
  for (int64_t x : counts) total += x;
  std::vector<uint16_t> h(static_cast<size_t>(counts[size_t(me)]));
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint16_t((i * 7 + size_t(me) * 1009) & 0xffff);
  if (cudaMemcpy(send, h.data(), h.size() * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemset(recv, 0xff, size_t(total) * 2) != cudaSuccess)
    return SF_ERR(kInternal, "comm bench: device buffer setup failed");
  std::vector<double> t;
  for (int rep = 0; rep <= reps; ++rep) {
    SF_TRY(c.barrier());
    const auto t0 = std::chrono::steady_clock::now();
    if (std::all_of(counts.begin(), counts.end(), [&](int64_t x) { return x == counts[0]; }))
      SF_TRY(c.all_gather(send, recv, counts[0], DType::kBF16));
    else
      SF_TRY(c.all_gatherv(send, counts[size_t(me)], recv, counts, DType::kBF16));
    if (rep > 0) t.push_back(sf::seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  std::vector<uint16_t> got(static_cast<size_t>(total));
  if (cudaMemcpy(got.data(), recv, got.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
    return SF_ERR(kInternal, "comm bench: read-back failed");
  bool ok = true;
  for (size_t r = 0, off = 0; r < counts.size(); off += size_t(counts[r]), ++r)
    for (int64_t i = 0; i < counts[r] && ok; i += 4099)
      ok = got[off + size_t(i)] == uint16_t((size_t(i) * 7 + r * 1009) & 0xffff);
  return std::make_pair(t[t.size() / 2], ok);
}
#endif

int run(int argc, char** argv) {
  std::unique_ptr<comm::Communicator> world = bench::mpi_world(&argc, &argv);
  if (!world) return 2;
  const bool rank0 = world->rank() == 0;
  int rc = 0;
  auto args = parse(argc, argv);
  if (!args.is_ok()) {
    if (rank0) std::fprintf(stderr, "error: %s\n", args.status().message().c_str());
    rc = 2;
  }
#if SF_HAVE_NCCL
  int ndev = 0;
  if (rc == 0 && (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1)) {
    if (rank0) std::fprintf(stderr, "error: no CUDA device\n");
    rc = 1;
  }
  std::unique_ptr<comm::Communicator> nc;
  if (rc == 0) {
    auto r = comm::make_nccl_communicator(*world, world->rank() % ndev, "bench");
    if (!r.is_ok()) {
      std::fprintf(stderr, "error (rank %d): %s\n", world->rank(), r.status().message().c_str());
      rc = 1;
    } else {
      nc = std::move(r).value();
    }
  }
  if (rc == 0) {
    const BenchArgs& a = args.value();
    const int N = world->size();
    std::ofstream out;
    if (rank0 && !a.out.empty()) out.open(a.out, std::ios::trunc);
    if (rank0) {
      // What the records were measured on and how (bench/gpu/run.sh sets SF_SOURCE_COMMIT).
      cudaDeviceProp prop{};
      const bool named = cudaGetDeviceProperties(&prop, 0) == cudaSuccess;
      int driver = 0;
      cudaDriverGetVersion(&driver);
      out << "{\"bench\": \"comm_allgather\", \"device\": \"" << N << "x "
          << (named ? prop.name : "unknown GPU") << "\", \"cuda_driver\": " << driver
          << ", \"date\": \"" << now_iso8601() << "\", \"commit\": \"" << bench::source_commit()
          << "\", \"command\": \"mpirun -np " << N << " " << bench::command_line(argc, argv)
          << "\", \"records\": [";
    }
    bool first = true;
    // A failure on one rank (memory, a collective, wrong data) ends the run on every rank at the
    // same point, so none waits in a collective its peers left.
    const auto agree = [&](int mine) {
      int any = mine;
      if (!world->all_reduce(&mine, &any, 1, DType::kI32, comm::ReduceOp::kMax).is_ok()) any = 1;
      return any;
    };
    for (int64_t mib : a.mib) {
      // A rank's block, in bf16 elements, a multiple of a 64-token row block of 8 KV heads x 128.
      const int64_t row_block = 64 * 8 * 128;
      const int64_t n = std::max<int64_t>(1, (mib << 20) / 2 / row_block) * row_block;
      uint16_t *send = nullptr, *recv = nullptr;
      if (cudaMalloc(&send, size_t(n) * 2) != cudaSuccess ||
          cudaMalloc(&recv, size_t(n) * 2 * size_t(N)) != cudaSuccess) {
        std::fprintf(stderr, "error (rank %d): cudaMalloc of %lld MiB failed\n", world->rank(),
                     static_cast<long long>(mib * (N + 1)));
        rc = 1;
      }
      if ((rc = agree(rc)) != 0) {
        cudaFree(send);  // (null is fine)
        cudaFree(recv);
        break;
      }
      for (const bool even : {true, false}) {
        std::vector<int64_t> counts(size_t(N), n);
        if (!even) counts.back() -= row_block;  // all_gatherv's grouped broadcasts
        auto r = time_gather(*nc, counts, send, recv, a.reps);
        if (!r.is_ok())
          std::fprintf(stderr, "error (rank %d): %s\n", world->rank(), r.status().message().c_str());
        if (r.is_ok() && !r.value().second)
          std::fprintf(stderr, "error (rank %d): gathered data differs from the ranks' ramps\n",
                       world->rank());
        if ((rc = agree(r.is_ok() && r.value().second ? 0 : 1)) != 0) break;
        int64_t recv_elems = 0;
        for (int i = 0; i < N; ++i)
          if (i != world->rank()) recv_elems += counts[size_t(i)];
        const double gb = double(recv_elems) * 2 / 1e9, s = r.value().first;
        if (rank0) {
          char line[512];
          std::snprintf(line, sizeof line,
                        "{\"ranks\": %d, \"path\": \"%s\", \"block_bytes\": %lld, "
                        "\"recv_bytes_per_rank\": %lld, \"median_s\": %.6f, \"recv_gb_per_s\": "
                        "%.2f, \"data_ok\": true}",
                        N, even ? "all_gather: ncclAllGather" : "all_gatherv: grouped ncclBroadcast",
                        static_cast<long long>(n * 2), static_cast<long long>(recv_elems * 2), s,
                        gb / s);
          std::printf("%s\n", line);
          out << (first ? "\n" : ",\n") << line;
          first = false;
        }
      }
      cudaFree(send);
      cudaFree(recv);
      if (rc) break;
    }
    if (rank0) out << "\n]}\n";
  }
  nc.reset();
#else
  if (rc == 0) {
    if (rank0) std::fprintf(stderr, "error: built without NCCL (a CUDA build with NCCL found)\n");
    rc = 1;
  }
#endif
  world.reset();
  comm::mpi_finalize();
  return rc;
}

}  // namespace
}  // namespace sf

int main(int argc, char** argv) { return sf::run(argc, argv); }
