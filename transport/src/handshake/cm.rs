//! The handshake reshaped for the RDMA connection manager, whose connection request carries at
//! most 56 bytes of private data ([`rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX`]).
//!
//! The CM itself exchanges what the TCP hello's address carries (queue pair number, PSN, GID,
//! path), so a CM hello is the rest of [`Hello`]: the request carries the client's, the accept
//! the server's, and a refusal travels as a reject whose private data names the [`Reject`]
//! reason. All integers big-endian:
//!
//! ```text
//! hello  (30 bytes): "rdCM" | version u16 | flags u8 | 0 | mtu u32 | buf_size u32
//!                    | recv_depth u32 | initial_credits u32 | grant_slots u8 | reads u8
//!                    | max_read u32
//! reject  (7 bytes): "rdCM" | version u16 | reject code u8 (`Reject::code`)
//! ```
//!
//! The CM pads private data to its transport's size with zeros, so a decoder reads only the
//! bytes it knows and ignores the rest.
//!
//! # Pre-shared key
//!
//! With [`crate::Config::psk`] the hello's key flag is set, and the exchange of the TCP
//! handshake is reshaped for one round trip of private data and the first message over the
//! queue pair:
//!
//! ```text
//! request (54 bytes): hello | nonce_c (24)
//! accept  (86 bytes): hello | nonce_s (24) | MAC_s (32)
//! first message over the queue pair, client to server: MAC_c (32)
//! ```
//!
//! The transcript is the request's 54 bytes, the accept's first 54, both queue pair numbers
//! (client's, server's; big-endian) and both IP addresses (client's, server's; 16 bytes each,
//! IPv4 as IPv4-mapped IPv6): each side's own, and the peer's as the CM reported it (zeros for
//! both numbers where the CM reports none, as iWARP's does). Queue pair numbers alone are
//! 24 bits and sequential on some devices; the addresses bind the exchange to the two hosts
//! the route joins. `MAC_s` is
//! the HMAC-SHA256 of the transcript, `MAC_c` that of the transcript and `MAC_s`, each under
//! its own label. The client checks `MAC_s` before it completes the connection (a wrong one:
//! it refuses, and the server's accept fails); the server hands out the connection only once
//! the first message is `MAC_c`. Fresh nonces on both sides make a recorded exchange useless.
//! Unlike the TCP handshake, the server makes a queue pair (and its receives) for a client
//! before it has proved anything: at most `max_pending_handshakes` of them, each for at most
//! `handshake_timeout`; its send buffers are registered only once the proof is in. The proof
//! counts as a message received (and sent) in the connection's statistics. A side with a key meeting one without is refused
//! ([`Reject::KeyMissing`]), a wrong key ([`Reject::BadKey`]) too.

use std::net::IpAddr;

use super::{u32_at, Hello, Psk, Reject, MAC_LEN, VERSION};
use crate::addr::QpAddress;

/// The magic of a CM hello or reject.
pub const CM_MAGIC: [u8; 4] = *b"rdCM";
/// Length of a CM hello.
pub const CM_HELLO_LEN: usize = 30;
/// Length of a CM reject's private data.
pub const CM_REJECT_LEN: usize = 7;

const FLAG_PSK: u8 = 0x01;

/// Length of a nonce in CM private data (the request has room for 24 bytes beside the hello).
pub const CM_NONCE_LEN: usize = 24;
/// Length of a keyed request: hello and nonce.
pub const CM_KEYED_REQUEST_LEN: usize = CM_HELLO_LEN + CM_NONCE_LEN;
/// Length of a keyed accept: hello, nonce and MAC.
pub const CM_KEYED_ACCEPT_LEN: usize = CM_KEYED_REQUEST_LEN + MAC_LEN;

const LABEL_CM_SERVER: &[u8] = b"rdmsg rdma_cm handshake: server hello";
const LABEL_CM_CLIENT: &[u8] = b"rdmsg rdma_cm handshake: client proof";

const _: () = assert!(CM_HELLO_LEN <= rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX);
const _: () = assert!(CM_KEYED_REQUEST_LEN <= rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX);
const _: () = assert!(CM_KEYED_ACCEPT_LEN <= rdmsg_verbs::ACCEPT_PRIVATE_DATA_MAX);
const _: () = assert!(CM_REJECT_LEN <= rdmsg_verbs::REJECT_PRIVATE_DATA_MAX);

/// `hello` as a request's or an accept's private data (its address is the CM's business).
pub fn encode_hello(hello: &Hello) -> [u8; CM_HELLO_LEN] {
    let mut b = [0u8; CM_HELLO_LEN];
    b[..4].copy_from_slice(&CM_MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_be_bytes());
    b[6] = 0;
    b[8..12].copy_from_slice(&hello.mtu.to_be_bytes());
    b[12..16].copy_from_slice(&hello.buf_size.to_be_bytes());
    b[16..20].copy_from_slice(&hello.recv_depth.to_be_bytes());
    b[20..24].copy_from_slice(&hello.initial_credits.to_be_bytes());
    b[24] = hello.grant_slots;
    b[25] = hello.reads;
    b[26..30].copy_from_slice(&hello.max_read.to_be_bytes());
    b
}

/// The hello in a peer's private data, range-checked, with `qpn` (from the CM) as its
/// address's queue pair number.
pub fn decode_hello(data: &[u8], qpn: u32) -> Result<Hello, Reject> {
    if data.len() < CM_HELLO_LEN || data[..4] != CM_MAGIC {
        return Err(Reject::BadMagic);
    }
    let version = u16::from_be_bytes([data[4], data[5]]);
    if version != VERSION {
        return Err(Reject::Version {
            peer: version,
            ours: VERSION,
        });
    }
    let hello = Hello {
        version,
        addr: QpAddress {
            lid: 0,
            qpn,
            psn: 0,
            gid: rdmsg_verbs::Gid([0; 16]),
        },
        mtu: u32_at(data, 8),
        buf_size: u32_at(data, 12),
        recv_depth: u32_at(data, 16),
        initial_credits: u32_at(data, 20),
        grant_slots: data[24],
        reads: data[25],
        max_read: u32_at(data, 26),
    };
    hello.check()?;
    Ok(hello)
}

/// Whether the hello in `data` says its side has a pre-shared key, checked against whether we
/// have one (a key on one side only: [`Reject::KeyMissing`]).
pub fn check_key_flag(data: &[u8], ours: bool) -> Result<(), Reject> {
    let theirs = data.get(6).is_some_and(|f| f & FLAG_PSK != 0);
    if theirs == ours {
        Ok(())
    } else {
        Err(Reject::KeyMissing)
    }
}

/// The client's request: its hello, and with a key its fresh nonce.
pub fn encode_request(hello: &Hello, psk: Option<&Psk>, nonce: &[u8; CM_NONCE_LEN]) -> Vec<u8> {
    let mut b = encode_hello(hello).to_vec();
    if psk.is_some() {
        b[6] |= FLAG_PSK;
        b.extend_from_slice(nonce);
    }
    b
}

/// The two ends of a CM connection as the transcript binds them: each side's own queue pair
/// number and address, and the peer's as the CM reported them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ends {
    /// The client's queue pair number.
    pub client_qpn: u32,
    /// The server's queue pair number.
    pub server_qpn: u32,
    /// The client's IP address (unspecified where the CM reports none).
    pub client_ip: IpAddr,
    /// The server's IP address (unspecified where the CM reports none).
    pub server_ip: IpAddr,
}

/// An address as the transcript signs it: IPv4 as IPv4-mapped IPv6, so that either form of
/// one address signs alike.
fn ip_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The transcript both sides sign: the keyed request and accept (MACs left out), both queue
/// pair numbers and both addresses.
fn transcript(request: &[u8], accept: &[u8], ends: &Ends) -> Result<Vec<u8>, Reject> {
    if request.len() < CM_KEYED_REQUEST_LEN || accept.len() < CM_KEYED_REQUEST_LEN {
        return Err(Reject::BadValue("nonce"));
    }
    // iWARP's CM reports no peer queue pair number (0): there both sides sign zeros.
    let (client_qpn, server_qpn) = if ends.client_qpn == 0 || ends.server_qpn == 0 {
        (0, 0)
    } else {
        (ends.client_qpn, ends.server_qpn)
    };
    let mut t = Vec::with_capacity(2 * CM_KEYED_REQUEST_LEN + 8 + 32);
    t.extend_from_slice(&request[..CM_KEYED_REQUEST_LEN]);
    t.extend_from_slice(&accept[..CM_KEYED_REQUEST_LEN]);
    t.extend_from_slice(&client_qpn.to_be_bytes());
    t.extend_from_slice(&server_qpn.to_be_bytes());
    t.extend_from_slice(&ip_bytes(ends.client_ip));
    t.extend_from_slice(&ip_bytes(ends.server_ip));
    Ok(t)
}

/// What the server checks the client's first message against: the key, and what `MAC_c`
/// signs.
#[derive(Clone)]
pub struct ProofCheck {
    psk: Psk,
    signed: Vec<u8>,
}

impl std::fmt::Debug for ProofCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProofCheck")
    }
}

impl ProofCheck {
    /// The server's check of the client's first message (constant time).
    pub fn check(&self, got: &[u8]) -> Result<(), Reject> {
        if got.len() == MAC_LEN && self.psk.verify(LABEL_CM_CLIENT, &[&self.signed], got) {
            Ok(())
        } else {
            Err(Reject::BadKey)
        }
    }
}

/// The server's accept: its hello, and with a key its nonce and `MAC_s` over the exchange;
/// with the key, also what the client's first message must prove.
pub fn encode_accept(
    hello: &Hello,
    psk: Option<&Psk>,
    request: &[u8],
    nonce: &[u8; CM_NONCE_LEN],
    ends: &Ends,
) -> Result<(Vec<u8>, Option<ProofCheck>), Reject> {
    let mut b = encode_hello(hello).to_vec();
    let Some(k) = psk else {
        return Ok((b, None));
    };
    b[6] |= FLAG_PSK;
    b.extend_from_slice(nonce);
    let mut signed = transcript(request, &b, ends)?;
    let mac_s = k.mac(LABEL_CM_SERVER, &[&signed]);
    b.extend_from_slice(&mac_s);
    signed.extend_from_slice(&mac_s);
    Ok((
        b,
        Some(ProofCheck {
            psk: k.clone(),
            signed,
        }),
    ))
}

/// The client's check of a keyed accept: `MAC_s` must be right; returns the proof to send as
/// the first message over the queue pair (`MAC_c`).
pub fn check_accept(
    psk: &Psk,
    request: &[u8],
    accept: &[u8],
    ends: &Ends,
) -> Result<[u8; MAC_LEN], Reject> {
    if accept.len() < CM_KEYED_ACCEPT_LEN {
        return Err(Reject::BadValue("server MAC"));
    }
    let t = transcript(request, accept, ends)?;
    let mac_s = &accept[CM_KEYED_REQUEST_LEN..CM_KEYED_ACCEPT_LEN];
    if !psk.verify(LABEL_CM_SERVER, &[&t], mac_s) {
        return Err(Reject::BadKey);
    }
    Ok(psk.mac(LABEL_CM_CLIENT, &[&t, mac_s]))
}

/// A refusal as a reject's private data.
pub fn encode_reject(reason: Reject) -> [u8; CM_REJECT_LEN] {
    let mut b = [0u8; CM_REJECT_LEN];
    b[..4].copy_from_slice(&CM_MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_be_bytes());
    b[6] = reason.code();
    b
}

/// The reason in a reject's private data: `None` when it is not an rdmsg reject (another
/// program refused, or the peer's CM did).
pub fn decode_reject(data: &[u8]) -> Option<Reject> {
    if data.len() < CM_REJECT_LEN || data[..4] != CM_MAGIC {
        return None;
    }
    Reject::from_code(data[6])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            version: VERSION,
            addr: QpAddress {
                lid: 0,
                qpn: 0x1234,
                psn: 0,
                gid: rdmsg_verbs::Gid([0; 16]),
            },
            mtu: 1024,
            buf_size: 4096,
            recv_depth: 64,
            initial_credits: 64,
            grant_slots: 4,
            reads: 1,
            max_read: 1 << 20,
        }
    }

    #[test]
    fn a_hello_fits_a_request_and_survives_the_padding() {
        let h = hello();
        let mut data = encode_hello(&h).to_vec();
        assert!(data.len() <= rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX);
        data.resize(rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX, 0);
        assert_eq!(decode_hello(&data, 0x1234), Ok(h));
    }

    #[test]
    fn foreign_short_or_wrong_private_data_is_refused_with_a_reason() {
        let good = encode_hello(&hello());
        assert_eq!(decode_hello(&[0; 56], 1), Err(Reject::BadMagic));
        assert_eq!(decode_hello(&good[..29], 1), Err(Reject::BadMagic));
        assert_eq!(decode_hello(b"", 1), Err(Reject::BadMagic));
        let mut v = good;
        v[5] ^= 0xff;
        assert!(matches!(decode_hello(&v, 1), Err(Reject::Version { .. })));
        // A key on one side only.
        let mut k = good;
        k[6] = FLAG_PSK;
        assert_eq!(decode_hello(&k, 1), Ok(hello_with_qpn(1)));
        assert_eq!(check_key_flag(&k, false), Err(Reject::KeyMissing));
        assert_eq!(check_key_flag(&good, true), Err(Reject::KeyMissing));
        assert_eq!(check_key_flag(&k, true), Ok(()));
        assert_eq!(check_key_flag(&good, false), Ok(()));
        // Range checks are the TCP hello's.
        let mut z = good;
        z[16..20].copy_from_slice(&0u32.to_be_bytes());
        assert_eq!(decode_hello(&z, 1), Err(Reject::BadValue("receive depth")));
        let mut m = good;
        m[8..12].copy_from_slice(&1000u32.to_be_bytes());
        assert_eq!(decode_hello(&m, 1), Err(Reject::BadValue("MTU")));
        // A queue pair number beyond 24 bits cannot come from the CM, but is refused anyway.
        assert!(decode_hello(&good, 1 << 24).is_err());
    }

    fn ends(client_qpn: u32, server_qpn: u32) -> Ends {
        Ends {
            client_qpn,
            server_qpn,
            client_ip: "10.0.0.1".parse().unwrap(),
            server_ip: "10.0.0.2".parse().unwrap(),
        }
    }

    fn hello_with_qpn(qpn: u32) -> Hello {
        let mut h = hello();
        h.addr.qpn = qpn;
        h
    }

    #[test]
    fn a_keyed_exchange_proves_both_sides_and_binds_nonces_queue_pairs_and_addresses() {
        let key = Psk::new(vec![7; 32]);
        let (nc, ns) = ([1; CM_NONCE_LEN], [2; CM_NONCE_LEN]);
        let mut request = encode_request(&hello(), Some(&key), &nc);
        assert_eq!(request.len(), CM_KEYED_REQUEST_LEN);
        assert!(request.len() <= rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX);
        request.resize(rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX, 0);
        assert_eq!(check_key_flag(&request, true), Ok(()));
        let (mut accept, check) =
            encode_accept(&hello(), Some(&key), &request, &ns, &ends(0x11, 0x22)).unwrap();
        assert_eq!(accept.len(), CM_KEYED_ACCEPT_LEN);
        accept.resize(rdmsg_verbs::ACCEPT_PRIVATE_DATA_MAX, 0);
        let check = check.expect("a keyed accept has a proof to check");
        let proof = check_accept(&key, &request, &accept, &ends(0x11, 0x22)).unwrap();
        assert_eq!(check.check(&proof), Ok(()));
        // A wrong key, either way.
        let other = Psk::new(vec![8; 32]);
        assert_eq!(
            check_accept(&other, &request, &accept, &ends(0x11, 0x22)),
            Err(Reject::BadKey)
        );
        let (_, forged) =
            encode_accept(&hello(), Some(&other), &request, &ns, &ends(0x11, 0x22)).unwrap();
        assert_eq!(forged.unwrap().check(&proof), Err(Reject::BadKey));
        // Another queue pair, nonce, or a truncated or empty proof: refused.
        assert_eq!(
            check_accept(&key, &request, &accept, &ends(0x11, 0x23)),
            Err(Reject::BadKey)
        );
        let mut replayed = request.clone();
        replayed[CM_HELLO_LEN] ^= 1;
        assert_eq!(
            check_accept(&key, &replayed, &accept, &ends(0x11, 0x22)),
            Err(Reject::BadKey)
        );
        assert_eq!(check.check(&proof[..31]), Err(Reject::BadKey));
        assert_eq!(check.check(b""), Err(Reject::BadKey));
        // An unkeyed accept where a keyed one is due is too short to check.
        let (plain, none) =
            encode_accept(&hello(), None, &request, &ns, &ends(0x11, 0x22)).unwrap();
        assert!(none.is_none());
        assert_eq!(
            check_accept(&key, &request, &plain, &ends(0x11, 0x22)),
            Err(Reject::BadValue("server MAC"))
        );
        // Another host at either end, whatever the queue pair numbers: refused.
        for other in [
            Ends {
                client_ip: "10.0.0.9".parse().unwrap(),
                ..ends(0x11, 0x22)
            },
            Ends {
                server_ip: "10.0.0.9".parse().unwrap(),
                ..ends(0x11, 0x22)
            },
        ] {
            assert_eq!(
                check_accept(&key, &request, &accept, &other),
                Err(Reject::BadKey)
            );
        }
        // One address in either form signs alike.
        let mapped = Ends {
            client_ip: "::ffff:10.0.0.1".parse().unwrap(),
            ..ends(0x11, 0x22)
        };
        assert_eq!(check_accept(&key, &request, &accept, &mapped), Ok(proof));
        // Where the CM reports no peer queue pair number (iWARP), both sides sign zeros.
        let (zero_accept, zero_check) =
            encode_accept(&hello(), Some(&key), &request, &ns, &ends(0, 0x22)).unwrap();
        let proof = check_accept(&key, &request, &zero_accept, &ends(0x11, 0)).unwrap();
        assert_eq!(zero_check.unwrap().check(&proof), Ok(()));
        // Without a key the request is the bare hello.
        assert_eq!(encode_request(&hello(), None, &nc).len(), CM_HELLO_LEN);
    }

    #[test]
    fn a_reject_carries_its_reason_and_foreign_rejects_carry_none() {
        for r in [Reject::Mtu, Reject::Limits("request"), Reject::Resources] {
            let mut data = encode_reject(r).to_vec();
            data.resize(rdmsg_verbs::REJECT_PRIVATE_DATA_MAX, 0);
            assert_eq!(decode_reject(&data), Some(r));
        }
        assert_eq!(decode_reject(&[0; 148]), None);
        assert_eq!(decode_reject(b"rdCM"), None);
        assert_eq!(decode_reject(b"no thanks"), None);
    }
}
