//! What the fuzz tests share (tests/feed_fuzz.rs, tests/portals.rs, tests/control.rs): a
//! seeded generator, so a failing sequence can be repeated from its seed, and the byte-level
//! damage a feed or a portal's answer can come with.

/// Tiny deterministic generator (no extra crate for tests).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    /// In `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
    /// [`Lcg::pick`], the item itself.
    pub fn one_of<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

/// Tokens that have broken JSON and geometry parsers: what a damaged or hostile feed is made of.
pub const TOKENS: &[&str] = &[
    "{", "}", "[", "]", "\"", ",", ":", "\\", "null", "NaN", "-Infinity", "-", "1e999", "-0", "1e-330",
    "123456789012345678901234567890", "\"\\ud800\"", "\"\\u0000\"", "true", "{}", "[]", "\u{feff}", "\r\n", "é",
];

/// One to four random damages to `doc`: a byte changed to anything (invalid UTF-8 included),
/// a span cut out, a span copied elsewhere, the text cut short, deep nesting (`[[[…` or
/// `{"a":{"a":…`) put in, or one of `tokens` put in or put in place of a number.
pub fn damage(doc: &[u8], rng: &mut Lcg, tokens: &[&str]) -> Vec<u8> {
    let mut out = doc.to_vec();
    for _ in 0..1 + rng.below(4) {
        if out.is_empty() {
            break;
        }
        let at = rng.below(out.len());
        match rng.below(8) {
            0 => out[at] = rng.next() as u8,
            1 => {
                let end = (at + 1 + rng.below(60)).min(out.len());
                out.drain(at..end);
            }
            2 => {
                let end = (at + 1 + rng.below(400)).min(out.len());
                let span = out[at..end].to_vec();
                let to = rng.below(out.len());
                out.splice(to..to, span);
            }
            3 => out.truncate(at),
            4 => {
                let depth = 50 + rng.below(400);
                let nest = if rng.one_in(2) { "[".repeat(depth) } else { "{\"a\":".repeat(depth) };
                out.splice(at..at, nest.into_bytes());
            }
            _ => {
                let token = rng.one_of(tokens).as_bytes().to_vec();
                let digit = out[at..].iter().position(|b| b.is_ascii_digit()).map(|p| at + p);
                match digit {
                    Some(d) if rng.one_in(2) => {
                        let end = d + out[d..].iter().take_while(|b| b.is_ascii_digit() || **b == b'.').count();
                        out.splice(d..end, token);
                    }
                    _ => {
                        out.splice(at..at, token);
                    }
                }
            }
        }
    }
    out
}

/// What a run of `source` commits: its watermark and each parcel's (content, geometry)
/// hashes. Compared before and after a failed run, which must change neither (equal hashes
/// are equal states; an area is a float).
pub type Committed = (Option<zonewatch::model::Watermark>, std::collections::BTreeMap<String, ([u8; 32], [u8; 32])>);

pub fn committed(engine: &zonewatch::pipeline::Engine, source: &str) -> Committed {
    let watermark = engine.store.watermark(source).expect("watermark reads");
    let states = engine.store.snapshot_states(source).expect("snapshot reads");
    (watermark, states.into_iter().map(|(id, s)| (id, (s.content_hash, s.geom_hash))).collect())
}
