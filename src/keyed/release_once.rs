//! Exactly one release on every path through the core: a counting policy whose permit
//! counts its releases (`release`, or a drop while still held, as a lease's permit
//! releases in the background), driven by hand through every shape of decision, inner
//! future and body, with the permit lost before any poll and the response future or body
//! dropped before any poll.
//!
//! After every run, once everything is dropped: one release when a permit was made, none
//! otherwise; a run that reached the end of its response released before the end was
//! handed on (the inner service's error, the body's end or error, or its last frame, as
//! the body or its length says); and with a permit that aborts on loss, neither the inner
//! future nor the body was polled once the loss was known.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode, response};
use http_body::{Body, Frame, SizeHint};
use tower::{Layer, Service, service_fn};

use super::KeyedLayer;
use super::policy::{
    BoxError, Decision, End, Hold, Permit, Policy, Release, Releasing, Sealed, Verdict,
};
use crate::future::Watch;
use crate::key::FnKey;

/// One request's shape: how it is decided, how the inner service and its body answer.
#[derive(Clone, Copy, Debug)]
struct RequestCase {
    /// Decided through a future that waits once, as a remote backend does.
    remote: bool,
    /// Admitted with a permit (else refused).
    admit: bool,
    /// The permit's release waits once.
    release_waits: bool,
    /// The permit stops the work when lost (a lock's default), else lets it run on.
    abort: bool,
    /// The permit is released with the response head (else when the body ends).
    at_head: bool,
    /// A gRPC request (a lost permit ends its body with trailers, not an error).
    grpc: bool,
    /// The inner future waits once before answering.
    inner_waits: bool,
    /// The inner service fails (no body).
    inner_fails: bool,
    body: BodyPlan,
}

/// The inner body: `frames` data frames, each after a `Pending` when `slow`; it says
/// when it has ended (`tells_end`) or its exact size (`sized`), and ends with an error
/// after its frames when `fails`.
#[derive(Clone, Copy, Debug)]
struct BodyPlan {
    frames: usize,
    slow: bool,
    tells_end: bool,
    sized: bool,
    fails: bool,
}

/// What happened, shared by the policy, its permits, the inner service and its body.
#[derive(Default)]
struct ReleaseCounts {
    permits: AtomicUsize,
    released: AtomicUsize,
    dropped_held: AtomicUsize,
    /// A permit is held now (made, neither released nor dropped).
    holding: AtomicBool,
    lost: AtomicBool,
    /// Polls of the inner future or body while a lost permit was held.
    polled_after_loss: AtomicUsize,
}

impl ReleaseCounts {
    /// Releases so far: by `release`, or by dropping a permit still held.
    fn releases(&self) -> usize {
        self.released.load(SeqCst) + self.dropped_held.load(SeqCst)
    }

    /// Called by the inner future and body on each poll.
    fn polled(&self) {
        if self.lost.load(SeqCst) && self.holding.load(SeqCst) {
            self.polled_after_loss.fetch_add(1, SeqCst);
        }
    }
}

#[derive(Clone)]
struct Counting {
    case: RequestCase,
    counts: Arc<ReleaseCounts>,
}

impl Sealed for Counting {}

impl<S, K> Layer<S> for KeyedLayer<K, Counting> {
    type Service = super::Keyed<S, K, Counting>;

    fn layer(&self, inner: S) -> Self::Service {
        super::Keyed::new(inner, self.clone())
    }
}

impl Counting {
    fn verdict(&self) -> Verdict<CountingPermit> {
        if !self.case.admit {
            let mut refusal = Response::new(Bytes::from_static(b"taken"));
            *refusal.status_mut() = StatusCode::LOCKED;
            return Verdict::Answer(Box::new(refusal));
        }
        self.counts.permits.fetch_add(1, SeqCst);
        self.counts.holding.store(true, SeqCst);
        Verdict::Admit(CountingPermit {
            case: self.case,
            counts: self.counts.clone(),
            held: true,
        })
    }
}

impl Policy for Counting {
    type Permit = CountingPermit;
    const REJECTED_BY: crate::rejection::RejectedBy = crate::rejection::RejectedBy::Lock;
    const FAIL_OPEN: bool = false;

    fn decide(&self, _key: &str, _parts: &Parts) -> Decision<CountingPermit> {
        if !self.case.remote {
            return Decision::Ready(self.verdict());
        }
        let policy = self.clone();
        let mut waited = false;
        Decision::Pending(Box::pin(std::future::poll_fn(move |_| {
            if std::mem::replace(&mut waited, true) {
                Poll::Ready(policy.verdict())
            } else {
                Poll::Pending
            }
        })))
    }
}

/// A permit that counts its release; dropped while held, it counts one (a lease's permit
/// releases in the background then).
struct CountingPermit {
    case: RequestCase,
    counts: Arc<ReleaseCounts>,
    held: bool,
}

impl Drop for CountingPermit {
    fn drop(&mut self) {
        if self.held {
            self.counts.dropped_held.fetch_add(1, SeqCst);
            self.counts.holding.store(false, SeqCst);
        }
    }
}

impl Watch for CountingPermit {
    fn lost_before_poll(&mut self, _: &mut Context<'_>) -> bool {
        self.counts.lost.load(SeqCst)
    }

    fn poll_lost(&mut self, _: &mut Context<'_>) -> Poll<()> {
        if self.counts.lost.load(SeqCst) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl Permit for CountingPermit {
    fn admit<B>(&mut self, _request: &mut Request<B>) {}

    fn abort_on_loss(&self) -> bool {
        self.case.abort
    }

    fn lost_response(self) -> Response<Bytes> {
        let mut response = Response::new(Bytes::new());
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        response
    }

    fn lost_error(self) -> BoxError {
        "lost".into()
    }

    fn on_response(&mut self, _head: &mut response::Parts) -> Hold {
        if self.case.at_head {
            Hold::Head
        } else {
            Hold::BodyEnd
        }
    }

    fn release(mut self, _end: End) -> Release {
        self.held = false;
        self.counts.released.fetch_add(1, SeqCst);
        self.counts.holding.store(false, SeqCst);
        if !self.case.release_waits {
            return Release::Done;
        }
        let mut waited = false;
        Release::Pending(Releasing::plain(Box::pin(std::future::poll_fn(
            move |_| {
                if std::mem::replace(&mut waited, true) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            },
        ))))
    }
}

/// The inner body of [`BodyPlan`].
struct PlannedBody {
    plan: BodyPlan,
    sent: usize,
    ready: bool,
    counts: Arc<ReleaseCounts>,
}

impl Body for PlannedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.counts.polled();
        if self.plan.slow && !std::mem::replace(&mut self.ready, true) {
            return Poll::Pending;
        }
        self.ready = false;
        if self.sent < self.plan.frames {
            self.sent += 1;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"ab")))));
        }
        if self.plan.fails && self.sent == self.plan.frames {
            self.sent += 1;
            return Poll::Ready(Some(Err("the body failed".into())));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.plan.tells_end && !self.plan.fails && self.sent >= self.plan.frames
    }

    fn size_hint(&self) -> SizeHint {
        match self.plan.sized && !self.plan.fails {
            true => SizeHint::with_exact(
                2 * (self.plan.frames - self.sent.min(self.plan.frames)) as u64,
            ),
            false => SizeHint::default(),
        }
    }
}

/// The inner service: waits once when told, then fails or answers with the body.
fn inner(
    case: RequestCase,
    counts: &Arc<ReleaseCounts>,
) -> impl Service<
    Request<()>,
    Response = Response<PlannedBody>,
    Error = String,
    Future = impl Future<Output = Result<Response<PlannedBody>, String>> + Send,
> + Clone {
    let counts = counts.clone();
    service_fn(move |_req: Request<()>| {
        let counts = counts.clone();
        let mut waited = !case.inner_waits;
        std::future::poll_fn(move |_| {
            counts.polled();
            if !std::mem::replace(&mut waited, true) {
                return Poll::Pending;
            }
            if case.inner_fails {
                return Poll::Ready(Err("the service failed".to_owned()));
            }
            Poll::Ready(Ok(Response::new(PlannedBody {
                plan: case.body,
                sent: 0,
                ready: false,
                counts: counts.clone(),
            })))
        })
    })
}

/// How many polls a run may take before it is taken for stuck.
const MAX_POLLS: usize = 40;

/// One request of `case`, polled by hand: its response future until ready, then its body
/// until it ends (or fails); the permit lost before poll `lose_before`, everything dropped
/// before poll `cut_before`. Checks the releases; returns how many polls it made.
fn run(case: RequestCase, lose_before: Option<usize>, cut_before: Option<usize>) -> usize {
    let counts = Arc::new(ReleaseCounts::default());
    let policy = Counting {
        case,
        counts: counts.clone(),
    };
    let key: fn(&Parts) -> Option<String> = |_| Some("k".to_owned());
    let layer = KeyedLayer::from_parts(FnKey::new(key), policy, Cow::Borrowed("no key"));
    let mut service = layer.layer(inner(case, &counts));
    let mut cx = Context::from_waker(Waker::noop());
    assert!(service.poll_ready(&mut cx).is_ready());
    let mut request = Request::builder();
    if case.grpc {
        request = request.header("content-type", "application/grpc");
    }
    let mut future = Box::pin(service.call(request.body(()).unwrap()));
    let mut polls = 0;
    // Before each poll: the loss, and whether to go on (false: drop everything now).
    let next = |polls: &mut usize| {
        if lose_before == Some(*polls) {
            counts.lost.store(true, SeqCst);
        }
        let go_on = cut_before != Some(*polls);
        *polls += 1;
        assert!(*polls < MAX_POLLS, "{case:?}: stuck");
        go_on
    };
    // The end was handed on (an error, or the body's end): the permit is released by then.
    let handed_on_end = || {
        assert_eq!(
            counts.releases(),
            counts.permits.load(SeqCst),
            "{case:?}, lost before poll {lose_before:?}: released before the end was handed on"
        );
    };
    let mut output = None;
    while next(&mut polls) {
        if let Poll::Ready(ready) = future.as_mut().poll(&mut cx) {
            output = Some(ready);
            break;
        }
    }
    drop(future);
    match output {
        Some(Err(_)) => handed_on_end(),
        Some(Ok(response)) => {
            let mut body = Box::pin(response.into_body());
            // With its size known, the head says how long the body is (`Content-Length`):
            // the client has it all once that many bytes are handed on.
            let mut size = body.size_hint().exact();
            while next(&mut polls) {
                match body.as_mut().poll_frame(&mut cx) {
                    Poll::Pending => {}
                    Poll::Ready(Some(Ok(frame))) => {
                        let len = frame.data_ref().map_or(0, |data| data.len() as u64);
                        size = size.map(|size| size.saturating_sub(len));
                        // The last frame, as the body or its size says: the client may
                        // read no further.
                        if body.is_end_stream() || size == Some(0) {
                            handed_on_end();
                            break;
                        }
                    }
                    // The end, or an error: the client reads no further.
                    Poll::Ready(None | Some(Err(_))) => {
                        handed_on_end();
                        break;
                    }
                }
            }
        }
        None => {}
    }
    drop(service);
    let what =
        format!("{case:?}, lost before poll {lose_before:?}, dropped before poll {cut_before:?}");
    let permits = counts.permits.load(SeqCst);
    assert!(permits <= 1, "{what}: {permits} permits");
    assert_eq!(
        counts.releases(),
        permits,
        "{what}: one release per permit, once dropped"
    );
    if case.abort {
        let polled = counts.polled_after_loss.load(SeqCst);
        assert_eq!(polled, 0, "{what}: polled after the loss");
    }
    polls
}

/// Every case: every admitted shape (decided at once or later, a release that waits or
/// not, aborting on loss or not, released at the head or at the body's end, HTTP or gRPC,
/// an inner future that waits or not, and every body of 0 to 2 frames, slow or not, that
/// tells its end, its size, or neither, and ends or fails; or an inner service that
/// fails), and refusals.
fn cases() -> Vec<RequestCase> {
    let flags = [false, true];
    let mut bodies = Vec::new();
    for frames in 0..=2 {
        for slow in flags {
            for tells_end in flags {
                for sized in flags {
                    for fails in flags {
                        bodies.push(BodyPlan {
                            frames,
                            slow,
                            tells_end,
                            sized,
                            fails,
                        });
                    }
                }
            }
        }
    }
    let mut cases = Vec::new();
    for bits in 0..64u32 {
        let flag = |i: u32| bits & (1 << i) != 0;
        let case = RequestCase {
            remote: flag(0),
            admit: true,
            release_waits: flag(1),
            abort: flag(2),
            at_head: flag(3),
            grpc: flag(4),
            inner_waits: flag(5),
            inner_fails: false,
            body: bodies[0],
        };
        cases.extend(bodies.iter().map(|&body| RequestCase { body, ..case }));
        cases.push(RequestCase {
            inner_fails: true,
            ..case
        });
        if !case.release_waits && !case.abort && !case.at_head && !case.inner_waits {
            cases.push(RequestCase {
                admit: false,
                ..case
            });
        }
    }
    cases
}

#[test]
fn one_release_per_permit_whenever_the_permit_is_lost_and_whenever_the_response_is_dropped() {
    let (mut runs, mut cases_run) = (0u64, 0u64);
    for case in cases() {
        cases_run += 1;
        let polls = run(case, None, None);
        for lose_before in std::iter::once(None).chain((0..polls).map(Some)) {
            let polls = run(case, lose_before, None);
            for cut_before in 0..polls {
                run(case, lose_before, Some(cut_before));
                runs += 1;
            }
            runs += 1;
        }
    }
    eprintln!("{cases_run} cases, {runs} runs");
}
