//! The C API from C: builds `libtcpx_p2p.so`, checks that the header
//! declares exactly the library's exports (and the status codes, constants
//! and struct layouts the Rust side uses), then compiles the C test program
//! against the header and library and runs it (two processes, host memory,
//! bytes compared).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use tcpx_p2p_capi::{Status, TcpxAccepted, TcpxBuf, TcpxNotif, TcpxRmaIov};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..")
}

fn header() -> PathBuf {
    repo().join("include/tcpx_p2p.h")
}

/// Builds the shared library with the profile of this test (once per
/// run: the tests run in parallel); its folder.
fn build_library() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(build_library_now).clone()
}

fn build_library_now() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    let target = profile_dir.parent().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-q", "-p", "tcpx-p2p-clib", "--target-dir"])
        .arg(target);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let st = cmd.status().expect("running cargo");
    assert!(st.success(), "building libtcpx_p2p.so failed");
    assert!(profile_dir.join("libtcpx_p2p.so").exists());
    profile_dir
}

/// Names of the functions the header declares (comments stripped).
fn header_functions() -> BTreeSet<String> {
    let text = std::fs::read_to_string(header()).unwrap();
    let mut code = String::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("/*") {
        code.push_str(&rest[..i]);
        rest = &rest[i..];
        rest = &rest[rest.find("*/").map_or(rest.len(), |j| j + 2)..];
    }
    code.push_str(rest);
    let mut names = BTreeSet::new();
    for (i, _) in code.match_indices("tcpx_") {
        let tail = &code[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let after = tail[end..].trim_start();
        let before = code[..i].chars().last();
        if after.starts_with('(') && before.is_none_or(|c| c.is_whitespace() || c == '*') {
            names.insert(tail[..end].to_string());
        }
    }
    names
}

/// Functions the library exports.
fn exported_functions(lib: &Path) -> BTreeSet<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib)
        .output()
        .expect("running nm (binutils)");
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 3 && f[1] == "T").then(|| f[2].to_string())
        })
        .collect()
}

#[test]
fn header_matches_exports() {
    let dir = build_library();
    let declared = header_functions();
    let exported = exported_functions(&dir.join("libtcpx_p2p.so"));
    assert!(declared.len() >= 30, "header parse found {declared:?}");
    let missing: Vec<_> = exported.difference(&declared).collect();
    let absent: Vec<_> = declared.difference(&exported).collect();
    assert!(
        missing.is_empty() && absent.is_empty(),
        "exported but not declared: {missing:?}; declared but not exported: {absent:?}"
    );
}

#[test]
fn header_status_codes_match() {
    let text = std::fs::read_to_string(header()).unwrap();
    let mut in_header = BTreeSet::new();
    for line in text.lines() {
        let l = line.trim().trim_end_matches(',');
        if let Some((name, value)) = l.split_once(" = ") {
            if name.starts_with("TCPX_") {
                in_header.insert((name.to_string(), value.parse::<i32>().unwrap()));
            }
        }
    }
    let in_rust: BTreeSet<(String, i32)> = Status::ALL
        .iter()
        .map(|s| {
            let camel = format!("{s:?}");
            let mut snake = String::new();
            for (i, c) in camel.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    snake.push('_');
                }
                snake.push(c.to_ascii_uppercase());
            }
            let prefix = if (*s as i32) < 0 {
                "TCPX_ERR_"
            } else {
                "TCPX_"
            };
            (format!("{prefix}{snake}"), *s as i32)
        })
        .collect();
    assert_eq!(in_header, in_rust);
}

/// Compiles the C test program (once per run); its path.
fn compile(dir: &Path) -> PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/capi_test.c");
    EXE.get_or_init(|| compile_now(dir, &src, "capi_test"))
        .clone()
}

/// Compiles `src` against the header and the library in `dir` into the
/// test's scratch folder as `name`, with every warning an error.
fn compile_now(dir: &Path, src: &Path, name: &str) -> PathBuf {
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args([
            "-std=c11",
            "-D_POSIX_C_SOURCE=200809L",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O1",
            "-g",
        ])
        .arg("-I")
        .arg(repo().join("include"))
        .arg(src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(dir)
        .arg("-ltcpx_p2p")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler {cc:?}: {e}"));
    assert!(
        out.status.success(),
        "compiling {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

#[test]
fn header_layout_matches_rust() {
    let dir = build_library();
    let exe = compile(&dir);
    let out = Command::new(&exe).arg("--layout").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let c: std::collections::BTreeMap<&str, usize> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    use std::mem::{offset_of, size_of};
    let rust = [
        ("TCPX_DESC_LEN", tcpx_p2p_capi::desc::DESC_LEN),
        ("TCPX_METADATA_MAX", 16 + 2 + 1 + 255),
        ("TCPX_NOTIF_MAX", tcpx_p2p::notif::MAX_NOTIF),
        ("TCPX_NAME_MAX", tcpx_p2p::notif::MAX_NOTIF_NAME),
        ("TCPX_IP_LEN", tcpx_p2p_capi::IP_LEN),
        ("TCPX_IOV_MAX", tcpx_p2p_wire::MAX_RMA_PIECES),
        ("sizeof(tcpx_status_t)", size_of::<Status>()),
        ("sizeof(tcpx_buf_t)", size_of::<TcpxBuf>()),
        ("offsetof(tcpx_buf_t,len)", offset_of!(TcpxBuf, len)),
        ("sizeof(tcpx_rma_iov_t)", size_of::<TcpxRmaIov>()),
        (
            "offsetof(tcpx_rma_iov_t,desc)",
            offset_of!(TcpxRmaIov, desc),
        ),
        (
            "offsetof(tcpx_rma_iov_t,remote_offset)",
            offset_of!(TcpxRmaIov, remote_offset),
        ),
        ("sizeof(tcpx_accepted_t)", size_of::<TcpxAccepted>()),
        (
            "offsetof(tcpx_accepted_t,remote_gpu)",
            offset_of!(TcpxAccepted, remote_gpu),
        ),
        ("offsetof(tcpx_accepted_t,ip)", offset_of!(TcpxAccepted, ip)),
        ("sizeof(tcpx_notif_t)", size_of::<TcpxNotif>()),
        (
            "offsetof(tcpx_notif_t,name_len)",
            offset_of!(TcpxNotif, name_len),
        ),
        (
            "offsetof(tcpx_notif_t,msg_len)",
            offset_of!(TcpxNotif, msg_len),
        ),
    ];
    for (k, v) in rust {
        assert_eq!(c.get(k), Some(&v), "{k}: C says {:?}, Rust {v}", c.get(k));
    }
    assert_eq!(c.len(), rust.len());
}

#[test]
fn header_compiles_as_cpp() {
    // The NIXL plugin includes the header from C++.
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-x",
            "c++",
        ])
        .arg(header())
        .output()
        .unwrap_or_else(|e| panic!("running the C++ compiler {cxx:?}: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn c_program_two_processes() {
    let dir = build_library();
    let exe = compile(&dir);
    let out = Command::new(&exe)
        .env("TCPX_P2P_LOG", "error")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "C test failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("capi_test: passed"));
}

/// docs/CAPI.md's example is a complete program: compiled exactly as the
/// file the page shows (every warning an error) and run, it moves its
/// bytes, checks them and says so.
#[test]
fn docs_example_compiles_and_runs() {
    let dir = build_library();
    let src = repo().join("examples/c/write_notify.c");
    let exe = compile_now(&dir, &src, "write_notify");
    let out = Command::new(&exe)
        .arg("lo")
        .env("TCPX_P2P_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        src.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("target: notification from writer: done"),
        "{stdout}"
    );
    assert!(
        stdout.contains("target: 4194304 bytes landed, 0 differ"),
        "{stdout}"
    );
    assert!(stdout.contains("write_notify: OK"), "{stdout}");
}
