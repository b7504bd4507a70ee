//! candle-cp-plan
