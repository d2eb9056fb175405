//! Making communicators: every rank of one process at once (`ncclCommInitAll`), or one rank of
//! a job of one process per GPU from rank 0's unique id (`ncclCommInitRankConfig`,
//! non-blocking, its setup polled until a deadline).

use std::ffi::{c_char, c_int};
use std::ptr;
use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use graft_core::DeviceError;

use super::status::{LAZY_CONNECT, OP};
use super::{NcclComm, one_shot};
use crate::device::CudaDevice;
use crate::driver::nccl::{self as dn, MISSING};

/// The bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `NCCL_CONFIG_UNDEF_INT`: a config field left to NCCL's default.
const UNDEF: c_int = c_int::MIN;

/// The `NCCL_VERSION` code of the header cudarc's `ncclConfig_t` layout comes from (its `nccl`
/// feature binds NCCL 2.30). A library of another version reads the struct by its `size`
/// field, copying at most its own struct's size, so an older libnccl ignores the fields it
/// does not know and a newer one keeps its defaults for the fields this struct lacks.
const CONFIG_VERSION: u32 = 2 * 10000 + 30 * 100;

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every other field undefined, so NCCL picks.
fn non_blocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Refuses to start without libnccl, or with NCCL's lazy connection on.
fn ready() -> Result<(), DeviceError> {
    if !dn::present() {
        return Err(DeviceError::Unavailable {
            op: OP,
            what: MISSING,
        });
    }
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none_or(|v| v != "0") {
        return Err(DeviceError::Unavailable {
            op: OP,
            what: LAZY_CONNECT,
        });
    }
    Ok(())
}

fn as_c_int(n: usize, what: &'static str) -> Result<c_int, DeviceError> {
    c_int::try_from(n).map_err(|_| DeviceError::InvalidArgument { op: OP, what })
}

impl NcclComm {
    /// One communicator per device, rank `i` on `devices[i]` (`ncclCommInitAll`): every
    /// device must be a different GPU of this process. Where every pair of the devices
    /// reaches each other's memory, peer access is enabled between their contexts (and left
    /// on) for the one-shot all-reduce of small messages.
    ///
    /// Requires `NCCL_RUNTIME_CONNECT=0` in the environment (NCCL then connects the ranks
    /// here, at init, not lazily inside the first collective of each kind): with lazy
    /// connection, enqueuing a collective waits on the host for the other ranks to enqueue
    /// theirs, so one rank failing a recording before its all-reduce would leave the others
    /// stuck in their capture, where no vote can reach them.
    pub fn init_all(devices: &[CudaDevice]) -> Result<Vec<NcclComm>, DeviceError> {
        ready()?;
        let mut ordinals: Vec<c_int> = Vec::with_capacity(devices.len());
        for d in devices {
            let ordinal = as_c_int(d.ordinal(), "a device ordinal exceeds i32::MAX")?;
            if ordinals.contains(&ordinal) {
                return Err(DeviceError::InvalidArgument {
                    op: OP,
                    what: "two ranks on one GPU; give each rank its own device",
                });
            }
            ordinals.push(ordinal);
        }
        let comms = dn::init_all(&ordinals)?;
        let mut comms: Vec<NcclComm> = comms
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (comm, d))| NcclComm {
                comm: Mutex::new(comm),
                queue: (**d).clone(),
                rank,
                world: devices.len(),
                deadline: None,
                one_shot: None,
                one_shot_limit: AtomicUsize::new(0),
                one_shot_off: None,
            })
            .collect();
        one_shot::enable_all(&mut comms);
        Ok(comms)
    }

    /// A new unique id (`ncclGetUniqueId`), made by rank 0 of a job and sent to the others
    /// (graft's [`Rendezvous::broadcast`](graft_launch::Rendezvous::broadcast)) before they all
    /// call [`NcclComm::init_rank`] with it.
    pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], DeviceError> {
        if !dn::present() {
            return Err(DeviceError::Unavailable {
                op: OP,
                what: MISSING,
            });
        }
        let id = dn::unique_id()?;
        Ok(id.internal.map(|b| b as u8))
    }

    /// Rank `rank`'s communicator of a job of `world` ranks (one process per GPU), on `device`,
    /// from rank 0's [`NcclComm::unique_id`]. Non-blocking (`ncclCommInitRankConfig` with
    /// `blocking = 0`): the setup, which waits for every rank, is polled at most `deadline`,
    /// after which the communicator is aborted and the error returned is
    /// [`DeviceError::CollectiveUnanswered`]. Every later operation on it is bounded by the same
    /// deadline. Requires `NCCL_RUNTIME_CONNECT=0`, as [`NcclComm::init_all`] does.
    ///
    /// Once NCCL is up, the ranks set up the one-shot all-reduce of small messages over the
    /// communicator itself (two or three tiny all-reduces within the same deadline): each
    /// sends its GPU's UUID and its workspace's CUDA IPC handle, opens its peers' where their
    /// GPUs are visible and reach each other, and all agree on whether the path is on.
    pub fn init_rank(
        device: &CudaDevice,
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world: usize,
        deadline: Duration,
    ) -> Result<NcclComm, DeviceError> {
        ready()?;
        if rank >= world {
            return Err(DeviceError::InvalidArgument {
                op: OP,
                what: "the rank is not below the world size",
            });
        }
        let n = as_c_int(world, "the world size exceeds i32::MAX")?;
        let r = as_c_int(rank, "the rank exceeds i32::MAX")?;
        let start = Instant::now();
        // NCCL binds the communicator to the current device (cudaGetDevice), which follows the
        // current context: this device's primary context.
        device.inner.make_current(OP)?;
        let unique = sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut config = non_blocking_config();
        let (handle, started) = dn::init_rank(unique, r, n, &mut config);
        if handle.is_null()
            && let Err(e) = started
        {
            // No handle: nothing to abort or release.
            return Err(e);
        }
        let mut comm = NcclComm {
            comm: Mutex::new(handle),
            queue: (**device).clone(),
            rank,
            world,
            deadline: Some(deadline),
            one_shot: None,
            one_shot_limit: AtomicUsize::new(0),
            one_shot_off: None,
        };
        if let Err(e) = started {
            // A handle NCCL made before failing is aborted.
            comm.abort_after_failure();
            return Err(e);
        }
        comm.settle_or_abort(start, start + deadline)?;
        // Every rank, at the same point: the one-shot path's setup exchanges over NCCL.
        one_shot::enable_rank(&mut comm, start, start + deadline)?;
        tracing::debug!(rank, world, waited = ?start.elapsed(), "NCCL communicator ready");
        Ok(comm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_nccls_initializer_with_blocking_off() {
        let c = non_blocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 23000, 0));
        assert!(c.netName.is_null() && c.commName.is_null());
        for field in [
            c.cgaClusterSize,
            c.minCTAs,
            c.maxCTAs,
            c.splitShare,
            c.maxP2pPeers,
        ] {
            assert_eq!(field, i32::MIN);
        }
    }
}
