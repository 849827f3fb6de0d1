//! The connection-address record rdma-core's pingpong examples exchange over TCP.
//!
//! `LID:QPN:PSN:GID` formatted as `%04x:%06x:%06x:` followed by the 16 GID bytes as 32 hex
//! digits, NUL-terminated: 52 bytes on the wire. Speaking it lets `rc_pingpong` talk to an
//! unmodified `ibv_rc_pingpong`.

use std::fmt;

use rdmsg_verbs::Gid;

/// What a peer needs to know to connect a queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAddress {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number we send with (24 bits).
    pub psn: u32,
    /// Port GID; all zero when the peer routes by LID only (no GRH).
    pub gid: Gid,
}

/// Why a record could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The record is not `LID:QPN:PSN:GID` with hex fields of 4, 6, 6 and 32 digits.
    #[error("expected LID:QPN:PSN:GID as 4:6:6:32 hex digits, got {0:?}")]
    Malformed(String),
}

impl QpAddress {
    /// Length of the record on the wire, terminating NUL included.
    pub const RECORD_LEN: usize = 52;

    /// The record, NUL-terminated, as `ibv_rc_pingpong` writes it.
    pub fn to_record(&self) -> [u8; Self::RECORD_LEN] {
        let mut text = format!(
            "{:04x}:{:06x}:{:06x}:",
            self.lid,
            self.qpn & 0xff_ffff,
            self.psn & 0xff_ffff
        );
        for b in self.gid.0 {
            text.push_str(&format!("{b:02x}"));
        }
        let mut out = [0u8; Self::RECORD_LEN];
        out[..text.len()].copy_from_slice(text.as_bytes());
        out
    }

    /// Parses a record; text after the first NUL is ignored.
    pub fn from_record(bytes: &[u8]) -> Result<Self, RecordError> {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        let text = std::str::from_utf8(&bytes[..end])
            .map_err(|_| RecordError::Malformed(String::from_utf8_lossy(&bytes[..end]).into()))?;
        let bad = || RecordError::Malformed(text.to_owned());
        let fields: Vec<&str> = text.split(':').collect();
        let [lid, qpn, psn, gid] = fields.as_slice() else {
            return Err(bad());
        };
        let hex = |s: &str, digits: usize| -> Result<u32, RecordError> {
            if s.len() != digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(s, 16).map_err(|_| bad())
        };
        let lid = u16::try_from(hex(lid, 4)?).map_err(|_| bad())?;
        let qpn = hex(qpn, 6)?;
        let psn = hex(psn, 6)?;
        if gid.len() != 32 || !gid.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut raw = [0u8; 16];
        for (i, byte) in raw.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&gid[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self {
            lid,
            qpn,
            psn,
            gid: Gid(raw),
        })
    }
}

impl fmt::Display for QpAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
            self.lid, self.qpn, self.psn, self.gid
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GID: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1];

    #[test]
    fn record_matches_the_pingpong_format() {
        let a = QpAddress {
            lid: 0,
            qpn: 0x11,
            psn: 0x8ab2c6,
            gid: Gid(GID),
        };
        let rec = a.to_record();
        assert_eq!(
            &rec[..51],
            b"0000:000011:8ab2c6:00000000000000000000ffff0a4d0001"
        );
        assert_eq!(rec[51], 0);
        assert_eq!(QpAddress::from_record(&rec).unwrap(), a);
    }

    #[test]
    fn bad_records_are_rejected() {
        for bad in [
            &b""[..],
            b"0000:000011:8ab2c6",
            b"0000:000011:8ab2c6:0000",
            b"000:000011:8ab2c6:00000000000000000000ffff0a4d0001",
            b"0000:00001g:8ab2c6:00000000000000000000ffff0a4d0001",
            b"0000:000011:8ab2c6:00000000000000000000ffff0a4d000x",
            b"0000:000011:8ab2c6:00000000000000000000ffff0a4d0001:",
            b"\xff\xfe",
            b"RDMSG\x00HS",
        ] {
            assert!(QpAddress::from_record(bad).is_err(), "{bad:?}");
        }
    }
}
