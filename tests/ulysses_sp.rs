//! ulysses_sp tests (to be written)
