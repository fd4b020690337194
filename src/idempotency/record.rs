//! The stored result of a request, and its versioned byte format.
//!
//! A record is stored as one Redis string (or one in-process entry), in this layout
//! (version 1; all integers big-endian):
//!
//! | bytes | content |
//! | --- | --- |
//! | 4 | the magic and version, `TRI1` |
//! | 1 | the kind: `1` a response, `3` a response with trailers (gRPC), `2` a result that cannot be replayed |
//! | 32 | the request's fingerprint (SHA-256 by default) |
//! | 2 | kinds 1 and 3: the status code |
//! | 2 | kinds 1 and 3: the number of headers, then for each: a 2-byte name length, the name, a 2-byte value length, the value |
//! | 2 | kind 3 only: the trailers, as the headers |
//! | rest | kinds 1 and 3: the body |
//!
//! A value that does not parse (another version, another program's data) is never
//! overwritten: the layer answers 500 and logs it.
//!
//! Records live beside the lock: in process, in [`MemoryLocks`](crate::MemoryLocks); on
//! Redis, as `<prefix>{<lock key>}:record` on every node. A first request checks for a
//! record and acquires in one script per node, then stores and releases in one, on a
//! quorum. A retry takes the record if any node of a quorum has it: read and write quorums
//! always meet.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// The magic and version at the start of every record (the Redis scripts check it before
/// they overwrite a record).
pub(crate) const MAGIC: &str = "TRI1";
const KIND_RESPONSE: u8 = 1;
const KIND_UNREPLAYABLE: u8 = 2;
const KIND_RESPONSE_WITH_TRAILERS: u8 = 3;

/// A request's fingerprint: 32 bytes, by default the SHA-256 of its method, route, path and
/// query, and body.
pub type Fingerprint = [u8; 32];

/// What a completed first request left for its retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    /// The response to replay.
    Response {
        fingerprint: Fingerprint,
        status: StatusCode,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
        /// After the body: a gRPC response's status.
        trailers: Vec<(HeaderName, HeaderValue)>,
    },
    /// The request ran, but its response could not be kept (over the cap, or not ended
    /// within the lease): retries get a problem, never a second run.
    Unreplayable { fingerprint: Fingerprint },
}

impl Record {
    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::Response { fingerprint, .. } | Record::Unreplayable { fingerprint } => {
                fingerprint
            }
        }
    }

    /// The record in its stored form; `None` when a header name or value is over 65,535
    /// bytes (such a response is not stored).
    pub(crate) fn encode(&self) -> Option<Bytes> {
        match self {
            Record::Unreplayable { fingerprint } => {
                let mut out = BytesMut::with_capacity(MAGIC.len() + 1 + fingerprint.len());
                out.put_slice(MAGIC.as_bytes());
                out.put_u8(KIND_UNREPLAYABLE);
                out.put_slice(fingerprint);
                Some(out.freeze())
            }
            Record::Response {
                fingerprint,
                status,
                headers,
                body,
                trailers,
            } => {
                let field_bytes: usize = headers
                    .iter()
                    .chain(trailers)
                    .map(|(n, v)| 4 + n.as_str().len() + v.len())
                    .sum();
                let mut out = BytesMut::with_capacity(
                    MAGIC.len() + 1 + fingerprint.len() + 6 + field_bytes + body.len(),
                );
                out.put_slice(MAGIC.as_bytes());
                out.put_u8(if trailers.is_empty() {
                    KIND_RESPONSE
                } else {
                    KIND_RESPONSE_WITH_TRAILERS
                });
                out.put_slice(fingerprint);
                out.put_u16(status.as_u16());
                put_fields(&mut out, headers)?;
                if !trailers.is_empty() {
                    put_fields(&mut out, trailers)?;
                }
                out.put_slice(body);
                Some(out.freeze())
            }
        }
    }

    /// Parses a stored record; `None` when it is not one of this format.
    pub(crate) fn decode(raw: &[u8]) -> Option<Record> {
        let mut reader = Reader(raw);
        if reader.take(MAGIC.len())? != MAGIC.as_bytes() {
            return None;
        }
        let kind = reader.u8()?;
        let fingerprint: Fingerprint = reader.take(32)?.try_into().ok()?;
        match kind {
            KIND_UNREPLAYABLE if reader.0.is_empty() => Some(Record::Unreplayable { fingerprint }),
            KIND_RESPONSE | KIND_RESPONSE_WITH_TRAILERS => {
                let status = StatusCode::from_u16(reader.u16()?).ok()?;
                let headers = reader.fields()?;
                let trailers = if kind == KIND_RESPONSE_WITH_TRAILERS {
                    reader.fields()?
                } else {
                    Vec::new()
                };
                Some(Record::Response {
                    fingerprint,
                    status,
                    headers,
                    body: Bytes::copy_from_slice(reader.0),
                    trailers,
                })
            }
            _ => None,
        }
    }
}

/// Writes a count of fields, then each: a 2-byte name length, the name, a 2-byte value
/// length, the value. `None` when a count or a length is over 65,535.
fn put_fields(out: &mut BytesMut, fields: &[(HeaderName, HeaderValue)]) -> Option<()> {
    out.put_u16(u16::try_from(fields.len()).ok()?);
    for (name, value) in fields {
        out.put_u16(u16::try_from(name.as_str().len()).ok()?);
        out.put_slice(name.as_str().as_bytes());
        out.put_u16(u16::try_from(value.len()).ok()?);
        out.put_slice(value.as_bytes());
    }
    Some(())
}

/// The headers of `headers` named in `keep`, in order, each value of a repeated one.
pub(crate) fn kept_headers(
    headers: &HeaderMap,
    keep: &[HeaderName],
) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| keep.contains(name))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1)?.first().copied()
    }

    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes(b.try_into().ok()?))
    }

    /// Fields as [`put_fields`] writes them.
    fn fields(&mut self) -> Option<Vec<(HeaderName, HeaderValue)>> {
        let count = self.u16()?;
        let mut fields = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = usize::from(self.u16()?);
            let name = HeaderName::from_bytes(self.take(len)?).ok()?;
            let len = usize::from(self.u16()?);
            let value = HeaderValue::from_bytes(self.take(len)?).ok()?;
            fields.push((name, value));
        }
        Some(fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(name: &'static str, value: &'static str) -> (HeaderName, HeaderValue) {
        (
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        )
    }

    fn response() -> Record {
        Record::Response {
            fingerprint: [7; 32],
            status: StatusCode::CREATED,
            headers: vec![
                field("content-type", "application/json"),
                field("location", "/orders/1"),
            ],
            body: Bytes::from_static(b"{\"order_id\":\"1\"}"),
            trailers: Vec::new(),
        }
    }

    /// A unary gRPC response: a length-prefixed message, then its status in trailers.
    fn grpc_response() -> Record {
        Record::Response {
            fingerprint: [8; 32],
            status: StatusCode::OK,
            headers: vec![field("content-type", "application/grpc")],
            body: Bytes::from_static(b"\0\0\0\0\x02\x08\x01"),
            trailers: vec![field("grpc-status", "0"), field("grpc-message", "")],
        }
    }

    #[test]
    fn records_round_trip() {
        let fingerprint = [9; 32];
        for record in [
            response(),
            grpc_response(),
            Record::Unreplayable { fingerprint },
        ] {
            let raw = record.encode().unwrap();
            assert_eq!(Record::decode(&raw), Some(record));
        }
    }

    #[test]
    fn the_format_starts_with_its_version() {
        let raw = response().encode().unwrap();
        assert_eq!(&raw[..4], b"TRI1");
        assert_eq!(raw[4], 1);
        assert_eq!(grpc_response().encode().unwrap()[4], 3);
        assert_eq!(&raw[5..37], &[7; 32]);
        assert_eq!(&raw[37..39], &201u16.to_be_bytes());
    }

    #[test]
    fn foreign_and_truncated_values_do_not_parse() {
        assert_eq!(Record::decode(b""), None);
        assert_eq!(Record::decode(b"0123456789abcdef0123456789abcdef"), None);
        assert_eq!(Record::decode(b"TRI2\x01"), None);
        let raw = response().encode().unwrap();
        for cut in 0..39 {
            assert_eq!(Record::decode(&raw[..cut]), None, "cut at {cut}");
        }
        let fingerprint = [1; 32];
        let mut trailing = Record::Unreplayable { fingerprint }
            .encode()
            .unwrap()
            .to_vec();
        trailing.push(0);
        assert_eq!(Record::decode(&trailing), None);
    }

    #[test]
    fn kept_headers_follow_the_response_and_keep_repeats() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            field("content-type", "text/plain"),
            field("set-cookie", "a=1"),
            field("link", "</a>"),
            field("link", "</b>"),
        ] {
            headers.append(name, value);
        }
        let kept = kept_headers(&headers, &[http::header::LINK, http::header::CONTENT_TYPE]);
        let names: Vec<_> = kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "link", "link"]);
        let values: Vec<_> = kept.iter().map(|(_, v)| v.to_str().unwrap()).collect();
        assert_eq!(values, ["text/plain", "</a>", "</b>"]);
    }
}
