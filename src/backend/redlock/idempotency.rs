//! Idempotency records on the Redlock nodes: `<prefix>{<lock key>}:record`, in the lock
//! key's Redis Cluster slot, written by the crate's
//! [`IdempotencyLayer`](crate::IdempotencyLayer) only.
//!
//! A first request looks for the record and acquires the lock in one script per node
//! ([`IDEMPOTENCY_BEGIN`]); it stores its record and releases the lock in one script per
//! node ([`IDEMPOTENCY_FINISH`]), on every node, acknowledged by a quorum. A retry takes
//! the record if any node that answered has it: a quorum that let the retry acquire shares
//! a node with the quorum that stored the record, and on that node the record was written
//! before the lock was deleted, in the same script, so the retry finds it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use redis::Value;

use super::Redlock;
use super::keys::{Auxiliary, Beside, Keys};
use super::round::Stragglers;
use super::scripts;
use super::tally::{QuorumVerdict, Rule, Vote};
use crate::backend::connection::Connection;
use crate::backend::contract::LockBackend;
use crate::backend::lua::{IDEMPOTENCY_BEGIN, IDEMPOTENCY_FINISH};
use crate::backend::notify::released;
use crate::backend::records::Begin;
use crate::error::{LockError, LockOperation, NodeFailureReason};
use crate::future::boxed;
use crate::lease::{Lease, Shape, Token};
use crate::observe::{self, op_span};

/// One node's answer to [`IDEMPOTENCY_BEGIN`].
enum Found {
    Record(Bytes),
    Set,
    Held { pttl_ms: i64 },
}

async fn begin_on(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    ttl_ms: u64,
    holder: Arc<str>,
) -> Result<Found, NodeFailureReason> {
    let mut cmd = scripts::evalsha(&IDEMPOTENCY_BEGIN, 3);
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Record, &prefix, &key))
        .arg(Auxiliary::of(Beside::Holder, &prefix, &key))
        .arg(token.as_bytes())
        .arg(ttl_ms)
        .arg(&*holder);
    let reply: Vec<Value> = scripts::run_acked(
        &mut conn,
        Some(&IDEMPOTENCY_BEGIN),
        &cmd,
        |reply: &Vec<Value>| matches!(reply.as_slice(), [Value::Int(1)]),
    )
    .await?;
    Ok(match reply.as_slice() {
        [Value::Int(2), Value::BulkString(record)] => Found::Record(Bytes::from(record.clone())),
        [Value::Int(1)] => Found::Set,
        [Value::Int(0), Value::Int(pttl_ms)] => Found::Held { pttl_ms: *pttl_ms },
        _ => Found::Held { pttl_ms: -1 },
    })
}

async fn finish_on(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    record: Bytes,
    ttl_ms: u64,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = scripts::evalsha(&IDEMPOTENCY_FINISH, 4);
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Record, &prefix, &key))
        .arg(Auxiliary::of(Beside::Waiters, &prefix, &key))
        .arg(Auxiliary::of(Beside::Holder, &prefix, &key))
        .arg(token.as_bytes())
        .arg(&record[..])
        .arg(ttl_ms)
        .arg(released(&prefix, &key));
    scripts::run_acked(&mut conn, Some(&IDEMPOTENCY_FINISH), &cmd, |&stored| {
        stored == 1
    })
    .await
}

async fn read_on(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
) -> Result<Option<Bytes>, NodeFailureReason> {
    let raw: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("GET")
        .arg(Auxiliary::of(Beside::Record, &prefix, &key))
        .query_async(&mut conn)
        .await;
    match raw {
        // A value of another type: found, as a record that does not parse (as
        // `IDEMPOTENCY_BEGIN` answers it).
        Err(e) if e.code() == Some("WRONGTYPE") => Ok(Some(Bytes::new())),
        raw => Ok(raw?.map(Bytes::from)),
    }
}

impl Redlock {
    /// Finds the record of `key`, or acquires `key` when there is none (the lease
    /// recording `holder`); with `max_wait`, waits for a holder to finish (woken by its
    /// release) and then finds its record.
    pub(crate) async fn find_or_acquire(
        &self,
        key: Arc<str>,
        max_wait: Duration,
        holder: Arc<str>,
    ) -> Result<Begin, LockError> {
        let span = op_span!(
            "tower_redlock.idempotency.lookup",
            &key,
            self.prefix(),
            self.quorum()
        );
        observe::traced(
            span,
            self.begin_untraced(key, max_wait, holder),
            |begun| match begun {
                Ok(Begin::Found(_)) => "found",
                Ok(Begin::Acquired(_)) => "acquired",
                Err(_) => observe::lock_verdict(begun),
            },
        )
        .await
    }

    async fn begin_untraced(
        &self,
        key: Arc<str>,
        max_wait: Duration,
        holder: Arc<str>,
    ) -> Result<Begin, LockError> {
        let started = Instant::now();
        match self.begin_once(key.clone(), holder.clone()).await {
            Err(LockError::Taken { .. }) if !max_wait.is_zero() => {}
            other => return other,
        }
        let left = max_wait.saturating_sub(started.elapsed());
        let lease = self.lock_key_within(key.clone(), left, holder).await?;
        // The holder we waited for stored its record before it released: look for it.
        let prefix = &self.inner.policy.prefix;
        let round = self
            .on_every_node(|conn| read_on(conn, prefix.clone(), key.clone()))
            .await;
        if let Some(record) = round.values().flatten().next().cloned() {
            self.release_detached(Keys::Lock(lease.key), lease.token, true);
            return Ok(Begin::Found(record));
        }
        if round.values().count() < self.inner.quorum {
            self.release_detached(Keys::Lock(lease.key.clone()), lease.token, true);
            return Err(self.no_quorum(round, LockOperation::Acquire));
        }
        Ok(Begin::Acquired(lease))
    }

    async fn begin_once(&self, key: Arc<str>, holder: Arc<str>) -> Result<Begin, LockError> {
        let token = Token::random();
        let start = Instant::now();
        let ttl_ms = self.inner.policy.ttl_ms();
        let prefix = &self.inner.policy.prefix;
        let round = self
            .on_nodes(
                start,
                // Boxed: the operation is moved several times on its way into the round,
                // and a box is cheaper to move than the script call it holds.
                |conn| {
                    let (prefix, key, holder) = (prefix.clone(), key.clone(), holder.clone());
                    boxed(|| begin_on(conn, prefix, key, token, ttl_ms, holder))
                },
                |found| Vote::of(matches!(found, Found::Set)),
                Rule::Acquire,
                Stragglers::Drop,
            )
            .await;
        let record = round.values().find_map(|found| match found {
            Found::Record(record) => Some(record.clone()),
            _ => None,
        });
        let set_any = round.values().any(|found| matches!(found, Found::Set));
        if let Some(record) = record {
            if set_any || round.verdict != QuorumVerdict::Lost {
                self.release_detached(Keys::Lock(key), token, false);
            }
            return Ok(Begin::Found(record));
        }
        match round.verdict {
            QuorumVerdict::Won => {
                let elapsed = start.elapsed();
                match self.validity(elapsed) {
                    Some(validity) => {
                        let lease = Lease {
                            key,
                            shape: Shape::Lock,
                            token,
                            ttl: self.inner.policy.ttl,
                            valid_until: start + validity,
                            fencing_token: None,
                            backend: self.inner.id,
                            reentered: false,
                        };
                        self.inner.local.hold(&lease);
                        Ok(Begin::Acquired(lease))
                    }
                    None => {
                        self.release_detached(Keys::Lock(key), token, true);
                        Err(LockError::TooSlow {
                            operation: LockOperation::Acquire,
                            elapsed,
                        })
                    }
                }
            }
            QuorumVerdict::Lost => {
                if set_any {
                    self.release_detached(Keys::Lock(key), token, false);
                }
                let ttl = self.inner.policy.ttl;
                let retry_after = round
                    .values()
                    .filter_map(|found| match found {
                        Found::Held { pttl_ms } => {
                            Some(u64::try_from(*pttl_ms).map_or(ttl, Duration::from_millis))
                        }
                        _ => None,
                    })
                    .max()
                    .unwrap_or(ttl)
                    .min(ttl);
                Err(LockError::Taken { retry_after })
            }
            QuorumVerdict::NoQuorum => {
                self.release_detached(Keys::Lock(key), token, false);
                Err(self.no_quorum(round, LockOperation::Acquire))
            }
        }
    }

    /// Stores `record` for `ttl` on every node and releases the lease there, in one
    /// script per node; succeeds once a quorum stored it.
    pub(crate) async fn store_and_release(
        &self,
        lease: Lease,
        record: Bytes,
        ttl: Duration,
    ) -> Result<(), LockError> {
        let span = op_span!(
            "tower_redlock.idempotency.store",
            lease.key(),
            self.prefix(),
            self.quorum()
        );
        observe::traced(
            span,
            self.finish_untraced(lease, record, ttl),
            observe::lock_verdict,
        )
        .await
    }

    async fn finish_untraced(
        &self,
        lease: Lease,
        record: Bytes,
        ttl: Duration,
    ) -> Result<(), LockError> {
        let ttl_ms = super::builder::millis(ttl).max(1);
        let prefix = &self.inner.policy.prefix;
        let local = self
            .inner
            .local
            .released(&lease.key, lease.token, self.prefix());
        let round = self
            .on_nodes(
                Instant::now(),
                |conn| {
                    // Boxed, as `begin_once`'s.
                    boxed(|| {
                        let (key, record) = (lease.key.clone(), record.clone());
                        finish_on(conn, prefix.clone(), key, lease.token, record, ttl_ms)
                    })
                },
                |stored| Vote::of(*stored == 1),
                Rule::Held,
                Stragglers::Finish,
            )
            .await;
        if local {
            self.inner.waiters.wake(&lease.key);
        }
        match round.verdict {
            QuorumVerdict::Won => Ok(()),
            QuorumVerdict::Lost => Err(LockError::Expired { taken_over: true }),
            QuorumVerdict::NoQuorum => Err(self.no_quorum(round, LockOperation::Release)),
        }
    }
}
