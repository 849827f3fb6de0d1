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
//! bytes it knows and ignores the rest. A pre-shared key cannot be proved in one round trip of
//! private data; a CM hello with the key flag is refused ([`Reject::KeyMissing`] on either
//! side), and [`crate::Config::psk`] is refused for CM connections before anything is sent.

use super::{u32_at, Hello, Reject, VERSION};
use crate::addr::QpAddress;

/// The magic of a CM hello or reject.
pub const CM_MAGIC: [u8; 4] = *b"rdCM";
/// Length of a CM hello.
pub const CM_HELLO_LEN: usize = 30;
/// Length of a CM reject's private data.
pub const CM_REJECT_LEN: usize = 7;

const FLAG_PSK: u8 = 0x01;

const _: () = assert!(CM_HELLO_LEN <= rdmsg_verbs::CONNECT_PRIVATE_DATA_MAX);
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
    if data[6] & FLAG_PSK != 0 {
        return Err(Reject::KeyMissing);
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
        let mut k = good;
        k[6] = FLAG_PSK;
        assert_eq!(decode_hello(&k, 1), Err(Reject::KeyMissing));
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
