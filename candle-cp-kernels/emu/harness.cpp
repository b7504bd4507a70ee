// Runs the real kernel source (kernels/*.cu compiled as host C++ under emu.h) on the CPU through
// the same extern "C" entry points and launch configurations as the Rust launchers
// (src/flash.rs, src/flash/bwd_pipe.rs, src/merge.rs, src/layout.rs, src/quant.rs, src/moe.rs, src/grouped_gemm.rs, src/dropout.rs), and compares the results
// with a float64 reference. One PASS/FAIL line per check; exit status 1 on any failure.
// Usage: harness [substring filter of check names]. Built and run by emu/run.sh.
#include "harness.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <map>
#include <random>

namespace {

int n_pass = 0, n_fail = 0;
const char* g_filter = nullptr;
std::string g_current;
std::string g_sched = "lockstep";
bool g_selftests = true;

void on_segv(int) {
  const char msg0[] = "FAIL [", msg[] = "] (segmentation fault: out-of-bounds global access) in ";
  (void)!write(1, msg0, sizeof(msg0) - 1);
  (void)!write(1, g_sched.data(), g_sched.size());
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

bool selftests_here() { return g_selftests; }

int main(int argc, char** argv) {
  if (argc > 1) g_filter = argv[1];
  std::signal(SIGSEGV, on_segv);
  std::signal(SIGBUS, on_segv);
  const auto t0 = std::chrono::steady_clock::now();
  // The whole suite under each (thread schedule, cp.async landing) combination below: the
  // read-before-wait hazards show under at-wait / random landing, the write-after-read ones
  // (a refill before the barrier that frees the buffer) under at-issue / random landing with
  // skewed warps. wgmma products run at issue under warps-asc, else at their wait_group.
  using S = cp_emu::Schedule;
  using L = cp_emu::Landing;
  struct Combo {
    S sched;
    L land;
    uint64_t seed;
    const char* label;
  };
  const Combo combos[] = {{S::Lockstep, L::AtWait, 0, "lockstep/at-wait"},
                          {S::WarpsAscending, L::AtIssue, 0, "warps-asc/at-issue"},
                          {S::WarpsDescending, L::AtIssue, 0, "warps-desc/at-issue"},
                          {S::Lockstep, L::Random, 1, "lockstep/random:1"},
                          {S::Random, L::Random, 2, "random:2/random:2"},
                          {S::Random, L::AtIssue, 3, "random:3/at-issue"}};
  // EMU_COMBOS (comma-separated labels) runs some of them: the CI's shorter run
  std::vector<Combo> chosen;
  const char* want = std::getenv("EMU_COMBOS");
  for (auto& c : combos) {
    if (!want || !*want || std::strstr(("," + std::string(want) + ",").c_str(), ("," + std::string(c.label) + ",").c_str())) chosen.push_back(c);
  }
  if (chosen.empty()) {
    std::printf("emu: EMU_COMBOS='%s' names none of the combinations\n", want);
    return 2;
  }
  const int nc = (int)chosen.size();
  std::printf("emu: combinations (schedule/landing[:seed]):");
  for (auto& c : chosen) std::printf(" %s", c.label);
  std::printf("%s\n", nc < (int)(sizeof(combos) / sizeof(combos[0])) ? " (EMU_COMBOS; the others skipped)" : "");
  std::fflush(stdout);
  // EMU_JOBS worker processes (default 2), each a contiguous share of the combinations with its
  // output in a temporary file; printed in order afterwards.
  const char* je = std::getenv("EMU_JOBS");
  const int jobs = std::max(1, std::min(nc, je ? std::atoi(je) : 2));
  std::vector<std::pair<pid_t, FILE*>> workers;
  for (int j = 0; j < jobs; ++j) {
    FILE* tmp = std::tmpfile();
    if (!tmp) {
      std::perror("tmpfile");
      return 2;
    }
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      return 2;
    }
    if (pid > 0) {
      workers.push_back({pid, tmp});
      continue;
    }
    dup2(fileno(tmp), 1);
    for (int ci = nc * j / jobs; ci < nc * (j + 1) / jobs; ++ci) {
      const Combo& c = chosen[ci];
      const auto c0 = std::chrono::steady_clock::now();
      const int n0 = n_pass + n_fail;
      g_selftests = ci == 0;  // the self-tests choose their own modes: once is enough
      cp_emu::set_schedule(c.sched, c.seed);
      cp_emu::set_cp_async_landing(c.land, c.seed);
      cp_emu::set_wgmma_at_issue(c.sched == S::WarpsAscending);
      g_sched = c.label;
      run_flash_checks();
      run_band_checks();
      run_misc_checks();
      run_quant_checks();
      run_moe_checks();
      run_grouped_checks();
      run_dropout_checks();
      run_fused_checks();
      run_probe_checks();
      std::printf("emu: %s: %d checks in %.1f s\n", c.label, n_pass + n_fail - n0,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count());
    }
    std::printf("emu-worker: %d %d\n", n_pass, n_fail);
    std::fflush(stdout);
    _exit(0);
  }
  for (auto& w : workers) {
    int status = 0;
    waitpid(w.first, &status, 0);
    std::rewind(w.second);
    char line[4096];
    bool summary = false;
    while (std::fgets(line, sizeof line, w.second)) {
      int p = 0, f = 0;
      if (std::sscanf(line, "emu-worker: %d %d", &p, &f) == 2) {
        n_pass += p, n_fail += f, summary = true;
        continue;
      }
      std::fputs(line, stdout);
    }
    std::fclose(w.second);
    if (!summary || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::printf("FAIL worker process %d ended abnormally (status %d)\n", (int)w.first, status);
      n_fail++;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("emu: %d passed, %d failed in %.1f s\n", n_pass, n_fail, secs);
  return n_fail ? 1 : 0;
}

void check_fold(const std::string& name, int B, int T, int H, int D, const std::vector<double>& ref_out,
                const std::vector<double>& ref_lse, double tol, uint64_t seed,
                const std::function<bool(float*, float*, int, int, int)>& run) {
  const int R = T + 7, row0 = 3;
  const size_t no = (size_t)B * R * H * D, nl = (size_t)B * H * R;
  Buf<float> out(no), lse(nl);
  std::vector<double> so = randn(no, seed), sl = randn(nl, seed + 1);
  for (size_t e = 0; e < nl; ++e) {
    sl[e] *= 3.0;
    if (e % 5 == 1) sl[e] = -INFINITY;  // a row that saw no key yet: out 0
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h)
        if (sl[((size_t)b * H + h) * R + r] == -INFINITY)
          for (int d = 0; d < D; ++d) so[(((size_t)b * R + r) * H + h) * D + d] = 0.0;
  const auto so_f = fill(out, so), sl_f = fill(lse, sl);
  std::vector<double> want_o(so_f), want_l(sl_f);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        const size_t li = ((size_t)b * H + h) * R + row0 + i;
        const double la = sl_f[li], lb = ref_lse[((size_t)b * H + h) * T + i], mx = std::max(la, lb);
        double wa = 0, wb = 0, l = -INFINITY;
        if (mx != -INFINITY) {
          const double ea = std::exp(la - mx), eb = std::exp(lb - mx);
          l = mx + std::log(ea + eb);
          wa = ea / (ea + eb);
          wb = eb / (ea + eb);
        }
        want_l[li] = l;
        for (int d = 0; d < D; ++d) {
          const size_t oi = (((size_t)b * R + row0 + i) * H + h) * D + d;
          want_o[oi] = wa * so_f[oi] + wb * ref_out[(((size_t)b * T + i) * H + h) * D + d];
        }
      }
  const std::string n = name + " fold into a state (rows 3.." + std::to_string(3 + T) + " of " + std::to_string(R) + ")";
  const bool ok = run(out.p, lse.p, R, row0, 1);
  check_launch(n, ok);
  if (!ok) return;
  check(n + " out", max_abs(out.to_f32(), want_o), tol);
  check(n + " lse", max_abs(lse.to_f32(), want_l), 1e-3);
}
