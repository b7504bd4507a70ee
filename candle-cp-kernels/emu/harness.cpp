// Runs the real kernel source (kernels/*.cu compiled as host C++ under emu.h) on the CPU through
// the same extern "C" entry points and launch configurations as the Rust launchers
// (src/flash.rs, src/flash/bwd_pipe.rs, src/merge.rs, src/layout.rs), and compares the results
// with a float64 reference. One PASS/FAIL line per check; exit status 1 on any failure.
// Usage: harness [substring filter of check names]. Built and run by emu/run.sh.
#include "harness.h"

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>

namespace {

int n_pass = 0, n_fail = 0;
const char* g_filter = nullptr;
std::string g_current;
std::string g_sched = "lockstep";

void on_segv(int) {
  const char msg[] = "FAIL (segmentation fault: out-of-bounds global access) in ";
  (void)!write(1, msg, sizeof(msg) - 1);
  (void)!write(1, g_current.data(), g_current.size());
  (void)!write(1, "\n", 1);
  _exit(1);
}

}  // namespace

void check(const std::string& name, double err, double tol) {
  const bool ok = std::isfinite(err) && err <= tol;
  std::printf("%s [%s] %s: err %.3e (tol %.1e)\n", ok ? "PASS" : "FAIL", g_sched.c_str(), name.c_str(), err, tol);
  std::fflush(stdout);
  (ok ? n_pass : n_fail)++;
}

void check_launch(const std::string& name, bool ok) {
  if (!ok) {
    std::printf("FAIL [%s] %s: kernel launch failed under the emulator (see EMU ERROR above)\n", g_sched.c_str(), name.c_str());
    n_fail++;
  }
}

bool wanted(const std::string& name) {
  g_current = name;
  return !g_filter || name.find(g_filter) != std::string::npos;
}

// Host buffer whose end touches a PROT_NONE page: a kernel read or write past the end faults.
void* guarded_alloc(size_t bytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t rounded = (bytes + 15) / 16 * 16;
  const size_t span = (rounded + page - 1) / page * page + page;
  auto base = static_cast<unsigned char*>(mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) {
    std::perror("mmap");
    std::exit(2);
  }
  mprotect(base + span - page, page, PROT_NONE);
  unsigned char* p = base + span - page - rounded;
  cp_emu::track_global(p, rounded);
  return p;
}

void guarded_free(void* p, size_t bytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t rounded = (bytes + 15) / 16 * 16;
  const size_t span = (rounded + page - 1) / page * page + page;
  auto end = static_cast<unsigned char*>(p) + rounded + page;
  cp_emu::untrack_global(p);
  munmap(end - span, span);
}

double max_abs(const std::vector<float>& a, const std::vector<double>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool inf_ok = std::isinf(b[i]) && a[i] == (float)b[i];
    const double d = inf_ok ? 0.0 : std::fabs((double)a[i] - b[i]);
    if (!(d <= e)) e = d;  // NaN propagates
  }
  return e;
}

double rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs((double)a[i] - b[i]);
    if (!(d <= num)) num = d;
    den = std::max(den, std::fabs(b[i]));
  }
  return num / std::max(den, 1e-30);
}

std::vector<double> randn(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

int main(int argc, char** argv) {
  if (argc > 1) g_filter = argv[1];
  std::signal(SIGSEGV, on_segv);
  std::signal(SIGBUS, on_segv);
  const auto t0 = std::chrono::steady_clock::now();
  // The whole suite under each thread schedule (see cp_emu::Schedule).
  const std::pair<cp_emu::Schedule, const char*> scheds[] = {{cp_emu::Schedule::Lockstep, "lockstep"},
                                                             {cp_emu::Schedule::WarpsAscending, "warps-asc"},
                                                             {cp_emu::Schedule::WarpsDescending, "warps-desc"}};
  for (auto& sc : scheds) {
    cp_emu::set_schedule(sc.first);
    // wgmma products deferred to their wait_group, except under warps-asc: at issue
    cp_emu::set_wgmma_at_issue(sc.first == cp_emu::Schedule::WarpsAscending);
    g_sched = sc.second;
    run_flash_checks();
    run_misc_checks();
    run_fused_checks();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("emu: %d passed, %d failed in %.1f s\n", n_pass, n_fail, secs);
  return n_fail ? 1 : 0;
}
