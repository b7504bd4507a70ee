// Files transport of the shim's libnccl (CPEMU_NCCL_TRANSPORT=files; semantics: nccl.cpp, "Files
// transport"): the ranks of a communicator are processes (or threads) that exchange operations
// through files in a shared directory, so that one process per GPU (NcclGroup::from_env) runs
// on the shim. Implementation: nccl_files.cpp. Used by nccl.cpp only.
#pragma once
#include <vector>

#include "nccl_match.h"

namespace cp_nccl::files {

// The transport CPEMU_NCCL_TRANSPORT selects: 0 threads (unset, "threads"), 1 files, -1 unknown.
int transport();

// Joins `c` (rank, nranks, dev, blocking set by the caller) to the communicator that `id` names:
// publishes its join file and starts its progress thread (which completes the init). On
// ncclSuccess c->fx is set; else c is untouched and ncclGetLastError() says why.
int join(ncclComm* c, const ncclUniqueId& id, const char* fn);
// Waits, at most cp_shim::wait_timeout_s(), until the init of `c` completed or failed.
int wait_formed(ncclComm* c, const char* fn);
// Posts one unit (the ops of one communicator from one ncclGroupEnd, or one lone call), in order.
void post(std::vector<Op>& unit);
// This rank's posted operations not known to be complete (nccl.cpp waits for them).
std::vector<WorkPtr> pending(ncclComm* c);
// Sets the asynchronous error of `c` if a peer poisoned the communicator (a mismatch).
void check_poison(ncclComm* c);
// Abort / destroy: stops the progress thread (own pending Works complete with ncclSystemError),
// publishes this rank's departure; the last rank out removes the directory. Never hangs.
void leave(ncclComm* c, const char* why);
// Frees the transport state of `c` (after leave).
void release(ncclComm* c);

}  // namespace cp_nccl::files
