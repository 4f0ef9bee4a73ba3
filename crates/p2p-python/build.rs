//! Builds the TCPX stand-in ncclNet plugin (crates/nccl-net-emu) and the
//! NIXL backend plugin (crates/nixl-plugin) and puts `libnccl_net_emu.so`
//! and `nixl/libplugin_TCPX_P2P.so` inside the Python package, so that
//! `tcpx_p2p.emulator_plugin_path()` and `tcpx_p2p.nixl_plugin_dir()` find
//! them after `pip install .`. A nested cargo with its own target directory
//! (the outer build holds the lock on ours). Set TCPX_P2P_SKIP_EMU=1 to skip
//! both.
//!
//! The package's copies come from release builds: a debug build of this
//! crate (`cargo clippy`, `cargo test --workspace`) only fills them where
//! they are missing, never replaces them -- it used to put debug builds of
//! both plugins where the Python tests and the benchmarks on a development
//! machine then loaded them (the NIXL plugin with its debug checks ran the
//! 131,072-descriptor rows).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=TCPX_P2P_SKIP_EMU");
    for p in [
        "../nccl-net-emu/src",
        "../nccl-net-emu/Cargo.toml",
        "../p2p-engine/src",
        "../p2p-engine/Cargo.toml",
        "../nixl-plugin/src",
        "../nixl-plugin/build.rs",
        "../nixl-plugin/Cargo.toml",
        "../p2p-capi/src",
        "../p2p-capi/Cargo.toml",
        "../../include",
    ] {
        println!("cargo:rerun-if-changed={p}");
    }
    if std::env::var("TCPX_P2P_SKIP_EMU").is_ok_and(|v| v == "1") {
        return;
    }
    let manifest =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target_dir = out.join("emu-target");
    let release = std::env::var("PROFILE").as_deref() == Ok("release");
    let pkg = manifest.join("python/tcpx_p2p");
    let (emu_so, nixl_so) = (
        pkg.join("libnccl_net_emu.so"),
        pkg.join("nixl/libplugin_TCPX_P2P.so"),
    );
    if !release && emu_so.exists() && nixl_so.exists() {
        return;
    }
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args([
        "build",
        "-p",
        "nccl-net-emu",
        "-p",
        "tcpx-p2p-nixl-plugin",
        "--lib",
    ])
    .arg("--manifest-path")
    .arg(manifest.join("../../Cargo.toml"))
    .arg("--target-dir")
    .arg(&target_dir)
    .env_remove("CARGO_TARGET_DIR")
    .env_remove("RUSTFLAGS")
    .env_remove("CARGO_ENCODED_RUSTFLAGS");
    if release {
        cmd.arg("--release");
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build nccl-net-emu: {e}"));
    if !status.success() {
        panic!("building nccl-net-emu (the TCPX stand-in plugin) and the NIXL plugin failed; see the output above");
    }
    let built = target_dir.join(if release { "release" } else { "debug" });
    let nixl = pkg.join("nixl");
    std::fs::create_dir_all(&nixl).unwrap_or_else(|e| panic!("creating {}: {e}", nixl.display()));
    for (name, to) in [
        ("libnccl_net_emu.so", &emu_so),
        ("libplugin_TCPX_P2P.so", &nixl_so),
    ] {
        if release || !to.exists() {
            copy(&built.join(name), to);
        }
    }
}

/// Puts a copy of `from` at `to` by renaming a fresh file over it, never by
/// rewriting `to` in place: a process that has the old library loaded (a
/// test run beside this build) keeps its mapping intact instead of dying of
/// SIGBUS. An identical file is left alone.
fn copy(from: &std::path::Path, to: &std::path::Path) {
    let ctx = || format!("copying {} to {}", from.display(), to.display());
    let new = std::fs::read(from).unwrap_or_else(|e| panic!("{}: {e}", ctx()));
    if std::fs::read(to).is_ok_and(|old| old == new) {
        return;
    }
    let tmp = to.with_extension(format!("so.tmp{}", std::process::id()));
    std::fs::write(&tmp, &new).unwrap_or_else(|e| panic!("{}: {e}", ctx()));
    let mode = std::fs::metadata(from)
        .unwrap_or_else(|e| panic!("{}: {e}", ctx()))
        .permissions();
    std::fs::set_permissions(&tmp, mode).unwrap_or_else(|e| panic!("{}: {e}", ctx()));
    std::fs::rename(&tmp, to).unwrap_or_else(|e| panic!("{}: {e}", ctx()));
}
