use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::{HeldBody, ResponseBody};
use super::policy::{
    BoxError, BoxFuture, End, Hold, Permit, Policy, Release, Releasing, Unavailable, Verdict,
};
use crate::future::{Lost, poll_guarded};
use crate::keyed::answers::Rendering;
use crate::keyed::shadow;
use http_body::Body;

pin_project! {
    /// The response future of a keyed middleware: waits for the policy's decision
    /// when the backend is remote, runs the inner service under the permit, and hands the
    /// permit to the [`ResponseBody`] when it is held until the body ends.
    ///
    /// It holds the inner service and the request while the decision is pending, so that
    /// the inner service is called only once the request is admitted; it knows nothing of
    /// the layer's settings.
    pub struct ResponseFuture<S, ReqB, P, ResB>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>>,
        P: Policy,
    {
        #[pin]
        state: Phase<S, ReqB, P, ResB>,
        // How the layer's own answers are rendered for this request.
        answers: Rendering,
    }
}

pin_project! {
    #[project = PhaseProj]
    enum Phase<S, ReqB, P, ResB>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>>,
        P: Policy,
    {
        // Waiting for the backend's answer.
        Deciding {
            decision: BoxFuture<Verdict<P::Permit>>,
            call: Option<(S, Request<ReqB>)>,
            rules: Rules,
        },
        // The inner service runs, under the permit if there is one; `lost` once the permit
        // was lost and the work runs on (when the permit does not abort on loss).
        Running {
            #[pin]
            future: S::Future,
            permit: Option<P::Permit>,
            lost: bool,
        },
        // The body's last frame was ready at the first look, and its release is pending:
        // the head waits for it.
        ReleasingBody {
            head: Option<http::response::Parts>,
            held: Option<HeldBody<ResB, P::Permit>>,
        },
        // The permit is released before the response is handed on.
        Releasing {
            release: Releasing,
            output: Option<Result<Response<ResponseBody<ResB, P>>, S::Error>>,
        },
        // The layer answers itself.
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqB, P, ResB> fmt::Debug for ResponseFuture<S, ReqB, P, ResB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    P: Policy,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, ReqB, P, ResB> ResponseFuture<S, ReqB, P, ResB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    P: Policy,
{
    #[inline]
    pub(crate) fn unguarded(service: &mut S, request: Request<ReqB>) -> Self {
        Self {
            state: run(service, request, None),
            answers: Rendering::Problem,
        }
    }

    #[inline]
    pub(crate) fn decided(
        verdict: Verdict<P::Permit>,
        rules: Rules,
        service: &mut S,
        request: Request<ReqB>,
        answers: Rendering,
    ) -> Self {
        Self {
            state: Phase::from_verdict(verdict, rules, service, request),
            answers,
        }
    }

    #[inline]
    pub(crate) fn deciding(
        decision: BoxFuture<Verdict<P::Permit>>,
        rules: Rules,
        service: S,
        request: Request<ReqB>,
        answers: Rendering,
    ) -> Self {
        Self {
            state: Phase::Deciding {
                decision,
                call: Some((service, request)),
                rules,
            },
            answers,
        }
    }
}

#[inline]
fn run<S, ReqB, P, ResB>(
    service: &mut S,
    request: Request<ReqB>,
    mut permit: Option<P::Permit>,
) -> Phase<S, ReqB, P, ResB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    P: Policy,
{
    let future = match permit.as_mut() {
        // Called as the request's own: a layer inside that takes the same lock gets this
        // lease back (reentrancy).
        Some(permit) => permit.scoped(|_| service.call(request)),
        None => service.call(request),
    };
    Phase::Running {
        future,
        permit,
        lost: false,
    }
}

impl<S, ReqB, P, ResB> Phase<S, ReqB, P, ResB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    P: Policy,
{
    #[inline]
    fn from_verdict(
        verdict: Verdict<P::Permit>,
        rules: Rules,
        service: &mut S,
        mut request: Request<ReqB>,
    ) -> Self {
        let mut permit = match verdict {
            Verdict::Admit(permit) => Some(permit),
            // In shadow mode the inner service runs in its place.
            Verdict::Answer(response) if rules.shadow => {
                shadow::let_through::<P>(Some(&response));
                None
            }
            Verdict::Answer(response) => {
                return Phase::Answered {
                    response: Some(*response),
                };
            }
            Verdict::Unavailable(unavailable) => {
                let Unavailable {
                    error,
                    answer,
                    open,
                } = *unavailable;
                super::outage::outage::<P>(&*error, rules.fail_open || rules.shadow);
                if rules.shadow && !rules.fail_open {
                    shadow::let_through::<P>(None);
                }
                if rules.fail_open || rules.shadow {
                    open
                } else {
                    return Phase::Answered {
                        response: Some(answer),
                    };
                }
            }
        };
        if let Some(permit) = &mut permit {
            if rules.shadow {
                permit.shadowed();
            }
            permit.admit(&mut request);
        }
        run(service, request, permit)
    }
}

impl<S, ReqB, P, ResB> Future for ResponseFuture<S, ReqB, P, ResB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    P: Policy,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB, P>>, S::Error>;

    // Each state's `Option`s are `Some` until the state is left (the permit taken in
    // `Running` was matched `Some` just above): an `expect` fails only on a poll after
    // completion, which `Future` forbids.
    #[allow(clippy::expect_used)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                PhaseProj::Deciding {
                    decision,
                    call,
                    rules,
                } => {
                    let verdict = ready!(decision.as_mut().poll(cx));
                    let (mut service, request) =
                        call.take().expect("Deciding is left once decided");
                    let next = Phase::from_verdict(verdict, *rules, &mut service, request);
                    this.state.set(next);
                }
                PhaseProj::Running {
                    future,
                    permit,
                    lost,
                } => {
                    let output = match permit.as_mut().filter(|_| !*lost) {
                        // Never polled once the permit is lost (a lease past its validity).
                        Some(guard) => match guard
                            .scoped(|guard| poll_guarded(guard, cx, |cx| future.poll(cx)))
                        {
                            Poll::Pending => return Poll::Pending,
                            Poll::Ready(Ok(output)) => output,
                            Poll::Ready(Err(Lost)) => {
                                let held = permit.take().expect("a permit was polled");
                                if held.abort_on_loss() {
                                    // Dropping the inner future here; the permit releases
                                    // whatever is left in the background.
                                    let response = held.lost_response();
                                    this.state.set(Phase::Answered {
                                        response: Some(response),
                                    });
                                } else {
                                    tracing::warn!(
                                        "the permit was lost; the request runs on unprotected"
                                    );
                                    *permit = Some(held);
                                    *lost = true;
                                }
                                continue;
                            }
                        },
                        None => ready!(future.poll(cx)),
                    };
                    let Some(held) = permit.take() else {
                        return Poll::Ready(output.map(|r| r.map(ResponseBody::plain)));
                    };
                    let grpc = matches!(this.answers, Rendering::Grpc);
                    match finish(held, output, *lost, grpc, cx) {
                        Finish::Ready(output) => return Poll::Ready(output),
                        Finish::Lost(response) => this.state.set(Phase::Answered {
                            response: Some(response),
                        }),
                        // Its release was polled and is pending: woken when it is done.
                        Finish::ReleasingBody { head, held } => {
                            this.state.set(Phase::ReleasingBody {
                                head: Some(head),
                                held: Some(held),
                            });
                            return Poll::Pending;
                        }
                        Finish::Releasing { release, output } => this.state.set(Phase::Releasing {
                            release,
                            output: Some(output),
                        }),
                    }
                }
                PhaseProj::ReleasingBody { head, held } => {
                    let body = held.as_mut().expect("ReleasingBody is left once released");
                    match first_look(body, cx) {
                        Look::Ready => {}
                        Look::Lost(response) => {
                            let response = Some(response);
                            this.state.set(Phase::Answered { response });
                            continue;
                        }
                        Look::Releasing => return Poll::Pending,
                    }
                    let (head, held) = (head.take(), held.take());
                    let (head, held) = head.zip(held).expect("polled after completion");
                    let body = ResponseBody::held(held);
                    return Poll::Ready(Ok(Response::from_parts(head, body)));
                }
                PhaseProj::Releasing { release, output } => {
                    ready!(Pin::new(release).poll(cx));
                    return Poll::Ready(output.take().expect("polled after completion"));
                }
                PhaseProj::Answered { response } => {
                    let response = response.take().expect("polled after completion");
                    let mut response = this.answers.render(response);
                    let trailers = response.extensions_mut().remove::<Trailers>();
                    let trailers = trailers.map(|t| Box::new(t.0));
                    return Poll::Ready(Ok(
                        response.map(|data| ResponseBody::answer(data, trailers))
                    ));
                }
            }
        }
    }
}

/// What a layer does with a refusal: `fail_open` runs the inner service when the store
/// cannot decide; `shadow` runs it instead of every refusal (see [`Shadow`](super::Shadow)).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rules {
    pub(crate) fail_open: bool,
    pub(crate) shadow: bool,
}

/// Trailers to send after a layer's own answer (a replayed gRPC response's status), in
/// the answer's extensions until its body is made.
#[derive(Clone, Debug)]
pub(crate) struct Trailers(pub(crate) http::HeaderMap);

/// What the response future's look at a held body found.
enum Look {
    /// Hand on the response (what was taken from the body goes first; a body not ready
    /// keeps the permit until it ends).
    Ready,
    /// The permit was lost before the head was handed on: the layer's answer instead.
    Lost(Response<Bytes>),
    /// The last frame waits for the release: so does the head.
    Releasing,
}

#[inline(always)]
fn first_look<B, H>(held: &mut HeldBody<B, H>, cx: &mut Context<'_>) -> Look
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    H: Permit,
{
    match held.poll_next(cx) {
        Poll::Pending if held.is_releasing() => Look::Releasing,
        Poll::Pending => Look::Ready,
        Poll::Ready(Ok(item)) => {
            held.put_back(item);
            Look::Ready
        }
        Poll::Ready(Err(permit)) => Look::Lost(permit.lost_response()),
    }
}

/// What to do once the inner service has answered under a permit.
enum Finish<B, P: Policy, E> {
    /// Hand on this.
    Ready(Result<Response<ResponseBody<B, P>>, E>),
    /// The permit was lost before the response was handed on: this answer instead.
    Lost(Response<Bytes>),
    /// The body's last frame waits for the release: so does the head.
    ReleasingBody {
        head: http::response::Parts,
        held: HeldBody<B, P::Permit>,
    },
    /// Release first, then hand on the response.
    Releasing {
        release: Releasing,
        output: Result<Response<ResponseBody<B, P>>, E>,
    },
}

/// Lets the permit add its headers, and decides when it is released: at the head, on a
/// failure, or, for a permit held until the body ends, by the body (a [`HeldBody`]), which
/// the response future looks at first. Most bodies are ready at once (a handler's bytes,
/// JSON), and then the permit is released before the response head is handed on, so that
/// a client that has read the head never finds the permit still held; a body that is not
/// ready, or not over after its first frame, keeps the permit until it ends.
fn finish<B, H, E, P>(
    mut held: H,
    output: Result<Response<B>, E>,
    lost: bool,
    grpc: bool,
    cx: &mut Context<'_>,
) -> Finish<B, P, E>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    H: Permit,
    P: Policy<Permit = H>,
{
    let (end, output) = match output {
        Err(e) => (End::Failed, Err(e)),
        Ok(response) => {
            let (mut head, body) = response.into_parts();
            if held.on_response(&mut head) != Hold::Head {
                let mut held = HeldBody::new(body, held, lost, grpc);
                return match first_look(&mut held, cx) {
                    Look::Ready => {
                        let body = ResponseBody::held(held);
                        Finish::Ready(Ok(Response::from_parts(head, body)))
                    }
                    Look::Lost(response) => Finish::Lost(response),
                    Look::Releasing => Finish::ReleasingBody { head, held },
                };
            }
            let body = ResponseBody::plain(body);
            (End::Complete, Ok(Response::from_parts(head, body)))
        }
    };
    match held.release(end) {
        Release::Done => Finish::Ready(output),
        Release::Pending(release) => Finish::Releasing { release, output },
    }
}
