//! Notifications, one-sided transfers at an offset, and calls for callers
//! that poll (the C API).

use super::*;

/// Items of one one-sided request when a transfer has more. A request is
/// planned, sent, admitted by the target (every item checked) and cleared
/// before its bytes move: a transfer of 131,072 blocks (vLLM's KV lists)
/// as two requests of 65,536 moved nothing for the first ~30 ms; in parts
/// of 8,192 its first bytes move after a sixteenth of that, and the later
/// parts are posted and admitted while they do. At most
/// [`crate::wire::MAX_RMA_ITEMS`].
pub(crate) const RMA_PART: usize = 8_192;
const _: () = assert!(RMA_PART <= crate::wire::MAX_RMA_ITEMS);

/// Notifications, one-sided transfers at an offset, and calls for callers
/// that poll (the C API).
impl Endpoint {
    /// The name sent with this endpoint's notifications.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub(super) fn check_notif(msg: &[u8]) -> Result<()> {
        if msg.len() > crate::wire::MAX_NOTIF {
            return Err(Error::invalid(format!(
                "notification of {} bytes exceeds the limit of {} bytes",
                msg.len(),
                crate::wire::MAX_NOTIF
            )));
        }
        Ok(())
    }

    /// Sends `msg` (at most [`crate::notif::MAX_NOTIF`] bytes) to the peer of
    /// `conn`; the peer's [`Endpoint::get_notifs`] returns it with our name.
    pub fn send_notif(&self, conn: u64, msg: &[u8]) -> Result<()> {
        Self::check_notif(msg)?;
        self.conn(conn)?.send_notif(&self.inner.name, msg)
    }

    /// Takes every notification received so far, oldest first.
    pub fn get_notifs(&self) -> Vec<Notif> {
        self.inner.notifs.drain()
    }

    /// One-sided write (`read == false`) or read of `bufs[i]` to or from
    /// `remote[i].1` bytes into the range `remote[i].0` names. With `notif`,
    /// the message is sent to the peer once the transfer has ended well:
    /// after a write, once the peer has every byte (its `WriteDone` came);
    /// after a read, once every byte has landed here.
    pub fn rma_async(
        &self,
        conn: u64,
        read: bool,
        bufs: &[Buf],
        remote: &[(RemoteDesc, u64)],
        notif: Option<&[u8]>,
    ) -> Result<u64> {
        if let Some(m) = notif {
            Self::check_notif(m)?;
        }
        let clock = crate::net::timing::Steps::start(tracing::enabled!(tracing::Level::TRACE));
        let c = self.conn(conn)?;
        if remote.len() != bufs.len() {
            return Err(Error::invalid(format!(
                "{} local buffers but {} remote descriptors",
                bufs.len(),
                remote.len()
            )));
        }
        let items = bufs
            .iter()
            .zip(remote)
            .map(|(b, (d, off))| {
                let fits = off
                    .checked_add(b.len as u64)
                    .is_some_and(|end| end <= d.len);
                if !fits {
                    return Err(Error::invalid(format!(
                        "{} bytes at offset {off} do not fit the {} bytes the peer's descriptor names",
                        b.len, d.len
                    )));
                }
                Ok(RmaItem {
                    token: d.token,
                    addr: d.addr + off,
                    len: b.len as u64,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let regions: Vec<u64> = remote.iter().map(|(d, _)| d.region).collect();
        let t_items = clock.at();
        let local = self.resolve_local(bufs)?;
        let t_local = clock.at();
        let t = self.post_rma_any(&c, read, local, items, &regions)?;
        trace_posted(&t, bufs.len(), clock, t_items, t_local);
        if let Some(m) = notif {
            c.watch(
                &t,
                crate::transfer::Watch::Notify {
                    name: self.inner.name.clone(),
                    msg: m.to_vec(),
                },
            );
        }
        Ok(self.publish(t))
    }

    /// A one-sided transfer of any number of items (up to
    /// [`crate::wire::MAX_RMA_PIECES`]) on connection `c`: one request, or
    /// parts of [`RMA_PART`] items under one transfer. Every one-sided call
    /// goes through here, so that none sends a request larger than the peer
    /// accepts.
    pub(super) fn post_rma_any(
        &self,
        c: &Arc<Conn>,
        read: bool,
        local: Vec<(MemRef, Arc<crate::memory::Region>)>,
        items: Vec<RmaItem>,
        regions: &[u64],
    ) -> Result<Arc<Transfer>> {
        if items.len() > crate::wire::MAX_RMA_PIECES {
            return Err(Error::invalid(format!(
                "{} pieces in one transfer; at most {} (post several)",
                items.len(),
                crate::wire::MAX_RMA_PIECES
            )));
        }
        if items.len() <= RMA_PART {
            c.post_rma(self.next_xfer(), read, local, items, regions)
        } else {
            self.post_rma_parts(c, read, local, items, regions)
        }
    }

    /// A one-sided transfer of more than [`RMA_PART`] items: one request
    /// per [`RMA_PART`] items, each sent as soon as it is built (the first
    /// part's bytes move while the later parts are planned and posted),
    /// under one transfer that ends once every part has ended (so that no
    /// byte of any part touches the buffers after it is reported), failed
    /// if any part failed. Cancelling it lets the parts run to their ends.
    fn post_rma_parts(
        &self,
        c: &Arc<Conn>,
        read: bool,
        local: Vec<(MemRef, Arc<crate::memory::Region>)>,
        items: Vec<RmaItem>,
        regions: &[u64],
    ) -> Result<Arc<Transfer>> {
        let max = RMA_PART;
        let parts = items.len().div_ceil(max);
        let whole = Transfer::new(self.next_xfer(), c.id, parts, Vec::new());
        let (mut local, mut items) = (local.into_iter(), items.into_iter());
        for (i, regs) in regions.chunks(max).enumerate() {
            let part_local = local.by_ref().take(regs.len()).collect();
            let part_items = items.by_ref().take(regs.len()).collect();
            let part = match c.post_rma(self.next_xfer(), read, part_local, part_items, regs) {
                Ok(p) => p,
                Err(e) => {
                    // The parts posted so far run on; this one and the ones
                    // after it never start.
                    let why = Failure::Lost(format!(
                        "part {} of {parts} could not be posted: {e}",
                        i + 1
                    ));
                    whole.poison(why);
                    for _ in i..parts {
                        whole.complete_one();
                    }
                    if i == 0 {
                        return Err(e);
                    }
                    return Ok(whole);
                }
            };
            part.part_of(whole.clone());
        }
        Ok(whole)
    }

    /// [`Endpoint::write_async`] with an optional notification sent once
    /// the peer has every byte.
    pub fn write_async_with_notif(
        &self,
        conn: u64,
        bufs: &[Buf],
        metas: &[FifoItem],
        notif: Option<&[u8]>,
    ) -> Result<u64> {
        let remote: Vec<_> = metas.iter().map(|m| (RemoteDesc::from(m), 0)).collect();
        self.rma_async(conn, false, bufs, &remote, notif)
    }

    /// [`Endpoint::read_async`] with an optional notification sent to the
    /// data's owner once every byte has landed here.
    pub fn read_async_with_notif(
        &self,
        conn: u64,
        bufs: &[Buf],
        metas: &[FifoItem],
        notif: Option<&[u8]>,
    ) -> Result<u64> {
        let remote: Vec<_> = metas.iter().map(|m| (RemoteDesc::from(m), 0)).collect();
        self.rma_async(conn, true, bufs, &remote, notif)
    }

    /// Offers `[ptr, ptr+len)` of region `mr` (any size) to every peer,
    /// connected now or later, until the region is deregistered.
    pub fn export_range(&self, mr: u64, ptr: u64, len: usize) -> Result<DescEntry> {
        let token = self.inner.registry.advertise(mr, ptr, len, None)?;
        Ok(DescEntry {
            addr: ptr,
            size: len as u64,
            mr_id: mr,
            token,
        })
    }

    /// The address and length of a registered region.
    pub fn region(&self, mr: u64) -> Result<(u64, usize)> {
        let r = self.inner.registry.get(mr)?;
        Ok((r.addr, r.len))
    }

    /// Stops tracking a transfer: it runs to its end on its own (its
    /// buffers stay in use until then; deregistration waits for them).
    pub fn release(&self, xfer: u64) -> Result<()> {
        self.inner
            .transfers
            .lock()
            .remove(&xfer)
            .map(|_| ())
            .ok_or_else(|| Error::invalid(format!("unknown transfer id {xfer}")))
    }

    /// The next connection from a peer if one comes within `timeout`
    /// (zero: only one already pending).
    pub fn try_accept(&self, timeout: Duration) -> Result<Option<Accepted>> {
        let Some(deadline) = crate::timeout::deadline_after(timeout) else {
            // Beyond the clock: no limit.
            return self.accept(None).map(Some);
        };
        let mut q = self.inner.accepted.lock();
        loop {
            if let Some(id) = q.pop_front() {
                drop(q);
                let conn = self.conn(id)?;
                return Ok(Some(Accepted {
                    conn: id,
                    ip: conn.peer.ip(),
                    gpu_index: conn.remote_gpu,
                }));
            }
            if Instant::now() >= deadline
                || self
                    .inner
                    .accepted_cv
                    .wait_until(&mut q, deadline)
                    .timed_out()
                    && q.is_empty()
            {
                return Ok(None);
            }
        }
    }
}

/// Traces where a one-sided posting's time went (with each request's own
/// steps, `lat: request posted`; `benchmarks/rma_timeline.py --posting`
/// reads both): building the items, resolving our buffers, the requests.
/// `clock` started with the call; `items` and `local` are its readings
/// once the first two were done.
pub(super) fn trace_posted(
    t: &Transfer,
    pieces: usize,
    clock: crate::net::timing::Steps,
    items: std::time::Duration,
    local: std::time::Duration,
) {
    tracing::trace!(
        xfer = t.id,
        pieces,
        items_us = items.as_micros() as u64,
        resolve_us = local.saturating_sub(items).as_micros() as u64,
        requests_us = clock.at().saturating_sub(local).as_micros() as u64,
        "lat: rma posted"
    );
}
