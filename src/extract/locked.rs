use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::{FromRef, FromRequestParts, Path};
use axum::response::{IntoResponse, Response};
use http::request::Parts;

use super::lock_keys::LockKeys;
use crate::error::LockError;
use crate::future::{Lost, Protected, Watch};
use crate::lease::Lease;
use crate::lock::handle::Locks;
use crate::lock::status::LeaseStatus;
use crate::rejection::Rejection;

/// Turns an extracted value into a lock key.
///
/// The key is `{SCOPE}:{lock_key()}`. The scope keeps different kinds of values apart
/// (order 42 and user 42); a [`LockLayer`](crate::LockLayer) with
/// [`.scope(SCOPE)`](crate::LockLayer::scope) locks the same keys.
///
/// `String` and the integer types implement it with the empty scope, so that
/// `Locked<Path<u64>>` works as is; two routes that lock `Path<u64>` then share the locks
/// of equal ids. Give each kind of resource a newtype with a scope of its own to keep them
/// apart.
///
/// When a handler with `Locked<T>` does not compile (axum's error only says the function
/// is not a `Handler`), `T` most likely lacks `LockKey` or `FromRequestParts`, or the
/// state has no `Locks`: put `#[axum::debug_handler]` (axum feature `macros`) on the
/// handler, and the compiler names the missing piece.
///
/// ```
/// use std::borrow::Cow;
/// use tower_redlock::LockKey;
///
/// #[derive(serde::Deserialize)]
/// struct OrderId(String);
///
/// impl LockKey for OrderId {
///     const SCOPE: &'static str = "order";
///     fn lock_key(&self) -> Cow<'_, str> {
///         Cow::Borrowed(&self.0)
///     }
/// }
/// ```
pub trait LockKey {
    /// The scope of every key of this type, such as `"order"`.
    const SCOPE: &'static str;

    /// This value's key. It must be non-empty, at most
    /// [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN) bytes and free of control characters, or
    /// the extractor answers 400.
    fn lock_key(&self) -> Cow<'_, str>;
}

impl<T: LockKey> LockKey for Path<T> {
    const SCOPE: &'static str = T::SCOPE;

    fn lock_key(&self) -> Cow<'_, str> {
        self.0.lock_key()
    }
}

impl LockKey for String {
    const SCOPE: &'static str = "";

    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

macro_rules! integer_lock_keys {
    ($($int:ty),*) => {
        $(
            impl LockKey for $int {
                const SCOPE: &'static str = "";

                fn lock_key(&self) -> Cow<'_, str> {
                    Cow::Owned(self.to_string())
                }
            }
        )*
    };
}

integer_lock_keys!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize
);

/// An extractor that holds a lock on `T`'s key while the handler runs.
///
/// `T` is any extractor that implements [`LockKey`] (`Path<OrderId>`, or your own type),
/// or [`LockKeys`] to hold several keys with one lease, all or none (a transfer's two
/// accounts); a body extractor (`Json<T>`) works too, as the handler's last argument.
/// The backend comes from the state: `Locks: FromRef<S>`. The lease is released when the
/// `Locked` value is dropped (in the background, with the TTL as the backstop), or
/// earlier with [`release`](Locked::release). Read the value through `Deref`.
///
/// While held, the lease is renewed in the background (every TTL/3, for at most
/// 10 × TTL). An extractor cannot stop the handler that holds it, so the lock-loss
/// guarantee covers work run through [`protect`](Locked::protect); check
/// [`status`](Locked::status) before irreversible steps otherwise.
///
/// When a [`LockLayer`](crate::LockLayer) already holds the same key for this request,
/// the extractor reuses that lease (the layer releases it) instead of locking against
/// itself.
///
/// A value taken from the body (`Locked<Json<T>>`) is read whole before the lock is
/// taken. A value taken from the head (`Locked<Path<T>>`) is locked before the extractors
/// after it run, and axum runs the one that reads the body last: a handler that also
/// takes a body would hold its lock while the client sends it. Put a
/// [`ReadRequestBodyLayer`](crate::lock::ReadRequestBodyLayer) on such a route, so that
/// the body has arrived (within 10 s) before the lock is taken.
///
/// The lock is held as long as the `Locked` value lives: in an `async fn` handler, until
/// it returns. A closure handler whose `async` block does not use the value
/// (`|_order: Locked<Path<OrderId>>| async move { .. }`) drops it, and so releases the
/// lock, before the block runs: move it in (`async move { let _order = order; .. }`), or
/// write an `async fn`.
///
/// Rejections ([`LockedRejection`]): `T`'s own rejection; **423 Locked** with
/// `Retry-After` when another request holds the key (RFC 4918); 400 for an invalid key;
/// 503 when the backend has no quorum. Bodies are `application/problem+json` (RFC 9457).
///
/// ```
/// use std::borrow::Cow;
/// use axum::{Router, extract::Path, routing::post};
/// use tower_redlock::{LockKey, Locked, Locks};
///
/// #[derive(serde::Deserialize)]
/// struct OrderId(String);
///
/// impl LockKey for OrderId {
///     const SCOPE: &'static str = "order";
///     fn lock_key(&self) -> Cow<'_, str> {
///         Cow::Borrowed(&self.0)
///     }
/// }
///
/// async fn pay(order: Locked<Path<OrderId>>) -> String {
///     // Runs while holding the lock on "order:{id}".
///     format!("paid {}", order.0.0)
/// }
///
/// let app: Router = Router::new()
///     .route("/orders/{order_id}/pay", post(pay))
///     .with_state(Locks::default());
/// ```
pub struct Locked<T> {
    value: Option<T>,
    status: LeaseStatus,
    /// Set when this extractor took the lease itself and so must release it.
    owner: Option<Owned>,
}

/// A lease this extractor acquired: its backend and the task that renews it.
pub(super) struct Owned {
    pub(super) locks: Locks,
    pub(super) renewer: tokio::task::JoinHandle<()>,
}

impl Owned {
    fn stop(self) -> Locks {
        self.renewer.abort();
        self.locks
    }
}

impl<T> Locked<T> {
    /// `value` locked under `status`; `owner` when this extractor took the lease itself.
    pub(super) fn new(value: T, status: LeaseStatus, owner: Option<Owned>) -> Self {
        Self {
            value: Some(value),
            status,
            owner,
        }
    }

    /// The lease held (key, token, fencing token), as acquired; its validity at
    /// acquisition. [`status`](Self::status) follows the renewals.
    pub fn lease(&self) -> &Lease {
        self.status.lease()
    }

    /// The live status of the lease: the validity as renewals move it, and whether it was
    /// lost.
    pub fn status(&self) -> &LeaseStatus {
        &self.status
    }

    /// Runs `work`, never polling it once the lease is lost: the extractor cannot stop the
    /// handler by itself, but work wrapped here stops at its next `.await` after a loss.
    ///
    /// # Errors
    ///
    /// [`LockError::Lost`] when the lease was lost (or released) before `work` completed.
    pub async fn protect<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        let status = &self.status;
        let lost = std::pin::pin!(status.lost());
        Protected::new(work, StatusWatch { status, lost })
            .await
            .map_err(|Lost| LockError::Lost)
    }

    /// Releases the lock now and hands back the value. A lease reused from a
    /// [`LockLayer`](crate::LockLayer) is left to the layer.
    ///
    /// # Errors
    ///
    /// As [`Locks::unlock`]: [`LockError::Expired`] when it had already run out (the work
    /// done after that was not protected), [`LockError::NoQuorum`] when too few nodes
    /// answered (the keys expire by their TTL). The value is lost with the error only in
    /// the sense that it is dropped; extract it again if needed.
    // `value` is taken only here, which consumes `self`, and in `Drop`.
    #[allow(clippy::expect_used)]
    pub async fn release(mut self) -> Result<T, LockError> {
        let value = self
            .value
            .take()
            .expect("value present until release or drop");
        if let Some(owned) = self.owner.take() {
            owned.stop().unlock(self.status.lease().clone()).await?;
        }
        Ok(value)
    }
}

/// The loss of a lease renewed elsewhere (the extractor's renewer task), seen through its
/// status: lost, or released.
struct StatusWatch<'a, L> {
    status: &'a LeaseStatus,
    lost: Pin<&'a mut L>,
}

impl<L: Future<Output = ()>> Watch for StatusWatch<'_, L> {
    fn lost_before_poll(&mut self, cx: &mut Context<'_>) -> bool {
        self.status.is_lost() || self.lost.as_mut().poll(cx).is_ready()
    }

    fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.status.is_lost() {
            return Poll::Ready(());
        }
        self.lost.as_mut().poll(cx)
    }
}

impl<T> Deref for Locked<T> {
    type Target = T;

    // `value` is taken only by `release`, which consumes `self`, and in `Drop`.
    #[allow(clippy::expect_used)]
    fn deref(&self) -> &T {
        self.value
            .as_ref()
            .expect("value present until release or drop")
    }
}

impl<T> Drop for Locked<T> {
    fn drop(&mut self) {
        if let Some(owned) = self.owner.take() {
            owned.stop().release_detached(self.status.lease());
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for Locked<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locked")
            .field("value", &self.value)
            .field("lease", self.status.lease())
            .field("reused", &self.owner.is_none())
            .finish()
    }
}

impl<T, S> FromRequestParts<S> for Locked<T>
where
    T: FromRequestParts<S> + LockKeys + Send,
    Locks: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = LockedRejection<T::Rejection>;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let value = T::from_request_parts(parts, state)
            .await
            .map_err(LockedRejection::Extract)?;
        let existing = parts.extensions.get::<LeaseStatus>();
        let holder = crate::holder::Holder::of(parts);
        super::lock_keys::lock(value, existing, Locks::from_ref(state), &holder)
            .await
            .map_err(LockedRejection::Lock)
    }
}

/// The rejection of [`Locked<T>`]: `T`'s own, or a lock problem.
#[derive(Debug)]
#[non_exhaustive]
pub enum LockedRejection<R> {
    /// `T` could not be extracted.
    Extract(R),
    /// The lock was not granted: 423, 400 or 503 as a problem+json response, with the
    /// [`Rejection`] in its extensions.
    Lock(Rejection),
}

impl<R: IntoResponse> IntoResponse for LockedRejection<R> {
    fn into_response(self) -> Response {
        match self {
            LockedRejection::Extract(r) => r.into_response(),
            LockedRejection::Lock(p) => p.into_response(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::StatusCode;

    use super::*;
    use crate::MemoryLocks;
    use crate::lock::watchdog::{Renewal, Watchdog};

    /// A job id read from the `job` header.
    #[derive(Debug)]
    struct Job(String);

    impl<S: Send + Sync> FromRequestParts<S> for Job {
        type Rejection = StatusCode;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
            let job = parts.headers.get("job").ok_or(StatusCode::BAD_REQUEST)?;
            Ok(Job(job.to_str().unwrap().to_owned()))
        }
    }

    impl LockKey for Job {
        const SCOPE: &'static str = "job";
        fn lock_key(&self) -> Cow<'_, str> {
            Cow::Borrowed(&self.0)
        }
    }

    fn parts(job: &str) -> Parts {
        http::Request::builder()
            .header("job", job)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    async fn lock(locks: &Locks, job: &str) -> Result<Locked<Job>, LockedRejection<StatusCode>> {
        Locked::<Job>::from_request_parts(&mut parts(job), locks).await
    }

    fn memory(ttl: Duration) -> Locks {
        Locks::from(MemoryLocks::builder().ttl(ttl).build().unwrap())
    }

    #[tokio::test]
    async fn release_frees_the_key_and_hands_back_the_value() {
        let locks = memory(Duration::from_secs(30));
        let held = lock(&locks, "1").await.unwrap();
        assert_eq!(held.lease().key(), "tower-redlock:job:1");
        assert!(matches!(
            lock(&locks, "1").await,
            Err(LockedRejection::Lock(p)) if p.status() == StatusCode::LOCKED
        ));
        let status = held.status().clone();
        let job = held.release().await.unwrap();
        assert_eq!(job.0, "1");
        // The holder is done: its status says so, and the key is free.
        tokio::time::timeout(Duration::from_secs(5), status.lost())
            .await
            .unwrap();
        assert!(!status.is_lost());
        let again = lock(&locks, "1").await.unwrap();
        drop(again);
        // Dropping releases too.
        lock(&locks, "1").await.unwrap();
    }

    #[tokio::test]
    async fn protect_runs_work_while_the_lease_holds() {
        let locks = memory(Duration::from_secs(30));
        let held = lock(&locks, "2").await.unwrap();
        let out = held
            .protect(async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                7
            })
            .await;
        assert_eq!(out.unwrap(), 7);
    }

    #[tokio::test]
    async fn protect_stops_work_once_the_lease_is_lost() {
        let ttl = Duration::from_millis(150);
        let locks = memory(ttl);
        let held = lock(&locks, "3").await.unwrap();
        // Someone else takes the key behind the holder's back: its next renewal finds the
        // token gone.
        locks.unlock(held.lease().clone()).await.unwrap();
        let _thief = locks.try_lock("job:3").await.unwrap();
        let mut polled_after_loss = false;
        let status = held.status().clone();
        let result = tokio::time::timeout(
            Duration::from_secs(5),
            held.protect(async {
                loop {
                    polled_after_loss |= status.is_lost();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }),
        )
        .await
        .expect("protect returns once the lease is lost");
        assert!(matches!(result, Err(LockError::Lost)));
        assert!(status.is_lost());
        assert!(!polled_after_loss, "the work was polled after the loss");
    }

    #[tokio::test]
    async fn a_lease_reused_from_a_layer_is_left_to_the_layer() {
        let locks = memory(Duration::from_secs(30));
        let layer_lease = locks.try_lock("job:4").await.unwrap();
        let watchdog = Watchdog::new(locks.clone(), layer_lease.clone(), Renewal::default());
        let mut parts = parts("4");
        parts.extensions.insert(watchdog.status());
        let reused = Locked::<Job>::from_request_parts(&mut parts, &locks)
            .await
            .unwrap();
        assert_eq!(reused.lease(), &layer_lease);
        reused.release().await.unwrap();
        assert!(
            locks.try_lock("job:4").await.is_err(),
            "the layer's lease was released by the extractor"
        );
    }

    #[test]
    fn strings_and_integers_are_lock_keys() {
        assert_eq!(String::from("a").lock_key(), "a");
        assert_eq!(42u64.lock_key(), "42");
        assert_eq!((-7i32).lock_key(), "-7");
        assert_eq!(<u8 as LockKey>::SCOPE, "");
    }
}
