//! Connecting two queue pairs of one device to each other, for single-host tests and demos.

use crate::device::{Context, LinkLayer};
use crate::error::{Error, Result};
use crate::qp::{QueuePair, RemoteAddress, RtrAttr, RtsAttr};

/// Connects `a` and `b`, RC queue pairs in RESET or INIT on `ctx`, to each other through
/// `port`: INIT → RTR → RTS on both, with the port's active MTU and, on RoCE, its RoCE v2 IPv4
/// GID. Queue pairs still in RESET are moved to INIT here; to have receives posted before the
/// peer can send, call [`QueuePair::to_init`] and post them first.
pub fn connect_loopback(
    ctx: &Context,
    port: u8,
    a: &mut QueuePair,
    b: &mut QueuePair,
) -> Result<()> {
    let attr = ctx.query_port(port)?;
    let (gid, sgid_index) = if attr.link_layer == LinkLayer::Ethernet {
        let (index, gid) = ctx.pick_roce_v2_ipv4_gid(port)?;
        let index = u8::try_from(index)
            .map_err(|_| Error::InvalidArgument(format!("GID index {index} above 255")))?;
        (Some(gid), index)
    } else {
        (None, 0)
    };
    let remote = RemoteAddress {
        lid: attr.lid,
        gid,
        sgid_index,
        sl: 0,
        port,
    };
    const PSN_A: u32 = 0x1a2b3c;
    const PSN_B: u32 = 0x4d5e6f;
    for qp in [&mut *a, &mut *b] {
        if qp.state() == crate::QpState::Reset {
            qp.to_init(port)?;
        }
    }
    a.to_rtr(&RtrAttr::new(b.qp_num(), PSN_B, attr.active_mtu, remote))?;
    b.to_rtr(&RtrAttr::new(a.qp_num(), PSN_A, attr.active_mtu, remote))?;
    a.to_rts(&RtsAttr::new(PSN_A))?;
    b.to_rts(&RtsAttr::new(PSN_B))?;
    Ok(())
}
