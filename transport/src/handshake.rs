//! rdmsg's own connection handshake, sent over the bootstrap TCP stream.
//!
//! Both sides write a [`Hello`] at once, read the peer's, check it, and write a one-byte
//! verdict. Only when both verdicts are "accept" do the queue pairs go to RTR and RTS; a final
//! "ready" byte each way guarantees that the peer is in RTR before the first send. The stream then
//! stays open: its end-of-file is how a vanished peer process is noticed, and a graceful close
//! writes [`GOODBYE`] first.

use std::io::{self, Read, Write};

use verbs_core::Gid;

use crate::addr::QpAddress;

/// First bytes of every hello. An `ibv_rc_pingpong` record starts with hex digits instead.
pub const MAGIC: [u8; 8] = *b"RDMSG\0HS";
/// Version of the handshake and of the credit protocol it sets up.
pub const VERSION: u16 = 1;
/// Length of an encoded hello.
pub const HELLO_LEN: usize = 52;
/// Verdict byte: the peer's hello is acceptable.
pub const ACCEPT: u8 = b'A';
/// Byte written once the queue pair is in RTS.
pub const READY: u8 = b'R';
/// Byte written on a graceful close, before shutting the stream down.
pub const GOODBYE: u8 = b'G';

/// Smallest receive buffer a peer may announce.
pub const MIN_BUF_SIZE: u32 = 64;
/// Largest receive buffer a peer may announce (1 GiB).
pub const MAX_BUF_SIZE: u32 = 1 << 30;
/// Most grant slots a side may reserve (the grant echo counts modulo 256).
pub const MAX_GRANT_SLOTS: u8 = 64;

/// What each side announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Handshake version.
    pub version: u16,
    /// The queue pair to connect to.
    pub addr: QpAddress,
    /// Path MTU the sender will use, in bytes.
    pub mtu: u32,
    /// Size of each receive buffer: the largest message the peer may send.
    pub buf_size: u32,
    /// Receive buffers for data messages.
    pub recv_depth: u32,
    /// Receive buffers reserved for credit grants.
    pub grant_slots: u8,
    /// Data credits the peer starts with (at most `recv_depth`).
    pub initial_credits: u32,
}

/// Why a hello was rejected. Its code travels as the verdict byte, so the peer learns why too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Reject {
    /// The bytes are not an rdmsg hello (wrong magic; an `ibv_rc_pingpong` record, say).
    #[error("not an rdmsg handshake (bad magic)")]
    BadMagic,
    /// Another handshake version.
    #[error("handshake version {peer} is not ours ({ours})")]
    Version {
        /// The peer's version.
        peer: u16,
        /// Ours.
        ours: u16,
    },
    /// A value out of range.
    #[error("invalid {0} in handshake")]
    BadValue(&'static str),
    /// The peer's path MTU differs from ours.
    #[error("path MTU mismatch")]
    Mtu,
    /// A verdict byte we do not know.
    #[error("unknown verdict {0:#04x}")]
    Unknown(u8),
}

impl Reject {
    /// The verdict byte for this reason.
    pub fn code(self) -> u8 {
        match self {
            Reject::BadMagic => b'M',
            Reject::Version { .. } => b'V',
            Reject::BadValue(_) => b'B',
            Reject::Mtu => b'T',
            Reject::Unknown(c) => c,
        }
    }

    /// The reason a verdict byte stands for (`None`: accepted).
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            ACCEPT => None,
            b'M' => Some(Reject::BadMagic),
            b'V' => Some(Reject::Version {
                peer: VERSION,
                ours: 0,
            }),
            b'B' => Some(Reject::BadValue("value")),
            b'T' => Some(Reject::Mtu),
            c => Some(Reject::Unknown(c)),
        }
    }
}

impl Hello {
    /// Big-endian wire form.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[0..8].copy_from_slice(&MAGIC);
        out[8..10].copy_from_slice(&self.version.to_be_bytes());
        out[10..12].copy_from_slice(&self.addr.lid.to_be_bytes());
        out[12..16].copy_from_slice(&self.addr.qpn.to_be_bytes());
        out[16..20].copy_from_slice(&self.addr.psn.to_be_bytes());
        out[20..36].copy_from_slice(&self.addr.gid.0);
        out[36..40].copy_from_slice(&self.mtu.to_be_bytes());
        out[40..44].copy_from_slice(&self.buf_size.to_be_bytes());
        out[44..48].copy_from_slice(&self.recv_depth.to_be_bytes());
        out[48] = self.grant_slots;
        out[49..52].copy_from_slice(&self.initial_credits.to_be_bytes()[1..]);
        out
    }

    /// Parses and checks a hello; every field is range-checked.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, Reject> {
        if b[0..8] != MAGIC {
            return Err(Reject::BadMagic);
        }
        let u16_at = |i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let version = u16_at(8);
        if version != VERSION {
            return Err(Reject::Version {
                peer: version,
                ours: VERSION,
            });
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[20..36]);
        let hello = Self {
            version,
            addr: QpAddress {
                lid: u16_at(10),
                qpn: u32_at(12),
                psn: u32_at(16),
                gid: Gid(gid),
            },
            mtu: u32_at(36),
            buf_size: u32_at(40),
            recv_depth: u32_at(44),
            grant_slots: b[48],
            initial_credits: u32::from_be_bytes([0, b[49], b[50], b[51]]),
        };
        hello.check()?;
        Ok(hello)
    }

    fn check(&self) -> Result<(), Reject> {
        if self.addr.qpn > 0xff_ffff || self.addr.psn > 0xff_ffff {
            return Err(Reject::BadValue("queue pair number or PSN"));
        }
        if verbs_core::Mtu::from_bytes(self.mtu as usize).is_none() {
            return Err(Reject::BadValue("MTU"));
        }
        if !(MIN_BUF_SIZE..=MAX_BUF_SIZE).contains(&self.buf_size) {
            return Err(Reject::BadValue("buffer size"));
        }
        if self.recv_depth == 0 || self.recv_depth > 0xff_ffff {
            return Err(Reject::BadValue("receive depth"));
        }
        if self.grant_slots < 3 || self.grant_slots > MAX_GRANT_SLOTS {
            return Err(Reject::BadValue("grant slots"));
        }
        if self.initial_credits == 0 || self.initial_credits > self.recv_depth {
            return Err(Reject::BadValue("initial credits"));
        }
        Ok(())
    }

    /// Checks the peer's hello against ours.
    pub fn check_peer(&self, peer: &Hello) -> Result<(), Reject> {
        if peer.mtu != self.mtu {
            return Err(Reject::Mtu);
        }
        Ok(())
    }
}

/// Reads exactly `buf.len()` bytes; `UnexpectedEof` if the peer closes first.
pub(crate) fn read_exact(stream: &mut impl Read, buf: &mut [u8]) -> io::Result<()> {
    stream.read_exact(buf)
}

/// Writes all of `buf`.
pub(crate) fn write_all(stream: &mut impl Write, buf: &[u8]) -> io::Result<()> {
    stream.write_all(buf)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            version: VERSION,
            addr: QpAddress {
                lid: 0,
                qpn: 0x12,
                psn: 0xabcdef,
                gid: Gid([7; 16]),
            },
            mtu: 1024,
            buf_size: 4096,
            recv_depth: 64,
            grant_slots: 3,
            initial_credits: 64,
        }
    }

    #[test]
    fn round_trips() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn rejects_what_it_should() {
        let mut pingpong = [0u8; HELLO_LEN];
        pingpong.copy_from_slice(
            &QpAddress {
                lid: 0,
                qpn: 1,
                psn: 2,
                gid: Gid([0; 16]),
            }
            .to_record(),
        );
        assert_eq!(Hello::decode(&pingpong), Err(Reject::BadMagic));
        let mut v2 = hello().encode();
        v2[9] = 2;
        assert_eq!(
            Hello::decode(&v2),
            Err(Reject::Version { peer: 2, ours: 1 })
        );
        type Breaker = fn(&mut Hello);
        let cases: [(Breaker, &str); 6] = [
            (|h| h.mtu = 1000, "MTU"),
            (|h| h.buf_size = 8, "buffer size"),
            (|h| h.recv_depth = 0, "receive depth"),
            (|h| h.grant_slots = 1, "grant slots"),
            (|h| h.initial_credits = 65, "initial credits"),
            (|h| h.addr.psn = 0x100_0000, "queue pair number or PSN"),
        ];
        for (break_it, what) in cases {
            let mut h = hello();
            break_it(&mut h);
            assert_eq!(Hello::decode(&h.encode()), Err(Reject::BadValue(what)));
        }
        let mut other = hello();
        other.mtu = 4096;
        assert_eq!(hello().check_peer(&other), Err(Reject::Mtu));
    }

    #[test]
    fn verdict_codes_round_trip() {
        assert_eq!(Reject::from_code(ACCEPT), None);
        for r in [Reject::BadMagic, Reject::Mtu] {
            assert_eq!(Reject::from_code(r.code()), Some(r));
        }
        assert_eq!(Reject::from_code(b'z'), Some(Reject::Unknown(b'z')));
    }
}
