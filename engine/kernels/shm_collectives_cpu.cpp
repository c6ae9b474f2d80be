// Collectives between the ranks of a tensor-parallel group on one machine, through a shared
// memory segment every rank has mapped (engine/shm_all_reduce.py makes it): the all-reduce
// (sum) of the row-parallel layers, the all-gather that brings the logits' shards to rank 0,
// and rank 0's broadcasts (sampled tokens, commands). Over gloo
// the same all-reduce is a few loopback TCP round trips: 0.7-1.8 ms for a decode step's
// [rows, hidden] on a 2-core VM whose loopback round trip is ~70 us, 60 of them a step.
//
// Segment: for each rank r, its sequence number (the last call it has published) and its pid,
// each on a cache line of its own; then two buffers of `world` slots of `slot_bytes` each.
// Call k (k = 1, 2, ...; a tensor larger than a slot takes one call per slot-sized chunk):
//   1. copy this rank's chunk into its slot of buffer k % 2;
//   2. publish k (a release store of the sequence number);
//   3. wait until every rank has published k (acquire loads);
//   4. the all-reduce sums the slots in rank order into the tensor: every rank adds the same
//      operands in the same order, so all ranks get the same bits, run after run, whatever
//      the chunking (the all-gather copies every slot out; the broadcast, rank 0's slot).
// Two buffers suffice: a rank starts writing buffer k % 2 again at call k + 2 only after it
// saw every rank publish k + 1, which each did after reading call k's slots.
// bf16 and fp16 sums round after each add (as a pairwise sum in that type does: gloo's, so
// at two ranks the result equals gloo's bit for bit, as it does in fp32).
//
// Every wait has a timeout, and a peer whose process is gone fails the call at once (the pid
// is checked while waiting), so a dead rank fails the step instead of hanging it.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
// Bindings only: torch/extension.h would also parse the whole C++ frontend.
#include <torch/python.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

namespace duet {
namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kSpins = 2048;    // busy polls before yielding the core
constexpr int64_t kYields = 4096;   // yields (~1 us each when nothing else runs) before sleeping
constexpr long kSleepNs = 50000;    // then naps between polls, growing
constexpr long kMaxSleepNs = 2000000;

int64_t* seq_of(uint8_t* base, int64_t r) { return reinterpret_cast<int64_t*>(base + r * kLine); }
int64_t* pid_of(uint8_t* base, int64_t world, int64_t r) {
  return reinterpret_cast<int64_t*>(base + (world + r) * kLine);
}
uint8_t* slot_of(uint8_t* base, int64_t world, int64_t slot_bytes, int64_t buffer, int64_t r) {
  return base + 2 * world * kLine + (buffer * world + r) * slot_bytes;
}

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Whether process `pid` has ended: no such process, or a zombie not yet reaped (a follower
// rank is rank 0's child, and rank 0 is the one waiting for it).
bool process_gone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  char path[64], buf[512];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;  // no /proc: only the timeout tells
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // "pid (name) S ...": the state after the name
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

// Until every rank has published `k`: spins, then yields the core (the ranks may outnumber
// the cores), then sleeps between polls (a follower waiting for an idle rank 0's next
// commands must not hold a core: gloo's wait sleeps in the kernel), checking the clock and
// the missing rank's process every so often.
void wait_for_all(uint8_t* base, int64_t world, int64_t k, double timeout_s) {
  double deadline = -1.0;
  for (int64_t r = 0; r < world; ++r) {
    int64_t polls = 0;
    while (__atomic_load_n(seq_of(base, r), __ATOMIC_ACQUIRE) < k) {
      ++polls;
      if (polls < kSpins) {
        pause();
        continue;
      }
      if (polls < kSpins + kYields) {
        sched_yield();
        if (polls % 256 != 0) continue;
      } else {  // naps from 50 us, doubling every 64, up to 2 ms: an idle wait costs little
        const int64_t naps = polls - kSpins - kYields;
        const long ns = std::min<long>(kMaxSleepNs, kSleepNs << std::min<int64_t>(naps / 64, 6));
        const timespec nap{0, ns};
        nanosleep(&nap, nullptr);
        if (naps % 16 != 0) continue;
      }
      const double t = now_s();
      if (deadline < 0) deadline = t + timeout_s;
      const int64_t pid = *pid_of(base, world, r);
      TORCH_CHECK(!process_gone(pid), "shared-memory collective: rank ", r, " (pid ", pid,
                  ") is gone");
      TORCH_CHECK(t < deadline, "shared-memory collective: rank ", r, " did not arrive in ",
                  timeout_s, " s (call ", k, ")");
    }
  }
}

// Sums `n` elements of the slots of `buffer`, in rank order, into `out`.
template <typename T>
void sum_slots(T* out, uint8_t* base, int64_t world, int64_t slot_bytes, int64_t buffer,
               int64_t n) {
  const T* first = reinterpret_cast<const T*>(slot_of(base, world, slot_bytes, buffer, 0));
  std::memcpy(out, first, n * sizeof(T));
  for (int64_t r = 1; r < world; ++r) {
    const T* s = reinterpret_cast<const T*>(slot_of(base, world, slot_bytes, buffer, r));
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t i = 0; i < n; ++i) out[i] += s[i];
    } else {  // widened, added, rounded back: a sum in T
      for (int64_t i = 0; i < n; ++i)
        out[i] = T(static_cast<float>(out[i]) + static_cast<float>(s[i]));
    }
  }
}

struct Group {
  uint8_t* base;
  int64_t rank, world, slot_bytes;
  double timeout_s;
};

Group group_of(const at::Tensor& segment, int64_t rank, int64_t world, int64_t slot_bytes,
               double timeout_s) {
  TORCH_CHECK(segment.is_cpu() && segment.scalar_type() == at::kByte && segment.is_contiguous(),
              "shm collectives: the segment is a contiguous uint8 tensor");
  TORCH_CHECK(0 <= rank && rank < world, "shm collectives: rank ", rank, " of ", world);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % kLine == 0, "slot_bytes: a multiple of ", kLine);
  TORCH_CHECK(segment.numel() >= 2 * world * kLine + 2 * world * slot_bytes,
              "shm collectives: the segment is smaller than ", world, " ranks' slots");
  return {segment.data_ptr<uint8_t>(), rank, world, slot_bytes, timeout_s};
}

// One call per chunk of the tensor's `total` elements of `elem` bytes (one for an empty
// tensor: every rank counts its calls alike): `fill(slot, start, n)` writes this rank's part,
// the rank publishes, waits for every rank, then `use(buffer, start, n)` reads the slots.
// Returns the rank's new call count.
template <typename Fill, typename Use>
int64_t exchange(const Group& g, int64_t seq, int64_t total, int64_t elem, Fill&& fill,
                 Use&& use) {
  const int64_t per_chunk = g.slot_bytes / elem;
  const int64_t chunks = std::max<int64_t>(1, (total + per_chunk - 1) / per_chunk);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t start = c * per_chunk, n = std::min(per_chunk, total - start);
    const int64_t k = ++seq, buffer = k % 2;
    fill(slot_of(g.base, g.world, g.slot_bytes, buffer, g.rank), start, n);
    __atomic_store_n(seq_of(g.base, g.rank), k, __ATOMIC_RELEASE);
    wait_for_all(g.base, g.world, k, g.timeout_s);
    use(buffer, start, n);
  }
  return seq;
}

}  // namespace

// Sum `x` over the group's ranks in place; `seq`: the calls this rank made so far. Returns
// the new count.
int64_t shm_all_reduce(at::Tensor x, at::Tensor segment, int64_t rank, int64_t world,
                       int64_t slot_bytes, int64_t seq, double timeout_s) {
  TORCH_CHECK(x.is_cpu() && x.is_contiguous(), "shm_all_reduce: a contiguous CPU tensor");
  const Group g = group_of(segment, rank, world, slot_bytes, timeout_s);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "shm_all_reduce: float32, bfloat16 or float16; got ", dtype);
  uint8_t* data = static_cast<uint8_t*>(x.data_ptr());
  const int64_t elem = x.element_size();
  auto fill = [&](uint8_t* slot, int64_t start, int64_t n) {
    std::memcpy(slot, data + start * elem, n * elem);
  };
  auto use = [&](int64_t buffer, int64_t start, int64_t n) {
    uint8_t* out = data + start * elem;
    if (dtype == at::kFloat) {
      sum_slots(reinterpret_cast<float*>(out), g.base, world, slot_bytes, buffer, n);
    } else if (dtype == at::kBFloat16) {
      sum_slots(reinterpret_cast<c10::BFloat16*>(out), g.base, world, slot_bytes, buffer, n);
    } else {
      sum_slots(reinterpret_cast<c10::Half*>(out), g.base, world, slot_bytes, buffer, n);
    }
  };
  return exchange(g, seq, x.numel(), elem, fill, use);
}

// Every rank's `x` (same shape and type on every rank) into `out` [world, *x.shape], in rank
// order. Returns the new call count.
int64_t shm_all_gather(at::Tensor x, at::Tensor out, at::Tensor segment, int64_t rank,
                       int64_t world, int64_t slot_bytes, int64_t seq, double timeout_s) {
  TORCH_CHECK(x.is_cpu() && x.is_contiguous() && out.is_cpu() && out.is_contiguous(),
              "shm_all_gather: contiguous CPU tensors");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.numel() == world * x.numel(),
              "shm_all_gather: out must hold ", world, " of x, of its type");
  const Group g = group_of(segment, rank, world, slot_bytes, timeout_s);
  const uint8_t* data = static_cast<const uint8_t*>(x.data_ptr());
  uint8_t* dest = static_cast<uint8_t*>(out.data_ptr());
  const int64_t elem = x.element_size(), row = x.numel() * elem;
  auto fill = [&](uint8_t* slot, int64_t start, int64_t n) {
    std::memcpy(slot, data + start * elem, n * elem);
  };
  auto use = [&](int64_t buffer, int64_t start, int64_t n) {
    for (int64_t r = 0; r < world; ++r)
      std::memcpy(dest + r * row + start * elem, slot_of(g.base, world, slot_bytes, buffer, r),
                  n * elem);
  };
  return exchange(g, seq, x.numel(), elem, fill, use);
}

// Rank 0's `x` into every rank's `x` (same shape and type). Returns the new call count.
int64_t shm_broadcast(at::Tensor x, at::Tensor segment, int64_t rank, int64_t world,
                      int64_t slot_bytes, int64_t seq, double timeout_s) {
  TORCH_CHECK(x.is_cpu() && x.is_contiguous(), "shm_broadcast: a contiguous CPU tensor");
  const Group g = group_of(segment, rank, world, slot_bytes, timeout_s);
  uint8_t* data = static_cast<uint8_t*>(x.data_ptr());
  const int64_t elem = x.element_size();
  auto fill = [&](uint8_t* slot, int64_t start, int64_t n) {
    if (rank == 0) std::memcpy(slot, data + start * elem, n * elem);
  };
  auto use = [&](int64_t buffer, int64_t start, int64_t n) {
    if (rank != 0)
      std::memcpy(data + start * elem, slot_of(g.base, world, slot_bytes, buffer, 0), n * elem);
  };
  return exchange(g, seq, x.numel(), elem, fill, use);
}

}  // namespace duet

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The waits release the GIL: another thread (a server's event loop) runs meanwhile.
  m.def("shm_all_reduce", &duet::shm_all_reduce,
        "sum x over the ranks mapping `segment` in place (engine/shm_all_reduce.py); returns "
        "the rank's new call count",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("shm_all_gather", &duet::shm_all_gather,
        "every rank's x into out [world, *x.shape], in rank order; returns the new call count",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("shm_broadcast", &duet::shm_broadcast,
        "rank 0's x into every rank's x; returns the new call count",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
