//! Lock keys: how a request becomes a key, and what a valid key is.
//!
//! A key reaches Redis as `{prefix}{scope}:{value}`:
//! - the *prefix* belongs to the backend ([`RedlockBuilder::prefix`](crate::RedlockBuilder::prefix),
//!   default `"tower-redlock:"`), so that one Redis can serve several applications;
//! - the *scope* belongs to the layer or extractor, so that `/items/{id}` and `/users/{id}`
//!   with the same id never share a lock;
//! - the *value* comes from the request: a header, a path parameter, the client's IP
//!   address (behind trusted proxies: [`ClientIpKey`]), or your function.
//!
//! Keys travel to Redis as `KEYS` arguments of commands and scripts, never spliced into
//! Lua source, so any byte is safe there; values are still checked (see [`validate_value`])
//! so that a client cannot make the server store unbounded or unprintable keys.
//!
//! # How long a key can be
//!
//! Only the value comes from the client, and it is at most [`MAX_KEY_LEN`] bytes (256).
//! `%`, `{` and `}` in the scope and the value are percent-encoded, which can triple them,
//! so a layer's whole key is at most `prefix + scope + 1 + 3 × 256` bytes. The prefix (at
//! most 128 bytes) and the scope are the server's: a fixed [`scope`] of the layer, or the
//! extractor's, which never takes a client's input but the key value (see [`HeaderKey`]).
//!
//! [`scope`]: crate::LockLayer::scope

use std::borrow::Cow;
#[cfg(feature = "lock")]
use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;

/// The longest key value accepted from a request, in bytes: 256.
///
/// The Idempotency-Key draft suggests UUIDs (36 bytes); 256 leaves room for composite keys
/// while keeping every Redis key small.
pub const MAX_KEY_LEN: usize = 256;

/// The longest resource name (prefix excluded) the backends accept from a direct call
/// ([`Locks::lock`](crate::Locks::lock) and the others), in bytes: 1024.
pub const MAX_RESOURCE_LEN: usize = 1024;

/// The most keys one lease may name ([`LockRequest::all`](crate::LockRequest::all) and the
/// others): 64. Each node checks and sets them in one script, so the bound keeps that
/// script short.
pub const MAX_KEYS_PER_LEASE: usize = 64;

/// Why a key value (of a lock or of a rate limit) was refused. The HTTP layers answer
/// `400 Bad Request` for each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value is empty.
    #[error("the key is empty")]
    Empty,
    /// A lease on several keys was asked for more than [`MAX_KEYS_PER_LEASE`] distinct
    /// keys, or for none.
    #[error("{count} keys were given for one lease; from 1 to {max} distinct ones are accepted")]
    KeyCount {
        /// How many distinct keys were given (counting stops one over the bound).
        count: usize,
        /// The bound.
        max: usize,
    },
    /// The value is longer than [`MAX_KEY_LEN`] bytes.
    #[error("the key is {len} bytes long; at most {max} are accepted")]
    TooLong {
        /// Length of the value, in bytes.
        len: usize,
        /// The bound, in bytes.
        max: usize,
    },
    /// The value contains a control character (such as NUL, CR, LF or DEL).
    #[error("the key contains a control character")]
    ControlCharacter,
    /// A header value is not visible ASCII, or a quoted string (RFC 8941) is malformed.
    #[error("the {0} header is not a valid string: use a bare token or an RFC 8941 quoted string")]
    MalformedHeader(HeaderName),
    /// A path parameter is not valid UTF-8 once percent-decoded.
    #[error("a path parameter is not valid UTF-8 once percent-decoded")]
    MalformedPathParameter,
    /// The request does not say whose key it is: the
    /// [`IdempotencyLayer::tenant`](crate::IdempotencyLayer::tenant) function found no
    /// tenant in it.
    #[error("the request does not say whose key it is (no tenant)")]
    MissingTenant,
    /// The header that a trusted proxy sets for the client's address has none where the
    /// [`ClientIpKey`] looks: not an IP address, an RFC 7239 `unknown` or obfuscated
    /// identifier, or a header that must appear once appearing twice.
    #[cfg(feature = "client-ip")]
    #[cfg_attr(docsrs, doc(cfg(feature = "client-ip")))]
    #[error("the {0} header from a trusted proxy has no client IP address where it should")]
    UnreadableClientIp(HeaderName),
}

/// Why a request has no key, as the extractor sees it ([`KeyExtractor::no_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoKey {
    /// The request lacks the key (no such header, the function returned `None`): the
    /// layer answers 400, or lets it through unguarded when the key is optional.
    Missing,
    /// The key does not apply to this request: a path parameter on a request that no route
    /// matched (the router's fallback, under `Router::layer`). It runs unguarded, so the
    /// fallback answers (404).
    NotApplicable,
    /// The server is set up so that the key cannot be found: the layer answers **500**
    /// (`application/problem+json`, nothing internal) and logs the message once per
    /// layer, at `error` level.
    Misconfigured(Misconfiguration),
}

/// A server mistake that keeps a layer from finding its key, seen only once requests come,
/// with the fix: a path parameter the route lacks, a path-parameter layer outside the
/// `Router`, a peer-address key without `ConnectInfo`. Mistakes the builders can see (a
/// header name that is not one) stop the app as it is built instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Misconfiguration(Cow<'static, str>);

impl Misconfiguration {
    /// A misconfiguration described by `message`, which should name the fix.
    pub fn new(message: impl Into<Cow<'static, str>>) -> Self {
        Self(message.into())
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.0
    }
}

/// Checks a key value: not empty, at most [`MAX_KEY_LEN`] bytes, no control characters.
///
/// # Errors
///
/// [`KeyError::Empty`], [`KeyError::TooLong`] or [`KeyError::ControlCharacter`].
///
/// ```
/// use tower_redlock::key::{validate_value, KeyError};
/// assert!(validate_value("order-42").is_ok());
/// assert_eq!(validate_value(""), Err(KeyError::Empty));
/// assert_eq!(validate_value("a\nb"), Err(KeyError::ControlCharacter));
/// ```
pub fn validate_value(value: &str) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty);
    }
    if value.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            len: value.len(),
            max: MAX_KEY_LEN,
        });
    }
    if has_control(value) {
        return Err(KeyError::ControlCharacter);
    }
    Ok(())
}

/// Whether `text` holds a control character (Unicode category Cc): one pass over the
/// bytes, as keys are almost always ASCII, and a look at the characters past the first
/// byte that is not.
pub(crate) fn has_control(text: &str) -> bool {
    match text
        .bytes()
        .position(|b| b.is_ascii_control() || !b.is_ascii())
    {
        None => false,
        Some(at) => text[at..].chars().any(char::is_control),
    }
}

/// Appends `part` with `%`, `{` and `}` percent-encoded (`%25`, `%7B`, `%7D`), so that a
/// key never holds a Redis Cluster hash tag by accident and stays one-to-one with its parts.
///
/// Hash tags are chosen on purpose: every auxiliary key of a lock is named
/// `<prefix>{<lock key>}<suffix>`, which lands in the lock key's slot only because the
/// prefix and the lock key have no braces of their own.
#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
#[inline]
pub(crate) fn push_escaped(out: &mut String, part: &str) {
    if !needs_escape(part.as_bytes()) {
        out.push_str(part);
        return;
    }
    for c in part.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

/// [`push_escaped`] in place on what `out` holds from byte `from` on.
#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
#[inline]
pub(crate) fn escape_from(out: &mut String, from: usize) {
    let Some(tail) = out.as_bytes().get(from..) else {
        return;
    };
    if !needs_escape(tail) {
        return;
    }
    let tail = out.split_off(from);
    push_escaped(out, &tail);
}

#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
#[inline]
fn needs_escape(part: &[u8]) -> bool {
    // A part of a few bytes (`ip`, a short id) is quicker to look over than to set a
    // vector search up for.
    if part.len() <= 8 {
        return part.iter().any(|&b| matches!(b, b'%' | b'{' | b'}'));
    }
    memchr::memchr3(b'%', b'{', b'}', part).is_some()
}

/// Runs `f` on this thread's scratch buffer, cleared: a key written there and only read (a
/// count in memory) costs no allocation, and one that is kept is copied once, into what
/// keeps it.
#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
pub(crate) fn with_scratch<T>(f: impl FnOnce(&mut String) -> T) -> T {
    /// Scratch buffers above this capacity are not kept.
    const KEEP: usize = 4096;
    thread_local! {
        static SCRATCH: std::cell::RefCell<String> =
            const { std::cell::RefCell::new(String::new()) };
    }
    SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut buffer) => {
            buffer.clear();
            let out = f(&mut buffer);
            if buffer.capacity() > KEEP {
                *buffer = String::new();
            }
            out
        }
        // Only if `f` itself writes a key.
        Err(_) => f(&mut String::new()),
    })
}

/// A key written by `write`, in the `Arc<str>` a lease keeps: its only allocation.
#[cfg(feature = "lock")]
pub(crate) fn shared_key(write: impl FnOnce(&mut String)) -> Arc<str> {
    with_scratch(|key| {
        write(key);
        Arc::<str>::from(key.as_str())
    })
}

/// A header name given to a layer's builder: a [`HeaderName`], or a string written in the
/// code, such as `"Idempotency-Key"` (header names are case-insensitive).
///
/// A string is checked when the layer is built, before any request: one that is not a
/// header name is a mistake in the code, and the builder panics with the fix. Parse a name
/// that comes from configuration with `HeaderName::try_from` and handle its `Result`.
pub trait IntoHeaderName: sealed::Sealed {
    /// The name; `method` names the builder in the panic message.
    #[doc(hidden)]
    fn into_header_name(self, method: &str) -> HeaderName;
}

impl IntoHeaderName for HeaderName {
    fn into_header_name(self, _method: &str) -> HeaderName {
        self
    }
}

impl IntoHeaderName for &HeaderName {
    fn into_header_name(self, _method: &str) -> HeaderName {
        self.clone()
    }
}

impl IntoHeaderName for &'static str {
    // A string written in the code that is no header name is the code's mistake, found as
    // the layer is built, before any request (see the trait's docs).
    #[allow(clippy::panic)]
    fn into_header_name(self, method: &str) -> HeaderName {
        HeaderName::from_bytes(self.as_bytes()).unwrap_or_else(|_| {
            panic!(
                "{method}({self:?}): not a header name (RFC 9110, section 5.1: letters, digits \
                 and !#$%&'*+-.^_`|~ only, not empty)"
            )
        })
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for http::HeaderName {}
    impl Sealed for &http::HeaderName {}
    impl Sealed for &'static str {}
}

/// Takes a lock key from a request.
///
/// Ready implementations: [`HeaderKey`] (`LockLayer::by_header`), [`PathParamKey`]
/// (`LockLayer::by_path_param`, feature `axum`), [`ClientIpKey`] (the client's address,
/// behind trusted proxies; feature `client-ip`) and [`FnKey`] (`LockLayer::by_fn`, a
/// closure). Implement it for anything else; the value is validated by the caller with
/// [`validate_value`], so an implementation only has to find it.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key value of this request: `Ok(None)` when the request has none (the layer then
    /// answers 400, or lets the request through when the key is optional). Borrow it from
    /// the request head when it is there as is (a header's value): the layer copies it
    /// once, into the key.
    ///
    /// # Errors
    ///
    /// A [`KeyError`] when the request carries a key that cannot be read; the layer
    /// answers 400.
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError>;

    /// Appends the scope of this request's key to `out`: what keeps keys of different
    /// resources apart. The default appends nothing: the value alone names the lock. The
    /// scope must not be taken from the client's input ([module docs](self)).
    fn write_scope(&self, parts: &Parts, out: &mut String) {
        let _ = (parts, out);
    }

    /// Why this request has no key, called when [`extract`](Self::extract) returned
    /// `Ok(None)`. The default, [`NoKey::Missing`], blames the request; say
    /// [`NoKey::Misconfigured`] when the server's setup is to blame (the layer answers
    /// 500 and logs the fix once), or [`NoKey::NotApplicable`] when the key does not apply.
    fn no_key(&self, parts: &mut Parts) -> NoKey {
        let _ = parts;
        NoKey::Missing
    }

    /// Whether this extractor names several keys per request, read with
    /// [`extract_all`](Self::extract_all) instead of [`extract`](Self::extract), all held
    /// with one lease, all or none ([`LockLayer`](crate::LockLayer) only; on another layer
    /// it does not compile). Default `false`. [`FnKeys`] (`LockLayer::by_fn_all`) is one.
    const SEVERAL: bool = false;

    /// Every key value of this request, for an extractor with [`SEVERAL`](Self::SEVERAL);
    /// `Ok(None)` or an empty list when the request has none. Each value is checked as
    /// [`extract`](Self::extract)'s, and shares its scope. The default: the one value of
    /// [`extract`](Self::extract).
    ///
    /// # Errors
    ///
    /// A [`KeyError`] when the request carries a key that cannot be read; the layer
    /// answers 400.
    fn extract_all(&self, parts: &mut Parts) -> Result<Option<Vec<String>>, KeyError> {
        Ok(self.extract(parts)?.map(|value| vec![value.into_owned()]))
    }

    /// Appends this request's key value to `out` as a layer's key holds it: checked with
    /// [`validate_value`] and escaped; `Ok(false)` when the request has none. The default
    /// does it over [`extract`](Self::extract); an extractor whose values need neither
    /// (an IP address) writes them straight in, without a copy.
    #[doc(hidden)]
    #[cfg(any(
        feature = "lock",
        feature = "rate-limit",
        feature = "concurrency-limit"
    ))]
    fn write_value(&self, parts: &mut Parts, out: &mut String) -> Result<bool, KeyError> {
        let Some(value) = self.extract(parts)? else {
            return Ok(false);
        };
        validate_value(&value)?;
        push_escaped(out, &value);
        Ok(true)
    }
}

/// The TCP peer's address of this request, IPv4-mapped IPv6 addresses as IPv4: axum's
/// `ConnectInfo<SocketAddr>` (feature `axum`), else a plain `SocketAddr` extension; `None`
/// when the server recorded neither.
#[cfg(any(feature = "rate-limit", feature = "client-ip"))]
pub(crate) fn peer_ip(parts: &Parts) -> Option<std::net::IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
    {
        return Some(info.0.ip().to_canonical());
    }
    let addr = parts.extensions.get::<std::net::SocketAddr>()?;
    Some(addr.ip().to_canonical())
}

#[cfg(feature = "client-ip")]
mod client_ip;
pub(crate) mod extractors;

#[cfg(feature = "client-ip")]
#[cfg_attr(docsrs, doc(cfg(feature = "client-ip")))]
pub use client_ip::{ClientIpKey, ClientIpSource};
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use extractors::PathParamKey;
pub use extractors::{FnKey, FnKeys, GlobalKey, HeaderKey};

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(
        feature = "lock",
        feature = "rate-limit",
        feature = "concurrency-limit"
    ))]
    #[test]
    fn escaping_keeps_braces_and_percent_out_of_keys_one_to_one() {
        let mut out = String::from("p:");
        push_escaped(&mut out, "a{b}%c");
        assert_eq!(out, "p:a%7Bb%7D%25c");
        let mut plain = String::new();
        push_escaped(&mut plain, "%7B");
        let mut brace = String::new();
        push_escaped(&mut brace, "{");
        assert_ne!(plain, brace);
        let mut tail = String::from("x{/items/{id}}");
        escape_from(&mut tail, 1);
        assert_eq!(tail, "x%7B/items/%7Bid%7D%7D");
    }

    #[test]
    fn validate_bounds_length_and_control_bytes() {
        assert!(validate_value(&"a".repeat(MAX_KEY_LEN)).is_ok());
        assert_eq!(
            validate_value(&"a".repeat(MAX_KEY_LEN + 1)),
            Err(KeyError::TooLong {
                len: MAX_KEY_LEN + 1,
                max: MAX_KEY_LEN
            })
        );
        assert_eq!(validate_value("a\u{7f}"), Err(KeyError::ControlCharacter));
        // Past ASCII: C1 controls count, other characters do not.
        assert_eq!(validate_value("é\u{85}"), Err(KeyError::ControlCharacter));
        assert_eq!(validate_value("commande-é-42"), Ok(()));
        assert!(!has_control("ключ"));
        assert!(has_control("ключ\u{9f}"));
    }

    /// An extractor of several keys that implements `extract` only.
    struct OneOfSeveral;

    impl KeyExtractor for OneOfSeveral {
        const SEVERAL: bool = true;

        fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
            Ok(parts
                .headers
                .get("x-key")
                .map(|v| Cow::Borrowed(v.to_str().unwrap_or("?"))))
        }
    }

    #[test]
    fn extract_all_by_default_is_the_one_value_of_extract() {
        let (mut parts, ()) = http::Request::builder()
            .header("x-key", "order-7")
            .body(())
            .unwrap_or_default()
            .into_parts();
        assert_eq!(
            OneOfSeveral.extract_all(&mut parts),
            Ok(Some(vec!["order-7".to_owned()]))
        );
        let (mut none, ()) = http::Request::new(()).into_parts();
        assert_eq!(OneOfSeveral.extract_all(&mut none), Ok(None));
    }
}
