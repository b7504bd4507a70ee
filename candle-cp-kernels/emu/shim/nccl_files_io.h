// File and process helpers of the files transport (nccl_files.cpp): the part header, atomic
// publication (write a temporary, then rename() or link()), reads, the liveness of a process,
// the directory name of an id. Included by nccl_files.cpp only.
#pragma once
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "nccl_abi.h"

namespace cp_nccl::files {

// Header of a coll.* / p2p.* file; `bytes` of payload follow.
struct Hdr {
  char magic[8];
  int32_t kind, dt, op, root, rank, pad;
  uint64_t count, seq, bytes;
};
inline const char kMagic[8] = {'c', 'p', 'n', 'c', 'c', 'l', '1', 0};

struct Backoff {  // 20 us doubling to 2 ms, back to 20 us on progress
  int us = 20;
  void reset() { us = 20; }
  void sleep() {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    us = std::min(us * 2, 2000);
  }
};

inline std::string host_name() {
  char h[256] = {};
  gethostname(h, sizeof h - 1);
  return h[0] ? h : "localhost";
}

inline std::string p2p_name(int src, int dst, uint64_t seq) {
  return "p2p." + std::to_string(src) + "." + std::to_string(dst) + "." + std::to_string(seq);
}
inline std::string coll_name(uint64_t seq, int r) { return "coll." + std::to_string(seq) + "." + std::to_string(r); }
inline bool exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

inline bool write_all(int fd, const void* p, size_t n) {
  const char* b = static_cast<const char*>(p);
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    b += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

inline bool read_at(int fd, void* p, size_t n, off_t off) {
  char* b = static_cast<char*>(p);
  while (n) {
    ssize_t r = pread(fd, b, n, off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
    off += r;
  }
  return true;
}

// Publishes `final` with the bytes a, b: 0, or the errno (EEXIST: `excl` and it exists).
inline int publish(const std::string& dir, const std::string& final, const void* a, size_t na, const void* b, size_t nb,
            bool excl) {
  static std::atomic<uint64_t> serial{0};
  const std::string tmp = dir + "/tmp." + std::to_string(getpid()) + "." + std::to_string(serial.fetch_add(1));
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  bool ok = write_all(fd, a, na) && (nb == 0 || write_all(fd, b, nb));
  int err = ok ? 0 : (errno ? errno : EIO);
  close(fd);
  if (!err && (excl ? link(tmp.c_str(), final.c_str()) : rename(tmp.c_str(), final.c_str())) != 0) err = errno;
  if (excl || err) unlink(tmp.c_str());
  return err;
}

inline bool read_text(const std::string& p, std::string& out) {
  int fd = open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char b[1024];
  ssize_t n = read(fd, b, sizeof b - 1);
  close(fd);
  out.assign(b, n > 0 ? static_cast<size_t>(n) : 0);
  return true;
}

// Whether process `pid` (of this host) has exited: gone, or a zombie nobody reaped yet.
inline bool pid_dead(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) == -1 && errno == ESRCH) return true;
  std::string s;
  if (!read_text("/proc/" + std::to_string(pid) + "/stat", s)) return false;
  size_t k = s.rfind(')');
  return k != std::string::npos && k + 2 < s.size() && (s[k + 2] == 'Z' || s[k + 2] == 'X');
}

// Opens a peer's file and checks its header; -1 if absent.
inline int open_part(const std::string& p, Hdr& h) {
  int fd = open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  if (!read_at(fd, &h, sizeof h, 0) || memcmp(h.magic, kMagic, sizeof kMagic) != 0) {
    close(fd);
    return -2;
  }
  return fd;
}

inline std::string hex_of(const ncclUniqueId& id) {  // 128-bit FNV-1a of the id's bytes (two seeds)
  uint64_t a = 0xcbf29ce484222325ull, b = 0x84222325cbf29ce4ull;
  for (size_t i = 0; i < sizeof id.internal; ++i) {
    a = (a ^ static_cast<unsigned char>(id.internal[i])) * 0x100000001b3ull;
    b = (b ^ static_cast<unsigned char>(id.internal[sizeof id.internal - 1 - i])) * 0x100000001b3ull;
  }
  char s[40];
  snprintf(s, sizeof s, "%016llx%016llx", static_cast<unsigned long long>(a), static_cast<unsigned long long>(b));
  return s;
}

// The content of a join file: "<nranks> <device> <pid> <host>" (nranks -1: unreadable).
struct JoinInfo {
  int nranks = 0, dev = -1, pid = 0;
  std::string host;
};
inline bool read_join_file(const std::string& p, JoinInfo& j) {
  std::string t;
  if (!read_text(p, t)) return false;
  char host[256] = {};
  if (sscanf(t.c_str(), "%d %d %d %255s", &j.nranks, &j.dev, &j.pid, host) < 3) j.nranks = -1;
  j.host = host;
  return true;
}

// Removes the communicator directories under `base` (except `keep`) that no rank can use any
// more: at least one join file, and every rank that joined has left (gone.<r>) or was a process
// of this host that exited (one that ended without ncclCommAbort / ncclCommDestroy).
inline void sweep(const std::string& base, const std::string& keep) {
  DIR* d = opendir(base.c_str());
  if (!d) return;
  const std::string me = host_name();
  std::vector<std::string> dirs;
  while (dirent* x = readdir(d))
    if (x->d_name[0] != '.' && keep != x->d_name) dirs.push_back(base + "/" + x->d_name);
  closedir(d);
  for (const std::string& dir : dirs) {
    DIR* x = opendir(dir.c_str());
    if (!x) continue;
    std::vector<std::string> names;
    while (dirent* e = readdir(x))
      if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) names.push_back(e->d_name);
    closedir(x);
    int joins = 0;
    bool usable = false;
    for (const std::string& n : names) {
      JoinInfo j;
      if (n.compare(0, 5, "join.") || !read_join_file(dir + "/" + n, j)) continue;
      ++joins;
      if (!exists(dir + "/gone." + n.substr(5)) && (j.host != me || !pid_dead(j.pid))) usable = true;
    }
    if (joins == 0 || usable) continue;
    for (const std::string& n : names) unlink((dir + "/" + n).c_str());
    rmdir(dir.c_str());
  }
}

}  // namespace cp_nccl::files
