//! The publication gate: whether a run's events may be published.
//!
//! * first ingest of a source → baseline (nothing sent), also when run as a `--reprocess`;
//! * `--reprocess` → keys primed, nothing sent;
//! * change spike (changed parcels above `max_change_ratio` of the layer, counting those
//!   that gained or lost district coverage: not alerted, but a half-missing or misplaced
//!   district export makes thousands of them) or quarantine spike
//!   (more than half the features quarantined as `missing_field` / `out_of_bounds` /
//!   `field_too_long`, or copies of ids the layer repeats, `duplicate_id`: the sign of a
//!   renamed field, a field mapped to a long text column or to one that is not unique, or a
//!   datum drift; checked before the first-ingest rule, so a first ingest so is held too) →
//!   held until an operator releases or primes it;
//! * a restated layer (publisher timestamp went backwards, from one not in the future:
//!   [`crate::model::Watermark::from_the_future`]) → held with that reason.

/// The gate's decision for one run.
#[derive(Debug, Clone, PartialEq)]
pub enum GateDecision {
    Baseline,
    Deliver,
    Reprocess,
    Hold(String),
}

/// What the gate looks at.
#[derive(Debug, Clone)]
pub struct GateInput {
    pub first_ingest: bool,
    pub reprocess: bool,
    /// Parcels in the stored snapshot before this run.
    pub previous_parcels: u64,
    /// Parcels with a change event in this run.
    pub changed: u64,
    /// Parcels of a district layer's base that gained or lost district coverage (not
    /// alerted, `derived.rs`), counted toward the change spike: a district export half
    /// missing, or with its coordinates swapped, uncovers thousands of parcels, and the
    /// parcels its missing districts were next to are alerted as rezoned (a black-box tester:
    /// 541 false alerts went out, and 541 more when the whole layer came back; a swapped one
    /// was committed, and the next real rezonings read as parcels gaining coverage).
    pub coverage_changed: u64,
    /// Features read this run.
    pub features: u64,
    /// Features quarantined for a systemic reason (`missing_field`, `out_of_bounds`,
    /// `field_too_long`), and the copies of ids a parcel layer repeats (`duplicate_id`).
    pub systemic_quarantined: u64,
    pub max_change_ratio: f64,
    /// Why the layer is a restatement (its publisher timestamp went backwards), if it is.
    pub restated: Option<String>,
}

/// Applies the gate.
pub fn decide(i: GateInput) -> GateDecision {
    if i.features > 0 && i.systemic_quarantined * 2 > i.features {
        return GateDecision::Hold(format!(
            "quarantine_spike: {} of {} features quarantined as missing_field/out_of_bounds/field_too_long/duplicate_id/empty_geometry/not_polygonal/non_finite/malformed_feature, or in a district layer as having no readable position (renamed field, a field mapped to a long text column, parcel_id mapped to a field that is not unique, datum drift, or geometry left out of the export or written as points?)",
            i.systemic_quarantined, i.features
        ));
    }
    if i.features == 0 && i.previous_parcels > 0 {
        return GateDecision::Hold(format!(
            "empty_layer: the layer has no features but the snapshot has {} parcels",
            i.previous_parcels
        ));
    }
    // A source's first ingest is its baseline, whether or not it was asked for as a
    // `--reprocess` (both send nothing; the baseline is what its record and audit rows say).
    if i.first_ingest {
        return GateDecision::Baseline;
    }
    if i.reprocess {
        return GateDecision::Reprocess;
    }
    if let Some(reason) = i.restated {
        return GateDecision::Hold(reason);
    }
    let base = i.previous_parcels.max(1) as f64;
    let moved = i.changed.saturating_add(i.coverage_changed);
    let ratio = moved as f64 / base;
    if ratio > i.max_change_ratio {
        let coverage = if i.coverage_changed > 0 { format!(" or gained or lost district coverage ({} of them)", i.coverage_changed) } else { String::new() };
        return GateDecision::Hold(format!(
            "change_spike: {moved} of {} parcels changed{coverage} ({:.1}% > max_change_ratio {:.1}%)",
            i.previous_parcels,
            ratio * 100.0,
            i.max_change_ratio * 100.0
        ));
    }
    GateDecision::Deliver
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> GateInput {
        GateInput {
            first_ingest: false,
            reprocess: false,
            previous_parcels: 1000,
            changed: 10,
            coverage_changed: 0,
            features: 1000,
            systemic_quarantined: 0,
            max_change_ratio: 0.05,
            restated: None,
        }
    }

    #[test]
    fn decisions() {
        assert_eq!(decide(input()), GateDecision::Deliver);
        assert!(matches!(decide(GateInput { changed: 51, ..input() }), GateDecision::Hold(r) if r.starts_with("change_spike")));
        // Parcels that gained or lost district coverage count toward the spike, said so.
        assert_eq!(decide(GateInput { changed: 20, coverage_changed: 30, ..input() }), GateDecision::Deliver);
        assert!(matches!(decide(GateInput { changed: 20, coverage_changed: 31, ..input() }), GateDecision::Hold(r) if r.starts_with("change_spike: 51 of 1000") && r.contains("coverage (31 of them)")));
        assert!(matches!(decide(GateInput { systemic_quarantined: 501, ..input() }), GateDecision::Hold(r) if r.starts_with("quarantine_spike")));
        assert_eq!(decide(GateInput { first_ingest: true, previous_parcels: 0, changed: 1000, ..input() }), GateDecision::Baseline);
        assert_eq!(decide(GateInput { reprocess: true, changed: 900, ..input() }), GateDecision::Reprocess);
        // A first ingest run as a `--reprocess` is the source's baseline.
        assert_eq!(decide(GateInput { first_ingest: true, reprocess: true, previous_parcels: 0, changed: 1000, ..input() }), GateDecision::Baseline);
        assert!(matches!(decide(GateInput { features: 0, ..input() }), GateDecision::Hold(_)));
        let restated = GateInput { restated: Some("restated: went backwards".into()), ..input() };
        assert_eq!(decide(restated.clone()), GateDecision::Hold("restated: went backwards".into()));
        assert_eq!(decide(GateInput { first_ingest: true, ..restated }), GateDecision::Baseline);
    }
}
