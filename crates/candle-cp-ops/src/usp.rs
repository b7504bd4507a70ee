//! 2-D (Ulysses x ring) attention.
