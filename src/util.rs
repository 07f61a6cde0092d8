//! Small shared helpers: human durations ("7d", "1h30m"),
//! and RFC 3339 formatting. They live here so every layer speaks the same units.

use std::time::Duration;

thread_local! {
    /// How many [`catch_geometry_panic`] calls this thread is inside.
    static CATCHING_GEOMETRY: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs geometry code that may panic on hostile input (the geometry library asserts on some
/// degenerate shapes) under `catch_unwind`, the thread marked so that the panic hook stays
/// quiet ([`panic_is_caught_geometry`]): the caller turns the panic into a quarantine reason
/// or a counted failure, which says what failed. The hook printed each such panic, several
/// lines of text on stderr per feature, among JSON logs under `--log-format json`.
pub fn catch_geometry_panic<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> std::thread::Result<T> {
    CATCHING_GEOMETRY.with(|c| c.set(c.get().saturating_add(1)));
    let result = std::panic::catch_unwind(f);
    CATCHING_GEOMETRY.with(|c| c.set(c.get().saturating_sub(1)));
    result
}

/// Whether a panic being reported on this thread will be caught by [`catch_geometry_panic`].
pub fn panic_is_caught_geometry() -> bool {
    CATCHING_GEOMETRY.with(|c| c.get() > 0)
}

/// Parses durations such as `500ms`, `60s`, `5m`, `1h`, `7d`, `1h30m` (units may be chained).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    let mut total_ms: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 {
            return Err(format!("duration {text:?}: expected a number at {rest:?}"));
        }
        let (num, tail) = rest.split_at(digits);
        let value: u128 = num
            .parse()
            .map_err(|_| format!("duration {text:?}: number {num:?} is too large"))?;
        let unit_len = tail.chars().take_while(|c| c.is_ascii_alphabetic()).count();
        let (unit, tail) = tail.split_at(unit_len);
        let factor: u128 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 7 * 86_400_000,
            "" => return Err(format!("duration {text:?}: missing unit (use ms, s, m, h, d or w)")),
            other => return Err(format!("duration {text:?}: unknown unit {other:?}")),
        };
        total_ms = total_ms
            .checked_add(value.saturating_mul(factor))
            .ok_or_else(|| format!("duration {text:?} is too large"))?;
        rest = tail.trim_start();
    }
    u64::try_from(total_ms)
        .map(Duration::from_millis)
        .map_err(|_| format!("duration {text:?} is too large"))
}

/// Formats a duration the way `parse_duration` reads it (units chained, largest first).
pub fn format_duration(d: Duration) -> String {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    // Units chained as `parse_duration` reads them: 99,305 s is `1d3h35m5s`, not `99305s`.
    let mut out = String::new();
    let mut rest = ms;
    for (unit, f) in [("d", 86_400_000u64), ("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
        if rest >= f {
            out.push_str(&format!("{}{unit}", rest / f));
            rest %= f;
        }
    }
    out
}

/// Whether something said at most once per `every_ms` may be said now, marking it said in
/// `last_ms`: a damaged row read at every scrape or sweep batch is worth one line an hour,
/// not one per read. Measured on the monotonic clock from the first call (no wall clock: it
/// decides nothing but a log line).
pub fn now_and_then(last_ms: &std::sync::atomic::AtomicU64, every_ms: u64) -> bool {
    use std::sync::atomic::Ordering;
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    // Counted from 1, so that 0 in `last_ms` means "never said".
    let now = START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1;
    let last = last_ms.load(Ordering::Relaxed);
    (last == 0 || now.saturating_sub(last) >= every_ms) && last_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
}

/// RFC 3339 UTC timestamp (`2026-11-30T03:53:01.123Z`) for a millisecond epoch time.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let millis = ms % 1000;
    let days = (secs / 86_400) as i64;
    let sod = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        sod / 3600,
        (sod / 60) % 60,
        sod % 60
    )
}

/// Parses an RFC 3339 / ISO 8601 UTC time (`2026-11-30T03:53:01Z`, fractional seconds and
/// `+00:00` offsets accepted, or a bare date) into epoch milliseconds.
///
/// Every field is held to RFC 3339's ranges (a four-digit year, an hour of 0-23, an offset of
/// at most 23:59) before any arithmetic: the text comes from operators' queries, and a year
/// or an offset that fills an `i64` used to wrap around to some time in the past (`?since=`
/// a time centuries away listed the whole ledger) or, with overflow checks, panic.
pub fn parse_rfc3339(text: &str) -> Option<u64> {
    let t = text.trim();
    let (date, time) = match t.find(['T', 't', ' ']) {
        Some(i) => (&t[..i], &t[i + 1..]),
        None => (t, "00:00:00Z"),
    };
    let mut dp = date.split('-');
    let y: i64 = dp.next()?.parse().ok()?;
    let mo: u32 = dp.next()?.parse().ok()?;
    let d: u32 = dp.next()?.parse().ok()?;
    if dp.next().is_some() || !(0..=9999).contains(&y) || !(1..=12).contains(&mo) || !(1..=days_in_month(y, mo)).contains(&d) {
        return None;
    }
    let (clock, offset_min): (&str, i64) = if let Some(c) = time.strip_suffix(['Z', 'z']) {
        (c, 0)
    } else if let Some(i) = time.rfind(['+', '-']) {
        let (c, off) = time.split_at(i);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let mut op = off[1..].split(':');
        let oh: i64 = op.next()?.parse().ok()?;
        let om: i64 = op.next().unwrap_or("0").parse().ok()?;
        if !(0..=23).contains(&oh) || !(0..=59).contains(&om) {
            return None;
        }
        (c, sign * (oh * 60 + om))
    } else {
        (time, 0)
    };
    let mut cp = clock.split(':');
    let h: i64 = cp.next()?.parse().ok()?;
    let mi: i64 = cp.next()?.parse().ok()?;
    let sec_text = cp.next().unwrap_or("0");
    let sec: f64 = sec_text.parse().ok()?;
    if !(0..=23).contains(&h) || !(0..=59).contains(&mi) || !(0.0..61.0).contains(&sec) {
        return None;
    }
    let days = days_from_civil(y, mo, d);
    let total = days * 86_400_000 + h * 3_600_000 + mi * 60_000 + (sec * 1000.0).round() as i64
        - offset_min * 60_000;
    u64::try_from(total).ok()
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// The days of month `m` (1-12) of year `y` in the proleptic Gregorian calendar: an operator's
/// `2026-02-30` is a typo to refuse, not a day to roll over into March.
fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Capped exponential backoff with full jitter: a uniform delay in
/// `[0, min(max, base · 2^(attempt-1))]`; `retry_after` (a server's `Retry-After`) is a floor.
/// Shared by the HTTP sources and the webhook deliveries.
pub fn full_jitter_backoff(base: Duration, max: Duration, attempt: u32, retry_after: Option<Duration>) -> Duration {
    let exp = backoff_cap(base, max, attempt);
    let jittered = Duration::from_millis(rand::random_range(0..=exp.as_millis() as u64));
    match retry_after {
        Some(ra) => jittered.max(ra),
        None => jittered,
    }
}

/// The cap [`full_jitter_backoff`] draws retry `attempt` (1: the first) below: `base` doubled
/// per attempt (up to 2^20), at most `max`.
pub fn backoff_cap(base: Duration, max: Duration, attempt: u32) -> Duration {
    base.saturating_mul(1u32.checked_shl(attempt.saturating_sub(1).min(20)).unwrap_or(u32::MAX)).min(max)
}

/// A target URL as it may be shown (API listings, `endpoints list`, `dlq show`, `check`, the
/// ledger): a password written in it (`https://user:pw@host/`, which the HTTP client sends as
/// basic auth) is replaced by `***`. A text that does not parse as a URL loses whatever may
/// be its user and password ([`without_userinfo`]); any other is shown as it is.
pub fn url_for_display(url: &str) -> std::borrow::Cow<'_, str> {
    match reqwest::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            // Cannot fail on a URL that has a password (it has a host).
            let _ = u.set_password(Some("***"));
            std::borrow::Cow::Owned(u.to_string())
        }
        Ok(_) => std::borrow::Cow::Borrowed(url),
        Err(_) => without_userinfo(url),
    }
}

/// A URL-like text with whatever stands between `://` and the last `@` before the path cut
/// out, for one that does not parse: `https://u:pa/ss@host/` → `https://***@host/`.
fn without_userinfo(text: &str) -> std::borrow::Cow<'_, str> {
    let Some(start) = text.find("://").map(|i| i + 3) else { return std::borrow::Cow::Borrowed(text) };
    let rest = &text[start..];
    // The authority ends at the first `?` or `#`; a `/` may be part of a broken password.
    let authority_end = rest.find(['?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => std::borrow::Cow::Owned(format!("{}***{}", &text[..start], &rest[at..])),
        None => std::borrow::Cow::Borrowed(text),
    }
}

/// An error and every error under it (`source()`), joined by ": ": a transport error's
/// outer text alone ("error sending request") does not say what went wrong.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// The cores this process may use (at least 1), asked once and kept for the life of the
/// process (a later change of affinity or CPU quota is not followed): `available_parallelism`
/// reads the affinity mask and the cgroup's quota on every call, and the matcher asks per
/// batch. Every thread count of the pipeline, the daemon and the bench comes from here.
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// Lower-case hex of a byte slice.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// This process's effective user id: the owner of the files it creates, and whom permission
/// checks are made for. (A file's owner, or `/proc/self`'s, is not always it: NFS squashing,
/// a process that is not dumpable.)
pub fn effective_uid() -> u32 {
    extern "C" {
        fn geteuid() -> u32;
    }
    // SAFETY: `geteuid` takes nothing, cannot fail and is callable from any thread.
    unsafe { geteuid() }
}

/// Caps glibc's malloc arenas at one per core, for the long-lived `serve`.
///
/// Why: glibc gives each thread that allocates its own arena, up to 8 per core, and memory
/// freed in one arena is not reused by another; a daemon whose blocking pool and runtime
/// threads each ran a source keeps all those arenas' high-water marks. Threads beyond the
/// cores cannot run at once anyway. Measured (issue 7, idle `serve` with 100 sources): about
/// 4 MiB less resident memory. A no-op on other allocators; call before spawning threads.
pub fn limit_allocator_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: std::os::raw::c_int, value: std::os::raw::c_int) -> std::os::raw::c_int;
        }
        const M_ARENA_MAX: std::os::raw::c_int = -8;
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(1, 64) as std::os::raw::c_int;
        // SAFETY: `mallopt` takes two integers and changes an allocator tuning knob; glibc
        // documents M_ARENA_MAX as settable at any time (it only limits future arenas).
        unsafe {
            mallopt(M_ARENA_MAX, cores);
        }
    }
}

/// Hands memory freed by a finished source run back to the operating system.
///
/// Why: glibc's allocator keeps the pages a run freed mapped in its arenas (one per thread
/// that allocated), so a `serve` daemon that has run its sources once sits at the high-water
/// mark of its largest run for months. Trimming after each run returns them; it costs about a
/// millisecond and runs at most once per source run. A no-op on other allocators.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: `malloc_trim` takes no pointers and only releases free heap pages; glibc
        // documents it as safe to call at any time from any thread.
        unsafe {
            malloc_trim(0);
        }
    }
}

/// Whether `c` may act on a terminal rather than show on it: a control character (escape
/// sequences, newlines, tabs) or a bidirectional override.
pub fn unsafe_on_terminal(c: char) -> bool {
    c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` as it may be printed to an operator's terminal: control characters (escape
/// sequences, newlines, tabs) and the bidirectional overrides are shown escaped (`\u{1b}`),
/// so a parcel id or zoning code from a feed can neither rewrite the screen nor break a
/// table's rows. Everything else is left as it is.
pub fn terminal_safe(text: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = unsafe_on_terminal;
    if !text.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `s` cut to at most `max` bytes on a character boundary, with `…` when cut (raw feature text
/// kept in quarantine rows).
pub fn truncate_text(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// A tokio runtime (all drivers; `multi_thread` or one thread), or why not as an error. Its
/// signal driver makes a socket pair the first time and panics when it cannot (out of file
/// descriptors: a tester's `ulimit -n 8` ended `run` and `serve` with exit 101 and a
/// backtrace): room for it is made first, so that the caller can say what is wrong, and a
/// panic all the same is returned as an error.
pub fn async_runtime(multi_thread: bool) -> std::io::Result<tokio::runtime::Runtime> {
    // Room for the drivers (a poller, a waker, the signal pair and a margin), made and let go.
    #[cfg(unix)]
    drop((0..4).map(|_| std::os::unix::net::UnixStream::pair()).collect::<std::io::Result<Vec<_>>>()?);
    let build = move || {
        let mut builder = if multi_thread { tokio::runtime::Builder::new_multi_thread() } else { tokio::runtime::Builder::new_current_thread() };
        builder.enable_all().build()
    };
    std::panic::catch_unwind(build).unwrap_or_else(|_| Err(std::io::Error::other("the runtime's drivers could not start (out of file descriptors?)")))
}

/// The folder `path` is in: its parent, or `.` for a bare file name (whose parent is "").
pub fn folder_of(path: &std::path::Path) -> &std::path::Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."))
}

/// Writes `bytes` to `path` through a temp file beside it (`<name>.XXXXXX.tmp`, removed on
/// failure), renamed into place: a reader sees the old file or the whole new one, and a full
/// disk leaves no empty or partial file behind. Its bytes are synced before the rename, so a
/// power cut after it does not leave the name on an empty file either (reviewer).
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut tmp = tempfile::Builder::new().prefix(&format!("{name}.")).suffix(".tmp").tempfile_in(folder_of(path))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_password_in_a_url_is_not_shown() {
        use super::url_for_display as shown;
        assert_eq!(shown("https://alice:s3cret@example.com/hook?x=1"), "https://alice:***@example.com/hook?x=1");
        assert_eq!(shown("http://:pw@example.com/"), "http://:***@example.com/");
        for same in ["https://alice@example.com/", "https://example.com/h", "not a url", ""] {
            assert_eq!(shown(same), same);
        }
        assert_eq!(shown("https://u:pa/ss@host/h"), "https://***@host/h", "one that does not parse");
        assert_eq!(super::without_userinfo("https://host/a@b"), "https://***@b", "a broken URL loses more, never the password");
        assert_eq!(super::without_userinfo("https://host/h?x=a@b"), "https://host/h?x=a@b");
        assert_eq!(super::without_userinfo("no scheme@host"), "no scheme@host");
    }

    use super::*;

    /// The mark is up while the geometry code runs, and down after it, panic or not.
    #[test]
    fn a_caught_geometry_panic_is_marked_while_it_is_caught() {
        assert!(!panic_is_caught_geometry());
        let caught = catch_geometry_panic(|| {
            assert!(panic_is_caught_geometry());
            panic!("degenerate ring")
        });
        assert!(caught.is_err());
        assert!(!panic_is_caught_geometry());
        assert_eq!(catch_geometry_panic(|| 4).ok(), Some(4));
    }

    #[test]
    fn hex_is_lower_case_two_digits_a_byte() {
        assert_eq!(hex(&[]), "");
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff, 0x10]), "000fa5ff10");
    }

    #[test]
    fn durations_parse_and_chain() {
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86_400));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5_400));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("3x").is_err());
        assert!(parse_duration("").is_err());
        assert_eq!(format_duration(Duration::from_secs(3600)), "1h");
        for (ms, text) in [(0, "0ms"), (999, "999ms"), (7_500, "7s500ms"), (99_305_000, "1d3h35m5s"), (5_400_000, "1h30m")] {
            assert_eq!(format_duration(Duration::from_millis(ms)), text);
            assert_eq!(parse_duration(text).unwrap(), Duration::from_millis(ms));
        }
    }

    #[test]
    fn text_from_a_feed_cannot_drive_the_terminal() {
        assert!(matches!(terminal_safe("R-1 Zürich"), std::borrow::Cow::Borrowed("R-1 Zürich")));
        assert_eq!(terminal_safe("EVIL\u{1b}]0;pwned\u{7}\u{1b}[2J"), "EVIL\\u{1b}]0;pwned\\u{7}\\u{1b}[2J");
        assert_eq!(terminal_safe("a\nb\tc\u{202e}d"), "a\\u{a}b\\u{9}c\\u{202e}d");
    }

    #[test]
    fn rfc3339_round_trips() {
        let ms = 1_796_011_981_123;
        let text = rfc3339(ms);
        assert_eq!(parse_rfc3339(&text), Some(ms));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339("1970-01-01T01:00:00+01:00"), Some(0));
        assert_eq!(parse_rfc3339("2024-02-30x"), None);
        // Out of RFC 3339's ranges: refused, not wrapped around (nor a panic).
        for text in ["292277026596-12-04T15:30:08Z", "9223372036854775807-01-01T00:00:00Z", "10000-01-01",
            "2020-01-01T00:00:00+9223372036854775807:00", "2020-01-01T00:00:00+24:00", "2020-01-01T-9223372036854775808:00:00Z", "2020-01-01T01:-5:00Z"] {
            assert_eq!(parse_rfc3339(text), None, "{text}");
        }
        assert_eq!(parse_rfc3339("9999-12-31T23:59:59Z"), Some(253_402_300_799_000));
        // Days a month does not have are refused, not rolled over into the next month.
        for text in ["2020-02-30", "2021-02-29", "1900-02-29", "2026-04-31T00:00:00Z", "2026-11-31", "2026-01-00"] {
            assert_eq!(parse_rfc3339(text), None, "{text}");
        }
        for (text, next_day) in [("2020-02-29", "2020-03-01"), ("2000-02-29", "2000-03-01"), ("2026-12-31", "2027-01-01"), ("2026-04-30", "2026-05-01")] {
            let (a, b) = (parse_rfc3339(text), parse_rfc3339(next_day));
            assert_eq!(a.zip(b).map(|(a, b)| b - a), Some(86_400_000), "{text}");
        }
        assert_eq!(parse_rfc3339("2020-01-01T00:00:00-23:59"), Some(1_577_836_800_000 + 23 * 3_600_000 + 59 * 60_000));
    }
}

