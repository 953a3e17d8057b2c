//! NCCL user-buffer registration of the plug-in's memory.

use super::*;

/// Keeps every device range the plug-in maps on `dev` registered with the
/// NCCL communicator `comm` (an `ncclComm_t` of the NCCL this process
/// loaded, PyTorch's unless `library` names another), from now until
/// [`nccl_deregister`]: the ranges mapped already are registered at once,
/// those mapped later when they are mapped, and each is deregistered
/// before it is unmapped (`empty_cache`, a budget, a sleep). The id of the
/// registration. The device's chunks must be NCCL-ready
/// (`VMMBUF_TORCH_NCCL_READY=1` before its first allocation). `library` is
/// used by the first registration on a device only.
///
/// # Safety
///
/// `comm` must be a live communicator of that NCCL library, and stay live
/// until [`nccl_deregister`] is called with the id returned (a communicator
/// destroyed first would be called through a dangling pointer).
pub(crate) unsafe fn nccl_register(dev: c_int, comm: usize, library: Option<&str>) -> Result<u64> {
    let d = device(dev)?;
    let mut d = d.lock();
    if !d.nccl_ready {
        return Err(Error::Unsupported {
            what: format!(
                "NCCL registration on device {dev}: its chunks were not made NCCL-ready; set VMMBUF_TORCH_NCCL_READY=1 before its first allocation"
            ),
        });
    }
    let hook = match &d.nccl {
        Some(h) => h.clone(),
        None => {
            let h = Arc::new(match library {
                Some(path) => NcclHook::open(path)?,
                None => NcclHook::loaded()?,
            });
            d.nccl = Some(h.clone());
            h
        }
    };
    // The first communicator: the hook joins every arena, which tells it
    // of each range mapped now. Refused (an arena cannot take the hook, or
    // the communicator is), no arena keeps a hook with no communicator.
    if hook.is_empty() {
        if let Err(e) = d
            .arenas
            .values()
            .try_for_each(|a| a.set_map_hook(Some(hook.clone())))
        {
            d.unhook_nccl();
            return Err(e);
        }
    }
    // SAFETY: forwarded to the caller: `comm` is live until deregistered.
    let id = unsafe { hook.add(comm as *mut c_void) };
    if hook.is_empty() {
        d.unhook_nccl();
    }
    id
}

/// Undoes every registration `nccl_register` made under `id` on `dev` and
/// stops registering with that communicator; with none left, the arenas
/// go back to having no map hook.
pub(crate) fn nccl_deregister(dev: c_int, id: u64) -> Result<()> {
    let unknown = || Error::InvalidArgument(format!("no NCCL registration {id} on device {dev}"));
    let d = existing(dev).ok_or_else(unknown)?;
    let d = d.lock();
    let hook = d.nccl.clone().ok_or_else(unknown)?;
    hook.remove(id)?;
    if hook.is_empty() {
        d.unhook_nccl();
    }
    Ok(())
}

/// Whether `[addr, addr + bytes)` on `dev` lies in one range registered
/// with every communicator `nccl_register` added there (so NCCL can use it
/// zero-copy); false with no registration.
pub(crate) fn nccl_covers(dev: c_int, addr: u64, bytes: usize) -> bool {
    let Some(d) = existing(dev) else {
        return false;
    };
    let hook = d.lock().nccl.clone();
    hook.is_some_and(|h| h.covers(addr, bytes))
}
