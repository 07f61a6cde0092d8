//! `POST /v1/backup`: a consistent copy of the store taken by the running daemon, for
//! `zonewatch backup` (which then copies it to its destination and removes it).

use crate::control::ControlState;
use crate::control::http::{error, json, parse_optional_json, Resp};
use crate::util::rfc3339;
use super::internal;
use hyper::StatusCode;
use serde::Deserialize;
use serde_json::json;

/// Body of `POST /v1/backup` (optional).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct BackupBody {
    /// File name inside the store's `backups/` folder (letters, digits, '-', '_', '.').
    name: Option<String>,
    /// The store file the client means (`zonewatch backup` sends its config's): a daemon
    /// serving another file refuses, 409 `other_store`.
    store: Option<FileIdentity>,
}

/// A file as the file system knows it (device and inode numbers): the same however its path
/// is written, or seen from another working directory.
#[derive(Deserialize, serde::Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
}

impl FileIdentity {
    /// The identity of the file at `path`.
    pub fn of(path: &std::path::Path) -> std::io::Result<FileIdentity> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        Ok(FileIdentity { dev: m.dev(), ino: m.ino() })
    }
}

pub(super) fn backup(st: &ControlState, body: &[u8]) -> Resp {
    let b: BackupBody = match parse_optional_json(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let own = std::path::absolute(st.engine.store.path()).unwrap_or_else(|_| st.engine.store.path().to_path_buf());
    if let Some(asked) = b.store {
        // Two installs sharing a token, one stopped with its address file left, the other on
        // that port since: the client's backup must not be this daemon's store (a tester got
        // another install's store, exit 0).
        if FileIdentity::of(&own).ok() != Some(asked) {
            return error(StatusCode::CONFLICT, "other_store", format!("this daemon serves the store {}, not the file asked for", own.display()));
        }
    }
    let name = b.name.unwrap_or_else(|| format!("zonewatch-{}.redb", rfc3339(st.engine.now()).replace([':', '.'], "-")));
    if !crate::config::valid_id(&name) || name.starts_with('.') {
        return error(StatusCode::BAD_REQUEST, "bad_name", "name must be a plain file name of at most 64 characters (letters, digits, '-', '_', '.'), not starting with '.'");
    }
    let dir = crate::cli::backup_dir(&st.engine.config);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return internal(format!("cannot create {}: {e}", dir.display()));
    }
    let dest = dir.join(&name);
    match st.engine.store.backup_to(&dest) {
        // Absolute: a client's working directory is not the daemon's (a relative `[store] path`
        // resolves against the daemon's).
        Ok(info) => {
            let path = std::path::absolute(&info.path).unwrap_or(info.path);
            json(StatusCode::CREATED, &json!({"path": path.display().to_string(), "bytes": info.bytes, "tables": info.tables, "rows": info.rows, "store": own.display().to_string()}))
        }
        Err(crate::store::StoreError::Conflict(m)) => error(StatusCode::CONFLICT, "exists", m),
        Err(e) => internal(e),
    }
}
