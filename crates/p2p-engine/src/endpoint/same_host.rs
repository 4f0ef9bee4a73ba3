//! Same-host calls on the endpoint (see `crate::local`).

use super::*;

// ---------------------------------------------------------------------------
// Same-host calls (see `crate::local`): connections to endpoints of this
// machine, CUDA IPC for GPU memory and cross-memory attach for host memory.

impl Endpoint {
    /// The local connection `id` (None: not a local one).
    pub(super) fn local_conn(&self, id: u64) -> Result<Option<Arc<crate::local::LocalConn>>> {
        self.inner.local.get(id)
    }

    pub(super) fn need_local(&self, id: u64) -> Result<Arc<crate::local::LocalConn>> {
        match self.local_conn(id)? {
            Some(c) => Ok(c),
            None if self.inner.conns.read().contains_key(&id) => Err(Error::invalid(format!(
                "connection {id} is not a same-host connection (made by connect_local/accept_local)"
            ))),
            None => Err(Error::invalid(format!("unknown connection id {id}"))),
        }
    }

    /// Connects to an endpoint of this host (see [`LocalPeer`]).
    pub fn connect_local(&self, peer: &LocalPeer) -> Result<u64> {
        self.inner.local.connect(peer)
    }

    /// Waits for the next same-host connection (None: forever).
    pub fn accept_local(&self, timeout: Option<Duration>) -> Result<AcceptedLocal> {
        self.inner.local.accept(timeout)
    }

    /// An opaque descriptor offering `[ptr, ptr+len)` (host or GPU memory,
    /// registered or not) to the peer of local connection `conn`, for as
    /// long as the connection lives.
    pub fn advertise_ipc(&self, conn: u64, ptr: u64, len: usize) -> Result<Vec<u8>> {
        Ok(self
            .need_local(conn)?
            .advertise(ptr, len as u64)?
            .to_bytes())
    }

    pub(super) fn ipc_rma(
        &self,
        conn: u64,
        read: bool,
        bufs: &[(u64, usize)],
        infos: &[&[u8]],
        inline: bool,
    ) -> Result<Arc<Transfer>> {
        let c = self.need_local(conn)?;
        let items = c.ipc_items(bufs, infos)?;
        let t = Transfer::new(self.next_xfer(), conn, 1, vec![]);
        c.rma(t.clone(), read, items, inline)?;
        Ok(t)
    }

    /// One-sided write of local buffers `(ptr, len)` (unregistered) into the
    /// ranges the peer advertised with `advertise_ipc`; returns a transfer id.
    pub fn write_ipc_async(
        &self,
        conn: u64,
        bufs: &[(u64, usize)],
        infos: &[&[u8]],
    ) -> Result<u64> {
        Ok(self.publish(self.ipc_rma(conn, false, bufs, infos, false)?))
    }

    /// One-sided read from the peer's `advertise_ipc` ranges; a transfer id.
    pub fn read_ipc_async(&self, conn: u64, bufs: &[(u64, usize)], infos: &[&[u8]]) -> Result<u64> {
        Ok(self.publish(self.ipc_rma(conn, true, bufs, infos, false)?))
    }

    /// Blocking [`Endpoint::write_ipc_async`]: a GPU copy to an already
    /// resolved range runs on the calling thread.
    pub fn write_ipc(&self, conn: u64, bufs: &[(u64, usize)], infos: &[&[u8]]) -> Result<()> {
        let t = self.ipc_rma(conn, false, bufs, infos, true)?;
        crate::local::outcome(&t, t.wait(None))
    }

    /// Blocking [`Endpoint::read_ipc_async`].
    pub fn read_ipc(&self, conn: u64, bufs: &[(u64, usize)], infos: &[&[u8]]) -> Result<()> {
        let t = self.ipc_rma(conn, true, bufs, infos, true)?;
        crate::local::outcome(&t, t.wait(None))
    }

    /// Two-sided send of `[ptr, ptr+len)` (unregistered) on a local
    /// connection, matched with the peer's receives in posting order.
    pub fn send_ipc_async(&self, conn: u64, ptr: u64, len: usize) -> Result<u64> {
        let c = self.need_local(conn)?;
        let t = Transfer::new(self.next_xfer(), conn, 1, vec![]);
        c.send(t.clone(), ptr, len as u64)?;
        Ok(self.publish(t))
    }

    /// Two-sided receive into `[ptr, ptr+len)` (unregistered).
    pub fn recv_ipc_async(&self, conn: u64, ptr: u64, len: usize) -> Result<u64> {
        let c = self.need_local(conn)?;
        let t = Transfer::new(self.next_xfer(), conn, 1, vec![]);
        c.recv(t.clone(), ptr, len as u64)?;
        Ok(self.publish(t))
    }

    /// `send`/`recv` of registered buffers on a local connection: one
    /// message per buffer, one transfer for all.
    pub(super) fn local_msg(
        &self,
        c: &Arc<crate::local::LocalConn>,
        send: bool,
        bufs: &[Buf],
    ) -> Result<u64> {
        let local = self.resolve_local(bufs)?;
        let regions = local.iter().map(|(_, r)| r.clone()).collect();
        let t = Transfer::new(self.next_xfer(), c.id, bufs.len(), regions);
        for b in bufs {
            if send {
                c.send(t.clone(), b.ptr, b.len as u64)?;
            } else {
                c.recv(t.clone(), b.ptr, b.len as u64)?;
            }
        }
        Ok(self.publish(t))
    }

    /// `write`/`read`/`transfer` on a local connection: the same-host path
    /// with the peer's registry advertisements.
    pub(super) fn local_rma(
        &self,
        c: &Arc<crate::local::LocalConn>,
        read: bool,
        bufs: &[Buf],
        remote: &[RmaItem],
    ) -> Result<u64> {
        let local = self.resolve_local(bufs)?;
        if remote.len() != local.len() {
            return Err(Error::invalid(format!(
                "{} local buffers but {} remote descriptors",
                local.len(),
                remote.len()
            )));
        }
        let items = bufs
            .iter()
            .zip(remote)
            .map(|(b, r)| crate::local::Item {
                space: crate::local::desc::Space::Registry,
                token: r.token,
                remote: r.addr,
                len: r.len,
                local: b.ptr,
                desc: None,
            })
            .collect();
        let regions = local.into_iter().map(|(_, r)| r).collect();
        let t = Transfer::new(self.next_xfer(), c.id, 1, regions);
        c.rma(t.clone(), read, items, false)?;
        Ok(self.publish(t))
    }
}
