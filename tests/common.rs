//! Shared helpers for the workspace-level integration tests (oracle loading, comparisons).
