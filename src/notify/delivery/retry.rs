//! When a failed send is tried again: the retry schedule or capped backoff with full jitter,
//! and a receiver's `Retry-After` (seconds or an HTTP date) as a floor.

use crate::config::DeliveryConfig;
use std::time::Duration;

/// `Retry-After` as seconds or an HTTP-date.
pub fn parse_retry_after(v: &str, now_ms: u64) -> Option<Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs.min(86_400)));
    }
    let when = httpdate::parse_http_date(v).ok()?;
    let when_ms = when.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as u64;
    Some(Duration::from_millis(when_ms.saturating_sub(now_ms)).min(Duration::from_secs(86_400)))
}

/// The delay before the next try after `attempts_done` tries, or `None` when the attempts are
/// used up. With a schedule: its `attempts_done`-th delay (its last past its end) ± `retry_jitter`; without: capped
/// exponential backoff with full jitter. `Retry-After` is a floor either way.
pub fn next_retry(cfg: &DeliveryConfig, attempts_done: u32, retry_after: Option<Duration>) -> Option<Duration> {
    if attempts_done >= cfg.max_attempts {
        return None;
    }
    if cfg.retry_schedule.is_empty() {
        return Some(backoff(cfg, attempts_done, retry_after));
    }
    // Past the schedule's end (a `max_attempts` above its length + 1), its last delay again:
    // the attempts configured are made, not cut short silently.
    let base = cfg.retry_delay(attempts_done);
    let j = cfg.retry_jitter.clamp(0.0, 0.99);
    let factor = if j > 0.0 { 1.0 + rand::random_range(-j..=j) } else { 1.0 };
    let d = Duration::from_secs_f64(base.as_secs_f64() * factor);
    Some(match retry_after {
        Some(ra) => d.max(ra),
        None => d,
    })
}

/// Capped exponential backoff with full jitter; `Retry-After` is a floor.
fn backoff(cfg: &DeliveryConfig, attempt: u32, retry_after: Option<Duration>) -> Duration {
    crate::util::full_jitter_backoff(cfg.base_delay, cfg.max_delay, attempt, retry_after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_honours_retry_after() {
        let cfg = DeliveryConfig { base_delay: Duration::from_millis(100), max_delay: Duration::from_millis(1000), ..Default::default() };
        for attempt in 1..30 {
            assert!(backoff(&cfg, attempt, None) <= Duration::from_millis(1000));
        }
        assert!(backoff(&cfg, 1, Some(Duration::from_secs(5))) >= Duration::from_secs(5));
        let now = 1_445_412_470_000; // 2015-10-21T07:27:50Z
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now), Some(Duration::from_secs(10)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now + 60_000), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn schedule_with_jitter_and_retry_after() {
        let cfg = DeliveryConfig::default();
        assert_eq!(cfg.max_attempts, 8);
        let expect = [5u64, 300, 1_800, 7_200, 18_000, 36_000, 36_000];
        for _ in 0..200 {
            for (i, base) in expect.iter().enumerate() {
                let d = next_retry(&cfg, i as u32 + 1, None).unwrap().as_secs_f64();
                let b = *base as f64;
                assert!(d >= b * 0.8 - 1e-9 && d <= b * 1.2 + 1e-9, "retry {} = {d}s", i + 1);
            }
        }
        assert_eq!(next_retry(&cfg, 8, None), None, "7 retries after the first try");
        assert!(next_retry(&cfg, 1, Some(Duration::from_secs(60))).unwrap() >= Duration::from_secs(60));
        // More attempts than the schedule has delays: its last delay again, until they are used.
        let short = DeliveryConfig { retry_schedule: vec![Duration::from_secs(1), Duration::from_secs(2)], max_attempts: 5, retry_jitter: 0.0, ..cfg };
        let delays: Vec<Option<Duration>> = (1..=5).map(|n| next_retry(&short, n, None)).collect();
        assert_eq!(delays, [1, 2, 2, 2].map(|s| Some(Duration::from_secs(s))).into_iter().chain([None]).collect::<Vec<_>>());
    }
}
