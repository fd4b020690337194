//! Request fingerprints: what tells a retry from another request that reuses its key.

use bytes::Bytes;
use http::request::Parts;
use sha2::{Digest, Sha256};

use super::record::Fingerprint;

/// The default fingerprint: SHA-256 over the method, the matched route (axum's
/// `MatchedPath`; empty without one), the request's path and query, and the request body,
/// each length-prefixed. The same key with another method, route, resource (path or query)
/// or body is answered 422 (the IETF draft "The Idempotency-Key HTTP Header Field",
/// section 2.7), never given the response of a request for another resource.
pub fn default_fingerprint(parts: &Parts, body: &Bytes) -> Fingerprint {
    let mut hash = Sha256::new();
    let target = parts.uri.path_and_query().map_or("", |p| p.as_str());
    for part in [
        parts.method.as_str().as_bytes(),
        crate::key::extractors::route_of(parts)
            .unwrap_or_default()
            .as_bytes(),
        target.as_bytes(),
        body,
    ] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hash.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str) -> Parts {
        let request = http::Request::builder().method(method).uri(uri).body(());
        request.unwrap().into_parts().0
    }

    #[test]
    fn fingerprints_tell_method_and_body_apart() {
        let body = Bytes::from_static(b"{\"item\":1}");
        let base = default_fingerprint(&parts("POST", "/orders"), &body);
        assert_eq!(base, default_fingerprint(&parts("POST", "/orders"), &body));
        assert_ne!(base, default_fingerprint(&parts("PUT", "/orders"), &body));
        // Another resource, or another query: another request.
        assert_ne!(base, default_fingerprint(&parts("POST", "/order"), &body));
        assert_ne!(
            base,
            default_fingerprint(&parts("POST", "/orders?to=b"), &body)
        );
        let other = Bytes::from_static(b"{\"item\":2}");
        assert_ne!(base, default_fingerprint(&parts("POST", "/orders"), &other));
        // Length prefixes: moving bytes between parts changes the fingerprint.
        assert_ne!(
            default_fingerprint(&parts("AB", "/"), &Bytes::from_static(b"c")),
            default_fingerprint(&parts("A", "/"), &Bytes::from_static(b"Bc"))
        );
    }
}
