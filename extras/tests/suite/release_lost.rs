//! Exactly one release when `LockLayer`'s lease is lost in each phase of a request (before
//! the handler runs, while it runs, after the response head, mid-body; stopping the work
//! or letting it run on), and when a real HTTP client goes away mid-body, on both
//! backends; and one release of a `ConcurrencyLimitLayer` permit on Redis whichever poll
//! its response is dropped before. Counted as `release_once` counts.

use crate::release_once::{Inner, Store, drive, layer};
use crate::support::{self, RedisNode};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;
use tower::{Layer, Service, ServiceExt};
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, OnLockLoss, RedisConcurrencyLimiter,
};

/// A lease's TTL: its validity runs out while the request waits.
fn ttl(node: Option<&RedisNode>) -> Duration {
    Duration::from_millis(if node.is_some() { 90 } else { 50 })
}

#[tokio::test]
async fn one_release_when_the_lease_is_lost_while_running_after_the_head_or_mid_body() {
    let node = RedisNode::start();
    for node in [None, Some(&node)] {
        let mut store = Store::new(node, ttl(node)).await;
        for on_loss in [OnLockLoss::Abort, OnLockLoss::Continue] {
            let abort = on_loss == OnLockLoss::Abort;
            let phases = [
                // (what the handler does, the phase, the status, data frames (the 503's
                // one is its problem), a body error)
                (
                    Inner::Hangs,
                    "running",
                    if abort { 503 } else { 200 },
                    usize::from(abort),
                    false,
                ),
                (Inner::HeadThenHangs, "after the head", 200, 0, abort),
                (Inner::FrameThenHangs, "mid-body", 200, 1, abort),
            ];
            for (inner, phase, status, frames, body_error) in phases {
                let mut service = layer(&store.locks, on_loss).layer(inner);
                let value = format!("{phase}-{on_loss:?}");
                let driven = drive(&mut service, &value, None).await;
                let what = format!("lost {phase}, {on_loss:?}");
                assert_eq!(driven.status, Some(status), "{}: {what}", store.name);
                assert_eq!(driven.frames, frames, "{}: {what}", store.name);
                assert_eq!(driven.body_error, body_error, "{}: {what}", store.name);
                assert!(driven.over, "{}: {what}", store.name);
                store.released(&value, 1, &what).await;
            }
        }
    }
}

#[tokio::test]
async fn one_release_when_the_lease_is_lost_between_the_decision_and_the_handler() {
    // In process the decision is made in `call`: the lease runs out before the first poll.
    let mut store = Store::new(None, ttl(None)).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = {
        let runs = runs.clone();
        tower::service_fn(move |_request: Request<_>| {
            let runs = runs.clone();
            // Counted when polled: the service is called as the request is admitted.
            async move {
                runs.fetch_add(1, SeqCst);
                Ok::<_, String>(http::Response::new(Empty::<Bytes>::new()))
            }
        })
    };
    let mut service = layer(&store.locks, OnLockLoss::Abort).layer(counted);
    let request = Request::builder()
        .header("x-key", "deciding")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let future = service.ready().await.unwrap().call(request);
    assert!(store.held("deciding").await);
    let expired = support::eventually(Duration::from_secs(2), || async {
        !store.held("deciding").await
    });
    assert!(expired.await, "the lease did not run out");
    let response = future.await.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(runs.load(SeqCst), 0, "the handler ran on a lost lease");
    store
        .released("deciding", 1, "lost before the handler ran")
        .await;
}

/// `GET /stream`: one chunk, then (once `more` is notified) chunks as fast as they are
/// taken.
fn streaming(store: &Store<'_>, more: Arc<Notify>) -> Router {
    let handler = move || {
        let more = more.clone();
        async move {
            let chunks = futures_util::stream::unfold(0u64, move |sent| {
                let more = more.clone();
                async move {
                    if sent == 1 {
                        more.notified().await;
                    }
                    let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                    Some((Ok::<_, std::io::Error>(chunk), sent + 1))
                }
            });
            Body::from_stream(chunks)
        }
    };
    let lock = layer(&store.locks, OnLockLoss::Abort);
    Router::new().route("/stream", get(handler).layer(lock))
}

#[tokio::test]
async fn one_release_when_the_client_goes_away_mid_body() {
    let node = RedisNode::start();
    for node in [None, Some(&node)] {
        let mut store = Store::new(node, Duration::from_secs(10)).await;
        let more = Arc::new(Notify::new());
        let base = support::serve(streaming(&store, more.clone())).await;
        store.idle_now();
        let addr = base.trim_start_matches("http://");
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("GET /stream HTTP/1.1\r\nhost: {addr}\r\nx-key: gone\r\n\r\n");
        client.write_all(head.as_bytes()).await.unwrap();
        // The head and the first chunk.
        let mut read = Vec::new();
        let mut buffer = vec![0; 16 * 1024];
        while read.len() < 32 * 1024 {
            let n = client.read(&mut buffer).await.unwrap();
            assert!(n > 0, "{}: the server closed first", store.name);
            read.extend_from_slice(&buffer[..n]);
        }
        assert!(read.starts_with(b"HTTP/1.1 200"), "{}", store.name);
        assert!(
            store.held("gone").await,
            "{}: held while the body streams",
            store.name
        );
        drop(client);
        // The body goes on; writing it, the server finds the client gone.
        more.notify_one();
        store
            .released("gone", 1, "the client went away mid-body")
            .await;
    }
}

#[tokio::test]
async fn one_concurrency_permit_release_when_the_response_is_dropped_before_any_of_its_polls() {
    let node = RedisNode::start();
    let limiter = RedisConcurrencyLimiter::builder(node.url())
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let mut service = ConcurrencyLimitLayer::by_header("x-key", 1)
        .backend(ConcurrencyLimiter::from(limiter))
        .layer(Inner::Frames(2));
    // Each release is one `ZREM` on the node.
    let zrem = || async { support::calls(&node, "zrem").await };
    let full = drive(&mut service, "warm-up", None).await;
    assert_eq!((full.status, full.over), (Some(200), true));
    let idle = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let settle = || async {
        let metrics = tokio::runtime::Handle::current().metrics();
        while metrics.num_alive_tasks() > idle {
            tokio::task::yield_now().await;
        }
    };
    settle().await;
    // Dropped before poll 0, 1, ... until a request is done before its limit.
    for limit in 0.. {
        let before = zrem().await;
        let value = format!("cut-{limit}");
        let cut = drive(&mut service, &value, Some(limit)).await;
        settle().await;
        let released = zrem().await - before;
        // The permit is free: a limit of one admits the next request.
        let next = drive(&mut service, &value, None).await;
        let what = format!("dropped before poll {limit} (done: {})", cut.over);
        assert_eq!(next.status, Some(200), "{what}: the permit was kept");
        // Nothing is asked before the first poll.
        assert_eq!(released, u64::from(limit > 0), "{what}: releases");
        if cut.over {
            eprintln!("dropped before each of {limit} polls");
            break;
        }
        assert!(limit < 100, "never done");
    }
}
