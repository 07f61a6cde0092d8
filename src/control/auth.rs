//! The control port's bearer token: read from `control.token_file`, created with 32 random
//! bytes (mode 0600) on first start when the file does not exist, compared in constant time.
//! The file is written whole or not at all (a temp file renamed into place), so a first start
//! cut short (a full disk) never leaves a token file that every later start refuses.

use base64::Engine as _;
use std::path::Path;

/// What the token file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenFile {
    /// No file yet: `serve` creates one.
    Missing,
    /// A file of whitespace alone: no token was ever in it (a file left by an older release's
    /// first start cut short by a full disk). `serve` writes a new token in its place.
    Empty,
    /// The token.
    Token(String),
}

/// What the token file holds; an error for a file that cannot be read or holds a token too
/// short to be one. `zonewatch check` asks this too, so a token `serve` would refuse fails
/// the service's pre-start check.
pub fn read_token(path: &Path) -> Result<TokenFile, String> {
    match std::fs::read_to_string(path) {
        Ok(t) => {
            let t = t.trim().to_string();
            if t.is_empty() {
                return Ok(TokenFile::Empty);
            }
            if t.len() < 16 {
                return Err(format!("control token in {} is shorter than 16 characters", path.display()));
            }
            Ok(TokenFile::Token(t))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TokenFile::Missing),
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

/// Why the token could not be had.
#[derive(Debug)]
pub struct TokenError {
    pub message: String,
    /// The disk or the quota is full: waiting may cure it (`serve` exits 1, which the
    /// packaged unit retries, not 2).
    pub passes: bool,
}

impl TokenError {
    fn new(message: String) -> Self {
        TokenError { message, passes: false }
    }

    fn io(what: String, e: &std::io::Error) -> Self {
        TokenError { message: format!("{what}: {e}"), passes: crate::store::is_out_of_space(e) }
    }
}

/// Loads the token, creating the file when it is absent (or holds no token). A token others
/// may read is used, with a warning (the operator may mean it; `check` says so too).
pub fn load_or_create_token(path: &Path) -> Result<String, TokenError> {
    let replace = match read_token(path).map_err(TokenError::new)? {
        TokenFile::Token(t) => {
            if let Some(mode) = others_may_read(path) {
                tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "every user may read the control token, and with it steer zonewatch: chmod o-rwx it");
            }
            return Ok(t);
        }
        TokenFile::Missing => false,
        TokenFile::Empty => true,
    };
    let bytes: [u8; 32] = rand::random();
    let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let parent = crate::util::folder_of(path);
    std::fs::create_dir_all(parent).map_err(|e| TokenError::io(format!("cannot create {}", parent.display()), &e))?;
    let cannot_write = |e: &std::io::Error| TokenError::io(format!("cannot write {}", path.display()), e);
    // Whole or not at all: the token goes to a temp file (mode 0600) beside the token file,
    // synced, then takes its name. A full disk leaves at most the temp file, removed on the
    // way out.
    let mut tmp = tempfile::Builder::new().prefix(".zonewatch-token-").tempfile_in(parent).map_err(|e| cannot_write(&e))?;
    {
        use std::io::Write;
        tmp.write_all(format!("{token}\n").as_bytes()).map_err(|e| cannot_write(&e))?;
        tmp.as_file().sync_all().map_err(|e| cannot_write(&e))?;
    }
    if replace {
        tmp.persist(path).map_err(|e| cannot_write(&e.error))?;
        tracing::warn!(path = %path.display(), "the control token file held no token; wrote a new one in its place");
    } else {
        match tmp.persist_noclobber(path) {
            Ok(_) => tracing::warn!(path = %path.display(), "created a new control token"),
            // Written meanwhile by someone else (an operator): theirs is the token.
            Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => return load_existing(path),
            Err(e) => return Err(cannot_write(&e.error)),
        }
    }
    // The new name survives a power cut with the folder's entry (best effort: not every
    // platform opens a folder).
    if let Ok(folder) = std::fs::File::open(parent) {
        let _ = folder.sync_all();
    }
    Ok(token)
}

/// The token of a file written by someone else while this process created its own.
fn load_existing(path: &Path) -> Result<String, TokenError> {
    match read_token(path).map_err(TokenError::new)? {
        TokenFile::Token(t) => Ok(t),
        _ => Err(TokenError::new(format!("control token {} was written meanwhile and holds no token", path.display()))),
    }
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
        // Nothing else is left in the folder (the temp file took the token's name).
        assert_eq!(std::fs::read_dir(p.parent().unwrap()).unwrap().count(), 1);
    }

    /// A token file holding no token (an older release's first start cut short by a full
    /// disk left one of 0 bytes, which every later start refused) gets a new token; a short
    /// one is still refused, as `check` refuses it.
    #[test]
    fn a_token_file_without_a_token_is_replaced_and_a_short_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("control.token");
        for empty in ["", "\n", "  \n"] {
            std::fs::write(&p, empty).unwrap();
            assert_eq!(read_token(&p), Ok(TokenFile::Empty));
            let t = load_or_create_token(&p).unwrap();
            assert!(t.len() >= 43, "{t}");
            assert_eq!(read_token(&p), Ok(TokenFile::Token(t)));
        }
        std::fs::write(&p, "short\n").unwrap();
        let e = load_or_create_token(&p).unwrap_err();
        assert!(e.message.contains("shorter than 16") && !e.passes, "{e:?}");
        std::fs::remove_file(&p).unwrap();
        assert_eq!(read_token(&p), Ok(TokenFile::Missing));
    }
}
