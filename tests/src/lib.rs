//! Shared helpers for integration tests.
