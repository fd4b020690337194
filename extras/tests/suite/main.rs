//! The integration tests, in one test binary: each module is one area, against real
//! `redis-server` processes and real HTTP. One binary builds and links once, where a binary
//! per file would compile `support` and the generic app code again for each.
//!
//! The tests that change something process-wide run in binaries of their own:
//! `tests/default_backend.rs` (the app's default backend), `tests/log_keys.rs` (full keys
//! in logs), `tests/observability.rs` (the global metrics recorder and tracing subscriber),
//! `tests/outage.rs` (the outage log's interval), and the crate's own
//! `tests/plain_hyper.rs` at the workspace root (built without axum as well, with none of
//! this package's crates).
//!
//! Run one area with `cargo test -p extras --test suite <module>::`, for example
//! `cargo test -p extras --test suite waiting::`.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "../support/mod.rs"]
mod support;

mod body_types;
mod breaker;
mod client_ip;
mod cluster;
mod concurrency;
mod example;
mod faults;
mod foreign;
mod foreign_values;
mod gcra;
mod grpc;
mod holder;
mod hostile_keys;
mod hotkey;
mod http;
mod idempotency;
mod idempotency_trust;
mod inspect;
mod lease_model;
mod lifecycle;
mod memory_store;
mod multilock;
mod prefix;
mod rate_limit;
mod ready;
mod recovery;
mod redlock;
mod release_lost;
mod release_once;
mod replica_ack;
mod rwfair;
mod script_flush;
mod sentinel;
mod shadow;
mod slow_body;
mod tls;
mod versions;
mod waiting;
