//! ncclNet v7 (the TCPX plugin's table) onto the loader's [`Table`]: its
//! `regMr` takes an `int` size, so a region over 2 GiB cannot be
//! registered.

use std::ffi::c_int;

use super::sys::{NcclNetPropertiesV7, NcclNetV7, SYMBOL_V7};
use super::table::{exported, text, Props, RegMrError, Table};

pub(super) fn read(lib: &libloading::Library) -> Option<Table> {
    let t: NcclNetV7 = exported(lib, SYMBOL_V7)?;
    let get_properties = t.get_properties.map(|f| {
        Box::new(move |dev: c_int, out: &mut Props| {
            // SAFETY: all-zero is a valid value of this plain C struct.
            let mut p: NcclNetPropertiesV7 = unsafe { std::mem::zeroed() };
            // SAFETY: the plugin fills one v7 properties struct.
            let code = unsafe { f(dev, &mut p) };
            *out = Props {
                name: text(p.name),
                pci_path: text(p.pci_path),
                guid: p.guid,
                ptr_support: p.ptr_support,
                speed: p.speed,
                max_comms: p.max_comms,
                max_recvs: p.max_recvs,
                net_device_type: p.net_device_type,
                net_device_version: p.net_device_version,
                reg_is_global: false,
            };
            code
        }) as _
    });
    let reg_mr = t.reg_mr.map(|f| {
        Box::new(move |comm, addr: u64, len: usize, ty, mh: &mut _| {
            let size = c_int::try_from(len).map_err(|_| RegMrError::TooLarge {
                len,
                version: 7,
                max: c_int::MAX as usize,
            })?;
            // SAFETY: `comm` is a live comm of this plugin; the range was
            // checked by the engine (and aligned inside its allocation).
            Ok(unsafe { f(comm, addr as *mut _, size, ty, mh) })
        }) as _
    });
    Some(Table {
        version: 7,
        calls: NcclNetV7 {
            get_properties: None,
            reg_mr: None,
            ..t
        },
        get_properties,
        reg_mr,
    })
}
