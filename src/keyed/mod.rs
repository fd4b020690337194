//! The core every keyed middleware shares: [`LockLayer`](crate::LockLayer),
//! [`RateLimitLayer`](crate::RateLimitLayer), [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer)
//! and [`IdempotencyLayer`](crate::IdempotencyLayer) are a [`KeyedLayer`] with a policy of
//! their own.
//!
//! One request through a keyed layer:
//!
//! 1. [`Keyed::call`](tower_service::Service::call) takes the key value from the request
//!    with the layer's [`KeyExtractor`](crate::key::KeyExtractor) and checks it: **400**
//!    when required and missing, or invalid; **500** when the server is misconfigured
//!    (logged once per layer); through unguarded when the key is optional and absent.
//! 2. It writes the whole key, `{prefix}{scope}:{value}`, in a scratch buffer and asks the
//!    layer's policy for a decision: admit with a permit, answer (a problem), or run
//!    unguarded (the backend is down and the layer fails open). An in-process backend
//!    answers at once; a Redis one through a future that the [`ResponseFuture`] awaits.
//! 3. It calls the inner service it drove to readiness (clone and swap), with what the
//!    permit puts on the request (a lease status, a usage count).
//! 4. The [`ResponseFuture`] runs the inner future under the permit (never polled past a
//!    lease's validity), lets the permit add its headers, and either releases it or hands
//!    it to the [`ResponseBody`], which releases it as the body ends.

/// `get_ref`, `get_mut` and `into_inner` for a service whose inner service `S` is the
/// field `inner`, as tower-http's services have them.
macro_rules! inner_service_accessors {
    () => {
        /// Gets a reference to the inner service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// Gets a mutable reference to the inner service.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Consumes `self`, returning the inner service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}
pub(crate) use inner_service_accessors;

/// Builder methods that store their argument in one field of the layer's policy, each
/// with its own doc comment: `fn name(value: Type) => field;` becomes
/// `pub fn name(mut self, value: Type) -> Self`, which sets `self.policy_mut().field`
/// (through `.into()`, for an `impl Into<T>` argument) and returns the layer. The layer
/// type is `#[must_use]`, and so is every setter's result.
macro_rules! layer_setters {
    ($($(#[$attr:meta])* fn $name:ident($value:ident: $ty:ty) => $field:ident;)*) => {$(
        $(#[$attr])*
        pub fn $name(mut self, $value: $ty) -> Self {
            self.policy_mut().$field = $value.into();
            self
        }
    )*};
}
pub(crate) use layer_setters;

pub(crate) mod answers;
mod body;
pub(crate) mod future;
pub(crate) mod layer;
pub(crate) mod policy;
mod service;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use layer::KeyedLayer;
pub use policy::Policy;
pub use service::Keyed;
#[cfg(test)]
pub(crate) mod tests;
