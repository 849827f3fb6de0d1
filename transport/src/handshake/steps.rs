//! The handshake machine's steps: what each message it waits for does when it is complete.

use super::*;

impl Handshake {
    /// Takes the message the state waits for, once it is all in.
    pub(super) fn step(&mut self) -> Result<(), Fail> {
        match self.state {
            State::ClientHello => self.on_client_hello(),
            State::ServerHello => self.on_server_hello(),
            State::Proof => self.on_proof(),
            State::Address => self.on_address(),
            State::Ready => self.on_ready(),
            State::Connecting | State::Done | State::Failed => Ok(()),
        }
    }

    fn on_client_hello(&mut self) -> Result<(), Fail> {
        let (version, kind, flags) = self.header()?;
        if kind != CLIENT_HELLO {
            return Err(Fail::Ours(Reject::BadValue("message kind")));
        }
        if self.have < CLIENT_HELLO_LEN {
            return Ok(());
        }
        let peer = self.peer_hello(version, flags)?;
        self.session =
            Resumption::decode(&self.inbuf[SIGNED_LEN..CLIENT_HELLO_LEN]).map_err(Fail::Ours)?;
        self.transcript
            .extend_from_slice(&self.inbuf[..CLIENT_HELLO_LEN]);
        let mut answer = [0u8; SERVER_HELLO_LEN];
        let mut ours = self.ours;
        ours.addr = QpAddress {
            lid: 0,
            qpn: 0,
            psn: 0,
            gid: Gid([0; 16]),
        };
        let flags = self.flags() | if self.resumable() { FLAG_RESUMABLE } else { 0 };
        answer[..HELLO_LEN].copy_from_slice(&ours.encode(ACCEPT, flags));
        answer[HELLO_LEN..SIGNED_LEN].copy_from_slice(&self.nonce);
        if let Some(k) = &self.psk {
            let mac = k.mac(LABEL_SERVER, &[&self.transcript, &answer[..SIGNED_LEN]]);
            answer[SIGNED_LEN..].copy_from_slice(&mac);
        }
        self.transcript.extend_from_slice(&answer);
        self.out.extend_from_slice(&answer);
        self.peer = Some(peer);
        self.state = State::Proof;
        self.have = 0;
        Ok(())
    }

    fn on_server_hello(&mut self) -> Result<(), Fail> {
        let (version, kind, flags) = self.header()?;
        if kind != ACCEPT {
            return Err(theirs(kind));
        }
        if self.have < SERVER_HELLO_LEN {
            return Ok(());
        }
        let peer = self.peer_hello(version, flags)?;
        let (signed, tag) = self.inbuf.split_at(SIGNED_LEN);
        self.check_mac(LABEL_SERVER, &[&self.transcript, signed], tag)?;
        self.resumable = flags & FLAG_RESUMABLE != 0;
        if matches!(self.session, Resumption::Resume(_)) && !self.resumable {
            // A server that resumes nothing has no such session (it is told, and stops).
            return Err(Fail::Ours(Reject::UnknownSession));
        }
        self.transcript.extend_from_slice(&self.inbuf);
        let mac = match &self.psk {
            Some(k) => k.mac(LABEL_CLIENT, &[&self.transcript]),
            None => [0; MAC_LEN],
        };
        self.transcript.extend_from_slice(&mac);
        self.out.push(ACCEPT);
        self.out.extend_from_slice(&mac);
        self.peer = Some(peer);
        self.state = State::Address;
        self.have = 0;
        Ok(())
    }

    fn on_proof(&mut self) -> Result<(), Fail> {
        if !self.verdict(ACCEPT, PROOF_LEN)? {
            return Ok(());
        }
        self.check_mac(LABEL_CLIENT, &[&self.transcript], &self.inbuf[1..PROOF_LEN])?;
        self.transcript.extend_from_slice(&self.inbuf[1..PROOF_LEN]);
        let peer = self.peer.expect("checked with the client hello");
        self.connect(peer);
        Ok(())
    }

    fn on_address(&mut self) -> Result<(), Fail> {
        if !self.verdict(READY, ADDRESS_LEN)? {
            return Ok(());
        }
        let addr = &self.inbuf[1..1 + ADDR_LEN];
        self.check_mac(
            LABEL_FINISH,
            &[&self.transcript, addr],
            &self.inbuf[1 + ADDR_LEN..ADDRESS_LEN],
        )?;
        let mut peer = self.peer.expect("checked with the server hello");
        peer.addr = decode_addr(addr);
        peer.check().map_err(Fail::Ours)?;
        self.peer = Some(peer);
        self.connect(peer);
        Ok(())
    }

    fn on_ready(&mut self) -> Result<(), Fail> {
        if self.verdict(READY, 1)? {
            self.state = State::Done;
        }
        Ok(())
    }

    /// The peer's hello: its key flag must match ours, its settings ours and our limits
    /// (which fix how many send buffers we register for it).
    fn peer_hello(&mut self, version: u16, flags: u8) -> Result<Hello, Fail> {
        let peer =
            Hello::decode_body(version, &self.inbuf[HEADER_LEN..HELLO_LEN]).map_err(Fail::Ours)?;
        if (flags & FLAG_PSK != 0) != self.psk.is_some() {
            return Err(Fail::Ours(Reject::KeyMissing));
        }
        self.ours.check_peer(&peer).map_err(Fail::Ours)?;
        self.send_buffers = self.limits.check(&peer).map_err(Fail::Ours)?;
        Ok(peer)
    }

    /// The handshake is through: the queue pair to `peer` is to be connected.
    fn connect(&mut self, peer: Hello) {
        self.action = Some(Action::Connect {
            peer,
            send_buffers: self.send_buffers,
        });
        self.state = State::Connecting;
        self.have = 0;
    }

    /// The header of a hello: its version must be ours.
    fn header(&self) -> Result<(u16, u8, u8), Fail> {
        let (version, kind, flags) = parse_header(&self.inbuf[..HEADER_LEN]).map_err(Fail::Ours)?;
        if version != VERSION {
            return Err(Fail::Ours(Reject::Version {
                peer: version,
                ours: VERSION,
            }));
        }
        Ok((version, kind, flags))
    }

    /// A message that opens with the peer's verdict: `expected`, or the peer's rejection;
    /// whether all `len` bytes of it are in.
    fn verdict(&self, expected: u8, len: usize) -> Result<bool, Fail> {
        match self.inbuf[0] {
            v if v == expected => Ok(self.have >= len),
            v => Err(theirs(v)),
        }
    }

    /// With a pre-shared key, `tag` must be its MAC over `parts` under `label`.
    fn check_mac(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> Result<(), Fail> {
        match &self.psk {
            Some(k) if !k.verify(label, parts, tag) => Err(Fail::Ours(Reject::BadKey)),
            _ => Ok(()),
        }
    }
}

/// The peer's rejection, coded `code`.
fn theirs(code: u8) -> Fail {
    Fail::Theirs(Reject::from_code(code).unwrap_or(Reject::Unknown(code)))
}
