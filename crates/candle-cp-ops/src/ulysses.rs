//! Ulysses: all-to-all sequence <-> head sharding and Ulysses attention.
