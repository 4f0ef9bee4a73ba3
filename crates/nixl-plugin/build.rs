//! Compiles the NIXL engine class (src/backend.cpp, over the C API in
//! include/tcpx_p2p.h) into a static library linked into the plugin.
//! NIXL's own headers are not needed: src/nixl_abi.hpp declares the part of
//! the interface a backend uses, checked by static_asserts at compile time.

fn main() {
    for p in [
        "src/backend.cpp",
        "src/nixl_abi.hpp",
        "../../include/tcpx_p2p.h",
    ] {
        println!("cargo:rerun-if-changed={p}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/backend.cpp")
        .include("../../include")
        .include("src")
        .pic(true)
        .flag("-fvisibility=hidden")
        .flag("-Wall")
        .flag("-Wextra")
        .warnings_into_errors(true)
        .compile("tcpx_nixl_backend");
    // Every symbol resolved at link time (the C API included): NIXL loads
    // the plugin with RTLD_NOW and offers it nothing but libstdc++.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,defs");
}
