//! Subscribers managed through the control port, kept in the store so they survive restarts
//! and travel with a backup. Subscribers from the config file are not stored here.

use super::runs::codec_err;
use super::tables::SUBSCRIBERS;
use super::delivery::{dead_letter_rows, outbox_rows_of, RowsDeadLettered};
use super::endpoints::{enable_in, forget_in, Reset};
use super::{Store, StoreError};
use crate::model::Severity;
use redb::{ReadableDatabase, ReadableTable};
use serde::{Deserialize, Serialize};

/// A subscriber created or edited over the control port. The AOI is kept as the GeoJSON the
/// operator sent (validated before it is stored).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StoredSubscriber {
    pub id: String,
    pub target: String,
    pub secret: Option<String>,
    pub min_severity: Severity,
    pub aoi_geojson: String,
    pub created_ms: u64,
    pub updated_ms: u64,
    /// The secret being rotated out: each delivery is signed with both while it is set, as
    /// a config subscriber's `secret_old` (record version 2; a version 1 record has none).
    pub secret_old: Option<String>,
}

/// The record version of [`StoredSubscriber`] this build writes (2: `secret_old`).
const SUBSCRIBER_RECORD_VERSION: u8 = 2;

/// A [`StoredSubscriber`] as version 1 stored it (before `secret_old`).
#[derive(Deserialize)]
struct StoredSubscriberV1 {
    id: String,
    target: String,
    secret: Option<String>,
    min_severity: Severity,
    aoi_geojson: String,
    created_ms: u64,
    updated_ms: u64,
}

impl From<StoredSubscriberV1> for StoredSubscriber {
    fn from(v: StoredSubscriberV1) -> StoredSubscriber {
        let StoredSubscriberV1 { id, target, secret, min_severity, aoi_geojson, created_ms, updated_ms } = v;
        StoredSubscriber { id, target, secret, min_severity, aoi_geojson, created_ms, updated_ms, secret_old: None }
    }
}

/// A stored subscriber record of either version.
pub(super) fn decode_subscriber(bytes: &[u8]) -> Result<StoredSubscriber, String> {
    super::codec::decode_migrating::<StoredSubscriberV1, _>(bytes, SUBSCRIBER_RECORD_VERSION, "subscribers")
}

fn encode_subscriber(sub: &StoredSubscriber) -> Vec<u8> {
    super::codec::encode_versioned(SUBSCRIBER_RECORD_VERSION, sub)
}

/// The targets of the subscribers managed over the control port as this transaction sees
/// them, read once per subscriber for one outcome commit (only for 410 answers, which are
/// few). A 410 from a target that is no longer its subscriber's (the old URL's, arriving
/// after `PUT` moved the subscriber to a new one) does not disable the endpoint, or it would
/// disable the new, healthy URL; it still counts as a failure for the breaker and
/// `disable_after`. The edit and the outcome are ordered by redb's write lock, so there is
/// no window: either the `PUT` committed first (this sees the new target) or the outcome did
/// (the endpoint was disabled, and the `PUT` re-enables it).
pub(super) struct StoredTargets<'t> {
    wtx: &'t redb::WriteTransaction,
    /// Opened at the first 410 of the commit (most commits have none).
    table: Option<redb::Table<'t, &'static str, &'static [u8]>>,
    seen: std::collections::HashMap<String, Option<String>>,
}

impl<'t> StoredTargets<'t> {
    pub(super) fn new(wtx: &'t redb::WriteTransaction) -> Self {
        StoredTargets { wtx, table: None, seen: Default::default() }
    }

    /// Whether subscriber `id` has moved away from `sent_to`, the target an attempt used: a
    /// stored subscriber whose target is another. False when the attempt's target is not
    /// known, for a config subscriber (not stored; its target changes only with a restart),
    /// and for a record that does not decode (the observation is applied, as before). A
    /// config subscriber that hides a stored one of the same id (`check` warns of it) is
    /// compared with the stored target: its 410s are the failures they otherwise are
    /// (`DeliveryResult::Gone`'s `otherwise`: on the retry schedule).
    pub(super) fn moved_from(&mut self, id: &str, sent_to: Option<&str>) -> Result<bool, StoreError> {
        let Some(sent_to) = sent_to else { return Ok(false) };
        if !self.seen.contains_key(id) {
            let table = match &mut self.table {
                Some(t) => t,
                None => self.table.insert(self.wtx.open_table(SUBSCRIBERS)?),
            };
            let target = match table.get(id)? {
                Some(v) => decode_subscriber(v.value()).ok().map(|s| s.target),
                None => None,
            };
            self.seen.insert(id.to_string(), target);
        }
        Ok(self.seen.get(id).and_then(Option::as_deref).is_some_and(|now| now != sent_to))
    }
}

/// Why the rows of a subscriber deleted over the control port are dead letters (replayable
/// once a subscriber of that id exists again).
pub const SUBSCRIBER_DELETED: &str = "subscriber_deleted";

/// What [`Store::put_subscriber`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriberPut {
    /// The record it replaced (None: created).
    pub previous: Option<StoredSubscriber>,
    /// The endpoint was disabled and the new record changed its target, so it was re-enabled
    /// (the disable was about the old URL).
    pub re_enabled: bool,
    /// The target changed: the alerts waiting for a later retry are due now, to the new one.
    pub retries_due_now: u64,
}

/// What [`Store::delete_subscriber`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SubscriberDeleted {
    /// Its outbox rows dead-lettered `subscriber_deleted`, and those left to a send in flight.
    pub rows: RowsDeadLettered,
}

impl Store {
    /// Every subscriber managed over the control port, by id.
    pub fn stored_subscribers(&self) -> Result<Vec<StoredSubscriber>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(SUBSCRIBERS)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (_, v) = item?;
            out.push(decode_subscriber(v.value()).map_err(|m| codec_err("subscribers", m))?);
        }
        Ok(out)
    }

    /// Up to `n` subscribers managed over the control port with an id after `after`, in id
    /// order, leaving out those `hidden` names (a config subscriber of the same id hides a
    /// stored one). A page of `GET /v1/subscribers`: it read every record, each with its AOI.
    pub fn stored_subscribers_page(&self, after: Option<&str>, n: usize, hidden: impl Fn(&str) -> bool) -> Result<Vec<StoredSubscriber>, StoreError> {
        use std::ops::Bound;
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(SUBSCRIBERS)?;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut out = Vec::new();
        for item in t.range::<&str>((from, Bound::Unbounded))? {
            if out.len() >= n {
                break;
            }
            let (k, v) = item?;
            if !hidden(k.value()) {
                out.push(decode_subscriber(v.value()).map_err(|m| codec_err("subscribers", m))?);
            }
        }
        Ok(out)
    }

    /// The subscriber `id` managed over the control port, if there is one (a point lookup).
    pub fn stored_subscriber(&self, id: &str) -> Result<Option<StoredSubscriber>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(SUBSCRIBERS)?;
        let found = t.get(id)?;
        found.map(|v| decode_subscriber(v.value()).map_err(|m| codec_err("subscribers", m))).transpose()
    }

    /// Inserts or replaces a subscriber. A replacement with another target re-enables its
    /// endpoint if it was disabled (an `endpoint_enabled` audit row naming both URLs), in the
    /// same transaction: the 410 or the failures that disabled it were the old URL's.
    pub fn put_subscriber(&self, sub: &StoredSubscriber, now_ms: u64) -> Result<SubscriberPut, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let previous: Option<StoredSubscriber> = {
            let mut t = wtx.open_table(SUBSCRIBERS)?;
            let prev = match t.get(sub.id.as_str())? {
                Some(v) => Some(decode_subscriber(v.value()).map_err(|m| codec_err("subscribers", m))?),
                None => None,
            };
            t.insert(sub.id.as_str(), encode_subscriber(sub).as_slice())?;
            prev
        };
        let mut retries_due_now = 0;
        let re_enabled = match &previous {
            // The new target starts with a closed breaker too: the failures that opened it
            // were the old URL's (the alerts made due now waited out its cool-down).
            Some(p) if p.target != sub.target => {
                retries_due_now = super::endpoints::retry_now_in(&wtx, &[sub.id.as_str()], now_ms)?;
                enable_in(&wtx, &sub.id, Reset::Always, &super::endpoints::moved_detail("", &p.target, &sub.target), now_ms)?
            }
            Some(_) => false,
            // A new subscriber starts enabled: health left under its id (a send to a deleted
            // subscriber that answered after the delete, or a config subscriber of that id
            // removed while disabled) was another endpoint's.
            None => enable_in(&wtx, &sub.id, Reset::Always, "a new subscriber of this id: the earlier endpoint's state does not apply", now_ms)?,
        };
        wtx.commit()?;
        Ok(SubscriberPut { previous, re_enabled, retries_due_now })
    }

    /// Deletes a subscriber (None: there was none). In the same transaction its endpoint
    /// health is forgotten and every outbox row queued for it is dead-lettered
    /// `subscriber_deleted` (each with its terminal audit row), so none waits forever for a
    /// subscriber that no longer exists; rows whose send has begun are left to that send's
    /// outcome (see [`RowsDeadLettered`]), and a row leased but not yet sending is
    /// dead-lettered and never sent.
    pub fn delete_subscriber(&self, id: &str, now_ms: u64) -> Result<Option<SubscriberDeleted>, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        // When it was created (a record that cannot be read: from the start).
        let created_ms = wtx.open_table(SUBSCRIBERS)?.remove(id)?.map(|v| decode_subscriber(v.value()).map(|s| s.created_ms).unwrap_or(0));
        let Some(created_ms) = created_ms else {
            wtx.abort()?;
            return Ok(None);
        };
        forget_in(&wtx, id)?;
        mark_letters_of_deleted(&wtx, id, created_ms)?;
        // Its rows are found before the lease lock is taken (lease passes are not stalled by
        // a scan of the whole outbox); which of them are in flight is asked under it, and
        // the lock is held through the commit (see `Leases::while_held`).
        let queued = outbox_rows_of(&wtx, id)?;
        // A row leased but not yet sending is dead-lettered too, and its send never begins.
        let rows = self.leases.while_held(move |sending| -> Result<(RowsDeadLettered, Vec<u64>, Vec<u64>), StoreError> {
            let rows = dead_letter_rows(&wtx, queued, SUBSCRIBER_DELETED, now_ms, sending)?;
            wtx.commit()?;
            Ok(rows)
        })?;
        Ok(Some(SubscriberDeleted { rows }))
    }
}

/// Whether a dead letter's reason says its subscriber was deleted over the control port: the
/// rows dead-lettered by the delete, and the letters it already had ([`mark_letters_of_deleted`]).
pub(super) fn deleted_reason(reason: &str) -> bool {
    reason.strip_prefix(SUBSCRIBER_DELETED).is_some_and(|rest| rest.is_empty() || rest.starts_with(" (was "))
}

/// A dead letter's reason once its subscriber was deleted, the reason it had kept after it
/// (`subscriber_deleted (was retries_exhausted)`): what [`deleted_reason`] recognises.
pub(super) fn marked_deleted(reason: &str) -> String {
    format!("{SUBSCRIBER_DELETED} (was {reason})")
}

/// In a delete's transaction: the subscriber's dead letters (of any reason) say it was
/// deleted, their reason kept after it (`subscriber_deleted (was retries_exhausted)`). A
/// replay then sets them aside should a config subscriber take the id, which has no creation
/// time to compare with (bb28: such letters went to the new target). The delete is refused
/// while a config subscriber has the id; a letter queued before the deleted one was created
/// (`created_ms`) is an earlier subscriber's of that id, and is left as it is (a reviewer).
/// Each letter's subscriber is read off its leading fields; only its own are decoded whole.
fn mark_letters_of_deleted(wtx: &redb::WriteTransaction, id: &str, created_ms: u64) -> Result<(), StoreError> {
    let mut letters = wtx.open_table(super::tables::DEAD_LETTERS)?;
    let mut marked: Vec<(u64, crate::model::DeadLetter)> = Vec::new();
    for item in letters.iter()? {
        let (k, v) = item?;
        if super::outbox_rows::entry_watcher(v.value()).ok() != Some(id) {
            continue;
        }
        // One that cannot be read is left as it is (`check --store` names it).
        let Ok(mut dead) = super::outbox_rows::decode_dead(v.value()) else { continue };
        if dead.entry.created_ms >= created_ms && !deleted_reason(&dead.reason) {
            dead.reason = marked_deleted(&dead.reason);
            marked.push((k.value(), dead));
        }
    }
    for (key, dead) in &marked {
        letters.insert(*key, super::outbox_rows::encode_dead(dead).as_slice())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LeaseStep;

    /// A store with control-port subscriber `a` and `n` alerts queued for it.
    fn store_with_queued(n: usize) -> (tempfile::TempDir, Store) {
        use crate::model::{sample_event, IdemKey};
        use crate::store::Claim;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let sub = StoredSubscriber { id: "a".into(), target: "https://h/".into(), secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: 1, updated_ms: 1, secret_old: None };
        store.put_subscriber(&sub, 1).unwrap();
        let events: Vec<_> = (0..n).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..n).map(|i| Claim { event: i, watcher_id: "a".into(), target: "https://h/".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) }).collect();
        store.enqueue(&events, &claims, "l", 1_000, 3_600_000).unwrap();
        (dir, store)
    }

    /// A subscriber deleted while its rows are leased: the row whose send has begun is left
    /// to its outcome; those leased but not yet sending are dead-lettered `subscriber_deleted`
    /// and their sends never begin (a tester's `DELETE` counted 40 rows in flight where 8
    /// were sending, and the other 32 then went out).
    #[test]
    fn a_delete_dead_letters_rows_leased_but_not_yet_sending() {
        let (_dir, store) = store_with_queued(3);
        let batch = store.lease_due(2_000, 60_000, 10, 0).unwrap();
        let ids: Vec<u64> = batch.entries.iter().map(|e| e.id).collect();
        assert_eq!(ids.len(), 3);
        assert!(store.lease_step(ids[0], batch.lease_until_ms, LeaseStep::BeginSend));
        let deleted = store.delete_subscriber("a", 3_000).unwrap().unwrap();
        assert_eq!((deleted.rows.dead_lettered, deleted.rows.in_flight), (2, 1));
        assert!(!store.lease_step(ids[1], batch.lease_until_ms, LeaseStep::BeginSend) && !store.lease_step(ids[2], batch.lease_until_ms, LeaseStep::BeginSend), "their sends never begin");
        assert_eq!(store.outbox_len().unwrap(), 1, "the row being sent waits for its outcome");
        assert_eq!(store.dead_letters().unwrap().len(), 2);
    }

    /// Rows a delete left to their sends: an answer that would leave one queued (a retry, a
    /// deferral) dead-letters it `subscriber_deleted`, and no pass leases them meanwhile,
    /// their leases expired and a subscriber of that id created again (reviewer: such a row
    /// went to the new subscriber's target); an answer that dead-letters it says the delete
    /// too (`subscriber_deleted (was http_400)`), as the letters the delete found say it.
    #[test]
    fn rows_a_delete_left_to_their_sends_are_never_queued_again() {
        use crate::store::{DeadCause, DeliveryResult};
        let (_dir, store) = store_with_queued(4);
        let batch = store.lease_due(2_000, 1, 10, 0).unwrap();
        let ids: Vec<u64> = batch.entries.iter().map(|e| e.id).collect();
        for id in &ids {
            assert!(store.lease_step(*id, batch.lease_until_ms, LeaseStep::BeginSend));
        }
        let deleted = store.delete_subscriber("a", 3_000).unwrap().unwrap();
        assert_eq!((deleted.rows.dead_lettered, deleted.rows.in_flight), (0, 4));
        let again = StoredSubscriber { id: "a".into(), target: "https://new/".into(), secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: 4_000, updated_ms: 4_000, secret_old: None };
        store.put_subscriber(&again, 4_000).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(store.lease_due(5_000, 60_000, 10, 0).unwrap().entries.is_empty(), "not leased while their sends' outcomes are awaited");
        let results = [
            DeliveryResult::Retry { id: ids[0], next_attempt_ms: 9_000, error: "http_503".into() },
            DeliveryResult::Deferred { id: ids[1], next_attempt_ms: 9_000, error: "EMFILE".into() },
            DeliveryResult::Sent { id: ids[2], status: 200 },
            DeliveryResult::Dead { id: ids[3], reason: "http_400".into(), cause: DeadCause::Endpoint },
        ];
        store.record_outcomes(&results, &[], 6_000).unwrap();
        assert_eq!(store.outbox_len().unwrap(), 0, "none left queued for the new subscriber");
        let dead = store.dead_letters().unwrap();
        let was_400 = format!("{SUBSCRIBER_DELETED} (was http_400)");
        assert_eq!(dead.iter().map(|d| (d.entry.id, d.reason.as_str())).collect::<Vec<_>>(), vec![(ids[0], SUBSCRIBER_DELETED), (ids[1], SUBSCRIBER_DELETED), (ids[3], was_400.as_str())]);
        assert_eq!(dead.iter().map(|d| d.entry.attempts).collect::<Vec<_>>(), vec![1, 0, 1], "a deferral was no attempt");
        let report = store.check_consistency().unwrap();
        assert!(report.is_consistent(), "{:?}", report.problems);
    }

    /// A delete marks only the letters queued since the deleted subscriber was created: one an
    /// earlier subscriber of the id left (a config one, say) stays as it was (a reviewer).
    #[test]
    fn a_delete_leaves_an_earlier_subscribers_letters_as_they_were() {
        use crate::model::{sample_event, IdemKey};
        use crate::store::{Claim, DeadCause, DeliveryResult};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let claim = |k: &str| Claim { event: 0, watcher_id: "a".into(), target: "https://h/".into(), min_severity: Severity::Info, key: IdemKey(k.into()) };
        store.enqueue(&[sample_event("P0")], &[claim("old")], "l", 1_000, 3_600_000).unwrap();
        let id = store.outbox().unwrap()[0].id;
        store.record_outcomes_with(&[DeliveryResult::Dead { id, reason: "retries_exhausted".into(), cause: DeadCause::NotSent }], &[], 1_500, None).unwrap();
        let sub = StoredSubscriber { id: "a".into(), target: "https://h/".into(), secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: 2_000, updated_ms: 2_000, secret_old: None };
        store.put_subscriber(&sub, 2_000).unwrap();
        store.enqueue(&[sample_event("P1")], &[claim("new")], "l", 2_500, 3_600_000).unwrap();
        let id = store.outbox().unwrap()[0].id;
        store.record_outcomes_with(&[DeliveryResult::Dead { id, reason: "retries_exhausted".into(), cause: DeadCause::NotSent }], &[], 2_600, None).unwrap();
        store.delete_subscriber("a", 3_000).unwrap().unwrap();
        let mut reasons: Vec<(String, String)> = store.dead_letters().unwrap().into_iter().map(|d| (d.entry.key.0, d.reason)).collect();
        reasons.sort();
        assert_eq!(reasons, [("new".to_string(), format!("{SUBSCRIBER_DELETED} (was retries_exhausted)")), ("old".to_string(), "retries_exhausted".to_string())]);
    }

    /// A subscriber created under a deleted one's id does not inherit its alerts: a replay
    /// quarantines the dead letters queued before it was created (`subscriber_recreated`),
    /// those the delete made and those its predecessor had already, each audited; released,
    /// one is this subscriber's and replays (an integrator's fleet-wide replay sent them to
    /// the new customer's target, bb25).
    #[test]
    fn a_replay_does_not_send_a_deleted_subscribers_alerts_to_one_created_again() {
        let (_dir, store) = store_with_queued(2);
        let deleted = store.delete_subscriber("a", 3_000).unwrap().unwrap();
        assert_eq!(deleted.rows.dead_lettered, 2);
        let again = StoredSubscriber { id: "a".into(), target: "https://other-customer/".into(), secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: 4_000, updated_ms: 4_000, secret_old: None };
        store.put_subscriber(&again, 4_000).unwrap();
        let ids: Vec<u64> = store.dead_letters().unwrap().iter().map(|d| d.entry.id).collect();
        for id in &ids {
            match store.replay_dead_letter(*id, 5_000, 3, Ok(())).unwrap() {
                crate::store::ReplayOutcome::Quarantined { reason } => assert!(reason.starts_with(crate::store::SUBSCRIBER_RECREATED), "{reason}"),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(store.outbox_len().unwrap(), 0, "nothing queued for the new subscriber");
        store.release_quarantined(&ids[..1], 6_000).unwrap();
        assert!(matches!(store.replay_dead_letter(ids[0], 7_000, 3, Ok(())).unwrap(), crate::store::ReplayOutcome::Requeued { .. }), "released: this subscriber's");
        // A deleted subscriber's id taken by the config file (a config subscriber has no
        // creation time, and no stored record): its letters are set aside too, those the
        // delete made and those it had already (marked by the delete, their reason kept).
        let (_dir2, other) = store_with_queued(2);
        let before = other.outbox().unwrap()[0].id;
        let dead = crate::store::DeliveryResult::Dead { id: before, reason: "retries_exhausted".into(), cause: crate::store::DeadCause::Endpoint };
        other.record_outcomes_with(&[dead], &[], 2_500, None).unwrap();
        other.delete_subscriber("a", 3_000).unwrap().unwrap();
        let mut reasons: Vec<String> = other.dead_letters().unwrap().into_iter().map(|d| d.reason).collect();
        reasons.sort();
        assert_eq!(reasons, [SUBSCRIBER_DELETED.to_string(), format!("{SUBSCRIBER_DELETED} (was retries_exhausted)")]);
        for d in other.dead_letters().unwrap() {
            assert!(matches!(other.replay_dead_letter(d.entry.id, 5_000, 3, Ok(())).unwrap(), crate::store::ReplayOutcome::Quarantined { reason } if reason.contains("now names another")), "{}", d.reason);
        }
        assert_eq!(other.outbox_len().unwrap(), 0);
        let report = store.check_consistency().unwrap();
        assert!(report.is_consistent(), "{:?}", report.problems);
    }

    /// A delete that runs between a send's outcome commit and the release of its lease (the
    /// lease marked settling) takes the row as the commit left it: a retry's row is
    /// dead-lettered, not counted in flight and marked revoked, whose mark the release would
    /// then drop (a second reader's race). What this shows is the rule (a settling row is not
    /// sending), on a row whose outcome is not committed; the commit-then-delete interleaving
    /// itself has no hook to be stopped at between the two.
    #[test]
    fn a_delete_takes_a_settling_row_as_not_sending() {
        let (_dir, store) = store_with_queued(1);
        let batch = store.lease_due(2_000, 60_000, 10, 0).unwrap();
        let id = batch.entries[0].id;
        assert!(store.lease_step(id, batch.lease_until_ms, LeaseStep::BeginSend));
        store.leases.mark_settling(&[id], true);
        let deleted = store.delete_subscriber("a", 3_000).unwrap().unwrap();
        assert_eq!((deleted.rows.dead_lettered, deleted.rows.in_flight), (1, 0));
        assert_eq!(store.outbox_len().unwrap(), 0);
        assert_eq!(store.dead_letters().unwrap()[0].reason, SUBSCRIBER_DELETED);
    }

    /// A lease taken over after it expired keeps saying its row's send began (its outcome
    /// may not be committed yet): a delete then leaves the row to it (second reader), and the
    /// take-over's own send never begins, nor does giving it back drop the mark: the row would
    /// have gone to a subscriber of that id created meanwhile (a reviewer). The earlier send's
    /// outcome settles it.
    #[test]
    fn a_lease_taken_over_keeps_its_send_begun() {
        use crate::store::DeliveryResult;
        let (_dir, store) = store_with_queued(1);
        let first = store.lease_due(2_000, 1, 10, 0).unwrap();
        let id = first.entries[0].id;
        assert!(store.lease_step(id, first.lease_until_ms, LeaseStep::BeginSend));
        std::thread::sleep(std::time::Duration::from_millis(5));
        let again = store.lease_due(3_000, 60_000, 10, 0).unwrap();
        assert_eq!(again.entries.len(), 1, "the expired lease is taken over");
        let deleted = store.delete_subscriber("a", 4_000).unwrap().unwrap();
        assert_eq!((deleted.rows.dead_lettered, deleted.rows.in_flight), (0, 1));
        let created = StoredSubscriber { id: "a".into(), target: "https://new/".into(), secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: 4_500, updated_ms: 4_500, secret_old: None };
        store.put_subscriber(&created, 4_500).unwrap();
        assert!(!store.lease_step(id, again.lease_until_ms, LeaseStep::BeginSend), "the take-over does not send");
        assert!(store.lease_step(id, again.lease_until_ms, LeaseStep::GiveBack));
        assert!(store.lease_due(5_000, 60_000, 10, 0).unwrap().entries.is_empty(), "still the earlier send's");
        store.record_outcomes(&[DeliveryResult::Retry { id, next_attempt_ms: 9_000, error: "http_503".into() }], &[], 6_000).unwrap();
        assert_eq!(store.outbox_len().unwrap(), 0, "not queued again for the new subscriber");
        assert_eq!(store.dead_letters().unwrap()[0].reason, SUBSCRIBER_DELETED);
    }

    /// An expired lease whose outcome is being committed is not taken over (a fourth reader:
    /// a pass whose snapshot predates the commit took it over, and the row went out again);
    /// once the marks are cleared (a commit that failed) it is.
    #[test]
    fn a_settling_lease_is_not_taken_over() {
        let (_dir, store) = store_with_queued(1);
        let first = store.lease_due(2_000, 1, 10, 0).unwrap();
        let id = first.entries[0].id;
        assert!(store.lease_step(id, first.lease_until_ms, LeaseStep::BeginSend));
        store.leases.mark_settling(&[id], true);
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(store.lease_due(3_000, 60_000, 10, 0).unwrap().entries.is_empty(), "settling: not taken over");
        store.leases.mark_settling(&[id], false);
        assert_eq!(store.lease_due(3_000, 60_000, 10, 0).unwrap().entries.len(), 1, "unmarked: taken over");
    }

    /// A record written before `secret_old` (version 1) reads as one without it; this
    /// build's records carry it.
    /// Alerts that wait for a later retry are due at once when an operator enables their
    /// endpoint (the receiver is mended) or gives it a new target; another endpoint's stay
    /// where they were. A quiet endpoint's alerts waited out the schedule, hours, with
    /// nothing to send them sooner.
    #[test]
    fn an_enable_or_a_new_target_makes_the_waiting_retries_due_now() {
        use crate::store::DeliveryResult;
        let (_dir, store) = store_with_queued(3);
        let rows: Vec<u64> = store.outbox().unwrap().iter().map(|e| e.id).collect();
        let later = 10 * 3_600_000;
        let retry = |id: u64, at: u64| DeliveryResult::Retry { id, next_attempt_ms: at, error: "connection: refused".into() };
        // Two retries far off, one of them of another endpoint's row (written as `b`'s).
        let mut other = store.outbox().unwrap().remove(2);
        other.watcher_id = "b".into();
        let wtx = store.db.begin_write().unwrap();
        wtx.open_table(crate::store::tables::OUTBOX).unwrap().insert(other.id, super::super::outbox_rows::encode_entry(&other).as_slice()).unwrap();
        wtx.commit().unwrap();
        store.record_outcomes(&[retry(rows[0], later), retry(rows[1], later), retry(rows[2], later)], &[], 2_000).unwrap();
        assert_eq!(store.next_due_ms().unwrap(), Some(later));
        let done = store.enable_endpoint("a", 3_000).unwrap();
        assert_eq!((done.was_disabled, done.retries_due_now), (false, 2));
        let due: Vec<(u64, String)> = store.outbox().unwrap().iter().map(|e| (e.next_attempt_ms, e.watcher_id.clone())).collect();
        assert!(due.contains(&(3_000, "a".into())) && due.contains(&(later, "b".into())) && due.len() == 3, "{due:?}");
        assert_eq!(store.enable_endpoint("a", 3_500).unwrap().retries_due_now, 0, "nothing waits past now");
        store.record_outcomes(&[retry(rows[0], later), retry(rows[1], later)], &[], 4_000).unwrap();
        let mut sub = store.stored_subscriber("a").unwrap().unwrap();
        sub.target = "https://mended/".into();
        assert_eq!(store.put_subscriber(&sub, 5_000).unwrap().retries_due_now, 2);
        sub.min_severity = Severity::Notice;
        assert_eq!(store.put_subscriber(&sub, 6_000).unwrap().retries_due_now, 0, "the same target: nothing moves");
        assert!(store.check_consistency().unwrap().problems.is_empty(), "{:?}", store.check_consistency().unwrap().problems);
    }

    #[test]
    fn a_version_1_subscriber_record_reads_without_a_secret_old() {
        #[derive(Serialize)]
        struct V1<'a> {
            id: &'a str,
            target: &'a str,
            secret: Option<&'a str>,
            min_severity: Severity,
            aoi_geojson: &'a str,
            created_ms: u64,
            updated_ms: u64,
        }
        let old = V1 { id: "w", target: "https://h/", secret: Some("whsec_x"), min_severity: Severity::Material, aoi_geojson: "{}", created_ms: 1, updated_ms: 2 };
        let bytes = super::super::codec::encode(&old);
        assert_eq!(bytes[0], 1);
        let read = decode_subscriber(&bytes).unwrap();
        let want = StoredSubscriber {
            id: "w".into(),
            target: "https://h/".into(),
            secret: Some("whsec_x".into()),
            min_severity: Severity::Material,
            aoi_geojson: "{}".into(),
            created_ms: 1,
            updated_ms: 2,
            secret_old: None,
        };
        assert_eq!(read, want);
        let now = StoredSubscriber { secret_old: Some("whsec_y".into()), ..want };
        let bytes = encode_subscriber(&now);
        assert_eq!(bytes[0], SUBSCRIBER_RECORD_VERSION);
        assert_eq!(decode_subscriber(&bytes).unwrap(), now);
    }
}
