//! [`Locked<T>`]: an axum extractor that holds a lock on a value taken from the request.

use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;

use axum::extract::{FromRef, FromRequestParts, Path};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use crate::error::LockError;
use crate::key::validate_value;
use crate::lease::Lease;
use crate::locks::Locks;
use crate::problem::Problem;

/// Turns an extracted value into a lock key.
///
/// The key is `{SCOPE}:{lock_key()}`. The scope keeps different kinds of values apart
/// (order 42 and user 42); a [`LockLayer`](crate::LockLayer) with
/// [`.scope(SCOPE)`](crate::LockLayer::scope) locks the same keys.
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

/// An extractor that holds a lock on `T`'s key while the handler runs.
///
/// `T` is any extractor that implements [`LockKey`] (`Path<OrderId>`, or your own type).
/// The backend comes from the state: `Locks: FromRef<S>`. The lease is released when the
/// `Locked` value is dropped (in the background, with the TTL as the backstop), or
/// earlier with [`release`](Locked::release). Read the value through `Deref`.
///
/// When a [`LockLayer`](crate::LockLayer) already holds the same key for this request,
/// the extractor reuses that lease (the layer releases it) instead of locking against
/// itself.
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
    lease: Lease,
    /// Set when this extractor took the lease itself and so must release it.
    owner: Option<Locks>,
}

impl<T> Locked<T> {
    /// The lease held (key, token, validity).
    pub fn lease(&self) -> &Lease {
        &self.lease
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
    pub async fn release(mut self) -> Result<T, LockError> {
        let value = self
            .value
            .take()
            .expect("value present until release or drop");
        if let Some(locks) = self.owner.take() {
            locks.unlock(self.lease.clone()).await?;
        }
        Ok(value)
    }
}

impl<T> Deref for Locked<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.value
            .as_ref()
            .expect("value present until release or drop")
    }
}

impl<T> Drop for Locked<T> {
    fn drop(&mut self) {
        if let Some(locks) = self.owner.take() {
            locks.release_detached(self.lease.clone());
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for Locked<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locked")
            .field("value", &self.value)
            .field("lease", &self.lease)
            .field("reused", &self.owner.is_none())
            .finish()
    }
}

impl<T, S> FromRequestParts<S> for Locked<T>
where
    T: FromRequestParts<S> + LockKey + Send,
    Locks: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = LockedRejection<T::Rejection>;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let value = T::from_request_parts(parts, state)
            .await
            .map_err(LockedRejection::Extract)?;
        let key = value.lock_key();
        let reject =
            |e: LockError| LockedRejection::Lock(Problem::from_lock_error(&e, StatusCode::LOCKED));
        validate_value(&key).map_err(|e| reject(e.into()))?;
        let resource = format!("{}:{}", T::SCOPE, key);
        drop(key);
        let locks = Locks::from_ref(state);
        if let Some(lease) = parts.extensions.get::<Lease>() {
            if locks.names(lease, &resource) {
                return Ok(Locked {
                    value: Some(value),
                    lease: lease.clone(),
                    owner: None,
                });
            }
        }
        match locks.try_lock(&resource).await {
            Ok(lease) => Ok(Locked {
                value: Some(value),
                lease,
                owner: Some(locks),
            }),
            Err(e) => {
                if !matches!(e, LockError::Taken { .. } | LockError::InvalidKey(_)) {
                    tracing::warn!(error = %e, "lock backend unavailable; answering 503");
                }
                Err(reject(e))
            }
        }
    }
}

/// The rejection of [`Locked<T>`]: `T`'s own, or a lock problem.
#[derive(Debug)]
#[non_exhaustive]
pub enum LockedRejection<R> {
    /// `T` could not be extracted.
    Extract(R),
    /// The lock was not granted: 423, 400 or 503 as a problem+json response.
    Lock(Problem),
}

impl<R: IntoResponse> IntoResponse for LockedRejection<R> {
    fn into_response(self) -> Response {
        match self {
            LockedRejection::Extract(r) => r.into_response(),
            LockedRejection::Lock(p) => p.into_response(),
        }
    }
}
