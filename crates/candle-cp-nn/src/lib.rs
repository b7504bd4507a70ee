//! candle-cp-nn
