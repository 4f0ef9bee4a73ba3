//! Every `TCPX_P2P_*` variable the engine, the Python module or the C API
//! reads is documented in docs/CONFIGURATION.md.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The quoted `"TCPX_P2P_NAME"` literals in `text`.
fn variables(text: &str) -> Vec<String> {
    let mut v = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("\"TCPX_P2P_") {
        let s = &rest[i + 1..];
        let end = s
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(s.len());
        if s[end..].starts_with('"') {
            v.push(s[..end].to_string());
        }
        rest = &s[end..];
    }
    v
}

#[test]
fn every_setting_read_is_documented() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/CONFIGURATION.md")).unwrap();
    let mut files = Vec::new();
    for c in [
        "crates/p2p-engine/src",
        "crates/p2p-python/src",
        "crates/p2p-capi/src",
    ] {
        rust_files(&root.join(c), &mut files);
    }
    let mut seen = 0;
    let mut missing = Vec::new();
    for f in &files {
        for var in variables(&std::fs::read_to_string(f).unwrap()) {
            seen += 1;
            if !doc.contains(&format!("`{var}")) {
                missing.push(format!("{var} ({})", f.display()));
            }
        }
    }
    assert!(seen > 20, "found only {seen} settings: the scan is broken");
    assert!(
        missing.is_empty(),
        "settings read but not in docs/CONFIGURATION.md: {missing:?}"
    );
}

#[test]
fn the_scan_finds_quoted_names_only() {
    assert_eq!(
        variables(r#"env("TCPX_P2P_A1"); "TCPX_P2P_B" TCPX_P2P_C "TCPX_P2P_D "#),
        ["TCPX_P2P_A1", "TCPX_P2P_B"]
    );
}
