//! The core on its own: a probe policy that records what the core asks of it, and bodies
//! that yield their frames as told.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode, response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tower::{Layer, Service, ServiceExt, service_fn};

use super::KeyedLayer;
use super::policy::{BoxError, Decision, End, Hold, Permit, Policy, Release, Sealed, Verdict};
use crate::future::Watch;
use crate::key::FnKey;

/// Reads the probe key from the `key` header.
type KeyFn = fn(&Parts) -> Option<String>;

/// Records what the core does, in order.
#[derive(Clone, Default)]
struct Probe {
    events: Arc<Mutex<Vec<String>>>,
    lost: Arc<AtomicBool>,
    hold_to_body_end: bool,
    /// Decide through a future, as a remote backend does.
    remote: bool,
}

impl Probe {
    /// A probe whose permit is held until the response body ends.
    fn holding() -> Self {
        Self {
            hold_to_body_end: true,
            ..Self::default()
        }
    }

    fn log(&self, event: impl Into<String>) {
        self.events.lock().unwrap().push(event.into());
    }

    fn events(&self) -> Vec<String> {
        self.events.lock().unwrap().clone()
    }

    fn layer(&self) -> KeyedLayer<FnKey<KeyFn>, Probe> {
        fn key(parts: &Parts) -> Option<String> {
            parts
                .headers
                .get("key")
                .map(|v| v.to_str().unwrap().to_owned())
        }
        KeyedLayer::from_parts(
            FnKey::new(key as KeyFn),
            self.clone(),
            Cow::Borrowed("no probe key"),
        )
    }
}

impl Sealed for Probe {}

impl<S, K> Layer<S> for KeyedLayer<K, Probe> {
    type Service = super::Keyed<S, K, Probe>;

    fn layer(&self, inner: S) -> Self::Service {
        super::Keyed::new(inner, self.clone())
    }
}

impl Policy for Probe {
    type Permit = ProbePermit;
    const REJECTED_BY: crate::rejection::RejectedBy = crate::rejection::RejectedBy::Lock;
    const FAIL_OPEN: bool = false;

    fn prefix(&self) -> &str {
        "p:"
    }

    const SEVERAL_KEYS: bool = true;

    fn decide_all(&self, keys: Vec<Arc<str>>, _parts: &Parts) -> Decision<ProbePermit> {
        self.log(format!("decide all {}", keys.join(" ")));
        Decision::Ready(Verdict::Admit(ProbePermit {
            probe: self.clone(),
        }))
    }

    fn decide(&self, key: &str, _parts: &Parts) -> Decision<ProbePermit> {
        self.log(format!("decide {key}"));
        let permit = ProbePermit {
            probe: self.clone(),
        };
        if self.remote {
            Decision::Pending(Box::pin(async move {
                tokio::task::yield_now().await;
                Verdict::Admit(permit)
            }))
        } else {
            Decision::Ready(Verdict::Admit(permit))
        }
    }
}

struct ProbePermit {
    probe: Probe,
}

impl Watch for ProbePermit {
    fn lost_before_poll(&mut self, _: &mut Context<'_>) -> bool {
        self.probe.lost.load(Ordering::SeqCst)
    }

    fn poll_lost(&mut self, _: &mut Context<'_>) -> Poll<()> {
        if self.probe.lost.load(Ordering::SeqCst) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl Permit for ProbePermit {
    fn admit<B>(&mut self, _request: &mut Request<B>) {
        self.probe.log("admit");
    }

    fn lost_response(self) -> Response<Bytes> {
        self.probe.log("lost response");
        let mut response = Response::new(Bytes::new());
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        response
    }

    fn lost_error(self) -> BoxError {
        self.probe.log("lost error");
        "lost".into()
    }

    fn on_response(&mut self, _head: &mut response::Parts) -> Hold {
        self.probe.log("response");
        if self.probe.hold_to_body_end {
            Hold::BodyEnd
        } else {
            Hold::Head
        }
    }

    fn on_data(&mut self, data: &Bytes) {
        self.probe
            .log(format!("data {}", String::from_utf8_lossy(data)));
    }

    fn release(self, end: End) -> Release {
        self.probe.log(format!("release {end:?}"));
        Release::Done
    }
}

/// A body that yields its frames one per poll, each after a `Pending` when `slow`; it
/// reports its exact size when `sized`, and its end (without a last poll) when `tells_end`.
pub(crate) struct Frames {
    frames: VecDeque<&'static str>,
    slow: bool,
    ready: bool,
    sized: bool,
    tells_end: bool,
}

impl Frames {
    fn new(frames: &[&'static str]) -> Self {
        Self {
            frames: frames.iter().copied().collect(),
            slow: false,
            ready: false,
            sized: false,
            tells_end: true,
        }
    }
}

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.slow && !self.ready {
            self.ready = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.ready = false;
        Poll::Ready(
            self.frames
                .pop_front()
                .map(|f| Ok(Frame::data(Bytes::from_static(f.as_bytes())))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.tells_end && self.frames.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        if self.sized {
            SizeHint::with_exact(self.frames.iter().map(|f| f.len() as u64).sum())
        } else {
            SizeHint::default()
        }
    }
}

/// A request with the probe key `k`.
fn request() -> Request<()> {
    Request::builder().header("key", "k").body(()).unwrap()
}

/// A body of `frames`, one poll apart.
fn slow(frames: &'static [&'static str]) -> impl Fn() -> Frames + Clone + Send + Sync + 'static {
    move || Frames {
        slow: true,
        ..Frames::new(frames)
    }
}

/// Sends one request through `probe`'s layer to a service that answers with `body()`.
async fn send(
    probe: &Probe,
    body: impl Fn() -> Frames + Clone + Send + Sync + 'static,
) -> Response<super::ResponseBody<Frames, Probe>> {
    let svc = probe.layer().layer(service_fn(move |_req: Request<()>| {
        let body = body();
        async move { Ok::<_, Infallible>(Response::new(body)) }
    }));
    svc.oneshot(request()).await.unwrap()
}

/// The next frame of `body`, which must be data.
async fn next_data(body: &mut super::ResponseBody<Frames, Probe>) -> Bytes {
    body.frame().await.unwrap().unwrap().into_data().unwrap()
}

#[tokio::test]
async fn a_held_body_is_released_before_its_last_frame_is_handed_on() {
    let probe = Probe::holding();
    let mut response = send(&probe, slow(&["a", "b", "c"])).await;
    assert_eq!(probe.events(), ["decide p::k", "admit", "response"]);
    let body = response.body_mut();
    for (frame, released) in [("a", false), ("b", false), ("c", true)] {
        assert_eq!(next_data(body).await, frame);
        assert_eq!(
            probe.events().last().map(String::as_str) == Some("release Complete"),
            released,
            "after frame {frame}: {:?}",
            probe.events()
        );
    }
    assert!(body.frame().await.is_none());
    assert!(body.is_end_stream());
    assert_eq!(
        probe
            .events()
            .iter()
            .filter(|e| e.starts_with("release"))
            .count(),
        1
    );
}

#[tokio::test]
async fn a_body_of_known_size_is_released_with_its_last_byte() {
    // The body never says it has ended; its size says so.
    let probe = Probe::holding();
    let mut response = send(&probe, || Frames {
        slow: true,
        sized: true,
        tells_end: false,
        ..Frames::new(&["ab", "cd"])
    })
    .await;
    let body = response.body_mut();
    assert_eq!(body.size_hint().exact(), Some(4));
    assert_eq!(next_data(body).await, "ab");
    assert!(!probe.events().contains(&"release Complete".to_owned()));
    assert_eq!(next_data(body).await, "cd");
    assert!(probe.events().contains(&"release Complete".to_owned()));
}

#[tokio::test]
async fn a_body_ready_at_once_is_released_before_the_head_is_handed_on() {
    let probe = Probe::holding();
    let response = send(&probe, || Frames::new(&["all"])).await;
    assert_eq!(
        probe.events(),
        [
            "decide p::k",
            "admit",
            "response",
            "data all",
            "release Complete"
        ]
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "all");
}

#[tokio::test]
async fn released_at_the_head_when_the_policy_says_so() {
    let probe = Probe::default();
    let response = send(&probe, slow(&["a", "b"])).await;
    assert_eq!(
        probe.events(),
        ["decide p::k", "admit", "response", "release Complete"]
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "ab");
    assert_eq!(probe.events().len(), 4, "no data seen once released");
}

#[tokio::test]
async fn a_permit_lost_mid_body_ends_the_body_with_an_error() {
    let probe = Probe::holding();
    let mut response = send(&probe, slow(&["a", "b", "c"])).await;
    let body = response.body_mut();
    assert_eq!(next_data(body).await, "a");
    probe.lost.store(true, Ordering::SeqCst);
    let cut = body.frame().await.unwrap();
    assert_eq!(cut.unwrap_err().to_string(), "lost");
    assert!(body.frame().await.is_none(), "nothing after the error");
    assert!(probe.events().contains(&"lost error".to_owned()));
    assert!(!probe.events().iter().any(|e| e == "data b"));
}

#[tokio::test]
async fn a_permit_lost_before_the_response_answers_instead() {
    let probe = Probe::holding();
    let lost = probe.lost.clone();
    let svc = probe.layer().layer(service_fn(move |_req: Request<()>| {
        let lost = lost.clone();
        async move {
            // The inner future waits once; the loss is seen before it is polled again.
            lost.store(true, Ordering::SeqCst);
            tokio::task::yield_now().await;
            panic!("polled after the loss");
            #[allow(unreachable_code)]
            Ok::<_, Infallible>(Response::new(Frames::new(&[])))
        }
    }));
    let response = svc.oneshot(request()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(probe.events().contains(&"lost response".to_owned()));
}

/// A service that is ready only once: its clones have not been driven to readiness.
struct ReadyOnce(bool);

impl Clone for ReadyOnce {
    fn clone(&self) -> Self {
        ReadyOnce(false)
    }
}

impl Service<Request<()>> for ReadyOnce {
    type Response = Response<Frames>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0 = true;
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        assert!(self.0, "called without poll_ready");
        self.0 = false;
        std::future::ready(Ok(Response::new(Frames::new(&["ok"]))))
    }
}

#[tokio::test]
async fn the_readied_service_is_the_one_called_whether_the_decision_waits_or_not() {
    for remote in [false, true] {
        let probe = Probe {
            remote,
            ..Probe::default()
        };
        let svc = probe.layer().layer(ReadyOnce(false));
        let response = svc.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "remote: {remote}");
        assert_eq!(probe.events()[..2], ["decide p::k", "admit"]);
    }
}

#[tokio::test]
async fn without_a_key_it_answers_400_or_runs_unguarded_when_optional() {
    let probe = Probe::default();
    let call = |layer: KeyedLayer<_, Probe>| async move {
        let svc = layer.layer(ReadyOnce(false));
        svc.oneshot(Request::new(())).await.unwrap().status()
    };
    assert_eq!(call(probe.layer()).await, StatusCode::BAD_REQUEST);
    assert_eq!(call(probe.layer().optional(true)).await, StatusCode::OK);
    assert!(
        probe.events().is_empty(),
        "the policy was asked: {:?}",
        probe.events()
    );
}

#[tokio::test]
async fn accessors_reach_the_inner_service() {
    let probe = Probe::default();
    let mut svc = super::Keyed::new(ReadyOnce(true), probe.layer());
    assert!(svc.get_ref().0);
    svc.get_mut().0 = false;
    assert!(!svc.into_inner().0);
}

#[tokio::test]
async fn several_keys_are_decided_together_and_one_when_they_are_equal() {
    type KeysFn = fn(&Parts) -> Option<Vec<String>>;
    fn keys(parts: &Parts) -> Option<Vec<String>> {
        let keys = parts.headers.get("keys")?.to_str().ok()?;
        Some(keys.split(',').map(str::to_owned).collect())
    }
    let probe = Probe::default();
    let layer = KeyedLayer::from_parts(
        crate::key::FnKeys::new(keys as KeysFn),
        probe.clone(),
        Cow::Borrowed("no probe keys"),
    );
    let svc = layer.layer(service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Frames::new(&["ok"])))
    }));
    let with_keys = |keys: &str| Request::builder().header("keys", keys).body(()).unwrap();
    let several = svc.clone().oneshot(with_keys("b,a")).await.unwrap();
    assert_eq!(several.status(), StatusCode::OK);
    assert_eq!(probe.events()[0], "decide all p::a p::b");
    // Duplicates count once: one key, decided as any other.
    let one = svc.clone().oneshot(with_keys("a,a")).await.unwrap();
    assert_eq!(one.status(), StatusCode::OK);
    assert!(probe.events().contains(&"decide p::a".to_owned()));
    let empty = svc.oneshot(with_keys("a,")).await.unwrap();
    assert_eq!(empty.status(), StatusCode::BAD_REQUEST);
}

/// A verdict moves by value from the backend to the response future: the answers are
/// boxed, so that an admission moves no more than its permit and a tag.
#[cfg(feature = "lock")]
#[test]
fn a_verdict_moves_at_about_the_size_of_its_permit() {
    use crate::lock::policy::LockPermit;
    use std::mem::size_of;
    let word = size_of::<usize>();
    assert!(size_of::<super::policy::Verdict<LockPermit>>() <= size_of::<LockPermit>() + word);
    assert!(
        size_of::<Option<super::policy::Decision<LockPermit>>>() <= size_of::<LockPermit>() + word
    );
    // The watchdog inside the permit makes its schedule only once the work waits.
    assert!(size_of::<crate::lock::watchdog::Watchdog>() <= 2 * word);
}
