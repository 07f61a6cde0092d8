//! Endpoint health, updated in the same transaction as the delivery outcomes: a circuit
//! breaker (opens when at least `breaker_ratio` of at least `breaker_min` recent attempts
//! failed; one half-open probe after `breaker_cooldown`), HTTP 410 disables the endpoint, and
//! an endpoint failing without a success for longer than `disable_after` is disabled. Disable
//! and re-enable are audit rows. A disabled endpoint's events stay in the outbox.

use super::codec::{decode, encode};
use super::runs::{append_audit, codec_err};
use super::tables::*;
use super::{Store, StoreError};
use crate::model::{AuditRow, EndpointState, Outcome};
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};
use std::collections::HashMap;

/// Thresholds for endpoint health (from `[delivery]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HealthPolicy {
    pub breaker_min: usize,
    pub breaker_ratio: f64,
    pub breaker_cooldown_ms: u64,
    pub disable_after_ms: u64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy { breaker_min: 10, breaker_ratio: 0.7, breaker_cooldown_ms: 60_000, disable_after_ms: 5 * 86_400_000 }
    }
}

/// Why an endpoint's entries may not be leased now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Gate {
    Open,
    /// Breaker cool-down over: one probe may go.
    Probe,
    /// Disabled (410, `disable_after`, an operator): held until an operator enables it.
    Disabled,
    /// Breaker open: held until this time (ms), when one probe may go.
    Cooling(u64),
}

/// One endpoint's health, if it has any on record.
pub(super) fn load(t: &impl ReadableTable<&'static str, &'static [u8]>, id: &str) -> Result<Option<EndpointState>, StoreError> {
    match t.get(id)? {
        Some(v) => Ok(Some(decode(v.value()).map_err(|e| codec_err("endpoints", e))?)),
        None => Ok(None),
    }
}

pub(super) fn gate(state: Option<&EndpointState>, now_ms: u64) -> Gate {
    match state {
        None => Gate::Open,
        Some(s) if s.disabled => Gate::Disabled,
        Some(s) => match s.breaker_open_until_ms {
            Some(t) if t > now_ms => Gate::Cooling(t),
            Some(_) => Gate::Probe,
            None => Gate::Open,
        },
    }
}

fn audit_endpoint(wtx: &WriteTransaction, id: &str, outcome: Outcome, detail: String, now_ms: u64) -> Result<(), StoreError> {
    let mut row = endpoint_row(id, outcome, detail, now_ms);
    append_audit(wtx, &mut row)?;
    Ok(())
}

/// The audit row of an endpoint being disabled or enabled (logged too: a disable as a
/// warning, an operator's enable, which is what was asked for, as info).
fn endpoint_row(id: &str, outcome: Outcome, detail: String, now_ms: u64) -> AuditRow {
    if outcome == Outcome::EndpointDisabled {
        tracing::warn!(endpoint = id, "{}: {detail}", outcome.as_str());
    } else {
        tracing::info!(endpoint = id, "{}: {detail}", outcome.as_str());
    }
    AuditRow {
        seq: 0,
        ts_ms: now_ms,
        outcome,
        idempotency_key: None,
        watcher_id: Some(id.to_string()),
        source_id: None,
        parcel_id: None,
        lineage_id: None,
        detail,
    }
}

/// The endpoint states one outcome transaction touches, each read once and written once
/// (a group commit carries thousands of outcomes for a few endpoints; reading, decoding and
/// re-writing an endpoint's record per outcome was measured at ~1% of delivery CPU).
pub(super) struct HealthBatch<'t, 'txn> {
    table: &'t mut redb::Table<'txn, &'static str, &'static [u8]>,
    /// The wall clock's steps forward: not counted as failing time (`clock_forward.rs`).
    steps: std::sync::Arc<[super::ForwardStep]>,
    touched: HashMap<String, EndpointState>,
    /// Endpoints whose gate this batch closed (breaker opened, endpoint disabled).
    closed: Vec<String>,
}

impl<'t, 'txn> HealthBatch<'t, 'txn> {
    pub(super) fn new(table: &'t mut redb::Table<'txn, &'static str, &'static [u8]>, steps: std::sync::Arc<[super::ForwardStep]>) -> Self {
        HealthBatch { table, steps, touched: HashMap::new(), closed: Vec::new() }
    }

    /// Folds one attempt's result into the endpoint's state. `gone` = the endpoint answered
    /// 410. Returns the `endpoint_disabled` audit row to append, in order with the batch's
    /// other rows, when this result disabled the endpoint.
    pub(super) fn observe(&mut self, id: &str, success: bool, gone: bool, now_ms: u64, policy: &HealthPolicy) -> Result<Option<AuditRow>, StoreError> {
        if !self.touched.contains_key(id) {
            // A health record that cannot be read (a damaged page, a bug) starts afresh rather
            // than failing the outcome commit: that would lose every outcome of the group and
            // resend its rows, on every commit that touches this endpoint, for ever.
            let s: EndpointState = match self.table.get(id)? {
                Some(v) => decode(v.value()).unwrap_or_else(|why| {
                    tracing::error!(endpoint = id, "endpoint health record cannot be read ({why}); starting it afresh");
                    EndpointState::default()
                }),
                None => EndpointState::default(),
            };
            self.touched.insert(id.to_string(), s);
        }
        let Some(s) = self.touched.get_mut(id) else { return Ok(None) };
        let was_open = !closes(s, now_ms);
        let row = observe(s, id, success, gone, now_ms, policy, &self.steps);
        if was_open && closes(s, now_ms) && !self.closed.iter().any(|c| c == id) {
            self.closed.push(id.to_string());
        }
        Ok(row)
    }

    /// Writes every touched state back (once each). Returns the endpoints whose gate the
    /// batch closed: a breaker opened (or a half-open probe failed), an endpoint disabled.
    pub(super) fn finish(self) -> Result<Vec<String>, StoreError> {
        for (id, s) in &self.touched {
            self.table.insert(id.as_str(), encode(s).as_slice())?;
        }
        Ok(self.closed)
    }
}

/// Whether the endpoint's state holds its rows back at `now_ms` (disabled, or a breaker
/// open past it; a half-open one lets its probe through).
fn closes(s: &EndpointState, now_ms: u64) -> bool {
    s.disabled || s.breaker_open_until_ms.is_some_and(|t| t > now_ms)
}

/// Folds one attempt's result into an endpoint's state; the `endpoint_disabled` audit row
/// when this result disabled it.
fn observe(s: &mut EndpointState, id: &str, success: bool, gone: bool, now_ms: u64, policy: &HealthPolicy, steps: &[super::ForwardStep]) -> Option<AuditRow> {
    let mut disable: Option<String> = None;
    s.recent.push(success);
    if s.recent.len() > 20 {
        let cut = s.recent.len() - 20;
        s.recent.drain(..cut);
    }
    if success {
        s.last_success_ms = Some(now_ms);
        s.failing_since_ms = None;
        if s.breaker_open_until_ms.take().is_some() {
            s.recent.clear();
            tracing::info!(endpoint = id, "circuit breaker closed after a successful probe");
        }
    } else {
        let since = *s.failing_since_ms.get_or_insert(now_ms);
        if gone {
            disable = Some(crate::notify::delivery::HTTP_410_GONE.into());
        } else if super::elapsed_ms(steps, since, now_ms) > policy.disable_after_ms {
            disable = Some(format!("failing without success since {}", crate::util::rfc3339(since)));
        }
        let failures = s.recent.iter().filter(|ok| !**ok).count();
        let half_open = s.breaker_open_until_ms.is_some_and(|t| t <= now_ms);
        if half_open || (s.recent.len() >= policy.breaker_min && failures as f64 >= policy.breaker_ratio * s.recent.len() as f64) {
            if s.breaker_open_until_ms.is_none() {
                tracing::warn!(endpoint = id, failures, of = s.recent.len(), "circuit breaker opened");
            }
            s.breaker_open_until_ms = Some(now_ms.saturating_add(policy.breaker_cooldown_ms));
        }
    }
    let newly_disabled = disable.is_some() && !s.disabled;
    if let Some(reason) = &disable {
        if !s.disabled {
            s.disabled = true;
            s.disabled_reason = Some(reason.clone());
            s.disabled_at_ms = Some(now_ms);
        }
    }
    if newly_disabled {
        return Some(endpoint_row(id, Outcome::EndpointDisabled, disable.unwrap_or_default(), now_ms));
    }
    None
}

/// The disabled endpoints' states, by id (records that cannot be read are left out).
fn disabled_in(rtx: &redb::ReadTransaction) -> Result<Vec<(String, EndpointState)>, StoreError> {
    let mut out = Vec::new();
    let Some(endpoints) = super::check::open_optional(rtx, ENDPOINTS)? else { return Ok(out) };
    for item in endpoints.iter()? {
        let (k, v) = item?;
        if let Ok(s) = decode::<EndpointState>(v.value()) {
            if s.disabled {
                out.push((k.value().to_string(), s));
            }
        }
    }
    Ok(out)
}

/// Alerts queued for an endpoint that is disabled: they wait for an operator's `endpoints
/// enable` (or a control-port subscriber's new target), and nothing else says so (a tester
/// fixed a config subscriber's target after a 410 and its alerts waited without a word).
#[derive(Debug, Clone, PartialEq)]
pub struct DisabledBacklog {
    /// The subscriber id.
    pub endpoint: String,
    pub reason: Option<String>,
    pub since_ms: Option<u64>,
    /// Alerts waiting for it in the outbox (fresh and retries).
    pub waiting: u64,
}

/// [`DisabledBacklog`] of every disabled endpoint with alerts waiting, by id. Reads only the
/// outbox rows' leading fields, and no outbox row at all when no endpoint is disabled. A row
/// whose leading fields do not decode is left out (`check --store` names it).
pub(super) fn disabled_backlog_in(rtx: &redb::ReadTransaction) -> Result<Vec<DisabledBacklog>, StoreError> {
    let mut disabled: std::collections::BTreeMap<String, DisabledBacklog> = std::collections::BTreeMap::new();
    for (id, s) in disabled_in(rtx)? {
        disabled.insert(id.clone(), DisabledBacklog { endpoint: id, reason: s.disabled_reason, since_ms: s.disabled_at_ms, waiting: 0 });
    }
    if disabled.is_empty() {
        return Ok(Vec::new());
    }
    // (A file older than schema 5 has no retry queue: `check --store` reads backups of any age.)
    for table in [OUTBOX, OUTBOX_RETRY] {
        let Some(rows) = super::check::open_optional(rtx, table)? else { continue };
        for item in rows.iter()? {
            let (_, v) = item?;
            if let Some(b) = super::outbox_rows::entry_watcher(v.value()).ok().and_then(|w| disabled.get_mut(w)) {
                b.waiting += 1;
            }
        }
    }
    Ok(disabled.into_values().filter(|b| b.waiting > 0).collect())
}

impl Store {
    /// Enables each of `subscribers` (config subscribers: id, target) whose endpoint was
    /// disabled for another target than the one it has now (audited `endpoint_enabled`,
    /// saying the target changed), as a control port `PUT` of a new target does: an operator
    /// who fixed the URL in the config after a 410 restarts zonewatch and its alerts go out
    /// (a tester's waited, said by no one). An endpoint disabled before this was recorded
    /// (schema 12 or older), or for the same target, stays disabled until `endpoints enable`.
    /// Writes nothing when there is nothing to enable. Returns the ids enabled.
    pub fn enable_moved_endpoints(&self, subscribers: &[(&str, &str)], now_ms: u64) -> Result<Vec<String>, StoreError> {
        let moved: Vec<(&str, &str, String)> = {
            let rtx = self.db.begin_read()?;
            let Some(targets) = super::check::open_optional(&rtx, ENDPOINT_DISABLED_TARGETS)? else { return Ok(Vec::new()) };
            if redb::ReadableTableMetadata::is_empty(&targets)? {
                return Ok(Vec::new());
            }
            let mut out = Vec::new();
            for (id, target) in subscribers {
                if let Some(was) = targets.get(*id)? {
                    if was.value() != *target {
                        out.push((*id, *target, was.value().to_string()));
                    }
                }
            }
            out
        };
        if moved.is_empty() {
            return Ok(Vec::new());
        }
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut enabled = Vec::new();
        for (id, target, was) in moved {
            // Looked at again under the write lock: an outcome or an operator may have moved
            // it meanwhile.
            let still = wtx.open_table(ENDPOINT_DISABLED_TARGETS)?.get(id)?.is_some_and(|t| t.value() == was);
            if still && enable_in(&wtx, id, Reset::IfDisabled, &moved_detail(" in the config", &was, target), now_ms)? {
                enabled.push(id.to_string());
            }
        }
        // One pass over the retries for every endpoint enabled (it read them once per endpoint).
        retry_now_in(&wtx, &enabled.iter().map(String::as_str).collect::<Vec<_>>(), now_ms)?;
        wtx.commit()?;
        Ok(enabled)
    }

    /// The ids of the endpoints disabled now (a record that cannot be read counts as enabled,
    /// as delivery takes it).
    pub fn disabled_endpoints(&self) -> Result<std::collections::HashSet<String>, StoreError> {
        Ok(disabled_in(&self.db.begin_read()?)?.into_iter().map(|(id, _)| id).collect())
    }

    /// Disabled endpoints with alerts waiting for them ([`DisabledBacklog`]).
    pub fn disabled_backlog(&self) -> Result<Vec<DisabledBacklog>, StoreError> {
        disabled_backlog_in(&self.db.begin_read()?)
    }

    /// Every endpoint with a recorded state, by subscriber id. A record that does not decode
    /// is left out with an error log, so its endpoint is listed as one with no record, which
    /// is how delivery takes it (healthy): failing the whole list failed every `/metrics`
    /// scrape and `GET /v1/endpoints` until the store was mended. `check --store` names it,
    /// and an operator's enable writes a fresh one. Said once an hour at most (every scrape
    /// reads it).
    pub fn endpoints(&self) -> Result<Vec<(String, EndpointState)>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(ENDPOINTS)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (k, v) = item?;
            match decode(v.value()) {
                Ok(s) => out.push((k.value().to_string(), s)),
                Err(e) => {
                    static SAID_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                    if crate::util::now_and_then(&SAID_MS, 3_600_000) {
                        tracing::error!("the health record of endpoint {:?} cannot be read and is left out (delivery takes it as healthy; `zonewatch endpoints enable` writes a new one): {e}", k.value());
                    }
                }
            }
        }
        Ok(out)
    }

    /// Re-enables an endpoint (clears the breaker and its history; audited when it was
    /// disabled) and makes its waiting retries due now. The command line and the control
    /// port both come here, so an operator's enable is the same audit row whichever way it
    /// was asked for.
    pub fn enable_endpoint(&self, id: &str, now_ms: u64) -> Result<EndpointEnabled, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let was_disabled = enable_in(&wtx, id, Reset::Always, ENABLED_BY_OPERATOR, now_ms)?;
        let retries_due_now = retry_now_in(&wtx, &[id], now_ms)?;
        wtx.commit()?;
        Ok(EndpointEnabled { was_disabled, retries_due_now })
    }
}

/// What an operator's [`Store::enable_endpoint`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointEnabled {
    /// It was disabled (an `endpoint_enabled` audit row says it was enabled).
    pub was_disabled: bool,
    /// Its alerts that waited for a later retry and are due now.
    pub retries_due_now: u64,
}

/// Makes every retry of the endpoints `ids` that waits past `now_ms` due at `now_ms`, in `wtx`;
/// returns how many. Why: an operator enables an endpoint, or gives it a new target, when its
/// receiver was mended, and a quiet endpoint (too few attempts to open its breaker) had its
/// alerts waiting out the retry schedule, up to 10 hours, with nothing to send them sooner
/// (found by a black-box tester playing an operator). One pass over the retry rows, in
/// order, decoding only those endpoints' rows (read off each row's head): its cost grows with
/// the retries waiting for every endpoint, paid by an operator's action, not by delivery.
/// A row being sent now is due already, so it is not moved (its outcome rewrites it).
pub(super) fn retry_now_in(wtx: &WriteTransaction, ids: &[&str], now_ms: u64) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let mut retry = wtx.open_table(OUTBOX_RETRY)?;
    let mut later = Vec::new();
    for item in retry.iter()? {
        let (_, v) = item?;
        if super::outbox_rows::entry_watcher(v.value()).is_ok_and(|w| ids.contains(&w)) {
            if let Ok(entry) = super::outbox_rows::decode_entry(v.value()) {
                if entry.next_attempt_ms > now_ms {
                    later.push(entry);
                }
            }
        }
    }
    let mut due = wtx.open_table(OUTBOX_RETRY_DUE)?;
    for entry in &mut later {
        due.remove((entry.next_attempt_ms, entry.id))?;
        entry.next_attempt_ms = now_ms;
        due.insert((now_ms, entry.id), ())?;
        retry.insert(entry.id, super::outbox_rows::encode_entry(entry).as_slice())?;
    }
    Ok(later.len() as u64)
}

/// The `endpoint_enabled` detail of an operator's enable (`zonewatch endpoints enable`,
/// `POST /v1/endpoints/{id}/enable`).
pub const ENABLED_BY_OPERATOR: &str = "enabled by operator";

/// When [`enable_in`] resets an endpoint's health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Reset {
    /// Always (an operator's enable, a control-port subscriber's new target: a breaker and
    /// its history go too).
    Always,
    /// Only when it is disabled (a config subscriber's new target, found as a command opens
    /// the store).
    IfDisabled,
}

/// Re-enables endpoint `id` inside `wtx` (breaker and history cleared, last success kept),
/// with an `endpoint_enabled` audit row saying `detail` when it was disabled. Returns whether
/// it was disabled.
pub(super) fn enable_in(wtx: &WriteTransaction, id: &str, reset: Reset, detail: &str, now_ms: u64) -> Result<bool, StoreError> {
    // The target it was disabled for is forgotten either way (one left by a release that
    // did not keep them would otherwise enable it again for a target change later on).
    wtx.open_table(ENDPOINT_DISABLED_TARGETS)?.remove(id)?;
    let was;
    {
        let mut t = wtx.open_table(ENDPOINTS)?;
        // A record that cannot be read is written again, as a healthy one, which is how
        // delivery took it: an operator's enable is the way to mend it, and failed on it.
        let s: EndpointState = match t.get(id)? {
            Some(v) => decode(v.value()).unwrap_or_else(|e| {
                tracing::warn!("the health record of endpoint {id:?} could not be read ({e}): written anew");
                EndpointState::default()
            }),
            None => EndpointState::default(),
        };
        was = s.disabled;
        if reset == Reset::IfDisabled && !was {
            return Ok(false);
        }
        let s = EndpointState { last_success_ms: s.last_success_ms, ..Default::default() };
        t.insert(id, encode(&s).as_slice())?;
    }
    if was {
        audit_endpoint(wtx, id, Outcome::EndpointEnabled, detail.to_string(), now_ms)?;
    }
    Ok(was)
}

/// Forgets endpoint `id`'s health inside `wtx` (its subscriber was deleted: one created
/// again under the same id starts enabled, with a closed breaker).
pub(super) fn forget_in(wtx: &WriteTransaction, id: &str) -> Result<(), StoreError> {
    wtx.open_table(ENDPOINTS)?.remove(id)?;
    wtx.open_table(ENDPOINT_DISABLED_TARGETS)?.remove(id)?;
    Ok(())
}

/// The `endpoint_enabled` detail of an endpoint enabled because its subscriber's target
/// changed (`how`: "" for a control-port edit, " in the config"), shown without a password
/// (the ledger is kept for ever, and logged too).
pub(super) fn moved_detail(how: &str, from: &str, to: &str) -> String {
    format!(
        "target changed{how} from {} to {}: the endpoint was disabled for the old URL",
        crate::util::url_for_display(from),
        crate::util::url_for_display(to)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::store::{Claim, DeadCause, DeliveryResult, Store};

    /// A health record that cannot be read does not fail the list (`/metrics` and
    /// `GET /v1/endpoints` read it: every scrape answered 500), and an operator's enable
    /// writes it anew instead of failing on it; `check --store` still names it until then.
    #[test]
    fn an_unreadable_health_record_is_listed_as_none_and_mended_by_an_enable() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let wtx = store.db.begin_write().unwrap();
        {
            let mut t = wtx.open_table(ENDPOINTS).unwrap();
            t.insert("bad", [0xFFu8, 0xFF].as_slice()).unwrap();
            t.insert("good", encode(&EndpointState::default()).as_slice()).unwrap();
        }
        wtx.commit().unwrap();
        let listed: Vec<String> = store.endpoints().unwrap().into_iter().map(|(id, _)| id).collect();
        assert_eq!(listed, vec!["good".to_string()]);
        assert!(store.check_consistency().unwrap().problems.iter().any(|p| p.contains("endpoint health record of bad")));
        assert!(!store.enable_endpoint("bad", 5).unwrap().was_disabled, "not known to be disabled");
        assert_eq!(store.endpoints().unwrap().len(), 2, "written anew");
        assert!(store.check_consistency().unwrap().problems.is_empty());
    }

    /// Dead letters count against an endpoint's health only when they are its doing: rows
    /// that never reached it (a refused private address, an unusable target, no subscriber
    /// left) leave its breaker closed and its history empty.
    #[test]
    fn only_the_endpoints_own_dead_letters_count_against_its_health() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let policy = HealthPolicy { breaker_min: 4, ..Default::default() };
        let events: Vec<_> = (0..8).map(|i| sample_event(&format!("P{i}"))).collect();
        for (watcher, cause) in [("local", DeadCause::NotSent), ("remote", DeadCause::Endpoint)] {
            let claims: Vec<Claim> = (0..events.len())
                .map(|i| Claim { event: i, watcher_id: watcher.into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("{watcher}-{i}")) })
                .collect();
            store.enqueue(&events, &claims, "l", 0, 3_600_000).unwrap();
            let dead: Vec<DeliveryResult> = store
                .outbox()
                .unwrap()
                .iter()
                .filter(|e| e.watcher_id == watcher)
                .map(|e| DeliveryResult::Dead { id: e.id, reason: "some reason".into(), cause })
                .collect();
            let closed = store.record_outcomes_with(&dead, &[], 10, Some(&policy)).unwrap().closed;
            // The commit names the endpoint whose breaker it opened (delivery stops sending
            // that endpoint's leased rows: `notify::closed_gates`).
            let expected: &[&str] = if cause == DeadCause::Endpoint { &["remote"] } else { &[] };
            assert_eq!(closed, expected, "{watcher}");
        }
        let states: std::collections::HashMap<String, EndpointState> = store.endpoints().unwrap().into_iter().collect();
        let local = states.get("local").cloned().unwrap_or_default();
        assert!(local.recent.is_empty() && local.breaker_open_until_ms.is_none(), "{local:?}");
        let remote = &states["remote"];
        assert!(remote.recent.iter().all(|ok| !ok) && remote.recent.len() == 8 && remote.breaker_open_until_ms.is_some(), "{remote:?}");
        assert_eq!(store.dead_letters().unwrap().len(), 16, "both are dead letters all the same");
    }

    /// `disable_after` counts the time an endpoint failed, not a step forward of the wall
    /// clock taken meanwhile (`clock_forward.rs`): failing for 20 s across a step of ten years
    /// leaves it enabled, and failing for 20 s more than `disable_after` after it disables it.
    #[test]
    fn disable_after_does_not_count_a_step_forward_of_the_clock() {
        const T: u64 = 1_000_000_000_000;
        const STEP: u64 = 10 * 365 * 86_400_000;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let policy = HealthPolicy { disable_after_ms: 600_000, breaker_min: 1_000, ..Default::default() };
        let claims: Vec<Claim> = (0..3).map(|i| Claim { event: 0, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) }).collect();
        store.enqueue(&[sample_event("A")], &claims, "l", T, 3_600_000).unwrap();
        let ids: Vec<u64> = store.outbox().unwrap().iter().map(|e| e.id).collect();
        let fail = |id: u64, at: u64| store.record_outcomes_with(&[DeliveryResult::Retry { id, next_attempt_ms: at + 1, error: "http_503".into() }], &[], at, Some(&policy)).unwrap();
        assert_eq!(store.watch_clock(T, 0), None);
        fail(ids[0], T);
        assert!(store.watch_clock(T + STEP + 20_000, 20_000).is_some());
        fail(ids[1], T + STEP + 20_000);
        assert!(!store.endpoints().unwrap()[0].1.disabled, "failing for 20 s");
        fail(ids[2], T + STEP + 620_001);
        assert!(store.endpoints().unwrap()[0].1.disabled, "failing for 10 min 1 ms");
    }
}
