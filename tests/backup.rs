//! Backups hold every table of the live store with the same rows, and restore refuses a
//! broken or foreign file.

mod common;
use common::*;

#[test]
fn backup_copies_every_table_and_restore_checks_its_input() {
    let ws = Workspace::new(&[Sub { id: "w", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: "http://127.0.0.1:9/h".into(), min_severity: "info", secret: None }], "", "");
    let engine = ws.engine();
    let v1 = grid(30);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let mut v2 = v1.clone();
    v2[0].zone = "C3".into();
    ws.write_layer(&layer(&v2));
    run(&engine, false);

    let dest = ws.path().join("b.redb");
    let info = engine.store.backup_to(&dest).unwrap();
    assert!(info.rows > 60);
    assert!(engine.store.backup_to(&dest).is_err(), "never overwrites");
    let live_tables = engine.store.table_names().unwrap();
    let copy = zonewatch::store::Store::open(&dest).unwrap();
    assert_eq!(copy.table_names().unwrap(), live_tables, "a table is missing from store/backup.rs");
    assert_eq!(copy.audit(&Default::default()).unwrap(), engine.store.audit(&Default::default()).unwrap());
    assert_eq!(copy.outbox().unwrap(), engine.store.outbox().unwrap());
    assert_eq!(copy.snapshot_states("s1").unwrap(), engine.store.snapshot_states("s1").unwrap());
    drop(copy);

    // Restore checks what it is given.
    let junk = ws.path().join("junk.redb");
    std::fs::write(&junk, b"not a database").unwrap();
    assert!(zonewatch::store::backup::restore(&junk, &ws.path().join("target.redb")).is_err());
    assert!(!ws.path().join("target.redb").exists(), "nothing written for a bad backup");
    // In use: the engine holds the live store open.
    let err = zonewatch::store::backup::restore(&dest, &ws.path().join("zw.redb")).unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    drop(engine);
    zonewatch::store::backup::restore(&dest, &ws.path().join("zw.redb")).unwrap();
    assert!(ws.path().join("zw.redb.before-restore").exists(), "the replaced store is kept");
    let engine = ws.engine();
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0000"].zoning, "C3");
}
