//! The .deb: built with packaging/build-deb.sh from the release binary, lintian-clean (no
//! errors), and the unpacked binary accepts the shipped default config.

use std::path::Path;
use std::process::Command;

#[test]
fn deb_builds_is_lintian_clean_and_its_default_config_checks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if Command::new("dpkg-deb").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "dpkg-deb missing under CI");
        eprintln!("SKIPPED (peers): dpkg-deb not available");
        return;
    }
    // The test binary's sibling is the release binary the script packages.
    let o = Command::new("bash").arg(root.join("packaging/build-deb.sh")).arg("--no-build").current_dir(root).output().unwrap();
    assert!(o.status.success(), "build-deb failed: {}", String::from_utf8_lossy(&o.stderr));
    let deb = root.join(String::from_utf8_lossy(&o.stdout).trim());
    assert!(deb.exists(), "{}", deb.display());

    match Command::new("lintian").args(["--tag-display-limit", "0"]).arg(&deb).output() {
        Ok(l) => {
            let out = String::from_utf8_lossy(&l.stdout);
            let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("E:")).collect();
            assert!(errors.is_empty(), "lintian errors:\n{}", errors.join("\n"));
            eprintln!("lintian: {} warning(s)", out.lines().filter(|l| l.starts_with("W:")).count());
        }
        Err(_) => {
            assert!(std::env::var_os("CI").is_none(), "lintian missing under CI: scripts/test installs it");
            eprintln!("SKIPPED (peers): lintian not installed");
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let x = Command::new("dpkg-deb").arg("-x").arg(&deb).arg(dir.path()).status().unwrap();
    assert!(x.success());
    for f in ["usr/bin/zonewatch", "etc/zonewatch/zonewatch.toml", "lib/systemd/system/zonewatch.service", "usr/share/doc/zonewatch/copyright", "usr/share/doc/zonewatch/docs/PERFORMANCE.md"] {
        assert!(dir.path().join(f).exists(), "package lacks {f}");
    }
    let unit = std::fs::read_to_string(dir.path().join("lib/systemd/system/zonewatch.service")).unwrap();
    for needle in ["StateDirectory=zonewatch", "ProtectSystem=strict", "Restart=on-failure", "RestartPreventExitStatus=2", "User=zonewatch"] {
        assert!(unit.contains(needle), "unit lacks {needle}");
    }
    // The shipped config checks as installed: its store goes in /var/lib/zonewatch, which
    // postinst makes (`check` refuses a store folder that does not exist, as `run` and `serve`
    // do); here that folder is made under the unpacked tree, as postinst would.
    let shipped = std::fs::read_to_string(dir.path().join("etc/zonewatch/zonewatch.toml")).unwrap();
    assert!(shipped.contains("path = \"/var/lib/zonewatch/zonewatch.redb\""), "{shipped}");
    let postinst = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/debian/postinst")).unwrap();
    assert!(postinst.contains("[ -d /var/lib/zonewatch ] || install -d -o zonewatch -g zonewatch -m 0750 /var/lib/zonewatch"), "{postinst}");
    // No recursive chown as root in a folder the service user can write (a reader: it could
    // be turned on a file outside it); systemd's StateDirectory= re-owns a kept folder.
    let mut code = postinst.lines().filter(|l| !l.trim_start().starts_with('#'));
    assert!(!code.any(|l| l.contains("chown -R") || l.contains("-exec chown") || l.contains("find ")), "{postinst}");
    let state = dir.path().join("var/lib/zonewatch");
    std::fs::create_dir_all(&state).unwrap();
    let installed = dir.path().join("etc/zonewatch/installed.toml");
    std::fs::write(&installed, shipped.replace("/var/lib/zonewatch", state.to_str().unwrap())).unwrap();
    let o = Command::new(dir.path().join("usr/bin/zonewatch")).args(["check", "--config"]).arg(&installed).output().unwrap();
    assert!(o.status.success(), "shipped config does not check: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("all good"));
}
