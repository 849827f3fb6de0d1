//! rdmsg's own connection handshake over the bootstrap TCP stream, as a pure state machine.
//!
//! [`Handshake`] does no I/O and reads no clock, like the cores of rustls and quinn-proto:
//! bytes from the peer go in through [`Handshake::feed`] (at most [`Handshake::wanted`] at a
//! time, so nothing that follows the handshake is swallowed), bytes for the peer come out of
//! [`Handshake::output`], and what the driver must do in between comes out of
//! [`Handshake::poll_action`]: set up and connect the queue pair, then report
//! [`Handshake::local_ready`] (or [`Handshake::abort`]). Deadlines belong to the driver. The
//! transport drives the connecting side with a blocking loop and the accepting side from the
//! [`Listener`](crate::Listener)'s poll loop, where many handshakes proceed at once, each with
//! its own deadline, so that a silent, slow or garbage-sending client delays nobody; a hub
//! can drive the same machine from its own epoll.
//!
//! # The exchange (version 5)
//!
//! ```text
//! client (QP in INIT, receives posted)                    server (nothing allocated)
//!   ClientHello: header 'C', hello, nonce,       ──▶  checks values, MTU, limits, key presence
//!                session field
//!        ◀──  ServerHello: header 'A', hello (no QP address), nonce, MAC_s
//!             or a header carrying a reject code (padded to 56 bytes): end
//!   checks values, MTU, limits, MAC_s
//!   'A', MAC_c   or a reject code: end           ──▶  checks MAC_c; only now creates its QP,
//!                                                     posts its receives, registers its send
//!                                                     buffers, moves to RTR and RTS
//!        ◀──  'R', server QP address, MAC_f   or a reject code: end
//!   checks MAC_f, registers its send buffers,
//!   moves to RTR and RTS
//!   'R'   or a reject code: end                  ──▶  done
//! ```
//!
//! The client speaks first and the server allocates nothing until the client's hello passed
//! every check (and, with a pre-shared key, until the client proved it knows the key), so a
//! silent or forged client costs the server a socket and a few hundred bytes, nothing pinned.
//! What a peer announces is bounded by [`Limits`] (from [`Config`](crate::Config)): its buffer
//! size decides how much memory we register for sending to it. Each side ends in RTS and the
//! server sends its "ready" (with its address) only from RTS, the client its own from RTS: so
//! each knows the other is at least in RTR before its first send.
//!
//! The stream then stays open: its end-of-file is how a vanished peer process is noticed. On a
//! graceful close a side writes [`GOODBYE`] (once its close message was delivered) before
//! shutting the stream down; any other byte after the handshake is a protocol violation
//! ([`Failure::BootstrapGarbage`](crate::Failure::BootstrapGarbage)).
//!
//! # Wire format
//!
//! All integers big-endian. A *header* is [`MAGIC`] (8 bytes), the version (2), a kind byte
//! (`'C'` for a client hello, [`ACCEPT`] or a reject code for the server's answer) and a flags
//! byte (bit 0: the sender has a pre-shared key). A *hello* is a header followed by 48 bytes:
//! LID (2), QPN (4), PSN (4), GID (16), path MTU (4), buffer size (4), receive depth (4),
//! initial credits (4), grant slots (1), RDMA reads served at once (1), largest message read
//! (4) — [`HELLO_LEN`] in all. Nonces and MACs are 32 bytes. The client hello ends with the
//! session field ([`SESSION_LEN`] bytes: a kind, 0 none, 1 a resumable session offered, 2 a
//! resume, and a [`TOKEN_LEN`]-byte token; see [`Resumption`]); the server hello's flag bit 1
//! says it agreed. A server that rejects the client
//! hello answers with a header carrying the reject code, padded with zeros to [`HELLO_LEN`]
//! bytes (so that an older client, which reads 52 or 56 bytes, sees the other version). Later
//! rejections are the reject code alone; see [`Reject::code`].
//!
//! # Pre-shared key
//!
//! With [`Config::psk`](crate::Config::psk) set on both sides, each proves it knows the key by
//! an HMAC-SHA256 over the transcript: `MAC_s` over both hellos and both nonces, `MAC_c` over
//! all of that plus `MAC_s`, `MAC_f` over all of that plus `MAC_c` and the server's queue pair
//! address; each under its own label, so that no MAC can stand in for another, and checked in
//! constant time. Fresh nonces on both sides make a recorded transcript useless. A side with a
//! key meeting one without is rejected ([`Reject::KeyMissing`]), a wrong key
//! ([`Reject::BadKey`]) too, on both sides. Without keys the nonce and MAC fields are sent but
//! mean nothing. The key authenticates the peer; it does not encrypt or protect the stream
//! afterwards.

pub mod cm;

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use rdmsg_verbs::Gid;
use sha2::Sha256;

use crate::addr::QpAddress;
use crate::Error;

/// First bytes of every hello. An `ibv_rc_pingpong` record starts with hex digits instead.
pub const MAGIC: [u8; 8] = *b"RDMSG\0HS";
/// Version of the handshake and of the protocols it sets up. 3: queue pairs serve RDMA reads
/// and sessions send large messages by rendezvous (a version 2 peer would drop those), so
/// the two refuse each other here rather than lose messages. 4: each side announces the reads
/// it serves at once and the largest message it reads (a sender fragments larger ones), and
/// frames and grants carry the delivery record. 5: the client hello carries a session field
/// (a session that may resume after a lost connection, or the resume of one).
pub const VERSION: u16 = 5;
/// Length of a header: magic, version, kind, flags.
pub const HEADER_LEN: usize = 12;
/// Length of an encoded hello, header included.
pub const HELLO_LEN: usize = 60;
/// Length of a nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Length of a session token ([`Resumption`]).
pub const TOKEN_LEN: usize = 16;
/// Length of the client hello's session field: its kind and a token.
pub const SESSION_LEN: usize = 1 + TOKEN_LEN;
/// Length of the client's hello: hello, nonce and session field.
pub const CLIENT_HELLO_LEN: usize = HELLO_LEN + NONCE_LEN + SESSION_LEN;
/// Length of the server's accepting answer: hello, nonce, MAC.
pub const SERVER_HELLO_LEN: usize = HELLO_LEN + NONCE_LEN + MAC_LEN;
/// Kind byte of a client hello.
pub const CLIENT_HELLO: u8 = b'C';
/// Verdict byte: the peer's hello (or proof) is acceptable.
pub const ACCEPT: u8 = b'A';
/// Byte written once the queue pair is in RTS.
pub const READY: u8 = b'R';
/// Byte written on a graceful close, once the close message was delivered, before shutting
/// the stream down. The only byte allowed after the handshake.
pub const GOODBYE: u8 = b'G';

/// Smallest receive buffer a peer may announce.
pub const MIN_BUF_SIZE: u32 = 64;
/// Largest receive buffer a hello may carry at all (1 GiB); [`Limits`] bound it further.
pub const MAX_BUF_SIZE: u32 = 1 << 30;
/// Largest receive depth a hello may carry at all; [`Limits`] bound it further.
pub const MAX_RECV_DEPTH: u32 = 0xff_ffff;
/// Most grant slots a side may reserve (the grant echo counts modulo 256).
pub const MAX_GRANT_SLOTS: u8 = 64;

/// Flag bit: the sender has a pre-shared key.
const FLAG_PSK: u8 = 0x01;
/// Flag bit of the server hello: the session the client offered is resumable, or the resume
/// it asked for will be served (if its token names a session here).
const FLAG_RESUMABLE: u8 = 0x02;
/// What the server signs: its hello and its nonce.
const SIGNED_LEN: usize = HELLO_LEN + NONCE_LEN;
/// Length of the hello after its header.
const BODY_LEN: usize = HELLO_LEN - HEADER_LEN;
/// Length of an encoded queue pair address.
const ADDR_LEN: usize = 26;
/// The client's answer to the server hello: verdict and MAC.
const PROOF_LEN: usize = 1 + MAC_LEN;
/// The server's last message: "ready", its address, MAC.
const ADDRESS_LEN: usize = 1 + ADDR_LEN + MAC_LEN;

// What each MAC proves. The version is not in the labels: it is in both hellos, which every
// MAC covers.
const LABEL_SERVER: &[u8] = b"rdmsg handshake: server hello";
const LABEL_CLIENT: &[u8] = b"rdmsg handshake: client proof";
const LABEL_FINISH: &[u8] = b"rdmsg handshake: server address";

/// The session field of a client hello: whether the connection carries a session that may
/// resume on a new connection after this one is lost, and which. The token is drawn at
/// random by the client for a new session and names it from then on; with a pre-shared key
/// every MAC covers it, so only a holder of the key can present it, and without one it is a
/// 128-bit secret of the two peers (and of whoever reads the bootstrap stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Resumption {
    /// A connection whose failure ends it.
    #[default]
    Off,
    /// A new session that may resume, named by this token.
    Offer([u8; TOKEN_LEN]),
    /// The resume of the session this token names.
    Resume([u8; TOKEN_LEN]),
}

impl Resumption {
    fn encode(self) -> [u8; SESSION_LEN] {
        let mut b = [0u8; SESSION_LEN];
        let (kind, token) = match self {
            Resumption::Off => (0, [0; TOKEN_LEN]),
            Resumption::Offer(t) => (1, t),
            Resumption::Resume(t) => (2, t),
        };
        b[0] = kind;
        b[1..].copy_from_slice(&token);
        b
    }

    fn decode(b: &[u8]) -> Result<Self, Reject> {
        let token: [u8; TOKEN_LEN] = b[1..SESSION_LEN].try_into().expect("sized");
        match b[0] {
            0 if token == [0; TOKEN_LEN] => Ok(Resumption::Off),
            1 => Ok(Resumption::Offer(token)),
            2 => Ok(Resumption::Resume(token)),
            _ => Err(Reject::BadValue("session field")),
        }
    }

    /// The token, if any.
    pub fn token(self) -> Option<[u8; TOKEN_LEN]> {
        match self {
            Resumption::Off => None,
            Resumption::Offer(t) | Resumption::Resume(t) => Some(t),
        }
    }
}

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
    /// RDMA reads the sender's queue pair serves at once (its responder resources): the
    /// other side keeps at most this many in flight towards it. At least 1.
    pub reads: u8,
    /// Largest message the sender reads from its peer's memory (rdmsg's rendezvous, at the
    /// typed layer): the peer sends larger ones another way. 0: none.
    pub max_read: u32,
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
    /// The peer asks for more than our limits allow ([`Limits`]): bigger buffers or a deeper
    /// receive queue than we accept, or buffers so big that not one send buffer fits in the
    /// send memory allowed.
    #[error("the peer's {0} exceeds our limit")]
    Limits(&'static str),
    /// One side has a pre-shared key and the other has none.
    #[error("a pre-shared key is configured on one side only")]
    KeyMissing,
    /// The peer did not prove that it knows our pre-shared key.
    #[error("pre-shared key authentication failed")]
    BadKey,
    /// The client asked to resume a session the server does not have: the server process
    /// restarted (its sessions are gone), the session ended there (its resume window ran
    /// out, or it was closed), or the server does not resume sessions.
    #[error(
        "the peer has no such session to resume: it restarted, the session's resume window \
         ran out there, or it does not resume sessions"
    )]
    UnknownSession,
    /// The peer could not set up its side (creating, registering or connecting its queue
    /// pair and buffers). Why does not travel; running out of descriptors or of locked memory
    /// is the common cause, and the peer's own error names it.
    #[error(
        "the peer could not set up its side of the connection (its queue pair, buffers or \
         descriptors): it may have reached its descriptor limit (`ulimit -n`) or locked-memory \
         limit (`ulimit -l`); the error on its side says which"
    )]
    Resources,
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
            Reject::Limits(_) => b'L',
            Reject::KeyMissing => b'K',
            Reject::BadKey => b'P',
            Reject::Resources => b'E',
            Reject::UnknownSession => b'S',
            Reject::Unknown(c) => c,
        }
    }

    /// The reason a verdict byte stands for (`None`: accepted). Details that do not travel
    /// (which value, which limit) read as generic.
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
            b'L' => Some(Reject::Limits("request")),
            b'K' => Some(Reject::KeyMissing),
            b'P' => Some(Reject::BadKey),
            b'E' => Some(Reject::Resources),
            b'S' => Some(Reject::UnknownSession),
            c => Some(Reject::Unknown(c)),
        }
    }
}

impl Hello {
    /// Checks that every field is in range.
    pub fn check(&self) -> Result<(), Reject> {
        if self.addr.qpn > 0xff_ffff || self.addr.psn > 0xff_ffff {
            return Err(Reject::BadValue("queue pair number or PSN"));
        }
        if rdmsg_verbs::Mtu::from_bytes(self.mtu as usize).is_none() {
            return Err(Reject::BadValue("MTU"));
        }
        if !(MIN_BUF_SIZE..=MAX_BUF_SIZE).contains(&self.buf_size) {
            return Err(Reject::BadValue("buffer size"));
        }
        if self.recv_depth == 0 || self.recv_depth > MAX_RECV_DEPTH {
            return Err(Reject::BadValue("receive depth"));
        }
        if self.grant_slots < 3 || self.grant_slots > MAX_GRANT_SLOTS {
            return Err(Reject::BadValue("grant slots"));
        }
        if self.initial_credits == 0 || self.initial_credits > self.recv_depth {
            return Err(Reject::BadValue("initial credits"));
        }
        if self.reads == 0 {
            return Err(Reject::BadValue("reads served"));
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

    /// The hello as sent, with a header of `kind` and `flags`.
    fn encode(&self, kind: u8, flags: u8) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..HEADER_LEN].copy_from_slice(&header(kind, flags));
        let b = &mut out[HEADER_LEN..];
        b[..ADDR_LEN].copy_from_slice(&encode_addr(&self.addr));
        b[26..30].copy_from_slice(&self.mtu.to_be_bytes());
        b[30..34].copy_from_slice(&self.buf_size.to_be_bytes());
        b[34..38].copy_from_slice(&self.recv_depth.to_be_bytes());
        b[38..42].copy_from_slice(&self.initial_credits.to_be_bytes());
        b[42] = self.grant_slots;
        b[43] = self.reads;
        b[44..48].copy_from_slice(&self.max_read.to_be_bytes());
        out
    }

    /// Parses and range-checks the 48 bytes after a header of `version`.
    fn decode_body(version: u16, b: &[u8]) -> Result<Self, Reject> {
        debug_assert_eq!(b.len(), BODY_LEN);
        let hello = Self {
            version,
            addr: decode_addr(&b[..ADDR_LEN]),
            mtu: u32_at(b, 26),
            buf_size: u32_at(b, 30),
            recv_depth: u32_at(b, 34),
            initial_credits: u32_at(b, 38),
            grant_slots: b[42],
            reads: b[43],
            max_read: u32_at(b, 44),
        };
        hello.check()?;
        Ok(hello)
    }
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn header(kind: u8, flags: u8) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_be_bytes());
    h[10] = kind;
    h[11] = flags;
    h
}

/// Magic, version, kind and flags of a header.
fn parse_header(h: &[u8]) -> Result<(u16, u8, u8), Reject> {
    if h[..8] != MAGIC {
        return Err(Reject::BadMagic);
    }
    Ok((u16::from_be_bytes([h[8], h[9]]), h[10], h[11]))
}

fn encode_addr(a: &QpAddress) -> [u8; ADDR_LEN] {
    let mut b = [0u8; ADDR_LEN];
    b[0..2].copy_from_slice(&a.lid.to_be_bytes());
    b[2..6].copy_from_slice(&a.qpn.to_be_bytes());
    b[6..10].copy_from_slice(&a.psn.to_be_bytes());
    b[10..26].copy_from_slice(&a.gid.0);
    b
}

fn decode_addr(b: &[u8]) -> QpAddress {
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[10..26]);
    QpAddress {
        lid: u16::from_be_bytes([b[0], b[1]]),
        qpn: u32_at(b, 2),
        psn: u32_at(b, 6),
        gid: Gid(gid),
    }
}

/// What a peer's hello may ask of us. Its buffer size is the size of each of our send
/// buffers, so it decides how much memory we register for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest receive buffer the peer may announce.
    pub max_buf_size: u32,
    /// Deepest receive queue (and so most initial credits) the peer may announce.
    pub max_recv_depth: u32,
    /// Most memory registered for send buffers.
    pub max_send_memory: u64,
    /// Send buffers wanted (the send queue depth).
    pub send_depth: u32,
}

impl Limits {
    /// Checks `peer` against the limits; returns how many send buffers of the peer's buffer
    /// size to register: `send_depth`, or fewer if that many would exceed `max_send_memory`
    /// (at least one).
    pub fn check(&self, peer: &Hello) -> Result<u32, Reject> {
        if peer.buf_size > self.max_buf_size {
            return Err(Reject::Limits("buffer size"));
        }
        if peer.recv_depth > self.max_recv_depth {
            return Err(Reject::Limits("receive depth"));
        }
        let fit = self.max_send_memory / u64::from(peer.buf_size.max(1));
        match u32::try_from(fit.min(u64::from(self.send_depth))) {
            Ok(0) | Err(_) => Err(Reject::Limits("buffer size")),
            Ok(n) => Ok(n),
        }
    }
}

/// A pre-shared key for authenticating handshakes. Its `Debug` shows the length only.
///
/// Use at least [`Psk::MIN_LEN`] random bytes (32 are best). The bytes are kept in memory
/// for the life of every `Config` holding the key, and not zeroed on drop.
#[derive(Clone)]
pub struct Psk(Arc<[u8]>);

impl Psk {
    /// Shortest key a [`Config`](crate::Config) accepts.
    pub const MIN_LEN: usize = 16;

    /// A key of these bytes.
    pub fn new(key: impl AsRef<[u8]>) -> Self {
        Self(Arc::from(key.as_ref()))
    }

    /// Length of the key in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the key is empty (a `Config` rejects it).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn hmac(&self, label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC accepts keys of any length");
        mac.update(label);
        for p in parts {
            mac.update(p);
        }
        mac
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
        self.hmac(label, parts).finalize().into_bytes().into()
    }

    /// Constant-time comparison of `tag` with the MAC of `parts`.
    fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        self.hmac(label, parts).verify_slice(tag).is_ok()
    }
}

impl fmt::Debug for Psk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psk({} bytes, redacted)", self.0.len())
    }
}

/// What the driver of a [`Handshake`] must do before the exchange can go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Set up the local side towards `peer`: on the server create the queue pair and post
    /// its receives first; move the queue pair to RTR and RTS, then call
    /// [`Handshake::local_ready`] with its address, or [`Handshake::abort`] if that failed.
    /// The `send_buffers` send buffers of `peer.buf_size` bytes are registered only once the
    /// handshake is done, so that a peer that stops before its "ready" pins none of them.
    Connect {
        /// The peer's hello, its queue pair address included.
        peer: Hello,
        /// Send buffers to register (see [`Limits::check`]).
        send_buffers: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Server: reading the client hello.
    ClientHello,
    /// Client: reading the server hello (or its rejection).
    ServerHello,
    /// Server: reading the client's verdict and proof.
    Proof,
    /// Client: reading the server's address (or its rejection).
    Address,
    /// Both: waiting for the driver to connect the queue pair.
    Connecting,
    /// Server: reading the client's "ready".
    Ready,
    /// Finished: the queue pairs are connected.
    Done,
    /// Failed; the output may still hold a reject code for the peer.
    Failed,
}

/// Which side rejected.
enum Fail {
    /// We reject the peer (and tell it).
    Ours(Reject),
    /// The peer rejected us.
    Theirs(Reject),
}

/// One side of the handshake: a byte-in, bytes-and-actions-out state machine (see the module
/// docs). A driver loops:
///
/// 1. write out [`output`](Self::output) and [`consume_output`](Self::consume_output) what
///    was written (also after an error: it may hold the reject code that tells the peer why);
/// 2. serve [`poll_action`](Self::poll_action);
/// 3. stop when [`is_done`](Self::is_done);
/// 4. otherwise read at most [`wanted`](Self::wanted) bytes from the peer and
///    [`feed`](Self::feed) them, or give up when the deadline passes.
pub struct Handshake {
    is_server: bool,
    state: State,
    /// Our hello; on the server its address is filled in by `local_ready`.
    ours: Hello,
    limits: Limits,
    psk: Option<Psk>,
    nonce: [u8; NONCE_LEN],
    /// The peer's hello once checked (on the client, its address arrives last).
    peer: Option<Hello>,
    send_buffers: u32,
    /// Client hello, server hello and client proof as sent, for the MACs.
    transcript: Vec<u8>,
    inbuf: [u8; SERVER_HELLO_LEN],
    have: usize,
    out: Vec<u8>,
    action: Option<Action>,
    /// The client's session field: what it asks (on the server, once its hello is in).
    session: Resumption,
    /// On the server: whether it makes sessions resumable. On the client, once the server
    /// hello is in: whether the server agreed.
    resumable: bool,
}

impl fmt::Debug for Handshake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handshake")
            .field("state", &self.state)
            .field("ours", &self.ours)
            .field("peer", &self.peer)
            .field("psk", &self.psk)
            .field("have", &self.have)
            .field("output", &self.out.len())
            .finish_non_exhaustive()
    }
}

impl Handshake {
    /// The connecting side, announcing `ours` (its queue pair already exists, in INIT with
    /// its receives posted); `nonce` must be fresh random bytes. The client hello is queued
    /// for output at once.
    pub fn client(ours: Hello, limits: Limits, psk: Option<Psk>, nonce: [u8; NONCE_LEN]) -> Self {
        Self::client_with(ours, limits, psk, nonce, Resumption::Off)
    }

    /// [`Handshake::client`] carrying a session field: a resumable session offered, or the
    /// resume of one. The server's answer says whether it agreed
    /// ([`Handshake::resumable`]); a resume it cannot serve is rejected
    /// ([`Reject::UnknownSession`]).
    pub fn client_with(
        ours: Hello,
        limits: Limits,
        psk: Option<Psk>,
        nonce: [u8; NONCE_LEN],
        session: Resumption,
    ) -> Self {
        let mut hs = Self::new(State::ServerHello, ours, limits, psk, nonce);
        hs.session = session;
        let mut hello = [0u8; CLIENT_HELLO_LEN];
        hello[..HELLO_LEN].copy_from_slice(&ours.encode(CLIENT_HELLO, hs.flags()));
        hello[HELLO_LEN..SIGNED_LEN].copy_from_slice(&nonce);
        hello[SIGNED_LEN..].copy_from_slice(&session.encode());
        hs.transcript.extend_from_slice(&hello);
        hs.out.extend_from_slice(&hello);
        hs
    }

    /// The accepting side, announcing `ours` (its address is ignored: the queue pair is
    /// created only once the client passed, see [`Action::Connect`]); `nonce` must be fresh
    /// random bytes.
    pub fn server(ours: Hello, limits: Limits, psk: Option<Psk>, nonce: [u8; NONCE_LEN]) -> Self {
        Self::new(State::ClientHello, ours, limits, psk, nonce)
    }

    /// This server makes sessions resumable when a client offers one, and serves resumes
    /// (its driver checks the token: [`Handshake::session`]).
    pub fn resuming(mut self, on: bool) -> Self {
        self.resumable = on;
        self
    }

    /// The client's session field (on the server, once the client hello is in; on the
    /// client, what it asked).
    pub fn session(&self) -> Resumption {
        self.session
    }

    /// Whether the connection carries a resumable session: the client offered or asked to
    /// resume one and the server agreed (known to the client once the server hello is in).
    pub fn resumable(&self) -> bool {
        self.resumable && self.session != Resumption::Off
    }

    fn new(
        state: State,
        ours: Hello,
        limits: Limits,
        psk: Option<Psk>,
        nonce: [u8; NONCE_LEN],
    ) -> Self {
        Self {
            is_server: state == State::ClientHello,
            state,
            ours,
            limits,
            psk,
            nonce,
            peer: None,
            send_buffers: 0,
            transcript: Vec::with_capacity(CLIENT_HELLO_LEN + SERVER_HELLO_LEN + MAC_LEN),
            inbuf: [0; SERVER_HELLO_LEN],
            have: 0,
            out: Vec::new(),
            action: None,
            session: Resumption::Off,
            resumable: false,
        }
    }

    fn flags(&self) -> u8 {
        if self.psk.is_some() {
            FLAG_PSK
        } else {
            0
        }
    }

    /// Bytes to send to the peer.
    pub fn output(&self) -> &[u8] {
        &self.out
    }

    /// Marks the first `n` bytes of [`output`](Self::output) as sent.
    pub fn consume_output(&mut self, n: usize) {
        self.out.drain(..n.min(self.out.len()));
    }

    /// What the driver must do now, if anything (returned once).
    pub fn poll_action(&mut self) -> Option<Action> {
        self.action.take()
    }

    /// Whether the handshake completed: both queue pairs are connected.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Whether the handshake failed (an error was returned).
    pub fn is_failed(&self) -> bool {
        self.state == State::Failed
    }

    /// The peer's hello once it passed our checks (on the client its address is all zero
    /// until the server's address arrived).
    pub fn peer(&self) -> Option<&Hello> {
        self.peer.as_ref()
    }

    /// Bytes the machine needs to make progress: read at most this many from the peer.
    /// 0 while it waits for output to be sent, for the driver, or is finished.
    pub fn wanted(&self) -> usize {
        let (checkpoint, total) = match self.state {
            State::ClientHello => (HEADER_LEN, CLIENT_HELLO_LEN),
            State::ServerHello => (HEADER_LEN, SERVER_HELLO_LEN),
            State::Proof => (1, PROOF_LEN),
            State::Address => (1, ADDRESS_LEN),
            State::Ready => (1, 1),
            State::Connecting | State::Done | State::Failed => return 0,
        };
        if self.have < checkpoint {
            checkpoint - self.have
        } else {
            total - self.have
        }
    }

    /// What the machine is waiting for, for error messages.
    pub fn stage(&self) -> &'static str {
        match self.state {
            State::ClientHello => "reading the client's hello",
            State::ServerHello => "reading the server's hello",
            State::Proof => "reading the client's verdict",
            State::Address => "reading the server's address",
            State::Connecting => "connecting the queue pair",
            State::Ready => "waiting for the client's ready",
            State::Done => "done",
            State::Failed => "failed",
        }
    }

    /// Takes bytes from the peer; returns how many were used (never more than
    /// [`wanted`](Self::wanted) allowed, so bytes past the handshake are left alone).
    /// An error ends the handshake: [`Error::BadHandshake`] when we reject the peer (the
    /// reject code is queued for output), [`Error::Rejected`] when the peer rejected us.
    pub fn feed(&mut self, mut input: &[u8]) -> Result<usize, Error> {
        let mut used = 0;
        loop {
            let want = self.wanted();
            if want == 0 || input.is_empty() {
                return Ok(used);
            }
            let n = want.min(input.len());
            self.inbuf[self.have..self.have + n].copy_from_slice(&input[..n]);
            self.have += n;
            used += n;
            input = &input[n..];
            if n == want {
                if let Err(f) = self.step() {
                    let e = match f {
                        Fail::Ours(r) => {
                            self.tell(r);
                            Error::BadHandshake(r)
                        }
                        Fail::Theirs(r) => Error::Rejected(r),
                    };
                    self.state = State::Failed;
                    return Err(e);
                }
            }
        }
    }

    /// The local queue pair is connected to the peer (in RTS, its send buffers registered);
    /// `local` is its address. Queues our "ready".
    pub fn local_ready(&mut self, local: QpAddress) {
        if self.state != State::Connecting {
            return;
        }
        if self.is_server {
            self.ours.addr = local;
            let addr = encode_addr(&local);
            let mac = match &self.psk {
                Some(k) => k.mac(LABEL_FINISH, &[&self.transcript, &addr]),
                None => [0; MAC_LEN],
            };
            self.out.push(READY);
            self.out.extend_from_slice(&addr);
            self.out.extend_from_slice(&mac);
            self.state = State::Ready;
            self.have = 0;
        } else {
            self.out.push(READY);
            self.state = State::Done;
        }
    }

    /// Setting up the local side failed: tells the peer `reason` (typically
    /// [`Reject::Resources`]) and ends the handshake.
    pub fn abort(&mut self, reason: Reject) {
        if !matches!(self.state, State::Done | State::Failed) {
            self.tell(reason);
            self.state = State::Failed;
        }
    }

    /// Queues a reject code where the peer expects our next message.
    fn tell(&mut self, r: Reject) {
        if self.state == State::ClientHello {
            // The server's first answer is a header; pad it to a whole hello so that a
            // version 1 client, which reads 52 bytes, sees the version.
            let mut reply = [0u8; HELLO_LEN];
            reply[..HEADER_LEN].copy_from_slice(&header(r.code(), self.flags()));
            self.out.extend_from_slice(&reply);
        } else {
            self.out.push(r.code());
        }
    }
}

mod steps;
#[cfg(test)]
mod tests;
