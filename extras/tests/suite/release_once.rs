//! Exactly one release on every path of `LockLayer`'s response future and body, on both
//! backends: dropped before any of their polls, a body that fails, an inner service that
//! fails. `release_lost` loses the lease in each phase and lets a real client go away.
//!
//! Releases are counted from what they do: the `tower_redlock.release` operations the
//! store runs (each is a span, counted on this thread, where everything runs) and, on
//! Redis, the release scripts the node ran (its `EVALSHA` calls less its acquisitions, each
//! an acquisition script's `PTTL`). The key is free after each path. Renewal is off, so
//! that the node runs no other script.

use crate::support::RedisNode;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::Empty;
use tower::{Layer, Service, ServiceExt};
use tower_redlock::key::HeaderKey;
use tower_redlock::{LeaseStatus, LockLayer, Locks, MemoryLocks, OnLockLoss, Redlock, Renewal};
use tracing_subscriber::layer::SubscriberExt;

/// The lock's scope, so that its key is `tower-redlock:once:<value>`.
pub(crate) const SCOPE: &str = "once";

/// Counts the `tower_redlock.release` spans made on this thread while it lives.
struct ReleaseSpans(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ReleaseSpans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() == "tower_redlock.release" {
            self.0.fetch_add(1, SeqCst);
        }
    }
}

/// A backend, and what tells how many releases it ran.
pub(crate) struct Store<'n> {
    pub(crate) name: &'static str,
    pub(crate) locks: Locks,
    /// The node, and a connection to it kept open: one made per look would leave a task
    /// behind for a while.
    node: Option<(&'n RedisNode, redis::aio::MultiplexedConnection)>,
    spans: Arc<AtomicUsize>,
    _spans: tracing::subscriber::DefaultGuard,
    /// The spans and the node's (`EVALSHA`, `PTTL`) calls counted so far.
    seen: (usize, u64, u64),
    /// The tasks alive when idle.
    idle_tasks: usize,
}

impl<'n> Store<'n> {
    /// The in-process store, or Redis on `node`, with leases of `ttl` and no renewal.
    pub(crate) async fn new(node: Option<&'n RedisNode>, ttl: Duration) -> Store<'n> {
        let locks = match node {
            None => Locks::from(MemoryLocks::builder().ttl(ttl).build().unwrap()),
            Some(node) => Locks::from(
                Redlock::builder([node.url()])
                    .ttl(ttl)
                    .node_timeout(ttl / 3)
                    .build()
                    .await
                    .unwrap(),
            ),
        };
        let node = match node {
            Some(node) => Some((node, node.conn().await)),
            None => None,
        };
        let spans = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry().with(ReleaseSpans(spans.clone()));
        let mut store = Store {
            name: if node.is_some() {
                "redis"
            } else {
                "in-process"
            },
            locks,
            node,
            spans,
            _spans: tracing::subscriber::set_default(subscriber),
            seen: (0, 0, 0),
            idle_tasks: 0,
        };
        // One request first: the scripts are loaded and the connections made.
        let mut warm_up = service(&store.locks, Inner::Frames(2));
        assert_eq!(drive(&mut warm_up, "warm-up", None).await.status, Some(200));
        store.idle_now();
        store.settle().await;
        store.observe().await;
        store
    }

    /// The node's `EVALSHA` and `PTTL` calls so far (`INFO commandstats`).
    async fn scripts(&mut self) -> (u64, u64) {
        let Some((_, conn)) = &mut self.node else {
            return (0, 0);
        };
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn)
            .await
            .unwrap();
        let calls = |name: &str| {
            let line = info
                .lines()
                .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")));
            line.and_then(|rest| rest.split(',').next()?.parse().ok())
                .unwrap_or(0)
        };
        (calls("evalsha"), calls("pttl"))
    }

    /// Takes the tasks alive now as the idle ones (a server started since).
    pub(crate) fn idle_now(&mut self) {
        self.idle_tasks = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
    }

    /// Waits until the tasks spawned since idle (background releases) are done.
    async fn settle(&self) {
        let metrics = tokio::runtime::Handle::current().metrics();
        let started = Instant::now();
        while metrics.num_alive_tasks() > self.idle_tasks {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{}: tasks left",
                self.name
            );
            tokio::task::yield_now().await;
        }
    }

    /// Releases since the last look: (release operations, release scripts the node ran).
    async fn observe(&mut self) -> (usize, u64) {
        self.settle().await;
        let spans = self.spans.load(SeqCst);
        let (evalsha, pttl) = self.scripts().await;
        let (old_spans, old_evalsha, old_pttl) =
            std::mem::replace(&mut self.seen, (spans, evalsha, pttl));
        let scripts = (evalsha - old_evalsha).saturating_sub(pttl - old_pttl);
        (spans - old_spans, scripts)
    }

    /// Checks that `what`, on the key of `value`, released `expected` times (on Redis, by
    /// the node's count too), and that the key is free.
    pub(crate) async fn released(&mut self, value: &str, expected: usize, what: &str) {
        let (spans, scripts) = self.observe().await;
        let name = self.name;
        assert_eq!(spans, expected, "{name}, {what}: release operations");
        if self.node.is_some() {
            assert_eq!(
                scripts, expected as u64,
                "{name}, {what}: release scripts on the node"
            );
        }
        assert!(
            !self.held(value).await,
            "{name}, {what}: the key is still held"
        );
        // The look at the key is no release.
        self.observe().await;
    }

    /// Whether the lock on `value` is held.
    pub(crate) async fn held(&self, value: &str) -> bool {
        let resource = format!("{SCOPE}:{value}");
        self.locks.inspect(&resource).await.unwrap().is_held()
    }
}

/// `LockLayer` on the header `x-key` of `locks`, its lease never renewed.
pub(crate) fn layer(locks: &Locks, on_loss: OnLockLoss) -> LockLayer<HeaderKey> {
    LockLayer::by_header("x-key")
        .scope(SCOPE)
        .backend(locks.clone())
        .renewal(Renewal::disabled())
        .on_lock_loss(on_loss)
}

/// [`layer`] over [`Inner`], aborting on loss.
pub(crate) fn service(
    locks: &Locks,
    inner: Inner,
) -> impl Service<
    Request<Empty<Bytes>>,
    Response = Response<impl Body<Data = Bytes> + use<>>,
    Error = String,
> + use<> {
    layer(locks, OnLockLoss::Abort).layer(inner)
}

/// What the inner service does. Each step comes after one wait (`Pending`, woken at once),
/// and "until lost" is until the lease is lost (never, with `OnLockLoss::Abort`, as the
/// layer stops the work first).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Inner {
    /// Answers with this many data frames.
    Frames(usize),
    /// Answers with a frame, then a body error.
    FailingBody,
    /// Fails.
    Fails,
    /// Answers until lost.
    Hangs,
    /// Answers with a body that ends when lost.
    HeadThenHangs,
    /// Answers with a frame, then a body that ends when lost.
    FrameThenHangs,
}

type Until = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Until `status`'s lease is lost.
fn until_lost(status: Option<LeaseStatus>) -> Until {
    Box::pin(async move {
        match status {
            Some(status) => status.lost().await,
            None => std::future::pending().await,
        }
    })
}

/// A wait: `Pending`, woken at once, the first time it is asked.
fn wait(waited: &mut bool, cx: &mut Context<'_>) -> bool {
    if std::mem::replace(waited, true) {
        *waited = false;
        return false;
    }
    cx.waker().wake_by_ref();
    true
}

impl<B> Service<Request<B>> for Inner {
    type Response = Response<TestBody>;
    type Error = String;
    type Future = Pin<Box<dyn Future<Output = Result<Response<TestBody>, String>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), String>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let status = request.extensions().get::<LeaseStatus>().cloned();
        let body = |frames, fail, until| TestBody {
            frames,
            fail,
            until,
            waited: false,
        };
        let (mut answer, mut until) = (None, None);
        match *self {
            Inner::Frames(n) => answer = Some(body(n, false, None)),
            Inner::FailingBody => answer = Some(body(1, true, None)),
            Inner::Fails => {}
            Inner::Hangs => until = Some(until_lost(status.clone())),
            Inner::HeadThenHangs => answer = Some(body(0, false, Some(until_lost(status)))),
            Inner::FrameThenHangs => answer = Some(body(1, false, Some(until_lost(status)))),
        }
        let mut waited = false;
        Box::pin(std::future::poll_fn(move |cx| {
            if wait(&mut waited, cx) {
                return Poll::Pending;
            }
            if let Some(until) = &mut until {
                std::task::ready!(until.as_mut().poll(cx));
                return Poll::Ready(Ok(Response::new(body(0, false, None))));
            }
            Poll::Ready(
                answer
                    .take()
                    .map(Response::new)
                    .ok_or_else(|| "the service failed".to_owned()),
            )
        }))
    }
}

/// The inner service's body: `frames` data frames, then an error when `fail`, then the
/// end once `until` is over; each after a wait.
pub(crate) struct TestBody {
    frames: usize,
    fail: bool,
    until: Option<Until>,
    waited: bool,
}

impl Body for TestBody {
    type Data = Bytes;
    type Error = String;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, String>>> {
        let this = &mut *self;
        if wait(&mut this.waited, cx) {
            return Poll::Pending;
        }
        if this.frames > 0 {
            this.frames -= 1;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"ab")))));
        }
        if std::mem::take(&mut this.fail) {
            return Poll::Ready(Some(Err("the body failed".to_owned())));
        }
        if let Some(until) = &mut this.until {
            std::task::ready!(until.as_mut().poll(cx));
            this.until = None;
        }
        Poll::Ready(None)
    }
}

/// How a request went.
#[derive(Debug, Default)]
pub(crate) struct Driven {
    /// Polls of the response future and the body.
    pub(crate) polls: usize,
    pub(crate) status: Option<u16>,
    pub(crate) frames: usize,
    pub(crate) body_error: bool,
    /// The body's end (or error) was read.
    pub(crate) over: bool,
}

/// Polls `poll` once per wake-up, unless `driven.polls` has reached `limit`: `None` then.
async fn within<T>(
    driven: &mut Driven,
    limit: Option<usize>,
    mut poll: impl FnMut(&mut Context<'_>) -> Poll<T>,
) -> Option<T> {
    std::future::poll_fn(|cx| {
        if limit.is_some_and(|limit| driven.polls >= limit) {
            return Poll::Ready(None);
        }
        driven.polls += 1;
        poll(cx).map(Some)
    })
    .await
}

/// Sends a request with the key `value` through `service` and reads its body to the end,
/// dropping both after `limit` polls in all.
pub(crate) async fn drive<S, B>(service: &mut S, value: &str, limit: Option<usize>) -> Driven
where
    S: Service<Request<Empty<Bytes>>, Response = Response<B>, Error = String>,
    B: Body<Data = Bytes>,
{
    let mut driven = Driven::default();
    let request = Request::builder()
        .header("x-key", value)
        .body(Empty::new())
        .unwrap();
    let service = service.ready().await.unwrap();
    let mut future = std::pin::pin!(service.call(request));
    let Some(response) = within(&mut driven, limit, |cx| future.as_mut().poll(cx)).await else {
        return driven;
    };
    let Ok(response) = response else {
        driven.over = true;
        return driven;
    };
    driven.status = Some(response.status().as_u16());
    let mut body = std::pin::pin!(response.into_body());
    loop {
        match within(&mut driven, limit, |cx| body.as_mut().poll_frame(cx)).await {
            None => return driven,
            Some(Some(Ok(_))) => driven.frames += 1,
            Some(Some(Err(_))) => {
                driven.body_error = true;
                driven.over = true;
                return driven;
            }
            Some(None) => {
                driven.over = true;
                return driven;
            }
        }
    }
}

#[tokio::test]
async fn one_release_when_the_response_is_dropped_before_any_of_its_polls() {
    let node = RedisNode::start();
    for node in [None, Some(&node)] {
        let mut store = Store::new(node, Duration::from_secs(10)).await;
        let mut service = service(&store.locks, Inner::Frames(2));
        let full = drive(&mut service, "full", None).await;
        assert_eq!((full.status, full.frames, full.over), (Some(200), 2, true));
        store.released("full", 1, "a whole response").await;
        // Dropped before poll 0, 1, ... until a request is done before its limit (how many
        // polls it takes depends on when the node answers).
        for limit in 0.. {
            let value = format!("cut-{limit}");
            let cut = drive(&mut service, &value, Some(limit)).await;
            // On Redis, nothing is asked before the first poll.
            let expected = usize::from(store.node.is_none() || limit > 0);
            let what = format!("dropped before poll {limit} (done: {})", cut.over);
            store.released(&value, expected, &what).await;
            if cut.over {
                eprintln!("{}: dropped before each of {limit} polls", store.name);
                break;
            }
            assert!(limit < 100, "{}: never done", store.name);
        }
    }
}

#[tokio::test]
async fn one_release_when_the_body_or_the_service_fails() {
    let node = RedisNode::start();
    for node in [None, Some(&node)] {
        let mut store = Store::new(node, Duration::from_secs(10)).await;
        let mut failing_body = service(&store.locks, Inner::FailingBody);
        let driven = drive(&mut failing_body, "body", None).await;
        assert_eq!(
            (driven.status, driven.frames, driven.body_error),
            (Some(200), 1, true)
        );
        store.released("body", 1, "a body that fails").await;
        let mut failing = service(&store.locks, Inner::Fails);
        let driven = drive(&mut failing, "service", None).await;
        assert_eq!((driven.status, driven.over), (None, true));
        store.released("service", 1, "a service that fails").await;
    }
}
