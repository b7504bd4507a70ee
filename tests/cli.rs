//! cli tests (to be written)
