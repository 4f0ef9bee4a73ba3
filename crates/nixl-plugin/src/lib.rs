//! `libplugin_TCPX_P2P.so`: a NIXL backend plugin (backend name `TCPX_P2P`)
//! whose data plane is the tcpx-p2p engine.
//!
//! NIXL loads `libplugin_<NAME>.so` from `NIXL_PLUGIN_DIR`, calls
//! `nixl_plugin_init` for its plugin table (API version 1) and creates
//! engines through it. The engine class is C++ (src/backend.cpp, built by
//! build.rs) over the engine's C API, which this crate links in from
//! `tcpx-p2p-capi`; only the two entry points below are exported. See
//! docs/NIXL.md for its settings.

// NIXL takes the backend's name from the file name: libplugin_TCPX_P2P.so.
#![allow(non_snake_case)]

use std::ffi::c_void;

// Keeps the C API's symbols in this shared object for the C++ part.
extern crate tcpx_p2p_capi;

extern "C" {
    /// The plugin table (a `nixlBackendPlugin`), static in the C++ part.
    fn tcpx_nixl_plugin() -> *mut c_void;
}

/// NIXL's entry point: the plugin table.
#[no_mangle]
pub extern "C" fn nixl_plugin_init() -> *mut c_void {
    // SAFETY: returns the address of a static; no arguments, no side effects.
    unsafe { tcpx_nixl_plugin() }
}

/// NIXL's exit point, called when the plugin is unloaded: engines are
/// destroyed by then and nothing else is held.
#[no_mangle]
pub extern "C" fn nixl_plugin_fini() {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::c_int;

    extern "C" {
        /// 0 when every virtual function of the engine class sits in the
        /// slot libnixl calls; else the first slot out of place.
        fn tcpx_nixl_check_slots() -> c_int;
        /// The engine class driven as libnixl drives it: 0, or the line of
        /// the first failed check in src/backend.cpp.
        fn tcpx_nixl_selftest() -> c_int;
    }

    #[test]
    fn engine_class_checks_descriptors_moves_bytes_and_notifies() {
        // SAFETY: self-contained; it makes and drops its own engine.
        assert_eq!(
            unsafe { tcpx_nixl_selftest() },
            0,
            "see that line of src/backend.cpp"
        );
    }

    #[test]
    fn virtual_slots_match_libnixl() {
        // SAFETY: a pure function over constants of the C++ part.
        assert_eq!(unsafe { tcpx_nixl_check_slots() }, 0);
    }

    #[test]
    fn plugin_table_reports_api_version_1() {
        let p = nixl_plugin_init() as *const c_int;
        assert!(!p.is_null());
        // SAFETY: the table starts with its int api_version.
        assert_eq!(unsafe { *p }, 1);
    }

    #[test]
    fn plugin_table_names_the_backend() {
        type Name = extern "C" fn() -> *const std::ffi::c_char;
        let table = nixl_plugin_init() as *const u8;
        // SAFETY: get_plugin_name is the fourth slot (offset 24) of the
        // table, a function taking nothing and returning a static C string.
        let name = unsafe {
            let f: Name = std::ptr::read(table.add(24) as *const Name);
            std::ffi::CStr::from_ptr(f())
        };
        assert_eq!(name.to_str(), Ok("TCPX_P2P"));
    }
}
