//! The control port's bearer token: read from `control.token_file`, created with 32 random
//! bytes (mode 0600) on first start when the file does not exist, compared in constant time.

use base64::Engine as _;
use std::path::Path;

/// The token in `path`, `None` when there is no file yet (`serve` creates one); an error for
/// a file that cannot be read or holds a token too short to be one. `zonewatch check` asks
/// this too, so a token `serve` would refuse fails the service's pre-start check.
pub fn read_token(path: &Path) -> Result<Option<String>, String> {
    match std::fs::read_to_string(path) {
        Ok(t) => {
            let t = t.trim().to_string();
            if t.len() < 16 {
                return Err(format!("control token in {} is shorter than 16 characters", path.display()));
            }
            Ok(Some(t))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read control token {}: {e}", path.display())),
    }
}

/// The mode of a token file that any user may read (None: only its owner and group may, or it
/// is not there). Whoever reads the token steers the daemon. The group is left alone: the
/// package makes the file `root:zonewatch 0640` so that the daemon's user reads it.
#[cfg(unix)]
pub fn others_may_read(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o007 != 0).then_some(mode)
}

#[cfg(not(unix))]
pub fn others_may_read(_: &Path) -> Option<u32> {
    None
}

/// Loads the token, creating the file when it is absent. A token others may read is used,
/// with a warning (the operator may mean it; `check` says so too).
pub fn load_or_create_token(path: &Path) -> Result<String, String> {
    match read_token(path)? {
        Some(t) => {
            if let Some(mode) = others_may_read(path) {
                tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "every user may read the control token, and with it steer zonewatch: chmod o-rwx it");
            }
            Ok(t)
        }
        None => {
            let bytes: [u8; 32] = rand::random();
            let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
            if let Some(parent) = path.parent() {
                if !parent.as_os_str().is_empty() {
                    std::fs::create_dir_all(parent).map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
                }
            }
            write_private(path, &format!("{token}\n")).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            tracing::warn!(path = %path.display(), "created a new control token");
            Ok(token)
        }
    }
}

#[cfg(unix)]
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())
}

#[cfg(not(unix))]
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::write(path, text)
}

/// Constant-time comparison (length leaks, content does not).
pub fn token_matches(expected: &str, presented: &str) -> bool {
    let (a, b) = (expected.as_bytes(), presented.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Checks an `Authorization` header value against the token.
pub fn authorized(expected: &str, header: Option<&str>) -> bool {
    // The scheme is case-insensitive (RFC 9110 11.1): `bearer` is `Bearer`.
    match header.map(str::trim_start).and_then(|h| h.split_once(' ')) {
        Some((scheme, t)) if scheme.eq_ignore_ascii_case("bearer") => token_matches(expected, t.trim()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The package's token is `root:zonewatch 0640` (the daemon reads it through its group):
    /// no warning. One every user may read is warned of.
    #[cfg(unix)]
    #[test]
    fn only_a_token_every_user_may_read_is_warned_of() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.token");
        std::fs::write(&path, "a-token-of-sixteen-or-more\n").unwrap();
        for (mode, warned) in [(0o600, None), (0o640, None), (0o644, Some(0o644)), (0o604, Some(0o604))] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(others_may_read(&path), warned, "{mode:o}");
        }
        assert_eq!(others_may_read(&dir.path().join("none")), None);
    }

    #[test]
    fn bearer_checks() {
        assert!(authorized("secret-token-123456", Some("Bearer secret-token-123456")));
        assert!(authorized("secret-token-123456", Some("bearer secret-token-123456")));
        assert!(authorized("secret-token-123456", Some("BEARER  secret-token-123456")));
        assert!(!authorized("secret-token-123456", Some("Basic secret-token-123456")));
        assert!(!authorized("secret-token-123456", Some("Bearersecret-token-123456")));
        assert!(!authorized("secret-token-123456", Some("Bearer secret-token-123457")));
        assert!(!authorized("secret-token-123456", Some("secret-token-123456")));
        assert!(!authorized("secret-token-123456", None));
        assert!(!authorized("secret-token-123456", Some("Bearer ")));
    }

    #[test]
    fn creates_a_private_token_once() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t/control.token");
        let a = load_or_create_token(&p).unwrap();
        assert_eq!(load_or_create_token(&p).unwrap(), a);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        }
    }
}
