//! What a [`crate::Session`] keeps for its connection and a [`crate::Hub`] keeps for each of
//! its peers: the sending side (sequence, solicitation policy, encoding and fragmenting) and
//! the receiving side (decoder), written once over a [`PeerIo`] so that both drive the same code.
//! `link` is where frames go, `send` the sending side, `receive` the receiving side,
//! `machine` the three a front end holds per peer (with the outbox) and the sequences that
//! join them, `table` a hub's per-peer state.

mod budget;
mod close;
mod config;
mod lend;
mod link;
mod machine;
mod outbox;
mod receive;
mod record;
mod send;
mod table;
#[cfg(test)]
mod tests;

pub(crate) use budget::ReassemblyBudget;
pub(crate) use close::Closing;
pub use config::{
    SessionConfig, SessionStats, DEFAULT_REASSEMBLY_TIMEOUT, DEFAULT_RENDEZVOUS_THRESHOLD,
};
pub(crate) use link::*;
pub(crate) use machine::PeerMachine;
#[cfg(test)]
use machine::{exchange_acks, stats, took};
pub use outbox::OutboxStats;
pub(crate) use outbox::{encoded_len, CallRequest, Outbox, Outgoing, Owned};
pub(crate) use receive::*;
pub use record::Delivery;
pub(crate) use record::*;
pub(crate) use send::*;
pub(crate) use table::*;
