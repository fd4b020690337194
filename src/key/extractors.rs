//! The ready key extractors: a header, an axum path parameter, a function.

use std::borrow::Cow;
use std::fmt;

use http::HeaderName;
use http::request::Parts;

#[cfg(feature = "axum")]
use super::Misconfiguration;
#[cfg(feature = "axum")]
use super::NoKey;
use super::{KeyError, KeyExtractor};

/// The key is a request header's value, such as `Idempotency-Key`.
///
/// The value may be an RFC 8941 string (`"8e03978e-40d5"`, as the IETF draft "The
/// Idempotency-Key HTTP Header Field" defines it) or a bare token (`8e03978e-40d5`); the
/// quotes are not part of the key. The scope is the header name, the method (one outside
/// RFC 9110's list counts as `other`) and the route (axum's `MatchedPath`), so the same
/// key sent to two endpoints takes two locks. Without a `MatchedPath` (a layer outside the
/// `Router`, or without the `axum` feature) the scope is the header name and the method
/// only, never the request's path, which the client chooses: give such a layer a fixed
/// [`scope`](crate::LockLayer::scope) per endpoint.
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
}

impl HeaderKey {
    /// Reads the header `name`.
    pub fn new(name: HeaderName) -> Self {
        Self { name }
    }

    /// The header read.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl KeyExtractor for HeaderKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        let Some(raw) = parts.headers.get(&self.name) else {
            return Ok(None);
        };
        let malformed = || KeyError::MalformedHeader(self.name.clone());
        let text = raw.to_str().map_err(|_| malformed())?;
        // Optional white space (RFC 9110, section 5.6.3): spaces and tabs, the only ASCII
        // white space a header value can hold.
        let text = text.trim_ascii_start().trim_ascii_end();
        if text.starts_with('"') {
            parse_sf_string(text)
                .ok_or_else(malformed)
                .map(|value| Some(Cow::Owned(value)))
        } else {
            Ok(Some(Cow::Borrowed(text)))
        }
    }

    fn write_scope(&self, parts: &Parts, out: &mut String) {
        out.push_str(self.name.as_str());
        out.push(' ');
        out.push_str(method_of(parts));
        if let Some(route) = route_of(parts) {
            out.push(' ');
            out.push_str(route);
        }
    }
}

/// The method for a scope: one of RFC 9110's (and PATCH), else `other`, so that a client
/// cannot mint scopes with methods of its own.
fn method_of(parts: &Parts) -> &'static str {
    use http::Method;
    static KNOWN: [Method; 9] = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::HEAD,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ];
    KNOWN
        .iter()
        .find(|known| **known == parts.method)
        .map_or("other", Method::as_str)
}

/// Parses an RFC 8941 sf-string (section 3.3.3): `"` ... `"` with `\"` and `\\` escapes,
/// printable ASCII only, nothing after the closing quote.
fn parse_sf_string(text: &str) -> Option<String> {
    let inner = text.strip_prefix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                c @ ('"' | '\\') => out.push(c),
                _ => return None,
            },
            '"' => return chars.next().is_none().then_some(out),
            ' '..='~' => out.push(c),
            _ => return None,
        }
    }
    None
}

/// The route template the router matched, if any.
#[cfg(feature = "axum")]
pub(crate) fn route_of(parts: &Parts) -> Option<&str> {
    parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map(axum::extract::MatchedPath::as_str)
}

#[cfg(not(feature = "axum"))]
pub(crate) fn route_of(_parts: &Parts) -> Option<&str> {
    None
}

/// The key is a path parameter of an axum route, such as `item_id` in
/// `/items/{item_id}/buy`.
///
/// The scope is the route template up to and including the parameter (`/items/{item_id}`),
/// so `/items/{item_id}/buy` and `/items/{item_id}` lock the same item while
/// `/users/{user_id}` never shares a lock with it. Path parameters exist once axum has
/// routed the request, so use the layer with `Router::route_layer`, `Router::layer` or
/// `MethodRouter::layer`, not around the whole `Router` from outside.
///
/// Misplaced, it answers 500 and logs the fix once ([`NoKey::Misconfigured`]): outside
/// the `Router`, or on a route without the parameter. A request that no route matched
/// (the fallback, under `Router::layer`) passes through unguarded, to its 404.
#[cfg(feature = "axum")]
#[derive(Debug, Clone)]
pub struct PathParamKey {
    name: Cow<'static, str>,
    brace: String,
}

#[cfg(feature = "axum")]
impl PathParamKey {
    /// Reads the path parameter `name`.
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        let name = name.into();
        let brace = format!("{{{name}}}");
        Self { name, brace }
    }

    /// The parameter read.
    pub fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(feature = "axum")]
impl KeyExtractor for PathParamKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        use axum::extract::rejection::RawPathParamsRejection;
        match raw_path_params(parts) {
            Some(Ok(params)) => Ok(params
                .iter()
                .find(|(name, _)| *name == self.name)
                .map(|(_, value)| Cow::Owned(value.to_owned()))),
            Some(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => {
                Err(KeyError::MalformedPathParameter)
            }
            // No parameters at all: `no_key` says why.
            _ => Ok(None),
        }
    }

    fn no_key(&self, parts: &mut Parts) -> NoKey {
        let name = &self.name;
        match route_of(parts).map(str::to_owned) {
            Some(route) => NoKey::Misconfigured(Misconfiguration::new(format!(
                "by_path_param(\"{name}\") on the route {route}, which has no path parameter \
                 `{{{name}}}`: add the layer only to routes that have it \
                 (MethodRouter::layer, or Router::route_layer on a Router of such routes)"
            ))),
            // The fallback of a Router::layer: a request no route matched.
            None if matches!(raw_path_params(parts), Some(Ok(_))) => NoKey::NotApplicable,
            None => NoKey::Misconfigured(Misconfiguration::new(format!(
                "by_path_param(\"{name}\") runs before the Router has matched a route, so there \
                 are no path parameters: add it with Router::route_layer or MethodRouter::layer, \
                 not around the Router"
            ))),
        }
    }

    fn write_scope(&self, parts: &Parts, out: &mut String) {
        match route_of(parts) {
            Some(route) => match route.find(&self.brace) {
                Some(at) => out.push_str(&route[..at + self.brace.len()]),
                None => out.push_str(route),
            },
            None => out.push_str(&self.brace),
        }
    }
}

/// The path parameters the router stored: `Some(Ok)` once it routed the request, to a
/// route or (with none) to its fallback. The future is ready at once.
#[cfg(feature = "axum")]
fn raw_path_params(
    parts: &mut Parts,
) -> Option<Result<axum::extract::RawPathParams, axum::extract::rejection::RawPathParamsRejection>>
{
    use axum::extract::FromRequestParts;
    use futures_util::FutureExt;
    axum::extract::RawPathParams::from_request_parts(parts, &()).now_or_never()
}

/// The key is what a function returns for the request; `None` means the request has no key.
///
/// The scope is empty unless the layer sets one, so the function's value names the lock.
#[derive(Clone)]
pub struct FnKey<F> {
    f: F,
}

impl<F> FnKey<F> {
    /// Wraps `f`.
    pub fn new(f: F) -> Self {
        Self { f }
    }
}

impl<F> fmt::Debug for FnKey<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnKey").finish_non_exhaustive()
    }
}

impl<F> KeyExtractor for FnKey<F>
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        Ok((self.f)(parts).map(Cow::Owned))
    }
}

/// The keys are what a function returns for the request head, all held with one lease
/// ([`LockLayer::by_fn_all`](crate::LockLayer::by_fn_all)): `None` or an empty list when
/// the request has none.
///
/// A lock takes several keys at once; a count or a permit does not, so a layer other than
/// [`LockLayer`](crate::LockLayer) over `FnKeys` does not compile:
///
/// ```compile_fail
/// use tower_redlock::{RateLimitLayer, key::FnKeys};
///
/// let keys = FnKeys::new(|_: &http::request::Parts| Some(vec!["a".to_owned()]));
/// let layer = RateLimitLayer::new(keys, "10/1".parse().unwrap());
/// ```
pub struct FnKeys<F> {
    f: F,
}

impl<F> FnKeys<F> {
    /// Wraps `f`.
    pub fn new(f: F) -> Self {
        Self { f }
    }
}

impl<F> fmt::Debug for FnKeys<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnKeys").finish_non_exhaustive()
    }
}

impl<F> KeyExtractor for FnKeys<F>
where
    F: Fn(&Parts) -> Option<Vec<String>> + Send + Sync + 'static,
{
    const SEVERAL: bool = true;

    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        // Read through `extract_all`; this is only for a caller that takes one key.
        Ok((self.f)(parts)
            .and_then(|values| values.into_iter().next())
            .map(Cow::Owned))
    }

    fn extract_all(&self, parts: &mut Parts) -> Result<Option<Vec<String>>, KeyError> {
        Ok((self.f)(parts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(header: &str) -> Parts {
        let req = http::Request::builder()
            .uri("/orders")
            .header("idempotency-key", header)
            .body(())
            .unwrap();
        req.into_parts().0
    }

    #[test]
    fn header_accepts_bare_token_and_sf_string() {
        let key = HeaderKey::new(HeaderName::from_static("idempotency-key"));
        assert_eq!(
            key.extract(&mut parts("abc-1")).unwrap().as_deref(),
            Some("abc-1")
        );
        assert_eq!(
            key.extract(&mut parts("\"abc-1\"")).unwrap().as_deref(),
            Some("abc-1")
        );
        assert_eq!(
            key.extract(&mut parts(r#""a\"b\\c""#)).unwrap().as_deref(),
            Some(r#"a"b\c"#)
        );
    }

    #[test]
    fn header_rejects_malformed_sf_string() {
        let key = HeaderKey::new(HeaderName::from_static("idempotency-key"));
        for bad in ["\"open", "\"a\"b", r#""a\nb""#] {
            assert!(
                matches!(
                    key.extract(&mut parts(bad)),
                    Err(KeyError::MalformedHeader(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn header_scope_separates_methods_and_never_takes_the_clients_path() {
        let key = HeaderKey::new(HeaderName::from_static("idempotency-key"));
        let scope_of = |method: &str, path: &str| {
            let p = http::Request::builder()
                .method(method)
                .uri(path)
                .body(())
                .unwrap()
                .into_parts()
                .0;
            let mut scope = String::new();
            key.write_scope(&p, &mut scope);
            scope
        };
        // No route matched (no MatchedPath): the path the client chose is left out.
        assert_eq!(scope_of("GET", "/orders"), "idempotency-key GET");
        assert_eq!(scope_of("GET", "/orders/x/y/z"), "idempotency-key GET");
        assert_eq!(scope_of("POST", "/orders"), "idempotency-key POST");
        // Methods of the client's own invention share one scope.
        assert_eq!(scope_of("BREW", "/"), "idempotency-key other");
        assert_eq!(scope_of("MINT-1", "/"), "idempotency-key other");
    }
}

/// One key for every request: a limit on the whole route (or service), across all
/// clients. The key is `global:all`; give each layer that uses it its own scope.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

impl KeyExtractor for GlobalKey {
    fn extract<'a>(&self, _parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        Ok(Some(Cow::Borrowed("all")))
    }

    fn write_scope(&self, _parts: &Parts, out: &mut String) {
        out.push_str("global");
    }
}
