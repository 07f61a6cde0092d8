//! Content-encoded portal responses (`gzip`, `deflate`), decoded while they stream in.
//!
//! It exists because county portals compress large layers (often by 10× or more) and because a
//! compressed body is also the classic way to make a client allocate gigabytes from a few
//! kilobytes on the wire (a "gzip bomb"). Decoding is therefore incremental: every received
//! chunk is fed to the decoder at once, the decoded bytes are counted against
//! `[ingest] max_decompressed_bytes` as they are produced, and decoding stops with
//! [`DecodeError::TooLarge`] the moment the cap would be passed, so memory never holds more
//! than the cap (plus one decoder window). The on-wire bytes are counted separately by the
//! transport against `max_response_bytes`.
//!
//! * `gzip` / `x-gzip`: RFC 1952, every member of a multi-member stream; the CRC and length
//!   trailer of each member is checked, so a corrupt or cut-short stream is an error;
//! * `deflate`: RFC 9110 means a zlib stream (RFC 1950), but some servers send raw deflate
//!   (RFC 1951); the first two bytes decide which, and the stream must reach its end;
//! * `identity` (or no header): bytes pass through, counted against the same cap.

use flate2::{Decompress, FlushDecompress, Status};
use std::io::Write;

/// Why a body could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The decoded body would exceed the cap; nothing past the cap was kept.
    #[error("decoded body exceeds {limit} bytes")]
    TooLarge { limit: u64 },
    /// The encoded bytes are not a valid stream of the announced encoding.
    #[error("corrupt {encoding} stream: {reason}")]
    Corrupt { encoding: &'static str, reason: String },
}

/// Which `Content-Encoding` a response announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Identity,
    Gzip,
    Deflate,
}

impl Encoding {
    /// Parses a `Content-Encoding` header value; `None` for encodings zonewatch does not
    /// decode (`br`, `zstd`, stacked encodings, …).
    pub fn from_header(value: Option<&str>) -> Option<Encoding> {
        match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            None | Some("") | Some("identity") => Some(Encoding::Identity),
            Some("gzip") | Some("x-gzip") => Some(Encoding::Gzip),
            Some("deflate") => Some(Encoding::Deflate),
            Some(_) => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Identity => "identity",
            Encoding::Gzip => "gzip",
            Encoding::Deflate => "deflate",
        }
    }
}

/// The decoded bytes not yet taken, refusing to let the body grow past `limit` in all
/// (`taken` counts what [`BodyDecoder::take_decoded`] already handed on).
struct Capped {
    out: Vec<u8>,
    taken: u64,
    limit: u64,
    exceeded: bool,
}

impl Capped {
    fn push(&mut self, buf: &[u8]) -> Result<(), DecodeError> {
        if self.taken + self.out.len() as u64 + buf.len() as u64 > self.limit {
            self.exceeded = true;
            return Err(DecodeError::TooLarge { limit: self.limit });
        }
        self.out.extend_from_slice(buf);
        Ok(())
    }
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.push(buf).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The raw-deflate / zlib state: undecided until the first two bytes have arrived.
enum Inflate {
    Pending(Vec<u8>),
    Running { z: Decompress, ended: bool },
}

enum State {
    Identity,
    Gzip(Box<flate2::write::MultiGzDecoder<Capped>>),
    Deflate(Box<Inflate>),
}

/// An incremental decoder for one response body.
pub struct BodyDecoder {
    encoding: Encoding,
    state: State,
    /// Used by identity and deflate (gzip keeps its own inside the decoder).
    out: Capped,
    wire_bytes: u64,
}

impl BodyDecoder {
    /// A decoder for `encoding` whose output may not exceed `limit` bytes.
    pub fn new(encoding: Encoding, limit: u64) -> BodyDecoder {
        let capped = || Capped { out: Vec::new(), taken: 0, limit, exceeded: false };
        let state = match encoding {
            Encoding::Identity => State::Identity,
            Encoding::Gzip => State::Gzip(Box::new(flate2::write::MultiGzDecoder::new(capped()))),
            Encoding::Deflate => State::Deflate(Box::new(Inflate::Pending(Vec::new()))),
        };
        BodyDecoder { encoding, state, out: capped(), wire_bytes: 0 }
    }

    /// Bytes received on the wire so far.
    pub fn wire_bytes(&self) -> u64 {
        self.wire_bytes
    }

    fn corrupt(&self, reason: impl Into<String>) -> DecodeError {
        DecodeError::Corrupt { encoding: self.encoding.as_str(), reason: reason.into() }
    }

    /// Feeds one received chunk.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), DecodeError> {
        self.wire_bytes += chunk.len() as u64;
        match &mut self.state {
            State::Identity => self.out.push(chunk),
            State::Gzip(dec) => match dec.write_all(chunk) {
                Ok(()) => Ok(()),
                Err(_) if dec.get_ref().exceeded => Err(DecodeError::TooLarge { limit: dec.get_ref().limit }),
                Err(e) => Err(DecodeError::Corrupt { encoding: "gzip", reason: e.to_string() }),
            },
            State::Deflate(inf) => {
                if let Inflate::Pending(head) = inf.as_mut() {
                    head.extend_from_slice(chunk);
                    if head.len() < 2 {
                        return Ok(());
                    }
                    let head = std::mem::take(head);
                    // A zlib header: CM = 8, window ≤ 32 KiB, and the 16-bit header is a
                    // multiple of 31 (RFC 1950 §2.2). Anything else is raw deflate.
                    let zlib = head[0] & 0x0f == 8 && head[0] >> 4 <= 7 && (u16::from(head[0]) << 8 | u16::from(head[1])) % 31 == 0;
                    **inf = Inflate::Running { z: Decompress::new(zlib), ended: false };
                    return inflate(inf, &mut self.out, &head, self.encoding);
                }
                inflate(inf, &mut self.out, chunk, self.encoding)
            }
        }
    }

    /// Hands on the bytes decoded since the last call (a body streamed to disk does not
    /// accumulate); they still count against the cap. [`BodyDecoder::finish`] then returns
    /// only the rest.
    pub fn take_decoded(&mut self) -> Vec<u8> {
        let capped = match &mut self.state {
            State::Gzip(dec) => dec.get_mut(),
            _ => &mut self.out,
        };
        capped.taken += capped.out.len() as u64;
        std::mem::take(&mut capped.out)
    }

    /// The bytes decoded so far (gzip may still hold up to one window internally).
    pub fn decoded_so_far(&self) -> &[u8] {
        match &self.state {
            State::Gzip(dec) => &dec.get_ref().out,
            _ => &self.out.out,
        }
    }

    /// Ends the body: checks the stream is complete and returns the decoded bytes.
    pub fn finish(self) -> Result<Vec<u8>, DecodeError> {
        if self.wire_bytes == 0 {
            // No body at all (a 304, an empty 200): nothing to decode.
            return Ok(Vec::new());
        }
        let err = self.corrupt("the stream ends before its end marker (truncated?)");
        match self.state {
            State::Identity => Ok(self.out.out),
            State::Gzip(dec) => match dec.finish() {
                Ok(c) => Ok(c.out),
                Err(e) => Err(DecodeError::Corrupt { encoding: "gzip", reason: format!("{e} (truncated or damaged)") }),
            },
            State::Deflate(inf) => match *inf {
                Inflate::Running { ended: true, .. } => Ok(self.out.out),
                _ => Err(err),
            },
        }
    }
}

/// Inflates `input` into `out` (bounded), remembering whether the stream has ended.
fn inflate(inf: &mut Inflate, out: &mut Capped, mut input: &[u8], encoding: Encoding) -> Result<(), DecodeError> {
    let Inflate::Running { z, ended } = inf else { return Ok(()) };
    let mut buf = vec![0u8; 64 * 1024];
    while !input.is_empty() {
        if *ended {
            return Err(DecodeError::Corrupt { encoding: encoding.as_str(), reason: format!("{} bytes after the end of the stream", input.len()) });
        }
        let (in0, out0) = (z.total_in(), z.total_out());
        let status = z
            .decompress(input, &mut buf, FlushDecompress::None)
            .map_err(|e| DecodeError::Corrupt { encoding: encoding.as_str(), reason: e.to_string() })?;
        let consumed = (z.total_in() - in0) as usize;
        let produced = (z.total_out() - out0) as usize;
        input = &input[consumed.min(input.len())..];
        out.push(&buf[..produced])?;
        if status == Status::StreamEnd {
            *ended = true;
        } else if consumed == 0 && produced == 0 {
            // With input and output room the inflater always moves; never spin or drop bytes.
            return Err(DecodeError::Corrupt { encoding: encoding.as_str(), reason: "the decoder made no progress".into() });
        }
    }
    // Drain output the decoder still holds for the input already given.
    while !*ended {
        let out0 = z.total_out();
        let status = z
            .decompress(&[], &mut buf, FlushDecompress::None)
            .map_err(|e| DecodeError::Corrupt { encoding: encoding.as_str(), reason: e.to_string() })?;
        let produced = (z.total_out() - out0) as usize;
        out.push(&buf[..produced])?;
        if status == Status::StreamEnd {
            *ended = true;
        }
        if produced == 0 {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::{DeflateEncoder, GzEncoder, ZlibEncoder};
    use flate2::Compression;

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn decode(enc: Encoding, body: &[u8], limit: u64, chunk: usize) -> Result<Vec<u8>, DecodeError> {
        let mut d = BodyDecoder::new(enc, limit);
        for c in body.chunks(chunk.max(1)) {
            d.push(c)?;
        }
        d.finish()
    }

    #[test]
    fn gzip_zlib_and_raw_deflate_round_trip_in_any_chunking() {
        let data: Vec<u8> = (0..200_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        let mut z = ZlibEncoder::new(Vec::new(), Compression::default());
        z.write_all(&data).unwrap();
        let zlib = z.finish().unwrap();
        let mut r = DeflateEncoder::new(Vec::new(), Compression::default());
        r.write_all(&data).unwrap();
        let raw = r.finish().unwrap();
        for chunk in [1, 7, 4096, usize::MAX] {
            assert_eq!(decode(Encoding::Gzip, &gz(&data), 1 << 30, chunk).unwrap(), data);
            assert_eq!(decode(Encoding::Deflate, &zlib, 1 << 30, chunk).unwrap(), data);
            assert_eq!(decode(Encoding::Deflate, &raw, 1 << 30, chunk).unwrap(), data);
        }
        // Two gzip members are one body.
        let mut two = gz(b"hello ");
        two.extend(gz(b"world"));
        assert_eq!(decode(Encoding::Gzip, &two, 100, 3).unwrap(), b"hello world");
    }

    /// Taking the decoded bytes as they come hands on the same body in pieces, and what was
    /// taken still counts against the cap (a bomb streamed to disk stops where one held in
    /// memory does).
    #[test]
    fn bytes_taken_as_they_come_make_the_same_body_and_count_against_the_cap() {
        let data: Vec<u8> = (0..300_000u32).flat_map(|i| (i % 241).to_le_bytes()).collect();
        let mut z = ZlibEncoder::new(Vec::new(), Compression::default());
        z.write_all(&data).unwrap();
        for (enc, body) in [(Encoding::Identity, data.clone()), (Encoding::Gzip, gz(&data)), (Encoding::Deflate, z.finish().unwrap())] {
            for chunk in [1, 4096, usize::MAX] {
                let mut d = BodyDecoder::new(enc, 1 << 30);
                let mut got = Vec::new();
                for c in body.chunks(chunk.min(body.len())) {
                    d.push(c).unwrap();
                    got.extend(d.take_decoded());
                }
                got.extend(d.finish().unwrap());
                assert_eq!(got, data, "{enc:?} in chunks of {chunk}");
            }
        }
        let zeros = vec![0u8; 10 << 20];
        let mut d = BodyDecoder::new(Encoding::Gzip, 1 << 20);
        let mut taken = 0;
        let err = gz(&zeros).chunks(4096).try_for_each(|c| {
            let r = d.push(c);
            taken += d.take_decoded().len();
            r
        });
        assert!(matches!(err, Err(DecodeError::TooLarge { limit }) if limit == 1 << 20), "{err:?}");
        assert!(taken <= 1 << 20, "{taken}");
        // The same for a plain body.
        let mut d = BodyDecoder::new(Encoding::Identity, 10);
        d.push(b"012345").unwrap();
        assert_eq!(d.take_decoded(), b"012345");
        assert!(matches!(d.push(b"6789a"), Err(DecodeError::TooLarge { limit: 10 })));
    }

    #[test]
    fn caps_and_corruption() {
        let zeros = vec![0u8; 10 << 20];
        let bomb = gz(&zeros);
        assert!(bomb.len() < 64 * 1024);
        let err = decode(Encoding::Gzip, &bomb, 1 << 20, 8192).unwrap_err();
        assert!(matches!(err, DecodeError::TooLarge { limit } if limit == 1 << 20), "{err}");
        let err = decode(Encoding::Identity, b"0123456789", 5, 3).unwrap_err();
        assert!(matches!(err, DecodeError::TooLarge { limit: 5 }));
        // Cut short, damaged in the middle, garbage: all errors, never panics.
        let good = gz(b"{\"type\":\"FeatureCollection\",\"features\":[]}");
        assert!(matches!(decode(Encoding::Gzip, &good[..good.len() - 4], 1 << 20, 5), Err(DecodeError::Corrupt { .. })));
        let mut bad = good.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0xff;
        assert!(decode(Encoding::Gzip, &bad, 1 << 20, 5).is_err());
        assert!(matches!(decode(Encoding::Gzip, b"not gzip at all", 1 << 20, 4), Err(DecodeError::Corrupt { .. })));
        assert!(matches!(decode(Encoding::Deflate, &[0x78, 0x9c, 1, 2], 1 << 20, 4), Err(DecodeError::Corrupt { .. })));
        // An empty body (a 304) is empty whatever the header says.
        assert_eq!(decode(Encoding::Gzip, b"", 10, 1).unwrap(), b"");
        assert_eq!(Encoding::from_header(Some("GZIP")), Some(Encoding::Gzip));
        assert_eq!(Encoding::from_header(Some("br")), None);
        assert_eq!(Encoding::from_header(None), Some(Encoding::Identity));
    }
}
