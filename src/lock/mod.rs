//! [`LockLayer`]: take a lock per request before the inner service runs, and hold it until
//! the response is done.
//!
//! For each request the layer (a [`KeyedLayer`](crate::keyed::KeyedLayer) with the
//! [`LockPolicy`]):
//! 1. takes the key value from the request with its [`KeyExtractor`](crate::key::KeyExtractor)
//!    and checks it ([`validate_value`](crate::key::validate_value));
//! 2. acquires `{scope}:{value}` on its backend ([`Locks`]), one attempt
//!    (or waits up to [`LockLayer::max_wait`]); with [`LockLayer::by_fn_all`], every
//!    key the request names, with one lease, all or none;
//! 3. runs the inner service with the lease's live [`LeaseStatus`] in
//!    the request extensions (read it, or the [`Lease`], with their
//!    extractors), renewing the lease while it runs ([`LockLayer::renewal`]) and never
//!    polling it past the lease's validity ([`LockLayer::on_lock_loss`]);
//! 4. keeps the lease while the response body streams, and releases it as the last frame
//!    is handed on, before the client can see the end of the response
//!    ([`LockLayer::release_at_head`] releases once the response head is ready instead);
//!    when the future or the body is dropped early (the client went away), it releases in
//!    the background, and the TTL is the backstop.
//!
//! When the lock is not granted it answers itself, with `application/problem+json`
//! (RFC 9457):
//!
//! | situation | status |
//! | --- | --- |
//! | the lock is held by another request | 409 for `by_header`, 423 otherwise ([`LockLayer::taken_status`]); `Retry-After` |
//! | the key is missing (when required) or invalid | 400 |
//! | the server is misconfigured (a path parameter the route lacks, the layer outside the `Router`, a bad header name) | 500, the fix logged once |
//! | the backend has no quorum | 503 with `Retry-After: 1` (see [Failing open](#failing-open)) |
//! | the lease was lost while the inner service ran | 503 with `Retry-After: 1` ([`OnLockLoss::Continue`](crate::OnLockLoss) runs on instead) |
//! | the lease was lost while the body streamed | the body ends with an error |
//!
//! The service's error type stays the inner service's: no `HandleErrorLayer` is needed.
//!
//! # Modes
//!
//! A layer, like a [`LockRequest`], takes a plain lock by default; [`LockMode`] lists
//! the others: [`LockMode::Shared`] lets requests hold a key together (readers),
//! [`LockMode::Exclusive`] makes a request wait for the readers and exclude them (a
//! writer that keeps new readers out while it waits), and [`LockMode::Fair`] makes
//! waiters ([`LockLayer::max_wait`]) acquire in arrival order across replicas. The
//! guide's chapters [shared and exclusive](crate::guide::shared_exclusive) and
//! [fair waiting](crate::guide::fair) give their guarantees and their costs in round trips.
//!
//! # Waiting
//!
//! A waiter ([`LockRequest::wait`], [`LockLayer::max_wait`]) is woken when the holder
//! releases: on Redis, waiters subscribe to the channel `{<key>}:released` on every node
//! and set a short-lived mark `{<key>}:waiters` beside the lock (the holder's value is
//! never touched); the release of a marked lock publishes on that channel. A waiter also
//! tries again on a jittered fallback timer (the holder's remaining TTL, at most 1 s) in
//! case a notification is missed, the holder is another client that does not publish, or
//! the lease simply expires. Behind a holder of the same client, the waiter queues in
//! process without touching Redis.
//!
//! # Reentrancy
//!
//! A request holds its own lock: while a layer's inner service runs, an acquisition of the
//! keys the layer holds, on the same backend, from the handler or its extractors
//! ([`Locks::acquire`], [`Locks::try_lock`], [`Locks::with_lock`], ...), gets the layer's
//! lease back at once, instead of a 409/423 or a wait on itself. Releasing or extending
//! that copy does nothing: the layer, the outermost holder, renews the lease and releases
//! it when the response is done. It reaches what runs in the inner service's future, on
//! its task: a task the handler spawns is another request, and is refused as any other.
//! A reader's lease ([`LockMode::Shared`]) is not reentered, and the innermost layer's
//! lease is the one seen when layers nest. [`Locked`](crate::Locked) reuses a layer's
//! lease on the same keys the same way.
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
//! A holder can outlive its lease (a long pause, a slow network), and then write after
//! another holder took the key. A fencing token stops that write at the storage: each
//! lease carries a number greater than every earlier lease's on the same key
//! ([`Lease::fencing_token`]), and the storage refuses a write with a number lower than
//! the highest it has seen (Martin Kleppmann, "How to do distributed locking"). Turn them
//! on with `fencing_tokens(true)` on either backend's builder
//! ([`RedlockBuilder::fencing_tokens`](crate::RedlockBuilder::fencing_tokens),
//! [`MemoryLocksBuilder::fencing_tokens`]); both then issue them, and neither does
//! without it. Shared leases carry none.
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
//! In process, one counter serves every key. On Redis, each lock key has its own counter
//! on every node, `{<lock key>}:fence` (in the lock key's Redis Cluster slot; no lock key
//! can take that name). An acquisition reads the counter on every node atomically with
//! its `SET NX`, takes one above the highest value seen, and writes it back (raising, never
//! lowering) on every node where it holds the key, requiring a quorum of those writes
//! before it succeeds.
//!
//! Why the token is monotonic across quorums, not just per node: a later acquisition of
//! the same key succeeds on a quorum, and any two quorums share a node. On that shared
//! node the later `SET NX` succeeded only after the earlier holder's key was gone, hence
//! after the earlier holder's write-back there (which ran while its key held its token).
//! So the later acquisition reads at least the earlier token and issues a strictly
//! greater one, even if its quorum misses the node that holds the highest counter.
//!
//! The counters' expiry: so that counters do not fill the keyspace, a counter expires
//! `max(24 h, 100 × TTL)` after the last write-back or renewal ([`Locks::extend`]) of a
//! fenced lease of its key on that node. The argument above needs the shared node's
//! counter to still be there, so the order holds between two acquisitions of a key less
//! than that apart, counting from the earlier lease's last renewal on the shared node.
//! After a longer idle time the counter starts again from 1: storage that keeps the
//! highest token of a key for longer than that will refuse the new, smaller tokens (forget
//! its tokens sooner, or keep a key busy), and a holder paused for that long past its last
//! renewal could write with a token above the new holder's.
//!
//! A counter that holds anything but a decimal integer below 2^53 was not written by this
//! crate: it is left as it is, and that node counts as failed for fenced acquisitions of
//! the key ([`NodeFailureReason::InvalidFencingCounter`](crate::NodeFailureReason),
//! naming the key; [`LockError::NoQuorum`](crate::LockError::NoQuorum) when too few nodes
//! are left).
//!
//! Assumptions: nodes keep their data. A node restarted empty forgets its counter; while
//! every other node of a later quorum took part in the earlier write-back the order still
//! holds, but a restart combined with another failure can issue a smaller token (A writes
//! back on X and Z while Y is down; X restarts empty; B acquires on X and Y). Delayed
//! restarts protect the lock, not the counter. Run the nodes with persistence
//! (`appendonly yes`, `appendfsync always`) where fencing matters. Tokens are exact up to
//! 2^53 (Lua numbers).
//!
//! # Failing open
//!
//! [`LockLayer::fail_open`]`(true)` runs the inner service without a lock when the
//! backend has no quorum (Redis down), instead of answering 503. The default is `false`,
//! fail closed, because a lock that is silently skipped protects nothing. The handler can
//! tell: it has no lease (take `Option<Lease>` or `Option<LeaseStatus>`).

mod layer;
pub(crate) mod policy;
#[cfg(test)]
mod tests;

use crate::keyed;
pub use layer::{Lock, LockLayer};
pub use policy::LockPolicy;

pub use crate::backend::handle::Locks;
pub use crate::backend::inspect::LockInspection;
pub use crate::backend::memory::{MemoryLocks, MemoryLocksBuilder};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use crate::backend::redlock::{Redlock, RedlockBuilder};
pub use crate::backend::request::{LockMode, LockRequest};
pub use crate::backend::status::LeaseStatus;
pub use crate::backend::watchdog::{OnLockLoss, Renewal};
pub use crate::lease::{Lease, Token};

/// The response future of [`Lock`].
pub type ResponseFuture<S, ReqB> = keyed::ResponseFuture<S, ReqB, LockPolicy>;

/// The response body of [`Lock`]: the inner body, holding the lease until it ends.
pub type ResponseBody<B> = keyed::ResponseBody<B, LockPolicy>;
