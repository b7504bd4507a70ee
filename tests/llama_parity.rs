//! llama_parity tests (to be written)
