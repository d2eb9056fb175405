//! Setting the one-shot all-reduce up when a communicator is made, with every rank agreeing on
//! whether it is on (the path an all-reduce takes must be the same on every rank):
//!
//! - ranks of one process (`init_all`): every pair of devices reaches each other's memory
//!   (`cuDeviceCanAccessPeer` both ways), peer access is enabled between their contexts, and
//!   every rank's part is made; one failure anywhere turns it off for all;
//! - ranks as processes (`init_rank`): each rank makes its part and sends, over the
//!   communicator itself ([`Gather`]), whether it is ready, its GPU's UUID and its
//!   workspace's IPC handle; each then finds its peers' GPUs among its visible devices, checks
//!   that they reach each other both ways, and opens their handles; a second exchange tells
//!   every rank whether all of that worked everywhere. Only then is it on, on all ranks.
//!
//! Where it stays off, each rank says why once (`tracing::info!`) and uses NCCL only.

use std::fmt;
use std::time::Instant;

use cudarc::driver::sys;
use graft_core::{DeviceError, GroupError};

use super::super::NcclComm;
use super::super::gather::Gather;
use super::super::status::OP;
use super::kernel::{CAPACITY, MAX_WORLD};
use super::{Local, OneShot, Peers};
use crate::driver;
use crate::driver::peer::{self as dp, IPC_HANDLE_BYTES};

/// Words of one rank's part of the setup's first exchange: ready (0 or 1), the GPU's UUID
/// (2), the workspace's IPC handle (8).
pub(super) const PART: usize = 1 + 2 + IPC_HANDLE_BYTES / 8;

/// Why the one-shot path is off.
#[derive(Debug)]
enum Off {
    /// This setup cannot have it (the reason says why).
    Unsupported(String),
    /// A driver call failed.
    Failed(DeviceError),
}

impl From<DeviceError> for Off {
    fn from(e: DeviceError) -> Off {
        Off::Failed(e)
    }
}

impl fmt::Display for Off {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Off::Unsupported(why) => f.write_str(why),
            Off::Failed(e) => write!(f, "setting it up failed: {e}"),
        }
    }
}

/// What every setup needs: the peer functions in the driver, at most [`MAX_WORLD`] ranks, and
/// a device of compute capability 7.0 or later (the flags' release and acquire).
fn supported(world: usize, capability: (u32, u32)) -> Result<(), Off> {
    if !driver::has_symbols(driver::PEER_SYMBOLS) {
        return Err(Off::Unsupported(
            "libcuda lacks a peer-memory function (update the NVIDIA driver)".into(),
        ));
    }
    if world > MAX_WORLD {
        return Err(Off::Unsupported(format!(
            "{world} ranks, more than the {MAX_WORLD} it serves"
        )));
    }
    if capability.0 < 7 {
        return Err(Off::Unsupported(format!(
            "compute capability {}.{} is below 7.0",
            capability.0, capability.1
        )));
    }
    Ok(())
}

/// The one-shot path for communicators of one process, on or off for all of them.
pub(in crate::nccl) fn enable_all(comms: &mut [NcclComm]) {
    match make_all(comms) {
        Ok(shots) => {
            for (comm, shot) in comms.iter_mut().zip(shots) {
                comm.one_shot = Some(shot);
                comm.set_one_shot_limit(CAPACITY);
            }
        }
        Err(why) => {
            tracing::info!(
                world = comms.len(),
                "the one-shot all-reduce is off ({why}): every all-reduce goes through NCCL"
            );
            for comm in comms {
                comm.one_shot_off = Some(why.to_string());
            }
        }
    }
}

fn make_all(comms: &[NcclComm]) -> Result<Vec<OneShot>, Off> {
    let world = comms.len();
    for c in comms {
        supported(world, c.queue.inner.capability)?;
    }
    for (i, a) in comms.iter().enumerate() {
        for (j, b) in comms.iter().enumerate() {
            let (da, db) = (a.queue.inner.cu_device, b.queue.inner.cu_device);
            if i != j && !dp::can_access_peer(OP, da, db)? {
                return Err(Off::Unsupported(format!(
                    "GPU {} cannot reach the memory of GPU {}",
                    a.queue.inner.ordinal, b.queue.inner.ordinal
                )));
            }
        }
    }
    for (i, a) in comms.iter().enumerate() {
        a.queue.inner.make_current(OP)?;
        for (j, b) in comms.iter().enumerate() {
            if i != j {
                // `b`'s primary context is retained by its device, which `b` holds.
                dp::enable_peer_access(OP, b.queue.inner.ctx)?;
            }
        }
    }
    let locals = comms
        .iter()
        .map(|c| Local::make(&c.queue, world))
        .collect::<Result<Vec<_>, _>>()?;
    let bases: Vec<u64> = locals.iter().map(|l| l.workspace).collect();
    for l in &locals {
        l.write_table(&bases)?;
    }
    Ok(locals
        .into_iter()
        .enumerate()
        .map(|(rank, local)| OneShot {
            local,
            rank,
            peers: Peers::Direct,
        })
        .collect())
}

/// This rank's part, ready to send: the workspace &c., its GPU's UUID and the workspace's IPC
/// handle.
fn prepare(comm: &NcclComm) -> Result<(Local, [u8; 16], [u8; IPC_HANDLE_BYTES]), Off> {
    let inner = &comm.queue.inner;
    supported(comm.world, inner.capability)?;
    let local = Local::make(&comm.queue, comm.world)?;
    let uuid = dp::uuid(OP, inner.cu_device)?;
    let handle = dp::ipc_handle(OP, local.workspace)?;
    Ok((local, uuid, handle))
}

/// Little-endian words of `bytes` (a multiple of 8 long).
fn words_of(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
}

/// The bytes of `words`, little-endian.
fn bytes_of<const N: usize>(words: &[u64]) -> [u8; N] {
    let mut out = [0u8; N];
    for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// Closes the peers' workspaces opened here (no kernel used them).
fn close(comm: &NcclComm, opened: Vec<u64>) {
    for at in opened {
        // Opened by `open_peers`, closed once.
        comm.queue
            .inner
            .sticky_on_error(driver::peer::ipc_close(OP, at));
    }
}

/// A failed exchange (the communicator is aborted already) as a device error. This rank's
/// part, which a peer may have opened, is kept rather than freed under the peer's mapping.
fn failed(local: Option<Local>, e: GroupError, rank: usize) -> DeviceError {
    if let Some(mut local) = local {
        local.keep_memory();
    }
    match e {
        GroupError::Device { source, .. } => source,
        GroupError::Unanswered { waited, .. } => DeviceError::CollectiveUnanswered {
            op: OP,
            rank,
            waited,
        },
        _ => DeviceError::CollectiveAborted { op: OP },
    }
}

/// The one-shot path for rank `comm.rank` of a job of processes, on or off on every rank
/// alike; the exchanges wait at most until `deadline` (`start` is when the communicator's
/// setup began). An error (an exchange that failed or timed out, which aborts the
/// communicator) is the communicator's: the caller returns it.
pub(in crate::nccl) fn enable_rank(
    comm: &mut NcclComm,
    start: Instant,
    deadline: Instant,
) -> Result<(), DeviceError> {
    let (rank, world) = (comm.rank, comm.world);
    let gather = Gather::new(comm, world * PART)?;
    let mine = prepare(comm);
    let mut send = vec![0u64; world * PART];
    if let Ok((_, uuid, handle)) = &mine {
        let part = &mut send[rank * PART..][..PART];
        part[0] = 1;
        for (slot, w) in part[1..]
            .iter_mut()
            .zip(words_of(uuid).chain(words_of(handle)))
        {
            *slot = w;
        }
    }
    let parts = match gather.exchange(comm, &send, start, deadline) {
        Ok(parts) => parts,
        Err(e) => return Err(failed(mine.ok().map(|(local, ..)| local), e, rank)),
    };
    // Whether anyone may open a workspace: the same answer on every rank.
    let all_ready = (0..world).all(|p| parts[p * PART] == 1);
    let mut opened = Vec::new();
    // This rank's part stays made until every rank is done with it (freed last, below).
    let (local, why) = match mine {
        Ok((local, uuid, _)) => {
            let why = open_peers(comm, &parts, uuid, &local, &mut opened).err();
            (Some(local), why)
        }
        Err(why) => (None, Some(why)),
    };
    send.fill(0);
    send[rank * PART] = u64::from(why.is_none());
    let agreed = match gather.exchange(comm, &send, start, deadline) {
        Ok(agreed) => agreed,
        Err(e) => {
            close(comm, opened);
            return Err(failed(local, e, rank));
        }
    };
    let unready: Vec<usize> = (0..world).filter(|&p| agreed[p * PART] != 1).collect();
    if unready.is_empty()
        && let Some(local) = local
    {
        comm.one_shot = Some(OneShot {
            local,
            rank,
            peers: Peers::Ipc {
                opened,
                barrier: gather,
            },
        });
        comm.set_one_shot_limit(CAPACITY);
        tracing::debug!(rank, world, "the one-shot all-reduce is on");
        return Ok(());
    }
    close(comm, opened);
    if all_ready {
        // Peers may have opened this rank's workspace: every rank closes its mappings before
        // any frees its own.
        send.fill(0);
        if let Err(e) = gather.exchange(comm, &send, start, deadline) {
            return Err(failed(local, e, rank));
        }
    }
    drop(local);
    let why = match why {
        Some(why) => why.to_string(),
        None => format!("ranks {unready:?} could not set it up: see their logs"),
    };
    tracing::info!(
        rank,
        "the one-shot all-reduce is off ({why}): every all-reduce goes through NCCL"
    );
    comm.one_shot_off = Some(why);
    Ok(())
}

/// Opens every peer's workspace from `parts` (every rank's part of the first exchange) into
/// `opened` (their addresses here), after checking that all ranks are ready and that this
/// GPU and each peer's reach each other; then writes the table.
fn open_peers(
    comm: &NcclComm,
    parts: &[u64],
    uuid: [u8; 16],
    local: &Local,
    opened: &mut Vec<u64>,
) -> Result<(), Off> {
    let (rank, world) = (comm.rank, comm.world);
    let part = |p: usize| &parts[p * PART..][..PART];
    if let Some(p) = (0..world).find(|&p| part(p)[0] != 1) {
        return Err(Off::Unsupported(format!(
            "rank {p} could not make its part: see its log"
        )));
    }
    let mine = comm.queue.inner.cu_device;
    let visible = visible_devices()?;
    let mut bases = vec![0u64; world];
    bases[rank] = local.workspace;
    for p in (0..world).filter(|&p| p != rank) {
        let peer_uuid: [u8; 16] = bytes_of(&part(p)[1..3]);
        let Some(&(device, _)) = visible.iter().find(|(_, u)| *u == peer_uuid) else {
            return Err(Off::Unsupported(format!(
                "rank {p}'s GPU is not visible to this process (on another host, or hidden by CUDA_VISIBLE_DEVICES)"
            )));
        };
        if peer_uuid != uuid
            && !(dp::can_access_peer(OP, mine, device)? && dp::can_access_peer(OP, device, mine)?)
        {
            return Err(Off::Unsupported(format!(
                "this GPU and rank {p}'s cannot reach each other's memory"
            )));
        }
        let handle: [u8; IPC_HANDLE_BYTES] = bytes_of(&part(p)[3..]);
        comm.queue.inner.make_current(OP)?;
        let at = dp::ipc_open(OP, &handle)?;
        opened.push(at);
        bases[p] = at;
    }
    local.write_table(&bases)?;
    Ok(())
}

/// Every device this process sees, with its UUID.
fn visible_devices() -> Result<Vec<(sys::CUdevice, [u8; 16])>, DeviceError> {
    (0..driver::device_count()?)
        .map(|ordinal| {
            let d = driver::device::get(OP, ordinal)?;
            Ok((d, dp::uuid(OP, d)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_carries_the_uuid_and_the_handle_as_words_and_back() {
        let uuid: [u8; 16] = std::array::from_fn(|i| i as u8 * 3);
        let handle: [u8; IPC_HANDLE_BYTES] = std::array::from_fn(|i| 255 - i as u8);
        let words: Vec<u64> = words_of(&uuid).chain(words_of(&handle)).collect();
        assert_eq!(words.len(), PART - 1);
        assert_eq!(bytes_of::<16>(&words[..2]), uuid);
        assert_eq!(bytes_of::<IPC_HANDLE_BYTES>(&words[2..]), handle);
    }

    #[test]
    fn unsupported_setups_say_why() {
        let too_many = supported(MAX_WORLD + 1, (9, 0)).unwrap_err().to_string();
        // Without libcuda the driver check comes first; with one, the rank count.
        assert!(
            too_many.contains("ranks") || too_many.contains("libcuda"),
            "{too_many}"
        );
        let old = supported(2, (6, 1)).unwrap_err().to_string();
        assert!(old.contains("6.1") || old.contains("libcuda"), "{old}");
    }
}
