//! Subscriber matching: an R-tree over AOI bounding rectangles finds candidates, then an exact
//! `geo` intersects test against the old and the new parcel geometry decides. (geo 0.33 does
//! not implement rstar 0.14's traits, so the tree holds rectangles tagged with an index into
//! a Vec of subscribers.)

use crate::config::SubscriberConfig;
use crate::model::{ChangeEvent, Severity, StoredGeometry};
use geo::{BoundingRect, Intersects, MultiPolygon};
use rstar::primitives::{GeomWithData, Rectangle};
use rstar::{RTree, AABB};
use std::sync::{Arc, RwLock};

/// A subscriber with its AOI loaded.
#[derive(Debug, Clone)]
pub struct Subscriber {
    pub id: String,
    pub target: String,
    pub secret: Option<String>,
    pub min_severity: Severity,
    pub aoi: MultiPolygon<f64>,
    /// The previous secret during a rotation (both signatures are sent).
    pub secret_old: Option<String>,
}

impl Subscriber {
    pub fn from_config(cfg: &SubscriberConfig, aoi: MultiPolygon<f64>) -> Subscriber {
        Subscriber {
            id: cfg.id.clone(),
            target: cfg.target.clone(),
            secret: cfg.secret.clone(),
            min_severity: cfg.min_severity,
            aoi,
            secret_old: cfg.secret_old.clone(),
        }
    }
}

type Entry = GeomWithData<Rectangle<[f64; 2]>, u32>;

/// One built index: the tree and the subscribers it points into. Immutable once built.
struct IndexSnapshot {
    tree: RTree<Entry>,
    subscribers: Vec<Arc<Subscriber>>,
}

impl IndexSnapshot {
    fn build(subscribers: Vec<Arc<Subscriber>>) -> IndexSnapshot {
        let entries: Vec<Entry> = subscribers
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let r = s.aoi.bounding_rect()?;
                Some(GeomWithData::new(
                    Rectangle::from_corners([r.min().x, r.min().y], [r.max().x, r.max().y]),
                    i as u32,
                ))
            })
            .collect();
        IndexSnapshot { tree: RTree::bulk_load(entries), subscribers }
    }
}

/// The spatial index of all subscribers. The subscriber set can be replaced while ingest
/// and delivery run (the control port edits subscribers): a new index is built off to the
/// side and swapped in; readers keep the snapshot they started with.
pub struct SubscriberIndex {
    current: RwLock<Arc<IndexSnapshot>>,
}

impl SubscriberIndex {
    pub fn build(subscribers: Vec<Subscriber>) -> SubscriberIndex {
        let subs = subscribers.into_iter().map(Arc::new).collect();
        SubscriberIndex { current: RwLock::new(Arc::new(IndexSnapshot::build(subs))) }
    }

    fn snapshot(&self) -> Arc<IndexSnapshot> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Replaces the whole subscriber set. The new tree is built before the write lock is taken.
    pub fn replace(&self, subscribers: Vec<Subscriber>) {
        let next = Arc::new(IndexSnapshot::build(subscribers.into_iter().map(Arc::new).collect()));
        match self.current.write() {
            Ok(mut g) => *g = next,
            Err(p) => *p.into_inner() = next,
        }
    }

    /// The current subscribers.
    pub fn subscribers(&self) -> Vec<Arc<Subscriber>> {
        self.snapshot().subscribers.clone()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Subscriber>> {
        self.snapshot().subscribers.iter().find(|s| s.id == id).cloned()
    }

    /// Subscribers whose AOI intersects any of the given geometries (touching counts).
    pub fn matching(&self, geometries: &[&MultiPolygon<f64>]) -> Vec<Arc<Subscriber>> {
        let snap = self.snapshot();
        let mut hits: Vec<u32> = Vec::new();
        for g in geometries {
            let Some(r) = g.bounding_rect() else { continue };
            let env = AABB::from_corners([r.min().x, r.min().y], [r.max().x, r.max().y]);
            for cand in snap.tree.locate_in_envelope_intersecting(env) {
                if hits.contains(&cand.data) {
                    continue;
                }
                if let Some(sub) = snap.subscribers.get(cand.data as usize) {
                    if sub.aoi.intersects(*g) {
                        hits.push(cand.data);
                    }
                }
            }
        }
        hits.sort_unstable();
        hits.into_iter().filter_map(|i| snap.subscribers.get(i as usize).cloned()).collect()
    }

    /// Subscribers a change event touches, through its old or its new geometry.
    pub fn matching_event(&self, event: &ChangeEvent) -> Vec<Arc<Subscriber>> {
        let old = event.old_geometry.as_ref().map(StoredGeometry::to_geo);
        let new = event.new_geometry.as_ref().map(StoredGeometry::to_geo);
        let geoms: Vec<&MultiPolygon<f64>> = old.iter().chain(new.iter()).collect();
        self.matching(&geoms)
    }
}
