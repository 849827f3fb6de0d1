//! Feeds arbitrary frames to the decoder and decodes whatever comes out: nothing may panic,
//! allocate without bound or hang. Frames are separated by the byte sequence `RDMSG|`.
//! Rendezvous descriptors and acknowledgements come out of `Decoder::take` parsed; a
//! descriptor's pieces are written back and parsed again (they must round-trip).
//! Every body decoded as a `Sample` is decoded by bincode's own serde decoder too: the two
//! must agree (the same value and length, or both refuse), unless ours stopped at its bounds.
//! Run: `cargo xtask test` fuzzes it for 60 s, growing a corpus under `target/`; `cargo xtask
//! fuzz-merge` folds that into the kept corpus (`msg/fuzz/corpus/decode`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmsg_msg::codec::{Decoded, Decoder, FrameBytes};
use rdmsg_msg::rendezvous::Descriptor;
use rdmsg_msg::{DecodeFailure, Envelope, Error, Message};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Sample {
    id: u64,
    name: String,
    values: Vec<f64>,
    nested: Option<Vec<(u8, String)>>,
}
rdmsg_msg::message!(Sample, tag = "fuzz.sample");

/// Decodes `env` as a `Sample` with rdmsg and with bincode, and checks that they agree.
fn decode_both(env: &Envelope) {
    let ours = env.decode::<Sample>();
    if env.tag() != Sample::TAG {
        return;
    }
    let body = env.body();
    // Under a limit, or a forged string length would have bincode allocate it.
    let limited = bincode::config::standard().with_limit::<{ 1 << 20 }>();
    let theirs = bincode::serde::decode_from_slice::<Sample, _>(body, limited);
    let encoded = |m: &Sample| bincode::serde::encode_to_vec(m, bincode::config::standard());
    match (&ours, &theirs) {
        (Ok(a), Ok((b, used))) => {
            assert_eq!(*used, body.len());
            assert_eq!(encoded(a).ok(), encoded(b).ok());
        }
        (
            Err(Error::Decode {
                source: DecodeFailure::Trailing(n),
                ..
            }),
            Ok((_, used)),
        ) => assert_eq!(*n, body.len() - used),
        (
            Err(Error::Decode {
                source: DecodeFailure::Bincode(_),
                ..
            }),
            Err(_),
        )
        | (
            Err(Error::Decode {
                source: DecodeFailure::TooLarge { .. } | DecodeFailure::TooDeep { .. },
                ..
            }),
            _,
        ) => {}
        _ => panic!("rdmsg: {ours:?}, bincode: {theirs:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut dec = Decoder::new(1 << 16);
    if data.len() % 2 == 1 {
        // Half the inputs with a registered type: unknown tags are then refused, fragmented
        // ones at their first fragment.
        dec.register::<Sample>().expect("one type");
    }
    let mut rest = data;
    loop {
        let (frame, next) = match rest.windows(6).position(|w| w == b"RDMSG|") {
            Some(i) => (&rest[..i], Some(&rest[i + 6..])),
            None => (rest, None),
        };
        match dec.take(FrameBytes::Owned(frame.to_vec())) {
            Ok(Decoded::Message(env)) => decode_both(&env),
            Ok(Decoded::Rendezvous {
                tag,
                seq,
                descriptor,
            }) => {
                let mut buf = vec![0u8; descriptor.encoded_len() + 20];
                let n = descriptor
                    .write_frame(tag, seq, &mut buf)
                    .expect("a parsed descriptor fits its own length");
                let again = Descriptor::parse(&buf[20..n]).expect("round-trips");
                assert_eq!(again, descriptor);
            }
            Ok(Decoded::Done(seqs)) => assert!(!seqs.is_empty()),
            Ok(Decoded::Packed(p)) => {
                // Checked whole when taken: it hands out exactly the messages it announced,
                // numbered in a row, each within the frame.
                let mut n = 0u32;
                for (seq, env) in dec.unpack(&p) {
                    assert_eq!(seq, p.last_seq().wrapping_sub(p.count() - 1).wrapping_add(n));
                    if let Ok(env) = env {
                        assert!(env.body().len() < frame.len());
                        decode_both(&env);
                    }
                    n += 1;
                }
                assert_eq!(n, p.count());
            }
            Ok(Decoded::Nothing | Decoded::Ask(_)) | Err(_) => {}
        }
        match next {
            Some(n) => rest = n,
            None => break,
        }
    }
});
