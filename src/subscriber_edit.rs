//! Editing the control port's subscribers while the engine runs.
//!
//! A `POST`/`PUT`/`DELETE /v1/subscribers` changes the store and the live subscriber index.
//! Both happen under one [`SubscriberEdit`], so two edits cannot interleave: without it, two
//! creates of one id could both pass the "does it exist" check, and two edits could reach the
//! store in one order and the index in the other (the index then matching for a definition
//! the store no longer has). The index is changed by one subscriber ([`IndexEdit`]); the
//! other subscribers' AOIs, parsed and checked when they were loaded, are not read again, so
//! an edit costs one index build however many subscribers there are, and a config AOI file
//! edited on disk since the start cannot fail an unrelated edit. An edit cannot fail once
//! its store transaction has committed: the answer never says "error" for a change that was
//! made.

use crate::notify::matcher::{IndexEdit, Subscriber};
use crate::pipeline::{Engine, PipelineError};
use crate::store::{StoredSubscriber, SubscriberDeleted, SubscriberPut};
use geo::MultiPolygon;

/// The turn to change the control port's subscribers: held from the first read of the one
/// being edited to the index's swap.
pub struct SubscriberEdit<'a> {
    engine: &'a Engine,
    index: IndexEdit<'a>,
}

impl Engine {
    /// Waits for the turn to edit the control port's subscribers (see the module doc).
    pub fn edit_subscribers(&self) -> SubscriberEdit<'_> {
        SubscriberEdit { engine: self, index: self.subscribers.edit() }
    }
}

impl SubscriberEdit<'_> {
    /// The stored subscriber `id`, read within the edit.
    pub fn stored(&self, id: &str) -> Result<Option<StoredSubscriber>, PipelineError> {
        Ok(self.engine.store.stored_subscriber(id)?)
    }

    /// Stores `rec` (its `aoi` already parsed and checked from `rec.aoi_geojson`) and puts it
    /// in the index. A config subscriber of the same id keeps the index's place (the config
    /// file wins, as at start); the control port refuses such an edit before it gets here.
    pub fn put(&self, rec: &StoredSubscriber, aoi: MultiPolygon<f64>) -> Result<SubscriberPut, PipelineError> {
        let put = self.engine.store.put_subscriber(rec, self.engine.now())?;
        if !self.engine.config.has_subscriber(&rec.id) {
            self.index.upsert(Subscriber {
                id: rec.id.clone(),
                target: rec.target.clone(),
                secret: rec.secret.clone(),
                min_severity: rec.min_severity,
                aoi,
                secret_old: rec.secret_old.clone(),
            });
        }
        Ok(put)
    }

    /// Deletes the stored subscriber `id` (its queued events dead-lettered in the same
    /// transaction: [`crate::store::Store::delete_subscriber`]) and takes it out of the index.
    /// `None`: there was none.
    pub fn delete(&self, id: &str) -> Result<Option<SubscriberDeleted>, PipelineError> {
        let deleted = self.engine.store.delete_subscriber(id, self.engine.now())?;
        if deleted.is_some() && !self.engine.config.has_subscriber(id) {
            self.index.remove(id);
        }
        Ok(deleted)
    }
}
