//! Severity ranking. `info` when nothing real changed (shape only); `critical` for
//! residential → intensive on a parcel larger than the source's threshold (geodesic m²);
//! `material` for that upzoning on smaller parcels and for any intensive → residential
//! downzoning; `notice` otherwise.

use crate::config::SeverityRules;
use crate::model::{ChangeKind, Severity};

/// The class a zoning code falls in for severity purposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeClass {
    Residential,
    Intensive,
    Other,
}

fn pattern_matches(pattern: &str, code: &str) -> bool {
    let p = pattern.trim().to_uppercase();
    let c = code.trim().to_uppercase();
    match p.strip_suffix('*') {
        Some(prefix) => c.starts_with(prefix),
        None => c == p,
    }
}

/// Classifies a zoning code with the source's patterns (intensive wins a tie).
pub fn classify(code: &str, rules: &SeverityRules) -> CodeClass {
    if rules.intensive.iter().any(|p| pattern_matches(p, code)) {
        CodeClass::Intensive
    } else if rules.residential.iter().any(|p| pattern_matches(p, code)) {
        CodeClass::Residential
    } else {
        CodeClass::Other
    }
}

/// Ranks one change.
pub fn rank(kind: ChangeKind, from: Option<&str>, to: Option<&str>, area_m2: f64, rules: &SeverityRules) -> Severity {
    match kind {
        ChangeKind::GeometryChanged => Severity::Info,
        ChangeKind::Added | ChangeKind::Removed => Severity::Notice,
        ChangeKind::OverlayAdded | ChangeKind::OverlayRemoved => Severity::Notice,
        // Zone ↔ no zone (streets, water) is coverage, not a rezoning.
        ChangeKind::AreaRezoned if from.is_none_or(str::is_empty) || to.is_none_or(str::is_empty) => Severity::Info,
        ChangeKind::Rezoned | ChangeKind::AreaRezoned => {
            let from = from.map(|c| classify(c, rules)).unwrap_or(CodeClass::Other);
            let to = to.map(|c| classify(c, rules)).unwrap_or(CodeClass::Other);
            match (from, to) {
                (CodeClass::Residential, CodeClass::Intensive) if area_m2 > rules.large_parcel_m2 => Severity::Critical,
                (CodeClass::Residential, CodeClass::Intensive) => Severity::Material,
                (CodeClass::Intensive, CodeClass::Residential) => Severity::Material,
                _ => Severity::Notice,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_per_the_rules() {
        let r = SeverityRules::default();
        assert_eq!(rank(ChangeKind::Rezoned, Some("R-1"), Some("M-2"), 6000.0, &r), Severity::Critical);
        assert_eq!(rank(ChangeKind::Rezoned, Some("r-1"), Some("C3"), 4000.0, &r), Severity::Material);
        assert_eq!(rank(ChangeKind::Rezoned, Some("R-1"), Some("C-3A"), 4000.0, &r), Severity::Material);
        assert_eq!(rank(ChangeKind::Rezoned, Some("I-1"), Some("RS-3"), 10.0, &r), Severity::Material);
        assert_eq!(rank(ChangeKind::Rezoned, Some("R-1"), Some("R-2"), 1e6, &r), Severity::Notice);
        assert_eq!(rank(ChangeKind::Rezoned, Some("C-1"), Some("C-2"), 1e6, &r), Severity::Notice);
        assert_eq!(rank(ChangeKind::GeometryChanged, Some("R-1"), Some("R-1"), 1e6, &r), Severity::Info);
        assert_eq!(rank(ChangeKind::Added, None, Some("R-1"), 1.0, &r), Severity::Notice);
    }
}
