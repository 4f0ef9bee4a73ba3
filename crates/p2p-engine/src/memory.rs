//! The memory registry: regions by id (host or CUDA, found by asking CUDA
//! about the pointer), and advertisements: the exact byte ranges a peer has
//! been given and may read or write.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::error::{Error, Result};
use crate::gpu;
use crate::wire::Token;

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    Host,
    /// Device memory of the GPU with this ordinal.
    Cuda(i32),
}

/// A registered range of memory.
#[derive(Debug)]
pub struct Region {
    pub id: u64,
    pub addr: u64,
    pub len: usize,
    pub kind: MemKind,
}

impl Region {
    /// Whether `[addr, addr+len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        within(self.addr, self.len, addr, len as u64)
    }
}

/// Whether `[addr, addr+len)` lies inside `[base, base+size)`, without overflow.
fn within(base: u64, size: usize, addr: u64, len: u64) -> bool {
    addr >= base
        && (addr - base)
            .checked_add(len)
            .is_some_and(|end| end <= size as u64)
}

/// `[addr, addr+len)` inside the advertisement `a` (named by `token`), or why not.
fn bounded(a: &Advert, token: Token, addr: u64, len: u64) -> std::result::Result<(), String> {
    if within(a.addr, a.len, addr, len) {
        return Ok(());
    }
    Err(format!(
        "{len} bytes at {addr:#x} lie outside the advertised {} bytes at {:#x} (descriptor {})",
        a.len, a.addr, token.id
    ))
}

/// Resolves the items of one peer request in a row: each item is checked
/// against our record of its advertisement exactly as
/// [`Registry::resolve`] checks it, but the record of the last token is
/// kept, so that a request of many items under one descriptor (vLLM's
/// block lists: 100,000+ items) takes one map lookup, not one per item.
pub struct Resolver<'a> {
    reg: &'a Registry,
    conn: u64,
    last: Option<(Token, Advert, Arc<Region>)>,
}

impl Resolver<'_> {
    /// The region the peer may touch at `[addr, addr+len)` under `token`.
    pub fn resolve(
        &mut self,
        token: Token,
        addr: u64,
        len: u64,
    ) -> std::result::Result<&Arc<Region>, String> {
        if !matches!(&self.last, Some((t, _, _)) if *t == token) {
            // Descriptors made one per block (UCCL's `advertisev`) are
            // all of one region: its lookup is kept with the last
            // descriptor's.
            let a = self.reg.advert_record(token, self.conn)?;
            let r = match &self.last {
                Some((_, _, r)) if r.id == a.region => r.clone(),
                _ => self.reg.advert_region(&a, token)?,
            };
            self.last = Some((token, a, r));
        }
        let (_, a, r) = self.last.as_ref().expect("set above");
        bounded(a, token, addr, len)?;
        Ok(r)
    }
}

/// Checks the local buffers of one call in a row, as [`Registry::check`]
/// does, keeping the last region found: a list of many buffers in one
/// region takes one map lookup.
pub struct Checker<'a> {
    reg: &'a Registry,
    last: Option<Arc<Region>>,
}

impl Checker<'_> {
    /// The region `id` if `[ptr, ptr+len)` lies inside it.
    pub fn check(&mut self, id: u64, ptr: u64, len: usize) -> Result<&Arc<Region>> {
        let r = self.region(id)?;
        check_range(r, ptr, len)?;
        Ok(r)
    }

    /// [`Checker::check`] without handing out the region (no reference
    /// count touched: a list of 131,072 pieces is checked whole before any
    /// part of it is resolved).
    pub fn check_only(&mut self, id: u64, ptr: u64, len: usize) -> Result<()> {
        check_range(self.region(id)?, ptr, len)
    }

    fn region(&mut self, id: u64) -> Result<&Arc<Region>> {
        if self.last.as_ref().is_none_or(|r| r.id != id) {
            self.last = Some(self.reg.get(id)?);
        }
        Ok(self.last.as_ref().expect("set above"))
    }
}

/// `[ptr, ptr+len)` non-null and inside `r`, or why not. (Called once a
/// piece for lists of 131,072: the refusal is built out of line.)
#[inline]
fn check_range(r: &Region, ptr: u64, len: usize) -> Result<()> {
    if ptr != 0 && r.contains(ptr, len) {
        return Ok(());
    }
    Err(out_of_range(r, ptr, len))
}

#[cold]
#[inline(never)]
fn out_of_range(r: &Region, ptr: u64, len: usize) -> Error {
    if ptr == 0 {
        return Error::invalid(format!("region {}: null pointer", r.id));
    }
    Error::invalid(format!(
        "region {}: {len} bytes at {ptr:#x} lie outside the registered {} bytes at {:#x}",
        r.id, r.len, r.addr
    ))
}

/// One advertisement: a byte range of a region offered to peers.
#[derive(Debug, Clone)]
struct Advert {
    secret: u64,
    region: u64,
    addr: u64,
    len: usize,
    /// The only connection that may use it (None: any connected peer, as for
    /// descriptors handed out with `get_serialized_descs`).
    conn: Option<u64>,
}

/// An unpredictable 64-bit value: SipHash with the process's random keys.
pub fn random_u64() -> u64 {
    static STATE: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = STATE.get_or_init(Default::default).build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

/// Host memory must be mapped, every page of it: a range that runs into an
/// unmapped page would fail later as a transport error mid-transfer.
#[allow(unsafe_code)]
fn check_mapped(addr: u64, len: usize) -> Result<()> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let start = addr & !(page - 1);
    let end = addr
        .checked_add(len as u64)
        .and_then(|e| e.checked_add(page - 1))
        .map(|e| e & !(page - 1))
        .ok_or_else(|| {
            Error::invalid(format!(
                "reg: range {addr:#x}+{len} wraps around the address space"
            ))
        })?;
    // Pages are asked about in batches: the answer vector stays small.
    const BATCH: u64 = 1 << 16;
    let mut vec = vec![0u8; BATCH.min((end - start) / page) as usize];
    let mut at = start;
    while at < end {
        let pages = ((end - at) / page).min(BATCH);
        // SAFETY: `vec` holds at least `pages` bytes; mincore only reads the
        // page tables of `[at, at + pages * page)` and writes `vec`.
        let r = unsafe {
            libc::mincore(
                at as *mut libc::c_void,
                (pages * page) as libc::size_t,
                vec.as_mut_ptr(),
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOMEM) {
                return Err(Error::invalid(format!(
                    "reg: {len} bytes at {addr:#x} are not all mapped memory of this process \
                     (unmapped page(s) in {at:#x}..{:#x}); register only memory you allocated",
                    at + pages * page
                )));
            }
            // Other errors (EINVAL on odd kernels) say nothing about the range.
            return Ok(());
        }
        at += pages * page;
    }
    Ok(())
}

/// Hashes the registry's own ids for its maps. The ids come from one
/// counter and only the registry inserts them; a peer only looks them up,
/// so the map needs no keyed hash against chosen collisions. The low bits
/// are the id itself, so that ids made one after another (UCCL's
/// `advertisev`, one per block) sit in neighbouring buckets and a list of
/// them resolves with few cache misses; the top seven bits, which the map
/// compares first, are mixed from the whole id. (SipHash scattered them:
/// 131,072 descriptors resolved at 120-190 ns each on the 2-core box.)
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Keys are u64 ids; any other input is folded in whole.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id;
    }

    fn finish(&self) -> u64 {
        const LOW: u64 = (1 << 57) - 1;
        (self.0 & LOW) | (self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) & !LOW)
    }
}

type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Regions and advertisements of one endpoint.
#[derive(Default)]
pub struct Registry {
    next_id: AtomicU64,
    regions: RwLock<IdMap<Arc<Region>>>,
    adverts: RwLock<IdMap<Advert>>,
}

impl Registry {
    pub fn new() -> Self {
        Registry {
            next_id: AtomicU64::new(1),
            ..Default::default()
        }
    }

    /// Registers `[addr, addr+len)`; CUDA is asked whether it is device memory.
    pub fn register(&self, addr: u64, len: usize) -> Result<Arc<Region>> {
        if addr == 0 {
            return Err(Error::invalid("reg: null pointer"));
        }
        if len == 0 {
            return Err(Error::invalid("reg: size is 0"));
        }
        if addr.checked_add(len as u64).is_none() {
            return Err(Error::invalid(format!(
                "reg: range {addr:#x}+{len} wraps around the address space"
            )));
        }
        let kind = match gpu::device_allocation(addr) {
            Some((d, range)) => {
                let (base, size) = match range {
                    Some(r) => r,
                    None => {
                        // The older query needs the owning GPU's context current.
                        gpu::Device::get(d)?.bind()?;
                        gpu::allocation_range(addr)?
                    }
                };
                if addr + len as u64 > base + size as u64 {
                    return Err(Error::invalid(format!(
                        "reg: {len} bytes at {addr:#x} run past the end of their GPU allocation ({size} bytes at {base:#x})"
                    )));
                }
                MemKind::Cuda(d)
            }
            None => {
                check_mapped(addr, len)?;
                MemKind::Host
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let r = Arc::new(Region {
            id,
            addr,
            len,
            kind,
        });
        self.regions.write().insert(id, r.clone());
        Ok(r)
    }

    pub fn get(&self, id: u64) -> Result<Arc<Region>> {
        self.regions
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("unknown memory region id {id}")))
    }

    /// The region `id` if `[ptr, ptr+len)` lies inside it.
    pub fn check(&self, id: u64, ptr: u64, len: usize) -> Result<Arc<Region>> {
        let r = self.get(id)?;
        check_range(&r, ptr, len)?;
        Ok(r)
    }

    /// A receive's capacity at `ptr` in region `id`: `len`, or what is
    /// registered from `ptr` to the region's end if that is less (UCCL
    /// posts a receive larger than its registration and is sent less).
    /// `ptr` itself must lie inside the region. A message larger than the
    /// capacity fails its receive before any byte lands (the nets check a
    /// message's size against the posted receive).
    pub fn recv_capacity(&self, id: u64, ptr: u64, len: usize) -> Result<usize> {
        let r = self.get(id)?;
        if ptr == 0 {
            return Err(Error::invalid(format!("region {id}: null pointer")));
        }
        let room = ptr
            .checked_sub(r.addr)
            .and_then(|off| (r.len as u64).checked_sub(off))
            .filter(|&room| room > 0 || len == 0)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "region {id}: {ptr:#x} lies outside the registered {} bytes at {:#x}",
                    r.len, r.addr
                ))
            })?;
        Ok(len.min(usize::try_from(room).unwrap_or(usize::MAX)))
    }

    /// Removes the region and every advertisement of it, then waits (up to
    /// `wait`) for transfers still using it (a peer's write whose receives
    /// are posted into it holds it too). If some remain, puts the region
    /// and its advertisements back and refuses: no byte may land in memory
    /// its owner believes released.
    #[cfg_attr(not(any(test, feature = "fuzzing")), allow(dead_code))]
    pub fn deregister(&self, id: u64, wait: Duration) -> Result<()> {
        self.deregister_revoking(id, wait, |_| {})
    }

    /// [`Registry::deregister`], calling `revoke` with the region's id once
    /// its advertisements are gone and before the wait: leases of them
    /// (see `crate::lease`) are revoked, and their holds end as the peers
    /// answer.
    pub fn deregister_revoking(
        &self,
        id: u64,
        wait: Duration,
        revoke: impl FnOnce(u64),
    ) -> Result<()> {
        let r = self
            .regions
            .write()
            .remove(&id)
            .ok_or_else(|| Error::invalid(format!("dereg: unknown memory region id {id}")))?;
        let mut gone = Vec::new();
        self.adverts.write().retain(|&tid, a| {
            if a.region == id {
                gone.push((tid, a.clone()));
            }
            a.region != id
        });
        revoke(id);
        let deadline = crate::timeout::deadline_after(wait);
        while Arc::strong_count(&r) > 1 && deadline.is_none_or(|d| Instant::now() < d) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let users = Arc::strong_count(&r) - 1;
        if users == 0 {
            return Ok(());
        }
        self.regions.write().insert(id, r.clone());
        self.adverts.write().extend(gone);
        Err(Error::invalid(format!(
            "dereg: region {id} ({} bytes at {:#x}) is still in use by {users} transfer(s) after {:.1} s \
             (a peer's write may be posted into it); it stays registered: wait for them or remove the connection, then dereg again",
            r.len,
            r.addr,
            wait.as_secs_f64()
        )))
    }

    /// Offers `[addr, addr+len)` of region `id` to `conn` (or to any peer).
    pub fn advertise(&self, id: u64, addr: u64, len: usize, conn: Option<u64>) -> Result<Token> {
        self.check(id, addr, len)?;
        let tid = self.next_id.fetch_add(1, Ordering::Relaxed);
        let secret = random_u64();
        self.adverts.write().insert(
            tid,
            Advert {
                secret,
                region: id,
                addr,
                len,
                conn,
            },
        );
        Ok(Token { id: tid, secret })
    }

    /// The region a peer on `conn` may touch at `[addr, addr+len)` under
    /// `token`, or why not. Never trusts anything but the local record.
    /// (The engine checks a request's items with a [`Resolver`].)
    #[cfg(test)]
    pub fn resolve(
        &self,
        token: Token,
        addr: u64,
        len: u64,
        conn: u64,
    ) -> std::result::Result<Arc<Region>, String> {
        let (a, region) = self.advert(token, conn)?;
        bounded(&a, token, addr, len)?;
        Ok(region)
    }

    /// The whole range advertisement `token` offers `conn`, and its region:
    /// what a lease of it covers.
    pub fn leasable(
        &self,
        token: Token,
        conn: u64,
    ) -> std::result::Result<(u64, u64, Arc<Region>), String> {
        let (a, region) = self.advert(token, conn)?;
        Ok((a.addr, a.len as u64, region))
    }

    /// The advertisement `token` names, usable by `conn`, and its region.
    fn advert(
        &self,
        token: Token,
        conn: u64,
    ) -> std::result::Result<(Advert, Arc<Region>), String> {
        let a = self.advert_record(token, conn)?;
        let region = self.advert_region(&a, token)?;
        Ok((a, region))
    }

    /// The advertisement `token` names, if `conn` may use it.
    fn advert_record(&self, token: Token, conn: u64) -> std::result::Result<Advert, String> {
        let a = self
            .adverts
            .read()
            .get(&token.id)
            .filter(|a| a.secret == token.secret)
            .cloned()
            .ok_or_else(|| format!("unknown or stale descriptor (token {})", token.id))?;
        if a.conn.is_some_and(|c| c != conn) {
            return Err(format!(
                "descriptor {} was advertised to another connection",
                token.id
            ));
        }
        Ok(a)
    }

    /// The region of advertisement `a` (named by `token`), while registered.
    fn advert_region(&self, a: &Advert, token: Token) -> std::result::Result<Arc<Region>, String> {
        self.regions
            .read()
            .get(&a.region)
            .cloned()
            .ok_or_else(|| format!("region of descriptor {} is gone", token.id))
    }

    /// A [`Resolver`] for the items of one request of a peer on `conn`.
    pub fn resolver(&self, conn: u64) -> Resolver<'_> {
        Resolver {
            reg: self,
            conn,
            last: None,
        }
    }

    /// A [`Checker`] for the local buffers of one call.
    pub fn checker(&self) -> Checker<'_> {
        Checker {
            reg: self,
            last: None,
        }
    }

    /// Removes region `id` and its advertisements at once, without waiting:
    /// transfers that resolved it hold it until they end. For memory
    /// registered on the caller's behalf (the `*_ipc` calls on a connection
    /// of the same-host net), once its requests are posted or its
    /// connection is gone.
    pub fn forget(&self, id: u64) {
        self.regions.write().remove(&id);
        self.adverts.write().retain(|_, a| a.region != id);
    }

    /// Forgets the advertisements made for one connection (when it closes).
    pub fn forget_conn(&self, conn: u64) {
        self.adverts.write().retain(|_, a| a.conn != Some(conn));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receive_holds_at_most_what_is_registered_from_its_pointer() {
        let reg = Registry::new();
        let buf = vec![0u8; 4096];
        let base = buf.as_ptr() as u64;
        let r = reg.register(base, 4096).unwrap();
        assert_eq!(reg.recv_capacity(r.id, base, 8192).unwrap(), 4096);
        assert_eq!(reg.recv_capacity(r.id, base, 100).unwrap(), 100);
        assert_eq!(reg.recv_capacity(r.id, base + 4000, 8192).unwrap(), 96);
        assert_eq!(reg.recv_capacity(r.id, base + 4095, usize::MAX).unwrap(), 1);
        assert_eq!(reg.recv_capacity(r.id, base + 4096, 0).unwrap(), 0);
        // The pointer itself must lie inside the region.
        assert!(reg.recv_capacity(r.id, base + 4096, 1).is_err());
        assert!(reg.recv_capacity(r.id, base - 1, 8192).is_err());
        assert!(reg.recv_capacity(r.id, u64::MAX, 8192).is_err());
        assert!(reg.recv_capacity(r.id, 0, 8192).is_err());
        assert!(reg.recv_capacity(999, base, 1).is_err());
    }

    #[test]
    fn bounds_and_tokens() {
        let reg = Registry::new();
        let buf = vec![0u8; 4096];
        let base = buf.as_ptr() as u64;
        let r = reg.register(base, 4096).unwrap();
        assert_eq!(r.kind, MemKind::Host);
        assert!(reg.check(r.id, base, 4096).is_ok());
        assert!(reg.check(r.id, base + 1, 4096).is_err());
        assert!(reg.check(r.id, base - 1, 1).is_err());
        assert!(reg.check(r.id, base + 4096, 0).is_ok());
        assert!(reg.check(r.id, u64::MAX, 2).is_err());
        assert!(reg.check(999, base, 1).is_err());
        assert!(reg.register(0, 10).is_err());
        assert!(reg.register(base, 0).is_err());
        assert!(reg.register(u64::MAX - 1, 10).is_err());

        let t = reg.advertise(r.id, base + 100, 200, Some(7)).unwrap();
        assert!(reg.resolve(t, base + 100, 200, 7).is_ok());
        assert!(reg.resolve(t, base + 150, 150, 7).is_ok());
        assert!(reg.resolve(t, base + 100, 201, 7).is_err());
        assert!(reg.resolve(t, base + 99, 1, 7).is_err());
        assert!(reg.resolve(t, base + 100, u64::MAX, 7).is_err());
        assert!(reg.resolve(t, base + 100, 10, 8).is_err(), "other conn");
        let forged = Token {
            id: t.id,
            secret: t.secret ^ 1,
        };
        assert!(reg.resolve(forged, base + 100, 10, 7).is_err());
        assert!(reg.advertise(r.id, base + 4000, 200, None).is_err());

        let any = reg.advertise(r.id, base, 4096, None).unwrap();
        assert!(reg.resolve(any, base, 4096, 12345).is_ok());
        // In use (we hold it): refused, and everything stays as it was.
        let err = reg.deregister(r.id, Duration::from_millis(10)).unwrap_err();
        assert!(err.to_string().contains("still in use"), "{err}");
        assert!(reg.resolve(t, base + 100, 200, 7).is_ok(), "kept");
        let id = r.id;
        drop(r);
        reg.deregister(id, Duration::from_millis(10)).unwrap();
        assert!(reg.resolve(t, base + 100, 200, 7).is_err(), "stale");
        assert!(reg.resolve(any, base, 1, 1).is_err(), "stale");
        assert!(reg.deregister(id, Duration::ZERO).is_err());
    }

    #[test]
    fn a_resolver_checks_every_item_even_under_a_remembered_token() {
        let reg = Registry::new();
        let buf = vec![0u8; 1 << 16];
        let base = buf.as_ptr() as u64;
        let r = reg.register(base, buf.len()).unwrap();
        let t = reg.advertise(r.id, base + 4096, 8192, Some(7)).unwrap();
        let other = reg.advertise(r.id, base, 1 << 16, Some(8)).unwrap();
        let mut res = reg.resolver(7);
        // Many items under one token, then one past its end, one before
        // its start, one overflowing: each judged on its own.
        for i in 0..64 {
            let got = res.resolve(t, base + 4096 + i * 128, 128).unwrap();
            assert_eq!(got.id, r.id);
        }
        assert!(res.resolve(t, base + 4096 + 8192 - 64, 128).is_err());
        assert!(res.resolve(t, base + 4095, 1).is_err());
        assert!(res.resolve(t, base + 4096, u64::MAX).is_err());
        // The same id with another secret, and a token of another
        // connection, are refused even right after a good item.
        let forged = Token {
            id: t.id,
            secret: t.secret ^ 1,
        };
        assert!(res.resolve(t, base + 4096, 1).is_ok());
        assert!(res.resolve(forged, base + 4096, 1).is_err());
        assert!(res.resolve(t, base + 4096, 1).is_ok());
        assert!(res.resolve(other, base, 1).is_err(), "advertised to conn 8");
        assert!(reg.resolver(8).resolve(other, base, 1 << 16).is_ok());
        // Gone once deregistered: a new request's resolver finds nothing.
        let id = r.id;
        drop(r);
        drop(res);
        reg.deregister(id, Duration::from_millis(10)).unwrap();
        assert!(reg.resolver(7).resolve(t, base + 4096, 1).is_err());
    }

    #[test]
    fn a_checker_checks_every_buffer_even_in_a_remembered_region() {
        let reg = Registry::new();
        let (a, b) = (vec![0u8; 4096], vec![0u8; 4096]);
        let (pa, pb) = (a.as_ptr() as u64, b.as_ptr() as u64);
        let (ra, rb) = (
            reg.register(pa, 4096).unwrap(),
            reg.register(pb, 4096).unwrap(),
        );
        let mut c = reg.checker();
        for i in 0..32 {
            assert_eq!(c.check(ra.id, pa + i * 128, 128).unwrap().id, ra.id);
        }
        assert!(c.check(ra.id, pa + 4000, 128).is_err());
        assert!(c.check(ra.id, 0, 1).is_err());
        // A buffer of one region under the other's id: refused.
        assert!(c.check(ra.id, pb, 1).is_err());
        assert_eq!(c.check(rb.id, pb, 4096).unwrap().id, rb.id);
        assert!(c.check(rb.id, pa, 1).is_err());
        assert!(c.check(999, pa, 1).is_err());
    }

    #[test]
    fn unmapped_host_memory_is_refused_at_reg() {
        let reg = Registry::new();
        let buf = vec![0u8; 1 << 16];
        let base = buf.as_ptr() as u64;
        // Past the end of the mapping: far beyond the heap's top.
        let err = reg.register(base, 1 << 40).unwrap_err().to_string();
        assert!(
            err.contains("not all mapped") && err.contains(&format!("{base:#x}")),
            "{err}"
        );
        // Page 0 is never mapped.
        assert!(reg.register(4096, 4096).is_err());
        assert!(reg.register(base, buf.len()).is_ok());
    }

    #[test]
    fn random_values_differ() {
        assert_ne!(random_u64(), random_u64());
    }

    #[test]
    fn ids_hash_to_themselves_below_and_mixed_above() {
        let hash = |id: u64| {
            let mut h = IdHasher::default();
            h.write_u64(id);
            h.finish()
        };
        const LOW: u64 = (1 << 57) - 1;
        // Ids made one after another land in neighbouring buckets...
        for id in [1u64, 2, 3, 1000, 131_072, LOW] {
            assert_eq!(hash(id) & LOW, id);
        }
        // ...and the seven bits compared first tell them apart.
        let tops: std::collections::HashSet<u64> = (1..=128u64).map(|id| hash(id) >> 57).collect();
        assert!(tops.len() > 64, "{} distinct of 128", tops.len());
        // Other input is folded in, never dropped.
        let mut h = IdHasher::default();
        h.write(&[1, 2, 3]);
        assert_ne!(h.finish(), IdHasher::default().finish());
    }

    #[test]
    fn many_adverts_resolve_in_any_order_and_forged_ones_do_not() {
        let reg = Registry::new();
        let n = 4096usize;
        let buf = vec![0u8; n * 64];
        let base = buf.as_ptr() as u64;
        let r = reg.register(base, buf.len()).unwrap();
        let toks: Vec<Token> = (0..n)
            .map(|i| {
                reg.advertise(r.id, base + (i * 64) as u64, 64, Some(7))
                    .unwrap()
            })
            .collect();
        let mut res = reg.resolver(7);
        for i in (0..n).rev().step_by(3).chain(0..n) {
            assert_eq!(
                res.resolve(toks[i], base + (i * 64) as u64, 64).unwrap().id,
                r.id
            );
            // Not past its own block, nor under another's secret or id.
            assert!(res.resolve(toks[i], base + (i * 64) as u64, 65).is_err());
        }
        let forged = Token {
            id: toks[5].id,
            secret: toks[5].secret ^ 1,
        };
        assert!(reg.resolver(7).resolve(forged, base + 5 * 64, 64).is_err());
        let unknown = Token {
            id: toks[n - 1].id + 1_000_000,
            secret: toks[5].secret,
        };
        assert!(reg.resolver(7).resolve(unknown, base, 64).is_err());
        // Another connection may not use them.
        assert!(reg.resolver(8).resolve(toks[0], base, 64).is_err());
    }
}
