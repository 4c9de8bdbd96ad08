//! Identities shared by the arena and the allocator (a leaf module: it imports nothing of
//! the crate but the device and stats types).

use crate::device::StreamId;
use crate::stats::PoolKind;

/// A CUDA graph memory pool id, as PyTorch's `MempoolId_t`; (0, 0) is the default pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId(pub u64, pub u64);

impl GraphPoolId {
    pub const DEFAULT: GraphPoolId = GraphPoolId(0, 0);
}

/// What an arena serves: one stream, one pool kind, one graph pool, one page generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ArenaKey {
    pub stream: StreamId,
    pub kind: PoolKind,
    pub graph_pool: GraphPoolId,
    /// The page generation whose pages the arena maps: 0, then one more at each page-size
    /// upgrade (`page_upgrade_at`, `driver_share_upgrade`). Arenas of one generation map
    /// pages of one size only.
    pub gen: u8,
}
