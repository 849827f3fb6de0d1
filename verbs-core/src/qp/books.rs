//! The requests a queue pair posted and has not handed back, with their buffers.

use std::collections::VecDeque;

use crate::mr::Buffer;
use crate::posted::InOrder;

/// What [`QueuePair::reclaim`](super::QueuePair::reclaim) found for a completion.
#[derive(Debug)]
pub enum Reclaimed {
    /// The completion is a receive of this queue pair: its buffer.
    Recv(Buffer),
    /// The completion is a send of this queue pair: the buffers of it and of every request
    /// posted before it on the send queue (empty for inline or empty sends).
    Send(Vec<Buffer>),
    /// The completion names no request this queue pair still holds (already handed back, of
    /// another queue pair, posted outside this crate, or made up): nothing is handed back.
    Unknown,
}

/// The requests a queue pair posted and has not handed back, with their buffers. Generic over
/// the buffer type so that the bookkeeping is tested without a device.
#[derive(Debug)]
pub(super) struct Posted<B> {
    /// Receive requests in posting order.
    pub(super) recv: InOrder<B>,
    /// Send requests in posting order, so with increasing wr_ids: (wr_id, buffer, whether it
    /// is an RDMA read). Completions on one send queue arrive in order, so a completion for
    /// one of them retires it and every entry before it.
    pub(super) send: VecDeque<(u64, Option<B>, bool)>,
}

impl<B> Posted<B> {
    pub(super) fn with_capacity(send: usize, recv: usize) -> Self {
        Self {
            recv: InOrder::with_capacity(recv),
            send: VecDeque::with_capacity(send),
        }
    }

    pub(super) fn take_recv(&mut self, id: u64) -> Option<B> {
        self.recv.take(id)
    }

    /// Retires the send request `id` and every one before it into `out`; false (and nothing
    /// retired) if `id` is not a send request still held.
    pub(super) fn complete_send(&mut self, id: u64, out: &mut Vec<B>) -> bool {
        // The oldest request, when every send is signaled: a look at the front.
        if self.send.front().is_some_and(|&(k, _, _)| k == id) {
            if let Some((_, Some(b), _)) = self.send.pop_front() {
                out.push(b);
            }
            return true;
        }
        let Ok(i) = self.send.binary_search_by_key(&id, |&(k, _, _)| k) else {
            return false;
        };
        out.extend(self.send.drain(..=i).filter_map(|(_, b, _)| b));
        true
    }

    /// [`Posted::complete_send`], the buffers of reads going to `reads` with their wr_ids.
    pub(super) fn complete_split(
        &mut self,
        id: u64,
        sends: &mut Vec<B>,
        reads: &mut Vec<(u64, B)>,
    ) -> bool {
        let Ok(i) = self.send.binary_search_by_key(&id, |&(k, _, _)| k) else {
            return false;
        };
        for (k, b, read) in self.send.drain(..=i) {
            match (b, read) {
                (Some(b), true) => reads.push((k, b)),
                (Some(b), false) => sends.push(b),
                (None, _) => {}
            }
        }
        true
    }
}
