//! comm tests (to be written)
