//! attention_oracle tests (to be written)
