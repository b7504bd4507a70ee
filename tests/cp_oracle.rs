//! cp_oracle tests (to be written)
