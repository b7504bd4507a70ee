//! candle-cp-llama
