//! `zonewatch bench`: measures the pipeline on synthetic counties, on the user's own hardware.
//!
//! Why a subcommand and not only `cargo bench`: the operator of an edge box wants to know what
//! *their* machine can ingest before pointing zonewatch at a 2-million-parcel county. Every
//! measure prints one JSON line per result (`{"bench": "...", ...}`) on stdout, so the output
//! can be kept and compared; `docs/PERFORMANCE.md` shows the lines of a reference run and the
//! command that reproduces them.
//!
//! Measures that report peak memory run in a child process of this same binary
//! (`--in-process`), so one measure's allocations never inflate another's peak.
//! `--scale test` runs every measure at toy sizes: the test suite uses it so the bench code
//! cannot rot (it checks the outputs are sane, not the timings).

pub mod delivery;
pub mod gen;
pub mod ingest;
pub mod recovery;
pub mod rss;
pub mod matching;
pub mod commit;
pub mod overlay;
pub mod portal;
pub mod idle;

use clap::{Args, ValueEnum};
use serde_json::Value;
use std::io::Write as _;
use std::path::PathBuf;

/// Errors of a bench run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("io on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Failed(String),
}

impl BenchError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BenchError::Io { path: path.into(), source }
    }
}

/// The field mapping of the generated county's layer (`gen.rs`), as a source's config
/// takes it: the parcel source of every measure that ingests the county.
pub const COUNTY_FIELDS: &str = "[source.fields]\nparcel_id = \"APN\"\nzoning = \"ZONE_CODE\"\neffective_date = \"EFF_DATE\"\n";

/// Preset sizes.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Toy sizes, seconds: what the test suite runs.
    Test,
    /// 100k parcels, 10k AOIs: a few minutes.
    Small,
    /// County sizes: 100k / 1M / 2.5M parcels, 10k / 100k AOIs. Needs ~10 GB of disk.
    Full,
}

/// The measures, in the order they run.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeasureName {
    Ingest,
    Portal,
    Matching,
    Commit,
    Delivery,
    Recovery,
    Overlay,
    Idle,
}

/// `zonewatch bench` arguments.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[arg(long, value_enum, default_value_t = Scale::Small)]
    pub scale: Scale,
    /// Run only these measures (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<MeasureName>,
    /// Parcel counts for the ingest measure (overrides the scale's).
    #[arg(long, value_delimiter = ',')]
    pub parcels: Vec<usize>,
    /// Working folder for generated layers and stores (kept; generated files are reused by a
    /// later run with the same seed). Default: a temporary folder removed at the end.
    #[arg(long)]
    pub work: Option<PathBuf>,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Run the measure here instead of in a child process (used by the parent itself).
    #[arg(long, hide = true)]
    pub in_process: bool,
}

/// What every measure gets.
#[derive(Debug, Clone)]
pub struct BenchCtx {
    pub scale: Scale,
    pub work: PathBuf,
    pub seed: u64,
    pub parcels: Vec<usize>,
    pub in_process: bool,
}

impl BenchCtx {
    /// Parcel counts for county-sized measures.
    pub fn parcel_sizes(&self) -> Vec<usize> {
        if !self.parcels.is_empty() {
            return self.parcels.clone();
        }
        match self.scale {
            Scale::Test => vec![3_000],
            Scale::Small => vec![100_000],
            Scale::Full => vec![100_000, 1_000_000, 2_500_000],
        }
    }

    /// `<work>/<name>`, emptied (a folder of a previous run) and created again: where a
    /// measure keeps its store.
    pub fn fresh_dir(&self, name: &str) -> Result<PathBuf, BenchError> {
        let dir = self.work.join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
        Ok(dir)
    }

    /// Runs `zonewatch bench --only NAME --in-process ...extra` in a child process and passes
    /// its JSON lines through (they are already printed by the child).
    pub fn run_child(&self, name: &str, extra: &[String]) -> Result<(), BenchError> {
        let exe = std::env::current_exe().map_err(|e| BenchError::io("current_exe", e))?;
        let scale = match self.scale {
            Scale::Test => "test",
            Scale::Small => "small",
            Scale::Full => "full",
        };
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["bench", "--in-process", "--only", name, "--scale", scale, "--seed", &self.seed.to_string()]);
        cmd.arg("--work").arg(&self.work);
        cmd.args(extra);
        let status = cmd.status().map_err(|e| BenchError::io("bench child", e))?;
        if !status.success() {
            return Err(BenchError::Failed(format!("bench child {name} {extra:?} exited with {status}")));
        }
        Ok(())
    }
}

/// Prints one result line (`{"bench": name, ...fields}`) and flushes, so a long run shows
/// its results as they come.
pub fn emit(bench: &str, fields: Value) {
    // `bench` first, for the human reading the lines (serde_json's map sorts the rest).
    let mut line = serde_json::json!({ "bench": bench }).to_string();
    if let Value::Object(map) = fields {
        let rest = Value::Object(map.into_iter().filter(|(k, _)| k != "bench").collect()).to_string();
        if rest.len() > 2 {
            line.pop();
            line.push(',');
            line.push_str(&rest[1..]);
        }
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Rate rounded to a whole number per second (0 for a zero duration).
pub fn per_s(n: u64, secs: f64) -> f64 {
    if secs <= 0.0 {
        0.0
    } else {
        (n as f64 / secs).round()
    }
}

/// Seconds rounded to milliseconds.
pub fn secs(d: std::time::Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// `zonewatch bench`: runs the selected measures. Exit code 0 when every measure ran.
pub fn cmd_bench(args: BenchArgs) -> i32 {
    let (_tmp, work) = match &args.work {
        Some(w) => (None, w.clone()),
        None => match tempfile::Builder::new().prefix("zonewatch-bench-").tempdir() {
            Ok(t) => {
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
            Err(e) => {
                eprintln!("bench: cannot create a work folder: {e}");
                return 2;
            }
        },
    };
    if let Err(e) = std::fs::create_dir_all(&work) {
        eprintln!("bench: cannot create {}: {e}", work.display());
        return 2;
    }
    let ctx = BenchCtx { scale: args.scale, work, seed: args.seed, parcels: args.parcels.clone(), in_process: args.in_process };
    let measures: Vec<MeasureName> = if args.only.is_empty() {
        MeasureName::value_variants().to_vec()
    } else {
        args.only.clone()
    };
    let mut failed = 0;
    for m in measures {
        let r = match m {
            MeasureName::Ingest => ingest::run(&ctx),
            MeasureName::Portal => portal::run(&ctx),
            MeasureName::Matching => matching::run(&ctx),
            MeasureName::Commit => commit::run(&ctx),
            MeasureName::Overlay => overlay::run(&ctx),
            MeasureName::Idle => idle::run(&ctx),
            MeasureName::Delivery => delivery::run(&ctx),
            MeasureName::Recovery => recovery::run(&ctx),
        };
        if let Err(e) = r {
            eprintln!("bench {m:?}: {e}");
            emit(&format!("{m:?}").to_lowercase(), serde_json::json!({"error": e.to_string()}));
            failed += 1;
        }
    }
    i32::from(failed > 0)
}
