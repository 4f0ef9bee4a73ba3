//! The C API of tcpx-p2p (`include/tcpx_p2p.h`): `extern "C"` functions over
//! [`tcpx_p2p::Endpoint`]. Every body runs behind a panic boundary
//! ([`status::guard`]), every pointer is checked before use, handles are
//! opaque boxes that carry a tag checked on each call, and engine errors
//! become [`Status`] codes in one function ([`status::status_of`]).
//!
//! # Safety
//!
//! The functions are `unsafe` because C hands them raw pointers. Their
//! common contract (stated once here rather than per function): a non-NULL
//! handle is one this library returned and has not freed; a non-NULL data
//! pointer is valid for the length given beside it (reads, or writes for
//! outputs) for the duration of the call; registered memory stays valid
//! until deregistered. NULL is always checked and refused where an object
//! is required.
#![allow(clippy::missing_safety_doc)] // the contract above covers every function

pub mod config;
pub mod desc;
pub mod status;

use std::ffi::{c_char, c_void, CStr};
use std::time::Duration;

use tcpx_p2p::notif::MAX_NOTIF;
use tcpx_p2p::RemoteDesc;
use tcpx_p2p::{Buf, Endpoint, Error, Notif};

use crate::config::CConfig;
use crate::desc::DESC_LEN;
pub use crate::status::Status;
use crate::status::{guard, guard_void, last_error_ptr, Fail, Res};

/// Bytes of `tcpx_accepted_t::ip`.
pub const IP_LEN: usize = 64;

const CONFIG_TAG: u64 = 0x7463_7078_6366_6731; // "tcpxcfg1"
const ENDPOINT_TAG: u64 = 0x7463_7078_6570_3031; // "tcpxep01"
const NOTIFS_TAG: u64 = 0x7463_7078_6e74_6631; // "tcpxntf1"

/// `tcpx_config_t`.
#[repr(C)] // the tag first, where a check reads it
pub struct TcpxConfig {
    tag: u64,
    c: CConfig,
}

/// `tcpx_endpoint_t`.
#[repr(C)] // the tag first, where a check reads it
pub struct TcpxEndpoint {
    tag: u64,
    ep: Endpoint,
}

/// `tcpx_notifs_t`.
#[repr(C)] // the tag first, where a check reads it
pub struct TcpxNotifs {
    tag: u64,
    list: Vec<Notif>,
}

/// `tcpx_buf_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TcpxBuf {
    pub mr: u64,
    pub ptr: *mut c_void,
    pub len: usize,
}

/// `tcpx_rma_iov_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TcpxRmaIov {
    pub mr: u64,
    pub ptr: *mut c_void,
    pub len: usize,
    pub desc: *const u8,
    pub remote_offset: u64,
}

/// `tcpx_accepted_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TcpxAccepted {
    pub conn: u64,
    pub remote_gpu: i32,
    pub ip: [c_char; IP_LEN],
}

/// `tcpx_notif_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TcpxNotif {
    pub conn: u64,
    pub name: *const c_char,
    pub name_len: usize,
    pub msg: *const u8,
    pub msg_len: usize,
}

// ------------------------------------------------------- pointer checks
//
// These read the caller's pointers on the crate-level contract above; they
// are private, so only the extern functions reach them.

/// A non-NULL, aligned pointer to a live handle with the expected tag.
fn handle<'a, T>(p: *const T, tag_of: impl Fn(&T) -> u64, tag: u64, what: &str) -> Res<&'a T> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(Fail::invalid(format!("{what} is not a valid handle")));
    }
    // SAFETY: non-NULL and aligned; by the crate's contract it is a handle
    // this library returned and has not freed.
    let r = unsafe { &*p };
    if tag_of(r) != tag {
        return Err(Fail::invalid(format!(
            "{what} is not a valid handle (freed, or never one)"
        )));
    }
    Ok(r)
}

fn endpoint<'a>(p: *const TcpxEndpoint) -> Res<&'a Endpoint> {
    handle(p, |h| h.tag, ENDPOINT_TAG, "endpoint").map(|h| &h.ep)
}

/// A non-NULL, aligned output location.
fn out<'a, T>(p: *mut T, what: &str) -> Res<&'a mut T> {
    if p.is_null() || !p.is_aligned() {
        return Err(Fail::invalid(format!("{what} is NULL or misaligned")));
    }
    // SAFETY: non-NULL and aligned; the caller gives a writable `T`.
    Ok(unsafe { &mut *p })
}

/// `n` elements at `p` (NULL allowed only when `n` is 0).
fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Res<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() || !p.is_aligned() {
        return Err(Fail::invalid(format!("{what} is NULL or misaligned")));
    }
    if n.checked_mul(size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(Fail::invalid(format!("{what}: {n} elements is too many")));
    }
    // SAFETY: non-NULL, aligned, size in range; the caller gives `n`
    // readable elements.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// `n` writable bytes at `p`.
fn out_bytes<'a>(p: *mut u8, n: usize, what: &str) -> Res<&'a mut [u8]> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL; the caller gives `n` writable bytes.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// A NUL-terminated UTF-8 string.
fn cstr<'a>(p: *const c_char, what: &str) -> Res<&'a str> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL; the caller gives a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| Fail::invalid(format!("{what} is not UTF-8")))
}

/// A remote descriptor of [`DESC_LEN`] bytes.
fn remote(p: *const u8, what: &str) -> Res<RemoteDesc> {
    let b = slice(p, DESC_LEN, what)?;
    let mut a = [0u8; DESC_LEN];
    a.copy_from_slice(b);
    desc::parse(&a)
}

/// An optional notification: NULL for none.
fn notif_arg<'a>(p: *const c_void, n: usize) -> Res<Option<&'a [u8]>> {
    if p.is_null() {
        return if n == 0 {
            Ok(None)
        } else {
            Err(Fail::invalid(
                "notification is NULL but its length is not 0",
            ))
        };
    }
    if n > MAX_NOTIF {
        return Err(Fail::invalid(format!(
            "notification of {n} bytes exceeds the limit of {MAX_NOTIF} bytes"
        )));
    }
    slice(p.cast::<u8>(), n, "notification").map(|s| Some(if n == 0 { &[][..] } else { s }))
}

fn bufs_of(b: &[TcpxBuf]) -> Res<Vec<Buf>> {
    if b.is_empty() {
        return Err(Fail::invalid("no buffers given"));
    }
    b.iter()
        .enumerate()
        .map(|(i, b)| {
            if b.ptr.is_null() {
                return Err(Fail::invalid(format!("buffer {i}: pointer is NULL")));
            }
            Ok(Buf {
                mr: b.mr,
                ptr: b.ptr as u64,
                len: b.len,
            })
        })
        .collect()
}

/// An engine failure of a call on `conn` over registrations `mrs`: an id
/// the endpoint does not know becomes [`Status::UnknownId`].
fn on_ids(ep: &Endpoint, conn: Option<u64>, mrs: &[u64], e: Error) -> Fail {
    let mut f = Fail::from(e);
    if f.status == Status::InvalidArgument {
        let unknown_conn =
            conn.is_some_and(|c| matches!(ep.conn_failure(c), Err(Error::Invalid(_))));
        if unknown_conn || mrs.iter().any(|&m| ep.region(m).is_err()) {
            f.status = Status::UnknownId;
        }
    }
    f
}

/// An engine failure of a call on transfer ids: an unknown id is the only
/// caller mistake such a call can make.
fn on_xfer(e: Error) -> Fail {
    let mut f = Fail::from(e);
    if f.status == Status::InvalidArgument {
        f.status = Status::UnknownId;
    }
    f
}

/// A C timeout: negative, or longer than the engine's longest, waits
/// without limit (the engine's one parser decides).
fn timeout_of(ms: i64) -> Option<Duration> {
    tcpx_p2p::timeout::from_millis_i64(ms)
}

fn accepted(a: tcpx_p2p::Accepted, o: &mut TcpxAccepted) {
    let ip = a.ip.to_string();
    let mut buf = [0 as c_char; IP_LEN];
    for (d, s) in buf.iter_mut().zip(ip.bytes().take(IP_LEN - 1)) {
        *d = s as c_char;
    }
    *o = TcpxAccepted {
        conn: a.conn,
        remote_gpu: a.gpu_index,
        ip: buf,
    };
}

// -------------------------------------------------------------- library

/// The library's version (static).
#[no_mangle]
pub extern "C" fn tcpx_version() -> *const c_char {
    static V: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(s) => s,
            Err(_) => c"unknown",
        };
    V.as_ptr()
}

/// A static description of a status code.
#[no_mangle]
pub extern "C" fn tcpx_status_str(status: i32) -> *const c_char {
    Status::ALL
        .iter()
        .find(|s| **s as i32 == status)
        .map_or(c"unknown status code", |s| s.describe())
        .as_ptr()
}

/// The calling thread's last failure ("" if none).
#[no_mangle]
pub extern "C" fn tcpx_last_error() -> *const c_char {
    last_error_ptr()
}

// --------------------------------------------------------------- config

#[no_mangle]
pub unsafe extern "C" fn tcpx_config_new(out_cfg: *mut *mut TcpxConfig) -> Status {
    guard("tcpx_config_new", || {
        let o = out(out_cfg, "out")?;
        *o = Box::into_raw(Box::new(TcpxConfig {
            tag: CONFIG_TAG,
            c: CConfig::from_env()?,
        }));
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_config_set(
    cfg: *mut TcpxConfig,
    key: *const c_char,
    value: *const c_char,
) -> Status {
    guard("tcpx_config_set", || {
        handle(cfg, |h| h.tag, CONFIG_TAG, "config")?;
        let (k, v) = (cstr(key, "key")?, cstr(value, "value")?);
        // SAFETY: checked above to be a live config handle; the header
        // forbids setting one config from two threads at once.
        let c = unsafe { &mut (*cfg).c };
        c.set(k, v)?;
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_config_free(cfg: *mut TcpxConfig) {
    guard_void("tcpx_config_free", || {
        if handle(cfg, |h| h.tag, CONFIG_TAG, "config").is_ok() {
            // SAFETY: a live handle from Box::into_raw; its tag is cleared
            // first so that a second free is refused.
            unsafe {
                (*cfg).tag = 0;
                drop(Box::from_raw(cfg));
            }
        }
    })
}

// ------------------------------------------------------------- endpoint

#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_create(
    cfg: *const TcpxConfig,
    out_ep: *mut *mut TcpxEndpoint,
) -> Status {
    guard("tcpx_endpoint_create", || {
        let c = &handle(cfg, |h| h.tag, CONFIG_TAG, "config")?.c;
        let o = out(out_ep, "out")?;
        c.check()?;
        tcpx_p2p::init_logging();
        let ep = Endpoint::new(c.gpu, c.cfg.clone())?;
        *o = Box::into_raw(Box::new(TcpxEndpoint {
            tag: ENDPOINT_TAG,
            ep,
        }));
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_destroy(ep: *mut TcpxEndpoint) {
    guard_void("tcpx_endpoint_destroy", || {
        if handle(ep, |h| h.tag, ENDPOINT_TAG, "endpoint").is_ok() {
            // SAFETY: a live handle from Box::into_raw, not in use by other
            // calls (the header's rule); tag cleared before the free.
            unsafe {
                (*ep).tag = 0;
                drop(Box::from_raw(ep));
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_metadata(
    ep: *const TcpxEndpoint,
    buf: *mut u8,
    len: *mut usize,
) -> Status {
    guard("tcpx_endpoint_metadata", || {
        let ep = endpoint(ep)?;
        let n = out(len, "len")?;
        let md = ep.metadata();
        if *n < md.len() {
            *n = md.len();
            return Err(Fail::new(
                Status::BufferTooSmall,
                format!("metadata needs {} bytes", md.len()),
            ));
        }
        out_bytes(buf, md.len(), "buf")?.copy_from_slice(&md);
        *n = md.len();
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_name(
    ep: *const TcpxEndpoint,
    buf: *mut c_char,
    cap: usize,
) -> Status {
    guard("tcpx_endpoint_name", || {
        let name = endpoint(ep)?.name().as_bytes();
        if cap < name.len() + 1 {
            return Err(Fail::new(
                Status::BufferTooSmall,
                format!("the name needs {} bytes", name.len() + 1),
            ));
        }
        let b = out_bytes(buf.cast::<u8>(), name.len() + 1, "buf")?;
        b[..name.len()].copy_from_slice(name);
        b[name.len()] = 0;
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_port(ep: *const TcpxEndpoint, port: *mut u16) -> Status {
    guard("tcpx_endpoint_port", || {
        let ep = endpoint(ep)?;
        *out(port, "port")? = ep.local_addr().port();
        Ok(Status::Ok)
    })
}

// ---------------------------------------------------------- connections

#[no_mangle]
pub unsafe extern "C" fn tcpx_connect_metadata(
    ep: *mut TcpxEndpoint,
    metadata: *const u8,
    len: usize,
    conn: *mut u64,
) -> Status {
    guard("tcpx_connect_metadata", || {
        let ep = endpoint(ep)?;
        let md = slice(metadata, len, "metadata")?;
        let o = out(conn, "conn")?;
        *o = ep.add_remote_endpoint(md)?;
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_connect(
    ep: *mut TcpxEndpoint,
    ip: *const c_char,
    port: u16,
    conn: *mut u64,
) -> Status {
    guard("tcpx_connect", || {
        let ep = endpoint(ep)?;
        let ip = cstr(ip, "ip")?;
        let o = out(conn, "conn")?;
        *o = ep.connect(ip, port, None)?;
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_accept(
    ep: *mut TcpxEndpoint,
    timeout_ms: i64,
    out_acc: *mut TcpxAccepted,
) -> Status {
    guard("tcpx_accept", || {
        let ep = endpoint(ep)?;
        let o = out(out_acc, "out")?;
        let a = match timeout_of(timeout_ms) {
            None => ep.accept(None)?,
            Some(t) => ep.try_accept(t)?.ok_or_else(|| {
                Fail::new(
                    Status::Timeout,
                    format!("no peer connected within {timeout_ms} ms"),
                )
            })?,
        };
        accepted(a, o);
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_try_accept(
    ep: *mut TcpxEndpoint,
    out_acc: *mut TcpxAccepted,
) -> Status {
    guard("tcpx_try_accept", || {
        let ep = endpoint(ep)?;
        let o = out(out_acc, "out")?;
        Ok(match ep.try_accept(Duration::ZERO)? {
            Some(a) => {
                accepted(a, o);
                Status::Ok
            }
            None => Status::Again,
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_disconnect(ep: *mut TcpxEndpoint, conn: u64) -> Status {
    guard("tcpx_disconnect", || {
        let ep = endpoint(ep)?;
        ep.remove_conn(conn)
            .map_err(|e| on_ids(ep, Some(conn), &[], e))?;
        Ok(Status::Ok)
    })
}

// --------------------------------------------------------------- memory

#[no_mangle]
pub unsafe extern "C" fn tcpx_reg(
    ep: *mut TcpxEndpoint,
    ptr: *mut c_void,
    len: usize,
    mr: *mut u64,
) -> Status {
    guard("tcpx_reg", || {
        let ep = endpoint(ep)?;
        let o = out(mr, "mr")?;
        if ptr.is_null() {
            return Err(Fail::invalid("ptr is NULL"));
        }
        *o = ep.reg(ptr as u64, len)?;
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_dereg(ep: *mut TcpxEndpoint, mr: u64) -> Status {
    guard("tcpx_dereg", || {
        let ep = endpoint(ep)?;
        ep.dereg(mr).map_err(|e| on_ids(ep, None, &[mr], e))?;
        Ok(Status::Ok)
    })
}

/// One descriptor per buffer into `desc_out`.
fn advertise(ep: *mut TcpxEndpoint, conn: u64, bufs: &[TcpxBuf], desc_out: *mut u8) -> Res {
    let ep = endpoint(ep)?;
    let bufs = bufs_of(bufs)?;
    let o = out_bytes(desc_out, bufs.len() * DESC_LEN, "desc_out")?;
    let mrs: Vec<u64> = bufs.iter().map(|b| b.mr).collect();
    let descs = bufs
        .iter()
        .map(|b| ep.advertise(conn, b.mr, b.ptr, b.len))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| on_ids(ep, Some(conn), &mrs, e))?;
    for (chunk, d) in o.chunks_exact_mut(DESC_LEN).zip(&descs) {
        chunk.copy_from_slice(d);
    }
    Ok(Status::Ok)
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_advertise(
    ep: *mut TcpxEndpoint,
    conn: u64,
    mr: u64,
    ptr: *mut c_void,
    len: usize,
    desc_out: *mut u8,
) -> Status {
    guard("tcpx_advertise", || {
        advertise(ep, conn, &[TcpxBuf { mr, ptr, len }], desc_out)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_advertisev(
    ep: *mut TcpxEndpoint,
    conn: u64,
    bufs: *const TcpxBuf,
    n: usize,
    desc_out: *mut u8,
) -> Status {
    guard("tcpx_advertisev", || {
        advertise(ep, conn, slice(bufs, n, "bufs")?, desc_out)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_export(ep: *mut TcpxEndpoint, mr: u64, desc_out: *mut u8) -> Status {
    guard("tcpx_export", || {
        let ep = endpoint(ep)?;
        let o = out_bytes(desc_out, DESC_LEN, "desc_out")?;
        let d = ep
            .export_region(mr)
            .map_err(|e| on_ids(ep, None, &[mr], e))?;
        o.copy_from_slice(&desc::export_bytes(&d));
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_desc_info(desc: *const u8, addr: *mut u64, len: *mut u64) -> Status {
    guard("tcpx_desc_info", || {
        let d = remote(desc, "desc")?;
        let (a, l) = (out(addr, "addr")?, out(len, "len")?);
        *a = d.addr;
        *l = d.len;
        Ok(Status::Ok)
    })
}

// ------------------------------------------------------------ transfers

/// Posts a one-sided transfer of `iov`.
fn rma(
    ep: *mut TcpxEndpoint,
    conn: u64,
    read: bool,
    iov: &[TcpxRmaIov],
    notif: *const c_void,
    notif_len: usize,
    xfer: *mut u64,
) -> Res {
    let ep = endpoint(ep)?;
    let notif = notif_arg(notif, notif_len)?;
    let o = out(xfer, "xfer")?;
    if iov.is_empty() {
        return Err(Fail::invalid("no pieces given"));
    }
    let max = tcpx_p2p_wire::MAX_RMA_PIECES;
    if iov.len() > max {
        return Err(Fail::invalid(format!(
            "{} pieces in one transfer; at most TCPX_IOV_MAX = {max} (post several)",
            iov.len()
        )));
    }
    let mut bufs = Vec::with_capacity(iov.len());
    let mut remotes: Vec<(RemoteDesc, u64)> = Vec::with_capacity(iov.len());
    // Pieces of one registration usually share a descriptor (a KV list
    // names one peer region thousands of times): parse each run once.
    let mut last: Option<(*const u8, RemoteDesc)> = None;
    for (i, p) in iov.iter().enumerate() {
        if p.ptr.is_null() {
            return Err(Fail::invalid(format!("piece {i}: pointer is NULL")));
        }
        bufs.push(Buf {
            mr: p.mr,
            ptr: p.ptr as u64,
            len: p.len,
        });
        let d = match last {
            Some((ptr, d)) if ptr == p.desc => d,
            _ => remote(p.desc, "desc")
                .map_err(|f| Fail::new(f.status, format!("piece {i}: {}", f.msg)))?,
        };
        last = Some((p.desc, d));
        remotes.push((d, p.remote_offset));
    }
    *o = ep
        .rma_async(conn, read, &bufs, &remotes, notif)
        .map_err(|e| {
            // Only on failure: a KV list has 100,000+ pieces.
            let mrs: Vec<u64> = bufs.iter().map(|b| b.mr).collect();
            on_ids(ep, Some(conn), &mrs, e)
        })?;
    Ok(Status::Ok)
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_write_async(
    ep: *mut TcpxEndpoint,
    conn: u64,
    mr: u64,
    ptr: *mut c_void,
    len: usize,
    desc: *const u8,
    remote_offset: u64,
    notif: *const c_void,
    notif_len: usize,
    xfer: *mut u64,
) -> Status {
    guard("tcpx_write_async", || {
        let iov = TcpxRmaIov {
            mr,
            ptr,
            len,
            desc,
            remote_offset,
        };
        rma(ep, conn, false, &[iov], notif, notif_len, xfer)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_read_async(
    ep: *mut TcpxEndpoint,
    conn: u64,
    mr: u64,
    ptr: *mut c_void,
    len: usize,
    desc: *const u8,
    remote_offset: u64,
    notif: *const c_void,
    notif_len: usize,
    xfer: *mut u64,
) -> Status {
    guard("tcpx_read_async", || {
        let iov = TcpxRmaIov {
            mr,
            ptr,
            len,
            desc,
            remote_offset,
        };
        rma(ep, conn, true, &[iov], notif, notif_len, xfer)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_writev_async(
    ep: *mut TcpxEndpoint,
    conn: u64,
    iov: *const TcpxRmaIov,
    n: usize,
    notif: *const c_void,
    notif_len: usize,
    xfer: *mut u64,
) -> Status {
    guard("tcpx_writev_async", || {
        rma(
            ep,
            conn,
            false,
            slice(iov, n, "iov")?,
            notif,
            notif_len,
            xfer,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_readv_async(
    ep: *mut TcpxEndpoint,
    conn: u64,
    iov: *const TcpxRmaIov,
    n: usize,
    notif: *const c_void,
    notif_len: usize,
    xfer: *mut u64,
) -> Status {
    guard("tcpx_readv_async", || {
        rma(
            ep,
            conn,
            true,
            slice(iov, n, "iov")?,
            notif,
            notif_len,
            xfer,
        )
    })
}

/// Posts a two-sided send or receive of `bufs`.
fn msg(
    ep: *mut TcpxEndpoint,
    conn: u64,
    send: bool,
    bufs: *const TcpxBuf,
    n: usize,
    xfer: *mut u64,
) -> Res {
    let ep = endpoint(ep)?;
    let bufs = bufs_of(slice(bufs, n, "bufs")?)?;
    let o = out(xfer, "xfer")?;
    let mrs: Vec<u64> = bufs.iter().map(|b| b.mr).collect();
    let posted = if send {
        ep.send_async(conn, &bufs)
    } else {
        ep.recv_async(conn, &bufs)
    };
    *o = posted.map_err(|e| on_ids(ep, Some(conn), &mrs, e))?;
    Ok(Status::Ok)
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_send_async(
    ep: *mut TcpxEndpoint,
    conn: u64,
    bufs: *const TcpxBuf,
    n: usize,
    xfer: *mut u64,
) -> Status {
    guard("tcpx_send_async", || msg(ep, conn, true, bufs, n, xfer))
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_recv_async(
    ep: *mut TcpxEndpoint,
    conn: u64,
    bufs: *const TcpxBuf,
    n: usize,
    xfer: *mut u64,
) -> Status {
    guard("tcpx_recv_async", || msg(ep, conn, false, bufs, n, xfer))
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_poll(ep: *mut TcpxEndpoint, xfer: u64) -> Status {
    guard("tcpx_poll", || {
        let done = endpoint(ep)?.poll(xfer).map_err(on_xfer)?;
        Ok(if done { Status::Ok } else { Status::Again })
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_wait(ep: *mut TcpxEndpoint, xfer: u64, timeout_ms: i64) -> Status {
    guard("tcpx_wait", || {
        let done = endpoint(ep)?
            .wait(xfer, timeout_of(timeout_ms))
            .map_err(on_xfer)?;
        if done {
            Ok(Status::Ok)
        } else {
            Err(Fail::new(
                Status::Timeout,
                format!("transfer {xfer} still running after {timeout_ms} ms"),
            ))
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_release(ep: *mut TcpxEndpoint, xfer: u64) -> Status {
    guard("tcpx_release", || {
        endpoint(ep)?.release(xfer).map_err(on_xfer)?;
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_cancel(ep: *mut TcpxEndpoint, xfer: u64, timeout_ms: i64) -> Status {
    guard("tcpx_cancel", || {
        let ended = endpoint(ep)?
            .cancel(xfer, timeout_of(timeout_ms))
            .map_err(on_xfer)?;
        if ended {
            Ok(Status::Ok)
        } else {
            Err(Fail::new(
                Status::Timeout,
                format!(
                    "transfer {xfer} still moving data after {timeout_ms} ms (its id stays valid)"
                ),
            ))
        }
    })
}

// -------------------------------------------------------- notifications

#[no_mangle]
pub unsafe extern "C" fn tcpx_send_notif(
    ep: *mut TcpxEndpoint,
    conn: u64,
    msg: *const c_void,
    len: usize,
) -> Status {
    guard("tcpx_send_notif", || {
        let ep = endpoint(ep)?;
        let m = notif_arg(msg, len)?.ok_or_else(|| Fail::invalid("msg is NULL"))?;
        ep.send_notif(conn, m)
            .map_err(|e| on_ids(ep, Some(conn), &[], e))?;
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_get_notifs(
    ep: *mut TcpxEndpoint,
    out_list: *mut *mut TcpxNotifs,
) -> Status {
    guard("tcpx_get_notifs", || {
        let ep = endpoint(ep)?;
        let o = out(out_list, "out")?;
        *o = Box::into_raw(Box::new(TcpxNotifs {
            tag: NOTIFS_TAG,
            list: ep.get_notifs(),
        }));
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_notifs_count(list: *const TcpxNotifs) -> usize {
    let mut n = 0;
    guard_void("tcpx_notifs_count", || {
        if let Ok(l) = handle(list, |h| h.tag, NOTIFS_TAG, "list") {
            n = l.list.len();
        }
    });
    n
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_notifs_at(
    list: *const TcpxNotifs,
    i: usize,
    out_notif: *mut TcpxNotif,
) -> Status {
    guard("tcpx_notifs_at", || {
        let l = &handle(list, |h| h.tag, NOTIFS_TAG, "list")?.list;
        let o = out(out_notif, "out")?;
        let n = l.get(i).ok_or_else(|| {
            Fail::invalid(format!("index {i} past the {} notifications", l.len()))
        })?;
        *o = TcpxNotif {
            conn: n.conn,
            name: n.from_name.as_ptr().cast(),
            name_len: n.from_name.len(),
            msg: n.msg.as_ptr(),
            msg_len: n.msg.len(),
        };
        Ok(Status::Ok)
    })
}

#[no_mangle]
pub unsafe extern "C" fn tcpx_notifs_free(list: *mut TcpxNotifs) {
    guard_void("tcpx_notifs_free", || {
        if handle(list, |h| h.tag, NOTIFS_TAG, "list").is_ok() {
            // SAFETY: a live handle from Box::into_raw; tag cleared first.
            unsafe {
                (*list).tag = 0;
                drop(Box::from_raw(list));
            }
        }
    })
}
