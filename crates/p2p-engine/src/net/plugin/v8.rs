//! ncclNet v8 onto the loader's [`Table`]: v7 with `regIsGlobal` in the
//! properties and a `size_t` size in `regMr`.

use std::ffi::c_int;

use super::sys::{NcclNetPropertiesV8, NcclNetV7, NcclNetV8, SYMBOL_V8};
use super::table::{exported, text, Props, Table};

pub(super) fn read(lib: &libloading::Library) -> Option<Table> {
    let t: NcclNetV8 = exported(lib, SYMBOL_V8)?;
    let get_properties = t.get_properties.map(|f| {
        Box::new(move |dev: c_int, out: &mut Props| {
            // SAFETY: all-zero is a valid value of this plain C struct.
            let mut p: NcclNetPropertiesV8 = unsafe { std::mem::zeroed() };
            // SAFETY: the plugin fills one v8 properties struct.
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
                reg_is_global: p.reg_is_global != 0,
            };
            code
        }) as _
    });
    let reg_mr = t.reg_mr.map(|f| {
        Box::new(move |comm, addr: u64, len: usize, ty, mh: &mut _| {
            // SAFETY: `comm` is a live comm of this plugin; the range was
            // checked by the engine (and aligned inside its allocation).
            Ok(unsafe { f(comm, addr as *mut _, len, ty, mh) })
        }) as _
    });
    Some(Table {
        version: 8,
        calls: NcclNetV7 {
            name: t.name,
            init: t.init,
            devices: t.devices,
            get_properties: None,
            listen: t.listen,
            connect: t.connect,
            accept: t.accept,
            reg_mr: None,
            reg_mr_dma_buf: t.reg_mr_dma_buf,
            dereg_mr: t.dereg_mr,
            isend: t.isend,
            irecv: t.irecv,
            iflush: t.iflush,
            test: t.test,
            close_send: t.close_send,
            close_recv: t.close_recv,
            close_listen: t.close_listen,
            get_device_mr: t.get_device_mr,
            irecv_consumed: t.irecv_consumed,
        },
        get_properties,
        reg_mr,
    })
}
