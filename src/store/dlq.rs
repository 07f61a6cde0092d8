//! Dead-letter replay and quarantine. A replay re-queues a dead letter under its **original**
//! idempotency key and body (so a receiver that already has it drops it by `webhook-id`), in
//! the same transaction that audits it; a key the ledger already shows as `sent` is absorbed
//! as a `duplicate`; a dead letter replayed more than `max_replays` times, or whose geometry no
//! longer validates, is moved to the delivery quarantine for a person.

use super::codec::decode;
use super::runs::{append_audit, codec_err};
use super::tables::*;
use super::{Store, StoreError};
use crate::model::*;
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};

/// What one replay did.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayOutcome {
    /// Back in the outbox as entry `outbox_id`; this is replay number `replay`.
    Requeued { outbox_id: u64, replay: u32 },
    /// The ledger already shows the key as delivered: nothing re-sent.
    Duplicate,
    /// Set aside for a person.
    Quarantined { reason: String },
    /// No dead letter with that id.
    NotFound,
}

fn next_outbox_id(wtx: &WriteTransaction) -> Result<u64, StoreError> {
    let mut meta = wtx.open_table(META)?;
    let next = meta
        .get(META_NEXT_OUTBOX_ID)?
        .map(|v| {
            let mut b = [0u8; 8];
            let n = v.value().len().min(8);
            b[..n].copy_from_slice(&v.value()[..n]);
            u64::from_le_bytes(b)
        })
        .unwrap_or(1);
    meta.insert(META_NEXT_OUTBOX_ID, (next + 1).to_le_bytes().as_slice())?;
    Ok(next)
}

fn key_was_sent(wtx: &WriteTransaction, key: &str) -> Result<bool, StoreError> {
    // The ledger is the proof: any `sent` row for this key means it was delivered.
    let audit = wtx.open_table(AUDIT)?;
    for item in audit.iter()? {
        let (_, v) = item?;
        let row: AuditRow = decode(v.value()).map_err(|m| codec_err("audit", m))?;
        if row.outcome == Outcome::Sent && row.idempotency_key.as_deref() == Some(key) {
            return Ok(true);
        }
    }
    Ok(false)
}

impl Store {
    /// Replays dead letter `id` (see the module doc). `geometry` is the caller's re-validation
    /// of the payload geometry. One transaction.
    pub fn replay_dead_letter(
        &self,
        id: u64,
        now_ms: u64,
        max_replays: u32,
        geometry: Result<(), String>,
    ) -> Result<ReplayOutcome, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let dl: DeadLetter = {
            let t = wtx.open_table(DEAD_LETTERS)?;
            let Some(v) = t.get(id)? else {
                drop(t);
                wtx.abort()?;
                return Ok(ReplayOutcome::NotFound);
            };
            super::outbox_rows::decode_dead(v.value()).map_err(|m| codec_err("dead_letters", m))?
        };
        let e = &dl.entry;
        let mut audit = AuditRow::for_entry(e, Outcome::Duplicate, now_ms, String::new());
        let replays = wtx.open_table(DLQ_REPLAYS)?.get(e.key.0.as_str())?.map(|v| v.value()).unwrap_or(0);
        let outcome = if key_was_sent(&wtx, &e.key.0)? {
            wtx.open_table(DEAD_LETTERS)?.remove(id)?;
            audit.detail = format!("replay of dead letter {id}: already delivered");
            ReplayOutcome::Duplicate
        } else if let Err(reason) = geometry.map_err(|m| format!("invalid_geometry: {m}")).and_then(|_| {
            if replays >= max_replays {
                Err(format!("replayed {replays} times (max_replays {max_replays})"))
            } else {
                Ok(())
            }
        }) {
            wtx.open_table(DEAD_LETTERS)?.remove(id)?;
            let q = DeadLetter { entry: e.clone(), reason: reason.clone(), dead_at_ms: now_ms };
            wtx.open_table(DLQ_QUARANTINE)?.insert(id, super::outbox_rows::encode_dead(&q).as_slice())?;
            audit.outcome = Outcome::Quarantined;
            audit.detail = format!("dead letter {id}: {reason}");
            ReplayOutcome::Quarantined { reason }
        } else {
            wtx.open_table(DEAD_LETTERS)?.remove(id)?;
            let new_id = next_outbox_id(&wtx)?;
            let entry = OutboxEntry {
                id: new_id,
                attempts: 0,
                created_ms: now_ms,
                next_attempt_ms: now_ms,
                last_error: None,
                ..e.clone()
            };
            wtx.open_table(OUTBOX)?.insert(new_id, super::outbox_rows::encode_entry(&entry).as_slice())?;
            // Replays queue behind live alerts.
            wtx.open_table(OUTBOX_RETRY_DUE)?.insert((now_ms, new_id), ())?;
            wtx.open_table(DLQ_REPLAYS)?.insert(e.key.0.as_str(), replays + 1)?;
            super::idem::repoint(&self.key_index, &wtx, &e.key.0, new_id)?;
            audit.outcome = Outcome::Queued;
            audit.detail = format!("replay {} of dead letter {id}", replays + 1);
            ReplayOutcome::Requeued { outbox_id: new_id, replay: replays + 1 }
        };
        append_audit(&wtx, &mut audit)?;
        wtx.commit()?;
        Ok(outcome)
    }

    /// Dead letters set aside for a person (replayed too often, invalid geometry).
    pub fn dlq_quarantine(&self) -> Result<Vec<DeadLetter>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(DLQ_QUARANTINE)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (_, v) = item?;
            out.push(super::outbox_rows::decode_dead(v.value()).map_err(|m| codec_err("dlq_quarantine", m))?);
        }
        Ok(out)
    }

    /// How many times the dead letter of `key` was replayed.
    pub fn replay_count(&self, key: &str) -> Result<u32, StoreError> {
        let rtx = self.db.begin_read()?;
        Ok(rtx.open_table(DLQ_REPLAYS)?.get(key)?.map(|v| v.value()).unwrap_or(0))
    }
}
