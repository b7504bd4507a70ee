//! Megatron-style tensor- and sequence-parallel conjugate collectives (autograd ops).
