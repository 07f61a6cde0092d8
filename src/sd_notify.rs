//! systemd's readiness protocol (`sd_notify`), for the packaged unit's `Type=notify`.
//!
//! Why it exists: with `Type=simple`, `systemctl start` and `restart` report success as soon
//! as the process is forked, so a config error that makes `serve` exit 2 a moment later is
//! seen only in `systemctl status` or the journal (a reviewer: the unit no longer runs
//! `zonewatch check` before it starts, which a config error made restart forever). With
//! `Type=notify` systemd waits for `READY=1`, sent once the config is read, the store open
//! and the control port listening: `systemctl restart zonewatch` then fails, naming the exit
//! status, when the daemon cannot start. Outside systemd (`NOTIFY_SOCKET` unset) nothing is
//! sent.

/// Sends `state` (`READY=1`, `STOPPING=1`) to the datagram socket systemd names in
/// `NOTIFY_SOCKET` (a path, or `@name` for an abstract socket). Best effort: a failure is
/// logged, never fatal (systemd then times the start out, which says what happened).
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else { return };
    if let Err(e) = send(&socket, state) {
        tracing::warn!(socket = %socket.to_string_lossy(), state, "cannot notify systemd: {e}");
    }
}

fn send(socket: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    let out = std::os::unix::net::UnixDatagram::unbound()?;
    let bytes = socket.as_encoded_bytes();
    match bytes.strip_prefix(b"@") {
        #[cfg(target_os = "linux")]
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            out.send_to_addr(state.as_bytes(), &addr)?;
        }
        _ => {
            out.send_to(state.as_bytes(), std::path::Path::new(socket))?;
        }
    }
    Ok(())
}
