//! Key extractors for rate limits: the peer IP, one global key, a header else the peer IP.

use std::net::IpAddr;

use http::HeaderName;
use http::request::Parts;

use std::borrow::Cow;

use crate::key::{
    HeaderKey, KeyError, KeyExtractor, MAX_KEY_LEN, Misconfiguration, NoKey, push_escaped,
    validate_value,
};

/// The peer's IP address, from axum's `ConnectInfo<SocketAddr>` (serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), else from a plain `SocketAddr`
/// extension. The scope is `"ip"`; IPv4-mapped IPv6 addresses count as IPv4.
///
/// This is the TCP peer: behind a proxy every client shares the proxy's limit. Do **not**
/// key on `X-Forwarded-For` or `Forwarded` as sent (any client can write any address):
/// behind proxies you trust, use [`ClientIpKey`](crate::key::ClientIpKey)
/// ([`RateLimitLayer::by_client_ip`](crate::RateLimitLayer::by_client_ip)), which reads
/// the entry they added, and groups IPv6 clients by /64 (one usually controls a whole /64).
///
/// Without a peer address the layer answers **500** and logs the fix once
/// ([`NoKey::Misconfigured`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerIpKey;

impl PeerIpKey {
    /// The peer's address of this request, if the server recorded it.
    pub fn peer_ip(parts: &Parts) -> Option<IpAddr> {
        crate::key::peer_ip(parts)
    }
}

impl KeyExtractor for PeerIpKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        Ok(Self::peer_ip(parts).map(|ip| Cow::Owned(ip.to_string())))
    }

    fn write_value(&self, parts: &mut Parts, out: &mut String) -> Result<bool, KeyError> {
        let Some(ip) = Self::peer_ip(parts) else {
            return Ok(false);
        };
        push_ip(out, ip);
        Ok(true)
    }

    fn no_key(&self, _parts: &mut Parts) -> NoKey {
        no_peer_address()
    }

    fn write_scope(&self, _parts: &Parts, out: &mut String) {
        out.push_str("ip");
    }
}

/// A header's value (a client id or API key) when present, else the peer IP ([`PeerIpKey`]).
///
/// The key is `client:id:{header value}` or `client:ip:{address}`, so a client cannot
/// spend another's IP budget by sending that address as its id. The header value may be a
/// bare token or an RFC 8941 string, as for [`HeaderKey`], of at most
/// [`MAX_KEY_LEN`]` - 3` bytes. Unless the header is checked (an API key verified by an
/// earlier layer), a client that changes it per request gets a fresh limit each time.
#[derive(Debug, Clone)]
pub struct HeaderOrPeerIp {
    header: HeaderKey,
}

impl HeaderOrPeerIp {
    /// Reads the header `name`, else the peer IP.
    pub fn new(name: HeaderName) -> Self {
        Self {
            header: HeaderKey::new(name),
        }
    }

    /// The header read.
    pub fn name(&self) -> &HeaderName {
        self.header.name()
    }
}

fn no_peer_address() -> NoKey {
    NoKey::Misconfigured(Misconfiguration::new(
        "no peer address in the request extensions: serve with \
         into_make_service_with_connect_info::<SocketAddr>() (or put a SocketAddr in the \
         extensions) to key on the peer IP",
    ))
}

/// Checks a client id from the header: a key value that still fits once tagged.
fn check_id(value: &str) -> Result<(), KeyError> {
    validate_value(value)?;
    let max = MAX_KEY_LEN - ID_TAG.len();
    if value.len() > max {
        return Err(KeyError::TooLong {
            len: value.len(),
            max,
        });
    }
    Ok(())
}

/// Appends `ip` as `Display` does; IPv4 without the formatting machinery (per request).
fn push_ip(out: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            out.reserve(15);
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        IpAddr::V6(v6) => {
            use std::fmt::Write;
            let _ = write!(out, "{v6}");
        }
    }
}

const ID_TAG: &str = "id:";
const IP_TAG: &str = "ip:";

impl KeyExtractor for HeaderOrPeerIp {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        if let Some(value) = self.header.extract(parts)? {
            check_id(&value)?;
            return Ok(Some(Cow::Owned(format!("{ID_TAG}{value}"))));
        }
        Ok(PeerIpKey::peer_ip(parts).map(|ip| Cow::Owned(format!("{IP_TAG}{ip}"))))
    }

    fn write_value(&self, parts: &mut Parts, out: &mut String) -> Result<bool, KeyError> {
        if let Some(value) = self.header.extract(parts)? {
            check_id(&value)?;
            out.push_str(ID_TAG);
            push_escaped(out, &value);
            return Ok(true);
        }
        let Some(ip) = PeerIpKey::peer_ip(parts) else {
            return Ok(false);
        };
        out.push_str(IP_TAG);
        push_ip(out, ip);
        Ok(true)
    }

    fn no_key(&self, _parts: &mut Parts) -> NoKey {
        no_peer_address()
    }

    fn write_scope(&self, _parts: &Parts, out: &mut String) {
        out.push_str("client");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::GlobalKey;
    use std::net::SocketAddr;

    fn parts(header: Option<&str>, peer: Option<SocketAddr>) -> Parts {
        let mut builder = http::Request::builder().uri("/items/1/buy");
        if let Some(value) = header {
            builder = builder.header("x-client-id", value);
        }
        let mut parts = builder.body(()).unwrap().into_parts().0;
        if let Some(peer) = peer {
            #[cfg(feature = "axum")]
            parts.extensions.insert(axum::extract::ConnectInfo(peer));
            #[cfg(not(feature = "axum"))]
            parts.extensions.insert(peer);
        }
        parts
    }

    fn peer(ip: &str) -> Option<SocketAddr> {
        Some(SocketAddr::new(ip.parse().unwrap(), 40000))
    }

    /// The extracted value, unwrapped from its `Ok`.
    fn value(key: &impl KeyExtractor, mut parts: Parts) -> Option<String> {
        key.extract(&mut parts).unwrap().map(Cow::into_owned)
    }

    /// Whether a value was written, and what.
    fn written(key: &impl KeyExtractor, mut parts: Parts) -> (bool, String) {
        let mut out = String::new();
        (key.write_value(&mut parts, &mut out).unwrap(), out)
    }

    fn client_id() -> HeaderOrPeerIp {
        HeaderOrPeerIp::new(HeaderName::from_static("x-client-id"))
    }

    #[test]
    fn peer_ip_reads_connect_info_and_canonicalizes() {
        let ip = |peer| value(&PeerIpKey, parts(None, peer));
        assert_eq!(ip(peer("203.0.113.7")).as_deref(), Some("203.0.113.7"));
        assert_eq!(
            ip(peer("::ffff:203.0.113.7")).as_deref(),
            Some("203.0.113.7")
        );
        assert_eq!(ip(None), None);
    }

    #[test]
    fn peer_ip_reads_a_plain_socket_addr() {
        let mut p = parts(None, None);
        p.extensions.insert(SocketAddr::from(([192, 0, 2, 1], 1)));
        assert_eq!(value(&PeerIpKey, p).as_deref(), Some("192.0.2.1"));
    }

    #[test]
    fn header_or_peer_ip_prefers_the_header_and_tags_values() {
        let key = client_id();
        let v = |header, ip| value(&key, parts(header, peer(ip)));
        assert_eq!(v(Some("abc"), "203.0.113.7").as_deref(), Some("id:abc"));
        assert_eq!(v(None, "203.0.113.7").as_deref(), Some("ip:203.0.113.7"));
        // An id that looks like an address does not share the address's budget.
        let spoof = v(Some("203.0.113.7"), "198.51.100.1");
        assert_eq!(spoof.as_deref(), Some("id:203.0.113.7"));
        assert_eq!(value(&key, parts(None, None)), None);
        let mut scope = String::new();
        key.write_scope(&parts(None, peer("203.0.113.7")), &mut scope);
        assert_eq!(scope, "client");
    }

    #[test]
    fn written_values_are_the_extracted_ones() {
        let header = client_id();
        fn agree(key: &impl KeyExtractor, ip: &str) {
            let extracted = value(key, parts(None, peer(ip))).unwrap();
            assert_eq!(
                written(key, parts(None, peer(ip))),
                (true, extracted),
                "{ip}"
            );
        }
        for ip in [
            "203.0.113.7",
            "0.0.0.0",
            "10.20.100.255",
            "9.99.199.250",
            "2001:db8::1",
            "::ffff:192.0.2.9",
        ] {
            agree(&PeerIpKey, ip);
            agree(&header, ip);
        }
        assert_eq!(
            written(&PeerIpKey, parts(None, None)),
            (false, String::new())
        );
        let escaped = written(&header, parts(Some("a{b}"), None));
        assert_eq!(escaped, (true, "id:a%7Bb%7D".to_owned()));
    }

    #[test]
    fn header_or_peer_ip_rejects_bad_headers_instead_of_falling_back() {
        let key = client_id();
        let extract = |header: &str| {
            let mut parts = parts(Some(header), peer("203.0.113.7"));
            key.extract(&mut parts).map(|v| v.map(Cow::into_owned))
        };
        assert_eq!(extract(""), Err(KeyError::Empty));
        let too_long = KeyError::TooLong {
            len: MAX_KEY_LEN - 2,
            max: MAX_KEY_LEN - 3,
        };
        assert_eq!(extract(&"a".repeat(MAX_KEY_LEN - 2)), Err(too_long));
        let longest = "a".repeat(MAX_KEY_LEN - 3);
        let value = value(&key, parts(Some(&longest), None)).unwrap();
        assert!(validate_value(&value).is_ok());
    }

    #[test]
    fn global_key_is_one_key() {
        assert_eq!(value(&GlobalKey, parts(None, None)).as_deref(), Some("all"));
        let mut scope = String::new();
        GlobalKey.write_scope(&parts(None, None), &mut scope);
        assert_eq!(scope, "global");
    }
}
