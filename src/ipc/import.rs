//! The importer's side of a shared buffer: [`SharedBuffer`]. A generation
//! is validated first (`wire::validate`, no effect), then applied in named
//! steps: import the fresh chunks, swap the mappings (undone on error),
//! commit.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use super::socket::{recv_generation, Generation};
use super::wire::{validate, Held, Plan};
use super::ChunkHandle;
use crate::backend::{Backend, Uses};
use crate::error::{Error, Result};
use crate::location::Grants;
use crate::location::{Access, AccessDesc, Location};
use crate::region::{NewChunk, Region};

/// A buffer another process shares: the importer's side.
///
/// [`import`](Self::import) receives the exporter's first generation over
/// a Unix socket, reserves an address range of the same size and maps every
/// chunk at its own offset, with access for this backend's device (and the
/// host, for chunks in host memory). [`sync`](Self::sync) follows the
/// exporter's growth. Offsets mean the same bytes in both processes; the base
/// address is this process's own.
///
/// All or nothing: a failed import or sync maps nothing new and unmaps
/// nothing; the descriptors received are closed. Kernels that read the
/// buffer by address must be recorded ([`record_use`](Self::record_use))
/// before a sync or drop unmaps what they read.
pub struct SharedBuffer<B: Backend> {
    backend: Arc<B>,
    socket: UnixStream,
    /// The reservation, the chunks mapped in it, poison and quarantine.
    region: Region<B>,
    /// The exporter's chunk id at each offset.
    ids: BTreeMap<usize, u64>,
    base: u64,
    reserved: usize,
    granularity: usize,
    generation: u64,
    grants: Vec<AccessDesc>,
    uses: Uses<B::Fence>,
}

impl<B: Backend> std::fmt::Debug for SharedBuffer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("base", &format_args!("{:#x}", self.base))
            .field("generation", &self.generation)
            .field("len", &self.region.table.len())
            .field("chunks", &self.region.table.chunk_count())
            .finish()
    }
}

impl<B: Backend> SharedBuffer<B> {
    /// Receives the exporter's next generation on `socket` and maps it in a
    /// reservation of its own, granting `access` to this backend's device
    /// (and to the host for host-placed chunks).
    ///
    /// Errors: [`Error::PeerGone`], [`Error::Protocol`] (including a chunk
    /// placed on a GPU this device cannot reach), driver errors; nothing
    /// stays mapped and no descriptor stays open.
    pub fn import(backend: Arc<B>, socket: UnixStream, access: Access) -> Result<Self> {
        let gen = recv_generation(&socket)?;
        let reserved = gen.head.reserved as usize;
        let granularity = gen.head.granularity as usize;
        let home = backend.home();
        let g = backend.granularity(home)?;
        if granularity == 0
            || !granularity.is_power_of_two()
            || !granularity.is_multiple_of(g)
            || reserved == 0
            || !reserved.is_multiple_of(granularity)
        {
            return Err(Error::protocol(format!(
                "reservation {reserved} at granularity {granularity} (this device's is {g})"
            )));
        }
        let region = Region::reserve(&backend, reserved, granularity, g)?;
        let base = region.base();
        let mut grants = vec![AccessDesc::new(home, access)];
        if home != Location::Host {
            grants.push(AccessDesc::new(Location::Host, access));
        }
        let mut this = Self {
            backend,
            socket,
            region,
            ids: BTreeMap::new(),
            base,
            reserved,
            granularity,
            generation: 0,
            grants,
            uses: Uses::default(),
        };
        this.apply(gen)?;
        Ok(this)
    }

    /// Waits for the exporter's next generation and applies it: maps the
    /// chunks that are new, unmaps those the exporter gave up (after the
    /// recorded uses), and takes the new length. Returns the generation.
    ///
    /// Errors: [`Error::PeerGone`] when the exporter is gone,
    /// [`Error::StaleGeneration`] for a generation not past this one,
    /// [`Error::Protocol`] for anything malformed; the buffer is as before.
    pub fn sync(&mut self) -> Result<u64> {
        self.check_poison()?;
        let gen = recv_generation(&self.socket)?;
        self.apply(gen)?;
        Ok(self.generation)
    }

    fn check_poison(&self) -> Result<()> {
        self.region.check_poison()
    }

    /// Checks a generation against what is held, imports its fresh chunks,
    /// then swaps the mappings: all or nothing.
    fn apply(&mut self, gen: Generation) -> Result<()> {
        let backend = &*self.backend;
        let held = Held {
            generation: self.generation,
            reserved: self.reserved,
            granularity: self.granularity,
            ids: &self.ids,
        };
        let plan = validate(
            &gen.head,
            &gen.records,
            &held,
            |place| backend.granularity(place),
            |place| match (place, backend.home()) {
                (Location::Device(d), Location::Device(me)) if d != me => {
                    backend.can_access_peer(me, d)
                }
                _ => Ok(true),
            },
        )?;
        let fresh = self.import_fresh(gen, &plan)?;
        if !plan.gone.is_empty() {
            // What goes may still be read by recorded work. On error the
            // imported chunks drop, closing their handles.
            self.wait_uses()?;
        }
        self.swap_mappings(&plan, fresh)?;
        self.generation = plan.generation;
        tracing::debug!(
            generation = plan.generation,
            chunks = self.region.table.chunk_count(),
            "vmmbuf: synced"
        );
        Ok(())
    }

    /// Step 1: every fresh chunk of the plan, imported from its descriptor.
    /// Failing here changes nothing (the descriptors and the chunks imported
    /// so far close as they drop).
    fn import_fresh(&self, mut gen: Generation, plan: &Plan) -> Result<Vec<B::Chunk>> {
        plan.fresh
            .iter()
            .map(|f| {
                let handle = match gen.fds.remove(&f.index) {
                    Some(fd) => ChunkHandle::PosixFd(fd),
                    None => ChunkHandle::Fabric(gen.fabric.remove(&f.index).expect(
                        "a descriptor or a fabric handle per fresh record (checked on receipt)",
                    )),
                };
                self.backend.import_handle(handle, f.bytes, f.placement)
            })
            .collect()
    }

    /// Step 2: unmaps what goes, maps and grants what comes, sets the
    /// length; undone on error (an undo that fails poisons the buffer and
    /// quarantines the chunks that may still be mapped).
    fn swap_mappings(&mut self, plan: &Plan, fresh: Vec<B::Chunk>) -> Result<()> {
        let backend = self.backend.clone();
        let grants = &self.grants;
        // The table keeps chunks in use; the new length is set at the end.
        let old_len = self.region.table.len();
        self.region
            .table
            .set_len(0)
            .expect("0 is always a valid length");
        let fresh: Vec<(usize, NewChunk<B::Chunk>)> = plan
            .fresh
            .iter()
            .zip(fresh)
            .map(|(f, chunk)| {
                let c = NewChunk {
                    chunk,
                    bytes: f.bytes,
                    placement: f.placement,
                };
                (f.offset, c)
            })
            .collect();
        let grants = Grants::new(grants, true).recording_driver_lists();
        let swapped = self.region.swap(&plan.gone, fresh, &grants);
        let removed = match swapped {
            Ok(removed) => removed,
            Err((e, back)) => {
                self.region
                    .table
                    .set_len(old_len)
                    .expect("the old chunks are back");
                for c in back {
                    let _ = backend.release(c.chunk);
                }
                return Err(e);
            }
        };
        // Step 3: commit (what went first: a fresh chunk may take the
        // offset of one that went).
        for (o, entry) in removed {
            self.ids.remove(&o);
            let _ = backend.release(entry.chunk);
        }
        for f in &plan.fresh {
            self.ids.insert(f.offset, f.id);
        }
        self.region
            .table
            .set_len(plan.len)
            .expect("validated: the length lies within the chunks from offset 0");
        Ok(())
    }

    fn wait_uses(&self) -> Result<()> {
        self.uses.each(|f| self.backend.wait(f))
    }

    /// Records work that reads the buffer by address (a kernel on a stream):
    /// a sync that unmaps, and drop, wait for it first.
    pub fn record_use(&self, fence: B::Fence) {
        self.uses.put(self.backend.fence_key(&fence), fence);
    }

    /// This process's address of offset 0.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The exporter's length (bytes in use) as of the last generation.
    pub fn len(&self) -> usize {
        self.region.table.len()
    }

    /// True when the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes mapped here.
    pub fn capacity(&self) -> usize {
        self.region.table.mapped_bytes()
    }

    /// The size of the reservation (the exporter's).
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// The generation held.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Chunks mapped here.
    pub fn chunk_count(&self) -> usize {
        self.region.table.chunk_count()
    }

    /// The backend this buffer is mapped in.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The socket, e.g. to answer the exporter.
    pub fn socket(&self) -> &UnixStream {
        &self.socket
    }

    /// Copies `dst.len()` bytes in use from `offset` into `dst` (after the
    /// recorded uses). The exporter may be writing meanwhile: the bytes are
    /// what the memory held when copied.
    pub fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_poison()?;
        self.region.table.check_in_use(offset, dst.len())?;
        self.wait_uses()?;
        let res = self.region.res_ref();
        self.backend.read(res, offset, dst)
    }

    /// Copies `src` into the bytes in use from `offset`: the exporter's
    /// memory itself, which it reads at the same offset. Needs the buffer
    /// imported with [`Access::ReadWrite`] (else [`Error::InvalidArgument`],
    /// nothing written); waits for the recorded uses first.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_poison()?;
        if self.grants[0].access != Access::ReadWrite {
            return Err(Error::invalid(
                "writing a shared buffer imported without Access::ReadWrite",
            ));
        }
        self.region.table.check_in_use(offset, src.len())?;
        self.wait_uses()?;
        let res = self.region.res();
        self.backend.write(res, offset, src)
    }
}

impl<B: Backend> Drop for SharedBuffer<B> {
    fn drop(&mut self) {
        // Unmapped by hand only once every recorded use has passed; else the
        // reservation's token unmaps as it drops (the CUDA backend waits for
        // the device first). Chunks go back to the driver either way.
        let waited = self.wait_uses();
        if let Err(e) = &waited {
            tracing::error!(error = %e, "vmmbuf: waiting for a shared buffer's uses failed");
        }
        let backend = self.backend.clone();
        self.region.close(waited.is_ok(), |chunk, _, _| {
            let _ = backend.release(chunk);
        });
    }
}
