//! `zonewatch audit`: the audit ledger as a table, JSON lines or CSV. The line formats are
//! written a page at a time, so ledgers of millions of rows stream; the JSON shape is shared
//! with the control port's `GET /v1/audit`.

use crate::model::AuditRow;
use crate::store::AuditFilter;
use crate::util::rfc3339;
use super::open::{load_config, store_error_text, store_exit_code};
use clap::ValueEnum;

/// How `zonewatch audit` prints the ledger: a table to read, or JSON lines / CSV for other
/// tools.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum AuditFormat {
    Table,
    Jsonl,
    Csv,
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The audit row as the JSON object `audit --format jsonl` prints.
pub fn audit_json(r: &AuditRow) -> serde_json::Value {
    serde_json::json!({
        "seq": r.seq, "ts": rfc3339(r.ts_ms), "outcome": r.outcome.as_str(),
        "idempotency_key": r.idempotency_key, "watcher_id": r.watcher_id, "source_id": r.source_id,
        "parcel_id": r.parcel_id, "lineage_id": r.lineage_id, "detail": r.detail,
    })
}

pub(super) fn cmd_audit(config: &std::path::Path, filter: AuditFilter, format: AuditFormat) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let store = match crate::store::Store::open_existing(&cfg.store_path) {
        Ok(s) => s,
        Err(e) => {
            error_line!("{}", store_error_text(&cfg.store_path, &e));
            return store_exit_code(&e);
        }
    };
    // Written through a handle whose errors are seen: `audit | head` closing the pipe ends
    // the command here, with the store closed cleanly (a panic would leave it to repair).
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = if format == AuditFormat::Table {
        // A table's columns are as wide as their widest cell: every row is read first.
        match store.audit(&filter) {
            Ok(rows) => write_audit_table(&mut out, &rows),
            Err(e) => {
                error_line!("{e}");
                return store_exit_code(&e);
            }
        }
    } else {
        match write_audit_pages(&mut out, &store, &filter, format, AUDIT_PAGE_ROWS) {
            Ok(written) => written,
            Err(e) => {
                // The rows before the one that stopped the read are written; it is named.
                let _ = std::io::Write::flush(&mut out);
                error_line!("{e}");
                return store_exit_code(&e);
            }
        }
    };
    match written.and_then(|()| std::io::Write::flush(&mut out)) {
        Ok(()) => 0,
        // The reader stopped early: as a Unix tool stopped by SIGPIPE.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            error_line!("writing the audit rows: {e}");
            1
        }
    }
}

/// Rows `zonewatch audit` reads per read transaction in its line formats.
const AUDIT_PAGE_ROWS: usize = 10_000;

/// The columns of `zonewatch audit`'s table and CSV.
const AUDIT_COLUMNS: [&str; 9] = ["seq", "ts", "outcome", "idempotency_key", "watcher_id", "source_id", "parcel_id", "lineage_id", "detail"];

/// One audit row's cells, in [`AUDIT_COLUMNS`] order.
fn audit_cells(r: &AuditRow) -> Vec<String> {
    vec![
        r.seq.to_string(),
        rfc3339(r.ts_ms),
        r.outcome.as_str().to_string(),
        r.idempotency_key.clone().unwrap_or_default(),
        r.watcher_id.clone().unwrap_or_default(),
        r.source_id.clone().unwrap_or_default(),
        r.parcel_id.clone().unwrap_or_default(),
        r.lineage_id.clone().unwrap_or_default(),
        r.detail.clone(),
    ]
}

/// The rows matching `filter` as lines of `format` (JSON lines or CSV), read `page_rows` at a
/// time, each page in a read transaction of its own that is closed before the page is
/// written: a ledger of millions of rows is never held in memory, and a reader that stops
/// (`audit | less`) does not hold a snapshot of the store open (redb could not reuse the
/// pages later commits free meanwhile). The ledger is append-only, so the pages join up into
/// one consistent prefix of it. The outer error is the store's (a row that does not decode),
/// the inner one the output's.
fn write_audit_pages(
    out: &mut impl std::io::Write,
    store: &crate::store::Store,
    filter: &AuditFilter,
    format: AuditFormat,
    page_rows: usize,
) -> Result<std::io::Result<()>, crate::store::StoreError> {
    if let Err(e) = write_audit_header(out, format) {
        return Ok(Err(e));
    }
    let page_rows = page_rows.max(1);
    let mut next_seq = filter.since_seq.unwrap_or(0);
    loop {
        let mut page = Vec::with_capacity(page_rows);
        let page_filter = AuditFilter { since_seq: Some(next_seq), ..filter.clone() };
        let read = store.audit_walk(&page_filter, false, None, |row| {
            next_seq = row.seq.saturating_add(1);
            page.push(row);
            page.len() < page_rows
        });
        if let Err(e) = page.iter().try_for_each(|row| write_audit_line(out, row, format)) {
            return Ok(Err(e));
        }
        read?;
        if page.len() < page_rows {
            return Ok(Ok(()));
        }
    }
}

/// What comes before the rows of a line format: the CSV header (nothing for JSON lines).
fn write_audit_header(out: &mut impl std::io::Write, format: AuditFormat) -> std::io::Result<()> {
    if format == AuditFormat::Csv {
        writeln!(out, "{}", AUDIT_COLUMNS.join(","))?;
    }
    Ok(())
}

/// One audit row as a line of `format` (JSON lines or CSV).
fn write_audit_line(out: &mut impl std::io::Write, r: &AuditRow, format: AuditFormat) -> std::io::Result<()> {
    match format {
        AuditFormat::Csv => writeln!(out, "{}", audit_cells(r).iter().map(|c| csv_field(c)).collect::<Vec<_>>().join(",")),
        _ => writeln!(out, "{}", audit_json(r)),
    }
}

/// The audit rows as an aligned table, then their count.
fn write_audit_table(out: &mut impl std::io::Write, rows: &[AuditRow]) -> std::io::Result<()> {
    // Cells hold text from feeds (parcel ids, codes): shown escaped, never interpreted.
    let mut table: Vec<Vec<String>> = rows.iter().map(|r| audit_cells(r).iter().map(|c| crate::util::terminal_safe(c).into_owned()).collect()).collect();
    for row in &mut table {
        if row[3].chars().count() > 16 {
            row[3] = format!("{}…", row[3].chars().take(16).collect::<String>());
        }
    }
    let mut widths: Vec<usize> = AUDIT_COLUMNS.iter().map(|c| c.len()).collect();
    for row in &table {
        for (i, c) in row.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| cells.iter().enumerate().map(|(i, c)| format!("{:<w$}", c, w = widths[i])).collect::<Vec<_>>().join("  ");
    writeln!(out, "{}", line(AUDIT_COLUMNS.iter().map(|c| c.to_string()).collect()))?;
    for row in table {
        writeln!(out, "{}", line(row))?;
    }
    writeln!(out, "({} row{})", rows.len(), if rows.len() == 1 { "" } else { "s" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::store::{Claim, Store};

    /// `zonewatch audit`'s line formats, read a page at a time, equal the ledger read whole:
    /// for every page size, with a filter that matches some rows only, and from a `seq`.
    #[test]
    fn audit_lines_read_a_page_at_a_time_equal_the_ledger_read_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("z.redb")).expect("open");
        let events: Vec<_> = (0..25).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..25)
            .map(|i| Claim {
                event: i,
                watcher_id: if i % 3 == 0 { "a" } else { "b" }.into(),
                target: "http://127.0.0.1:9/h".into(),
                min_severity: Severity::Info,
                key: IdemKey(format!("k{i}")),
            })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).expect("enqueue");
        assert_eq!(store.audit(&AuditFilter::default()).expect("audit").len(), 25);
        let filters = [AuditFilter::default(), AuditFilter { watcher: Some("a".into()), ..Default::default() }, AuditFilter { since_seq: Some(5), ..Default::default() }];
        for filter in filters {
            for format in [AuditFormat::Jsonl, AuditFormat::Csv] {
                let mut whole = Vec::new();
                write_audit_header(&mut whole, format).expect("header");
                for row in store.audit(&filter).expect("audit") {
                    write_audit_line(&mut whole, &row, format).expect("line");
                }
                for page_rows in [1, 7, 25, 1000] {
                    let mut paged = Vec::new();
                    write_audit_pages(&mut paged, &store, &filter, format, page_rows).expect("read").expect("write");
                    assert_eq!(String::from_utf8_lossy(&paged), String::from_utf8_lossy(&whole), "{filter:?} {format:?} {page_rows}");
                }
            }
        }
    }
}
