//! [`LockLayer`]: take a lock per request before the inner service runs, and hold it until
//! the response is done.
//!
//! For each request the layer (the [keyed core](crate::keyed) with the
//! [`LockPolicy`]):
//! 1. reads the request body whole, before any lock is taken, so that a client that sends
//!    it slowly holds nothing: at most 1 MiB ([`LockLayer::max_request_body`]; 413 beyond)
//!    within 10 s ([`LockLayer::request_body_timeout`]; 408 beyond); a request without a
//!    body goes on at once, and [`LockLayer::stream_request_body`] hands the body on
//!    unread instead. The inner service gets it as a [`RequestBody`];
//! 2. takes the key value from the request with its [`KeyExtractor`](crate::key::KeyExtractor)
//!    and checks it ([`validate_value`](crate::key::validate_value));
//! 3. acquires `{scope}:{value}` on its backend ([`Locks`]), one attempt
//!    (or waits up to [`LockLayer::max_wait`]); with [`LockLayer::by_fn_all`], every
//!    key the request names, with one lease, all or none;
//! 4. runs the inner service with the lease's live [`LeaseStatus`] in the request
//!    extensions (read it, or the [`Lease`], with their extractors), renewing the lease
//!    ([`LockLayer::renewal`]) and never polling it past its validity
//!    ([`LockLayer::on_lock_loss`]);
//! 5. releases the lease as the body's last frame is handed on, before the client sees the
//!    end ([`LockLayer::release_at_head`]: once the head is ready); when the future or body
//!    is dropped early (the client went away), in the background, the TTL the backstop.
//!
//! When the lock is not granted it answers itself (`application/problem+json`, RFC 9457):
//!
//! | situation | status |
//! | --- | --- |
//! | the lock is held by another request | 409 for `by_header`, 423 otherwise ([`LockLayer::taken_status`]); `Retry-After` |
//! | the key is missing (when required) or invalid | 400 |
//! | the request body is over the bound, or slower than the layer waits for | 413, 408 |
//! | the server is misconfigured (a path parameter the route lacks, the layer outside the `Router`) | 500, the fix logged once |
//! | the backend has no quorum | 503 with `Retry-After: 1` (see [Failing open](#failing-open)) |
//! | the lease was lost while the inner service ran | 503 with `Retry-After: 1` ([`OnLockLoss::Continue`](crate::OnLockLoss) runs on instead) |
//! | the lease was lost while the body streamed | the body ends with an error |
//!
//! The service's error type stays the inner service's: no `HandleErrorLayer` is needed.
//!
//! `Retry-After` on contention is the typical hold time of the key's scope, as this
//! process measured it when it released keys of that scope, never above the holder's
//! remaining TTL. Before this process has released a key of the scope (its first
//! contention after start, say) it is that remaining TTL: `Retry-After: 10` under a fresh
//! lease of the default TTL, however short the handler
//! ([guide::http_answers](crate::guide::http_answers#retry-after)).
//!
//! # Modes
//!
//! A layer, like a [`LockRequest`], takes a plain lock by default; [`LockMode`] lists
//! the others: [`LockMode::Shared`] (readers hold a key together), [`LockMode::Exclusive`]
//! (a writer that waits for the readers and keeps new ones out), and [`LockMode::Fair`]
//! (waiters acquire in arrival order across replicas). The guide's chapters
//! [shared and exclusive](crate::guide::shared_exclusive) and [fair waiting](crate::guide::fair)
//! give their guarantees and costs.
//!
//! # Waiting
//!
//! A waiter ([`LockRequest::wait`], [`LockLayer::max_wait`]) is woken when the holder
//! releases, with a jittered timer as fallback; behind a holder of the same client it
//! queues in process without touching Redis. The guide's
//! [bounded waiting](crate::guide::lifecycle#bounded-waiting) says how, on Redis.
//!
//! # Reentrancy
//!
//! While a layer's inner service runs, an acquisition of the keys it holds, on the same
//! backend, from the handler or its extractors ([`Locks::acquire`], [`Locks::try_lock`],
//! [`Locks::with_lock`], ...), gets the layer's lease back at once instead of a 409/423 or
//! a wait on itself. Releasing or extending that copy does nothing: the layer renews and
//! releases it. This holds within the inner service's future, on its task (a task the
//! handler spawns is another request); a reader's lease ([`LockMode::Shared`]) is not
//! reentered, and with nested layers the innermost lease is seen.
//! [`Locked`](crate::Locked) reuses a layer's lease on the same keys the same way.
//!
//! ```
//! use axum::{Router, extract::State, routing::post};
//! use tower_redlock::{LockLayer, Locks};
//!
//! async fn run(State(locks): State<Locks>) -> &'static str {
//!     // The layer holds "job:nightly": this is the same lease, not a conflict.
//!     let lease = locks.try_lock("job:nightly").await.expect("the request's own lease");
//!     locks.unlock(lease).await.ok(); // the layer still holds it
//!     "done"
//! }
//!
//! let locks = Locks::default();
//! let layer = LockLayer::by_fn(|_| Some("nightly".to_owned())).scope("job").backend(locks.clone());
//! let app: Router = Router::new().route("/run", post(run).layer(layer)).with_state(locks);
//! ```
//!
//! # Fencing tokens
//!
//! A holder can outlive its lease (a long pause, a slow network) and write after another
//! took the key. With `fencing_tokens(true)` on either backend's builder
//! ([`RedlockBuilder::fencing_tokens`](crate::RedlockBuilder::fencing_tokens),
//! [`MemoryLocksBuilder::fencing_tokens`]) each exclusive lease carries a number greater
//! than every earlier lease's on the same key ([`Lease::fencing_token`]), and the storage
//! refuses a write with a number below the highest it has seen (Martin Kleppmann, "How to
//! do distributed locking"). Shared leases carry none.
//!
//! A handler reads its token from the lease ([`Locked::lease`](crate::Locked::lease), the
//! [`Lease`] extractor, or [`LockLayer::fencing_header`]) and passes it with the write:
//!
//! ```
//! use std::borrow::Cow;
//! use std::sync::{Arc, Mutex};
//! use axum::{Router, extract::{FromRef, Path, State}, http::StatusCode, routing::post};
//! use tower_redlock::{LockKey, Locked, Locks, MemoryLocks};
//!
//! /// The storage side: one balance, with the highest token that wrote it.
//! #[derive(Clone, Default)]
//! struct Ledger(Arc<Mutex<(u64, i64)>>);
//!
//! impl Ledger {
//!     /// Compare and set: refused for a token below the highest seen.
//!     fn write(&self, token: u64, balance: i64) -> Result<(), StatusCode> {
//!         let mut stored = self.0.lock().unwrap();
//!         if token < stored.0 {
//!             return Err(StatusCode::CONFLICT); // a stale holder
//!         }
//!         *stored = (token, balance);
//!         Ok(())
//!     }
//! }
//!
//! #[derive(serde::Deserialize)]
//! struct Account(String);
//!
//! impl LockKey for Account {
//!     const SCOPE: &'static str = "account";
//!     fn lock_key(&self) -> Cow<'_, str> {
//!         Cow::Borrowed(&self.0)
//!     }
//! }
//!
//! #[derive(Clone, FromRef)]
//! struct App {
//!     locks: Locks,
//!     ledger: Ledger,
//! }
//!
//! async fn deposit(
//!     State(ledger): State<Ledger>,
//!     account: Locked<Path<Account>>,
//! ) -> Result<&'static str, StatusCode> {
//!     let token = account.lease().fencing_token().ok_or(StatusCode::INTERNAL_SERVER_ERROR)?;
//!     ledger.write(token, 100)?;
//!     Ok("deposited")
//! }
//!
//! let locks = Locks::from(MemoryLocks::builder().fencing_tokens(true).build().unwrap());
//! let app: Router = Router::new()
//!     .route("/accounts/{account}/deposit", post(deposit))
//!     .with_state(App { locks, ledger: Ledger::default() });
//! ```
//!
//! With Redis as the storage, the compare-and-set is one Lua script (`KEYS[1]` the
//! record, `ARGV[1]` the token, `ARGV[2]` the value), run with redis-rs's `Script`:
//!
//! ```lua
//! local highest = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
//! if tonumber(ARGV[1]) < highest then return 0 end
//! redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
//! return 1
//! ```
//!
//! On Redis each lock key has a counter `<prefix>{<lock key>}:fence` on every node, which
//! expires `max(24 h, 100 × TTL)` after the last write-back or renewal ([`Locks::extend`])
//! of a fenced lease of its key; after a longer idle time tokens start again from 1. A
//! counter that is not a decimal integer below 2^53 was not written by this crate: it is
//! left alone, and the node counts as failed for that key
//! ([`NodeFailureReason::InvalidFencingCounter`](crate::NodeFailureReason)). Why the tokens
//! grow across quorums, and why the nodes need persistence (`appendonly yes`,
//! `appendfsync always`) where fencing matters: the guide's [fencing
//! tokens](crate::guide::lifecycle#fencing-tokens).
//!
//! # Failing open
//!
//! [`LockLayer::fail_open`]`(true)` runs the inner service without a lock when the
//! backend has no quorum (Redis down), instead of answering 503. The default, `false`,
//! fails closed: a lock silently skipped protects nothing. The handler then has no lease
//! (take `Option<Lease>` or `Option<LeaseStatus>`).

// The middleware: the layer, its policy over the keyed core, the request body it reads.
mod body;
mod layer;
pub(crate) mod policy;
#[cfg(test)]
mod tests;

// The lock domain, below the middlewares and the keyed core, above the backends (no file
// here imports the middleware's): the `Locks` handle, what a `LockRequest` asks and the one
// acquisition path that runs it, a lease's live `LeaseStatus`, the renewing watchdog,
// reentrancy within a request.
pub(crate) mod handle;
pub(crate) mod reentry;
pub(crate) mod request;
pub(crate) mod status;
pub(crate) mod watchdog;

pub use body::{
    DEFAULT_MAX_REQUEST_BODY, DEFAULT_REQUEST_BODY_TIMEOUT, ReadRequestBody, ReadRequestBodyFuture,
    ReadRequestBodyLayer, RequestBody,
};
pub use layer::{Lock, LockAll, LockAllLayer, LockLayer};
pub use policy::LockPolicy;

// The lock domain, beside the layer: the handle, the request, the lease's status, the
// watchdog and reentrancy.
pub use handle::Locks;
pub use request::{LockAllRequest, LockRequest};
pub use status::LeaseStatus;
pub use watchdog::{OnLockLoss, Renewal};

// What the storage below defines: the modes it implements, what it reports, the backends.
pub use crate::backend::contract::LockMode;
pub use crate::backend::inspect::LockInspection;
pub use crate::backend::memory::{MemoryLocks, MemoryLocksBuilder};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use crate::backend::redlock::{Redlock, RedlockBuilder};
pub use crate::holder::LockHolder;
pub use crate::lease::{Lease, Token};
