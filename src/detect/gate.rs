//! The publication gate: whether a run's events may be published.
//!
//! * first ingest of a source → baseline (nothing sent), also when run as a `--reprocess`;
//! * `--reprocess` → keys primed, nothing sent;
//! * change spike (changed parcels above `max_change_ratio` of the layer, counting those
//!   that moved without an alert, [`Silent`]: a district layer's parcels that gained or lost
//!   coverage, against the parcels a district covered; a parcel layer's stored parcels whose
//!   feature could not be read; in area mode the share of the layer's area that changed) or
//!   quarantine spike
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
    /// Parcels that moved without an alert, counted toward the change spike all the same,
    /// and what they are ([`Silent`]).
    pub silent: Silent,
    /// Area mode: the spike is the share of the layer's area that changed, (m² in changed
    /// places, m² of the stored places), not a count of places (a layer dissolved to a few
    /// features a code held a routine run for two small changes).
    pub area: Option<(f64, f64)>,
    /// Features read this run.
    pub features: u64,
    /// A parcel layer's stored parcels whose feature was quarantined this run and that no
    /// valid feature of the layer updated (each keeps its stored state, not alerted). More
    /// than half the stored parcels so is held: a layer exported without its geometry, or as
    /// points, was committed with exit 0 and every rezoning in it unseen (a black-box
    /// tester). Counted against half, not `max_change_ratio`: a layer that keeps a few
    /// retired parcels without geometry at every version must not be held at every run
    /// (a reviewer), and features never read before (a tax roll's condo units) are not
    /// stored parcels at all.
    pub unreadable_stored: u64,
    /// Features quarantined for a systemic reason (`missing_field`, `out_of_bounds`,
    /// `field_too_long`), and the copies of ids a parcel layer repeats (`duplicate_id`).
    pub systemic_quarantined: u64,
    pub max_change_ratio: f64,
    /// Why the layer is a restatement (its publisher timestamp went backwards), if it is.
    pub restated: Option<String>,
}

/// Parcels that moved without an alert of their own, for the change spike.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Silent {
    #[default]
    None,
    /// A district layer's parcels that lost their district coverage (not alerted,
    /// `derived.rs`): a district export half missing, or with its coordinates swapped,
    /// uncovers thousands, and the parcels its missing districts were next to are alerted as
    /// rezoned (a black-box tester: 541 false alerts went out, and 541 more when the whole
    /// layer came back; a swapped one was committed, and the next real rezonings read as
    /// parcels gaining coverage). Measured against the parcels a district covered before
    /// (`previous_parcels` is that count then): a county base watched by one town's districts
    /// would drown the town's half-missing export in parcels no district ever covered.
    /// Parcels gaining coverage are not counted: a town zoning annexed land is no breakage.
    Coverage(u64),
}

impl Silent {
    fn count(self) -> u64 {
        match self {
            Silent::None => 0,
            Silent::Coverage(n) => n,
        }
    }

    /// What an operator should know before resolving such a hold: priming a broken export
    /// stores it (a parcel it uncovered reads as gaining coverage when the real layer comes
    /// back, and its rezoning there is never alerted; a reviewer); the next export supersedes
    /// the hold without either.
    fn advice(self) -> &'static str {
        match self {
            Silent::Coverage(n) if n > 0 => "; if this export is broken, neither release nor prime it: the next export supersedes the hold",
            _ => "",
        }
    }

    fn said(self) -> String {
        match self {
            Silent::Coverage(n) if n > 0 => format!(" or lost their district coverage ({n} of them)"),
            _ => String::new(),
        }
    }
}

/// Applies the gate.
pub fn decide(i: GateInput) -> GateDecision {
    if i.features > 0 && i.systemic_quarantined * 2 > i.features {
        return GateDecision::Hold(format!(
            "quarantine_spike: {} of {} features quarantined as missing_field/out_of_bounds/field_too_long/duplicate_id, or in a district layer as having no readable position (renamed field, a field mapped to a long text column, parcel_id mapped to a field that is not unique, datum drift, or geometry left out of the export?)",
            i.systemic_quarantined, i.features
        ));
    }
    if i.previous_parcels > 0 && i.unreadable_stored * 2 > i.previous_parcels {
        return GateDecision::Hold(format!(
            "quarantine_spike: {} of {} stored parcels could not be read this run (no polygon, unreadable coordinates, a field missing: geometry left out of the export, or written as points?)",
            i.unreadable_stored, i.previous_parcels
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
    if let Some((changed_m2, total_m2)) = i.area {
        let ratio = changed_m2 / total_m2.max(1.0);
        if ratio > i.max_change_ratio {
            return GateDecision::Hold(format!(
                "change_spike: {} places, {changed_m2:.0} m² of the layer's {total_m2:.0} m², changed ({:.1}% > max_change_ratio {:.1}%)",
                i.changed,
                ratio * 100.0,
                i.max_change_ratio * 100.0
            ));
        }
        return GateDecision::Deliver;
    }
    let base = i.previous_parcels.max(1) as f64;
    let moved = i.changed.saturating_add(i.silent.count());
    let ratio = moved as f64 / base;
    if ratio > i.max_change_ratio {
        let of = if matches!(i.silent, Silent::Coverage(_)) { "parcels a district covered" } else { "parcels" };
        return GateDecision::Hold(format!(
            "change_spike: {moved} of {} {of} changed{} ({:.1}% > max_change_ratio {:.1}%){}",
            i.previous_parcels,
            i.silent.said(),
            ratio * 100.0,
            i.max_change_ratio * 100.0,
            i.silent.advice()
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
            silent: Silent::None,
            area: None,
            unreadable_stored: 0,
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
        assert_eq!(decide(GateInput { changed: 20, silent: Silent::Coverage(30), ..input() }), GateDecision::Deliver);
        assert!(matches!(decide(GateInput { changed: 20, silent: Silent::Coverage(31), ..input() }), GateDecision::Hold(r) if r.starts_with("change_spike: 51 of 1000 parcels a district covered") && r.contains("coverage (31 of them)")));
        assert!(matches!(decide(GateInput { changed: 51, ..input() }), GateDecision::Hold(r) if !r.contains("of them")), "no count of nothing");
        // Stored parcels that could not be read hold past half of them, not past the ratio.
        assert_eq!(decide(GateInput { changed: 0, unreadable_stored: 500, ..input() }), GateDecision::Deliver);
        assert!(matches!(decide(GateInput { changed: 0, unreadable_stored: 501, ..input() }), GateDecision::Hold(r) if r.starts_with("quarantine_spike: 501 of 1000 stored parcels")));
        // Area mode measures the share of the layer's area that changed, not a count.
        assert_eq!(decide(GateInput { changed: 2, previous_parcels: 20, area: Some((4_000.0, 100_000.0)), ..input() }), GateDecision::Deliver);
        assert!(matches!(decide(GateInput { changed: 2, previous_parcels: 20, area: Some((6_000.0, 100_000.0)), ..input() }), GateDecision::Hold(r) if r.starts_with("change_spike: 2 places")));
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
