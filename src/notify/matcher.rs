//! Subscriber matching: an R-tree over AOI bounding rectangles finds candidates, then an exact
//! `geo` intersects test against the old and the new parcel geometry decides. (geo 0.33 does
//! not implement rstar 0.14's traits, so the tree holds rectangles tagged with an index into
//! a Vec of subscribers.)
//!
//! A run's events are matched a chunk at a time ([`PinnedIndex::match_batch`]): one index
//! snapshot held for the chunk, which also tells the commit which new parcels lie outside
//! every AOI's envelope and need no event ([`PinnedIndex::may_touch`]); the events split
//! over the machine's cores, each event's old and new geometry
//! tested once when they are equal, and an exact test skipped when it is provably true (the
//! event lies inside an AOI that is exactly its own bounding rectangle). The batch gives the
//! same answer as [`SubscriberIndex::matching_event`], event by event (tested).

use crate::config::SubscriberConfig;
use crate::model::{ChangeEvent, Envelope, Severity, StoredGeometry};
use geo::{BoundingRect, Intersects, MultiPolygon};
use rstar::primitives::{GeomWithData, Rectangle};
use rstar::{RTree, AABB};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

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
    /// Per subscriber: `Some(rect)` when its AOI is one polygon without holes whose ring is
    /// exactly its bounding rectangle. Then any geometry whose envelope lies inside `rect`
    /// intersects it, and the exact test is geo's cheaper `Rect`–polygon one.
    is_rect: Vec<Option<geo::Rect<f64>>>,
    /// Subscriber id → index into `subscribers`. Delivery looks its subscriber up once per
    /// webhook; a scan of the list cost ~5,000 string compares a webhook at 10k subscribers.
    by_id: HashMap<String, u32>,
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
        let is_rect = subscribers
            .iter()
            .map(|s| if aoi_is_rectangle(&s.aoi) { s.aoi.bounding_rect() } else { None })
            .collect();
        // Ids are unique in a loaded config; should two ever share one, the first wins, as the
        // scan this replaces did.
        let mut by_id = HashMap::with_capacity(subscribers.len());
        for (i, s) in subscribers.iter().enumerate() {
            by_id.entry(s.id.clone()).or_insert(i as u32);
        }
        IndexSnapshot { tree: RTree::bulk_load(entries), subscribers, is_rect, by_id }
    }

    /// Indices of the subscribers whose AOI intersects any of `geoms` (sorted, distinct):
    /// the same answer as [`SubscriberIndex::matching`] on their `to_geo` forms, with the
    /// rectangle shortcut. The envelope is read off the stored coordinates; the `geo` form,
    /// which costs an allocation per ring, is built only for a candidate that needs the
    /// exact test (most parcels of a county fall in no AOI's envelope).
    fn match_indices(&self, geoms: &[&StoredGeometry], hits: &mut Vec<u32>) {
        hits.clear();
        for g in geoms {
            let Some((min, max)) = g.exterior_envelope() else { continue };
            // The shortcut needs every part of `g` to have a point (its exterior): then the
            // whole of `g` lies inside its envelope, and inside any rectangle containing it.
            let solid = g.0.iter().filter(|rings| !rings.is_empty()).all(|rings| !rings[0].is_empty());
            let mut exact: Option<MultiPolygon<f64>> = None;
            for cand in self.tree.locate_in_envelope_intersecting(AABB::from_corners(min, max)) {
                if hits.contains(&cand.data) {
                    continue;
                }
                let i = cand.data as usize;
                let Some(sub) = self.subscribers.get(i) else { continue };
                // geo's `Rect` test decides a geometry with a part whose exterior is empty
                // by that part's hole, the polygon test (the one-by-one path) does not: such
                // geometries take the polygon test.
                let hit = match self.is_rect.get(i).copied().flatten() {
                    Some(a) if solid && a.min().x <= min[0] && a.min().y <= min[1] && a.max().x >= max[0] && a.max().y >= max[1] => true,
                    Some(a) if solid => a.intersects(&*exact.get_or_insert_with(|| g.to_geo())),
                    _ => sub.aoi.intersects(&*exact.get_or_insert_with(|| g.to_geo())),
                };
                if hit {
                    hits.push(cand.data);
                }
            }
        }
        hits.sort_unstable();
    }

    /// Indices of the subscribers whose AOI intersects any of `geometries` (sorted,
    /// distinct), by the plain envelope query and exact test: the reference the batch path
    /// is tested against.
    fn plain_indices(&self, geometries: &[&MultiPolygon<f64>]) -> Vec<u32> {
        let mut hits: Vec<u32> = Vec::new();
        for g in geometries {
            let Some(r) = g.bounding_rect() else { continue };
            let env = AABB::from_corners([r.min().x, r.min().y], [r.max().x, r.max().y]);
            for cand in self.tree.locate_in_envelope_intersecting(env) {
                if hits.contains(&cand.data) {
                    continue;
                }
                if let Some(sub) = self.subscribers.get(cand.data as usize) {
                    if sub.aoi.intersects(*g) {
                        hits.push(cand.data);
                    }
                }
            }
        }
        hits.sort_unstable();
        hits
    }

    /// [`IndexSnapshot::plain_indices`] of one event's old and new geometry.
    fn plain_event_indices(&self, event: &ChangeEvent) -> Vec<u32> {
        let geoms: Vec<MultiPolygon<f64>> = event.old_geometry.iter().chain(&event.new_geometry).map(StoredGeometry::to_geo).collect();
        self.plain_indices(&geoms.iter().collect::<Vec<_>>())
    }

    /// The subscribers at these indices.
    fn subscribers_at(&self, indices: &[u32]) -> Vec<Arc<Subscriber>> {
        indices.iter().filter_map(|&i| self.subscribers.get(i as usize).cloned()).collect()
    }

    /// Matched subscriber indices of one event (old and new geometry; tested once when equal).
    fn event_indices(&self, event: &ChangeEvent, hits: &mut Vec<u32>) {
        let same = matches!((&event.old_geometry, &event.new_geometry), (Some(a), Some(b)) if a == b);
        let new = if same { None } else { event.new_geometry.as_ref() };
        let geoms: Vec<&StoredGeometry> = event.old_geometry.iter().chain(new).collect();
        self.match_indices(&geoms, hits);
    }
}

/// One subscriber set, held for a batch of questions ([`SubscriberIndex::pinned`]).
pub struct PinnedIndex(Arc<IndexSnapshot>);

impl PinnedIndex {
    /// Whether any subscriber's AOI envelope touches `envelope`: when not, no geometry
    /// inside `envelope` matches anyone, and its event need not be built.
    pub fn may_touch(&self, envelope: Envelope) -> bool {
        let (min, max) = envelope;
        self.0.tree.locate_in_envelope_intersecting(AABB::from_corners(min, max)).next().is_some()
    }

    /// Subscribers each event touches (same answer as [`SubscriberIndex::matching_event`]
    /// per event), in parallel over the machine's cores.
    pub fn match_batch(&self, events: &[ChangeEvent]) -> Vec<Vec<Arc<Subscriber>>> {
        let snap = &self.0;
        let run = |chunk: &[ChangeEvent]| -> Vec<Vec<Arc<Subscriber>>> {
            let mut hits = Vec::new();
            chunk
                .iter()
                .map(|e| {
                    snap.event_indices(e, &mut hits);
                    snap.subscribers_at(&hits)
                })
                .collect()
        };
        let threads = crate::util::cores()
            .min(events.len() / MIN_EVENTS_PER_THREAD)
            .max(1);
        if threads == 1 {
            return run(events);
        }
        let per = events.len().div_ceil(threads);
        let parts: Vec<Vec<Vec<Arc<Subscriber>>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = events.chunks(per).skip(1).map(|c| scope.spawn(move || run(c))).collect();
            // The calling thread takes the first chunk itself.
            let mut parts = vec![run(&events[..per.min(events.len())])];
            for h in handles {
                // A worker only panics on a bug: its chunk comes back empty, the count below
                // falls short, and the whole batch is matched again on the plain path.
                parts.push(h.join().unwrap_or_default());
            }
            parts
        });
        let mut out = Vec::with_capacity(events.len());
        for p in parts {
            out.extend(p);
        }
        if out.len() != events.len() {
            // Only after a worker panic: fall back to the plain path for the whole batch.
            return events.iter().map(|e| snap.subscribers_at(&snap.plain_event_indices(e))).collect();
        }
        out
    }
}

/// True when `aoi` is one polygon without holes whose exterior ring runs exactly along its
/// bounding rectangle (4 corners, closed, axis-parallel edges), e.g. a drawn box.
fn aoi_is_rectangle(aoi: &MultiPolygon<f64>) -> bool {
    let [p] = aoi.0.as_slice() else { return false };
    if !p.interiors().is_empty() {
        return false;
    }
    let ring = &p.exterior().0;
    if ring.len() != 5 || ring[0] != ring[4] {
        return false;
    }
    let Some(r) = p.bounding_rect() else { return false };
    if !(r.width() > 0.0 && r.height() > 0.0) {
        return false;
    }
    // Every corner is a bbox corner, all four distinct, every edge axis-parallel.
    let corner = |c: &geo::Coord<f64>| (c.x == r.min().x || c.x == r.max().x) && (c.y == r.min().y || c.y == r.max().y);
    let mut seen = [false; 4];
    for c in &ring[..4] {
        if !corner(c) {
            return false;
        }
        let k = usize::from(c.x == r.max().x) * 2 + usize::from(c.y == r.max().y);
        if seen[k] {
            return false;
        }
        seen[k] = true;
    }
    ring.windows(2).all(|w| w[0].x == w[1].x || w[0].y == w[1].y)
}

/// Events per worker below which a batch is matched on the calling thread (a thread costs
/// more than matching a few hundred events).
const MIN_EVENTS_PER_THREAD: usize = 512;

/// The spatial index of all subscribers. The subscriber set can be replaced while ingest
/// and delivery run (the control port edits subscribers): a new index is built off to the
/// side and swapped in; readers keep the snapshot they started with.
pub struct SubscriberIndex {
    current: RwLock<Arc<IndexSnapshot>>,
    /// Taken by every change of the set ([`IndexEdit`]): two edits each
    /// built from the same snapshot would otherwise swap in one and lose the other.
    edits: Mutex<()>,
}

/// The turn to change the subscriber set, one edit at a time. Each change builds the next
/// index from the current one's subscribers (their AOIs already parsed and checked), so an
/// edit costs one tree build (milliseconds at 10k subscribers), not a reload of every AOI.
pub struct IndexEdit<'a> {
    index: &'a SubscriberIndex,
    _turn: MutexGuard<'a, ()>,
}

impl IndexEdit<'_> {
    /// Puts `sub` in, in the place of the subscriber of its id, or last when there is none.
    pub fn upsert(&self, sub: Subscriber) {
        let mut subs = self.index.snapshot().subscribers.clone();
        match subs.iter().position(|s| s.id == sub.id) {
            Some(i) => subs[i] = Arc::new(sub),
            None => subs.push(Arc::new(sub)),
        }
        self.index.swap(IndexSnapshot::build(subs));
    }

    /// Takes the subscriber `id` out (nothing when there is none).
    pub fn remove(&self, id: &str) {
        let mut subs = self.index.snapshot().subscribers.clone();
        let before = subs.len();
        subs.retain(|s| s.id != id);
        if subs.len() != before {
            self.index.swap(IndexSnapshot::build(subs));
        }
    }
}

impl SubscriberIndex {
    pub fn build(subscribers: Vec<Subscriber>) -> SubscriberIndex {
        let subs = subscribers.into_iter().map(Arc::new).collect();
        SubscriberIndex { current: RwLock::new(Arc::new(IndexSnapshot::build(subs))), edits: Mutex::new(()) }
    }

    /// Waits for the turn to change the set (see [`IndexEdit`]).
    pub fn edit(&self) -> IndexEdit<'_> {
        let turn = match self.edits.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        IndexEdit { index: self, _turn: turn }
    }

    fn swap(&self, next: IndexSnapshot) {
        let next = Arc::new(next);
        match self.current.write() {
            Ok(mut g) => *g = next,
            Err(p) => *p.into_inner() = next,
        }
    }

    fn snapshot(&self) -> Arc<IndexSnapshot> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// The current subscribers.
    pub fn subscribers(&self) -> Vec<Arc<Subscriber>> {
        self.snapshot().subscribers.clone()
    }

    /// The subscriber with this id, from the current snapshot (a hash lookup).
    pub fn get(&self, id: &str) -> Option<Arc<Subscriber>> {
        let snap = self.snapshot();
        snap.by_id.get(id).and_then(|&i| snap.subscribers.get(i as usize)).cloned()
    }

    /// Subscribers whose AOI intersects any of the given geometries (touching counts).
    pub fn matching(&self, geometries: &[&MultiPolygon<f64>]) -> Vec<Arc<Subscriber>> {
        let snap = self.snapshot();
        snap.subscribers_at(&snap.plain_indices(geometries))
    }

    /// Subscribers each event touches (same answer as [`Self::matching_event`] per event),
    /// matched against one index snapshot, in parallel over the machine's cores.
    pub fn match_batch(&self, events: &[ChangeEvent]) -> Vec<Vec<Arc<Subscriber>>> {
        self.pinned().match_batch(events)
    }

    /// The current subscriber set, held: what a run asks of it in a batch stays the answer
    /// of one set while the control port replaces it.
    pub fn pinned(&self) -> PinnedIndex {
        PinnedIndex(self.snapshot())
    }

    /// Subscribers a change event touches, through its old or its new geometry.
    pub fn matching_event(&self, event: &ChangeEvent) -> Vec<Arc<Subscriber>> {
        let snap = self.snapshot();
        snap.subscribers_at(&snap.plain_event_indices(event))
    }
}

#[cfg(test)]
mod tests {
    //! The batch path must answer exactly as the one-event path, on random AOIs of every
    //! kind the shortcut distinguishes (rectangles, rotated squares, triangles, donuts,
    //! multi-part) and random events (old = new, old ≠ new, only old, only new).
    use super::*;
    use crate::model::{ChangeKind, Severity};
    use crate::synth::SplitMix64;
    use geo::{polygon, LineString, Polygon};

    fn ring(pts: &[(f64, f64)]) -> LineString<f64> {
        let mut v: Vec<(f64, f64)> = pts.to_vec();
        v.push(pts[0]);
        LineString::from(v)
    }

    fn random_aoi(rng: &mut SplitMix64) -> MultiPolygon<f64> {
        let (x, y) = (rng.range(0.0, 1.0), rng.range(0.0, 1.0));
        let s = rng.range(0.005, 0.15);
        match rng.below(5) {
            0 => MultiPolygon(vec![polygon![(x: x, y: y), (x: x + s, y: y), (x: x + s, y: y + s), (x: x, y: y + s), (x: x, y: y)]]),
            1 => MultiPolygon(vec![Polygon::new(ring(&[(x, y - s), (x + s, y), (x, y + s), (x - s, y)]), vec![])]),
            2 => MultiPolygon(vec![Polygon::new(ring(&[(x, y), (x + s, y), (x, y + s)]), vec![])]),
            3 => {
                let h = s / 3.0;
                MultiPolygon(vec![Polygon::new(
                    ring(&[(x, y), (x + s, y), (x + s, y + s), (x, y + s)]),
                    vec![ring(&[(x + h, y + h), (x + 2.0 * h, y + h), (x + 2.0 * h, y + 2.0 * h), (x + h, y + 2.0 * h)])],
                )])
            }
            _ => MultiPolygon(vec![
                polygon![(x: x, y: y), (x: x + s, y: y), (x: x + s, y: y + s), (x: x, y: y + s), (x: x, y: y)],
                Polygon::new(ring(&[(x + 2.0 * s, y), (x + 3.0 * s, y), (x + 2.5 * s, y + s)]), vec![]),
            ]),
        }
    }

    fn random_parcel(rng: &mut SplitMix64) -> StoredGeometry {
        let (x, y) = (rng.range(-0.05, 1.05), rng.range(-0.05, 1.05));
        let (w, h) = (rng.range(0.0005, 0.02), rng.range(0.0005, 0.02));
        let pts = if rng.below(3) == 0 {
            vec![[x, y], [x + w, y + h * 0.2], [x + w * 0.5, y + h], [x, y]]
        } else {
            vec![[x, y], [x + w, y], [x + w, y + h], [x, y + h], [x, y]]
        };
        StoredGeometry(vec![vec![pts]])
    }

    fn event(old: Option<StoredGeometry>, new: Option<StoredGeometry>) -> ChangeEvent {
        ChangeEvent {
            source_id: "s".into(),
            jurisdiction: "j".into(),
            parcel_id: "p".into(),
            kind: ChangeKind::Rezoned,
            from: None,
            to: None,
            effective_date: None,
            old_geometry: old,
            new_geometry: new,
            area_m2: 1.0,
            observed_at_ms: 0,
            severity: Severity::Info,
            revision: 0,
        }
    }

    #[test]
    fn batch_matches_one_by_one_on_random_inputs() {
        let mut rng = SplitMix64::new(42);
        let subs: Vec<Subscriber> = (0..600)
            .map(|i| Subscriber {
                id: format!("w{i}"),
                target: "http://127.0.0.1:9/".into(),
                secret: None,
                min_severity: Severity::Info,
                aoi: random_aoi(&mut rng),
                secret_old: None,
            })
            .collect();
        let idx = SubscriberIndex::build(subs);
        let snap = idx.snapshot();
        assert!(snap.is_rect.iter().filter(|r| r.is_some()).count() > 50, "the shortcut must be exercised");
        assert!(snap.is_rect.iter().filter(|r| r.is_none()).count() > 50);
        let events: Vec<ChangeEvent> = (0..5_000)
            .map(|_| {
                let g = random_parcel(&mut rng);
                match rng.below(4) {
                    0 => event(Some(g.clone()), Some(g)),
                    1 => event(Some(g), Some(random_parcel(&mut rng))),
                    2 => event(Some(g), None),
                    _ => event(None, Some(g)),
                }
            })
            .collect();
        // Parcels exactly touching rectangle AOIs: along an edge, at a corner, from inside.
        let mut events = events;
        for r in snap.is_rect.iter().flatten().take(200) {
            let (x0, y0, x1, y1) = (r.min().x, r.min().y, r.max().x, r.max().y);
            let sq = |x: f64, y: f64, s: f64| StoredGeometry(vec![vec![vec![[x, y], [x + s, y], [x + s, y + s], [x, y + s], [x, y]]]]);
            events.push(event(None, Some(sq(x1, y0, 0.001))));
            events.push(event(None, Some(sq(x1, y1, 0.001))));
            events.push(event(None, Some(sq(x0 - 0.001, y0 - 0.001, 0.001))));
            events.push(event(None, Some(sq(x0, y0, (x1 - x0) * 0.5))));
            events.push(event(None, Some(sq(x1 + 1e-9, y0, 0.001))));
            // Stored forms the envelope is read off without `to_geo`: a part with no rings,
            // a part whose exterior is empty but has a hole, a part far outside next to one
            // inside, and no geometry at all.
            let inside = vec![[x0, y0], [x0 + (x1 - x0) * 0.5, y0], [x0, y0 + (y1 - y0) * 0.5], [x0, y0]];
            let far = vec![[5.0, 5.0], [5.1, 5.0], [5.0, 5.1], [5.0, 5.0]];
            events.push(event(None, Some(StoredGeometry(vec![vec![], vec![inside.clone()]]))));
            events.push(event(None, Some(StoredGeometry(vec![vec![vec![], inside.clone()], vec![far.clone()]]))));
            events.push(event(Some(StoredGeometry(vec![vec![far], vec![inside]])), None));
            events.push(event(Some(StoredGeometry(vec![])), Some(StoredGeometry(vec![vec![]]))));
            // An empty exterior with a hole inside the AOI, next to a triangle whose envelope
            // overlaps the AOI's corner while the triangle misses it.
            let (w, h) = (x1 - x0, y1 - y0);
            let hole = vec![[x0 + w * 0.5, y0 + h * 0.5], [x0 + w * 0.6, y0 + h * 0.5], [x0 + w * 0.5, y0 + h * 0.6], [x0 + w * 0.5, y0 + h * 0.5]];
            let corner = vec![[x1 - w * 0.1, y1 + h * 0.2], [x1 + w * 0.2, y1 - h * 0.1], [x1 + w * 0.2, y1 + h * 0.2], [x1 - w * 0.1, y1 + h * 0.2]];
            events.push(event(None, Some(StoredGeometry(vec![vec![vec![], hole], vec![corner]]))));
        }
        let batch = idx.match_batch(&events);
        assert_eq!(batch.len(), events.len());
        let pinned = idx.pinned();
        let (mut matched, mut untouched) = (0, 0);
        for (e, got) in events.iter().zip(&batch) {
            let want: Vec<String> = idx.matching_event(e).iter().map(|s| s.id.clone()).collect();
            let got: Vec<String> = got.iter().map(|s| s.id.clone()).collect();
            assert_eq!(got, want, "event {e:?}");
            matched += got.len();
            // The commit's skip: a new geometry whose envelope touches no AOI's matches no one.
            if let (None, Some(envelope)) = (&e.old_geometry, e.new_geometry.as_ref().and_then(StoredGeometry::exterior_envelope)) {
                if !pinned.may_touch(envelope) {
                    assert!(want.is_empty(), "skipped but matched: {e:?}");
                    untouched += 1;
                }
            }
        }
        assert!(untouched > 100, "too few events outside every envelope ({untouched})");
        assert!(matched > 1_000, "too few matches ({matched}) to compare anything");
        // Small batches take the single-thread path: same answers.
        assert_eq!(idx.match_batch(&events[..10]).len(), 10);
        assert!(idx.match_batch(&[]).is_empty());
    }

    #[test]
    fn rectangle_detection() {
        let sq = MultiPolygon(vec![polygon![(x: 0.0, y: 0.0), (x: 1.0, y: 0.0), (x: 1.0, y: 1.0), (x: 0.0, y: 1.0), (x: 0.0, y: 0.0)]]);
        assert!(aoi_is_rectangle(&sq));
        let diamond = MultiPolygon(vec![Polygon::new(ring(&[(0.0, -1.0), (1.0, 0.0), (0.0, 1.0), (-1.0, 0.0)]), vec![])]);
        assert!(!aoi_is_rectangle(&diamond));
        // Bowtie over the bbox corners: corners right, edges diagonal.
        let bowtie = MultiPolygon(vec![Polygon::new(ring(&[(0.0, 0.0), (1.0, 1.0), (1.0, 0.0), (0.0, 1.0)]), vec![])]);
        assert!(!aoi_is_rectangle(&bowtie));
        let flat = MultiPolygon(vec![Polygon::new(ring(&[(0.0, 0.0), (1.0, 0.0), (1.0, 0.0), (0.0, 0.0)]), vec![])]);
        assert!(!aoi_is_rectangle(&flat));
    }

    #[test]
    fn get_finds_every_subscriber_by_id_and_follows_edits() {
        let sub = |id: &str, target: &str| Subscriber {
            id: id.into(),
            target: target.into(),
            secret: None,
            min_severity: Severity::Info,
            aoi: MultiPolygon(vec![]),
            secret_old: None,
        };
        let mut subs: Vec<Subscriber> = (0..1_000).map(|i| sub(&format!("w{i}"), &format!("http://127.0.0.1:9/{i}"))).collect();
        subs.push(sub("w7", "http://127.0.0.1:9/second"));
        let idx = SubscriberIndex::build(subs);
        for i in [0, 1, 499, 999] {
            assert_eq!(idx.get(&format!("w{i}")).map(|s| s.target.clone()), Some(format!("http://127.0.0.1:9/{i}")));
        }
        assert_eq!(idx.get("w7").map(|s| s.target.clone()).as_deref(), Some("http://127.0.0.1:9/7"), "first of two equal ids");
        assert!(idx.get("w1000").is_none());

        let square = |x: f64| MultiPolygon(vec![polygon![(x: x, y: 0.0), (x: x + 1.0, y: 0.0), (x: x + 1.0, y: 1.0), (x: x, y: 1.0), (x: x, y: 0.0)]]);
        let parcel = square(10.25);
        let edit = idx.edit();
        // Added last, found by id and by place.
        edit.upsert(Subscriber { aoi: square(10.0), ..sub("w1000", "http://127.0.0.1:9/new") });
        assert_eq!(idx.get("w1000").map(|s| s.target.clone()).as_deref(), Some("http://127.0.0.1:9/new"));
        assert_eq!(idx.matching(&[&parcel]).iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["w1000"]);
        // Replaced in place: its new AOI, not the old one, decides.
        edit.upsert(Subscriber { aoi: square(50.0), ..sub("w1000", "http://127.0.0.1:9/moved") });
        assert_eq!(idx.get("w1000").map(|s| s.target.clone()).as_deref(), Some("http://127.0.0.1:9/moved"));
        assert!(idx.matching(&[&parcel]).is_empty());
        assert_eq!(idx.subscribers().len(), 1_002);
        // Removed: gone by id; removing an id that is not there changes nothing.
        edit.remove("w0");
        edit.remove("nobody");
        assert!(idx.get("w0").is_none());
        assert_eq!(idx.get("w1").map(|s| s.target.clone()).as_deref(), Some("http://127.0.0.1:9/1"));
        assert_eq!(idx.subscribers().len(), 1_001);
    }
}
