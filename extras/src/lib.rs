//! No library: this package holds tower-redlock's integration tests (`tests/`), benches
//! (`benches/`) and gRPC example (`examples/grpc.rs`), apart from the crate so that building
//! the crate or its flash-sale example does not build the crates they need. See
//! `Cargo.toml`.
