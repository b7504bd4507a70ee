//! Shared helpers for the candle-cp examples.
