use super::*;
use crate::key::validate_value;

const PROXY: &str = "10.0.0.1";

/// A request from `peer` (none: no peer address) with `headers`.
fn parts(peer: Option<&str>, headers: &[(&str, &str)]) -> Parts {
    let mut builder = http::Request::builder().uri("/items/1/buy");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let mut parts = builder.body(()).unwrap().into_parts().0;
    if let Some(peer) = peer {
        let addr = SocketAddr::new(peer.parse().unwrap(), 40000);
        #[cfg(feature = "axum")]
        parts.extensions.insert(axum::extract::ConnectInfo(addr));
        #[cfg(not(feature = "axum"))]
        parts.extensions.insert(addr);
    }
    parts
}

fn behind_proxies(source: ClientIpSource) -> ClientIpKey {
    ClientIpKey::new(source)
        .trusted_proxies(["10.0.0.0/8", "fd00::/8"])
        .unwrap()
}

/// The key value for a request from the proxy with one header.
fn value(key: &ClientIpKey, name: &str, header: &str) -> Result<Option<String>, KeyError> {
    let mut p = parts(Some(PROXY), &[(name, header)]);
    key.extract(&mut p).map(|v| v.map(Cow::into_owned))
}

fn xff(header: &str) -> Option<String> {
    let key = behind_proxies(ClientIpSource::RightmostXForwardedFor);
    value(&key, "x-forwarded-for", header).unwrap()
}

#[test]
fn xff_is_read_from_the_right_and_the_left_most_entry_never_counts() {
    assert_eq!(xff("203.0.113.7").as_deref(), Some("203.0.113.7/32"));
    // What the client wrote on the left, forged or garbage, is never read.
    assert_eq!(
        xff("198.51.100.1, 203.0.113.7").as_deref(),
        Some("203.0.113.7/32")
    );
    assert_eq!(
        xff("not an address,, 203.0.113.7").as_deref(),
        Some("203.0.113.7/32")
    );
    let key = behind_proxies(ClientIpSource::RightmostXForwardedFor);
    let mut p = parts(Some(PROXY), &[]);
    let value = http::HeaderValue::from_bytes(b"\xff\xfe, 203.0.113.7").unwrap();
    p.headers.insert("x-forwarded-for", value);
    assert_eq!(key.extract(&mut p).unwrap().unwrap(), "203.0.113.7/32");
    // Trusted hops are skipped; ports are dropped.
    assert_eq!(
        xff("198.51.100.1, 203.0.113.7:4711, 10.0.0.2, 10.9.9.9").as_deref(),
        Some("203.0.113.7/32")
    );
    // Every entry trusted: the farthest hop.
    assert_eq!(xff("10.1.1.1, 10.0.0.2").as_deref(), Some("10.1.1.1/32"));
}

#[test]
fn xff_field_lines_are_one_list_last_line_last() {
    let key = behind_proxies(ClientIpSource::RightmostXForwardedFor);
    let p = parts(
        Some(PROXY),
        &[
            ("x-forwarded-for", "198.51.100.1"),
            ("x-forwarded-for", "203.0.113.7, 10.0.0.2"),
        ],
    );
    assert_eq!(
        key.client_ip(&p).unwrap(),
        Some("203.0.113.7".parse().unwrap())
    );
    let p = parts(
        Some(PROXY),
        &[
            ("x-forwarded-for", "203.0.113.7"),
            ("x-forwarded-for", "10.0.0.2"),
        ],
    );
    assert_eq!(
        key.client_ip(&p).unwrap(),
        Some("203.0.113.7".parse().unwrap())
    );
}

#[test]
fn an_unreadable_entry_where_the_client_should_be_is_invalid_and_an_absent_header_missing() {
    let key = behind_proxies(ClientIpSource::RightmostXForwardedFor);
    let unreadable = Err(KeyError::UnreadableClientIp(HeaderName::from_static(
        "x-forwarded-for",
    )));
    assert_eq!(
        value(&key, "x-forwarded-for", "203.0.113.7, bogus"),
        unreadable
    );
    assert_eq!(
        value(&key, "x-forwarded-for", "bogus, 10.0.0.2"),
        unreadable
    );
    let mut p = parts(Some(PROXY), &[]);
    assert_eq!(key.extract(&mut p), Ok(None));
    assert_eq!(key.no_key(&mut p), NoKey::Missing);
}

#[test]
fn an_untrusted_peer_is_keyed_by_its_own_address_whatever_it_sends() {
    let key = behind_proxies(ClientIpSource::RightmostXForwardedFor);
    let mut p = parts(Some("198.51.100.9"), &[("x-forwarded-for", "203.0.113.7")]);
    assert_eq!(key.extract(&mut p).unwrap().unwrap(), "198.51.100.9/32");
    // Not even read: garbage is no error.
    let mut p = parts(Some("198.51.100.9"), &[("x-forwarded-for", "bogus")]);
    assert_eq!(key.extract(&mut p).unwrap().unwrap(), "198.51.100.9/32");
    // No proxy is trusted by default.
    let key = ClientIpKey::new(ClientIpSource::XRealIp);
    let mut p = parts(Some(PROXY), &[("x-real-ip", "203.0.113.7")]);
    assert_eq!(key.extract(&mut p).unwrap().unwrap(), "10.0.0.1/32");
}

#[test]
fn forwarded_elements_are_read_from_the_right_by_their_for_parameter() {
    let key = behind_proxies(ClientIpSource::RightmostForwarded);
    let forwarded = |header| value(&key, "forwarded", header);
    assert_eq!(
        forwarded(r#"for=198.51.100.1, for="[2001:db8:7:1::9]:4711";proto=https"#),
        Ok(Some("2001:db8:7:1::/64".to_owned()))
    );
    assert_eq!(
        forwarded("for=garbage-from-the-client, for=203.0.113.7;by=10.0.0.1, for=10.0.0.2"),
        Ok(Some("203.0.113.7/32".to_owned()))
    );
    let unreadable = Err(KeyError::UnreadableClientIp(HeaderName::from_static(
        "forwarded",
    )));
    for header in [
        "for=unknown",
        "for=_hidden",
        "proto=https",
        "for=203.0.113.7;x",
    ] {
        assert_eq!(forwarded(header), unreadable, "{header}");
    }
}

#[test]
fn single_address_headers_are_read_by_client_ip_and_must_appear_once() {
    let key = behind_proxies(ClientIpSource::CfConnectingIp);
    assert_eq!(
        value(&key, "cf-connecting-ip", "2001:db8::1"),
        Ok(Some("2001:db8::/64".to_owned()))
    );
    let mut twice = parts(
        Some(PROXY),
        &[
            ("cf-connecting-ip", "203.0.113.7"),
            ("cf-connecting-ip", "198.51.100.1"),
        ],
    );
    assert!(matches!(
        key.extract(&mut twice),
        Err(KeyError::UnreadableClientIp(_))
    ));
    let key = behind_proxies(ClientIpSource::CloudFrontViewerAddress);
    assert_eq!(
        value(&key, "cloudfront-viewer-address", "203.0.113.7:46532"),
        Ok(Some("203.0.113.7/32".to_owned()))
    );
    let key = behind_proxies(ClientIpSource::XRealIp);
    assert_eq!(value(&key, "x-forwarded-for", "203.0.113.7"), Ok(None));
}

#[test]
fn addresses_are_grouped_by_the_prefix_of_their_family() {
    let key = ClientIpKey::new(ClientIpSource::Peer);
    let of = |key: &ClientIpKey, peer| {
        let mut p = parts(Some(peer), &[]);
        key.extract(&mut p).unwrap().unwrap().into_owned()
    };
    assert_eq!(of(&key, "2001:db8:7:1:aaaa::1"), "2001:db8:7:1::/64");
    assert_eq!(of(&key, "2001:db8:7:1:ffff::2"), "2001:db8:7:1::/64");
    assert_eq!(of(&key, "2001:db8:7:2::1"), "2001:db8:7:2::/64");
    assert_eq!(of(&key, "::ffff:203.0.113.7"), "203.0.113.7/32");
    let wide = key.ipv4_prefix(24).unwrap().ipv6_prefix(48).unwrap();
    assert_eq!(of(&wide, "203.0.113.7"), "203.0.113.0/24");
    assert_eq!(of(&wide, "2001:db8:7:ff::1"), "2001:db8:7::/48");
    let mut scope = String::new();
    wide.write_scope(&parts(None, &[]), &mut scope);
    assert_eq!(scope, "client-ip");
}

#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
#[test]
fn written_values_are_the_extracted_ones() {
    let key = behind_proxies(ClientIpSource::RightmostXForwardedFor);
    for header in ["203.0.113.7", "2001:db8::1", "10.0.0.2", "bogus"] {
        let extracted = value(&key, "x-forwarded-for", header).map(|v| v.unwrap_or_default());
        let mut p = parts(Some(PROXY), &[("x-forwarded-for", header)]);
        let mut out = String::new();
        let written = key.write_value(&mut p, &mut out).map(|_| out);
        assert_eq!(written, extracted, "{header}");
    }
    let longest = ClientIpKey::new(ClientIpSource::Peer)
        .ipv6_prefix(128)
        .unwrap();
    let mut p = parts(Some("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe"), &[]);
    let value = longest.extract(&mut p).unwrap().unwrap();
    assert_eq!(value.len(), 43);
    assert_eq!(validate_value(&value), Ok(()));
}

#[test]
fn ranges_and_prefix_lengths_are_checked_when_built() {
    let key = ClientIpKey::new(ClientIpSource::XRealIp);
    for bad in [
        "10.0.0.0/33",
        "not-a-range",
        "",
        "10.0.0.0/",
        "2001:db8::/129",
    ] {
        match key.clone().trusted_proxies(["127.0.0.1", bad]) {
            Err(ConfigError::InvalidProxyRange(text)) => assert_eq!(text, bad),
            other => panic!("{bad}: {other:?}"),
        }
    }
    assert!(matches!(
        key.clone().ipv4_prefix(33),
        Err(ConfigError::InvalidPrefixLength {
            len: 33,
            max: 32,
            ..
        })
    ));
    assert!(matches!(
        key.clone().ipv6_prefix(129),
        Err(ConfigError::InvalidPrefixLength {
            len: 129,
            max: 128,
            ..
        })
    ));
    // One address, host bits, and IPv4-mapped ranges.
    let key = key
        .trusted_proxies(["192.0.2.10", " 10.1.2.3/8 ", "::ffff:172.16.0.0/108"])
        .unwrap();
    for trusted in ["192.0.2.10", "10.200.0.1", "172.16.9.9", "::ffff:10.0.0.1"] {
        assert!(
            key.trusts(trusted.parse::<IpAddr>().unwrap().to_canonical()),
            "{trusted}"
        );
    }
    for other in ["192.0.2.11", "11.0.0.1", "172.32.0.1"] {
        assert!(!key.trusts(other.parse().unwrap()), "{other}");
    }
}

#[test]
fn without_a_peer_address_the_server_is_misconfigured() {
    let key = behind_proxies(ClientIpSource::RightmostXForwardedFor);
    let mut p = parts(None, &[("x-forwarded-for", "203.0.113.7")]);
    assert_eq!(key.extract(&mut p), Ok(None));
    assert!(
        matches!(key.no_key(&mut p), NoKey::Misconfigured(m) if m.message().contains("connect_info"))
    );
}
