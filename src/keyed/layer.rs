use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::Response;
use http::request::Parts;

use super::policy::{Decision, Policy, Verdict};
#[cfg(feature = "axum")]
use crate::key::PathParamKey;
use crate::key::{
    HeaderKey, IntoHeaderName, KeyError, KeyExtractor, Misconfiguration, NoKey, escape_from,
    push_escaped, validate_value, with_scratch,
};
use crate::keyed::answers::RenderFn;
use crate::rejection::{Rejection, RejectionKind};

/// The layer of a keyed middleware: where the key comes from and what to do without one
/// (here), and what to do with it (the policy `P`). [`LockLayer`](crate::LockLayer) and
/// [`RateLimitLayer`](crate::RateLimitLayer) are this type with their policies.
///
/// Cloning the layer shares its key extractor, its backend and its settings; the builder
/// methods change a copy once the layer has been cloned.
#[must_use]
pub struct KeyedLayer<K, P> {
    pub(crate) core: Arc<Core<K, P>>,
}

/// What the layer and its services share.
pub(crate) struct Core<K, P> {
    pub(crate) extractor: Arc<K>,
    /// A fixed scope instead of the extractor's, percent-encoded once ([`push_escaped`]).
    pub(crate) scope: Option<Arc<str>>,
    pub(crate) required: bool,
    /// Whether the inner service runs when the backend cannot decide.
    pub(crate) fail_open: bool,
    /// The 400 detail when a required key is missing.
    pub(crate) missing: Cow<'static, str>,
    /// Whether a misconfiguration found per request (a route without the path parameter)
    /// was logged: once per layer.
    reported: AtomicBool,
    /// The application's rendering of rejections for HTTP clients.
    pub(crate) on_rejection: Option<Arc<RenderFn>>,
    /// Whether refusals are let through (shadow mode), switchable at run time.
    pub(crate) shadow: super::Shadow,
    /// Requests that pass unguarded whatever their key (health checks, metrics).
    pub(crate) exempt: Vec<Exemption>,
    pub(crate) policy: P,
}

/// A request that passes a layer unguarded: a path, every path under a prefix, or what a
/// function picks.
#[derive(Clone)]
pub(crate) enum Exemption {
    Path(Box<str>),
    Under(Box<str>),
    If(Arc<dyn Fn(&Parts) -> bool + Send + Sync>),
}

impl Exemption {
    /// `/metrics` is that path; `/grpc.health.v1.Health/` every path under it.
    pub(crate) fn path(path: &str) -> Self {
        if path.ends_with('/') {
            Exemption::Under(path.into())
        } else {
            Exemption::Path(path.into())
        }
    }

    fn covers(&self, parts: &Parts) -> bool {
        let path = parts.uri.path();
        match self {
            Exemption::Path(exempt) => path == &**exempt,
            Exemption::Under(prefix) => path.starts_with(&**prefix),
            Exemption::If(f) => f(parts),
        }
    }
}

impl fmt::Debug for Exemption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exemption::Path(path) => write!(f, "Path({path:?})"),
            Exemption::Under(prefix) => write!(f, "Under({prefix:?})"),
            Exemption::If(_) => f.write_str("If(..)"),
        }
    }
}

impl<K, P: Clone> Clone for Core<K, P> {
    fn clone(&self) -> Self {
        Self {
            extractor: self.extractor.clone(),
            scope: self.scope.clone(),
            required: self.required,
            fail_open: self.fail_open,
            missing: self.missing.clone(),
            // A changed copy is another layer: it reports on its own.
            reported: AtomicBool::new(false),
            on_rejection: self.on_rejection.clone(),
            shadow: self.shadow.clone(),
            exempt: self.exempt.clone(),
            policy: self.policy.clone(),
        }
    }
}

impl<K, P> Clone for KeyedLayer<K, P> {
    fn clone(&self) -> Self {
        Self {
            core: self.core.clone(),
        }
    }
}

impl<K: fmt::Debug, P: Policy + fmt::Debug> fmt::Debug for KeyedLayer<K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.core.fmt(f)
    }
}

impl<K: fmt::Debug, P: Policy + fmt::Debug> fmt::Debug for Core<K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(P::REJECTED_BY.layer())
            .field("extractor", &self.extractor)
            .field("scope", &self.scope)
            .field("required", &self.required)
            .field("fail_open", &self.fail_open)
            .field("on_rejection", &self.on_rejection.is_some())
            .field("shadow", &self.shadow)
            .field("exempt", &self.exempt)
            .field("policy", &self.policy)
            .finish()
    }
}

impl<K: KeyExtractor, P: Policy> KeyedLayer<K, P> {
    /// A layer over `extractor` and `policy`: key required, the extractor's scope, the
    /// policy's default on backend failures. An extractor of several keys on a policy of
    /// one does not compile.
    pub(crate) fn from_parts(extractor: K, policy: P, missing: Cow<'static, str>) -> Self {
        const {
            assert!(
                !K::SEVERAL || P::SEVERAL_KEYS,
                "a key extractor of several keys (FnKeys, LockLayer::by_fn_all) works with \
                 LockLayer only"
            )
        };
        Self {
            core: Arc::new(Core {
                extractor: Arc::new(extractor),
                scope: None,
                required: true,
                fail_open: P::FAIL_OPEN,
                missing,
                reported: AtomicBool::new(false),
                on_rejection: None,
                shadow: super::Shadow::default(),
                exempt: Vec::new(),
                policy,
            }),
        }
    }
}

impl<K, P: Clone> KeyedLayer<K, P> {
    /// The settings, to change: shared ones are copied first.
    pub(crate) fn core_mut(&mut self) -> &mut Core<K, P> {
        Arc::make_mut(&mut self.core)
    }

    /// The policy's settings, to change.
    pub(crate) fn policy_mut(&mut self) -> &mut P {
        &mut self.core_mut().policy
    }

    // The settings every keyed layer has; documented on the public layers
    // (`keyed_middleware!`).
    pub(crate) fn scope(mut self, scope: impl Into<String>) -> Self {
        let scope = scope.into();
        let mut escaped = String::with_capacity(scope.len());
        push_escaped(&mut escaped, &scope);
        self.core_mut().scope = Some(Arc::from(escaped));
        self
    }

    pub(crate) fn optional(mut self, optional: bool) -> Self {
        self.core_mut().required = !optional;
        self
    }

    pub(crate) fn fail_open(mut self, fail_open: bool) -> Self {
        self.core_mut().fail_open = fail_open;
        self
    }

    pub(crate) fn on_rejection(mut self, render: Arc<RenderFn>) -> Self {
        self.core_mut().on_rejection = Some(render);
        self
    }

    pub(crate) fn shadow(mut self, shadow: super::Shadow) -> Self {
        self.core_mut().shadow = shadow;
        self
    }

    pub(crate) fn exempt(mut self, exemption: Exemption) -> Self {
        self.core_mut().exempt.push(exemption);
        self
    }
}

impl<P: Policy + Clone> KeyedLayer<HeaderKey, P> {
    #[cfg(any(feature = "rate-limit", feature = "concurrency-limit"))]
    /// Scoped by the header name alone (`x-tenant:acme`): one count per header value
    /// across every route the layer guards, as a limit on a tenant or an API key is.
    pub(crate) fn tenant_wide(self) -> Self {
        let name = self.core.extractor.name().as_str().to_owned();
        self.scope(name)
    }

    /// The layer of a `by_header` constructor: keys from the header `name`, decided by
    /// `policy`; a request without the header is answered 400 naming it.
    ///
    /// # Panics
    ///
    /// When `name` is a string that is not a header name ([`IntoHeaderName`]).
    pub(crate) fn from_header(name: impl IntoHeaderName, policy: P) -> Self {
        let name = name.into_header_name(&format!("{}::by_header", P::REJECTED_BY.layer()));
        let detail = format!("This endpoint requires a non-empty {name} header.");
        Self::from_parts(HeaderKey::new(name), policy, Cow::Owned(detail))
    }
}

#[cfg(feature = "axum")]
impl<P: Policy + Clone> KeyedLayer<PathParamKey, P> {
    /// The layer of a `by_path_param` constructor: keys from the axum path parameter
    /// `name`, decided by `policy`; `missing` is the 400 detail for a request without the
    /// parameter.
    ///
    /// # Panics
    ///
    /// When `name` is empty: a mistake in the code, found as the layer is built.
    pub(crate) fn from_path_param(
        name: impl Into<Cow<'static, str>>,
        policy: P,
        missing: &'static str,
    ) -> Self {
        let key = PathParamKey::new(name);
        assert!(
            !key.name().is_empty(),
            "{}::by_path_param: the parameter name is empty",
            P::REJECTED_BY.layer()
        );
        Self::from_parts(key, policy, Cow::Borrowed(missing))
    }
}

impl<K: KeyExtractor, P: Policy> Core<K, P> {
    /// Reads and checks the request's key, written whole in a scratch buffer (the policy
    /// copies it only if it keeps it), and asks the policy about it: its decision, or the
    /// layer's own answer (400, 500) as a decided one; `None` when the request has no key
    /// and needs none (it runs unguarded).
    pub(crate) fn step(&self, parts: &mut Parts) -> Option<Decision<P::Permit>> {
        if !self.exempt.is_empty() && self.exempt.iter().any(|e| e.covers(parts)) {
            return None;
        }
        if K::SEVERAL {
            return self.step_all(parts);
        }
        let read = with_scratch(|key| {
            self.write_key_head(key, parts);
            match self.extractor.write_value(parts, key) {
                Ok(true) => Ok(self.decide(key, parts)),
                Ok(false) => Err(None),
                Err(e) => Err(Some(e)),
            }
        });
        match read {
            Ok(decision) => Some(decision),
            Err(error) => self.unread(error, parts),
        }
    }

    /// Writes the head of this layer's keys, `{prefix}{scope}:`, in `key`: the policy's
    /// prefix, then the layer's fixed scope or else the extractor's for this request,
    /// percent-encoded ([`push_escaped`]).
    fn write_key_head(&self, key: &mut String, parts: &Parts) {
        key.push_str(self.policy.prefix());
        match &self.scope {
            Some(scope) => key.push_str(scope),
            None => {
                let scope_at = key.len();
                self.extractor.write_scope(parts, key);
                escape_from(key, scope_at);
            }
        }
        key.push(':');
    }

    /// [`step`](Self::step) for an extractor of several keys: each value is checked and
    /// written as one key would be, and the policy decides for the set (sorted, distinct).
    fn step_all(&self, parts: &mut Parts) -> Option<Decision<P::Permit>> {
        let values = match self.extractor.extract_all(parts) {
            Ok(Some(values)) if !values.is_empty() => values,
            Ok(_) => return self.unread(None, parts),
            Err(e) => return self.unread(Some(e), parts),
        };
        let mut keys = Vec::with_capacity(values.len());
        for value in &values {
            if let Err(e) = validate_value(value) {
                return self.unread(Some(e), parts);
            }
            keys.push(with_scratch(|key| {
                self.write_key_head(key, parts);
                push_escaped(key, value);
                Arc::<str>::from(key.as_str())
            }));
        }
        keys.sort_unstable();
        keys.dedup();
        if keys.len() > crate::key::MAX_KEYS_PER_LEASE {
            let error = KeyError::KeyCount {
                count: keys.len(),
                max: crate::key::MAX_KEYS_PER_LEASE,
            };
            return answer(invalid_key::<P>(&error));
        }
        if self.policy.refuses() {
            return answer(Rejection::misconfigured(P::REJECTED_BY).into());
        }
        if let [key] = keys.as_slice() {
            return Some(self.policy.decide(key, parts));
        }
        Some(self.policy.decide_all(keys, parts))
    }

    /// The policy's decision for `key`, or 500 when its backend refuses to decide (the
    /// in-process fallback in a process that built Redis: [`Policy::refuses`]).
    #[inline]
    fn decide(&self, key: &str, parts: &Parts) -> Decision<P::Permit> {
        if self.policy.refuses() {
            return Decision::Ready(Verdict::answer(
                Rejection::misconfigured(P::REJECTED_BY).into(),
            ));
        }
        self.policy.decide(key, parts)
    }

    /// The answer when no key was read: `error` when the key is invalid, else why the
    /// request has none.
    fn unread(&self, error: Option<KeyError>, parts: &mut Parts) -> Option<Decision<P::Permit>> {
        let Some(error) = error else {
            return match self.extractor.no_key(parts) {
                NoKey::Misconfigured(mistake) => answer(self.misconfiguration(&mistake)),
                NoKey::Missing if self.required => {
                    self.policy.bad_key(true);
                    let rejection = Rejection::new(
                        P::REJECTED_BY,
                        RejectionKind::MissingKey,
                        self.missing.clone(),
                    );
                    answer(rejection.into())
                }
                _ => None,
            };
        };
        self.policy.bad_key(false);
        answer(invalid_key::<P>(&error))
    }

    /// 500, and the mistake in the log the first time.
    fn misconfiguration(&self, mistake: &Misconfiguration) -> Response<Bytes> {
        if !self.reported.swap(true, Ordering::Relaxed) {
            tracing::error!(
                layer = P::REJECTED_BY.layer(),
                "{mistake}; every request through this layer is answered 500 until it is fixed"
            );
        }
        Rejection::misconfigured(P::REJECTED_BY).into()
    }
}

/// The layer's own answer (400, 500), decided at once.
fn answer<H>(response: Response<Bytes>) -> Option<Decision<H>> {
    Some(Decision::Ready(Verdict::answer(response)))
}

/// 400 for a key that cannot be used.
fn invalid_key<P: Policy>(error: &KeyError) -> Response<Bytes> {
    let noun = P::REJECTED_BY.key_noun();
    let detail = match error {
        KeyError::Empty => format!("The {noun} is empty."),
        KeyError::TooLong { len, max } => {
            format!("The {noun} is {len} bytes long; at most {max} are accepted.")
        }
        KeyError::ControlCharacter => format!("The {noun} contains a control character."),
        other => format!("Invalid {noun}: {other}."),
    };
    Rejection::new(P::REJECTED_BY, RejectionKind::InvalidKey, detail).into()
}
