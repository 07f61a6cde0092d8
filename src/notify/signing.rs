//! Standard Webhooks signatures: `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, keyed
//! by the base64-decoded part of a `whsec_` secret.

use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Decodes a `whsec_...` (or bare base64) secret into key bytes.
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, String> {
    let b64 = secret.trim().strip_prefix("whsec_").unwrap_or(secret.trim());
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("not a whsec_ base64 secret: {e} (a secret is whsec_ followed by the base64 of at least 16 random bytes; make one with: echo \"whsec_$(openssl rand -base64 32)\")"))?;
    if key.len() < 16 {
        return Err("secret must decode to at least 16 bytes (make one with: echo \"whsec_$(openssl rand -base64 32)\")".into());
    }
    Ok(key)
}

/// The `webhook-signature` value for one message.
pub fn sign(key: &[u8], msg_id: &str, timestamp_secs: u64, body: &[u8]) -> String {
    match Signer::new(key) {
        Ok(signer) => sign_with(&signer, msg_id, &timestamp_secs.to_string(), body),
        // HMAC accepts keys of any length; this arm is unreachable in practice.
        Err(_) => String::new(),
    }
}

/// An HMAC-SHA256 keyed once, so signing a message starts from the keyed state instead of
/// hashing the key's pads again (a delivery worker keeps one per endpoint secret).
#[derive(Clone)]
pub struct Signer(Hmac<Sha256>);

/// Whether a subscriber with `secret` and `secret_old` signs with both: a `secret_old` beside
/// a secret, unless it is the same key written another way (`whsec_` left off, spaces), which
/// signs once. One that does not decode counts as another key (its send is a `bad_secret`).
pub fn rotating(secret: Option<&str>, secret_old: Option<&str>) -> bool {
    match (secret, secret_old) {
        (Some(new), Some(old)) => !decode_secret(new).is_ok_and(|k| decode_secret(old).is_ok_and(|o| o == k)),
        _ => false,
    }
}

/// Shows no key material.
impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer(..)")
    }
}

impl Signer {
    /// Keys an HMAC with `key` (HMAC takes keys of any length, so this does not fail in
    /// practice; an error is still an error, never a signature under another key).
    pub fn new(key: &[u8]) -> Result<Signer, String> {
        <Hmac<Sha256> as KeyInit>::new_from_slice(key).map(Signer).map_err(|e| format!("bad HMAC key: {e}"))
    }

    /// Decodes a `whsec_` secret ([`decode_secret`]) and keys a signer with it.
    pub fn from_secret(secret: &str) -> Result<Signer, String> {
        Signer::new(&decode_secret(secret)?)
    }
}

/// [`sign`] with a keyed [`Signer`] and the timestamp already rendered as decimal seconds.
pub fn sign_with(signer: &Signer, msg_id: &str, timestamp_secs: &str, body: &[u8]) -> String {
    let mut mac = signer.0.clone();
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp_secs.as_bytes());
    mac.update(b".");
    mac.update(body);
    let sig = mac.finalize().into_bytes();
    let mut out = String::with_capacity(3 + 44);
    out.push_str("v1,");
    base64::engine::general_purpose::STANDARD.encode_string(sig, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rotation is two keys: the same key written another way is not one.
    #[test]
    fn rotating_means_two_keys() {
        const A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        const B: &str = "whsec_dGhpcyBpcyBhIHNlY29uZCBzZWNyZXQga2V5";
        assert!(rotating(Some(B), Some(A)));
        assert!(!rotating(Some(A), Some("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")));
        assert!(!rotating(Some(A), Some(" whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw ")));
        assert!(!rotating(Some(A), None) && !rotating(None, Some(A)));
        assert!(rotating(Some(A), Some("whsec_%%%")), "an old secret that does not decode is another key");
    }

    /// The test vector published with the Standard Webhooks specification.
    #[test]
    fn standard_webhooks_test_vector() {
        let key = decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let sig = sign(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        // A signer keyed once signs message after message from the same keyed state.
        let signer = Signer::from_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        for _ in 0..2 {
            assert_eq!(sign_with(&signer, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", br#"{"test": 2432232314}"#), sig);
        }
    }

    #[test]
    fn rejects_bad_secrets() {
        assert!(decode_secret("whsec_%%%").is_err());
        assert!(decode_secret("whsec_AAAA").is_err());
        assert!(Signer::from_secret("whsec_%%%").is_err());
    }
}
