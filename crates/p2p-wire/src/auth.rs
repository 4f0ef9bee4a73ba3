//! The handshake's proofs: what each side of a control connection sends to
//! show it holds the shared secret, over both hellos as they went over the
//! wire (the exchange itself is the engine's `handshake`).

use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::{NONCE_LEN, PROOF_LEN};

/// Which end of the control connection we are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that called connect: it proposes.
    Initiator,
    /// The side that accepted: it answers.
    Acceptor,
}

const PROOF_LABEL: &[u8] = b"tcpx-p2p handshake proof v5";

/// The secret's digest that a same-host connection's hello carries (0 with
/// no secret). Same-host peers are also checked to be of our uid
/// (`SO_PEERCRED`), which could read our memory anyway: the digest keeps
/// endpoints of one user with different secrets apart, nothing more.
pub fn local_auth(key: &[u8]) -> u64 {
    if key.is_empty() {
        return 0;
    }
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(b"tcpx-p2p same-host hello");
    let d = m.finalize().into_bytes();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b) | 1
}

/// The proof `role` sends: HMAC-SHA256 under the shared secret over both
/// hellos as they went over the wire (each length-prefixed).
pub fn proof(
    key: &[u8],
    role: Role,
    initiator_hello: &[u8],
    acceptor_hello: &[u8],
) -> [u8; PROOF_LEN] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(PROOF_LABEL);
    m.update(match role {
        Role::Initiator => b"I",
        Role::Acceptor => b"A",
    });
    for h in [initiator_hello, acceptor_hello] {
        m.update(&(h.len() as u64).to_le_bytes());
        m.update(h);
    }
    m.finalize().into_bytes().into()
}

/// Whether `got` is the proof `role` owes, compared in constant time.
pub fn verify(
    key: &[u8],
    role: Role,
    initiator_hello: &[u8],
    acceptor_hello: &[u8],
    got: &[u8; PROOF_LEN],
) -> bool {
    proof(key, role, initiator_hello, acceptor_hello)
        .ct_eq(got)
        .into()
}

/// A fresh random nonce from the operating system.
pub fn nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(n)
}
