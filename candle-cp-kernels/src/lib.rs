//! CUDA kernels for candle-cp. Without the `cuda` feature this crate is empty.
