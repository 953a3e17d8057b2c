//! Peers: whether arenas map their chunks for the other GPUs, and the
//! grant every arena gets once a second GPU is in use (`PeerMode::Auto`).

use super::*;

/// Set once the process allocates on a second GPU (`PeerMode::Auto`).
static SECOND_GPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether arenas made now map their chunks for the peers.
pub(super) fn peers_on() -> bool {
    match Settings::get().peers {
        PeerMode::Always => true,
        PeerMode::Never => false,
        PeerMode::Auto => SECOND_GPU.load(std::sync::atomic::Ordering::SeqCst),
    }
}

/// Device `new`, a second one, has just been made (`PeerMode::Auto`; its
/// caller holds its lock): every arena of every other device grants its
/// peers access, and arenas made from now on map for them (the flag is set
/// before the arenas are visited, each under its device's lock, so an
/// arena made meanwhile is either visited or reads the flag; `new` has no
/// arena yet). A failure is logged, not returned: the allocation that made
/// the device does not depend on it, and the arena maps its later chunks
/// for the peers all the same.
pub(super) fn grant_peers_everywhere(new: c_int) {
    if SECOND_GPU.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    // The other devices' contexts are bound here: the caller's comes back
    // (the allocation's own guard may not have read it).
    let _keep = vmmbuf::cuda::KeepCurrentContext::new().ok();
    for (dev, d) in all_devices().into_iter().filter(|(k, _)| *k != new) {
        let d = d.lock();
        for (tag, a) in d.arenas.iter() {
            match a.grant_peer_access() {
                Ok(n) => {
                    tracing::debug!(dev, tag = %tag, chunks = n, "vmmbuf-torch: a second GPU is in use; peers granted access")
                }
                Err(e) => {
                    tracing::warn!(dev, tag = %tag, error = %e, "vmmbuf-torch: granting the peers access failed; copies from another GPU may fail")
                }
            }
        }
    }
}
