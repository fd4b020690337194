//! The client's IP address as a key: the TCP peer's, or the one a trusted proxy's header
//! gives, grouped by prefix.

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use forwarded_header_value::ForwardedStanza;
use http::request::Parts;
use http::{HeaderMap, HeaderName};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{KeyError, KeyExtractor, Misconfiguration, NoKey, peer_ip};
use crate::error::ConfigError;

/// Where a [`ClientIpKey`] reads the client's address when the request comes from a trusted
/// proxy. From any other peer it takes the peer's own address, whatever the source.
///
/// The headers of one address are read by the [`client-ip`](https://docs.rs/client-ip)
/// crate, which refuses one that comes twice (the client's and the proxy's) rather than
/// guess, CloudFront's aside. A list (`X-Forwarded-For`, `Forwarded`) is walked from the
/// right, over every field line of the header, last first, as one comma-separated list
/// (RFC 9110, section 5.3). Never the left-most entry: a proxy appends to what the client
/// sent, so any client can write the left of the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClientIpSource {
    /// The TCP peer (axum's `ConnectInfo<SocketAddr>`); no header is read. For a service
    /// that clients reach directly.
    Peer,
    /// `X-Forwarded-For`, a de facto standard (MDN, "X-Forwarded-For"): each proxy appends
    /// the address it received the request from. The entries are read from the right,
    /// skipping those inside the trusted proxies' ranges; the first other one is the
    /// client's. Entries may carry a port (`192.0.2.7:4711`, `[2001:db8::7]:4711`).
    RightmostXForwardedFor,
    /// `Forwarded` (RFC 7239), read as `X-Forwarded-For` is, by the `for` parameter of each
    /// element (section 5.2), each element parsed by the `forwarded-header-value` crate. An
    /// element without `for`, with `for=unknown` or with an obfuscated identifier
    /// (`for=_hidden`, section 6) where the walk needs an address makes the key invalid.
    RightmostForwarded,
    /// `X-Real-IP`, one address, as nginx's `proxy_set_header X-Real-IP $remote_addr` sets it.
    XRealIp,
    /// `CF-Connecting-IP`, one address (Cloudflare).
    CfConnectingIp,
    /// `True-Client-IP`, one address (Akamai, Cloudflare Enterprise).
    TrueClientIp,
    /// `Fly-Client-IP`, one address (Fly.io).
    FlyClientIp,
    /// `CloudFront-Viewer-Address`, the address and port (Amazon CloudFront).
    CloudFrontViewerAddress,
    /// `X-Envoy-External-Address`, one address (Envoy).
    XEnvoyExternalAddress,
}

impl ClientIpSource {
    /// The header read, `None` for the peer.
    fn header(self) -> Option<HeaderName> {
        let name = match self {
            Self::Peer => return None,
            Self::RightmostXForwardedFor => "x-forwarded-for",
            Self::RightmostForwarded => "forwarded",
            Self::XRealIp => "x-real-ip",
            Self::CfConnectingIp => "cf-connecting-ip",
            Self::TrueClientIp => "true-client-ip",
            Self::FlyClientIp => "fly-client-ip",
            Self::CloudFrontViewerAddress => "cloudfront-viewer-address",
            Self::XEnvoyExternalAddress => "x-envoy-external-address",
        };
        Some(HeaderName::from_static(name))
    }
}

/// The key is the client's IP address, grouped by prefix: the TCP peer's, or, when the
/// peer is one of the trusted proxies, the one their header gives ([`ClientIpSource`]).
///
/// - From a peer outside [`trusted_proxies`](Self::trusted_proxies) (none by default) the
///   key is the peer's address, and no header is read: a client reaching the service
///   directly cannot choose its key.
/// - From a trusted peer, the source's header: a list (`X-Forwarded-For`, `Forwarded`) is
///   read from the right, skipping the trusted proxies' own entries, so a forged left-most
///   entry changes nothing; when every entry is a trusted proxy's, the left-most (the hop
///   farthest away, itself trusted) is the client.
/// - A trusted peer's request without the header has no key: 400, or unguarded with
///   [`optional`](crate::RateLimitLayer::optional). A header without an address where
///   one is needed ([`KeyError::UnreadableClientIp`]) is a 400 either way.
/// - Without a peer address (served without `ConnectInfo`) the layer answers **500** and
///   logs the fix once ([`NoKey::Misconfigured`]).
///
/// The value is the network the address falls in, `{address}/{length}`: each IPv4 address
/// alone by default (`203.0.113.7/32`), IPv6 ones by /64 (`2001:db8:7:1::/64`), since one
/// host is usually given a whole /64 and could rotate through it. IPv4-mapped IPv6
/// addresses count as IPv4. The scope is `"client-ip"`. Any keyed layer takes it
/// (`LockLayer::new`, `RateLimitLayer::new`, `ConcurrencyLimitLayer::new`).
///
/// ```
/// # #[cfg(all(feature = "lock", feature = "rate-limit", feature = "concurrency-limit"))] {
/// use tower_redlock::key::{ClientIpKey, ClientIpSource};
/// use tower_redlock::{ConcurrencyLimitLayer, LockLayer, RateLimitLayer};
///
/// // Behind load balancers in 10.0.0.0/8 that append to X-Forwarded-For.
/// let client = ClientIpKey::new(ClientIpSource::RightmostXForwardedFor)
///     .trusted_proxies(["10.0.0.0/8", "2001:db8:ffff::/48"])?
///     .ipv6_prefix(56)?;
/// let rate = RateLimitLayer::by_client_ip(client.clone(), "100/60".parse()?);
/// let uploads = ConcurrencyLimitLayer::by_client_ip(client.clone(), 2);
/// let one_at_a_time = LockLayer::new(client);
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct ClientIpKey {
    source: ClientIpSource,
    trusted: Vec<IpNet>,
    ipv4_prefix: u8,
    ipv6_prefix: u8,
}

impl From<ClientIpSource> for ClientIpKey {
    fn from(source: ClientIpSource) -> Self {
        Self::new(source)
    }
}

impl ClientIpKey {
    /// Reads the client's address from `source` when the peer is a trusted proxy; no proxy
    /// is trusted until [`trusted_proxies`](Self::trusted_proxies) says which. IPv4
    /// addresses are grouped by /32, IPv6 by /64.
    pub fn new(source: ClientIpSource) -> Self {
        Self {
            source,
            trusted: Vec::new(),
            ipv4_prefix: 32,
            ipv6_prefix: 64,
        }
    }

    /// The proxies whose header is believed: each an address range in CIDR notation
    /// (`10.0.0.0/8`, `2001:db8::/32`) or one address (`192.0.2.10`), IPv4 or IPv6; host
    /// bits are ignored (`10.1.2.3/8` is `10.0.0.0/8`), and an IPv4-mapped IPv6 range
    /// counts as IPv4. Replaces any list given before; an empty list trusts no one. List
    /// the proxies only: a trusted host that calls the service without the header gets 400.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidProxyRange`] for the first entry that is neither.
    pub fn trusted_proxies<I>(mut self, ranges: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        self.trusted = ranges
            .into_iter()
            .map(|range| parse_range(range.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(self)
    }

    /// The prefix length, in bits, that IPv4 clients are grouped by: one key per
    /// network of that length. Default 32: each address alone.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPrefixLength`] above 32.
    pub fn ipv4_prefix(mut self, len: u8) -> Result<Self, ConfigError> {
        self.ipv4_prefix = checked_prefix("IPv4", len, 32)?;
        Ok(self)
    }

    /// The prefix length, in bits, that IPv6 clients are grouped by: one key per network
    /// of that length. Default 64, the usual assignment to one host or link (RFC 6177);
    /// 56 or 48 group a site's whole delegation.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPrefixLength`] above 128.
    pub fn ipv6_prefix(mut self, len: u8) -> Result<Self, ConfigError> {
        self.ipv6_prefix = checked_prefix("IPv6", len, 128)?;
        Ok(self)
    }

    /// Where the address is read.
    pub fn source(&self) -> ClientIpSource {
        self.source
    }

    /// The client's address in this request as the key reads it, before grouping; `Ok(None)`
    /// without a peer address, or from a trusted proxy without the header.
    ///
    /// # Errors
    ///
    /// [`KeyError::UnreadableClientIp`] when a trusted proxy's header has no address where
    /// one is needed.
    pub fn client_ip(&self, parts: &Parts) -> Result<Option<IpAddr>, KeyError> {
        let Some(peer) = peer_ip(parts) else {
            return Ok(None);
        };
        let Some(name) = self.source.header() else {
            return Ok(Some(peer));
        };
        if !self.trusts(peer) {
            return Ok(Some(peer));
        }
        let headers = &parts.headers;
        let found = match self.source {
            ClientIpSource::RightmostXForwardedFor => self.walk(headers, &name, list_entry),
            ClientIpSource::RightmostForwarded => self.walk(headers, &name, forwarded_for),
            _ => single(self.source, headers),
        };
        found
            .map(|ip| ip.map(|ip| ip.to_canonical()))
            .map_err(|()| KeyError::UnreadableClientIp(name))
    }

    /// The 400 detail for a request without the key, as a `by_client_ip` layer gives it.
    #[cfg(any(feature = "rate-limit", feature = "concurrency-limit"))]
    pub(crate) fn missing_detail(&self) -> Cow<'static, str> {
        match self.source.header() {
            Some(name) => Cow::Owned(format!(
                "The request came through a trusted proxy without the {name} header that gives \
                 the client's IP address."
            )),
            None => Cow::Borrowed("The request carries no client IP address."),
        }
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|range| range.contains(&ip))
    }

    /// The first address from the right of the list in the header `name` that no trusted
    /// proxy holds; the left-most when all are trusted; `Ok(None)` for an empty list. Only
    /// the entries up to it are parsed, so what a client wrote further left never counts.
    fn walk(
        &self,
        headers: &HeaderMap,
        name: &HeaderName,
        parse: fn(&str) -> Option<IpAddr>,
    ) -> Result<Option<IpAddr>, ()> {
        let mut farthest = None;
        for line in headers.get_all(name).iter().rev() {
            // Split as bytes: what stands left of the entries read is never looked at, even
            // bytes that are not text.
            for entry in line.as_bytes().rsplit(|&byte| byte == b',') {
                let entry = std::str::from_utf8(entry).map_err(|_| ())?.trim();
                if entry.is_empty() {
                    continue;
                }
                let ip = parse(entry).ok_or(())?.to_canonical();
                if !self.trusts(ip) {
                    return Ok(Some(ip));
                }
                farthest = Some(ip);
            }
        }
        Ok(farthest)
    }

    /// The network that `ip` falls in, at this key's prefix length for its family.
    fn group(&self, ip: IpAddr) -> IpNet {
        let grouped = match ip {
            IpAddr::V4(v4) => Ipv4Net::new(v4, self.ipv4_prefix).map(|net| net.trunc().into()),
            IpAddr::V6(v6) => Ipv6Net::new(v6, self.ipv6_prefix).map(|net| net.trunc().into()),
        };
        // The lengths were checked when set; the address alone otherwise.
        grouped.unwrap_or_else(|_| IpNet::from(ip))
    }
}

/// One `X-Forwarded-For` entry: an address, or an address and port.
fn list_entry(entry: &str) -> Option<IpAddr> {
    IpAddr::from_str(entry)
        .or_else(|_| SocketAddr::from_str(entry).map(|addr| addr.ip()))
        .ok()
}

/// The address of one `Forwarded` element's `for` parameter (RFC 7239, section 5.2).
fn forwarded_for(element: &str) -> Option<IpAddr> {
    ForwardedStanza::from_str(element).ok()?.forwarded_for_ip()
}

/// A header of one address, read by the `client-ip` crate: `Ok(None)` when absent.
fn single(source: ClientIpSource, headers: &HeaderMap) -> Result<Option<IpAddr>, ()> {
    let read = match source {
        ClientIpSource::XRealIp => ::client_ip::x_real_ip,
        ClientIpSource::CfConnectingIp => ::client_ip::cf_connecting_ip,
        ClientIpSource::TrueClientIp => ::client_ip::true_client_ip,
        ClientIpSource::FlyClientIp => ::client_ip::fly_client_ip,
        ClientIpSource::CloudFrontViewerAddress => ::client_ip::cloudfront_viewer_address,
        ClientIpSource::XEnvoyExternalAddress => ::client_ip::x_envoy_external_address,
        // Read by `ClientIpKey::client_ip` itself.
        ClientIpSource::Peer
        | ClientIpSource::RightmostXForwardedFor
        | ClientIpSource::RightmostForwarded => return Err(()),
    };
    match read(headers) {
        Ok(ip) => Ok(Some(ip)),
        Err(::client_ip::Error::AbsentHeader { .. }) => Ok(None),
        Err(_) => Err(()),
    }
}

/// A trusted proxy range: CIDR or one address, host bits cleared, IPv4-mapped as IPv4.
fn parse_range(text: &str) -> Result<IpNet, ConfigError> {
    let trimmed = text.trim();
    let net = IpNet::from_str(trimmed)
        .or_else(|_| IpAddr::from_str(trimmed).map(IpNet::from))
        .map_err(|_| ConfigError::InvalidProxyRange(text.to_owned()))?
        .trunc();
    if let IpNet::V6(v6) = net {
        if let (Some(v4), Some(len)) = (
            v6.network().to_ipv4_mapped(),
            v6.prefix_len().checked_sub(96),
        ) {
            if let Ok(v4) = Ipv4Net::new(v4, len) {
                return Ok(IpNet::V4(v4));
            }
        }
    }
    Ok(net)
}

fn checked_prefix(family: &'static str, len: u8, max: u8) -> Result<u8, ConfigError> {
    if len > max {
        return Err(ConfigError::InvalidPrefixLength { family, len, max });
    }
    Ok(len)
}

impl KeyExtractor for ClientIpKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        let ip = self.client_ip(parts)?;
        Ok(ip.map(|ip| Cow::Owned(self.group(ip).to_string())))
    }

    // An address and a prefix length: never empty, at most 43 bytes, no control character,
    // nothing to escape.
    #[cfg(any(
        feature = "lock",
        feature = "rate-limit",
        feature = "concurrency-limit"
    ))]
    fn write_value(&self, parts: &mut Parts, out: &mut String) -> Result<bool, KeyError> {
        let Some(ip) = self.client_ip(parts)? else {
            return Ok(false);
        };
        use std::fmt::Write as _;
        let _ = write!(out, "{}", self.group(ip));
        Ok(true)
    }

    fn no_key(&self, parts: &mut Parts) -> NoKey {
        if peer_ip(parts).is_some() {
            return NoKey::Missing;
        }
        NoKey::Misconfigured(Misconfiguration::new(
            "no peer address in the request extensions: serve with \
             into_make_service_with_connect_info::<SocketAddr>() (or put a SocketAddr in the \
             extensions) to key on the client IP (ClientIpKey)",
        ))
    }

    fn write_scope(&self, _parts: &Parts, out: &mut String) {
        out.push_str("client-ip");
    }
}

#[cfg(test)]
mod tests;
