//! Subscribers managed through the control port, kept in the store so they survive restarts
//! and travel with a backup. Subscribers from the config file are not stored here.

use super::codec::{decode, encode};
use super::runs::codec_err;
use super::tables::SUBSCRIBERS;
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
}

impl Store {
    pub fn stored_subscribers(&self) -> Result<Vec<StoredSubscriber>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(SUBSCRIBERS)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (_, v) = item?;
            out.push(decode(v.value()).map_err(|m| codec_err("subscribers", m))?);
        }
        Ok(out)
    }

    /// Inserts or replaces a subscriber; returns the previous record.
    pub fn put_subscriber(&self, sub: &StoredSubscriber) -> Result<Option<StoredSubscriber>, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let prev = {
            let mut t = wtx.open_table(SUBSCRIBERS)?;
            let prev = match t.get(sub.id.as_str())? {
                Some(v) => Some(decode(v.value()).map_err(|m| codec_err("subscribers", m))?),
                None => None,
            };
            t.insert(sub.id.as_str(), encode(sub).as_slice())?;
            prev
        };
        wtx.commit()?;
        Ok(prev)
    }

    /// Deletes a subscriber; true when it existed.
    pub fn delete_subscriber(&self, id: &str) -> Result<bool, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let existed = wtx.open_table(SUBSCRIBERS)?.remove(id)?.is_some();
        wtx.commit()?;
        Ok(existed)
    }
}
