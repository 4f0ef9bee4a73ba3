//! The one table the loader calls, whatever ncclNet version a plugin
//! exports. Each version's module ([`super::v7`], [`super::v8`]) adapts
//! its own table onto it -- as NCCL adapts each older table onto its
//! newest -- so a new version is one new module and one line in the
//! loader's list of versions (`VERSIONS`).

use std::ffi::{c_char, c_int, c_void, CStr};

use super::sys::{NcclNetV7, NcclResult};

/// A device's properties as every version's struct is read into them.
#[derive(Debug, Default)]
pub(super) struct Props {
    pub(super) name: Option<String>,
    pub(super) pci_path: Option<String>,
    pub(super) guid: u64,
    pub(super) ptr_support: c_int,
    pub(super) speed: c_int,
    pub(super) max_comms: c_int,
    pub(super) max_recvs: c_int,
    pub(super) net_device_type: c_int,
    pub(super) net_device_version: c_int,
    pub(super) reg_is_global: bool,
}

/// `getProperties` of device `dev`: fills `Props`, returns the plugin's code.
pub(super) type GetProperties = Box<dyn Fn(c_int, &mut Props) -> NcclResult + Send + Sync>;

/// `regMr(comm, address, length, type, handle out)`: the plugin's code, or
/// why this version cannot register such a range.
pub(super) type RegMr = Box<
    dyn Fn(*mut c_void, u64, usize, c_int, &mut *mut c_void) -> Result<NcclResult, RegMrError>
        + Send
        + Sync,
>;

/// A range a version's `regMr` cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum RegMrError {
    #[error(
        "cannot register {len} bytes: a v{version} plugin takes at most {max} bytes per region"
    )]
    TooLarge {
        len: usize,
        version: u32,
        max: usize,
    },
}

/// What the loader calls.
pub(super) struct Table {
    pub(super) version: u32,
    /// The functions whose C types every version we read shares (v7's
    /// field types); its `get_properties` and `reg_mr` are unset: those are
    /// the adapted ones below.
    pub(super) calls: NcclNetV7,
    pub(super) get_properties: Option<GetProperties>,
    pub(super) reg_mr: Option<RegMr>,
}

/// Reads a version's table out of a loaded library: `None` when the
/// library does not export it (or exports NULL).
pub(super) type Reader = fn(&libloading::Library) -> Option<Table>;

/// A property string, if the plugin gave one.
pub(super) fn text(p: *const c_char) -> Option<String> {
    (!p.is_null())
        // SAFETY: the plugin's property strings are NUL-terminated.
        .then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Copies the exported table `T` named `symbol` out of `lib`.
pub(super) fn exported<T: Copy>(lib: &libloading::Library, symbol: &str) -> Option<T> {
    // SAFETY: the symbol, when present, is the version's table (the
    // plugin's ABI promise); only its address is read here.
    let p = unsafe { lib.get::<*const T>(symbol) }.ok().map(|s| *s)?;
    // SAFETY: a non-null pointer to the exported table, copied out while
    // the library is loaded (and it is never unloaded).
    (!p.is_null()).then(|| unsafe { std::ptr::read(p) })
}
