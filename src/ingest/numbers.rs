//! Numbers a `serde_json::Value` cannot hold, written as strings before a portal answer is
//! parsed. An integer past the 64-bit range would be read as a float and lose its digits past
//! the 17th (two long zoning codes or ids would read the same), and a number past a float's
//! range (`1e400`) fails the whole parse. Both are quoted, keeping their text; the normaliser
//! reads such a string as the number was written, as it reads the number itself in a file
//! layer. [`quote_unreadable_numbers`] does it to an answer held in memory, [`QuotingReader`]
//! to one read from disk (a page too large to hold, `http::Response`), with the same result.

use std::io::{BufRead, Read};

/// A number token longer than this is passed on as it is, not held to be judged: a page can
/// be hundreds of MiB, and a hostile one all digits. Unquoted, serde_json reads it as a float
/// or fails the page on it (a `BadJson` error, not a wrong value).
pub const MAX_NUMBER_TOKEN: usize = 64 * 1024;

/// Bytes that continue a number token once a `-` or a digit has started it.
fn continues_number(b: u8) -> bool {
    matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
}

/// Whether the number token `token` is one a `Value` cannot hold exactly. Most tokens are
/// coordinates: they are told apart by their bytes alone, and only a long integer or a float
/// with a long mantissa or a large exponent is parsed.
fn unreadable(token: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(token) else { return false };
    match text.find(['.', 'e', 'E']) {
        None => {
            let digits = text.strip_prefix('-').unwrap_or(text);
            digits.len() >= 19 && digits.bytes().all(|b| b.is_ascii_digit()) && text.parse::<i64>().is_err() && text.parse::<u64>().is_err()
        }
        Some(_) => {
            let exponent = text.find(['e', 'E']).map(|at| text[at + 1..].trim_start_matches(['+', '-']).len()).unwrap_or(0);
            let mantissa = text.find(['e', 'E']).unwrap_or(text.len());
            (exponent >= 3 || mantissa > 300) && text.parse::<f64>().is_ok_and(f64::is_infinite)
        }
    }
}

/// `json` with every number a `Value` cannot hold quoted; `None` when it has no such number
/// (the common case: nothing is copied).
pub fn quote_unreadable_numbers(json: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let (mut i, mut copied) = (0, 0);
    let mut in_string = false;
    while i < json.len() {
        let b = json[i];
        if in_string {
            match b {
                b'\\' => i += 1,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        if b == b'"' {
            in_string = true;
            i += 1;
            continue;
        }
        if b == b'-' || b.is_ascii_digit() {
            let start = i;
            while i < json.len() && continues_number(json[i]) {
                i += 1;
            }
            if i - start <= MAX_NUMBER_TOKEN && unreadable(&json[start..i]) {
                let o = out.get_or_insert_with(|| Vec::with_capacity(json.len() + 16));
                o.extend_from_slice(&json[copied..start]);
                o.push(b'"');
                o.extend_from_slice(&json[start..i]);
                o.push(b'"');
                copied = i;
            }
            continue;
        }
        i += 1;
    }
    let mut o = out?;
    o.extend_from_slice(&json[copied..]);
    Some(o)
}

/// Where [`QuotingReader`] is in the JSON text.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lexeme {
    Between,
    InString,
    /// Just after a backslash in a string: the next byte is taken as it is.
    Escaped,
    /// In a number token, held in `number` until it ends (or passed on once past
    /// [`MAX_NUMBER_TOKEN`]).
    InNumber { long: bool },
}

/// A reader of JSON text that hands it on with the numbers a `Value` cannot hold quoted, as
/// [`quote_unreadable_numbers`] would: it holds one number token at a time (at most
/// [`MAX_NUMBER_TOKEN`] bytes) and one chunk of its reader's text, whatever the text's size.
pub struct QuotingReader<R> {
    inner: R,
    lexeme: Lexeme,
    number: Vec<u8>,
    out: Vec<u8>,
    at: usize,
    ended: bool,
}

impl<R: BufRead> QuotingReader<R> {
    pub fn new(inner: R) -> QuotingReader<R> {
        QuotingReader { inner, lexeme: Lexeme::Between, number: Vec::new(), out: Vec::new(), at: 0, ended: false }
    }

    /// The number token held, ended: quoted when a `Value` cannot hold it.
    fn end_number(number: &mut Vec<u8>, out: &mut Vec<u8>) {
        if unreadable(number) {
            out.push(b'"');
            out.extend_from_slice(number);
            out.push(b'"');
        } else {
            out.extend_from_slice(number);
        }
        number.clear();
    }

    /// Reads on until some text is ready in `out`, or the reader is at its end.
    fn refill(&mut self) -> std::io::Result<()> {
        self.out.clear();
        self.at = 0;
        while self.out.is_empty() && !self.ended {
            let QuotingReader { inner, lexeme, number, out, .. } = self;
            let chunk = inner.fill_buf()?;
            if chunk.is_empty() {
                if let Lexeme::InNumber { long: false } = lexeme {
                    Self::end_number(number, out);
                }
                self.ended = true;
                break;
            }
            out.reserve(chunk.len());
            let mut i = 0;
            while i < chunk.len() {
                match *lexeme {
                    Lexeme::InString => {
                        // The run up to the next quote or backslash goes on as it is.
                        let run = chunk[i..].iter().position(|&b| b == b'"' || b == b'\\').unwrap_or(chunk.len() - i);
                        out.extend_from_slice(&chunk[i..i + run]);
                        i += run;
                        if let Some(&b) = chunk.get(i) {
                            *lexeme = if b == b'"' { Lexeme::Between } else { Lexeme::Escaped };
                            out.push(b);
                            i += 1;
                        }
                    }
                    Lexeme::Escaped => {
                        *lexeme = Lexeme::InString;
                        out.push(chunk[i]);
                        i += 1;
                    }
                    Lexeme::InNumber { long } => {
                        let run = chunk[i..].iter().position(|&b| !continues_number(b)).unwrap_or(chunk.len() - i);
                        let digits = &chunk[i..i + run];
                        if long {
                            out.extend_from_slice(digits);
                        } else if number.len() + digits.len() > MAX_NUMBER_TOKEN {
                            out.append(number);
                            out.extend_from_slice(digits);
                            *lexeme = Lexeme::InNumber { long: true };
                        } else {
                            number.extend_from_slice(digits);
                        }
                        i += run;
                        if i < chunk.len() {
                            // The token ended at a byte that is not part of it.
                            if let Lexeme::InNumber { long: false } = *lexeme {
                                Self::end_number(number, out);
                            }
                            *lexeme = Lexeme::Between;
                        }
                    }
                    Lexeme::Between => {
                        // The run up to the next string or number goes on as it is.
                        let run = chunk[i..].iter().position(|&b| b == b'"' || b == b'-' || b.is_ascii_digit()).unwrap_or(chunk.len() - i);
                        out.extend_from_slice(&chunk[i..i + run]);
                        i += run;
                        if let Some(&b) = chunk.get(i) {
                            if b == b'"' {
                                *lexeme = Lexeme::InString;
                                out.push(b);
                            } else {
                                *lexeme = Lexeme::InNumber { long: false };
                                number.push(b);
                            }
                            i += 1;
                        }
                    }
                }
            }
            let n = chunk.len();
            inner.consume(n);
        }
        Ok(())
    }
}

impl<R: BufRead> Read for QuotingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.at == self.out.len() {
            self.refill()?;
        }
        let n = buf.len().min(self.out.len() - self.at);
        buf[..n].copy_from_slice(&self.out[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_a_value_cannot_hold_are_read_as_written() {
        let q = |s: &str| quote_unreadable_numbers(s.as_bytes()).map(|v| String::from_utf8(v).unwrap());
        assert_eq!(q(r#"{"a":1,"b":-12.5e3,"c":18446744073709551615,"d":-9223372036854775808,"s":"123456789012345678901234567890"}"#), None, "nothing to change");
        assert_eq!(
            q(r#"{"z":123456789012345678901234567890,"n":-98765432109876543210987,"f":1e400,"g":[1.5,-2e-400],"s":"1e400 \" 123456789012345678901"}"#).as_deref(),
            Some(r#"{"z":"123456789012345678901234567890","n":"-98765432109876543210987","f":"1e400","g":[1.5,-2e-400],"s":"1e400 \" 123456789012345678901"}"#)
        );
        let v: serde_json::Value = serde_json::from_slice(&quote_unreadable_numbers(br#"{"z":18446744073709551616}"#).unwrap()).unwrap();
        assert_eq!(v["z"], "18446744073709551616");
    }

    /// Through the reader, read in chunks of 1, 2, 3, 5, 7, 64 and 8192 bytes, a text comes out as the
    /// in-memory quoting makes it: random texts of the tokens that matter (strings with
    /// escapes and digits, long and short numbers, floats past range, punctuation), each
    /// token cut at every chunk boundary somewhere.
    #[test]
    fn the_reader_quotes_as_the_in_memory_pass_does_at_every_chunk_size() {
        let pieces: [&[u8]; 16] = [
            b"{", b"}", b"[", b"]", b",", b":", b" ", b"\"a\\\"1\"", b"\"\\\\\"", b"\"123456789012345678901234\"", b"-12.5e3", b"123456789012345678901234567890",
            b"-98765432109876543210987", b"1e400", b"18446744073709551615", b"true",
        ];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..300 {
            let len = (next() % 40) as usize;
            let text: Vec<u8> = (0..len).flat_map(|_| pieces[(next() % pieces.len() as u64) as usize].to_vec()).collect();
            let want = quote_unreadable_numbers(&text).unwrap_or_else(|| text.clone());
            for chunk in [1, 2, 3, 5, 7, 64, 8192] {
                let mut got = Vec::new();
                QuotingReader::new(std::io::BufReader::with_capacity(chunk, text.as_slice())).read_to_end(&mut got).unwrap();
                assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want), "chunk {chunk}: {}", String::from_utf8_lossy(&text));
            }
        }
    }

    /// A number token past [`MAX_NUMBER_TOKEN`] is passed on as it is by both, so a page of
    /// digits is never held whole to be judged.
    #[test]
    fn a_number_token_past_the_cap_is_passed_on_as_it_is() {
        let mut text = b"[".to_vec();
        text.extend(std::iter::repeat_n(b'7', MAX_NUMBER_TOKEN + 10));
        text.extend_from_slice(b",123456789012345678901234567890]");
        let want = br#"[,"123456789012345678901234567890"]"#;
        let got_memory = quote_unreadable_numbers(&text).unwrap();
        let mut got_reader = Vec::new();
        QuotingReader::new(std::io::BufReader::with_capacity(4096, text.as_slice())).read_to_end(&mut got_reader).unwrap();
        for got in [got_memory, got_reader] {
            assert_eq!(got.len(), text.len() + 2);
            assert!(got.starts_with(b"[7777") && got.ends_with(&want[2..]), "{}", String::from_utf8_lossy(&got[got.len() - 40..]));
        }
    }
}
