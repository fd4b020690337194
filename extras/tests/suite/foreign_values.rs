//! Values this crate did not write, at every key its scripts touch: a hash, a list, and
//! (where a string is not the crate's format for the key) a string. Each test puts them
//! there on a real Redis node, runs the operation through the public API or a layer over
//! real HTTP, and checks that the value is exactly as it was (type, content, no expiry
//! added) and that the answer is the safe one: a lock key, readers' set, writer intent or
//! fair queue of another client holds the lock; a fencing counter, rate-limit counter or
//! idempotency record of another format is an error; a waiters' mark is not ours to set
//! or delete.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use support::{Logs, Monitor, RedisNode, eventually, exists, serve};
use tokio::sync::Semaphore;
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, IdempotencyLayer, LockError, LockMode, LockRequest,
    Locks, NodeFailureReason, Quota, RateLimitLayer, RateLimiter, RedisConcurrencyLimiter,
    RedisRateLimiter, Redlock,
};

/// The lock backend's default prefix, which the tests' clients keep.
const P: &str = "tower-redlock:";

/// A value another client wrote.
#[derive(Clone, Copy, Debug)]
enum Foreign {
    Hash,
    List,
    Str(&'static str),
}

use Foreign::{Hash, List, Str};

/// What a node holds at a key: its type, its content (a hash's fields sorted), its PTTL.
#[derive(Debug, PartialEq)]
struct Held {
    kind: String,
    content: Vec<String>,
    pttl: i64,
}

impl Foreign {
    /// Writes the value at `key` on the node at `url`, without expiry, over whatever was
    /// there.
    async fn put_at(self, url: &str, key: &str) {
        let mut conn = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let () = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut write = match self {
            Hash => redis::cmd("HSET"),
            List => redis::cmd("RPUSH"),
            Str(_) => redis::cmd("SET"),
        };
        write.arg(key);
        match self {
            Hash => write.arg("owner").arg("someone else").arg("n").arg("42"),
            List => write.arg("a").arg("b").arg("c"),
            Str(s) => write.arg(s),
        };
        let _: redis::Value = write.query_async(&mut conn).await.unwrap();
    }

    async fn put(self, node: &RedisNode, key: &str) {
        self.put_at(&node.url(), key).await;
    }

    /// What the node holds at its key while the value is untouched.
    fn held(self) -> Held {
        let (kind, content) = match self {
            Hash => ("hash", vec!["n", "42", "owner", "someone else"]),
            List => ("list", vec!["a", "b", "c"]),
            Str(s) => ("string", vec![s]),
        };
        Held {
            kind: kind.to_owned(),
            content: content.into_iter().map(str::to_owned).collect(),
            pttl: -1,
        }
    }
}

async fn held(node: &RedisNode, key: &str) -> Held {
    let mut conn = node.conn().await;
    let kind: String = redis::cmd("TYPE")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
    let read = |name: &str| {
        let mut cmd = redis::cmd(name);
        cmd.arg(key);
        cmd
    };
    let content: Vec<String> = match kind.as_str() {
        "hash" => {
            let fields: BTreeMap<String, String> =
                read("HGETALL").query_async(&mut conn).await.unwrap();
            fields.into_iter().flat_map(|(f, v)| [f, v]).collect()
        }
        "list" => read("LRANGE")
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap(),
        "string" => vec![read("GET").query_async(&mut conn).await.unwrap()],
        "zset" => read("ZRANGE")
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut conn)
            .await
            .unwrap(),
        _ => Vec::new(),
    };
    Held {
        kind,
        content,
        pttl: support::pttl(node, key).await,
    }
}

/// Panics unless `key` holds `value` exactly as it was written.
async fn assert_untouched(node: &RedisNode, key: &str, value: Foreign, what: &str) {
    assert_eq!(
        held(node, key).await,
        value.held(),
        "{what}: {value:?} at {key} was modified"
    );
}

fn lock_key(resource: &str) -> String {
    format!("{P}{resource}")
}

/// The key `role` beside the lock on `resource`.
fn beside(resource: &str, role: &str) -> String {
    format!("{P}{{{P}{resource}}}:{role}")
}

async fn client(node: &RedisNode, fenced: bool) -> Locks {
    Locks::from(
        Redlock::builder([node.url()])
            .ttl(Duration::from_secs(5))
            .node_timeout(Duration::from_millis(500))
            .fencing_tokens(fenced)
            .build()
            .await
            .unwrap(),
    )
}

const WAIT: Duration = Duration::from_millis(150);

fn is_taken<T: std::fmt::Debug>(result: &Result<T, LockError>) -> bool {
    matches!(result, Err(LockError::Taken { .. }))
}

fn is_taken_over<T: std::fmt::Debug>(result: &Result<T, LockError>) -> bool {
    matches!(result, Err(LockError::Expired { taken_over: true }))
}

/// Every way to take a lock, on a lock key that holds a value of another client or type:
/// the lock is held (`Taken`), and nothing is written there or beside it.
#[tokio::test]
async fn a_lock_key_holding_a_foreign_value_is_held_and_left_as_it_is() {
    let node = RedisNode::start();
    let plain = client(&node, false).await;
    let fenced = client(&node, true).await;
    type Request = fn(String) -> LockRequest<'static>;
    let requests: [(&str, &Locks, Request); 9] = [
        ("plain", &plain, |r| LockRequest::new(r)),
        ("plain, waiting", &plain, |r| LockRequest::new(r).wait(WAIT)),
        ("fenced", &fenced, |r| LockRequest::new(r)),
        ("fenced, waiting", &fenced, |r| {
            LockRequest::new(r).wait(WAIT)
        }),
        ("shared", &plain, |r| {
            LockRequest::new(r).mode(LockMode::Shared)
        }),
        ("shared, waiting", &plain, |r| {
            LockRequest::new(r).mode(LockMode::Shared).wait(WAIT)
        }),
        ("exclusive, fenced", &fenced, |r| {
            LockRequest::new(r).mode(LockMode::Exclusive)
        }),
        ("fair, fenced, waiting", &fenced, |r| {
            LockRequest::new(r).mode(LockMode::Fair).wait(WAIT)
        }),
        ("a set, fenced", &fenced, |r| {
            LockRequest::all([r.clone(), format!("{r}-other")]).into()
        }),
    ];
    let mut case = 0;
    for (what, locks, request) in requests {
        for value in [Hash, List, Str("not a token")] {
            case += 1;
            let resource = format!("held-{case}");
            let key = lock_key(&resource);
            value.put(&node, &key).await;
            let result = locks.acquire(request(resource.clone())).await;
            assert!(is_taken(&result), "{what}, {value:?}: {result:?}");
            assert_untouched(&node, &key, value, what).await;
            for role in ["fence", "readers", "writer-waiting"] {
                let aux = beside(&resource, role);
                assert!(!exists(&node, &aux).await, "{what}: {aux}");
            }
            assert!(!exists(&node, &lock_key(&format!("{resource}-other"))).await);
        }
    }
}

/// The waiters' mark beside a held lock holding a value this crate did not write: every
/// waiting attempt leaves it as it is (the waiter still gets `Taken` at its deadline),
/// and so does every release that would delete the mark and publish. Our own mark, in the
/// control round, is set by the same waits and deleted by the same releases.
#[tokio::test]
async fn a_waiters_mark_holding_a_foreign_value_is_neither_set_nor_deleted() {
    let node = RedisNode::start();
    let holder = client(&node, false).await;
    let waiter = client(&node, false).await;
    let fenced_waiter = client(&node, true).await;
    #[derive(Clone, Copy, Debug)]
    enum Holder {
        Plain,
        Reader,
        Set,
    }
    // (what, how the holder holds, who waits and how, whether the holder force-unlocks)
    type Request = fn(String) -> LockRequest<'static>;
    let cases: [(&str, Holder, &Locks, Request, bool); 7] = [
        (
            "plain wait, release",
            Holder::Plain,
            &waiter,
            |r| LockRequest::new(r).wait(WAIT),
            false,
        ),
        (
            "fenced wait, release",
            Holder::Plain,
            &fenced_waiter,
            |r| LockRequest::new(r).wait(WAIT),
            false,
        ),
        (
            "shared wait, release",
            Holder::Plain,
            &waiter,
            |r| LockRequest::new(r).mode(LockMode::Shared).wait(WAIT),
            false,
        ),
        (
            "exclusive wait, reader's release",
            Holder::Reader,
            &fenced_waiter,
            |r| LockRequest::new(r).mode(LockMode::Exclusive).wait(WAIT),
            false,
        ),
        (
            "fair wait, release",
            Holder::Plain,
            &fenced_waiter,
            |r| LockRequest::new(r).mode(LockMode::Fair).wait(WAIT),
            false,
        ),
        (
            "plain wait, release of a set",
            Holder::Set,
            &waiter,
            |r| LockRequest::new(r).wait(WAIT),
            false,
        ),
        (
            "plain wait, force_unlock",
            Holder::Plain,
            &waiter,
            |r| LockRequest::new(r).wait(WAIT),
            true,
        ),
    ];
    let mut case = 0;
    for (what, holds, waits, request, force) in cases {
        for value in [None, Some(Hash), Some(List), Some(Str("x"))] {
            case += 1;
            let resource = format!("marked-{case}");
            let mark = beside(&resource, "waiters");
            let held = match holds {
                Holder::Plain => holder.try_lock(&resource).await,
                Holder::Reader => {
                    let shared = LockRequest::new(resource.clone()).mode(LockMode::Shared);
                    holder.acquire(shared).await
                }
                Holder::Set => {
                    let set = LockRequest::all([resource.clone(), format!("{resource}-b")]);
                    holder.acquire(set).await
                }
            }
            .unwrap();
            if let Some(value) = value {
                value.put(&node, &mark).await;
            }
            let waited = waits.acquire(request(resource.clone())).await;
            assert!(is_taken(&waited), "{what}, {value:?}: {waited:?}");
            match value {
                Some(value) => assert_untouched(&node, &mark, value, what).await,
                None => assert_eq!(
                    support::get(&node, &mark).await.as_deref(),
                    Some("1"),
                    "{what}: the waiter marked the lock"
                ),
            }
            if force {
                assert_eq!(holder.force_unlock(&resource).await.unwrap(), 1, "{what}");
            } else {
                holder.unlock(held).await.unwrap();
            }
            match value {
                Some(value) => assert_untouched(&node, &mark, value, what).await,
                None => assert!(!exists(&node, &mark).await, "{what}: the mark is deleted"),
            }
        }
    }
}

/// A fencing counter of another type or format: every fenced acquisition fails on the
/// node with `InvalidFencingCounter` naming it, sets nothing, and leaves it as it is; an
/// extension of a lease taken before leaves it as it is too.
#[tokio::test]
async fn a_fencing_counter_of_another_format_is_an_error_and_left_as_it_is() {
    let node = RedisNode::start();
    let locks = client(&node, true).await;
    type Request = fn(String) -> LockRequest<'static>;
    let requests: [(&str, Request); 4] = [
        ("plain", |r| LockRequest::new(r)),
        ("exclusive", |r| {
            LockRequest::new(r).mode(LockMode::Exclusive)
        }),
        ("fair", |r| LockRequest::new(r).mode(LockMode::Fair)),
        ("a set", |r| LockRequest::all([format!("{r}-a"), r]).into()),
    ];
    let mut case = 0;
    for (what, request) in requests {
        for value in [Hash, List, Str("not a number")] {
            case += 1;
            let resource = format!("fenced-{case}");
            let counter = beside(&resource, "fence");
            value.put(&node, &counter).await;
            let err = locks.acquire(request(resource.clone())).await.unwrap_err();
            let LockError::NoQuorum { failures, .. } = &err else {
                panic!("{what}, {value:?}: {err:?}");
            };
            assert!(
                matches!(
                    &failures[..],
                    [f] if matches!(&f.reason, NodeFailureReason::InvalidFencingCounter { key } if *key == counter)
                ),
                "{what}, {value:?}: {err:?}"
            );
            assert_untouched(&node, &counter, value, what).await;
            assert!(!exists(&node, &lock_key(&resource)).await, "{what}");
            assert!(!exists(&node, &lock_key(&format!("{resource}-a"))).await);
        }
    }
    // Written after the lease took its fencing token: the extension refreshes the lock
    // and leaves the counter.
    for value in [Hash, List, Str("not a number")] {
        case += 1;
        let resource = format!("fenced-{case}");
        let counter = beside(&resource, "fence");
        let mut lease = locks.try_lock(&resource).await.unwrap();
        value.put(&node, &counter).await;
        locks.extend(&mut lease).await.unwrap();
        assert_untouched(&node, &counter, value, "extension").await;
        locks.unlock(lease).await.unwrap();
        assert_untouched(&node, &counter, value, "release").await;
    }
}

/// A lock key another client overwrote while a lease held it: the extension and the
/// release answer that another holder has it, and leave its value; `force_unlock`
/// deletes only a string (a lock), and leaves a value of another type.
#[tokio::test]
async fn a_lock_key_taken_over_by_a_foreign_value_is_neither_extended_nor_deleted() {
    let node = RedisNode::start();
    let locks = client(&node, true).await;
    let mut case = 0;
    for set in [false, true] {
        for value in [Hash, List, Str("not a token")] {
            case += 1;
            let resource = format!("over-{case}");
            let request = if set {
                LockRequest::all([resource.clone(), format!("{resource}-b")]).into()
            } else {
                LockRequest::new(resource.clone())
            };
            let mut lease = locks.acquire(request).await.unwrap();
            let key = lock_key(&resource);
            value.put(&node, &key).await;
            let extended = locks.extend(&mut lease).await;
            assert!(
                is_taken_over(&extended),
                "set {set}, {value:?}: {extended:?}"
            );
            assert_untouched(&node, &key, value, "extension").await;
            let released = locks.unlock(lease).await;
            assert!(
                is_taken_over(&released),
                "set {set}, {value:?}: {released:?}"
            );
            assert_untouched(&node, &key, value, "release").await;
        }
    }
    for value in [Hash, List] {
        case += 1;
        let resource = format!("over-{case}");
        let key = lock_key(&resource);
        value.put(&node, &key).await;
        assert_eq!(locks.force_unlock(&resource).await.unwrap(), 0);
        assert_untouched(&node, &key, value, "force_unlock").await;
    }
}

/// A readers' set or writer intent of another type (or a writer intent that is not a
/// token): readers and writers find the lock held, a waiting writer neither replaces nor
/// (once it gets the lock) deletes the intent, and a reader's extension and release
/// answer that another holder has the set.
#[tokio::test]
async fn a_readers_set_or_writer_intent_of_another_type_is_left_as_it_is() {
    let node = RedisNode::start();
    let readers = client(&node, false).await;
    let writers = client(&node, true).await;
    let shared = |r: &str| LockRequest::new(r.to_owned()).mode(LockMode::Shared);
    let exclusive = |r: &str| LockRequest::new(r.to_owned()).mode(LockMode::Exclusive);
    let mut case = 0;
    for value in [Hash, List, Str("not a set")] {
        case += 1;
        let resource = format!("rw-{case}");
        let set = beside(&resource, "readers");
        value.put(&node, &set).await;
        let reader = readers.acquire(shared(&resource)).await;
        assert!(is_taken(&reader), "reader, {value:?}: {reader:?}");
        let writer = writers.acquire(exclusive(&resource)).await;
        assert!(is_taken(&writer), "writer, {value:?}: {writer:?}");
        assert_untouched(&node, &set, value, "readers' set").await;
        assert!(!exists(&node, &lock_key(&resource)).await);
    }
    for value in [Hash, List, Str("not a token")] {
        case += 1;
        let resource = format!("rw-{case}");
        let intent = beside(&resource, "writer-waiting");
        let reader = readers.acquire(shared(&resource)).await.unwrap();
        value.put(&node, &intent).await;
        let refused = writers.acquire(shared(&resource)).await;
        assert!(is_taken(&refused), "another reader, {value:?}: {refused:?}");
        let waited = writers.acquire(exclusive(&resource).wait(WAIT)).await;
        assert!(is_taken(&waited), "waiting writer, {value:?}: {waited:?}");
        assert_untouched(&node, &intent, value, "a waiting writer's intent").await;
        readers.unlock(reader).await.unwrap();
        let writer = writers.acquire(exclusive(&resource)).await.unwrap();
        assert_untouched(&node, &intent, value, "the writer that got the lock").await;
        writers.unlock(writer).await.unwrap();
    }
    for value in [Hash, List, Str("not a set")] {
        case += 1;
        let resource = format!("rw-{case}");
        let mut reader = readers.acquire(shared(&resource)).await.unwrap();
        let set = beside(&resource, "readers");
        assert_eq!(reader.key(), set);
        value.put(&node, &set).await;
        let extended = readers.extend(&mut reader).await;
        assert!(is_taken_over(&extended), "{value:?}: {extended:?}");
        let released = readers.unlock(reader).await;
        assert!(is_taken_over(&released), "{value:?}: {released:?}");
        assert_untouched(&node, &set, value, "a reader's extension and release").await;
    }
}

/// A fair queue or its deadlines of another type: a fair waiter finds the lock held,
/// queues nothing, and leaves them as they are, also when it gives up and leaves the
/// queue (seen on the node with `MONITOR`).
#[tokio::test]
async fn a_fair_queue_of_another_type_is_left_as_it_is() {
    let node = RedisNode::start();
    let locks = client(&node, true).await;
    let mut case = 0;
    for role in ["queue", "queue-deadlines"] {
        for value in [Hash, List, Str("not a queue")] {
            case += 1;
            let resource = format!("fair-{case}");
            let key = beside(&resource, role);
            value.put(&node, &key).await;
            let monitor = Monitor::start(&node);
            let fair = LockRequest::new(resource.clone()).mode(LockMode::Fair);
            let waited = locks.acquire(fair.wait(WAIT)).await;
            assert!(is_taken(&waited), "{role}, {value:?}: {waited:?}");
            // The leave: `EVALSHA <sha> 2 <queue> <deadlines> ...`.
            let leave = format!("\"2\" \"{}\"", beside(&resource, "queue"));
            let left = eventually(Duration::from_secs(5), || async {
                monitor.seen(&["EVALSHA", &leave])
            })
            .await;
            assert!(left, "{role}: the waiter did not leave the queue");
            assert_untouched(&node, &key, value, role).await;
            assert!(!exists(&node, &lock_key(&resource)).await);
        }
    }
}

/// `POST /orders` under `IdempotencyLayer`, counting its runs. A body `foreign:<i>` makes
/// the handler write `FOREIGN[i]` at the `role` key beside its own lock (found with
/// `SCAN`) before it answers.
fn orders(url: String, locks: Locks, runs: Arc<std::sync::atomic::AtomicUsize>) -> Router {
    Router::new().route(
        "/orders",
        post(move |headers: HeaderMap, body: String| {
            let (url, runs) = (url.clone(), runs.clone());
            async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if let Some(order) = body.strip_prefix("foreign:") {
                    let (role, i) = order.split_once(':').unwrap();
                    let idempotency_key = headers["idempotency-key"].to_str().unwrap();
                    let mut lock = support::scan(&url, &format!("{P}*{idempotency_key}*")).await;
                    // The lock key, not the keys beside it (`<prefix>{<lock key>}:<role>`).
                    lock.retain(|key| !key.contains('{'));
                    let [lock] = &lock[..] else {
                        panic!("one lock key while the handler runs: {lock:?}");
                    };
                    let value = FOREIGN[i.parse::<usize>().unwrap()];
                    value.put_at(&url, &format!("{P}{{{lock}}}:{role}")).await;
                }
                (StatusCode::CREATED, "created")
            }
        })
        .layer(IdempotencyLayer::new().backend(locks)),
    )
}

const FOREIGN: [Foreign; 3] = [Hash, List, Str("not a record")];

async fn post_order(base: &str, key: &str, body: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/orders"))
        .header("Idempotency-Key", key)
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

/// An idempotency record key holding a value of another type, or a string that is not a
/// record: the retry is answered 500 with one error line each, runs nothing, takes no
/// lock, and the value is left. Written while the first request runs, it is not
/// overwritten when the request ends (the lock is released all the same); a foreign
/// waiters' mark beside the lock is left too, and the record is stored.
#[tokio::test]
async fn an_idempotency_record_of_another_type_or_format_is_refused_and_left_as_it_is() {
    let (logs, _guard) = Logs::capture();
    let node = RedisNode::start();
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ran = || runs.load(std::sync::atomic::Ordering::SeqCst);
    let base = serve(orders(node.url(), client(&node, false).await, runs.clone())).await;
    for (i, value) in FOREIGN.into_iter().enumerate() {
        let key = format!("order-retried-{i}");
        assert_eq!(post_order(&base, &key, "first").await.status(), 201);
        let records = support::scan(&node.url(), &format!("{P}{{*{key}*}}:record")).await;
        let [record] = &records[..] else {
            panic!("one record: {records:?}");
        };
        let lock = &record[P.len() + 1..record.len() - "}:record".len()];
        value.put(&node, record).await;
        let before = ran();
        let retry = post_order(&base, &key, "first").await;
        assert_eq!(retry.status(), 500, "{value:?}");
        assert_eq!(ran(), before, "{value:?}: the handler ran again");
        assert_untouched(&node, record, value, "a retry").await;
        assert!(!exists(&node, lock).await, "{value:?}: a lock was taken");
    }
    assert_eq!(
        logs.errors_with("an idempotency record could not be read"),
        FOREIGN.len(),
        "one line per refused retry"
    );
    for role in ["record", "waiters"] {
        for (i, value) in FOREIGN.into_iter().enumerate() {
            let key = format!("order-{role}-{i}");
            let first = post_order(&base, &key, &format!("foreign:{role}:{i}")).await;
            assert_eq!(first.status(), 201, "{role}, {value:?}");
            assert_eq!(first.text().await.unwrap(), "created");
            let locks = support::scan(&node.url(), &format!("{P}*{key}*")).await;
            let lock = locks.iter().find(|k| !k.contains('{'));
            let beside = locks.iter().find(|k| k.ends_with(&format!("}}:{role}")));
            let beside = beside.expect("the value the handler wrote");
            // The record is stored (and the lock released) as the response ends.
            let released = eventually(Duration::from_secs(5), || async {
                lock.is_none() || !exists(&node, lock.unwrap()).await
            })
            .await;
            assert!(released, "{role}, {value:?}: the lock was not released");
            assert_untouched(&node, beside, value, role).await;
            let retry = post_order(&base, &key, &format!("foreign:{role}:{i}")).await;
            match role {
                "record" => assert_eq!(retry.status(), 500, "{value:?}"),
                _ => {
                    assert_eq!(retry.status(), 201, "{value:?}");
                    assert_eq!(retry.headers()["idempotent-replayed"], "true");
                }
            }
            assert_untouched(&node, beside, value, role).await;
        }
    }
}

/// A fixed-window count or GCRA arrival time of another type, not a decimal, or without
/// expiry (this crate's always expire): `hit` is an error, the layer lets the request
/// through (limiters fail open) or answers 503 when failing closed, and the value is left.
#[tokio::test]
async fn a_rate_limit_counter_of_another_type_or_format_is_an_error_and_left_as_it_is() {
    let node = RedisNode::start();
    let limiter = RedisRateLimiter::builder(node.url())
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let quotas = [
        ("fixed window", "5/60".parse::<Quota>().unwrap()),
        ("GCRA", Quota::gcra(5, Duration::from_secs(1), 2).unwrap()),
    ];
    let values = [Hash, List, Str("abc"), Str("7")];
    let mut case = 0;
    for (what, quota) in quotas {
        for value in values {
            case += 1;
            let resource = format!("rate-{case}");
            let key = format!("tower-redlock-rate:{resource}");
            value.put(&node, &key).await;
            let hit = limiter.hit(&resource, quota).await;
            assert!(hit.is_err(), "{what}, {value:?}: {hit:?}");
            assert_untouched(&node, &key, value, what).await;
        }
        for fail_open in [true, false] {
            case += 1;
            let scope = format!("rate-{case}");
            let app = Router::new()
                .route("/search", post(|| async { "results" }))
                .layer(
                    RateLimitLayer::global(quota)
                        .scope(&*scope)
                        .backend(RateLimiter::from(limiter.clone()))
                        .fail_open(fail_open)
                        // Uncounted while the store cannot count, so that every foreign
                        // value gets the outage answer (the in-process fallback has tests
                        // of its own in rate_limit.rs).
                        .outage_replicas(0),
                );
            let base = serve(app).await;
            let client = reqwest::Client::new();
            // A first request finds the layer's key.
            let first = support::post_to(&client, format!("{base}/search")).await;
            assert_eq!(first.status(), 200);
            let keys = support::scan(&node.url(), &format!("tower-redlock-rate:{scope}:*")).await;
            let [key] = &keys[..] else {
                panic!("one key: {keys:?}")
            };
            for value in values {
                value.put(&node, key).await;
                let answer = support::post_to(&client, format!("{base}/search")).await;
                let expected = if fail_open { 200 } else { 503 };
                assert_eq!(answer.status(), expected, "{what}, {value:?}");
                assert_untouched(&node, key, value, what).await;
            }
        }
    }
}

/// A permit set of another type, and a waiters' mark this crate did not write, under
/// `ConcurrencyLimitLayer`: the request runs unguarded (the limiter fails open), a waiter
/// still gets its permit (on its timer), and renewals and releases of a permit whose set
/// was overwritten leave the value as it is.
#[tokio::test]
async fn a_permit_set_or_mark_of_another_type_is_left_as_it_is() {
    let node = RedisNode::start();
    let limiter = |ttl: Duration| {
        let url = node.url();
        async move {
            ConcurrencyLimiter::from(
                RedisConcurrencyLimiter::builder(url)
                    .permit_ttl(ttl)
                    .timeout(Duration::from_secs(2))
                    .build()
                    .await
                    .unwrap(),
            )
        }
    };
    let client = reqwest::Client::new();
    let gated = |scope: &str, limiter: ConcurrencyLimiter, gate: Arc<Semaphore>| {
        let layer = ConcurrencyLimitLayer::global(1)
            .scope(scope)
            .backend(limiter)
            .max_wait(Duration::from_secs(5));
        Router::new()
            .route(
                "/work",
                post(move || {
                    let gate = gate.clone();
                    async move {
                        gate.acquire().await.expect("open").forget();
                        "done"
                    }
                }),
            )
            .route_layer(layer)
    };
    let post_work = |base: &str| client.post(format!("{base}/work")).send();

    // The permit set.
    for (i, value) in [Hash, List, Str("not a set")].into_iter().enumerate() {
        let scope = format!("set-{i}");
        let set = format!("tower-redlock-concurrency:{{{scope}:all}}");
        value.put(&node, &set).await;
        let app = gated(
            &scope,
            limiter(Duration::from_secs(10)).await,
            Arc::new(Semaphore::new(1)),
        );
        let base = serve(app).await;
        assert_eq!(post_work(&base).await.unwrap().status(), 200, "{value:?}");
        assert_untouched(&node, &set, value, "the permit set").await;
    }

    // The mark: a waiter marks the set (ours in the control round), and the holder's
    // release deletes only our mark.
    for (i, value) in [None, Some(Hash), Some(List), Some(Str("x"))]
        .into_iter()
        .enumerate()
    {
        let scope = format!("mark-{i}");
        let set = format!("tower-redlock-concurrency:{{{scope}:all}}");
        let mark = format!("{set}:waiters");
        if let Some(value) = value {
            value.put(&node, &mark).await;
        }
        let gate = Arc::new(Semaphore::new(0));
        let base = serve(gated(
            &scope,
            limiter(Duration::from_secs(10)).await,
            gate.clone(),
        ))
        .await;
        let monitor = Monitor::start(&node);
        let holder = tokio::spawn(post_work(&base));
        let held = eventually(Duration::from_secs(5), || async {
            exists(&node, &set).await
        });
        assert!(held.await, "the holder took no permit");
        let waiter = tokio::spawn(post_work(&base));
        // A waiting try: `EVALSHA <sha> 2 <set> <mark> ...`.
        let marking = format!("\"2\" \"{set}\" \"{mark}\"");
        let tried = eventually(Duration::from_secs(5), || async {
            monitor.seen(&["EVALSHA", &marking])
        });
        assert!(
            tried.await,
            "{value:?}: the waiter did not try with its mark"
        );
        match value {
            Some(value) => assert_untouched(&node, &mark, value, "a waiting try").await,
            None => assert_eq!(support::get(&node, &mark).await.as_deref(), Some("1")),
        }
        gate.add_permits(2);
        assert_eq!(holder.await.unwrap().unwrap().status(), 200);
        assert_eq!(waiter.await.unwrap().unwrap().status(), 200, "{value:?}");
        match value {
            Some(value) => assert_untouched(&node, &mark, value, "a release").await,
            None => assert!(!exists(&node, &mark).await, "our mark is deleted"),
        }
    }

    // Renewals (every 100 ms for 300 ms permits) and the release of a permit whose set
    // another client overwrote while the request ran: the request runs on (a lost permit
    // does not stop it), and the value stays.
    for (i, value) in [Hash, List, Str("not a set")].into_iter().enumerate() {
        let scope = format!("renew-{i}");
        let set = format!("tower-redlock-concurrency:{{{scope}:all}}");
        let gate = Arc::new(Semaphore::new(0));
        let base = serve(gated(
            &scope,
            limiter(Duration::from_millis(300)).await,
            gate.clone(),
        ))
        .await;
        let monitor = Monitor::start(&node);
        let request = tokio::spawn(post_work(&base));
        let held = eventually(Duration::from_secs(5), || async {
            exists(&node, &set).await
        });
        assert!(held.await, "no permit was taken");
        value.put(&node, &set).await;
        // A renewal: `EVALSHA <sha> 1 <set> ...`, after the overwrite.
        let seen = monitor.lines().len();
        let renewal = format!("\"1\" \"{set}\"");
        let renewed = eventually(Duration::from_secs(5), || async {
            monitor.lines()[seen..]
                .iter()
                .any(|line| line.contains("EVALSHA") && line.contains(&renewal))
        });
        assert!(renewed.await, "{value:?}: no renewal was tried");
        gate.add_permits(1);
        assert_eq!(request.await.unwrap().unwrap().status(), 200, "{value:?}");
        // The release: `EVALSHA <sha> 2 <set> <mark> ...`.
        let release = format!("\"2\" \"{set}\"");
        let released = eventually(Duration::from_secs(5), || async {
            monitor.seen(&["EVALSHA", &release])
        });
        assert!(released.await, "{value:?}: the permit was not released");
        assert_untouched(&node, &set, value, "renewals and the release").await;
    }
}
