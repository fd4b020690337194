use std::borrow::Cow;
use std::time::Duration;

#[cfg(doc)]
use http::HeaderName;
use http::StatusCode;

use super::policy::LockPolicy;
use crate::backend::contract::LockMode;
use crate::key::{FnKey, FnKeys, HeaderKey, IntoHeaderName, KeyExtractor};
use crate::lock::handle::Locks;
#[cfg(doc)]
use crate::lock::request::LockRequest;
use crate::lock::request::Wait;
use crate::lock::watchdog::{OnLockLoss, Renewal};
use tower_layer::Layer;

use super::body::ReadRequestBody;
use crate::keyed::{Keyed, KeyedLayer};

crate::keyed::keyed_middleware! {
    /// A [`Layer`](tower_layer::Layer) that locks each request on a key taken from it; see
    /// the [module docs](crate::lock).
    ///
    /// Cloning the layer shares its backend, its key extractor and its settings.
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use tower_redlock::LockLayer;
    ///
    /// let app: Router = Router::new()
    ///     .route("/orders", post(|| async { "created" }))
    ///     .layer(LockLayer::by_header("Idempotency-Key"));
    /// ```
    pub struct LockLayer<K> = LockPolicy;

    /// The service of [`LockLayer`]: reads the request body (unless streamed), locks the
    /// request, and calls the inner service `S` under the lease.
    pub struct Lock<S, K> = ReadRequestBody<Keyed<S, K, LockPolicy>>, via [.inner.inner];
}

crate::keyed::keyed_middleware! {
    /// A [`Layer`](tower_layer::Layer) that locks each request on several keys at once, with
    /// one lease: built by [`LockLayer::by_fn_all`]. It has [`LockLayer`]'s settings but
    /// [`max_wait`](LockLayer::max_wait) and [`mode`](LockLayer::mode): a set is held in
    /// [`LockMode::Plain`] and answered at once.
    pub struct LockAllLayer<K> = LockPolicy;

    /// The service of [`LockAllLayer`], as [`Lock`] is [`LockLayer`]'s.
    pub struct LockAll<S, K> = ReadRequestBody<Keyed<S, K, LockPolicy>>, via [.inner.inner];
}

/// `Layer` for a lock layer: its service reads the body first (by default), then locks.
macro_rules! lock_layer {
    ($layer:ident, $service:ident) => {
        impl<S, K> Layer<S> for $layer<K> {
            type Service = $service<S, K>;

            fn layer(&self, inner: S) -> Self::Service {
                $service {
                    inner: ReadRequestBody {
                        inner: Keyed::new(inner, self.keyed.clone()),
                        rule: self.keyed.core.policy.body,
                        on_rejection: self.keyed.core.on_rejection.clone(),
                    },
                }
            }
        }
    };
}
lock_layer!(LockLayer, Lock);
lock_layer!(LockAllLayer, LockAll);

impl<S, K: KeyExtractor> Lock<S, K> {
    /// A [`LockLayer`] over `extractor`; the same as [`LockLayer::new`].
    pub fn layer(extractor: K) -> LockLayer<K> {
        LockLayer::new(extractor)
    }
}

impl LockLayer<HeaderKey> {
    /// Locks on a header's value, such as `Idempotency-Key` (IETF draft "The
    /// Idempotency-Key HTTP Header Field"): a second request with the same key while the
    /// first is in flight gets **409 Conflict**; a request without the header gets **400**
    /// (see [`optional`](Self::optional)). The value may be a bare token or an RFC 8941
    /// quoted string.
    ///
    /// `name` is a [`HeaderName`] or a string ([`IntoHeaderName`]); header names are
    /// case-insensitive.
    ///
    /// This stops *concurrent* duplicates; a retry after the first request completed runs
    /// again: [`IdempotencyLayer`](crate::IdempotencyLayer) replays the first response.
    ///
    /// # Panics
    ///
    /// When `name` is a string that is not a header name, such as `"Idempotency Key"`: a
    /// mistake in the code, found as the app is built.
    pub fn by_header(name: impl IntoHeaderName) -> Self {
        Self::from_keyed(KeyedLayer::from_header(
            name,
            LockPolicy::new(StatusCode::CONFLICT),
        ))
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl LockLayer<crate::key::PathParamKey> {
    /// Locks on an axum path parameter, such as `item_id` in `/items/{item_id}/buy`: a
    /// second request for the same resource while the first holds it gets **423 Locked**
    /// (RFC 4918, section 11.3). The scope is the route up to the parameter, so
    /// `/items/{item_id}` and `/users/{user_id}` never share a lock. Where to add it, and
    /// the 500 when misplaced: [`PathParamKey`](crate::key::PathParamKey).
    ///
    /// # Panics
    ///
    /// When `name` is empty.
    pub fn by_path_param(name: impl Into<Cow<'static, str>>) -> Self {
        Self::from_keyed(KeyedLayer::from_path_param(
            name,
            LockPolicy::new(StatusCode::LOCKED),
            "The request has no path parameter to lock on.",
        ))
    }
}

impl<F> LockLayer<FnKey<F>>
where
    F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
{
    /// Locks on what `f` returns for the request head; `None` means the request has no key
    /// (400 unless [`optional`](Self::optional)). Contention is **423 Locked**.
    ///
    /// ```
    /// use tower_redlock::LockLayer;
    ///
    /// // One report per tenant at a time.
    /// let layer = LockLayer::by_fn(|parts| {
    ///     parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)
    /// })
    /// .scope("report");
    /// ```
    pub fn by_fn(f: F) -> Self {
        Self::new(FnKey::new(f))
    }
}

impl<F> LockLayer<FnKeys<F>>
where
    F: Fn(&http::request::Parts) -> Option<Vec<String>> + Send + Sync + 'static,
{
    /// A [`LockAllLayer`] on every key that `f` returns for the request head: all of
    /// them or none, with one lease, one quorum verdict for the set, released together when the response
    /// is done (see [`LockRequest::all`](crate::LockRequest::all)). The order does not matter (the keys are
    /// sorted, duplicates dropped), so two requests that name the same keys in opposite
    /// orders never deadlock. `None` or an empty list means the request has no key (400
    /// unless [`optional`](Self::optional)); a key value is checked as any other (400), and
    /// more than [`MAX_KEYS_PER_LEASE`](crate::key::MAX_KEYS_PER_LEASE) distinct ones are
    /// refused (400). Contention is **423 Locked**, with `Retry-After` from the holder
    /// that frees last, at once. Every key shares the layer's scope.
    ///
    /// Keys in the request body need the body: lock them in the handler with
    /// [`Locked<Json<T>>`](crate::Locked) and [`LockKeys`](crate::LockKeys), or
    /// [`LockRequest::all`](crate::LockRequest::all).
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use tower_redlock::LockLayer;
    ///
    /// // POST /transfers with `From-Account` and `To-Account` headers holds both accounts.
    /// let layer = LockLayer::by_fn_all(|parts| {
    ///     let account = |name| Some(parts.headers.get(name)?.to_str().ok()?.to_owned());
    ///     Some(vec![account("from-account")?, account("to-account")?])
    /// })
    /// .scope("account");
    /// let app: Router = Router::new().route("/transfers", post(|| async { "moved" }).layer(layer));
    /// ```
    pub fn by_fn_all(f: F) -> LockAllLayer<FnKeys<F>> {
        LockAllLayer::from_keyed(KeyedLayer::from_parts(
            FnKeys::new(f),
            LockPolicy::new(StatusCode::LOCKED),
            Cow::Borrowed("The request carries no lock key."),
        ))
    }
}

impl<K: KeyExtractor> LockLayer<K> {
    /// Locks on the key that `extractor` finds. Defaults: the app's default backend
    /// ([`Locks::default`]), 423 on contention, key required, fail closed, lease held until
    /// the response body has ended. An extractor of several keys
    /// ([`FnKeys`]) takes a [`LockAllLayer`] ([`by_fn_all`](Self::by_fn_all)): here it
    /// does not compile.
    pub fn new(extractor: K) -> Self {
        const {
            assert!(
                !K::SEVERAL,
                "LockLayer::new: an extractor of several keys takes a LockAllLayer (LockLayer::by_fn_all)"
            )
        };
        Self::from_keyed(KeyedLayer::from_parts(
            extractor,
            LockPolicy::new(StatusCode::LOCKED),
            Cow::Borrowed("The request carries no lock key."),
        ))
    }
}

/// The settings of both lock layers.
macro_rules! lock_settings {
    () => {
        crate::keyed::layer_setters! {
            /// The lock backend: a [`Redlock`](crate::Redlock),
            /// [`MemoryLocks`](crate::MemoryLocks) or [`Locks`]. Default: the app's default
            /// backend ([`Locks::set_default`]'s, else the in-process fallback). With more than
            /// one replica, set a `Redlock` as the default once or give it here: in a process
            /// that built a `Redlock`, the fallback refuses every request with a 500 rather
            /// than let each replica lock on its own (see [`Locks::default`]).
            fn backend(locks: impl Into<Locks>) => locks;

            /// The status sent when the lock is held by another request. Default 409 Conflict
            /// for `by_header` (a request with that key is in flight), 423 Locked otherwise.
            fn taken_status(status: StatusCode) => taken_status;

            /// How the lease is renewed while the request runs (its inner future and its
            /// response body). Default: every TTL/3, for at most 10 × TTL in all
            /// ([`Renewal::default`]); [`Renewal::disabled`] lets the lease run out after one
            /// TTL.
            fn renewal(renewal: Renewal) => renewal;

            /// What happens when the lease is lost while the request runs. Default
            /// [`OnLockLoss::Abort`]: the inner future is dropped, never polled past the
            /// lease's validity, and the client gets 503; once the response head is out, the
            /// body ends with an error instead (the client sees a cut response).
            fn on_lock_loss(on_loss: OnLockLoss) => on_loss;

            /// Whether the lease is released once the response head is ready instead of when
            /// the response body has ended. Default `false`: the lease covers the whole
            /// response, so a streamed body is produced under the lock, and it is released as
            /// the last frame is handed on, before the client can see the end of the response.
            /// Set `true` for long streams that must not hold a lock: the body then runs
            /// unlocked.
            fn release_at_head(release_at_head: bool) => release_at_head;
        }

        /// The largest request body read before the lock is taken, in bytes; a longer one is
        /// answered 413 Content Too Large (RFC 9110, section 15.5.14) without taking the lock.
        /// Default 1 MiB ([`DEFAULT_MAX_REQUEST_BODY`](super::DEFAULT_MAX_REQUEST_BODY)).
        /// The inner service gets the same bytes as a [`RequestBody`](super::RequestBody).
        pub fn max_request_body(mut self, bytes: usize) -> Self {
            self.policy_mut().body.max = bytes;
            self
        }

        /// How long a request body has to arrive whole before the lock is taken; a slower
        /// one is answered 408 Request Timeout (RFC 9110, section 15.5.9) without ever taking
        /// the lock. Default 10 s
        /// ([`DEFAULT_REQUEST_BODY_TIMEOUT`](super::DEFAULT_REQUEST_BODY_TIMEOUT)). The time
        /// counts from the request's arrival at this layer.
        pub fn request_body_timeout(mut self, timeout: Duration) -> Self {
            self.policy_mut().body.timeout = timeout;
            self
        }

        /// Whether the request body is streamed to the inner service under the lock instead
        /// of read first. Default `false`: the body is read whole (within
        /// [`max_request_body`](Self::max_request_body) and
        /// [`request_body_timeout`](Self::request_body_timeout)) before the lock is taken, so
        /// a client that sends its body slowly holds no lock while it does. Set `true` for
        /// uploads larger than the bound and for client-streaming gRPC calls (whose body does
        /// not end before the call answers): the lock is then held while the client sends, so
        /// bound the body's time with the server's own limits.
        pub fn stream_request_body(mut self, stream: bool) -> Self {
            self.policy_mut().body.read_first = !stream;
            self
        }

        /// Sends the lease's fencing token to the inner service in this request header (for
        /// example `Fencing-Token`), so that it can pass the token on to storage that rejects
        /// stale writers. Default: not sent (the token is always in the lease, read with the
        /// `Lease` extractor, when the backend issues one: see
        /// [`RedlockBuilder::fencing_tokens`](crate::RedlockBuilder::fencing_tokens)). A
        /// client's own value of this header never reaches the inner service.
        ///
        /// # Panics
        ///
        /// When `name` is a string that is not a header name ([`IntoHeaderName`]).
        pub fn fencing_header(mut self, name: impl IntoHeaderName) -> Self {
            let name = name.into_header_name("LockLayer::fencing_header");
            self.policy_mut().fencing_header = Some(name);
            self
        }
    };
}

impl<K> LockAllLayer<K> {
    lock_settings!();
}

impl<K> LockLayer<K> {
    lock_settings!();

    /// Waits up to `max_wait` for a held lock before answering 409/423: the request is
    /// woken when the holder releases (see [`LockRequest::wait`]), then tries again.
    /// Default zero: answer at once. The wait counts against the client's own timeout,
    /// so keep it short. An acquisition attempt in flight at the deadline runs to its
    /// end, so the answer can come up to one node timeout after `max_wait`.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.policy_mut().options.wait = Wait::up_to(max_wait);
        self
    }

    /// How the request holds its key; default [`LockMode::Plain`]. Readers
    /// ([`LockMode::Shared`]) hold a key together; every writer of a key that has readers
    /// must be [`LockMode::Exclusive`]; [`LockMode::Fair`] waiters acquire in arrival
    /// order. Contention is answered as usual (423/409 with `Retry-After`); the
    /// [module docs](crate::lock#modes) link the guarantees and costs.
    ///
    /// A layer on several keys ([`LockAllLayer`]) holds them in [`LockMode::Plain`] and has
    /// no mode to set: calling this on it does not compile.
    ///
    /// ```compile_fail
    /// use tower_redlock::{LockLayer, LockMode};
    ///
    /// let layer = LockLayer::by_fn_all(|_| Some(vec!["a".to_owned(), "b".to_owned()]))
    ///     .mode(LockMode::Shared);
    /// ```
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.policy_mut().options.mode = mode;
        self
    }
}
