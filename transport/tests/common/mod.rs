//! Helpers shared by the transport's device-test files (each uses a part of them).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use rdmsg_transport::handshake::{Handshake, Hello, Limits, NONCE_LEN, VERSION};
use rdmsg_transport::{Endpoint, PathParams};

/// The default device's endpoint; a test without a device fails here.
pub fn endpoint() -> Endpoint {
    Endpoint::open_default().unwrap_or_else(|e| panic!("device test needs an RDMA device: {e}"))
}

/// A hello a client on `ep` could send (its queue pair address made up).
pub fn plausible_hello(ep: &Endpoint) -> Hello {
    Hello {
        version: VERSION,
        addr: rdmsg_transport::QpAddress {
            lid: 0,
            qpn: 1,
            psn: 1,
            gid: ep.gid(),
        },
        mtu: ep.path_mtu(&PathParams::default()).bytes() as u32,
        buf_size: 4096,
        recv_depth: 64,
        grant_slots: 3,
        initial_credits: 64,
        reads: 1,
        max_read: 64 << 20,
    }
}

/// The bytes of a client hello announcing `hello`, without a key.
pub fn client_hello(hello: Hello) -> Vec<u8> {
    let limits = Limits {
        max_buf_size: u32::MAX,
        max_recv_depth: u32::MAX,
        max_send_memory: u64::MAX,
        send_depth: 1,
    };
    Handshake::client(hello, limits, None, [7; NONCE_LEN])
        .output()
        .to_vec()
}

/// A client that speaks its handshake (`hello`, nonce bytes `nonce`) until the server has
/// connected its queue pair and sent its address, then stops, as one that never says
/// "ready": its stream, still open.
pub fn stalled_before_ready(addr: SocketAddr, hello: Hello, nonce: u8) -> TcpStream {
    let limits = Limits {
        max_buf_size: u32::MAX,
        max_recv_depth: u32::MAX,
        max_send_memory: u64::MAX,
        send_depth: 64,
    };
    let mut s = TcpStream::connect(addr).unwrap();
    let mut hs = Handshake::client(hello, limits, None, [nonce; NONCE_LEN]);
    let mut buf = [0u8; 512];
    loop {
        s.write_all(hs.output()).unwrap();
        let n = hs.output().len();
        hs.consume_output(n);
        if hs.poll_action().is_some() {
            return s;
        }
        let got = s.read(&mut buf[..hs.wanted().clamp(1, 512)]).unwrap();
        assert!(got > 0, "the server hung up at {}", hs.stage());
        hs.feed(&buf[..got]).unwrap();
    }
}
